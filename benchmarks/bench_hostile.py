"""Hostile files (tests/hostile.py) through `diagnose --format json`, and issue 21's attacks
(tests/attacks.py: special files, cache entries, schedulers, options, through the CLI and the
API): exit, time, peak RSS, stderr lines.

    python benchmarks/bench_hostile.py                       # this tree only
    python benchmarks/bench_hostile.py --before /tmp/old     # side by side with another checkout
    python benchmarks/bench_hostile.py fifo_cached glob_fifo # some cases only
    python benchmarks/bench_hostile.py --shapes26            # issue 26: per shape, per read path

--shapes26 builds each shape of tests/shapes26.py and times it in the three read paths
(default = the stream reader; SNAPFORENSICS_STREAM=0; SNAPFORENSICS_PURE_PYTHON=1, each with
SNAPFORENSICS_NO_CACHE=1) and in the baseline (`gc.disable(); pickle.load(f)` of the same bytes,
in a subprocess under the same caps): wall seconds, and the time and peak RSS above the floor (the
same command on a 2-entry snapshot: interpreter start, imports) per pickle byte, as s/MB and
bytes/byte (a linear, bounded read has both flat across sizes).

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
    code_s, wall, rss, lines = measure(tree, argv, memory, seconds, extra_env)
    return f"exit {code_s}, {wall:.1f} s, {rss / 1e6:.0f} MB, {lines} stderr lines"


def measure(tree: Path, argv: list[str], memory: int, seconds: int,
            extra_env: dict[str, str] | None = None) -> tuple[str, float, int, int]:
    """(exit code or "killed", wall seconds, peak RSS bytes, stderr lines) of one subprocess."""
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
    return code_s, wall, ru.ru_maxrss * 1024, lines


PATHS = {"stream": {}, "no_stream": {"SNAPFORENSICS_STREAM": "0"},
         "pure": {"SNAPFORENSICS_PURE_PYTHON": "1"}}
_BASELINE = ("import gc, gzip, pickle, sys\n"
             "data = open(sys.argv[1], 'rb').read()\n"
             "data = gzip.decompress(data) if data[:2] == b'\\x1f\\x8b' else data\n"
             "gc.disable()\n"
             "import io; pickle.load(io.BytesIO(data))\n")


def shapes26(names: list[str], memory: int, seconds: int) -> None:
    """Issue 26's table: per shape, the baseline and each read path (module docstring)."""
    import gzip

    from hostile import EMPTY_LIST, entry, pkl, snapshot_dict, trace_of
    from shapes26 import SHAPES

    env = {"SNAPFORENSICS_NO_CACHE": "1"}
    for k in ("SNAPFORENSICS_STREAM", "SNAPFORENSICS_PURE_PYTHON", "SNAPFORENSICS_LOAD_MEMORY"):
        os.environ.pop(k, None)
    cells = " | ".join(f"{p} wall, s/MB | {p} RSS/byte" for p in PATHS)
    print(f"| shape | pickle bytes | base wall, s/MB | base RSS/byte | {cells} |")
    print("|---|---:|---:|---:|" + "---:|---:|" * len(PATHS))
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "tiny.pickle"
        tiny.write_bytes(pkl(snapshot_dict(EMPTY_LIST, trace_of([entry(),
                                                                 entry("free_completed")]))))

        def least(argv: list[str], extra: dict[str, str]) -> tuple[str, float, int, int]:
            return min((measure(ROOT, argv, memory, seconds, extra) for _ in range(3)),
                       key=lambda m: m[1])  # the floor: the fastest of 3 (start-up noise)
        floor = {p: least(["-m", "snapforensics", "diagnose", str(tiny), "--format", "json"],
                          {**env, **e}) for p, e in PATHS.items()}
        base_floor = least(["-c", _BASELINE, str(tiny)], {})

        def cell(m: tuple[str, float, int, int], fl: tuple[str, float, int, int],
                 size: int) -> list[str]:
            code, wall, rss, _ = m
            mb = size / 1e6
            return [f"{wall:.2f} s, {max(0.0, wall - fl[1]) / mb:.2f} s/MB, exit {code}",
                    f"{max(0, rss - fl[2]) / size:.1f}"]

        for name, build in SHAPES:
            if names and name not in names:
                continue
            path = build(Path(tmp))
            data = path.read_bytes()
            size = len(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
            row = [name, f"{size:,}",
                   *cell(measure(ROOT, ["-c", _BASELINE, str(path)], memory, seconds),
                         base_floor, size)]
            for p, e in PATHS.items():
                row += cell(measure(ROOT, ["-m", "snapforensics", "diagnose", str(path),
                                           "--format", "json"], memory, seconds, {**env, **e}),
                            floor[p], size)
            print("| " + " | ".join(row) + " |", flush=True)
        print(f"\nfloors (the same command on a {tiny.stat().st_size}-byte snapshot): base "
              f"{base_floor[2] / 1e6:.0f} MB {base_floor[1]:.2f} s, "
              + ", ".join(f"{p} {v[2] / 1e6:.0f} MB {v[1]:.2f} s" for p, v in floor.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="checkout of the code before the change")
    ap.add_argument("--memory", type=int, default=4 << 30)
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("--shapes26", action="store_true",
                    help="issue 26's shapes (tests/shapes26.py) per read path, vs pickle.load")
    ap.add_argument("cases", nargs="*", help="case names (default: all)")
    args = ap.parse_args()
    if args.shapes26:
        shapes26(args.cases, args.memory, args.seconds)
        return
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
