"""Rendering of a Comparison (analysis/compare.py): terminal, markdown, html (json:
report/json). Two runs compared rank by rank: report/compare_runs.py.

Labels, sources, categories and rule ids came from snapshots: each passes its sink's function
of report/sanitize.py, exactly as in the diagnosis reports.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from snapforensics.analysis.compare import BEFORE_AFTER, Comparison
from snapforensics.report.common import VERDICT_ORDER, human
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import FRAME, ROWS, TEXT
from snapforensics.report.sanitize import markdown as md
from snapforensics.report.terminal import t

PEAK_NAMES = (("overall_bytes", "overall peak"), ("forward_bytes", "forward peak"),
              ("backward_bytes", "backward peak"))


# ------------------------------------------------------------------------------ shared words

def signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + human(abs(n))


def pct(p: float | None) -> str:
    return "n/a" if p is None else f"{p:+.1f}%"


def change(ch: dict[str, Any]) -> str:
    """`-60.5 MiB (-24.1%)` for one {before, after, delta_bytes, delta_pct}."""
    if not ch["before"] and not ch["after"]:
        return "-"
    if not ch["before"]:
        return f"{signed(ch['delta_bytes'])} (new)"
    return f"{signed(ch['delta_bytes'])} ({pct(ch['delta_pct'])})"


def who(inp: dict[str, Any]) -> str:
    return inp["label"] + (f" (rank {inp['rank']})" if inp.get("rank") is not None else "")


def headline(c: Comparison) -> str:
    base = c.baseline
    if c.mode == BEFORE_AFTER:
        d = c.deltas[-1]
        p = d["peaks"]["overall_bytes"]
        words = [f"peak {human(p['before'])} -> {human(p['after'])} ({pct(p['delta_pct'])})"]
        gone = [f["rule"] for f in d["findings"]["disappeared"] if f["verdict"] == "anomalous"]
        new = [f["rule"] for f in d["findings"]["appeared"] if f["verdict"] == "anomalous"]
        if gone:
            words.append("gone: " + ", ".join(gone))
        if new:
            words.append("new: " + ", ".join(new))
        if len(c.deltas) > 1:
            words[0] = f"{base['label']} -> {d['label']}: " + words[0]
        return "; ".join(words)
    im = c.imbalance or {}
    w = im.get("worst") or {}
    if not w:
        return "ranks compared"
    if not im.get("flagged"):
        return (f"{len(c.inputs)} ranks, balanced: peaks within {pct(w['deviation_pct'])} of "
                f"the median {human(im['median_peak_bytes'])} (spread {im['spread_pct']:.1f}%)")
    return (f"{len(c.inputs)} ranks, IMBALANCED: {w['label']} deviates most from the median "
            f"peak {human(im['median_peak_bytes'])}: {pct(w['deviation_pct'])} "
            f"(spread {im['spread_pct']:.1f}%)")


def prediction_lines(d: dict[str, Any]) -> list[str]:
    """One line per baseline anomaly with a predicted peak: predicted vs measured."""
    out = []
    for p in d.get("predictions") or []:
        state = "fixed" if p["fixed"] else "still anomalous, so not a test of the prediction"
        out.append(f"{p['rule']} ({state}): predicted peak {human(p['predicted_peak_bytes'])}, "
                   f"measured {human(p['measured_peak_bytes'])}, error {pct(p['error_pct'])}; "
                   f"saving predicted {human(p['predicted_saving_bytes'])}, measured "
                   f"{human(p['measured_saving_bytes'])}")
    return out


def imbalance_line(c: Comparison) -> str | None:
    im = c.imbalance
    if not im:
        return None
    w = im["worst"]
    if im["flagged"]:
        return (f"{w['label']} peaks at {human(w['peak_bytes'])}, {pct(w['deviation_pct'])} "
                f"from the median {human(im['median_peak_bytes'])} (threshold "
                f"{im['threshold_pct']:.0f}%): usually uneven sharding or uneven data per rank")
    return (f"largest deviation from the median {human(im['median_peak_bytes'])}: "
            f"{w['label']} {pct(w['deviation_pct'])} (under {im['threshold_pct']:.0f}%)")


def finding_rows(c: Comparison) -> list[tuple[str, str, str, list[str]]]:
    """(rule, verdict, status, one cell per input) for every rule seen in any input. The
    verdict is the most severe one seen; a cell names its own verdict only when it differs."""
    sev = VERDICT_ORDER
    rules: dict[str, str] = {}
    for inp in c.inputs:
        for f in inp["findings"]:
            v = rules.get(f["rule"])
            if v is None or sev.get(f["verdict"], 3) < sev.get(v, 3):
                rules[f["rule"]] = f["verdict"]
    rows = []
    for rule, verdict in rules.items():
        cells, present = [], []
        for inp in c.inputs:
            f = next((f for f in inp["findings"] if f["rule"] == rule), None)
            present.append(f is not None)
            cells.append("-" if f is None else human(f["bytes"])
                         + ("" if f["verdict"] == verdict else f" ({f['verdict']})"))
        if all(present):
            status = "persists"
        elif present[0]:
            status = "disappears" if len(present) == 2 else "gone in " + ",".join(
                _letter(n) for n, p in enumerate(present) if not p)
        else:
            status = "appears" if len(present) == 2 else "appears in " + ",".join(
                _letter(n) for n, p in enumerate(present) if p)
        rows.append((rule, verdict, status, cells))
    rows.sort(key=lambda r: (r[2] == "persists", sev.get(r[1], 3), r[0]))
    return rows


def category_rows(c: Comparison) -> list[tuple[str, list[str]]]:
    """(category, baseline bytes then `after (delta)` per later input), biggest change first."""
    cats: dict[str, int] = {}
    for d in c.deltas:
        for x in d["categories_at_peak"]:
            cats[x["category"]] = max(cats.get(x["category"], 0), abs(x["delta_bytes"]))
    for k in c.baseline["categories_at_peak"]:
        cats.setdefault(k, 0)
    rows = []
    for cat in sorted(cats, key=lambda k: (-cats[k], k)):
        cells = [human(c.baseline["categories_at_peak"].get(cat, 0))]
        for d in c.deltas:
            x = {y["category"]: y for y in d["categories_at_peak"]}.get(cat)
            cells.append(f"{human(x['after'])} ({signed(x['delta_bytes'])})" if x else "0 B")
        rows.append((cat, cells))
    return rows


# ---------------------------------------------------------------------------------- formats

def terminal(c: Comparison, screen: Screen = PLAIN) -> str:
    console = screen.console(width=120)
    mode = "before/after" if c.mode == BEFORE_AFTER else "rank vs rank"
    console.print(t(f"snapforensics compare ({mode}, baseline {c.baseline['label']})", FRAME,
                    "bold"))
    flagged = c.imbalance and c.imbalance["flagged"]
    console.print(t(headline(c), TEXT, "bold red" if flagged else "bold"))
    for w in c.warnings[:ROWS]:
        console.print(t(f"warning: {w}", TEXT, "yellow"))

    tab = Table(title="inputs", title_justify="left", show_edge=False)
    tab.add_column("")
    tab.add_column("source", overflow="fold")
    tab.add_column("rank", justify="right")
    tab.add_column("peak", justify="right")
    tab.add_column("peak in")
    tab.add_column("anomalies", overflow="fold")
    for n, inp in enumerate(c.inputs):
        tab.add_row(_letter(n), t(inp["label"], FRAME),
                  "-" if inp["rank"] is None else str(inp["rank"]),
                  human(inp["peaks"]["overall_bytes"]), t(inp["peak_phase"] or "-"),
                  t(", ".join(inp["anomalies"]) or "none", TEXT))
    console.print(tab)

    tab = Table(title=f"peaks, change vs {_letter(0)}", title_justify="left", show_edge=False)
    tab.add_column("")
    tab.add_column(_letter(0), justify="right")
    for n in range(1, len(c.inputs)):
        tab.add_column(_letter(n), justify="right")
        tab.add_column(f"{_letter(n)} - {_letter(0)}", justify="right")
    for key, name in PEAK_NAMES:
        row = [name, human(c.baseline["peaks"][key])]
        for d in c.deltas:
            ch = d["peaks"][key]
            style = "green" if ch["delta_bytes"] < 0 else "red" if ch["delta_bytes"] > 0 else ""
            row += [human(ch["after"]), Text(change(ch), style=style)]
        tab.add_row(*row)
    console.print(tab)

    rows = category_rows(c)
    if rows:
        tab = Table(title="alive at the peak, by what made it", title_justify="left",
                  show_edge=False)
        tab.add_column("category", overflow="fold")
        tab.add_column(_letter(0), justify="right")
        for n in range(1, len(c.inputs)):
            tab.add_column(f"{_letter(n)} (change)", justify="right")
        for cat, cells in rows:
            tab.add_row(t(cat), *cells)
        console.print(tab)
        if c.mode == BEFORE_AFTER:
            for d in c.deltas:
                console.print(t(f"{d['label']}: removed {human(d['removed_at_peak_bytes'])} "
                                 f"and added {human(d['added_at_peak_bytes'])} at the peak",
                                 TEXT))

    rows = finding_rows(c)
    if rows:
        tab = Table(title="findings", title_justify="left", show_edge=False)
        tab.add_column("rule", overflow="fold", min_width=min(40, max(len(r[0]) for r in rows)))
        tab.add_column("verdict")
        tab.add_column("status", overflow="fold")
        for n in range(len(c.inputs)):
            tab.add_column(_letter(n), justify="right", overflow="fold")
        for rule, verdict, status, cells in rows:
            bad = verdict == "anomalous"
            style = ("green" if bad else "") if status.startswith(("disappears", "gone")) else \
                ("red" if bad else "") if status.startswith("appears") else ""
            tab.add_row(t(rule), t(verdict, style="bold red" if bad else ""),
                      t(status, style=style), *cells)
        console.print(tab)
    else:
        console.print(Text("no findings in any input", style="dim"))

    for d in c.deltas:
        lines = prediction_lines(d)
        if lines:
            console.print(t(f"prediction check ({c.baseline['label']} -> {d['label']}):",
                             FRAME, "bold"))
            for line, p in zip(lines, d["predictions"]):
                ok = p["error_pct"] is not None and abs(p["error_pct"]) < 10
                console.print(t("  " + line, TEXT, ("green" if ok else "yellow")
                                 if p["fixed"] else "dim"))
    line = imbalance_line(c)
    if line:
        console.print(t(line, TEXT, "bold red" if flagged else "green"))
    for x in gate_lines(c):
        console.print(t(x, TEXT, "bold red" if x.startswith("FAIL") else "green"))
    return console.file.getvalue()


def markdown(c: Comparison, screen: Screen = PLAIN) -> str:
    mode = "before/after" if c.mode == BEFORE_AFTER else "rank vs rank"
    out = [f"# snapforensics compare ({mode})", "", f"**{md(headline(c), TEXT)}**", ""]
    if c.warnings:
        out += [f"- ⚠ {md(w, TEXT)}" for w in c.warnings[:ROWS]] + [""]
    out += ["| | source | rank | overall peak | forward | backward | peak in | anomalies |",
            "|---|---|---|---|---|---|---|---|"]
    for n, inp in enumerate(c.inputs):
        p = inp["peaks"]
        out.append(f"| {_letter(n)} | {md(inp['source'], FRAME)} | "
                   f"{'-' if inp['rank'] is None else inp['rank']} | "
                   f"{human(p['overall_bytes'])} | {human(p['forward_bytes'])} | "
                   f"{human(p['backward_bytes'])} | {md(inp['peak_phase'] or '-')} | "
                   f"{md(', '.join(inp['anomalies']) or 'none', TEXT)} |")
    out += ["", "## Peaks", "",
            "| | " + " | ".join([_letter(0)] + [f"{_letter(n)} | {_letter(n)} - {_letter(0)}"
                                               for n in range(1, len(c.inputs))]) + " |",
            "|---" * (2 + 2 * len(c.deltas)) + "|"]
    for key, name in PEAK_NAMES:
        cells = [human(c.baseline["peaks"][key])]
        for d in c.deltas:
            cells += [human(d["peaks"][key]["after"]), change(d["peaks"][key])]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    rows = category_rows(c)
    if rows:
        out += ["", "## Alive at the peak, by what made it", "",
                "| category | " + " | ".join([_letter(0)] + [f"{_letter(n)} (change)" for n in
                                                            range(1, len(c.inputs))]) + " |",
                "|---" * (2 + len(c.deltas)) + "|"]
        out += [f"| {md(cat)} | " + " | ".join(cells) + " |" for cat, cells in rows]
    rows = finding_rows(c)
    out += ["", "## Findings", ""]
    if rows:
        out += ["| rule | verdict | status | "
                + " | ".join(_letter(n) for n in range(len(c.inputs))) + " |",
                "|---" * (3 + len(c.inputs)) + "|"]
        out += [f"| {md(rule)} | {md(verdict)} | {md(status)} | " + " | ".join(cells) + " |"
                for rule, verdict, status, cells in rows]
    else:
        out.append("No findings in any input.")
    for d in c.deltas:
        lines = prediction_lines(d)
        if lines:
            out += ["", "## Prediction check "
                    + md(f"({c.baseline['label']} -> {d['label']})", FRAME), ""]
            out += [f"- {md(line, TEXT)}" for line in lines]
    line = imbalance_line(c)
    if line:
        out += ["", "## Imbalance", "", md(line, TEXT), "",
                "| rank | source | peak | vs median |", "|---|---|---|---|"]
        out += [f"| {'-' if r['rank'] is None else r['rank']} | {md(r['source'], FRAME)} | "
                f"{human(r['peak_bytes'])} | {pct(r['deviation_pct'])} |"
                for r in c.imbalance["ranks"]]
    gate = gate_lines(c)
    if gate:
        out += ["", "## Gate", ""] + [f"- {md(x, TEXT)}" for x in gate]
    return "\n".join(out) + "\n"


def _letter(n: int) -> str:
    return chr(ord("A") + n) if n < 26 else f"#{n + 1}"


def gate_lines(doc) -> list[str]:
    """The CI gate's verdict, when one was asked (`--fail-on`)."""
    if doc.gate is None:
        return []
    return [f"FAIL: {x}" for x in doc.gate] or ["gate passed"]


def html(c: Comparison, screen: Screen = PLAIN) -> str:
    """The same sections as markdown, as one self-contained offline page."""
    from snapforensics.report.pages import lines, page, table

    n = len(c.inputs)
    body = lines(gate_lines(c), "fail") + lines(c.warnings[:ROWS])
    body.append("<h2>Inputs</h2>" + table(
        ["", "source", "rank", "overall peak", "peak in", "anomalies"],
        [[_letter(i), x["source"], "-" if x["rank"] is None else x["rank"],
          human(x["peaks"]["overall_bytes"]), x["peak_phase"] or "-",
          ", ".join(x["anomalies"]) or "none"] for i, x in enumerate(c.inputs)]))
    body.append("<h2>Peaks</h2>" + table(
        ["", _letter(0)] + [h for i in range(1, n) for h in (_letter(i), f"{_letter(i)} - A")],
        [[name, human(c.baseline["peaks"][key])]
         + [x for d in c.deltas for x in (human(d["peaks"][key]["after"]),
                                          change(d["peaks"][key]))]
         for key, name in PEAK_NAMES]))
    rows = category_rows(c)
    if rows:
        body.append("<h2>Alive at the peak, by what made it</h2>" + table(
            ["category", _letter(0)] + [f"{_letter(i)} (change)" for i in range(1, n)],
            [[cat, *cells] for cat, cells in rows]))
    rows = finding_rows(c)
    body.append("<h2>Findings</h2>" + (table(
        ["rule", "verdict", "status"] + [_letter(i) for i in range(n)],
        [[rule, verdict, status, *cells] for rule, verdict, status, cells in rows],
        [verdict for _, verdict, _, _ in rows]) if rows else "<p>No findings in any input.</p>"))
    for d in c.deltas:
        pl = prediction_lines(d)
        if pl:
            body += lines([f"Prediction check ({c.baseline['label']} -> {d['label']}):"] + pl,
                          "")
    line = imbalance_line(c)
    if line:
        body += lines([line], "")
    mode = "before/after" if c.mode == BEFORE_AFTER else "rank vs rank"
    return page(f"snapforensics compare ({mode})", headline(c), body, c.tool)
