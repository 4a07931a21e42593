"""Rich terminal output: the default for `diagnose`."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

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

COLOR = {"anomalous": "bold red", "expected": "green", "info": "cyan"}


def render(d: Diagnosis, console: Console) -> None:
    console.print(Text(f"snapforensics: {d.source}", style="bold"))
    console.print(Text(headline(d), style="bold red" if d.anomalies else "bold green"))
    console.print(peak_line(d))
    console.print(Text(provenance_line(d), style="dim"))
    for w in d.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))
    for dev in d.devices:
        t = Table(title=f"device {dev.device}: peak {human(dev.peaks['overall_bytes'])} "
                        f"in {dev.peak_phase}", title_justify="left", show_edge=False)
        t.add_column("alive at peak, by what made it")
        t.add_column("bytes", justify="right")
        t.add_column("share", justify="right")
        total = sum(dev.categories_at_peak.values()) or 1
        for c, b in sorted(dev.categories_at_peak.items(), key=lambda x: -x[1]):
            t.add_row(c, human(b), f"{100 * b / total:.0f}%")
        if dev.categories_at_peak:
            console.print(t)
        if len(dev.iterations) > 1 or any(i["backward_peak_bytes"] for i in dev.iterations):
            it = Table(show_edge=False)
            it.add_column("iteration")
            it.add_column("forward peak", justify="right")
            it.add_column("backward peak", justify="right")
            it.add_column("recompute peak", justify="right")
            it.add_column("optimizer peak", justify="right")
            for i in dev.iterations:
                it.add_row(str(i["index"]), human(i["forward_peak_bytes"]),
                           human(i["backward_peak_bytes"]), *phase_peaks(i))
            console.print(it)
        elif not dev.categories_at_peak:
            console.print(f"device {dev.device}: {human(dev.segments['allocated_bytes'])} "
                          f"allocated in {dev.segments['count']} segments "
                          f"({human(dev.segments['reserved_bytes'])} reserved) at dump")
    if not d.findings:
        console.print(Text("no findings", style="dim"))
    for f in verdict_order(d.findings):
        parts = [Text("\n".join(finding_lines(f)), style="bold"), Text(f.cause)]
        mods = f.evidence.get("modules") or []
        if mods:
            mt = Table(show_edge=False, box=None)
            mt.add_column("module")
            mt.add_column("bytes", justify="right")
            mt.add_column("blocks", justify="right")
            for m in mods[:8]:
                mt.add_row(m["module"], human(m["bytes"]), str(m["blocks"]))
            parts.append(mt)
        for s in (f.evidence.get("stacks") or [])[:1]:
            parts.append(Text("stack:\n  " + "\n  ".join(s["stack"][:8]), style="dim"))
        if f.fix:
            parts.append(Text("fix:", style="bold"))
            parts.append(Syntax(f.fix, "python", theme="ansi_dark", background_color="default"))
        console.print(Panel(Group(*parts), title=f"[{COLOR.get(f.verdict, '')}]"
                            f"{f.verdict.upper()}[/] {f.title}", subtitle=f.rule,
                            title_align="left", subtitle_align="right"))
