"""`diagnose --format json` against the unpickling floor, time and peak RSS, in one run.

    python benchmarks/bench_diagnose.py FILE [FILE ...] [--repeat 1] [--previous] [--torch]
        [--torch-timeout 900] [--as-limit GB]

For each file, each step runs in its own subprocess (so each peak RSS is that step's alone,
read from os.wait4's rusage), interleaved, best wall time of --repeat runs:
  floor   `gc.disable(); pickle.load(f)`            (the unpickling floor, issue 10)
  pickle  plain `pickle.load(f)` (GC on, as a user runs it)
  ours    `python -m snapforensics diagnose FILE --format json -o TMP --no-cache -q` (a first
          run: the model cache is bypassed), through the streaming reader (snapshot/_stream.c)
  prev    (with --previous) the same with SNAPFORENSICS_STREAM=0: the C unpickler, then the
          C trace reader over the unpickled entries (the reader before the stream)
  torch   (with --torch) `python -m torch.cuda._memory_viz trace_plot FILE -o TMP.html`, the
          viewer users have today (needs torch), and the size of the HTML it writes; killed
          after --torch-timeout seconds
--as-limit GB caps every step's address space (RLIMIT_AS, as `prlimit --as` does): a step that
cannot load the file within it fails and its row says so (MemoryError, killed...), instead of
taking the machine's memory.
Times are whole-process wall times (interpreter start-up and imports included for every step).
Prints ours / floor for time and for peak RSS (issue 20's targets on the 1 GB shape: <= 1.0x
time, <= 0.5x RSS), with the load average (1 min) before each row and after it.
`SNAPFORENSICS_PURE_PYTHON=1` in the environment measures the loader's Python path instead of
the C trace reader.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOAD = ("import gc, pickle, sys\n"
        "{gc}\n"
        "with open(sys.argv[1], 'rb') as f:\n"
        "    pickle.load(f)  # the file under test is our own synthetic or corpus file\n")


def run(cmd: list[str], timeout: float | None = None, limit: int = 0,
        **extra: str) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, "" or why it failed) of one child process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)

    def cap() -> None:
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    with tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                             preexec_fn=cap if limit else None)
        timer = threading.Timer(timeout, p.kill) if timeout else None
        if timer:
            timer.start()
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        if timer:
            timer.cancel()
        p.returncode = code = os.waitstatus_to_exitcode(status)
        why = ""
        if code < 0:
            why = f"killed at {wall:.0f} s" if timeout and wall >= timeout else f"signal {-code}"
        elif code:
            err.seek(0)
            msg = err.read().decode(errors="replace").strip().splitlines() or ["?"]
            why = msg[-1][:60]
            print(f"  ! {' '.join(cmd[:4])}... exit {code}: {msg[-1][:300]}", file=sys.stderr)
    return wall, ru.ru_maxrss * 1024, why


def bench(path: Path, repeat: int, torch: bool, previous: bool = False,
          torch_timeout: float = 900, limit: int = 0) -> dict:
    py = sys.executable
    steps = {
        "floor": [py, "-c", LOAD.format(gc="gc.disable()"), str(path)],
        "pickle": [py, "-c", LOAD.format(gc=""), str(path)],
    }
    best: dict[str, tuple[float, int, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        steps["ours"] = [py, "-m", "snapforensics", "diagnose", str(path), "--format", "json",
                         "-o", str(Path(tmp) / "out.json"), "--no-cache", "-q"]
        if previous:
            steps["prev"] = steps["ours"]
        html = Path(tmp) / "trace.html"
        if torch:
            steps["torch"] = [py, "-m", "torch.cuda._memory_viz", "trace_plot", str(path),
                              "-o", str(html)]
        for _ in range(repeat):
            for name, cmd in steps.items():
                got = run(cmd, torch_timeout if name == "torch" else None, limit,
                          **({"SNAPFORENSICS_STREAM": "0"} if name == "prev" else {}))
                old = best.get(name)
                if old is None or (not got[2] and (old[2] or got[0] < old[0])):
                    best[name] = (got[0], max(got[1], old[1] if old else 0), got[2])
        if torch:
            best["html"] = (html.stat().st_size if html.exists() else 0, 0, "")
    return best


def cell(r: tuple[float, int, str], w: int = 13) -> str:
    """`seconds GB`, or why the step failed."""
    return f"{r[0]:7.2f} {r[1] / 2**30:5.2f}" if not r[2] else f"{r[2][:w]:>{w}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--torch", action="store_true", help="also time torch's trace_plot")
    ap.add_argument("--torch-timeout", type=float, default=900,
                    help="seconds before trace_plot is killed")
    ap.add_argument("--previous", action="store_true",
                    help="also time diagnose through the reader before the stream")
    ap.add_argument("--as-limit", type=float, default=0,
                    help="cap every step's address space at this many GiB")
    args = ap.parse_args()
    limit = int(args.as_limit * 2**30)
    print(f"{'file':26} {'MB':>6} | {'floor s':>7} {'GB':>5} | {'pickle s':>7} {'GB':>5} | "
          f"{'ours s':>7} {'GB':>5} | {'time/floor':>10} {'rss/floor':>9}"
          + (f" | {'prev s':>7} {'GB':>5}" if args.previous else "")
          + (f" | {'torch s':>7} {'GB':>5} {'HTML MB':>7}" if args.torch else "")
          + " | load avg" + (f"  (every step capped at {args.as_limit:g} GiB of address space)"
                             if limit else ""))
    for p in args.files:
        before = os.getloadavg()[0]
        b = bench(p, args.repeat, args.torch, args.previous, args.torch_timeout, limit)
        f, o = b["floor"], b["ours"]
        ratios = f"{o[0] / f[0]:9.2f}x {o[1] / f[1]:8.2f}x" if not (f[2] or o[2]) else \
            f"{'':>10} {'':>9}"
        print(f"{p.name[:26]:26} {p.stat().st_size / 1e6:6.0f} | {cell(f)} | {cell(b['pickle'])}"
              f" | {cell(o)} | {ratios}"
              + (f" | {cell(b['prev'])}" if args.previous else "")
              + (f" | {cell(b['torch'])} {b['html'][0] / 1e6:7.0f}" if args.torch else "")
              + f" | {before:.1f}-{os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
