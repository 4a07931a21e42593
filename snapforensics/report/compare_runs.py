"""Two run folders compared rank by rank (analysis/gate.py, `snapforensics.compare_runs/1`):
the CI view. Every format says the same four things in the same order: the gate's verdict at
the top (a banner, when `--fail-on` was given), each rank's peaks and what A's predicted peak
after its fix says against B's measured one, the anomalies gone and new per rank, and the
before/after plot of the rank whose peak changed most (terminal: two sparklines; Markdown: a
Mermaid chart; HTML: an inline SVG).

Rule ids and file labels came from snapshots and file names: each passes its sink's function.
The table holds numbers only; rule ids go on their own lines, so a piped (100-column) table
never breaks a rule name mid-word.
"""

from __future__ import annotations

from typing import Any

from snapforensics.analysis.gate import new_anomalies
from snapforensics.report import mermaid, plot
from snapforensics.report.common import human
from snapforensics.report.compare import change, pct, prediction_lines, who
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import FRAME, ROWS, TEXT
from snapforensics.report.sanitize import html as h
from snapforensics.report.sanitize import markdown as md
from snapforensics.report.terminal import t

HEAD = ["rank", "peak A", "peak B", "change", "A's predicted peak after the fix (error vs B)"]
SPARK = "▁▂▃▄▅▆▇█"


def headline(r) -> str:
    o = r.overall
    g = o["largest_growth"]
    words = [f"{o['ranks']} rank{'s' if o['ranks'] != 1 else ''} compared: highest peak "
             f"{human(o['peak_bytes']['before'])} -> {human(o['peak_bytes']['after'])} "
             f"({pct(o['peak_bytes']['delta_pct'])})",
             f"largest change {g['label']} {change(g)}"]
    if o["new_anomalies"]:
        words.append("new: " + ", ".join(o["new_anomalies"]))
    if o["gone_anomalies"]:
        words.append("gone: " + ", ".join(o["gone_anomalies"]))
    return "; ".join(words)


def banner(r) -> str | None:
    """The gate's verdict in one line; None when no gate was asked."""
    if r.gate is None:
        return None
    if not r.gate:
        return "GATE PASSED: no rank regressed past the threshold, no new anomaly"
    return f"GATE FAILED ({len(r.gate)}): " + "; ".join(r.gate[:ROWS])


def _prediction(d: dict[str, Any]) -> str:
    p = next(iter(d.get("predictions") or []), None)
    if p is None:
        return "-"
    state = "" if p["fixed"] else ", not fixed in B"
    return f"{human(p['predicted_peak_bytes'])} ({pct(p['error_pct'])}{state})"


def rows(r) -> list[list[str]]:
    out = []
    for c in r.pairs:
        d = c.deltas[0]
        p = d["peaks"]["overall_bytes"]
        rank = d.get("rank")
        out.append([str(rank) if rank is not None else who(c.inputs[1]), human(p["before"]),
                    human(p["after"]), change(p), _prediction(d)])
    return out


def notes(r) -> list[str]:
    """Per rank, the anomalies that appeared or went away and each prediction checked; then
    the files without a counterpart."""
    out = []
    for c in r.pairs:
        d = c.deltas[0]
        gone = [x["rule"] for x in d["findings"]["disappeared"] if x["verdict"] == "anomalous"]
        new = [x["rule"] for x in new_anomalies(d)]
        if new:
            out.append(f"{who(c.inputs[1])}: new anomaly {', '.join(new)}")
        if gone:
            out.append(f"{who(c.inputs[1])}: anomaly gone {', '.join(gone)}")
        out += [f"{who(c.inputs[1])}: prediction check: {x}" for x in prediction_lines(d)]
    return out[:ROWS * 3] + [f"no counterpart: {u}" for u in r.unpaired[:ROWS]]


def _plot_title(r) -> str:
    p = r.plot or {}
    return f"live bytes of {p.get('label', '?')}, A and B"


def sparklines(r, width: int = 60) -> list[str]:
    """A and B's live bytes over the share of their trace rows, one character per slice
    (its highest point), on one scale."""
    p = r.plot or {}
    if not p.get("a") or not p.get("b"):
        return []
    series = [mermaid.progress(p["a"]), mermaid.progress(p["b"])]
    import numpy as np

    top = max(float(v.max()) for _, v in series) or 1.0
    out = []
    for name, (x, v) in zip("AB", series):
        slot = np.minimum((x / 100 * width).astype(int), width - 1)
        level = np.full(width, np.nan)
        np.fmax.at(level, slot, v)
        for i in range(width):  # a slice with no point keeps the level before it
            if np.isnan(level[i]):
                level[i] = level[i - 1] if i else 0.0
        chars = "".join(SPARK[min(int(b / top * len(SPARK)), len(SPARK) - 1)]
                        for b in level.tolist())
        out.append(f"{name} {chars} peak {human(int(v.max()))}")
    return out


def terminal(r, screen: Screen = PLAIN) -> str:
    from rich.table import Table
    from rich.text import Text

    console = screen.console()
    console.print(t(f"snapforensics compare {r.a} -> {r.b} (rank by rank)", FRAME, "bold"))
    b = banner(r)
    if b:
        console.print(t(b, TEXT, "bold red" if r.gate else "bold green"))
    console.print(t(headline(r), TEXT, "bold"))
    tab = Table(show_edge=False)
    for col in HEAD:
        tab.add_column(col, justify="left" if col == "rank" else "right", no_wrap=col != "rank")
    for row in rows(r):
        tab.add_row(*(t(x, TEXT) for x in row))
    console.print(tab)
    for x in notes(r):
        console.print(t(x, TEXT, "red" if "new anomaly" in x else ""))
    spark = sparklines(r)
    if spark:
        console.print(t(_plot_title(r) + " (x: % of each recording's trace rows)", TEXT, "dim"))
        for line in spark:
            console.print(Text(line))  # our own characters and figures only
    return console.file.getvalue()


def markdown(r, screen: Screen = PLAIN) -> str:
    from snapforensics.report.pages import md_table

    out = [f"# snapforensics compare {md(r.a)} -> {md(r.b)} (rank by rank)", ""]
    b = banner(r)
    if b:
        out += [f"> **{md(b, TEXT)}**", ""]
    out += [f"**{md(headline(r), TEXT)}**", "", *md_table(HEAD, rows(r))]
    out += [f"- {md(x, TEXT)}" for x in notes(r)]
    p = r.plot or {}
    chart = mermaid.before_after(p.get("a") or [], p.get("b") or [],
                                 "Live bytes: bars A (baseline), line B")
    if chart:
        out += ["", f"Before/after: {md(p.get('label', '?'))}, the rank whose peak changed "
                "most (x: % of each recording's trace rows).", "", *chart]
    return "\n".join(out) + "\n"


def html(r, screen: Screen = PLAIN) -> str:
    from snapforensics.report.pages import lines, page, table

    body = []
    b = banner(r)
    if b:
        cls = "fail" if r.gate else "pass"
        body.append(f"<p class='banner {cls}' style='padding:10px 14px;border-radius:6px;"
                    f"font-weight:700;color:#fff;background:"
                    f"{'#b00020' if r.gate else '#2e7d32'}'>{h(b, TEXT)}</p>")
    body.append(table(HEAD, rows(r)))
    body += lines(notes(r), "note")
    p = r.plot or {}
    if p.get("a") and p.get("b"):
        body.append(f"<h2>Before/after: {h(p.get('label', '?'))}</h2>"
                    + plot.svg_before_after([mermaid.progress(p["a"]), mermaid.progress(p["b"])],
                                            ["A (baseline)", "B"], h))
    return page(f"snapforensics compare {r.a} -> {r.b} (rank by rank)", headline(r), body,
                r.pairs[0].tool)
