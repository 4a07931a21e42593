"""Hostile files (tests/hostile.py) through `diagnose --format json`, and issue 21's attacks
(tests/attacks.py: special files, cache entries, schedulers, options, through the CLI and the
API): exit, time, peak RSS, stderr lines.

    python benchmarks/bench_hostile.py                       # this tree only
    python benchmarks/bench_hostile.py --before /tmp/old     # side by side with another checkout
    python benchmarks/bench_hostile.py fifo_cached glob_fifo # some cases only

Each run is one subprocess (its own session, killed as a group at the limit) under an
address-space cap (--memory, default 4 GiB) and a time limit (--seconds, default 120); the peak
RSS comes from os.wait4 (the process and the children it waited for). Prints a Markdown table:
attack | file | before (exit, time, peak RSS, stderr lines) | after. Exit 139 = SIGSEGV;
"killed" = time limit.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from attacks import ATTACKS  # noqa: E402
from hostile import CASES  # noqa: E402


def run(tree: Path, argv: list[str], memory: int, seconds: int,
        extra_env: dict[str, str] | None = None) -> str:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = dict(os.environ, PYTHONPATH=str(tree), ATTACK_TREE=str(tree))
    env.pop("SNAPFORENSICS_EXPANSION", None)
    env.update(extra_env or {})
    with tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        p = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL, stderr=err, preexec_fn=cap, cwd=tree,
                             start_new_session=True)
        killed = False
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t > seconds and not killed:
                os.killpg(p.pid, signal.SIGKILL)
                killed = True
            time.sleep(0.05)
        try:  # workers left behind by a killed parent
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
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
    ap.add_argument("cases", nargs="*", help="case names (default: all)")
    args = ap.parse_args()
    names = args.cases or [*CASES, *ATTACKS]
    print("| attack | file | before | after |\n|---|---:|---|---|")
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            if name in CASES:
                path = CASES[name](Path(tmp))
                argv = ["-m", "snapforensics", "diagnose", str(path), "--format", "json"]
                env: dict[str, str] = {}
                size = f"{path.stat().st_size / 1e3:.0f} kB"
                cleanup = None
            else:
                os.environ["ATTACK_TREE"] = str(args.before or ROOT)
                a = ATTACKS[name](Path(tmp))
                argv, env, cleanup = a.argv, a.env, a.cleanup
                size = f"{a.file.stat().st_size / 1e3:.0f} kB" if a.file else "-"
            try:
                before = run(args.before, argv, args.memory, args.seconds, env) \
                    if args.before else "-"
                if name in ATTACKS and args.before:  # fresh state (cache, files) for after
                    cleanup()
                    shutil.rmtree(tmp)
                    os.mkdir(tmp)
                    os.environ["ATTACK_TREE"] = str(ROOT)
                    a = ATTACKS[name](Path(tmp))
                    argv, env, cleanup = a.argv, a.env, a.cleanup
                after = run(ROOT, argv, args.memory, args.seconds, env)
            finally:
                if cleanup:
                    cleanup()
            print(f"| {name} | {size} | {before} | {after} |", flush=True)


if __name__ == "__main__":
    main()
