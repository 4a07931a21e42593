"""Rendering of a Comparison (analysis/compare.py): terminal, markdown, json."""

from __future__ import annotations

from typing import Any

from snapforensics.analysis.compare import BEFORE_AFTER, Comparison
from snapforensics.report.common import human

FORMATS = ("terminal", "markdown", "json", "html")
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
    sev = {"anomalous": 0, "expected": 1, "info": 2}
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

def render_text(c: Comparison, fmt: str) -> str:
    if fmt == "json":
        from snapforensics.report.json import dumps
        return dumps(c.to_dict(), indent=True)
    if fmt == "markdown":
        return render_markdown(c)
    if fmt == "html":
        return render_html(c)
    from io import StringIO

    from rich.console import Console
    buf = StringIO()
    render_terminal(c, Console(file=buf, width=120, force_terminal=False, no_color=True))
    return buf.getvalue()


def render_terminal(c: Comparison, console) -> None:
    from rich.table import Table
    from rich.text import Text

    mode = "before/after" if c.mode == BEFORE_AFTER else "rank vs rank"
    console.print(Text(f"snapforensics compare ({mode}, baseline {c.baseline['label']})",
                       style="bold"))
    flagged = c.imbalance and c.imbalance["flagged"]
    console.print(Text(headline(c), style="bold red" if flagged else "bold"))
    for w in c.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))

    t = Table(title="inputs", title_justify="left", show_edge=False)
    t.add_column("")
    t.add_column("source", overflow="fold")
    t.add_column("rank", justify="right")
    t.add_column("peak", justify="right")
    t.add_column("peak in")
    t.add_column("anomalies", overflow="fold")
    for n, inp in enumerate(c.inputs):
        t.add_row(_letter(n), inp["label"], "-" if inp["rank"] is None else str(inp["rank"]),
                  human(inp["peaks"]["overall_bytes"]), str(inp["peak_phase"] or "-"),
                  ", ".join(inp["anomalies"]) or "none")
    console.print(t)

    t = Table(title=f"peaks, change vs {_letter(0)}", title_justify="left", show_edge=False)
    t.add_column("")
    t.add_column(_letter(0), justify="right")
    for n in range(1, len(c.inputs)):
        t.add_column(_letter(n), justify="right")
        t.add_column(f"{_letter(n)} - {_letter(0)}", justify="right")
    for key, name in PEAK_NAMES:
        row = [name, human(c.baseline["peaks"][key])]
        for d in c.deltas:
            ch = d["peaks"][key]
            style = "green" if ch["delta_bytes"] < 0 else "red" if ch["delta_bytes"] > 0 else ""
            row += [human(ch["after"]), Text(change(ch), style=style)]
        t.add_row(*row)
    console.print(t)

    rows = category_rows(c)
    if rows:
        t = Table(title="alive at the peak, by what made it", title_justify="left",
                  show_edge=False)
        t.add_column("category", overflow="fold")
        t.add_column(_letter(0), justify="right")
        for n in range(1, len(c.inputs)):
            t.add_column(f"{_letter(n)} (change)", justify="right")
        for cat, cells in rows:
            t.add_row(cat, *cells)
        console.print(t)
        if c.mode == BEFORE_AFTER:
            for d in c.deltas:
                console.print(f"{d['label']}: removed {human(d['removed_at_peak_bytes'])} "
                              f"and added {human(d['added_at_peak_bytes'])} at the peak")

    rows = finding_rows(c)
    if rows:
        t = Table(title="findings", title_justify="left", show_edge=False)
        t.add_column("rule", overflow="fold", min_width=min(40, max(len(r[0]) for r in rows)))
        t.add_column("verdict")
        t.add_column("status", overflow="fold")
        for n in range(len(c.inputs)):
            t.add_column(_letter(n), justify="right", overflow="fold")
        for rule, verdict, status, cells in rows:
            bad = verdict == "anomalous"
            style = ("green" if bad else "") if status.startswith(("disappears", "gone")) else \
                ("red" if bad else "") if status.startswith("appears") else ""
            t.add_row(rule, Text(verdict, style="bold red" if bad else ""), Text(status, style),
                      *cells)
        console.print(t)
    else:
        console.print(Text("no findings in any input", style="dim"))

    for d in c.deltas:
        lines = prediction_lines(d)
        if lines:
            console.print(Text(f"prediction check ({c.baseline['label']} -> {d['label']}):",
                               style="bold"))
            for line, p in zip(lines, d["predictions"]):
                ok = p["error_pct"] is not None and abs(p["error_pct"]) < 10
                console.print(Text("  " + line, style=("green" if ok else "yellow")
                                   if p["fixed"] else "dim"))
    line = imbalance_line(c)
    if line:
        console.print(Text(line, style="bold red" if flagged else "green"))


def render_markdown(c: Comparison) -> str:
    mode = "before/after" if c.mode == BEFORE_AFTER else "rank vs rank"
    out = [f"# snapforensics compare ({mode})", "", f"**{headline(c)}**", ""]
    if c.warnings:
        out += [f"- ⚠ {w}" for w in c.warnings] + [""]
    out += ["| | source | rank | overall peak | forward | backward | peak in | anomalies |",
            "|---|---|---|---|---|---|---|---|"]
    for n, inp in enumerate(c.inputs):
        p = inp["peaks"]
        out.append(f"| {_letter(n)} | `{inp['source']}` | "
                   f"{'-' if inp['rank'] is None else inp['rank']} | "
                   f"{human(p['overall_bytes'])} | {human(p['forward_bytes'])} | "
                   f"{human(p['backward_bytes'])} | {inp['peak_phase'] or '-'} | "
                   f"{', '.join(inp['anomalies']) or 'none'} |")
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
        out += [f"| {cat} | " + " | ".join(cells) + " |" for cat, cells in rows]
    rows = finding_rows(c)
    out += ["", "## Findings", ""]
    if rows:
        out += ["| rule | verdict | status | "
                + " | ".join(_letter(n) for n in range(len(c.inputs))) + " |",
                "|---" * (3 + len(c.inputs)) + "|"]
        out += [f"| `{rule}` | {verdict} | {status} | " + " | ".join(cells) + " |"
                for rule, verdict, status, cells in rows]
    else:
        out.append("No findings in any input.")
    for d in c.deltas:
        lines = prediction_lines(d)
        if lines:
            out += ["", f"## Prediction check ({c.baseline['label']} -> {d['label']})", ""]
            out += [f"- {line}" for line in lines]
    line = imbalance_line(c)
    if line:
        out += ["", "## Imbalance", "", line, "",
                "| rank | source | peak | vs median |", "|---|---|---|---|"]
        out += [f"| {'-' if r['rank'] is None else r['rank']} | `{r['source']}` | "
                f"{human(r['peak_bytes'])} | {pct(r['deviation_pct'])} |"
                for r in c.imbalance["ranks"]]
    return "\n".join(out) + "\n"


def _letter(n: int) -> str:
    return chr(ord("A") + n) if n < 26 else f"#{n + 1}"


def render_html(c: Comparison, gate: list[str] | None = None) -> str:
    """The same sections as markdown, as one self-contained offline page."""
    from snapforensics.report.pages import lines, page, table

    n = len(c.inputs)
    body = lines(c.warnings) + lines(gate or [], "warn fail")
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
            body.append(f"<h2>Prediction check ({_esc(c.baseline['label'])} -> "
                        f"{_esc(d['label'])})</h2>")
            body += lines(pl, "")
    line = imbalance_line(c)
    if line:
        body.append("<h2>Imbalance</h2>")
        body += lines([line], "")
    mode = "before/after" if c.mode == BEFORE_AFTER else "rank vs rank"
    return page(f"snapforensics compare ({mode})", headline(c), body, c.tool)


def _esc(s: Any) -> str:
    from snapforensics.report.pages import h
    return h(s)


# ------------------------------------------------------------------------- two runs, by rank

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


def run_rows(r) -> list[list[str]]:
    from snapforensics.analysis.gate import _new_anomalies

    out = []
    for c in r.pairs:
        d = c.deltas[0]
        p = d["peaks"]["overall_bytes"]
        out.append([who(c.inputs[1]), human(p["before"]), human(p["after"]), change(p),
                    ", ".join(x["rule"] for x in _new_anomalies(d)) or "-",
                    ", ".join(x["rule"] for x in d["findings"]["disappeared"]
                              if x["verdict"] == "anomalous") or "-"])
    return out


def render_runs(r, fmt: str, gate: list[str], console=None) -> str | None:
    """Two run folders compared rank by rank: the overall headline, one row per rank, the
    unpaired files and the gate's verdict, in any format."""
    if fmt == "json":
        from snapforensics.report.json import dumps
        return dumps(r.to_dict() | {"gate": {"failures": gate}}, indent=True)
    head = f"snapforensics compare {r.a} -> {r.b} (rank by rank)"
    notes = [f"no counterpart: {u}" for u in r.unpaired] + [f"FAIL: {g}" for g in gate]
    if fmt == "html":
        from snapforensics.report.pages import lines, page, table
        return page(head, runs_headline(r), [table(RUN_HEAD, run_rows(r))] + lines(notes),
                    r.pairs[0].tool)
    if fmt == "markdown":
        from snapforensics.report.pages import md_table
        return "\n".join([f"# {head}", "", f"**{runs_headline(r)}**", ""]
                         + md_table(RUN_HEAD, run_rows(r)) + [f"- {x}" for x in notes]) + "\n"
    from rich.table import Table
    from rich.text import Text
    if console is None:
        from io import StringIO

        from rich.console import Console
        buf = StringIO()
        render_runs(r, fmt, gate, Console(file=buf, width=120, no_color=True))
        return buf.getvalue()
    console.print(Text(head, style="bold"))
    console.print(Text(runs_headline(r), style="bold"))
    t = Table(show_edge=False)
    for col in RUN_HEAD:
        t.add_column(col)
    for row in run_rows(r):
        t.add_row(*map(Text, row))
    console.print(t)
    for x in notes:
        console.print(Text(x, style="red" if x.startswith("FAIL") else "yellow"))
    return None
