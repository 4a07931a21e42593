"""Compare two runs rank by rank, and the CI gate over any before/after comparison.

    r = compare_runs(docs_a, docs_b)      # runs/a vs runs/b: rank0 with rank0, ...
    r.pairs[0].deltas[0]["peaks"]         # one before/after Comparison per rank in both runs
    failures(r.pairs, ["regression=5%", "new-anomaly"])   # [] when the gate passes

Gate conditions (`--fail-on`, repeatable):
- `regression=P%` (or a bare number of percent): a rank's overall peak grew by more than P% of
  its baseline peak. 5% is a sensible default for CI: run-to-run noise of one training step's
  peak is allocator rounding (<1%), while one extra unsharded FSDP unit or activation set is
  several percent of the peak.
- `new-anomaly`: a rule that is anomalous after and was not anomalous before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from snapforensics.analysis.compare import BEFORE_AFTER, Comparison, _change, compare
from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.analysis.vocab import Verdict
from snapforensics.errors import SnapError

SCHEMA = "snapforensics.compare_runs/1"
GATES = ("regression=P%", "new-anomaly")


@dataclass
class RunComparison:
    a: str
    b: str
    pairs: list[Comparison]  # one per rank present in both runs, in rank order
    overall: dict[str, Any]  # the highest peak over ranks, before and after
    unpaired: list[str] = field(default_factory=list)  # files with no counterpart
    gate: list[str] | None = None  # why `--fail-on` failed ([] passed); None: no gate asked
    # the timelines ([row, live bytes, phase] points) of the rank whose peak changed most, A's
    # and B's, for the reports' before/after plot; not part of the JSON (each rank's JSON
    # timeline is in its own diagnosis)
    plot: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"schema": SCHEMA, "a": self.a, "b": self.b, "overall": self.overall,
               "unpaired": self.unpaired, "ranks": [p.to_dict() for p in self.pairs]}
        return out if self.gate is None else out | {"gate": {"failures": self.gate}}


def _rank_key(d: Diagnosis, n: int) -> Any:
    """Pair by the rank the file name shows (copies of one recording share provenance), then
    by the recorded rank, then by position."""
    from snapforensics.snapshot import rank_from_name

    r = rank_from_name(d.source)
    return r if r is not None else d.rank if d.rank is not None else f"#{n}"


def compare_runs(a: str, b: str, diags_a: Sequence[Diagnosis],
                 diags_b: Sequence[Diagnosis]) -> RunComparison:
    ka = {_rank_key(d, n): d for n, d in enumerate(diags_a)}
    kb = {_rank_key(d, n): d for n, d in enumerate(diags_b)}
    both = [k for k in ka if k in kb]
    if not both:
        raise SnapError(f"{a} and {b} have no rank in common to compare")
    pairs = [compare([ka[k], kb[k]], mode=BEFORE_AFTER) for k in both]
    unpaired = [ka[k].source for k in ka if k not in kb] + [kb[k].source for k in kb
                                                            if k not in ka]
    pa = max(p.inputs[0]["peaks"]["overall_bytes"] for p in pairs)
    pb = max(p.inputs[1]["peaks"]["overall_bytes"] for p in pairs)
    n = max(range(len(pairs)),
            key=lambda i: pairs[i].deltas[0]["peaks"]["overall_bytes"]["delta_bytes"])
    worst, da, db = pairs[n], ka[both[n]].primary, kb[both[n]].primary
    plot = {"label": worst.deltas[0]["label"], "rank": worst.deltas[0]["rank"],
            "a": da.timeline if da else [], "b": db.timeline if db else []}
    return RunComparison(a=a, b=b, pairs=pairs, unpaired=unpaired, plot=plot, overall={
        "ranks": len(pairs), "peak_bytes": _change(pa, pb),
        "largest_growth": {"label": worst.deltas[0]["label"], "rank": worst.deltas[0]["rank"],
                           **worst.deltas[0]["peaks"]["overall_bytes"]},
        "new_anomalies": sorted({f["rule"] for p in pairs for f in new_anomalies(p.deltas[0])}),
        "gone_anomalies": sorted({f["rule"] for p in pairs
                                  for f in p.deltas[0]["findings"]["disappeared"]
                                  if f["verdict"] == Verdict.ANOMALOUS})})


def new_anomalies(delta: dict[str, Any]) -> list[dict[str, Any]]:
    f = delta["findings"]
    return [x for x in f["appeared"] if x["verdict"] == Verdict.ANOMALOUS] + \
        [x for x in f["persisted"] if x["verdict_after"] == Verdict.ANOMALOUS
         and x["verdict_before"] != Verdict.ANOMALOUS]


def parse(conditions: Sequence[str]) -> list[tuple[str, float]]:
    """`regression=5%` -> ("regression", 5.0); `new-anomaly` -> ("new-anomaly", 0)."""
    out = []
    for c in conditions:
        m = re.fullmatch(r"regression(?:=(\d+(?:\.\d+)?)%?)?", c.strip())
        if m:
            out.append(("regression", float(m.group(1) or 5.0)))
        elif c.strip() == "new-anomaly":
            out.append(("new-anomaly", 0.0))
        else:
            raise SnapError(f"--fail-on {c}: expected one of {', '.join(GATES)}")
    return out


def failures(comparisons: Sequence[Comparison], conditions: Sequence[str]) -> list[str]:
    """Why the gate fails, one line per rank and condition; [] when it passes."""
    conds = parse(conditions)
    out = []
    for c in comparisons:
        if c.mode != BEFORE_AFTER:
            raise SnapError("--fail-on compares a run against a baseline (before/after, or two "
                            "run folders); ranks of one run have no baseline")
        for d in c.deltas:
            for kind, pct in conds:
                p = d["peaks"]["overall_bytes"]
                if kind == "regression" and p["delta_pct"] is not None and \
                        p["delta_pct"] > pct:
                    out.append(f"{d['label']}: peak grew {p['delta_pct']:+.1f}% "
                               f"(more than {pct:g}%)")
                if kind == "new-anomaly":
                    out += [f"{d['label']}: new anomaly {x['rule']}" for x in
                            new_anomalies(d)]
    return out
