"""The facade: a loaded Snapshot in, one finished Diagnosis out."""

from __future__ import annotations

import re

import numpy as np

from snapforensics import __version__
from snapforensics.analysis import compiled, identity, timeline
from snapforensics.analysis.context import DeviceAnalysis, analyse
from snapforensics.analysis.diagnosis import (
    TENSORS,
    DeviceSummary,
    Diagnosis,
    Finding,
    top_anomaly,
)
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.evidence import peaks as phase_peaks
from snapforensics.analysis.frameworks import detect as frameworks
from snapforensics.analysis.frameworks import fixes as framework_fixes
from snapforensics.analysis.lifetimes import Lifetimes
from snapforensics.analysis.rules import run_rules
from snapforensics.analysis.vocab import Phase
from snapforensics.snapshot.model import Snapshot, Trace


def diagnose(snapshot: Snapshot, categories: dict[str, re.Pattern] | None = None) -> Diagnosis:
    return diagnose_devices(snapshot, categories)[0]


def diagnose_devices(snapshot: Snapshot, categories: dict[str, re.Pattern] | None = None,
                     lifetimes: dict[int, Lifetimes] | None = None,
                     columns: dict[int, dict[str, np.ndarray]] | None = None
                     ) -> tuple[Diagnosis, list[DeviceAnalysis]]:
    """The Diagnosis and the per-device analyses it was made from (for the Python API).

    `categories`: user categories (name -> regex on stack frames and range names), applied
    after the rules ran (see `DeviceAnalysis.add_categories`). `lifetimes`: devices' lifetimes
    already paired (by device; the cache's); `columns`: with them, each device's
    `context.columns` of an earlier analysis (the cache's)."""
    analyses = [analyse(snapshot, t, (lifetimes or {}).get(t.device),
                        (columns or {}).get(t.device) if lifetimes else None)
                for t in snapshot.active_traces]
    findings = [f for d in analyses for f in run_rules(d)]
    _name_findings(findings, analyses)
    framework = frameworks.detect(snapshot, analyses)
    framework_fixes.localize(findings, framework)
    warnings = list(snapshot.warnings)
    code = snapshot.provenance.get("script_exit_code") \
        if isinstance(snapshot.provenance, dict) else None
    if type(code) is int and code != 0:  # the recorder keeps the script's exit code
        warnings.append(f"the recorded script exited with code {code}: the trace ends where it "
                        "failed, and a step it did not finish is not in it")
    for d in analyses:
        d.add_categories(categories or {})
    summaries = [_summary(snapshot, d, findings) for d in analyses]
    for d in analyses:
        if d.lt.reused_addresses:
            warnings.append(f"device {d.device}: {d.lt.reused_addresses} allocations reuse an "
                            "address whose block was never freed in the trace (lost free "
                            "entries); each such block is taken as freed there")
        if d.lt.rows and d.lt.baseline > int(d.lt.live.max()):
            warnings.append(f"device {d.device}: memory was highest before the first trace "
                            f"entry ({human(d.lt.baseline)} alive then); the trace shows only "
                            "its decline, so the peak's makeup is unknown")
        if d.lt.truncated:
            warnings.append(
                f"device {d.device}: history is truncated (ring buffer wrapped or recording "
                f"started mid-run): {d.lt.orphan_frees} frees with no alloc, {d.lt.unseen_live} "
                f"blocks alive at dump with no alloc; {human(d.lt.baseline)} alive before the "
                "first entry is counted from its start, with no stack for what made it")
    seen = {d.device for d in analyses}
    for dev in sorted({s.device for s in snapshot.segments} - seen):
        summaries.append(_segments_only(snapshot, dev))
        findings += run_rules(analyse(snapshot, Trace.empty(dev)))
    if not any(len(t) for t in snapshot.traces):
        warnings.append("no allocation history in this snapshot (recorded without "
                        "_record_memory_history, or a segments-only dump): figures come from the "
                        "segments alive at dump time only")
    diagnosis = Diagnosis(source=snapshot.source, rank=snapshot.rank, format=snapshot.format,
                          provenance=snapshot.provenance, warnings=warnings, devices=summaries,
                          findings=findings, tool=f"snapforensics {__version__}",
                          framework=framework.to_dict())
    return diagnosis, analyses


def _name_findings(findings: list[Finding], analyses: list[DeviceAnalysis]) -> None:
    """Every rule that lists its blocks gets their tensor names, where the file has them (one
    mechanism for all rules: `identity.finding_tensors` over `Finding.members`)."""
    by_device = {d.device: d for d in analyses}
    for f in findings:
        d = by_device.get(f.device)
        if f.members is None or d is None or d.names is None or TENSORS in f.evidence:
            continue
        named = identity.finding_tensors(d.names, d.lt, f.members)
        if named:
            f.evidence[TENSORS] = named


def _summary(snapshot: Snapshot, d: DeviceAnalysis, findings: list[Finding]) -> DeviceSummary:
    lt, tl = d.lt, d.tl
    peaks = phase_peaks(d, lt.live) | {"overall_bytes": d.peak_bytes}
    alive = np.flatnonzero(lt.alive_at(d.peak_row)) if d.peak_row >= 0 else np.zeros(0, int)
    names = d.category_names
    at_peak = {c: int(lt.size[alive][d.category[alive] == i].sum())
               for i, c in enumerate(names)}
    totals = {c: {"bytes": int(lt.size[d.category == i].sum()),
                  "blocks": int((d.category == i).sum())} for i, c in enumerate(names)}
    stacks = top_stacks(d, alive, 5)
    top = top_anomaly([f for f in findings if f.device == d.device])
    plot = timeline.build(d, top, d.allocator.reserved if snapshot.kind.caching_allocator
                          else None)
    return DeviceSummary(
        device=d.device,
        peaks=peaks,
        peak_row=d.peak_row,
        peak_phase=d.phase_name(d.peak_row),
        iterations=[_iteration(d, it) for it in tl.iterations],
        categories_at_peak={k: v for k, v in at_peak.items() if v},
        categories_total={k: v for k, v in totals.items() if v["blocks"]},
        top_stacks_at_peak=stacks,
        history={"rows": lt.rows, "allocations": int((lt.alloc_row >= 0).sum()),
                 "orphan_frees": lt.orphan_frees, "unseen_live_blocks": lt.unseen_live,
                 "truncated": lt.truncated, "baseline_bytes": lt.baseline},
        segments=snapshot.segment_totals(d.device),
        timeline=plot.timeline_rows() if plot else [],
        tensors=identity.summary(d, d.names) if d.names is not None else
        _without_names(snapshot),
        compiled=compiled.summary(d, d.compiled) if d.compiled is not None else None,
        parallel_dims=sorted(d.layout.shown),
        plot=plot,
    )


def _without_names(snapshot: Snapshot) -> dict:
    """`identity.without_names`, once per file (a file may have thousands of devices)."""
    cached = getattr(snapshot, "_without_names", None)
    if cached is None:
        cached = identity.without_names(snapshot)
        object.__setattr__(snapshot, "_without_names", cached)
    return cached


def _iteration(d: DeviceAnalysis, it) -> dict:
    """One iteration: its peaks, and the peak and share of rows of each phase in it."""
    ph = d.tl.phase[it.start:it.end + 1]
    live = d.lt.live[it.start:it.end + 1]
    phases = {}
    for phase in Phase:
        m = ph == phase
        if m.any():
            phases[phase.label] = {"peak_bytes": int(live[m].max()), "rows": int(m.sum())}
    return {"index": it.index, "forward_peak_bytes": it.forward_peak,
            "backward_peak_bytes": it.backward_peak, "start_row": it.start, "end_row": it.end,
            "phases": phases}


def _segments_only(snapshot: Snapshot, device: int) -> DeviceSummary:
    seg = snapshot.segment_totals(device)
    return DeviceSummary(
        device=device,
        peaks={"forward_bytes": 0, "backward_bytes": 0, "overall_bytes": seg["allocated_bytes"]},
        peak_row=-1, peak_phase="dump", iterations=[], categories_at_peak={},
        categories_total={}, top_stacks_at_peak=[],
        history={"rows": 0, "allocations": 0, "orphan_frees": 0, "unseen_live_blocks": 0,
                 "truncated": False, "baseline_bytes": 0},
        segments=seg,
    )
