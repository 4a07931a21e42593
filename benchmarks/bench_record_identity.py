"""What tensor names cost while recording (issue 29, item 1): the bundled example recorded with
and without them, in one run.

Prints figures; it is not a test (no timed assertion). Records ``snapforensics.examples.
fsdp_ckpt`` (2 ranks, gloo, CPU) through ``snapforensics record``, ``--repeat`` times each way,
alternating: ``SNAPFORENSICS_NAMES=0`` (before: no identity tracker) and the default (after).
Per run: the rank-0 step time (median CPU time of the steps after the first, the example's own
log), the record's wall time, rank 0's profiler stop and conversion (the recorder's own line),
the snapshot's size; with names, the observations written and the time the optimizer-step
hooks took (measured inside them). Medians over the repeats, and after / before.

    python benchmarks/bench_record_identity.py                  # fixed, 3 steps, 3 repeats
    python benchmarks/bench_record_identity.py --repeat 5 -- --variant noac --steps 4
"""

from __future__ import annotations

import argparse
import os
import pickle
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
RANK0 = re.compile(r"rank 0: .*written in (\S+) s.*profiler stop (\S+) s, convert (\S+) s")


def one(names: bool, args: list[str]) -> dict:
    env = dict(os.environ, SNAPFORENSICS_NAMES="1" if names else "0",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "snapforensics", "record", "--device", "cpu",
                               "--nproc-per-node", "2", "--out", str(out), "-m", EXAMPLE, "--",
                               *args], cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"record failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        log = proc.stdout + proc.stderr
        steps = [(int(m[1]), float(m[3])) for m in STEP.finditer(log)]
        cpu = [c for i, c in steps if i > 0] or [c for _, c in steps]
        m = RANK0.search(log)
        snap_path = out / "rank0.pickle"
        with open(snap_path, "rb") as f:
            snap = pickle.load(f)
        tensors = snap.get("snapforensics_tensors") or {}
        return {"wall_s": wall, "step_cpu_s": statistics.median(cpu) if cpu else float("nan"),
                "stop_s": float(m[2]) if m else float("nan"),
                "convert_s": float(m[3]) if m else float("nan"),
                "mb": snap_path.stat().st_size / 1e6,
                "observations": len(tensors.get("ptr", [])),
                "step_hooks_s": tensors.get("step_hooks_s", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("example_args", nargs="*")
    ns = ap.parse_args()
    args = ns.example_args or ["--variant", "fixed", "--steps", "3"]
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(ns.repeat):
        for names in (False, True):
            r = one(names, args)
            runs[names].append(r)
            print(f"run {i} names={'on ' if names else 'off'}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()),
                flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    print(f"\nmedians over {ns.repeat} runs each ({' '.join(args)}, 2 ranks, CPU):")
    print(f"{'':14}{'before':>10}{'after':>10}{'after/before':>14}")
    for k in ("wall_s", "step_cpu_s", "stop_s", "convert_s", "mb"):
        b, a = med[False][k], med[True][k]
        print(f"{k:14}{b:>10.3f}{a:>10.3f}{(a / b if b else float('nan')):>14.3f}")
    print(f"{'observations':14}{med[False]['observations']:>10.0f}"
          f"{med[True]['observations']:>10.0f}")
    print(f"{'step_hooks_s':14}{'':>10}{med[True]['step_hooks_s']:>10.4f}")


if __name__ == "__main__":
    main()
