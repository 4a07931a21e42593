"""HTML: one self-contained file to attach to a bug ticket.

No network at all: inline CSS, inline SVG charts, `<details>` instead of scripts. The only
script element is the full JSON diagnosis (`<script type="application/json" id="diagnosis">`)
so tools can pull the numbers back out of the file. Every string that came from the snapshot
(file paths, function names, provenance, the source path) goes through `html.escape`; the
embedded JSON has every `<` written as `\\u003c`, so it can never close its script element.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from snapforensics.analysis.diagnosis import (
    MODULES,
    STACKS,
    TENSORS,
    DeviceSummary,
    Diagnosis,
    Finding,
)
from snapforensics.report import plot
from snapforensics.report.common import (
    command_line,
    compiled_lines,
    compiled_regions,
    dump_line,
    finding_lines,
    framework_line,
    headline,
    human,
    largest_named,
    names_line,
    no_names,
    peak_line,
    peak_stacks,
    phase_peaks,
    provenance_line,
    ratio,
    saved_by_layer,
    tensor_names,
    verdict_order,
)
from snapforensics.report.json import dumps
from snapforensics.report.registry import PLAIN, Screen
from snapforensics.report.sanitize import FRAME, FRAMES, NAME, ROWS, TEXT
from snapforensics.report.sanitize import html as escape

VERDICT_LABEL = {"anomalous": "ANOMALOUS", "expected": "EXPECTED", "info": "INFO"}

CSS = """
:root{--fg:#1d2430;--muted:#5f6b7a;--line:#dde2e8;--bg:#fff;--soft:#f5f7fa;
--red:#c62828;--redbg:#fdecea;--green:#2e7d32;--greenbg:#e8f5e9;--blue:#1565c0;
--bluebg:#e3f0fd;--amber:#8a5a00;--amberbg:#fff4d6}
*{box-sizing:border-box}
.sf-report{background:var(--soft);color:var(--fg);
font:15px/1.5 -apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1120px;margin:0 auto;padding:24px 20px 48px}
.topfix{border:1px solid #f3c0bc;background:#fffafa;border-radius:8px;padding:10px 14px;
margin:12px 0}
.topfix h4{margin:0 0 4px}
h1{font-size:20px;margin:0 0 2px}h2{font-size:18px;margin:0 0 10px}
h3{font-size:16px;margin:0 0 6px}h4{font-size:14px;margin:14px 0 6px}
code,pre{font:12.5px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace}
pre{background:#f6f8fa;border:1px solid var(--line);border-radius:6px;padding:10px 12px;
overflow-x:auto;margin:6px 0;white-space:pre}
pre.fix{background:#0f1720;color:#e6edf3;border-color:#0f1720}
.src{color:var(--muted);word-break:break-all}
.card{background:var(--bg);border:1px solid var(--line);border-radius:10px;padding:18px 20px;
margin:16px 0}
.headline{font-size:18px;font-weight:650;padding:12px 16px;border-radius:8px;margin:14px 0 12px}
.headline.bad{background:var(--redbg);color:var(--red)}
.headline.good{background:var(--greenbg);color:var(--green)}
.headline.none{background:#eef0f3;color:var(--muted)}
.stats{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0}
.stat{flex:1 1 150px;background:var(--soft);border:1px solid var(--line);border-radius:8px;
padding:8px 12px}
.stat .k{font-size:12px;color:var(--muted);text-transform:uppercase;letter-spacing:.04em}
.stat .v{font-size:20px;font-weight:650}
.muted{color:var(--muted)}
.warnings{background:var(--amberbg);border:1px solid #f0d28a;border-left:5px solid #e0a800;
border-radius:8px;padding:10px 14px;margin:12px 0;color:var(--amber)}
.warnings ul{margin:4px 0 0;padding-left:20px}
.warnings strong{color:#6b4500}
table{border-collapse:collapse;margin:8px 0;font-size:14px}
th,td{border-bottom:1px solid var(--line);padding:4px 12px 4px 0;text-align:left;
vertical-align:top}
th{font-size:12px;color:var(--muted);text-transform:uppercase;letter-spacing:.04em}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums;padding-left:12px}
tr.hot td{font-weight:650}
.chart{width:100%;height:auto;display:block;margin:8px 0 2px}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:13px;color:var(--muted);margin:2px 0 10px}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-1px;
margin-right:5px}
.bars{display:grid;grid-template-columns:minmax(120px,max-content) 1fr max-content max-content;
gap:4px 12px;align-items:center;font-size:14px;margin:8px 0}
.bar{height:14px;border-radius:3px;min-width:2px}
.track{background:#eef0f3;border-radius:3px}
.n{font-variant-numeric:tabular-nums;text-align:right}
details{margin:6px 0}summary{cursor:pointer}
details>summary{font-weight:550}
.finding{border-left:6px solid var(--line)}
.finding.anomalous{border-left-color:var(--red)}
.finding.expected{border-left-color:var(--green)}
.finding.info{border-left-color:var(--blue)}
.badge{display:inline-block;font-size:11.5px;font-weight:700;letter-spacing:.05em;
border-radius:4px;padding:1px 7px;margin-right:6px;vertical-align:2px}
.badge.anomalous{background:var(--red);color:#fff}
.badge.expected{background:var(--green);color:#fff}
.badge.info{background:var(--blue);color:#fff}
.rule{font-size:13px;color:var(--muted);margin-bottom:8px}
ul.figs{margin:6px 0;padding-left:20px;font-weight:600}
.cmp{display:grid;grid-template-columns:max-content 1fr max-content;gap:4px 12px;
align-items:center;font-size:14px;max-width:720px;margin:8px 0}
.summary a{color:inherit}
h2.sec{margin:28px 0 0}
.card>:last-child{margin-bottom:0}
footer{color:var(--muted);font-size:12.5px;margin-top:24px}
"""


def e(x: Any, limit: int = TEXT) -> str:
    """Escape anything for text or a quoted attribute, capped at `limit` characters."""
    return escape(x, limit)


def _num(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def _bars(rows: list[tuple[str, int]]) -> str:
    total = sum(b for _, b in rows) or 1
    top = max((b for _, b in rows), default=0) or 1
    out = ['<div class="bars">']
    for name, b in rows:
        out.append(f'<div>{e(name)}</div><div class="track"><div class="bar" style="width:'
                   f'{100 * b / top:.1f}%;background:{plot.color(name)}"></div></div>'
                   f'<div class="n">{e(human(b))}</div>'
                   f'<div class="n muted">{100 * b / total:.0f}%</div>')
    out.append("</div>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Sections


def _stack_pre(stack: list[Any]) -> str:
    more = [f"… {len(stack) - FRAMES} more frames"] if len(stack) > FRAMES else []
    return "<pre>" + "\n".join(e(s, FRAME) for s in [*stack[:FRAMES], *more]) + "</pre>"


def _header(d: Diagnosis) -> str:
    cls = "bad" if d.anomalies else "good" if d.devices else "none"
    p = d.peaks
    out = ['<header class="card">', '<h1>snapforensics diagnosis</h1>',
           f'<div class="src"><code>{e(d.source, FRAME)}</code></div>',
           f'<div class="headline {cls}">{e(headline(d))}</div>', _top_fix(d),
           '<div class="stats">',
           _stat("overall peak", human(p["overall_bytes"])),
           _stat("forward peak", human(p["forward_bytes"]) if p["forward_bytes"] else "n/a"),
           _stat("backward peak", human(p["backward_bytes"]) if p["backward_bytes"] else "n/a"),
           _stat("backward / forward", ratio(p["backward_bytes"], p["forward_bytes"])
                 if p["backward_bytes"] else "n/a"),
           '</div>',
           f'<p>{e(peak_line(d))}</p>',
           f'<p class="muted">{e(provenance_line(d))}</p>']
    fw = framework_line(d)
    if fw:
        out.append(f'<p class="muted">{e(fw)}</p>')
    cmd = command_line(d)
    if cmd:
        out.append(f'<div>command:</div><pre>{e(cmd, FRAME)}</pre>')
    if d.provenance:
        items = [(k, v) for k, v in d.provenance.items() if k != "command"][:ROWS]
        rows = "".join(f"<tr><td>{e(k, NAME)}</td><td><code>{e(_short(v), FRAME)}</code></td>"
                       "</tr>" for k, v in items)
        if rows:
            out.append(f'<details><summary>Recording details</summary><table>{rows}</table>'
                       '</details>')
    if d.warnings:
        out.append('<div class="warnings"><strong>&#9888; Warnings: read the figures with '
                   'these in mind</strong><ul>')
        out += [f"<li>{e(w)}</li>" for w in d.warnings[:ROWS]]
        if len(d.warnings) > ROWS:
            out.append(f"<li>… {len(d.warnings) - ROWS} more warnings</li>")
        out.append("</ul></div>")
    if d.findings:
        counts: dict[str, int] = {}
        for f in d.findings:
            counts[f.verdict] = counts.get(f.verdict, 0) + 1
        links = []
        for i, f in enumerate(verdict_order(d.findings), start=1):
            links.append(f'<li><span class="badge {e(f.verdict)}">'
                         f'{e(VERDICT_LABEL.get(f.verdict, f.verdict.upper()))}</span>'
                         f'<a href="#finding-{i}">{e(f.title, NAME)}</a> '
                         f'<span class="muted">{e(human(f.bytes))}</span></li>')
        out.append('<div class="summary"><h4>Findings</h4><ul>' + "".join(links) + "</ul></div>")
    out.append("</header>")
    return "".join(out)


def _short(v: Any, limit: int = 300) -> str:
    s = v if isinstance(v, str) else dumps(v)[:limit + 1]
    return s if len(s) <= limit else s[:limit] + "..."


def _stat(k: str, v: str) -> str:
    return f'<div class="stat"><div class="k">{e(k)}</div><div class="v">{e(v)}</div></div>'


def _drawn(d: Diagnosis) -> set[int]:
    """The devices whose plot this report draws (`plot.panels`: bounded whatever the file
    says)."""
    return {s.device for s in plot.panels([dev.plot for dev in d.devices if dev.plot])}


def _device(dev: DeviceSummary, d: Diagnosis, drawn: set[int]) -> str:
    row = f" (trace row {_num(dev.peak_row)})" if _num(dev.peak_row) >= 0 else ""
    out = [f'<section class="card" id="device-{e(dev.device)}">',
           f'<h2>Device {e(dev.device)}</h2>',
           f'<p>Peak <strong>{e(human(dev.peaks["overall_bytes"]))}</strong> in '
           f'{e(dev.peak_phase)}{row}; {e(dump_line(d, dev))}.</p>']
    hist = dev.history or {}
    if hist.get("rows"):
        note = (f'{_num(hist.get("rows"))} trace rows, {_num(hist.get("allocations"))} '
                'allocations')
        if hist.get("truncated"):
            note += (f'; history truncated: {human(_num(hist.get("baseline_bytes")))} was '
                     'already alive before the first entry')
        out.append(f'<p class="muted">{e(note)}</p>')
    chart = _plot(dev, d) if dev.device in drawn else ""
    if dev.timeline and not chart:  # a series was made, and left out of the document
        out.append(f'<p class="muted">Plot left out: a report draws the {plot.MAX_PANELS} '
                   'devices with the highest peaks.</p>')
    elif chart:
        out += ["<h4>Live bytes over time, by what made them (hover for what is alive)</h4>",
                chart]
    else:
        out.append('<p class="muted">No allocation history on this device: no timeline, '
                   'figures come from the segments alive at dump time.</p>')
    # one forward-only iteration repeats the peak above: shown only when it adds something
    if len(dev.iterations) > 1 or any(_num(i.get("backward_peak_bytes")) for i in dev.iterations):
        fw_max = max((_num(i.get("forward_peak_bytes")) for i in dev.iterations), default=0)
        bw_max = max((_num(i.get("backward_peak_bytes")) for i in dev.iterations), default=0)
        rows = []
        for it in dev.iterations[:ROWS]:
            fw, bw = _num(it.get("forward_peak_bytes")), _num(it.get("backward_peak_bytes"))
            hot = ' class="hot"' if max(fw, bw) == max(fw_max, bw_max) else ""
            rows.append(f'<tr{hot}><td>{e(it.get("index"))}</td>'
                        f'<td class="n">{e(it.get("start_row", ""))}&ndash;'
                        f'{e(it.get("end_row", ""))}</td>'
                        f'<td class="n">{e(human(fw))}</td><td class="n">{e(human(bw))}</td>'
                        + "".join(f'<td class="n">{e(p)}</td>' for p in phase_peaks(it)) +
                        f'<td class="n">{e(ratio(bw, fw)) if bw else "n/a"}</td></tr>')
        table = ('<table><tr><th>iteration</th><th class="n">rows</th>'
                 '<th class="n">forward peak</th><th class="n">backward peak</th>'
                 '<th class="n">recompute peak</th><th class="n">optimizer peak</th>'
                 '<th class="n">backward/forward</th></tr>' + "".join(rows) + "</table>")
        if len(rows) > 20:
            table = (f"<details><summary>{len(rows)} iterations</summary>{table}</details>")
        out += ["<h4>Iterations</h4>", table]
    if dev.categories_at_peak:
        rows2 = sorted(((str(c), _num(b)) for c, b in dev.categories_at_peak.items()),
                       key=lambda x: -x[1])
        out += ["<h4>Alive at the peak, by what made it</h4>", _bars(rows2)]
    out += _names(dev) + _compiled(dev)
    if dev.top_stacks_at_peak:
        out.append("<h4>Top allocating stacks alive at the peak</h4>")
        for k, s in enumerate(peak_stacks(dev)):
            out.append(f'<details{" open" if k == 0 else ""}><summary>'
                       f'{e(human(_num(s.get("bytes"))))} in {e(_num(s.get("blocks")))} blocks '
                       f'({e(s.get("category", "?"), NAME)})</summary>'
                       f'{_stack_pre(s.get("stack") or [])}</details>')
    out.append("</section>")
    return "".join(out)


def _names(dev: DeviceSummary) -> list[str]:
    t = tensor_names(dev)
    if t is None:
        return []
    out = [f'<p>{e(names_line(t))}.</p>']
    rows = saved_by_layer(t)
    if rows:
        body = "".join(f'<tr><td><code>{e(a, NAME)}</code></td><td class="n">{e(human(b))}</td>'
                       f'<td class="n">{e(n)}</td><td>{e(i)}</td></tr>' for a, b, n, i in
                       rows[:ROWS])
        out.append(f'<h4>Saved for backward, by layer (alive at the peak: '
                   f'{e(human(sum(r[1] for r in rows)))})</h4><table><tr><th>layer</th>'
                   '<th class="n">bytes</th><th class="n">tensors</th><th>inside</th></tr>'
                   f'{body}</table>')
    big = largest_named(t)
    if big:
        body = "".join(f'<tr><td><code>{e(a, NAME)}</code></td><td>{e(k, NAME)}</td>'
                       f'<td>{e(s, NAME)}</td><td class="n">{e(human(b))}</td></tr>'
                       for a, k, s, b in big)
        out.append('<h4>Largest named tensors at the peak</h4><table><tr><th>tensor</th>'
                   '<th>kind</th><th>shape</th><th class="n">bytes</th></tr>'
                   f'{body}</table>')
    return out


def _compiled(dev: DeviceSummary) -> list[str]:
    comp = compiled_regions(dev)
    if comp is None:
        return []
    body = "".join(f'<tr><td><code>{e(r, NAME)}</code></td><td><code>{e(src, NAME)}</code></td>'
                   f'<td class="n">{e(human(fw))}</td><td class="n">{e(human(bw))}</td>'
                   f'<td class="n">{e(n)}</td></tr>' for r, src, fw, bw, n in comp[1][:ROWS])
    out = [f'<h4>{e(comp[0])}</h4><table><tr><th>region</th><th>source</th>'
           '<th class="n">forward at peak</th><th class="n">backward at peak</th>'
           f'<th class="n">blocks</th></tr>{body}</table>']
    lines = compiled_lines(dev)
    if lines is not None:
        body = "".join(f'<tr><td><code>{e(ln, NAME)}</code></td><td><code>{e(b, NAME)}</code>'
                       f'</td><td>{e(ps)}</td><td class="n">{e(human(pk))}</td>'
                       f'<td class="n">{e(human(mk))}</td></tr>'
                       for ln, b, ps, pk, mk in lines[1][:ROWS])
        out.append(f'<h4>{e(lines[0])}</h4><table><tr><th>model line</th><th>buffers</th>'
                   '<th>pass</th><th class="n">at peak</th><th class="n">allocated</th></tr>'
                   f'{body}</table>')
    return out


def _no_names_card(d: Diagnosis) -> str:
    t = no_names(d)
    if t is None:
        return ""
    said = "".join(f"<li>{e(s)}</li>" for s in (t.get("said") or [])[:ROWS])
    return ('<section class="card" id="tensor-names"><h2>Tensor names</h2>'
            f'<p>This dump has no tensor names. What it can say:</p><ul>{said}</ul>'
            f'<p>The next dump with names:</p><pre>{e(t.get("recipe", ""))}</pre></section>')


def _finding(i: int, f: Finding, d: Diagnosis) -> str:
    v = f.verdict if f.verdict in VERDICT_LABEL else "info"
    out = [f'<section class="card finding {v}" id="finding-{i}">',
           f'<h3><span class="badge {v}">{e(VERDICT_LABEL.get(f.verdict, f.verdict.upper()))}'
           f'</span>{e(f.title, NAME)}</h3>',
           f'<div class="rule">rule <code>{e(f.rule, NAME)}</code> &middot; device '
           f'{e(f.device)}</div>',
           '<ul class="figs">' + "".join(f"<li>{e(x)}</li>" for x in finding_lines(d, f))
           + "</ul>"]
    if f.predicted_peak_bytes is not None:
        dev = next((x for x in d.devices if x.device == f.device), None)
        now = dev.peaks["overall_bytes"] if dev else d.peaks["overall_bytes"]
        scale = max(now, f.predicted_peak_bytes) or 1
        out.append('<div class="cmp">')
        for label, val, col in (("measured peak", now, "#c62828"),
                                ("predicted after the fix", f.predicted_peak_bytes, "#2e7d32")):
            out.append(f'<div>{label}</div><div class="track"><div class="bar" style="width:'
                       f'{100 * val / scale:.1f}%;background:{col}"></div></div>'
                       f'<div class="n">{e(human(val))}</div>')
        out.append("</div>")
    out.append(f'<p>{e(f.cause)}</p>')
    ev = f.evidence or {}
    mods = f.modules
    if mods:
        rows = "".join(f'<tr><td><code>{e(m.get("module", "?"), NAME)}</code></td>'
                       f'<td class="n">{e(human(_num(m.get("bytes"))))}</td>'
                       f'<td class="n">{e(_num(m.get("blocks")))}</td></tr>' for m in mods[:ROWS])
        out.append('<h4>By module</h4><table><tr><th>module</th><th class="n">bytes</th>'
                   f'<th class="n">blocks</th></tr>{rows}</table>')
    named = largest_named(f.tensors)
    if named:
        rows = "".join(f'<tr><td><code>{e(a, NAME)}</code></td><td>{e(k, NAME)}</td>'
                       f'<td>{e(sh, NAME)}</td><td class="n">{e(human(b))}</td></tr>'
                       for a, k, sh, b in named)
        out.append('<h4>Tensors</h4><table><tr><th>tensor</th><th>kind</th><th>shape</th>'
                   f'<th class="n">bytes</th></tr>{rows}</table>')
    for s in f.stacks[:1]:
        out.append(f'<details open><summary>Representative stack '
                   f'({e(human(_num(s.get("bytes"))))} in {e(_num(s.get("blocks")))} blocks)'
                   f'</summary>{_stack_pre(s.get("stack") or [])}</details>')
    if f.fix:
        out.append(f'<h4>Fix</h4><pre class="fix"><code>{e(f.fix, FRAME * FRAMES)}</code></pre>')
    if f.blocks:  # the explorer highlights its blocks (`explore`, README: Explore)
        out.append(f'<p class="rule">Its blocks, one by one: <code>snapforensics explore '
                   f'{e(shlex.quote(d.source), FRAME)} --finding '
                   f'{next(n for n, x in enumerate(d.findings) if x is f)}</code></p>')
    extra = _extra_evidence(ev)
    if extra:
        out.append(f"<details><summary>More evidence</summary>{extra}</details>")
    out.append("</section>")
    return "".join(out)


def _extra_evidence(ev: dict[str, Any]) -> str:
    rows = []
    for k, v in list(ev.items())[:ROWS]:
        if k in (MODULES, STACKS, TENSORS):  # shown above
            continue
        if k in ("by_path", "per_iteration_bytes", "predicted_peaks") and isinstance(v, dict):
            txt = ", ".join(f"{kk}: {human(_num(vv))}" for kk, vv in list(v.items())[:ROWS])
        else:
            txt = _short(v)
        rows.append(f"<tr><td>{e(k, NAME)}</td><td>{e(txt)}</td></tr>")
    return f"<table>{''.join(rows)}</table>" if rows else ""


def script_json(v: Any) -> str:
    """The sink's neutralizer for data inside a <script type="application/json">: `<` only
    occurs inside JSON strings, where \\u003c means the same character, so nothing in the
    payload can close the script element or open an HTML comment."""
    return dumps(v).replace("<", "\\u003c")


def _json_block(d: Diagnosis) -> str:
    return f'<script type="application/json" id="diagnosis">{script_json(d.to_dict())}</script>'


def _plot(dev: DeviceSummary, d: Diagnosis) -> str:
    if dev.plot is None:
        return ""
    top = next((f for f in d.findings if f.rule == dev.plot.predicted_rule
                and f.device == dev.device), None)
    return plot.svg(dev.plot, e, script_json, top.title if top else None)


def _top_fix(d: Diagnosis) -> str:
    """The fix of the anomaly to fix first, on the first screen."""
    f = d.top
    if f is None or not f.fix:
        return ""
    i = verdict_order(d.findings).index(f) + 1
    after = (f" Predicted peak after it: {human(f.predicted_peak_bytes)}"
             f" (now {human(d.peaks['overall_bytes'])})." if f.predicted_peak_bytes else "")
    return (f'<div class="topfix"><h4>Fix first: <a href="#finding-{i}">{e(f.title, NAME)}</a>'
            f'</h4><div class="muted">{e(after)}</div>'
            f'<pre class="fix"><code>{e(f.fix, FRAME * FRAMES)}</code></pre></div>')


def scoped(css: str, scope: str = ".sf-report") -> str:
    """Every rule of `css` limited to the report's element, so the styles never leak into a
    page the report is embedded in (a notebook); `:root`, `body` and `.sf-report` rules style
    that element itself."""
    def one(m: re.Match) -> str:
        sels = ",".join(scope if x.strip() in (":root", "body", ".sf-report")
                        else f"{scope} {x.strip()}" for x in m[1].split(","))
        return f"{sels}{{{m[2]}}}"
    return re.sub(r"([^{}]+)\{([^{}]*)\}", one, css)


def body(d: Diagnosis) -> list[str]:
    """The report's sections (header, devices, findings): the page's body and, isolated from
    the notebook's styles, a notebook cell's (report/notebook.py)."""
    parts = [_header(d)]
    drawn = _drawn(d)
    parts += [_device(dev, d, drawn) for dev in d.devices]
    card = _no_names_card(d)
    if card:
        parts.append(card)
    parts.append('<h2 class="sec" id="findings">Findings</h2>')
    if not d.findings:
        parts.append('<section class="card"><p class="muted">No findings: no rule matched this '
                     'snapshot.</p></section>')
    parts += [_finding(i, f, d) for i, f in enumerate(verdict_order(d.findings), start=1)]
    return parts


def render(d: Diagnosis, screen: Screen = PLAIN) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>snapforensics: {e(d.source, FRAME)}</title>",
             f"<style>body{{margin:0}}{scoped(CSS + plot.CSS)}</style></head>"
             '<body class="sf-report"><main>', *body(d)]
    parts.append(f'<footer>{e(d.tool or "snapforensics")}. The full diagnosis is embedded in '
                 'this file as JSON: <code>&lt;script type="application/json" id="diagnosis"'
                 '&gt;</code>.</footer>')
    parts.append(_json_block(d))
    if any(dev.plot for dev in d.devices):
        parts.append(f"<script>{plot.JS}</script>")
    parts.append("</main></body></html>\n")
    return "\n".join(parts)
