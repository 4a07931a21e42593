"""Every pipeline forecast pair table measured again from the recording cache.

Prints figures; it is not a test. The tables in `snapforensics/analysis/forecast/pipeline.py`
(`PAIRS`, `FSDP_PAIRS`, ..., `TP_PAIRS`) each hold, per recorded pair (source layout -> target
layout), the smallest and largest error of the forecast's per-stage peaks against the recorded
twin's (the worst of each stage's dp and tp ranks), as the slow and full tests check them
(tests/test_forecast.py, `_check_mesh_pair`). This re-measures every row with the code as it is
now, from the layouts `tests/recordings.py` caches (recording those it lacks, the
examples/pipeline.py runs the tests record), and prints each table's rows that moved, each
table's band and the worst pair. With --write the tables in pipeline.py are rewritten with the
new figures (the rows and their order kept).

    python benchmarks/pipeline_pairs.py [--only TP_PAIRS,PAIRS] [--write]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from snapforensics.analysis.forecast import pipeline as pf  # noqa: E402

# each table and the FSDP world size its labels mean when they name none
TABLES = {"PAIRS": 1, "FSDP_PAIRS": 2, "INTERLEAVED_PAIRS": 1, "FSDP_INTERLEAVED_PAIRS": 2,
          "FSDP_WORLD_PAIRS": 2, "FSDP_WORLD_INTERLEAVED_PAIRS": 2,
          "FROM_INTERLEAVED_PAIRS": 1, "FSDP_FROM_INTERLEAVED_PAIRS": 2, "TP_PAIRS": 1,
          "FSDP_TP_PAIRS": 2}
LABEL = re.compile(r"S=(\d+)(x2)? M=(\d+) (\w+)(?: dp=(\d+))?(?: tp=(\d+))?$")


def layout(label: str, dp: int) -> tuple[int, int, str, int, int]:
    """'S=2x2 M=4 interleaved tp=4' -> (stages, micro-batches, schedule, dp, tp)."""
    m = LABEL.match(label)
    if m is None:
        raise ValueError(label)
    return (int(m[1]), int(m[3]), m[4], int(m[5] or dp), int(m[6] or 1))


def measure(source: tuple, target: tuple) -> list[float]:
    """The source's ranks forecast to the target layout: each stage's error against the worst
    recorded peak of its dp and tp ranks (the tests' `_mesh_errors`)."""
    from test_forecast import _mesh_errors

    return _mesh_errors(source, target)[0]


def table_text(name: str, rows: list[tuple[str, str, float, float]]) -> str:
    lines = [f"{name}: tuple[tuple[str, str, float, float], ...] = ("]
    lines += [f'    ("{a}", "{b}", {lo + 0.0:.4f}, {hi + 0.0:.4f}),' for a, b, lo, hi in rows]
    return "\n".join(lines + [")"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated table names")
    ap.add_argument("--write", action="store_true", help="rewrite the tables in pipeline.py")
    a = ap.parse_args()
    names = [n for n in TABLES if not a.only or n in a.only.split(",")]
    path = REPO / "snapforensics/analysis/forecast/pipeline.py"
    text = path.read_text()
    worst = (0.0, "")
    for name in names:
        rows, moved = [], 0
        for src_label, tgt_label, lo, hi in getattr(pf, name):
            errors = measure(layout(src_label, TABLES[name]), layout(tgt_label, TABLES[name]))
            new = (src_label, tgt_label, round(min(errors), 4), round(max(errors), 4))
            if (new[2], new[3]) != (lo, hi):
                moved += 1
                print(f"  {name}: {src_label} -> {tgt_label}: {lo:+.2%}..{hi:+.2%} now "
                      f"{new[2]:+.2%}..{new[3]:+.2%}")
            worst = max(worst, (max(abs(new[2]), abs(new[3])),
                                f"{name}: {src_label} -> {tgt_label}"))
            rows.append(new)
        print(f"{name}: {len(rows)} pairs, {min(r[2] for r in rows):+.2%}.."
              f"{max(r[3] for r in rows):+.2%}, {moved} moved, "
              f"{sum(max(-r[2], r[3]) <= 0.05 for r in rows)} within 5%")
        old = re.search(rf"^{name}: tuple\[.*?\n\)$", text, re.S | re.M)
        assert old is not None, name
        text = text[:old.start()] + table_text(name, rows) + text[old.end():]
    print(f"worst pair: {worst[0]:.2%} ({worst[1]})")
    if a.write:
        path.write_text(text)


if __name__ == "__main__":
    main()
