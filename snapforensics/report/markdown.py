"""Markdown: a report to paste into a bug ticket."""

from __future__ import annotations

from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.report.common import (
    finding_lines,
    headline,
    human,
    peak_line,
    phase_peaks,
    provenance_line,
    verdict_order,
)


def render(d: Diagnosis, image: str | None = None) -> str:
    """`image`: the timeline plot's PNG, written beside the report (`-o report.md`)."""
    out = [f"# snapforensics diagnosis: `{d.source}`", "",
           f"**{headline(d)}**", ""]
    if d.top is not None and d.top.fix:
        out += [f"Fix first ({d.top.rule}"
                + (f", predicted peak after it {human(d.top.predicted_peak_bytes)}"
                   if d.top.predicted_peak_bytes else "") + "):", "",
                "```python", d.top.fix, "```", ""]
    if image:
        out += [f"![live bytes over time by category; the predicted curve after the fix]"
                f"({image})", ""]
    out += [f"- {peak_line(d)}", f"- {provenance_line(d)}"]
    if d.provenance.get("command"):
        out.append(f"- command: `{' '.join(map(str, d.provenance['command']))}`")
    for w in d.warnings:
        out.append(f"- ⚠ {w}")
    out.append("")
    for dev in d.devices:
        out += [f"## Device {dev.device}", "",
                f"Peak {human(dev.peaks['overall_bytes'])} in {dev.peak_phase}; "
                + (f"{human(dev.segments['allocated_bytes'])} alive at dump (no caching "
                   "allocator on CPU)." if d.format.get("backend") == "cpu" else
                   f"segments reserved {human(dev.segments['reserved_bytes'])} at dump."), ""]
        if dev.iterations:
            out += ["| iteration | forward peak | backward peak | recompute peak "
                    "| optimizer peak |",
                    "|---|---|---|---|---|"]
            out += [f"| {it['index']} | {human(it['forward_peak_bytes'])} | "
                    f"{human(it['backward_peak_bytes'])} | {' | '.join(phase_peaks(it))} |"
                    for it in dev.iterations]
            out.append("")
        if dev.categories_at_peak:
            total = sum(dev.categories_at_peak.values()) or 1
            out += ["| alive at peak, by what made it | bytes | share |", "|---|--:|--:|"]
            out += [f"| {c} | {human(b)} | {100 * b / total:.0f}% |" for c, b in
                    sorted(dev.categories_at_peak.items(), key=lambda x: -x[1])]
            out.append("")
        if dev.top_stacks_at_peak:
            out += ["Top allocating stacks alive at the peak:", ""]
            for s in dev.top_stacks_at_peak[:3]:
                out += _details(f"{human(s['bytes'])} in {s['blocks']} blocks "
                                f"({s.get('category', '?')})", s["stack"][:8])
    out += ["## Findings", ""]
    if not d.findings:
        out += ["No findings.", ""]
    for f in verdict_order(d.findings):
        out += [f"### [{f.verdict.upper()}] {f.title}", "", f"`{f.rule}`", ""]
        out += [f"- {line}" for line in finding_lines(f)]
        out += ["", f.cause, ""]
        mods = f.evidence.get("modules") or []
        if mods:
            out += ["| module | bytes | blocks |", "|---|---|---|"]
            out += [f"| {m['module']} | {human(m['bytes'])} | {m['blocks']} |" for m in mods]
            out.append("")
        if f.fix:
            out += ["Fix:", "", "```python", f.fix, "```", ""]
        for s in (f.evidence.get("stacks") or [])[:1]:
            out += _details("Representative stack", s["stack"])
    return "\n".join(out)


def _details(summary: str, stack: list[str]) -> list[str]:
    """A collapsed stack: GitHub and GitCode render `<details>` with a fenced block inside
    when blank lines separate them."""
    return [f"<details><summary>{summary}</summary>", "", "```", *stack, "```", "", "</details>",
            ""]
