"""Rendering of a Fleet (analysis/fleet.py): terminal, markdown, json, html.

Every format says the same thing in the same order: the headline, the ranks worst first with
their peaks and distance from the median, then the findings by rule (one line when on every
rank, the ranks named when not), unreadable inputs and warnings.
"""

from __future__ import annotations

import html as _html
from typing import Any

from snapforensics.analysis.fleet import Fleet
from snapforensics.report.common import human

FORMATS = ("terminal", "markdown", "json", "html")


def headline(f: Fleet) -> str:
    n = len(f.ranks)
    if not n:
        return f"no readable rank ({len(f.errors)} inputs failed)"
    s = f.spread or {}
    words = [f"{n} rank{'s' if n != 1 else ''}, worst {who(f.ranks[0])} "
             f"peak {human(f.ranks[0]['peaks']['overall_bytes'])}",
             f"median {human(s['median_peak_bytes'])}, spread {s['spread_pct']:.1f}%"
             + (" (IMBALANCED)" if s.get("flagged") else "")]
    an = f.anomalies
    if an:
        top = an[0]
        words.append(f"{len(an)} anomal{'y' if len(an) == 1 else 'ies'}: {top['title']} "
                     f"({where(top, n)})")
    else:
        words.append("no anomaly")
    if f.errors:
        words.append(f"{len(f.errors)} unreadable")
    return "; ".join(words)


def who(r: dict[str, Any]) -> str:
    return f"rank {r['rank']}" if r.get("rank") is not None else r["label"]


def where(row: dict[str, Any], n: int) -> str:
    if row["on_all_ranks"]:
        return f"all {n} ranks" if n > 1 else "the only rank"
    shown = ", ".join(map(str, row["ranks"][:12])) + (" ..." if len(row["ranks"]) > 12 else "")
    return f"rank{'s' if row['rank_count'] > 1 else ''} {shown} only"


def _size(row: dict[str, Any]) -> str:
    lo, hi = row["bytes_min"], row["bytes_max"]
    return human(hi) if lo == hi else f"{human(lo)}-{human(hi)}"


def rank_rows(f: Fleet) -> list[list[str]]:
    return [[who(r), human(r["peaks"]["overall_bytes"]), f"{r['deviation_pct']:+.1f}%",
             human(r["peaks"]["forward_bytes"]), human(r["peaks"]["backward_bytes"]),
             str(r["peak_phase"] or "-"), ", ".join(r["anomalies"]) or "-"] for r in f.ranks]


RANK_HEAD = ["rank", "peak", "vs median", "forward", "backward", "peak in", "anomalies"]
FINDING_HEAD = ["verdict", "finding", "where", "bytes", "rule"]


def finding_rows(f: Fleet) -> list[list[str]]:
    n = len(f.ranks)
    return [[r["verdict"], r["title"], where(r, n), _size(r), r["rule"]] for r in f.findings]


def render_text(f: Fleet, fmt: str) -> str:
    if fmt == "json":
        from snapforensics.report.json import dumps
        return dumps(f.to_dict(), indent=True)
    if fmt == "markdown":
        return render_markdown(f)
    if fmt == "html":
        return render_html(f)
    from io import StringIO

    from rich.console import Console
    buf = StringIO()
    render_terminal(f, Console(file=buf, width=120, force_terminal=False, no_color=True))
    return buf.getvalue()


def render_terminal(f: Fleet, console) -> None:
    from rich.table import Table
    from rich.text import Text

    console.print(Text("snapforensics fleet", style="bold"))
    console.print(Text(headline(f), style="bold red" if f.anomalies else "bold green"))
    t = Table(show_edge=False)
    for i, h in enumerate(RANK_HEAD):
        t.add_column(h, justify="right" if 0 < i < 5 else "left")
    for row in rank_rows(f):
        t.add_row(*map(Text, row))
    if f.ranks:
        console.print(t)
    if f.findings:
        ft = Table(show_edge=False, title="findings by rank", title_justify="left")
        for h in FINDING_HEAD:
            ft.add_column(h)
        for row, r in zip(finding_rows(f), f.findings):
            ft.add_row(*map(Text, row), style="red" if r["verdict"] == "anomalous" and
                       not r["on_all_ranks"] else None)
        console.print(ft)
    for e in f.errors:
        console.print(Text(f"unreadable: {e['source']}: {e['error']}", style="yellow"))
    for w in f.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))


def _md(s: Any) -> str:
    """A table cell: no line breaks, no column separators, no markup from file names."""
    return str(s).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ") \
        .replace("<", "&lt;").replace("`", "\\`").replace("*", "\\*").replace("_", "\\_")


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(map(_md, r)) + " |" for r in rows] + [""]


def render_markdown(f: Fleet) -> str:
    out = ["# snapforensics fleet", "", f"**{_md(headline(f))}**", ""]
    if f.ranks:
        out += ["## Ranks, worst first", ""] + _md_table(RANK_HEAD, rank_rows(f))
    if f.findings:
        out += ["## Findings by rank", ""] + _md_table(FINDING_HEAD, finding_rows(f))
        for r in f.anomalies[:3]:
            if r.get("fix"):
                out += [f"Fix for `{r['rule']}`:", "", "```python", r["fix"], "```", ""]
    for e in f.errors:
        out.append(f"- unreadable: {_md(e['source'])}: {_md(e['error'])}")
    for w in f.warnings:
        out.append(f"- warning: {_md(w)}")
    return "\n".join(out).rstrip() + "\n"


def _h(s: Any) -> str:
    return _html.escape(str(s), quote=True)


def _h_table(head: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    cls = classes or [""] * len(rows)
    return ("<table><tr>" + "".join(f"<th>{_h(x)}</th>" for x in head) + "</tr>"
            + "".join(f"<tr class='{c}'>" + "".join(f"<td>{_h(x)}</td>" for x in r) + "</tr>"
                      for r, c in zip(rows, cls)) + "</table>")


CSS = ("body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222}"
       "table{border-collapse:collapse;margin:8px 0 20px}td,th{padding:3px 10px;"
       "border-bottom:1px solid #ddd;text-align:left}th{background:#f4f4f4}"
       "tr.anomalous td{color:#b00020}tr.specific td{font-weight:600}"
       "pre{background:#f6f8fa;padding:8px;overflow:auto}.warn{color:#8a6d00}")


def render_html(f: Fleet) -> str:
    """One self-contained offline page (no script, no URL fetched)."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>snapforensics fleet"
             f"</title><style>{CSS}</style></head><body><h1>snapforensics fleet</h1>"
             f"<p><b>{_h(headline(f))}</b></p>"]
    if f.ranks:
        parts.append("<h2>Ranks, worst first</h2>" + _h_table(RANK_HEAD, rank_rows(f)))
    if f.findings:
        cls = [f"{r['verdict']}{'' if r['on_all_ranks'] else ' specific'}" for r in f.findings]
        parts.append("<h2>Findings by rank</h2>" + _h_table(FINDING_HEAD, finding_rows(f), cls))
        for r in f.anomalies[:3]:
            if r.get("fix"):
                parts.append(f"<p>Fix for <code>{_h(r['rule'])}</code>:</p>"
                             f"<pre>{_h(r['fix'])}</pre>")
    parts += [f"<p class='warn'>unreadable: {_h(e['source'])}: {_h(e['error'])}</p>"
              for e in f.errors]
    parts += [f"<p class='warn'>warning: {_h(w)}</p>" for w in f.warnings]
    return "".join(parts) + f"<footer><small>{_h(f.tool)}</small></footer></body></html>\n"
