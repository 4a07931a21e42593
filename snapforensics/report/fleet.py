"""Rendering of a Fleet (analysis/fleet.py): terminal, markdown, html (json: report/json).

Every format says the same thing in the same order: the headline, the ranks worst first with
their peaks and distance from the median, then the findings by rule (one line when on every
rank, the ranks named when not), unreadable inputs and warnings.
"""

from __future__ import annotations

from typing import Any

from snapforensics.analysis.fleet import RUNS, Fleet
from snapforensics.report.common import human
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import NAME, ROWS, TEXT, markdown_code, markdown_span
from snapforensics.report.sanitize import markdown as md
from snapforensics.report.terminal import t


def headline(f: Fleet) -> str:
    n = len(f.ranks)
    if not n:
        return f"no readable rank ({len(f.errors)} inputs failed)"
    s = f.spread or {}
    if f.mode == RUNS:  # files of separate runs: their spread is not an imbalance
        words = [f"{n} separate runs, not ranks of one run (compare them: snapforensics "
                 f"compare {' '.join(r['source'] for r in f.ranks[:2])})",
                 f"highest peak {human(f.ranks[0]['peaks']['overall_bytes'])} in "
                 f"{who(f.ranks[0])}"]
    else:
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
    if not all(isinstance(r, int) for r in row["ranks"]):  # labels: ranks did not tell apart
        return f"{shown} only"
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


def terminal(f: Fleet, screen: Screen = PLAIN) -> str:
    """Fitted to the width: anomalies counted per rank, each finding's rule id on its own line
    under its title (ids are long and must stay copy-pasteable)."""
    from rich.table import Table
    from rich.text import Text

    console = screen.console()
    console.print(t("snapforensics fleet", NAME, "bold"))
    console.print(t(headline(f), TEXT, "bold red" if f.anomalies else "bold green"))
    tab = Table(show_edge=False)
    for i, head in enumerate(RANK_HEAD):
        tab.add_column(head, justify="left" if i in (0, 5) else "right", overflow="fold")
    for row, r in zip(rank_rows(f), f.ranks):
        tab.add_row(*(t(x, TEXT) for x in row[:-1]), str(len(r["anomalies"])))
    if f.ranks:
        console.print(tab)
    if f.findings:
        ft = Table(show_edge=False, title="findings by rank", title_justify="left")
        for head in ("verdict", "where", "bytes", "finding / rule"):
            ft.add_column(head, overflow="fold")
        for (verdict, title, where_, size, rule), r in zip(finding_rows(f), f.findings):
            cell = Text.assemble(t(title, TEXT), "\n", t(rule, NAME, "dim"))
            ft.add_row(t(verdict), t(where_, TEXT), size, cell,
                       style="red" if verdict == "anomalous" and not r["on_all_ranks"] else None)
        console.print(ft)
    for line in _notes(f):
        console.print(t(line, TEXT, "bold" if line.startswith("the worst") else "yellow"))
    return console.file.getvalue()


def _notes(f: Fleet) -> list[str]:
    """The next command (the worst rank's own report: its fix, predicted peak and plot), then
    unreadable inputs and warnings."""
    nxt = ([f"the worst rank's full report (fix, predicted peak, plot): snapforensics "
            f"diagnose {f.ranks[0]['source']} -o report.html"] if f.ranks else [])
    return (nxt + [f"unreadable: {e['source']}: {e['error']}" for e in f.errors[:ROWS]]
            + [f"warning: {w}" for w in f.warnings[:ROWS]])


def markdown(f: Fleet, screen: Screen = PLAIN) -> str:
    from snapforensics.report.pages import md_table

    out = ["# snapforensics fleet", "", f"**{md(headline(f), TEXT)}**", ""]
    if f.ranks:
        out += ["## Ranks, worst first", ""] + md_table(RANK_HEAD, rank_rows(f))
    if f.findings:
        out += ["## Findings by rank", ""] + md_table(FINDING_HEAD, finding_rows(f))
        for r in f.anomalies[:3]:
            if r.get("fix"):
                out += [f"Fix for {markdown_span(r['rule'])}:", "",
                        *markdown_code(r["fix"].splitlines(), "python"), ""]
    out += [f"- {md(x, TEXT)}" for x in _notes(f)]
    return "\n".join(out).rstrip() + "\n"


def html(f: Fleet, screen: Screen = PLAIN) -> str:
    """One self-contained offline page (no script, no URL fetched)."""
    from snapforensics.report.pages import lines, page, table
    from snapforensics.report.sanitize import html as h

    body = []
    if f.ranks:
        body.append("<h2>Ranks, worst first</h2>" + table(RANK_HEAD, rank_rows(f)))
    if f.findings:
        cls = [f"{r['verdict']}{'' if r['on_all_ranks'] else ' specific'}" for r in f.findings]
        body.append("<h2>Findings by rank</h2>" + table(FINDING_HEAD, finding_rows(f), cls))
        body += [f"<p>Fix for <code>{h(r['rule'])}</code>:</p><pre>{h(r['fix'], TEXT)}</pre>"
                 for r in f.anomalies[:3] if r.get("fix")]
    body += lines(_notes(f))
    return page("snapforensics fleet", headline(f), body, f.tool)
