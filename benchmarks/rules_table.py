"""Record every variant of the bundled example and print what each rule finds (figures, not a test).

    python benchmarks/rules_table.py                 # all variants, CPU, 2 ranks, 3 steps
    python benchmarks/rules_table.py buggy fixed     # some of them

Each variant is recorded by the real recorder into a temp folder; rank 0 is diagnosed; one line
per finding: variant, rule, verdict, bytes, predicted peak and saving, and the measured peak.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapforensics.analysis import diagnose  # noqa: E402
from snapforensics.examples.fsdp_ckpt import VARIANTS  # noqa: E402
from snapforensics.report.common import human  # noqa: E402
from snapforensics.snapshot import load  # noqa: E402


def main(variants: list[str]) -> None:
    print(f"{'variant':28} {'rule':38} {'verdict':9} {'bytes':>10} {'pred.peak':>10} "
          f"{'saving':>10} {'peak':>10}  rec s")
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            out = Path(tmp) / v
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "snapforensics", "record", "-q",
                                "--nproc-per-node", "2", "--device", "cpu", "--out", str(out),
                                "-m", "snapforensics.examples.fsdp_ckpt", "--", "--variant", v],
                               capture_output=True, text=True)
            rec = time.perf_counter() - t
            if r.returncode:
                print(f"{v:28} recording failed (exit {r.returncode})")
                continue
            d = diagnose(load(out / "rank0.pickle"))
            peak = human(d.peaks["overall_bytes"])
            if not d.findings:
                print(f"{v:28} {'(no findings)':38} {'':9} {'':>10} {'':>10} {'':>10} {peak:>10}"
                      f"  {rec:.1f}")
            for f in d.findings:
                pred = human(f.predicted_peak_bytes) if f.predicted_peak_bytes else "-"
                save = human(f.saving_bytes) if f.saving_bytes else "-"
                print(f"{v:28} {f.rule:38} {f.verdict:9} {human(f.bytes):>10} {pred:>10} "
                      f"{save:>10} {peak:>10}  {rec:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(VARIANTS))
