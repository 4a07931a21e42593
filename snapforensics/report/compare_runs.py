"""Rendering of two runs compared rank by rank (analysis/gate.py `compare_runs`): terminal,
markdown, html (json: report/json). Labels and sources pass their sink's function of
report/sanitize.py."""

from __future__ import annotations

from rich.table import Table

from snapforensics.report.changes import change, gate_lines, pct, who
from snapforensics.report.common import human
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import FRAME, ROWS, TEXT
from snapforensics.report.sanitize import markdown as md
from snapforensics.report.terminal import t

RUN_HEAD = ["rank", "peak A", "peak B", "change", "new anomalies", "gone anomalies"]


def runs_headline(r) -> str:
    o = r.overall
    g = o["largest_growth"]
    words = [f"{o['ranks']} ranks compared: highest peak {human(o['peak_bytes']['before'])} -> "
             f"{human(o['peak_bytes']['after'])} ({pct(o['peak_bytes']['delta_pct'])})",
             f"largest change {g['label']} {change(g)}"]
    if o["new_anomalies"]:
        words.append("new: " + ", ".join(o["new_anomalies"]))
    if o["gone_anomalies"]:
        words.append("gone: " + ", ".join(o["gone_anomalies"]))
    return "; ".join(words)


def _run_rows(r) -> list[list[str]]:
    from snapforensics.analysis.gate import new_anomalies

    out = []
    for c in r.pairs:
        d = c.deltas[0]
        p = d["peaks"]["overall_bytes"]
        out.append([who(c.inputs[1]), human(p["before"]), human(p["after"]), change(p),
                    ", ".join(x["rule"] for x in new_anomalies(d)) or "-",
                    ", ".join(x["rule"] for x in d["findings"]["disappeared"]
                              if x["verdict"] == "anomalous") or "-"])
    return out


def _run_notes(r) -> list[str]:
    return gate_lines(r) + [f"no counterpart: {u}" for u in r.unpaired[:ROWS]]


def runs_terminal(r, screen: Screen = PLAIN) -> str:
    console = screen.console()
    console.print(t(f"snapforensics compare {r.a} -> {r.b} (rank by rank)", FRAME, "bold"))
    console.print(t(runs_headline(r), TEXT, "bold"))
    tab = Table(show_edge=False)
    for col in RUN_HEAD:
        tab.add_column(col, overflow="fold")
    for row in _run_rows(r):
        tab.add_row(*(t(x, TEXT) for x in row))
    console.print(tab)
    for x in _run_notes(r):
        console.print(t(x, TEXT, "bold red" if x.startswith("FAIL") else "yellow"))
    return console.file.getvalue()


def runs_markdown(r, screen: Screen = PLAIN) -> str:
    from snapforensics.report.pages import md_table

    return "\n".join([f"# snapforensics compare {md(r.a)} -> {md(r.b)} (rank by rank)", "",
                      f"**{md(runs_headline(r), TEXT)}**", ""]
                     + md_table(RUN_HEAD, _run_rows(r))
                     + [f"- {md(x, TEXT)}" for x in _run_notes(r)]) + "\n"


def runs_html(r, screen: Screen = PLAIN) -> str:
    from snapforensics.report.pages import lines, page, table

    return page(f"snapforensics compare {r.a} -> {r.b} (rank by rank)", runs_headline(r),
                [table(RUN_HEAD, _run_rows(r))] + lines(_run_notes(r)), r.pairs[0].tool)
