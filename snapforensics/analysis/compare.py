"""Compare several diagnoses: before/after a fix, or the ranks of one run.

Plain data only (no rendering, no torch). Everything is relative to the first input, the
baseline: for before/after that is the run with the bug, for ranks it is the first rank given.

    c = compare([diagnose(load("runs/buggy/rank0.pickle")), diagnose(load("runs/fixed/..."))])
    c.deltas[0]["peaks"]["overall_bytes"]["delta_pct"]        # -24.1
    c.deltas[0]["findings"]["disappeared"]                     # [{"rule": ..., "bytes": ...}]
    c.deltas[0]["predictions"][0]["error_pct"]                 # did the fix do what we said?

Finding and loading files is the runner layer's job (runner.py: compare_paths). Figures
are those of each diagnosis's primary device (the one with the highest peak), which is every
device of a one-GPU-per-rank snapshot.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapforensics import __version__
from snapforensics.analysis.diagnosis import Diagnosis, Finding
from snapforensics.analysis.evidence import human
from snapforensics.analysis.vocab import Verdict
from snapforensics.errors import SnapError

SCHEMA = "snapforensics.compare/1"

AUTO, BEFORE_AFTER, RANKS = "auto", "before_after", "ranks"
MODES = (AUTO, BEFORE_AFTER, RANKS)
PEAK_KEYS = ("overall_bytes", "forward_bytes", "backward_bytes")
# A rank whose peak is this far from the median is flagged as imbalanced.
IMBALANCE_THRESHOLD_PCT = 5.0
_SEVERITY = {Verdict.ANOMALOUS: 0, Verdict.EXPECTED: 1, Verdict.INFO: 2}


@dataclass
class Comparison:
    mode: str  # before_after | ranks
    inputs: list[dict[str, Any]]  # inputs[0] is the baseline
    deltas: list[dict[str, Any]]  # one per input after the first, each relative to inputs[0]
    imbalance: dict[str, Any] | None = None  # ranks mode only
    warnings: list[str] = field(default_factory=list)
    tool: str = f"snapforensics {__version__}"
    gate: list[str] | None = None  # why `--fail-on` failed ([] passed); None: no gate asked

    @property
    def baseline(self) -> dict[str, Any]:
        return self.inputs[0]

    def to_dict(self) -> dict[str, Any]:
        out = {"schema": SCHEMA, "tool": self.tool, "mode": self.mode,
               "baseline": self.inputs[0]["source"], "inputs": self.inputs,
               "deltas": self.deltas, "imbalance": self.imbalance, "warnings": self.warnings}
        return out if self.gate is None else out | {"gate": {"failures": self.gate}}


def compare(diags: Sequence[Diagnosis], mode: str = AUTO) -> Comparison:
    """Compare finished diagnoses, the first being the baseline."""
    if len(diags) < 2:
        raise SnapError(f"compare needs at least two snapshots, got {len(diags)}")
    if mode not in MODES:
        raise SnapError(f"unknown compare mode {mode!r} (one of {', '.join(MODES)})")
    labels = _labels([d.source for d in diags])
    inputs = [_input(d, label) for d, label in zip(diags, labels)]
    if mode == AUTO:
        mode = RANKS if _looks_like_ranks(diags) else BEFORE_AFTER
    base = diags[0]
    deltas = [_delta(base, inputs[0], d, inp, predictions=mode == BEFORE_AFTER)
              for d, inp in zip(diags[1:], inputs[1:])]
    return Comparison(mode=mode, inputs=inputs, deltas=deltas,
                      imbalance=_imbalance(inputs) if mode == RANKS else None,
                      warnings=_warnings(diags, inputs, mode))


def _labels(sources: list[str]) -> list[str]:
    """The shortest path tails that tell the inputs apart (`buggy/rank0.pickle`)."""
    parts = [[x for x in Path(s).parts if x not in ("/", "\\")] or [s] for s in sources]
    uniq = {tuple(p) for p in parts}
    for n in range(1, max(len(p) for p in parts) + 1):
        tails = ["/".join(p[-n:]) for p in parts]
        if len(set(tails)) == len(uniq):
            return tails
    return list(sources)


def _looks_like_ranks(diags: Sequence[Diagnosis]) -> bool:
    """Distinct known ranks of one run: same folder, or the same recorded command."""
    ranks = [d.rank for d in diags]
    if any(r is None for r in ranks) or len(set(ranks)) != len(ranks):
        return False
    same_dir = len({str(Path(d.source).resolve().parent) for d in diags}) == 1
    cmds = [d.provenance.get("command") for d in diags]
    same_cmd = cmds[0] is not None and all(c == cmds[0] for c in cmds)
    return same_dir or same_cmd


def _by_rule(findings: list[Finding]) -> dict[str, dict[str, Any]]:
    """Findings keyed by rule id, summed over devices; the most severe verdict wins."""
    out: dict[str, dict[str, Any]] = {}
    for f in findings:
        r = out.setdefault(f.rule, {"rule": f.rule, "verdict": f.verdict, "title": f.title,
                                    "bytes": 0, "blocks": 0, "devices": []})
        r["bytes"] += int(f.bytes)
        r["blocks"] += int(f.blocks)
        if f.device not in r["devices"]:
            r["devices"].append(f.device)
        if _SEVERITY.get(f.verdict, 3) < _SEVERITY.get(r["verdict"], 3):
            r["verdict"], r["title"] = f.verdict, f.title
    return out


def _input(d: Diagnosis, label: str) -> dict[str, Any]:
    p = d.primary
    return {
        "label": label,
        "source": d.source,
        "rank": d.rank,
        "device": p.device if p else None,
        "backend": d.format.get("backend"),
        "peaks": d.peaks,
        "peak_phase": p.peak_phase if p else None,
        "categories_at_peak": dict(p.categories_at_peak) if p else {},
        "findings": sorted(_by_rule(d.findings).values(),
                           key=lambda f: (_SEVERITY.get(f["verdict"], 3), -f["bytes"])),
        "anomalies": sorted({f.rule for f in d.anomalies}),
        "warnings": len(d.warnings),
    }


def _change(before: int, after: int) -> dict[str, Any]:
    return {"before": int(before), "after": int(after), "delta_bytes": int(after - before),
            "delta_pct": round(100.0 * (after - before) / before, 2) if before else None}


def _delta(base: Diagnosis, binp: dict, d: Diagnosis, inp: dict, *,
           predictions: bool) -> dict[str, Any]:
    peaks = {k: _change(binp["peaks"][k], inp["peaks"][k]) for k in PEAK_KEYS}
    ca, cb = binp["categories_at_peak"], inp["categories_at_peak"]
    cats = [{"category": c, **_change(ca.get(c, 0), cb.get(c, 0))} for c in set(ca) | set(cb)]
    cats.sort(key=lambda x: (-abs(x["delta_bytes"]), x["category"]))
    fa = {f["rule"]: f for f in binp["findings"]}
    fb = {f["rule"]: f for f in inp["findings"]}
    slim = ("rule", "verdict", "title", "bytes")
    findings = {
        "appeared": [{k: fb[r][k] for k in slim} for r in fb if r not in fa],
        "disappeared": [{k: fa[r][k] for k in slim} for r in fa if r not in fb],
        "persisted": [{"rule": r, "title": fb[r]["title"], "verdict_before": fa[r]["verdict"],
                       "verdict_after": fb[r]["verdict"], "bytes": fb[r]["bytes"],
                       **_change(fa[r]["bytes"], fb[r]["bytes"])}
                      for r in fa if r in fb],
    }
    out = {
        "baseline": binp["source"], "source": inp["source"], "label": inp["label"],
        "rank": inp["rank"], "peaks": peaks,
        "peak_phase": {"before": binp["peak_phase"], "after": inp["peak_phase"]},
        "categories_at_peak": cats,
        "removed_at_peak_bytes": -sum(x["delta_bytes"] for x in cats if x["delta_bytes"] < 0),
        "added_at_peak_bytes": sum(x["delta_bytes"] for x in cats if x["delta_bytes"] > 0),
        "findings": findings,
        "anomalies": {"before": len(binp["anomalies"]), "after": len(inp["anomalies"])},
    }
    if predictions:
        out["predictions"] = _predictions(base, d, fb)
    return out


def _predictions(base: Diagnosis, after: Diagnosis, fb: dict[str, dict]) -> list[dict]:
    """Each baseline anomaly's predicted peak after its fix vs the measured peak of `after`
    on the same device; `fixed` when that anomaly is gone (or no longer anomalous) there."""
    best: dict[tuple[str, int], Finding] = {}
    for f in base.anomalies:
        if f.predicted_peak_bytes is None:
            continue
        k = (f.rule, f.device)
        if k not in best or (f.saving_bytes or 0) > (best[k].saving_bytes or 0):
            best[k] = f
    out: list[dict[str, Any]] = []
    for (rule, dev), f in best.items():
        bdev = next((x for x in base.devices if x.device == dev), base.primary)
        adev = next((x for x in after.devices if x.device == dev), after.primary)
        if bdev is None or adev is None:
            continue
        measured = int(adev.peaks["overall_bytes"])
        before = int(bdev.peaks["overall_bytes"])
        pred = int(f.predicted_peak_bytes or 0)  # never None: filtered above
        out.append({
            "rule": rule, "device": dev,
            "fixed": rule not in fb or fb[rule]["verdict"] != Verdict.ANOMALOUS,
            "baseline_peak_bytes": before,
            "predicted_peak_bytes": pred,
            "measured_peak_bytes": measured,
            "predicted_saving_bytes": before - pred,
            "measured_saving_bytes": before - measured,
            "error_bytes": pred - measured,
            "error_pct": round(100.0 * (pred - measured) / measured, 2) if measured else None,
        })
    out.sort(key=lambda x: (not x["fixed"], -x["predicted_saving_bytes"]))
    return out


def _imbalance(inputs: list[dict]) -> dict[str, Any]:
    """How far each rank's peak is from the median; the one furthest off is named."""
    peaks = [i["peaks"]["overall_bytes"] for i in inputs]
    med = statistics.median(peaks)
    per = [{"label": i["label"], "source": i["source"], "rank": i["rank"],
            "peak_bytes": p,
            "deviation_bytes": int(p - med),
            "deviation_pct": round(100.0 * (p - med) / med, 2) if med else 0.0}
           for i, p in zip(inputs, peaks)]
    worst = max(per, key=lambda x: (abs(x["deviation_bytes"]), x["peak_bytes"]))
    return {
        "median_peak_bytes": int(med),
        "min_peak_bytes": int(min(peaks)),
        "max_peak_bytes": int(max(peaks)),
        "spread_pct": round(100.0 * (max(peaks) - min(peaks)) / med, 2) if med else 0.0,
        "worst": {k: worst[k] for k in ("label", "source", "rank", "peak_bytes",
                                        "deviation_bytes", "deviation_pct")},
        "threshold_pct": IMBALANCE_THRESHOLD_PCT,
        "flagged": abs(worst["deviation_pct"]) >= IMBALANCE_THRESHOLD_PCT,
        "ranks": per,
    }


def _warnings(diags: Sequence[Diagnosis], inputs: list[dict], mode: str) -> list[str]:
    out = []
    backends = {i["backend"] for i in inputs}
    if len(backends) > 1:
        out.append("inputs come from different backends (" + ", ".join(sorted(map(str, backends)))
                   + "): CPU-recorded peaks have no caching allocator, so sizes differ")
    for i, d in zip(inputs, diags):
        if not any(dev.history.get("rows") for dev in d.devices):
            out.append(f"{i['label']}: no allocation history, its peak is what was alive at "
                       "dump time")
        elif any(dev.history.get("truncated") for dev in d.devices):
            # what was alive before the first entry is counted in the peak from the start
            # (lifetimes.py); only a history that starts mid-run (frees of blocks it never saw
            # made: a wrapped ring buffer) can have missed a higher moment
            base = max((v for dev in d.devices
                        if type(v := dev.history.get("baseline_bytes")) is int), default=0)
            cut = any(dev.history.get("orphan_frees") for dev in d.devices)
            out.append(f"{i['label']}: {human(base)} was alive before its history starts "
                       "(counted in its peak, without the stacks that made it)" +
                       ("; the history starts mid-run, so an earlier, higher moment may be "
                        "missing" if cut else ""))
    if mode == RANKS:
        ranks = [i["rank"] for i in inputs]
        if any(r is None for r in ranks):
            out.append("some inputs show no rank (in the file or its name): labelled by file")
        elif len(set(ranks)) != len(ranks):
            out.append("the same rank is given more than once")
        # a stranger's provenance may hold anything: only an int is a world size
        ws = {w for d in diags if type(w := d.provenance.get("world_size")) is int}
        if len(ws) == 1 and None not in ranks:
            missing = sorted(set(range(next(iter(ws)))) - set(ranks))
            if missing:
                out.append(f"world size {next(iter(ws))}: rank(s) "
                           f"{', '.join(map(str, missing[:16]))}"
                           f"{' ...' if len(missing) > 16 else ''} not given")
    return out
