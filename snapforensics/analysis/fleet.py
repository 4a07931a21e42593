"""Many ranks' diagnoses into one fleet view (plain data, no rendering).

    f = fleet(docs)          # the per-rank documents `parallel.run` gathers
    f.ranks[0]               # the worst rank: most anomalous rules, then the highest peak
    f.spread                 # median / min / max peak, spread %, the rank furthest off
    f.findings               # one row per rule: on every rank, or which ranks (rank-specific)

A finding present on every rank is one line (a configuration bug: every rank runs the same
code); one present on some ranks only is called out with its ranks (data, sharding or a
rank-dependent code path). Figures are each rank's primary device, as in `compare`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from snapforensics import __version__
from snapforensics.analysis.compare import (
    _SEVERITY,
    RANKS,
    _imbalance,
    _input,
    _labels,
    _looks_like_ranks,
    _warnings,
)
from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.analysis.vocab import Verdict

SCHEMA = "snapforensics.fleet/1"
RUNS = "runs"


@dataclass
class Fleet:
    ranks: list[dict[str, Any]]  # worst first
    spread: dict[str, Any] | None  # None with fewer than one readable rank
    findings: list[dict[str, Any]]  # by rule, most severe and widest first
    errors: list[dict[str, str]] = field(default_factory=list)  # inputs that could not be read
    warnings: list[str] = field(default_factory=list)
    tool: str = f"snapforensics {__version__}"
    # "ranks": distinct ranks of one run (one folder or one recorded command); "runs": files
    # of separate runs (the same rank twice, unknown ranks, different folders and commands),
    # whose spread says nothing about balance
    mode: str = RANKS

    @property
    def anomalies(self) -> list[dict[str, Any]]:
        return [f for f in self.findings if f["verdict"] == Verdict.ANOMALOUS]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "tool": self.tool, "mode": self.mode, "ranks": self.ranks,
                "spread": self.spread, "findings": self.findings, "errors": self.errors,
                "warnings": self.warnings}


def fleet(docs: list[dict[str, Any]]) -> Fleet:
    """Documents in input order; `{"source", "error"}` ones are listed as unreadable."""
    errors = [{"source": d["source"], "error": d["error"]} for d in docs if "error" in d]
    diags = [Diagnosis.from_dict(d) for d in docs if "error" not in d]
    if not diags:
        return Fleet(ranks=[], spread=None, findings=[], errors=errors)
    inputs = [_input(d, label) for d, label in zip(diags, _labels([d.source for d in diags]))]
    spread = _imbalance(inputs)
    dev = {r["source"]: r for r in spread["ranks"]}
    ranks = [{"label": i["label"], "source": i["source"], "rank": i["rank"],
              "backend": i["backend"], "peaks": i["peaks"], "peak_phase": i["peak_phase"],
              "deviation_pct": dev[i["source"]]["deviation_pct"],
              "anomalies": i["anomalies"], "findings": len(i["findings"]),
              "warnings": i["warnings"]} for i in inputs]
    ranks.sort(key=lambda r: (-len(r["anomalies"]), -r["peaks"]["overall_bytes"], r["label"]))
    one_run = len(diags) < 2 or _looks_like_ranks(diags)
    return Fleet(ranks=ranks, spread=spread, findings=_by_rule(inputs, diags), errors=errors,
                 warnings=_warnings(diags, inputs, RANKS) if one_run else [],
                 mode=RANKS if one_run else RUNS)


def _by_rule(inputs: list[dict], diags: list[Diagnosis]) -> list[dict[str, Any]]:
    """One row per rule; its ranks are rank numbers when those tell the inputs apart, else
    the inputs' labels (copies of one recording share its rank)."""
    ranks = [i["rank"] for i in inputs]
    by_rank = None not in ranks and len(set(ranks)) == len(ranks)
    rows: dict[str, dict[str, Any]] = {}
    for inp, d in zip(inputs, diags):
        fixes = {f.rule: f for f in d.findings if f.fix}
        for f in inp["findings"]:
            r = rows.setdefault(f["rule"], {"rule": f["rule"], "verdict": f["verdict"],
                                            "title": f["title"], "ranks": [], "bytes": []})
            r["ranks"].append(inp["rank"] if by_rank else inp["label"])
            r["bytes"].append(f["bytes"])
            if _SEVERITY.get(f["verdict"], 3) < _SEVERITY.get(r["verdict"], 3):
                r["verdict"], r["title"] = f["verdict"], f["title"]
            if "fix" not in r and f["rule"] in fixes:
                r["fix"] = fixes[f["rule"]].fix
    out = []
    for r in rows.values():
        b = r.pop("bytes")
        r |= {"on_all_ranks": len(r["ranks"]) == len(inputs), "rank_count": len(r["ranks"]),
              "bytes_min": min(b), "bytes_max": max(b)}
        out.append(r)
    out.sort(key=lambda r: (_SEVERITY.get(r["verdict"], 3), -r["rank_count"], -r["bytes_max"]))
    return out
