"""Formatting shared by every renderer, so all formats say the same thing."""

from __future__ import annotations

from snapforensics.analysis.diagnosis import Diagnosis, Finding
from snapforensics.analysis.evidence import human

__all__ = ["human", "ratio", "headline", "peak_line", "provenance_line", "finding_lines",
           "phase_peaks", "verdict_order"]

VERDICT_ORDER = {"anomalous": 0, "expected": 1, "info": 2}


def verdict_order(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (VERDICT_ORDER.get(f.verdict, 3), -f.bytes))


def ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def headline(d: Diagnosis) -> str:
    n = len(d.anomalies)
    if n:
        top = max(d.anomalies, key=lambda f: f.saving_bytes or f.bytes)
        save = f", fixing it saves ~{human(top.saving_bytes)} of peak" if top.saving_bytes else ""
        return f"{n} anomal{'y' if n == 1 else 'ies'} found: {top.title}{save}"
    if not d.devices:
        return "empty snapshot: nothing was allocated"
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
    parts = [f"backend {f.get('backend', '?')}", f.get("era", "")]
    if d.rank is not None:
        parts.append(f"rank {d.rank}" + (f"/{p['world_size']}" if p.get("world_size") else ""))
    if p.get("stacks"):
        parts.append(f"stacks={p['stacks']}")
    if p.get("max_entries"):
        parts.append(f"max_entries={p['max_entries']}")
    if p.get("cpu_recorded"):
        parts.append("CPU-recorded (profiler allocator events, no caching allocator)")
    return ", ".join(x for x in parts if x)


def phase_peaks(iteration: dict) -> list[str]:
    """Recompute and optimizer peaks of one iteration ("-" where the phase did not occur)."""
    ph = iteration.get("phases", {})
    return [human(ph[p]["peak_bytes"]) if p in ph else "-" for p in ("recompute", "optimizer")]


def finding_lines(f: Finding) -> list[str]:
    """Key figures of a finding as short lines."""
    out = [f"{human(f.bytes)} in {f.blocks} blocks (device {f.device})"]
    if f.predicted_peak_bytes is not None:
        out.append(f"predicted peak after the fix: {human(f.predicted_peak_bytes)}"
                   + (f" (saves {human(f.saving_bytes)})" if f.saving_bytes else ""))
    return out
