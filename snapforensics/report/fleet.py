"""Rendering of a Fleet (analysis/fleet.py): terminal, markdown, json, html.

Every format says the same thing in the same order: the headline, the ranks worst first with
their peaks and distance from the median, then the findings by rule (one line when on every
rank, the ranks named when not), unreadable inputs and warnings.
"""

from __future__ import annotations

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
    return r["label"] + (f" (rank {r['rank']})" if r.get("rank") is not None else "")


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


def render_markdown(f: Fleet) -> str:
    from snapforensics.report.pages import md, md_table

    out = ["# snapforensics fleet", "", f"**{md(headline(f))}**", ""]
    if f.ranks:
        out += ["## Ranks, worst first", ""] + md_table(RANK_HEAD, rank_rows(f))
    if f.findings:
        out += ["## Findings by rank", ""] + md_table(FINDING_HEAD, finding_rows(f))
        for r in f.anomalies[:3]:
            if r.get("fix"):
                out += [f"Fix for `{r['rule']}`:", "", "```python", r["fix"], "```", ""]
    for e in f.errors:
        out.append(f"- unreadable: {md(e['source'])}: {md(e['error'])}")
    for w in f.warnings:
        out.append(f"- warning: {md(w)}")
    return "\n".join(out).rstrip() + "\n"


def render_html(f: Fleet) -> str:
    """One self-contained offline page (no script, no URL fetched)."""
    from snapforensics.report.pages import h, lines, page, table

    body = []
    if f.ranks:
        body.append("<h2>Ranks, worst first</h2>" + table(RANK_HEAD, rank_rows(f)))
    if f.findings:
        cls = [f"{r['verdict']}{'' if r['on_all_ranks'] else ' specific'}" for r in f.findings]
        body.append("<h2>Findings by rank</h2>" + table(FINDING_HEAD, finding_rows(f), cls))
        body += [f"<p>Fix for <code>{h(r['rule'])}</code>:</p><pre>{h(r['fix'])}</pre>"
                 for r in f.anomalies[:3] if r.get("fix")]
    body += lines([f"unreadable: {e['source']}: {e['error']}" for e in f.errors])
    body += lines([f"warning: {w}" for w in f.warnings])
    return page("snapforensics fleet", headline(f), body, f.tool)
