"""How stable the matrix's figures are from one recording to the next: peaks and predictions.

Prints figures; it is not a test. Records the scenario matrix (``python -m
snapforensics.examples.scenarios``, 2 ranks then the 4-rank layouts) N times into a temporary
folder (or reads matrices recorded earlier, ``--from DIR ...``), diagnoses rank 0 of every
layout in each, and prints per layout, over the N recordings:

- the measured peak (replayed from the trace, as tests/test_matrix.py measures it): min, max
  and spread (max - min) / min;
- for every rule with a predicted peak in any recording: how many recordings had the finding
  anomalous, the spread of its predicted peak, and, where the layout has a fixed twin, the
  worst error of an anomalous finding's prediction against the twin's measured peak in the same
  matrix recording (test_matrix allows 5%).

The worst figures over all layouts close the output. Issue 22: f2_block_noac's peak (and so
the error of f2_block_noac_rab_false's prediction) moved by gloo's reduce-scatter clone,
787,456 B, in some recordings on a loaded machine.

    python benchmarks/bench_prediction_spread.py --repeat 3
    python benchmarks/bench_prediction_spread.py --repeat 10 \
        --only f2_block_noac,f2_block_noac_rab_false --keep /tmp/spread
    python benchmarks/bench_prediction_spread.py --from /tmp/spread/run*
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from recordings import load_strict, replay_peak  # noqa: E402

from snapforensics.analysis import diagnose  # noqa: E402
from snapforensics.snapshot import load  # noqa: E402


def record(out: Path, only: list[str], layouts: dict) -> float:
    """One matrix (or the layouts in ``only``) into ``out``; its wall seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    worlds = sorted({layouts[n].world for n in only}) if only else [2, 4]
    t0 = time.perf_counter()
    for world in worlds:
        cmd = [sys.executable, "-m", "snapforensics.examples.scenarios", "--out", str(out)]
        names = [n for n in only if layouts[n].world == world]
        cmd += ["--only", ",".join(names)] if names else ["--world", str(world)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"recording failed ({proc.returncode}): {' '.join(cmd)}\n"
                     f"{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def measure(matrix: Path, names: list[str]) -> dict[str, dict]:
    """Per layout: rank 0's measured peak and {rule: (predicted peak, verdict)}."""
    out = {}
    for name in names:
        path = matrix / name / "rank0.pickle"
        if not path.is_file():
            continue
        d = diagnose(load(path))
        out[name] = {"peak": replay_peak(load_strict(path)),
                     "predictions": {f.rule: (f.predicted_peak_bytes, str(f.verdict))
                                     for f in d.findings if f.predicted_peak_bytes}}
    return out


def spread(values: list[int]) -> float:
    return (max(values) - min(values)) / min(values) if values and min(values) else 0.0


def report(runs: list[dict[str, dict]], layouts: dict) -> None:
    worst_peak = worst_pred = worst_err = (0.0, "")
    for name in sorted({n for r in runs for n in r}):
        got = [r[name] for r in runs if name in r]
        peaks = [g["peak"] for g in got]
        s = spread(peaks)
        worst_peak = max(worst_peak, (s, name))
        print(f"{name:28s} {len(got):2d} rec  peak {min(peaks):>11,}..{max(peaks):>11,} B "
              f"spread {100 * s:6.3f}%")
        twin = layouts[name].twin if name in layouts else None
        for rule in sorted({rule for g in got for rule in g["predictions"]}):
            preds = [g["predictions"][rule][0] for g in got if rule in g["predictions"]]
            anomalous = sum(g["predictions"].get(rule, (0, ""))[1] == "anomalous" for g in got)
            line = (f"    {rule:44s} anomalous {anomalous}/{len(got)}  predicted "
                    f"{min(preds):>11,}..{max(preds):>11,} B spread {100 * spread(preds):6.3f}%")
            if anomalous:
                worst_pred = max(worst_pred, (spread(preds), f"{name} {rule}"))
            errs = [abs(r[name]["predictions"][rule][0] - r[twin]["peak"]) / r[twin]["peak"]
                    for r in runs if twin and twin in r and name in r
                    and rule in r[name]["predictions"]]
            if errs and anomalous:
                line += f"  vs twin {twin}: worst error {100 * max(errs):.3f}%"
                worst_err = max(worst_err, (max(errs), f"{name} {rule}"))
            print(line)
    print(f"worst peak spread {100 * worst_peak[0]:.3f}% ({worst_peak[1]}); worst spread of an "
          f"anomaly's prediction {100 * worst_pred[0]:.3f}% ({worst_pred[1]}); worst error "
          f"against the twin {100 * worst_err[0]:.3f}% ({worst_err[1]})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, metavar="N", help="recordings (default 3)")
    p.add_argument("--only", default="", help="comma-separated layouts (default: all)")
    p.add_argument("--from", dest="src", type=Path, nargs="+", help="matrices recorded earlier")
    p.add_argument("--keep", type=Path, help="record into this folder (one subfolder a run)")
    a = p.parse_args()
    from snapforensics.examples.scenarios.layouts import LAYOUTS

    only = [n for n in a.only.split(",") if n]
    unknown = [n for n in only if n not in LAYOUTS]
    if unknown:
        sys.exit(f"unknown layout(s): {', '.join(unknown)}")
    names = only or list(LAYOUTS)
    runs = []
    if a.src:
        runs = [measure(m, names) for m in a.src]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            base = a.keep or Path(tmp)
            for i in range(a.repeat):
                out = base / f"run{i}"
                wall = record(out, only, LAYOUTS)
                runs.append(measure(out, names))
                print(f"recording {i + 1}/{a.repeat}: {wall:.0f} s, load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
    print(f"{len(runs)} recordings of {len(names)} layouts, python {sys.executable}")
    report(runs, LAYOUTS)


if __name__ == "__main__":
    main()
