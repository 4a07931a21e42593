"""Terminal text: the default for `diagnose`, coloured for a real terminal, plain otherwise.

Every string from the snapshot passes `sanitize.terminal` and reaches rich as `Text` (markup
parsing is off on the console): nothing in a file can move the cursor or make a live link.
The fix is printed as plain lines, outside any border and never wrapped, so it can be copied
from an 80-column terminal; stack paths drop their site-packages prefix.
"""

from __future__ import annotations

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from snapforensics.analysis.diagnosis import Diagnosis, Finding
from snapforensics.report.common import (
    command_line,
    compiled_lines,
    compiled_regions,
    finding_lines,
    framework_line,
    headline,
    human,
    largest_named,
    names_line,
    no_names,
    peak_line,
    phase_peaks,
    provenance_line,
    saved_by_layer,
    tensor_names,
    verdict_order,
)
from snapforensics.report.redact import short_path
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import (
    FRAME,
    FRAMES,
    NAME,
    ROWS,
    TEXT,
    lines,
    terminal,
)

COLOR = {"anomalous": "bold red", "expected": "green", "info": "cyan"}


def t(s: object, limit: int = NAME, style: str = "") -> Text:
    """Untrusted text for rich: neutralized, capped, never markup."""
    return Text(terminal(s, limit), style=style)


def render(d: Diagnosis, screen: Screen = PLAIN) -> str:
    console = screen.console()
    console.print(t(f"snapforensics: {d.source}", FRAME, "bold"))
    console.print(t(headline(d), TEXT, "bold red" if d.anomalies else "bold green"))
    console.print(t(peak_line(d), TEXT))
    console.print(t(provenance_line(d), TEXT, "dim"))
    fw = framework_line(d)
    if fw:
        console.print(t(fw, TEXT, "dim"))
    cmd = command_line(d)
    if cmd:
        console.print(t(f"command: {cmd}", FRAME, "dim"))
    for w in d.warnings[:ROWS]:
        console.print(t(f"warning: {w}", TEXT, "yellow"))
    if len(d.warnings) > ROWS:
        console.print(t(f"… {len(d.warnings) - ROWS} more warnings", style="yellow"))
    for dev in d.devices:
        _device(console, d, dev)
    _no_names(console, d)
    if not d.findings:
        console.print(Text("no findings", style="dim"))
    for f in verdict_order(d.findings):
        _finding(console, d, f)
    return console.file.getvalue()


def _device(console: Console, d: Diagnosis, dev) -> None:
    if dev.categories_at_peak:
        tab = Table(title=t(f"device {dev.device}: peak {human(dev.peaks['overall_bytes'])} in "
                            f"{dev.peak_phase}"), title_justify="left", show_edge=False)
        tab.add_column("alive at peak, by what made it")
        tab.add_column("bytes", justify="right")
        tab.add_column("share", justify="right")
        total = sum(dev.categories_at_peak.values()) or 1
        for c, b in sorted(dev.categories_at_peak.items(), key=lambda x: -x[1])[:ROWS]:
            tab.add_row(t(c), human(b), f"{100 * b / total:.0f}%")
        console.print(tab)
    if len(dev.iterations) > 1 or any(i["backward_peak_bytes"] for i in dev.iterations):
        it = Table(show_edge=False)
        for name in ("iteration", "forward peak", "backward peak", "recompute peak",
                     "optimizer peak"):
            it.add_column(name, justify="left" if name == "iteration" else "right")
        for i in dev.iterations[:ROWS]:
            it.add_row(str(i["index"]), human(i["forward_peak_bytes"]),
                       human(i["backward_peak_bytes"]), *phase_peaks(i))
        console.print(it)
        if len(dev.iterations) > ROWS:
            console.print(Text(f"… {len(dev.iterations) - ROWS} more iterations", style="dim"))
    names = tensor_names(dev)
    if names is not None:
        console.print(t(names_line(names), TEXT))
        rows = saved_by_layer(names)
        if rows:
            _table(console, t(f"saved for backward, by layer (alive at the peak: "
                              f"{human(sum(r[1] for r in rows))})"),
                   ("layer", "bytes", "tensors", "inside"), {"bytes", "tensors"},
                   [(t(a), human(b), str(n), t(i, TEXT)) for a, b, n, i in rows[:ROWS]])
    comp = compiled_regions(dev)
    if comp is not None:
        _table(console, t(comp[0], TEXT),
               ("region", "source", "forward at peak", "backward at peak", "blocks"),
               {"forward at peak", "backward at peak", "blocks"},
               [(t(r), t(src, TEXT), human(fw), human(bw), str(n))
                for r, src, fw, bw, n in comp[1][:ROWS]])
    lines = compiled_lines(dev)
    if lines is not None:
        _table(console, t(lines[0], TEXT),
               ("model line", "buffers", "pass", "at peak", "allocated"), {"at peak", "allocated"},
               [(t(ln, TEXT), t(b, TEXT), t(ps, TEXT), human(pk), human(mk))
                for ln, b, ps, pk, mk in lines[1][:ROWS]])
    if not dev.categories_at_peak and not (len(dev.iterations) > 1 or any(
            i["backward_peak_bytes"] for i in dev.iterations)):
        console.print(f"device {dev.device}: {human(dev.segments['allocated_bytes'])} "
                      f"allocated in {dev.segments['count']} segments "
                      f"({human(dev.segments['reserved_bytes'])} reserved) at dump")


def _table(console: Console, title: Text | str, columns: tuple[str, ...], right: set[str],
           rows: list[tuple]) -> None:
    """A left-titled table of rendered cells (numbers right-aligned)."""
    tab = Table(title=title, title_justify="left", show_edge=False)
    for name in columns:
        tab.add_column(name, justify="right" if name in right else "left")
    for r in rows:
        tab.add_row(*r)
    console.print(tab)


def _no_names(console: Console, d: Diagnosis) -> None:
    """Once: a dump without tensor names, what it can say, and the recipe for the next one."""
    nn = no_names(d)
    if nn is None:
        return
    console.print(Text("tensor names: none in this dump. What it can say:", style="bold"))
    for line in (nn.get("said") or [])[:ROWS]:
        console.print(t(f"  - {line}", TEXT))
    console.print(Text("the next dump with names:", style="bold"))
    console.print(t(f"  {nn.get('recipe', '')}", TEXT))


def _finding(console: Console, d: Diagnosis, f: Finding) -> None:
    console.print()
    head = Text.assemble((f.verdict.upper(), COLOR.get(f.verdict, "")), " ",
                         t(f.title, NAME, "bold"), "  ", t(f.rule, NAME, "dim"))
    console.rule(style=COLOR.get(f.verdict, ""))
    console.print(head)
    for line in finding_lines(d, f):
        console.print(t(line, TEXT, "bold"))
    console.print(t(f.cause, TEXT))
    mods = f.modules
    if mods:
        mt = Table(show_edge=False, box=None)
        mt.add_column("module", overflow="fold")
        mt.add_column("bytes", justify="right")
        mt.add_column("blocks", justify="right")
        for m in mods[:8]:
            mt.add_row(t(m["module"]), human(m["bytes"]), str(m["blocks"]))
        console.print(mt)
    named = largest_named(f.tensors)
    if named:
        nt = Table(show_edge=False, box=None)
        for name in ("tensor", "kind", "shape", "bytes"):
            nt.add_column(name, justify="right" if name == "bytes" else "left", overflow="fold")
        for a, k, sh, b in named:
            nt.add_row(t(a), t(k), t(sh), human(b))
        console.print(nt)
    for s in f.stacks[:1]:
        console.print(Text("stack:", style="dim"))
        for frame in s["stack"][:8]:
            console.print(t("  " + short_path(frame), FRAME, "dim"), overflow="fold")
    if f.fix:
        console.print(Text("fix:", style="bold"))
        print_code(console, f.fix)


def print_code(console: Console, code: str) -> None:
    """Code as plain lines: no border, no wrap, no crop; highlighted only with colours on."""
    body = "\n".join(terminal(x, FRAME) for x in lines(code, FRAMES))
    text = Syntax(body, "python", theme="ansi_dark", background_color="default").highlight(body) \
        if console.color_system else Text(body)
    for line in text.split("\n"):
        console.print(line, soft_wrap=True)
