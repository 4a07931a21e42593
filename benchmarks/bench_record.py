"""What CPU recording costs: the bundled example's step time and peak RSS, plain vs recorded.

Prints figures from one run; it is not a test. Runs ``snapforensics.examples.fsdp_ckpt`` (2 ranks,
gloo, CPU) three ways, one after the other, with the same arguments:

- plain: ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m EXAMPLE ...``;
- recorded: ``snapforensics record --device cpu --nproc-per-node 2 -m EXAMPLE ...``;
- recorded with a window: the same with ``--steps A:B`` (default: the last two steps).

Step time = the median of rank 0's step times after the first step (the first pays one-off
costs: lazy init, first all-gathers), in CPU time of the rank's process (all its threads): on a
shared machine wall time measures the neighbours as much as the recorder (the wall ratio is
printed too); RSS = rank 0's peak RSS (``ru_maxrss``). Ratios are
recorded / plain. Also shows the recorder's own stop/convert time (after the script).

    python benchmarks/bench_record.py                     # 10 steps, the default model
    python benchmarks/bench_record.py --steps 6 --window 4:6 -- --layers 2 --dim 256
    python benchmarks/bench_record.py --spread 10 --steps 2 -- --layers 2 --dim 128

``--spread N`` instead records the same run N times and prints rank 0's peak (replayed from the
trace) of each and the spread (max - min) / min: the stability of CPU recordings (issue 7).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "snapforensics.examples.fsdp_ckpt"
STEP = re.compile(r"\] step (\d+) loss \S+ \((\d+\.\d+) s, cpu (\d+\.\d+) s\)")
RSS = re.compile(r"\] peak RSS (\d+\.\d+) MB")
WRITTEN = re.compile(r"rank 0: .*written in (\S+) s")


def run(cmd: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                    os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    found = STEP.findall(proc.stdout)
    steps = [float(cpu) for _, _, cpu in found]
    walls = [float(w) for _, w, _ in found]
    rss = RSS.search(proc.stdout)
    dump = WRITTEN.search(proc.stderr)
    return {"steps": steps, "walls": walls, "wall": wall,
            "rss": float(rss.group(1)) if rss else float("nan"),
            "dump": float(dump.group(1)) if dump else 0.0}


def spread(n: int, args: list[str]) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from recordings import load_strict, replay_peak

    peaks = []
    for i in range(n):
        with tempfile.TemporaryDirectory() as tmp:
            r = run([sys.executable, "-m", "snapforensics", "record", "-q", "--device", "cpu",
                     "--nproc-per-node", "2", "--out", f"{tmp}/out", "-m", EXAMPLE, "--", *args])
            snap = load_strict(Path(tmp) / "out" / "rank0.pickle")
        peaks.append(replay_peak(snap))
        print(f"recording {i}: rank-0 peak {peaks[-1]} B, "
              f"{snap['snapforensics'].get('cpu_inferred_frees')} frees recovered, "
              f"{r['wall']:.1f} s", flush=True)
    print(f"example {' '.join(args)}; {n} recordings; rank-0 peak spread "
          f"{100 * (max(peaks) - min(peaks)) / min(peaks):.3f}% "
          f"(min {min(peaks)}, max {max(peaks)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", default=None, help="--steps A:B for the windowed run "
                                                  "(default: the last two steps)")
    p.add_argument("--variant", default="fixed")
    p.add_argument("--spread", type=int, default=0, metavar="N",
                   help="record N times; print rank 0's peaks and their spread")
    p.add_argument("example_args", nargs="*", help="more arguments for the example (after --)")
    a = p.parse_args()
    window = a.window or f"{a.steps - 2}:{a.steps}"
    args = ["--variant", a.variant, "--steps", str(a.steps), *a.example_args]
    py = sys.executable
    if a.spread:
        return spread(a.spread, args)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "plain": run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          "2", "-m", EXAMPLE, *args]),
            "recorded": run([py, "-m", "snapforensics", "record", "-q", "--device", "cpu",
                             "--nproc-per-node", "2", "--out", f"{tmp}/all", "-m", EXAMPLE,
                             "--", *args]),
            f"recorded --steps {window}": run(
                [py, "-m", "snapforensics", "record", "--device", "cpu", "--nproc-per-node", "2",
                 "--steps", window, "--out", f"{tmp}/window", "-m", EXAMPLE, "--", *args]),
        }
    base = runs["plain"]
    base_step = statistics.median(base["steps"][1:])
    print(f"example {' '.join(args)}; 2 ranks, CPU; step = median of steps 1..{a.steps - 1}")
    base_wall = statistics.median(base["walls"][1:])
    print(f"{'run':28} {'cpu s':>7} {'ratio':>6} {'wall s':>7} {'ratio':>6} {'RSS MB':>8} "
          f"{'ratio':>6} {'total s':>7}  cpu s of steps 0..")
    for name, r in runs.items():
        step, wall = statistics.median(r["steps"][1:]), statistics.median(r["walls"][1:])
        shown = " ".join(f"{t:.2f}" for t in r["steps"])
        print(f"{name:28} {step:7.3f} {step / base_step:6.2f} {wall:7.3f} {wall / base_wall:6.2f} "
              f"{r['rss']:8.1f} {r['rss'] / base['rss']:6.2f} {r['wall']:7.1f}  {shown}")
    print("(the recorded runs' wall time includes the recorder's stop + convert + write after "
          "the script)")


if __name__ == "__main__":
    main()
