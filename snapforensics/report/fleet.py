"""Rendering of a Fleet (analysis/fleet.py): terminal, markdown, html (json: report/json).

Every format says the same thing in the same order: the headline, the ranks worst first with
their peaks and distance from the median, then the findings by rule (one line when on every
rank, the ranks named when not), each anomaly once with its fix and the peak predicted after it
(on the worst rank that has it), the worst rank's timeline plot (Markdown: a Mermaid chart,
and the PNG beside `-o FILE`; HTML: the SVG with its hover; the terminal names the command that
draws it), unreadable inputs and warnings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from snapforensics.analysis.diagnosis import DeviceSummary
from snapforensics.analysis.fleet import RUNS, Fleet
from snapforensics.report.common import human
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import NAME, ROWS, TEXT, markdown_code, markdown_span
from snapforensics.report.sanitize import markdown as md
from snapforensics.report.terminal import print_code, t


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
                 + (" (expected: pipeline stages)" if s.get("flagged") and
                    (f.statement or {}).get("verdict") == "expected"
                    else " (IMBALANCED)" if s.get("flagged") else "")]
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


def statement(f: Fleet) -> str | None:
    """Which rank (pipeline stage) peaks highest, by what, and whether that is a defect."""
    st = f.statement
    if not st:
        return None
    where_ = st["label"] + (f" (rank {st['rank']})" if st.get("rank") is not None else "")
    if st.get("tp_rank") is not None:
        where_ = f"TP rank {st['tp_rank']} of {st['tp']}, {where_}"
    if st.get("stage") is not None:
        where_ = f"pipeline stage {st['stage']} of {st['stages']}, {where_}"
    by = (f", mostly {st['category']} (+{human(st['category_extra_bytes'])} over the other "
          "ranks' median)" if st.get("category") and st["category_extra_bytes"] > 0 else "")
    return (f"{st['verdict']}: {where_} peaks highest, {human(st['over_median_bytes'])} over "
            f"the median{by}: {st['why']}")


def who(r: dict[str, Any]) -> str:
    return r["label"] + (f" (rank {r['rank']})" if r.get("rank") is not None else "")


def where(row: dict[str, Any], n: int) -> str:
    off = row.get("off_ranks") or []
    if off:
        med = row.get("bytes_median") or 0
        shown = ", ".join(map(str, off[:12])) + (" ..." if len(off) > 12 else "")
        off_text = f"; off the median ({human(med)}): {shown}"
    else:
        off_text = ""
    return _where(row, n) + off_text


def _where(row: dict[str, Any], n: int) -> str:
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
    if statement(f):
        console.print(t(statement(f), TEXT))
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
    for r in _fixes(f):
        console.print(t(f"Fix for {r['rule']}", NAME, "bold") + t(f" ({_predicted(f, r)}):",
                                                                   TEXT))
        print_code(console, r["fix"])  # plain lines, never wrapped: copyable
    for line in _notes(f):
        console.print(t(line, TEXT, "bold" if line.startswith("the worst") else "yellow"))
    return console.file.getvalue()


FIXES = 3  # the anomalies whose fix a fleet report prints (the JSON has every one)


def _fixes(f: Fleet) -> list[dict[str, Any]]:
    return [r for r in f.anomalies[:FIXES] if r.get("fix")]


def _predicted(f: Fleet, r: dict[str, Any]) -> str:
    """The peak after the fix, on which rank, from what."""
    if r.get("predicted_peak_bytes") is None:
        return "no predicted peak for this fix"
    on = next((x for x in f.ranks if x["label"] == r["predicted_on"]), None)
    now = f" from {human(on['peaks']['overall_bytes'])}" if on else ""
    return (f"peak predicted after it {human(r['predicted_peak_bytes'])}{now} on "
            f"{who(on) if on else r['predicted_on']}")


def _worst_device(f: Fleet) -> DeviceSummary | None:
    """The worst rank's device whose plot the report draws (its highest peak)."""
    d = f.worst
    drawn = [dev for dev in d.devices if dev.plot is not None] if d else []
    return max(drawn, key=lambda dev: dev.peaks["overall_bytes"]) if drawn else None


def _plot_title(f: Fleet, dev: DeviceSummary) -> str:
    return (f"Live bytes over time on the worst rank, {who(f.ranks[0])}, device {dev.device} "
            "(by what made them; the line: after the top fix)")


def _notes(f: Fleet, plotted: bool = False) -> list[str]:
    """Where the plot is (the terminal has none) and the worst rank's own report, then
    unreadable inputs and warnings."""
    nxt = []
    if f.ranks:
        if not plotted:
            nxt.append("the worst rank's plot: write this report with -o fleet.html (or .md)")
        nxt.append(f"the worst rank's full report (every finding, its evidence and plot): "
                   f"snapforensics diagnose {f.ranks[0]['source']} -o report.html")
    return (nxt + [f"unreadable: {e['source']}: {e['error']}" for e in f.errors[:ROWS]]
            + [f"warning: {w}" for w in f.warnings[:ROWS]])


def markdown(f: Fleet, screen: Screen = PLAIN, image: str | None = None) -> str:
    """`image`: the worst rank's plot as a PNG written beside the report (`render_beside`)."""
    from snapforensics.report import mermaid
    from snapforensics.report.pages import md_table

    out = ["# snapforensics fleet", "", f"**{md(headline(f), TEXT)}**", ""]
    if statement(f):
        out += [md(statement(f), TEXT), ""]
    if f.ranks:
        out += ["## Ranks, worst first", ""] + md_table(RANK_HEAD, rank_rows(f))
    if f.findings:
        out += ["## Findings by rank", ""] + md_table(FINDING_HEAD, finding_rows(f))
        for r in _fixes(f):
            out += [f"Fix for {markdown_span(r['rule'])} ({md(_predicted(f, r), TEXT)}):", "",
                    *markdown_code(r["fix"].splitlines(), "python"), ""]
    dev = _worst_device(f)
    chart = mermaid.chart(dev) if dev is not None else []
    if dev is not None and chart:
        out += ["## The worst rank's timeline", "", md(_plot_title(f, dev), TEXT), "", *chart, ""]
        out += [f"The full plot (by what made the bytes, phases, the peak) is `{md(image, TEXT)}`, "
                "written beside this file: attach it to the ticket." if image else
                "The full plot (by what made the bytes, phases, the peak): write this report "
                "with `-o fleet.md`, which also writes `fleet.png` to attach.", ""]
    out += [f"- {md(x, TEXT)}" for x in _notes(f, plotted=bool(chart))]
    return "\n".join(out).rstrip() + "\n"


def render_beside(f: Fleet, path: Path) -> str:
    """The Markdown for `-o FILE`: the worst rank's plot written beside it (FILE with .png)."""
    from snapforensics.report import plot
    from snapforensics.report.output import write_file

    dev = _worst_device(f)
    image = Path(path).with_suffix(".png") if dev is not None and dev.plot is not None else None
    if image is not None and dev is not None and dev.plot is not None:
        write_file(image, plot.png([dev.plot]))
    return markdown(f, PLAIN, image.name if image else None)


def html(f: Fleet, screen: Screen = PLAIN) -> str:
    """One self-contained offline page (no URL fetched; the plot's hover script inline)."""
    from snapforensics.report import plot
    from snapforensics.report.html import e, scoped, script_json
    from snapforensics.report.pages import lines, page, table
    from snapforensics.report.sanitize import html as h

    body = [f"<p>{h(statement(f), TEXT)}</p>"] if statement(f) else []
    if f.ranks:
        body.append("<h2>Ranks, worst first</h2>" + table(RANK_HEAD, rank_rows(f)))
    if f.findings:
        cls = [f"{r['verdict']}{'' if r['on_all_ranks'] else ' specific'}" for r in f.findings]
        body.append("<h2>Findings by rank</h2>" + table(FINDING_HEAD, finding_rows(f), cls))
        body += [f"<p>Fix for <code>{h(r['rule'])}</code> ({h(_predicted(f, r), TEXT)}):</p>"
                 f"<pre>{h(r['fix'], TEXT)}</pre>" for r in _fixes(f)]
    dev = _worst_device(f)
    if dev is not None and dev.plot is not None and f.worst is not None:
        top = next((x for x in f.worst.findings if x.rule == dev.plot.predicted_rule), None)
        body.append(f"<h2>The worst rank's timeline</h2><p>{h(_plot_title(f, dev), TEXT)}</p>"
                    "<div class='sf-report'>"
                    + plot.svg(dev.plot, e, script_json, top.title if top else None)
                    + "</div>")
    body += lines(_notes(f, plotted=dev is not None))
    css = scoped(plot.CSS) if dev is not None else ""
    return page("snapforensics fleet", headline(f), body, f.tool, css,
                plot.JS if dev is not None else "")
