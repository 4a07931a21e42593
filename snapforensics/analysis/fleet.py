"""Many ranks' diagnoses into one fleet view (plain data, no rendering).

    f = fleet(docs)          # the per-rank documents `parallel.run` gathers
    f.ranks[0]               # the worst rank: most anomalous rules, then the highest peak
    f.spread                 # median / min / max peak, spread %, the rank furthest off
    f.findings               # one row per rule: on every rank, or which ranks (rank-specific),
                             # its fix and the peak predicted after it on the worst such rank
    f.worst                  # the worst rank's Diagnosis: the plot the reports draw
    f.statement              # which rank (pipeline stage) peaks highest and why (`_statement`)

A finding present on every rank is one line (a configuration bug: every rank runs the same
code); one present on some ranks only is called out with its ranks (data, sharding or a
rank-dependent code path). Figures are each rank's primary device, as in `compare`.
"""

from __future__ import annotations

import statistics
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
from snapforensics.analysis.mesh import mesh
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
    # the rank with the highest peak and why (`_statement`); None with fewer than two ranks
    statement: dict[str, Any] | None = None
    # the worst rank's diagnosis (ranks[0]), with its plot series: renderers draw its plot;
    # not in the JSON
    worst: Diagnosis | None = field(default=None, repr=False, compare=False)

    @property
    def anomalies(self) -> list[dict[str, Any]]:
        return [f for f in self.findings if f["verdict"] == Verdict.ANOMALOUS]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "tool": self.tool, "mode": self.mode, "ranks": self.ranks,
                "spread": self.spread, "findings": self.findings, "errors": self.errors,
                "warnings": self.warnings, "statement": self.statement}


def worst_key(doc: dict[str, Any]) -> tuple[int, int]:
    """How bad a rank's document is, as the fleet orders ranks (`fleet`): its distinct
    anomalous rules, then its highest peak. An error document is never the worst."""
    if "error" in doc:
        return (-1, -1)
    return (len({f["rule"] for f in doc["findings"] if f["verdict"] == Verdict.ANOMALOUS}),
            int(doc["peaks"]["overall_bytes"]))


class WorstPlots:
    """Fed each rank's document as it arrives (`parallel.run(on_doc=...)`), keeps the plot
    series only on the documents that can still be the worst rank (the one plot a fleet
    report draws): a fleet of N ranks holds one rank's series (those tied for worst, all of
    them, so the label decides as in `fleet`), not N times ~0.2 MB."""

    def __init__(self) -> None:
        self.best: tuple[int, int] | None = None
        self.kept: list[dict[str, Any]] = []

    def add(self, doc: dict[str, Any]) -> None:
        key = worst_key(doc)
        if self.best is None or key > self.best:
            for old in self.kept:
                _drop_plots(old)
            self.best, self.kept = key, [doc]
        elif key == self.best:
            self.kept.append(doc)
        else:
            _drop_plots(doc)


def _drop_plots(doc: dict[str, Any]) -> None:
    for dev in doc.get("devices") or ():
        dev["plot"] = None


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
    by_label = {i["label"]: (i, d) for i, d in zip(inputs, diags)}
    worst_first = [by_label[r["label"]] for r in ranks]
    findings = _by_rule(inputs, diags)
    _predictions(findings, worst_first)
    return Fleet(ranks=ranks, spread=spread, findings=findings, errors=errors,
                 warnings=_warnings(diags, inputs, RANKS) if one_run else [],
                 mode=RANKS if one_run else RUNS, worst=worst_first[0][1],
                 statement=_statement(inputs, diags, spread) if one_run else None)


def _statement(inputs: list[dict], diags: list[Diagnosis],
               spread: dict[str, Any]) -> dict[str, Any] | None:
    """The rank with the highest peak, the category that puts it there (the one furthest above
    the other ranks' median at their peaks) and whether that is a defect.

    With every rank a pipeline stage (`framework.pipeline`, analysis/frameworks/detect.py):
    under 1F1B stage s of S holds at most min(M, S - s) micro-batches' activations, so the
    first stage peaking highest by its activations is the schedule working as designed
    (`expected`, not an imbalance to fix); a later stage peaking highest, or the first by
    anything but activations, is not what the schedule explains (`anomalous`); under GPipe
    every stage holds all M, which pipeline.all_forward_before_backward reports. Without stage
    information the rank is named and its spread verdict kept (`anomalous` when the spread
    is flagged, else `info`): the files do not say its pipeline stage (nor its TP rank, unless
    the recorder noted it). With TP (a TP degree over 1, analysis/mesh.py: the recorder's
    process groups name it, or the rank's blocks show TP's redistributions) the rank's TP index
    and degree are named too (`tp_rank`, `tp`): the ranks of one stage share its stage index."""
    if len(inputs) < 2:
        return None
    w = min(range(len(inputs)), key=lambda i: (-inputs[i]["peaks"]["overall_bytes"],
                                               inputs[i]["label"]))
    wi, others = inputs[w], [x for i, x in enumerate(inputs) if i != w]
    mine = wi["categories_at_peak"]
    names = sorted(set(mine).union(*(o["categories_at_peak"] for o in others)))
    extra = {c: int(mine.get(c, 0) - statistics.median(
        o["categories_at_peak"].get(c, 0) for o in others)) for c in names}
    cause = max(names, key=lambda c: (extra[c], c)) if names else None
    peak = int(wi["peaks"]["overall_bytes"])
    out: dict[str, Any] = {
        "label": wi["label"], "rank": wi["rank"], "peak_bytes": peak,
        "over_median_bytes": int(peak - spread["median_peak_bytes"]),
        "category": str(cause) if cause else None,
        "category_extra_bytes": extra[cause] if cause else 0,
        "stage": None, "stages": None, "schedule": None}
    # its place among the ranks that share its stage
    top = diags[w].primary
    layout = mesh(diags[w].provenance, top.parallel_dims if top else ())
    if layout.uses("tp"):
        out |= {"tp_rank": layout.index("tp"), "tp": layout.degree("tp")}
    pipes = [d.framework.get("pipeline") for d in diags]
    stages = [p.get("stage") if p else None for p in pipes]
    p = pipes[w]
    if p and None not in stages:  # TP ranks of one stage share it
        out |= {"stage": p["stage"], "stages": p["stages"], "schedule": p["schedule"]}
        if p["schedule"] == "gpipe":
            out |= {"verdict": Verdict.ANOMALOUS, "why": (
                "GPipe: every stage holds all micro-batches' activations until its backward "
                "(pipeline.all_forward_before_backward)")}
        elif p["stage"] == min(s for s in stages if s is not None) and cause == "activation":
            out |= {"verdict": Verdict.EXPECTED, "why": (
                f"1F1B: stage s of {p['stages']} holds at most min(M, {p['stages']} - s) "
                "micro-batches' activations, so the first stage holds the most: by design, "
                "not an imbalance to fix")}
        else:
            out |= {"verdict": Verdict.ANOMALOUS, "why": (
                f"1F1B holds fewer micro-batches on later stages, so its schedule does not "
                f"explain stage {p['stage']} peaking highest by {cause}")}
    else:
        flagged = bool(spread.get("flagged"))
        prov = diags[w].provenance if isinstance(diags[w].provenance, dict) else {}
        if type(prov.get("process_groups")) is list and not layout.uses("pp") and \
                "pp" not in layout.shown and not any(pipes):
            # the recorder notes a pipeline's stages and groups: none here, so every rank runs
            # the same layers and only the spread speaks
            why = ("no pipeline: the recorder saw no pipeline stage or group, so every rank "
                   "runs the same layers; " + (
                       f"{spread['worst']['label']} is {spread['worst']['deviation_pct']:+.1f}% "
                       f"off the median peak, beyond the {spread['threshold_pct']}% a balanced "
                       "job's ranks stay within" if flagged else "the ranks' peaks are within "
                       f"{spread['threshold_pct']}% of their median, as a balanced job's are"))
        else:
            why = "the files do not say its pipeline stage" + (
                "" if out.get("tp_rank") is not None else " or tensor-parallel rank")
        out |= {"verdict": Verdict.ANOMALOUS if flagged else Verdict.INFO, "why": why}
    return out


def _predictions(rows: list[dict[str, Any]], worst_first: list[tuple[dict, Diagnosis]]) -> None:
    """Each rule's peak predicted after its fix (and what that saves) on the worst rank that
    has the finding with a prediction, named by `predicted_on` (its label): the figure beside
    the worst rank's plot. Rules without a prediction anywhere get None."""
    for r in rows:
        hit = next(((inp, f) for inp, d in worst_first for f in d.findings
                    if f.rule == r["rule"] and f.predicted_peak_bytes is not None), None)
        r["predicted_peak_bytes"] = hit[1].predicted_peak_bytes if hit else None
        r["saving_bytes"] = hit[1].saving_bytes if hit else None
        r["predicted_on"] = hit[0]["label"] if hit else None


# A rank whose finding is off the others' median by more than OFF_RATIO and OFF_BYTES: every
# rank of a job runs the same code, so the same finding differs by the data it got and the
# process groups it is in; a quarter and 64 MiB (NCCL's 4 MiB buffers times 16 channels: one more
# communicator) is more than either explains on a balanced job.
OFF_RATIO, OFF_BYTES = 1.25, 64 << 20


def _off_median(ranks: list, sizes: list[int]) -> dict[str, Any]:
    """The ranks whose bytes are off the median (`off_ranks`, with `bytes_median`), from three
    ranks on (two have no majority to differ from)."""
    if len(sizes) < 3:
        return {"bytes_median": None, "off_ranks": []}
    med = sorted(sizes)[len(sizes) // 2]
    off = [rk for rk, b in zip(ranks, sizes) if abs(b - med) > OFF_BYTES
           and (b > med * OFF_RATIO or b * OFF_RATIO < med)]
    return {"bytes_median": med, "off_ranks": off}


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
              "bytes_min": min(b), "bytes_max": max(b), **_off_median(r["ranks"], b)}
        out.append(r)
    out.sort(key=lambda r: (_SEVERITY.get(r["verdict"], 3), -r["rank_count"], -r["bytes_max"]))
    return out
