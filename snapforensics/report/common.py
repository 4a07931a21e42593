"""Words shared by every renderer, so all formats say the same thing in the same order.

These build raw sentences (names from the snapshot capped, not yet escaped); each renderer
passes them through its sink's function in report/sanitize.py.
"""

from __future__ import annotations

from snapforensics.analysis.diagnosis import Diagnosis, Finding, saving_rank
from snapforensics.analysis.evidence import human
from snapforensics.analysis.vocab import Verdict
from snapforensics.report.sanitize import NAME, cap

__all__ = [
    "by_saving",
    "finding_lines",
    "headline",
    "human",
    "peak_line",
    "phase_peaks",
    "provenance_line",
    "ratio",
    "saving_peak",
    "verdict_order",
]

VERDICT_ORDER = {Verdict.ANOMALOUS: 0, Verdict.EXPECTED: 1, Verdict.INFO: 2}
# An info finding whose fix would save at least this share of the peak is named in the
# headline even without an anomaly: a fifth of the peak is the same bar the fragmentation rule
# uses for "significant", and a saving a user would act on before buying memory.
HEADLINE_INFO_SHARE = 0.20
# Rules whose saving is reserved memory (what the caching allocator holds), not allocated
# memory: their "% of peak" is of the reserved peak, and they say so.
RESERVED_SAVING_RULES = frozenset({"allocator.fragmentation"})


def by_saving(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=saving_rank, reverse=True)


def verdict_order(findings: list[Finding]) -> list[Finding]:
    """Anomalies first, then expected, then info; inside each, by peak saving then bytes."""
    return sorted(by_saving(findings), key=lambda f: VERDICT_ORDER.get(f.verdict, 3))


def ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def saving_peak(d: Diagnosis, f: Finding) -> tuple[str, int]:
    """Which peak `f.saving_bytes` is a saving of ("reserved" or "allocated") and its size."""
    dev = next((x for x in d.devices if x.device == f.device), d.primary)
    if f.rule in RESERVED_SAVING_RULES:
        ev = f.evidence or {}
        res = ev.get("reserved_peak_bytes") or (ev.get("at_dump") or {}).get("reserved_bytes")
        return "reserved", int(res or (dev.segments.get("reserved_bytes", 0) if dev else 0))
    return "allocated", int(dev.peaks["overall_bytes"] if dev else d.peaks["overall_bytes"])


def _saving(d: Diagnosis, f: Finding) -> str:
    kind, peak = saving_peak(d, f)
    share = f" ({100 * f.saving_bytes / peak:.0f}% of the {kind} peak)" if peak else ""
    return f"~{human(f.saving_bytes)}{share}"


def headline(d: Diagnosis) -> str:
    anomalies = by_saving(d.anomalies)
    if anomalies:
        n, top = len(anomalies), anomalies[0]
        save = f", fixing it saves {_saving(d, top)}" if top.saving_bytes else ""
        return f"{n} anomal{'y' if n == 1 else 'ies'} found: {cap(top.title, NAME)}{save}"
    if not d.devices:
        return "empty snapshot: nothing was allocated"
    for f in by_saving([f for f in d.findings if f.verdict == Verdict.INFO and f.saving_bytes]):
        peak = saving_peak(d, f)[1]
        if peak and f.saving_bytes >= HEADLINE_INFO_SHARE * peak:
            return f"no anomaly; {cap(f.title, NAME)} would save {_saving(d, f)}"
    return "no anomaly found"


def peak_line(d: Diagnosis) -> str:
    p = d.peaks
    if p["forward_bytes"] and p["backward_bytes"]:
        return (f"peak {human(p['overall_bytes'])}; forward {human(p['forward_bytes'])}, "
                f"backward {human(p['backward_bytes'])} "
                f"(backward/forward {ratio(p['backward_bytes'], p['forward_bytes'])})")
    return f"peak {human(p['overall_bytes'])}"


def provenance_line(d: Diagnosis) -> str:
    f, p = d.format, d.provenance
    parts = [f"backend {cap(f.get('backend', '?'), NAME)}", cap(f.get("era", ""), NAME)]
    if d.rank is not None:
        ws = p.get("world_size")
        parts.append(f"rank {d.rank}" + (f"/{cap(ws, NAME)}" if ws else ""))
    if p.get("stacks"):
        parts.append(f"stacks={cap(p['stacks'], NAME)}")
    if p.get("max_entries"):
        parts.append(f"max_entries={cap(p['max_entries'], NAME)}")
    if p.get("cpu_recorded"):
        parts.append("CPU-recorded (profiler allocator events, no caching allocator)")
    ranges = f.get("ranges")
    if isinstance(ranges, str) and ranges.startswith(("recording thread only (", "none (")):
        parts.append(f"record_function ranges: {cap(ranges, NAME)}")
    return ", ".join(x for x in parts if x)


def command_line(d: Diagnosis) -> str | None:
    cmd = d.provenance.get("command")
    if not cmd:
        return None
    return " ".join(map(str, cmd[:64])) if isinstance(cmd, (list, tuple)) else str(cmd)


def phase_peaks(iteration: dict) -> list[str]:
    """Recompute and optimizer peaks of one iteration ("-" where the phase did not occur)."""
    ph = iteration.get("phases", {})
    return [human(ph[p]["peak_bytes"]) if p in ph else "-" for p in ("recompute", "optimizer")]


def finding_lines(d: Diagnosis, f: Finding) -> list[str]:
    """Key figures of a finding as short lines."""
    out = [f"{human(f.bytes)} in {f.blocks} blocks (device {f.device})"]
    if f.predicted_peak_bytes is not None:
        out.append(f"predicted peak after the fix: {human(f.predicted_peak_bytes)}"
                   + (f", saving {_saving(d, f)}" if f.saving_bytes else ""))
    elif f.saving_bytes:
        out.append(f"the fix saves {_saving(d, f)}")
    return out
