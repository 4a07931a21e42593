"""Renderers of a Forecast: terminal, markdown, json, html (one table, the same facts)."""

from __future__ import annotations

import html as _html

from snapforensics.analysis.evidence import human
from snapforensics.analysis.forecast import SCALING_TEXT, Forecast, Prediction

COLUMNS = ("W", "strategy", "ckpt", "micro-batch", "fix applied", "predicted peak",
           "vs recorded", "phase (row)", "dominant", "fits")


def _row(p: Prediction, recorded: int) -> list[str]:
    sc = p.scenario
    head = [str(sc.world_size), sc.strategy, sc.checkpointing, f"x{sc.micro_batch_scale:g}",
            sc.fix or "-"]
    if p.refused:
        return head + ["refused", "", "", p.refused, ""]
    pk = p.predicted_peak_bytes or 0
    delta = f"{(pk - recorded) / recorded:+.0%}" if recorded else "n/a"
    fits = "" if p.fits is None else ("yes" if p.fits else "NO")
    return head + [human(pk), delta, f"{p.phase} ({p.peak_row})", p.dominant or "-", fits]


def _baseline_line(f: Forecast) -> str:
    b = f.baseline
    w = b["world_size"] or "unknown"
    return (f"recorded: world size {w}, {b['strategy']}, checkpointing {b['checkpointing']}; "
            f"peak {human(b['peak_bytes'])} in {b['phase']} (row {b['row']}), replayed "
            f"{human(b['replayed_peak_bytes'] or 0)}")


def _fit_lines(f: Forecast) -> list[str]:
    if not f.fit:
        return []
    fit = f.fit
    out = []
    cap = human(fit["capacity_bytes"])
    if fit.get("smallest_world_size"):
        out.append(f"smallest world size that fits {cap}: {fit['smallest_world_size']} "
                   f"(peak {human(fit['peak_bytes_there'])})")
    else:
        out.append(f"no world size fits {cap}: {fit.get('reason', '')}")
    ch = fit.get("cheapest_change")
    if ch:
        what = ", ".join(f"{k}={v}" for k, v in ch["change"].items())
        out.append(f"cheapest change that fits at the recorded world size: {what} "
                   f"(peak {human(ch['peak_bytes'])})")
    else:
        out.append("no single change (strategy, checkpointing, half micro-batch) fits at the "
                   "recorded world size")
    return out


def _scaling_lines(f: Forecast) -> list[str]:
    """What is alive at the recorded peak, by category and by how it scales (the model)."""
    b = f.baseline
    rows = b.get("breakdown") or {}
    out = ["alive at the recorded peak: " + ", ".join(
        f"{c} {human(v)}" for c, v in sorted(rows.items(), key=lambda x: -x[1]))]
    if b.get("by_scaling"):
        out.append("by how it scales: " + "; ".join(
            f"{SCALING_TEXT[k]} {human(v)}" for k, v in b["by_scaling"].items()))
    return out


def render_text(f: Forecast, fmt: str) -> str:
    if fmt == "json":
        from snapforensics.report.json import dumps
        return dumps(f.to_dict(), indent=True)
    if fmt == "markdown":
        return _markdown(f)
    if fmt == "html":
        return _html_page(f)
    from io import StringIO

    from rich.console import Console
    buf = StringIO()
    render_terminal(f, Console(file=buf, width=140, force_terminal=False, no_color=True))
    return buf.getvalue()


def render_terminal(f: Forecast, console) -> None:
    from rich.table import Table
    from rich.text import Text

    console.print(Text(f"snapforensics forecast: {f.source}", style="bold"))
    console.print(Text(_baseline_line(f)))
    for n in f.notes:
        console.print(Text(f"note: {n}", style="yellow"))
    t = Table(show_edge=False)
    for c in COLUMNS:
        t.add_column(c, justify="right" if c in ("predicted peak", "vs recorded") else "left")
    rec = f.baseline["peak_bytes"]
    for p in f.scenarios:
        t.add_row(*[Text(x) for x in _row(p, rec)])
    console.print(t)
    for line in _scaling_lines(f) + _fit_lines(f):
        console.print(Text(line))


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("`", "'").replace("\n", " ")


def _markdown(f: Forecast) -> str:
    out = [f"# snapforensics forecast: `{_md(f.source)}`", "", f"- {_baseline_line(f)}"]
    out += [f"- note: {_md(n)}" for n in f.notes]
    out += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    rec = f.baseline["peak_bytes"]
    out += ["| " + " | ".join(_md(x) for x in _row(p, rec)) + " |" for p in f.scenarios]
    out += [""] + [f"- {_md(x)}" for x in _scaling_lines(f) + _fit_lines(f)]
    out += ["", "Each block scales by what made it: " + ", ".join(SCALING_TEXT.values()) +
            " (docs/forecast.md)."]
    return "\n".join(out) + "\n"


def _html_page(f: Forecast) -> str:
    e = lambda x: _html.escape(str(x), quote=True)  # noqa: E731
    rec = f.baseline["peak_bytes"]
    rows = "".join("<tr>" + "".join(f"<td>{e(x)}</td>" for x in _row(p, rec)) + "</tr>"
                   for p in f.scenarios)
    items = "".join(f"<li>{e(x)}</li>" for x in f.notes + _scaling_lines(f) + _fit_lines(f))
    head = "".join(f"<th>{e(c)}</th>" for c in COLUMNS)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>snapforensics forecast: {e(f.source)}</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
        f"<h1>snapforensics forecast</h1><p><code>{e(f.source)}</code></p>"
        f"<p>{e(_baseline_line(f))}</p><table><tr>{head}</tr>{rows}</table><ul>{items}</ul>"
        "</body></html>\n")
