"""`diagnose --format json` against the unpickling floor, time and peak RSS, in one run.

    python benchmarks/bench_diagnose.py FILE [FILE ...] [--repeat 1]

For each file, each step runs in its own subprocess (so each peak RSS is that step's alone,
read from os.wait4's rusage), interleaved, best wall time of --repeat runs:
  floor   `gc.disable(); pickle.load(f)`            (the unpickling floor, issue 10)
  pickle  plain `pickle.load(f)` (GC on, as a user runs it)
  ours    `python -m snapforensics diagnose FILE --format json -o TMP --no-cache -q` (a first
          run: the model cache is bypassed), through the streaming reader (snapshot/_stream.c)
  prev    (with --previous) the same with SNAPFORENSICS_STREAM=0: the C unpickler, then the
          C trace reader over the unpickled entries (the reader before the stream)
  torch   (with --torch) `python -m torch.cuda._memory_viz trace_plot FILE -o TMP.html`, the
          viewer users have today (needs torch), and the size of the HTML it writes
Times are whole-process wall times (interpreter start-up and imports included for every step).
Prints ours / floor for time and for peak RSS. Targets: <= 2x time, <= 1.2x RSS.
`SNAPFORENSICS_PURE_PYTHON=1` in the environment measures the loader's Python path instead of
the C trace reader.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOAD = ("import gc, pickle, sys\n"
        "{gc}\n"
        "with open(sys.argv[1], 'rb') as f:\n"
        "    pickle.load(f)  # the file under test is our own synthetic or corpus file\n")


def run(cmd: list[str], **extra: str) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of one child process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    with tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = code = os.waitstatus_to_exitcode(status)
        if code:
            err.seek(0)
            msg = err.read().decode(errors="replace").strip()[-300:]
            print(f"  ! {' '.join(cmd[:4])}... exit {code}: {msg}", file=sys.stderr)
    return wall, ru.ru_maxrss * 1024, code


def bench(path: Path, repeat: int, torch: bool, previous: bool = False) -> dict:
    py = sys.executable
    steps = {
        "floor": [py, "-c", LOAD.format(gc="gc.disable()"), str(path)],
        "pickle": [py, "-c", LOAD.format(gc=""), str(path)],
    }
    best: dict[str, tuple[float, int]] = {}
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
                wall, rss, _ = run(cmd, **({"SNAPFORENSICS_STREAM": "0"} if name == "prev"
                                           else {}))
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, max(rss, best.get(name, (0, 0))[1]))
        if torch:
            best["html"] = (html.stat().st_size if html.exists() else 0, 0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--torch", action="store_true", help="also time torch's trace_plot")
    ap.add_argument("--previous", action="store_true",
                    help="also time diagnose through the reader before the stream")
    args = ap.parse_args()
    print(f"{'file':34} {'MB':>6} | {'floor s':>7} {'GB':>5} | {'pickle s':>8} {'GB':>5} | "
          f"{'ours s':>7} {'GB':>5} | {'time/floor':>10} {'rss/floor':>9}"
          + (f" | {'prev s':>7} {'GB':>5}" if args.previous else "")
          + (f" | {'torch s':>7} {'GB':>5} {'HTML MB':>7}" if args.torch else "")
          + f"  (load average {os.getloadavg()[0]:.1f})")
    for p in args.files:
        b = bench(p, args.repeat, args.torch, args.previous)
        (ft, fr), (pt, pr), (ot, orss) = b["floor"], b["pickle"], b["ours"]
        print(f"{p.name[:34]:34} {p.stat().st_size / 1e6:6.0f} | {ft:7.2f} {fr / 2**30:5.2f} | "
              f"{pt:8.2f} {pr / 2**30:5.2f} | {ot:7.2f} {orss / 2**30:5.2f} | "
              f"{ot / ft:9.2f}x {orss / fr:8.2f}x"
              + (f" | {b['prev'][0]:7.2f} {b['prev'][1] / 2**30:5.2f}" if args.previous else "")
              + (f" | {b['torch'][0]:7.2f} {b['torch'][1] / 2**30:5.2f} {b['html'][0] / 1e6:7.0f}"
                 if args.torch else "")
              + f"  (load average {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
