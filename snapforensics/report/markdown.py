"""Markdown: a report to paste into a bug ticket.

Every string from the snapshot goes through `sanitize.markdown` (text, headings, table cells)
or `sanitize.markdown_code` (fenced blocks): it cannot close a fence, start a heading, shift a
table cell, or carry raw HTML or a link.
"""

from __future__ import annotations

from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.report.common import (
    command_line,
    finding_lines,
    headline,
    human,
    peak_line,
    phase_peaks,
    provenance_line,
    verdict_order,
)
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import FRAME, FRAMES, ROWS, TEXT, lines
from snapforensics.report.sanitize import markdown as md
from snapforensics.report.sanitize import markdown_code as code
from snapforensics.report.sanitize import markdown_span as span


def render(d: Diagnosis, screen: Screen = PLAIN) -> str:
    out = [f"# snapforensics diagnosis: {md(d.source, FRAME)}", "",
           f"**{md(headline(d), TEXT)}**", "", f"- {md(peak_line(d), TEXT)}",
           f"- {md(provenance_line(d), TEXT)}"]
    cmd = command_line(d)
    if cmd:
        out.append(f"- command: {md(cmd, FRAME)}")
    out += [f"- ⚠ {md(w, TEXT)}" for w in d.warnings[:ROWS]]
    if len(d.warnings) > ROWS:
        out.append(f"- ⚠ … {len(d.warnings) - ROWS} more warnings")
    out.append("")
    for dev in d.devices:
        out += [f"## Device {dev.device}", "",
                f"Peak {human(dev.peaks['overall_bytes'])} in {md(dev.peak_phase)}; "
                + (f"{human(dev.segments['allocated_bytes'])} alive at dump (no caching "
                   "allocator on CPU)." if d.format.get("backend") == "cpu" else
                   f"segments reserved {human(dev.segments['reserved_bytes'])} at dump."), ""]
        if dev.iterations:
            out += ["| iteration | forward peak | backward peak | recompute peak "
                    "| optimizer peak |",
                    "|---|---|---|---|---|"]
            out += [f"| {it['index']} | {human(it['forward_peak_bytes'])} | "
                    f"{human(it['backward_peak_bytes'])} | {' | '.join(phase_peaks(it))} |"
                    for it in dev.iterations[:ROWS]]
            if len(dev.iterations) > ROWS:
                out.append(f"| … {len(dev.iterations) - ROWS} more | | | | |")
            out.append("")
        if dev.categories_at_peak:
            out += ["| alive at peak, by what made it | bytes |", "|---|---|"]
            out += [f"| {md(c)} | {human(b)} |" for c, b in
                    sorted(dev.categories_at_peak.items(), key=lambda x: -x[1])[:ROWS]]
            out.append("")
        if dev.top_stacks_at_peak:
            out += ["Top allocating stacks alive at the peak:", ""]
            for s in dev.top_stacks_at_peak[:3]:
                out.append(f"- {human(s['bytes'])} in {s['blocks']} blocks "
                           f"({md(s.get('category', '?'))})")
                out += [f"  {line}" for line in code(s["stack"][:8])]
            out.append("")
    out += ["## Findings", ""]
    if not d.findings:
        out += ["No findings.", ""]
    for f in verdict_order(d.findings):
        out += [f"### [{f.verdict.upper()}] {md(f.title)}", "", span(f.rule), ""]
        out += [f"- {md(line, TEXT)}" for line in finding_lines(d, f)]
        out += ["", md(f.cause, TEXT), ""]
        mods = f.evidence.get("modules") or []
        if mods:
            out += ["| module | bytes | blocks |", "|---|---|---|"]
            out += [f"| {md(m['module'])} | {human(m['bytes'])} | {m['blocks']} |"
                    for m in mods[:ROWS]]
            out.append("")
        for s in (f.evidence.get("stacks") or [])[:1]:
            out += ["Representative stack:", "", *code(s["stack"][:FRAMES]), ""]
        if f.fix:
            out += ["Fix:", "", *code(lines(f.fix, FRAMES), "python"), ""]
    return "\n".join(out)
