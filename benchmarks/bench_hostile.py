"""Hostile files (tests/hostile.py) through `diagnose --format json`: exit, time, peak RSS.

    python benchmarks/bench_hostile.py                       # this tree only
    python benchmarks/bench_hostile.py --before /tmp/old     # side by side with another checkout

Each run is one subprocess under an address-space cap (--memory, default 4 GiB) and a time limit
(--seconds, default 120); the peak RSS comes from os.wait4. Prints a Markdown table:
attack class | before (exit, time, peak RSS) | after. Exit 139 = SIGSEGV; "killed" = time limit.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hostile import CASES  # noqa: E402


def run(tree: Path, path: Path, memory: int, seconds: int) -> str:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "snapforensics", "diagnose", str(path),
                              "--format", "json"], env=env, stdout=subprocess.DEVNULL,
                             stderr=err, preexec_fn=cap, cwd=tree)
        killed = False
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t > seconds:
                p.send_signal(signal.SIGKILL)
                killed = True
            time.sleep(0.05)
        wall = time.perf_counter() - t
        p.returncode = code = os.waitstatus_to_exitcode(status)
        err.seek(0)
        lines = len(err.read().decode(errors="replace").strip().splitlines())
    code_s = "killed" if killed else (f"{128 - code}" if code < 0 else str(code))
    return f"exit {code_s}, {wall:.1f} s, {ru.ru_maxrss / 1024:.0f} MB, {lines} stderr lines"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="checkout of the code before the change")
    ap.add_argument("--memory", type=int, default=4 << 30)
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print("| attack | file | before | after |\n|---|---:|---|---|")
        for name in args.cases:
            path = CASES[name](Path(tmp))
            before = run(args.before, path, args.memory, args.seconds) if args.before else "-"
            after = run(ROOT, path, args.memory, args.seconds)
            print(f"| {name} | {path.stat().st_size / 1e3:.0f} kB | {before} | {after} |",
                  flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
