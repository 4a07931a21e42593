"""Markdown: a report to paste into a bug ticket.

Every string from the snapshot goes through `sanitize.markdown` (text, headings, table cells)
or `sanitize.markdown_code` (fenced blocks), or `sanitize.html` inside the `<summary>` of a
collapsed stack: it cannot close a fence, start a heading, shift a table cell, or carry raw HTML
or a link. The timeline is a Mermaid chart (report/mermaid.py: it survives pasting into an
issue); `-o report.md` also writes the full plot as `report.png` beside it (`render_beside`)
and says to attach it.
"""

from __future__ import annotations

from pathlib import Path

from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.report import mermaid
from snapforensics.report.common import (
    command_line,
    compiled_lines,
    compiled_regions,
    dump_line,
    finding_lines,
    framework_line,
    headline,
    human,
    largest_named,
    names_line,
    no_names,
    peak_line,
    peak_stacks,
    phase_peaks,
    provenance_line,
    saved_by_layer,
    tensor_names,
    verdict_order,
)
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import FRAME, FRAMES, ROWS, TEXT, html, lines
from snapforensics.report.sanitize import markdown as md
from snapforensics.report.sanitize import markdown_code as code
from snapforensics.report.sanitize import markdown_span as span


def render(d: Diagnosis, screen: Screen = PLAIN, image: str | None = None) -> str:
    """`image`: the timeline plot's PNG written beside the report (`render_beside`)."""
    out = [f"# snapforensics diagnosis: {md(d.source, FRAME)}", "",
           f"**{md(headline(d), TEXT)}**", ""]
    top = d.top
    if top is not None and top.fix:
        after = (f", predicted peak after it {human(top.predicted_peak_bytes)}"
                 if top.predicted_peak_bytes else "")
        out += [f"Fix first ({span(top.rule)}{after}):", "",
                *code(lines(top.fix, FRAMES), "python"), ""]
    out += _pictures(d, image)
    out += [f"- {md(peak_line(d), TEXT)}", f"- {md(provenance_line(d), TEXT)}"]
    fw = framework_line(d)
    if fw:
        out.append(f"- {md(fw, TEXT)}")
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
                f"{md(dump_line(d, dev), TEXT)}.", ""]
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
            total = sum(dev.categories_at_peak.values()) or 1
            out += ["| alive at peak, by what made it | bytes | share |", "|---|--:|--:|"]
            out += [f"| {md(c)} | {human(b)} | {100 * b / total:.0f}% |" for c, b in
                    sorted(dev.categories_at_peak.items(), key=lambda x: -x[1])[:ROWS]]
            out.append("")
        out += _names(dev) + _compiled(dev)
        if dev.top_stacks_at_peak:
            out += ["Top allocating stacks alive at the peak:", ""]
            for s in peak_stacks(dev)[:3]:
                out += _details(f"{human(s['bytes'])} in {s['blocks']} blocks "
                                f"({s.get('category', '?')})", s["stack"][:8])
    out += _no_names(d)
    out += ["## Findings", ""]
    if not d.findings:
        out += ["No findings.", ""]
    for f in verdict_order(d.findings):
        out += [f"### [{f.verdict.upper()}] {md(f.title)}", "", span(f.rule), ""]
        out += [f"- {md(line, TEXT)}" for line in finding_lines(d, f)]
        out += ["", md(f.cause, TEXT), ""]
        mods = f.modules
        if mods:
            out += ["| module | bytes | blocks |", "|---|---|---|"]
            out += [f"| {md(m['module'])} | {human(m['bytes'])} | {m['blocks']} |"
                    for m in mods[:ROWS]]
            out.append("")
        named = largest_named(f.tensors)
        if named:
            out += ["| tensor | kind | shape | bytes |", "|---|---|---|--:|"]
            out += [f"| {md(a)} | {md(k)} | {md(sh)} | {human(b)} |" for a, k, sh, b in named]
            out.append("")
        if f.fix:
            out += ["Fix:", "", *code(lines(f.fix, FRAMES), "python"), ""]
        for s in f.stacks[:1]:
            out += _details("Representative stack", s["stack"][:FRAMES])
    return "\n".join(out)


def _names(dev) -> list[str]:
    """The recorder's tensor names: coverage, saved for backward by layer, largest tensors."""
    t = tensor_names(dev)
    if t is None:
        return []
    out = [md(names_line(t), TEXT) + ".", ""]
    rows = saved_by_layer(t)
    if rows:
        out += [f"Saved for backward, by layer (alive at the peak: "
                f"{human(sum(r[1] for r in rows))}):", "",
                "| layer | bytes | tensors | inside |", "|---|--:|--:|---|"]
        out += [f"| {md(a)} | {human(b)} | {n} | {md(i, TEXT)} |" for a, b, n, i in rows[:ROWS]]
        out.append("")
    big = largest_named(t)
    if big:
        out += ["| largest named at the peak | kind | shape | bytes |", "|---|---|---|--:|"]
        out += [f"| {md(a)} | {md(k)} | {md(s)} | {human(b)} |" for a, k, s, b in big]
        out.append("")
    return out


def _compiled(dev) -> list[str]:
    """The torch.compile regions that made blocks, and what of the peak each holds."""
    comp = compiled_regions(dev)
    if comp is None:
        return []
    out = [md(comp[0], TEXT) + ":", "",
           "| region | source | forward at peak | backward at peak | blocks |",
           "|---|---|--:|--:|--:|"]
    out += [f"| {md(r)} | {md(src, TEXT)} | {human(fw)} | {human(bw)} | {n} |"
            for r, src, fw, bw, n in comp[1][:ROWS]]
    lines = compiled_lines(dev)
    if lines is not None:
        out += ["", md(lines[0], TEXT) + ":", "",
                "| model line | buffers | pass | at peak | allocated |", "|---|---|---|--:|--:|"]
        out += [f"| {md(ln, TEXT)} | {md(b, TEXT)} | {md(ps, TEXT)} | {human(pk)} | {human(mk)} |"
                for ln, b, ps, pk, mk in lines[1][:ROWS]]
    return out + [""]


def _no_names(d: Diagnosis) -> list[str]:
    t = no_names(d)
    if t is None:
        return []
    out = ["## Tensor names", "", "This dump has no tensor names. What it can say:", ""]
    out += [f"- {md(s, TEXT)}" for s in (t.get("said") or [])[:ROWS]]
    out += ["", "The next dump with names:", "", *code([str(t.get("recipe", ""))], "python"),
            ""]
    return out


def _pictures(d: Diagnosis, image: str | None) -> list[str]:
    """The timeline where the report is pasted: a Mermaid chart per device (GitHub and GitLab
    render it), and one line about the PNG with categories and phases: attach it (a relative
    image link breaks once the text is pasted into an issue), or how to get it."""
    charts = [line for dev in d.devices for line in [*mermaid.chart(dev), ""]
              if mermaid.chart(dev)]
    if not charts:
        return []
    if image:
        note = (f"The full plot (live bytes by what made them, phases, the peak) is `{image}`, "
                "written beside this file: attach it to the ticket (drag it into the issue).")
    elif any(dev.plot is not None for dev in d.devices):
        note = ("The full plot (live bytes by what made them, phases, the peak): write this "
                "report with `-o report.md`, which also writes `report.png` to attach.")
    else:
        note = ("The full plot (live bytes by what made them, phases, the peak): "
                "`snapforensics diagnose` of one file with `-o report.md` also writes "
                "`report.png` to attach.")
    return [*charts, note, ""]


def _details(summary: str, stack: list[str]) -> list[str]:
    """A collapsed stack: GitHub and GitCode render `<details>` with a fenced block inside
    when blank lines separate them. The summary is HTML there: it takes the HTML sink's
    neutralizer, the block the fence's."""
    return [f"<details><summary>{html(summary, TEXT)}</summary>", "", *code(stack), "",
            "</details>", ""]


def render_beside(d: Diagnosis, path: Path) -> str:
    """The report for `-o FILE`: the timeline plot is written beside it (FILE with .png) with
    matplotlib, and linked by its name."""
    from snapforensics.report import plot
    from snapforensics.report.output import write_file

    series = [dev.plot for dev in d.devices if dev.plot is not None]
    image = Path(path).with_suffix(".png") if series else None
    if image is not None:
        write_file(image, plot.png(series))
    return render(d, PLAIN, image.name if image else None)
