"""The timeline plot, drawn from one `analysis.timeline.Series`: inline SVG with a hover for the
HTML report, a PNG (matplotlib) for the Markdown one. Both draw the same things: live bytes
stacked by what made them, phases shaded, iteration starts, the peak, the predicted curve after
the top fix and, with a caching allocator, the reserved bytes.

Every string from the snapshot (category names from --category, stack frames in the hover)
goes through the sink's neutralizing function: `esc` for SVG text, `script_json` for the hover
data (capped like every report string, and read by the script with `textContent`, never parsed
as HTML), `mpl_text` for the PNG.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np

from snapforensics.analysis.evidence import human
from snapforensics.analysis.series import MAX_PANELS, Series, panels

__all__ = ["MAX_PANELS", "panels", "png", "svg"]
from snapforensics.analysis.vocab import PHASE_LABELS
from snapforensics.report.sanitize import FRAME, NAME, cap

PHASE_COLORS = {
    "init": "#9aa3ad",
    "forward": "#4c8bf5",
    "backward": "#f29d38",
    "recompute": "#a86fd8",
    "optimizer": "#3fae6a",
    "unknown": "#c9ccd1",
}
# Categories drawn side by side must stay apart: related kinds (parameters sharded and
# unsharded, gradients and their reduce-scatter buffers) get different hues, not shades of one
# (tests/test_views.py checks every pair's CIE76 distance, the one perceptual measure that
# needs no library). Tableau's 20 colours, which are chosen for that.
CATEGORY_COLORS = {
    "parameter": "#1f77b4",
    "fsdp.sharded_param": "#aec7e8",
    "fsdp.unsharded_param": "#9467bd",
    "fsdp.all_gather_buffer": "#f7b6d2",
    "gradient": "#ff7f0e",
    "fsdp.unsharded_grad": "#8c564b",
    "fsdp.sharded_grad": "#17becf",
    "fsdp.reduce_scatter_buffer": "#bcbd22",
    "activation": "#d62728",
    "recompute_activation": "#ff9896",
    "optimizer_state": "#2ca02c",
    "other": "#7f7f7f",
    "untraced": "#e8e8e8",
    "ddp.bucket": "#e377c2",
    "ddp.grad_copy": "#ffbb78",
    "moe.dispatch_buffer": "#98df8a",
    "moe.combine_buffer": "#c49c94",
    "tp.all_gather": "#9c9ede",
    "tp.reduce_scatter": "#dbdb8d",
    "tp.all_reduce": "#8c6d31",
    "pp.p2p_buffer": "#2288ff",
    "megatron.param_grad_buffer": "#008866",
    "megatron.main_param": "#225500",
    "megatron.bucket_comm": "#990044",
    "deepspeed.reduce_bucket": "#11eecc",
    "deepspeed.gathered_param": "#aa66ff",
}
_PALETTE = ("#393b79", "#e7ba52", "#843c39", "#637939", "#7b4173", "#3182bd", "#e6550d")
PHASE_ALPHA = 0.13  # the shading's opacity, the same in the key
PEAK, PREDICTED, RESERVED = "#c62828", "#111111", "#6b7280"


def color(name: str, table: dict[str, str] = CATEGORY_COLORS) -> str:
    if name in table:
        return table[name]
    return _PALETTE[sum(map(ord, name)) % len(_PALETTE)]  # stable across runs, unlike hash()


def binary_unit(vmax: float) -> tuple[float, str]:
    """The largest binary unit (bytes, name) that `vmax` reaches."""
    unit, name = 1.0, "B"
    for k, nm in enumerate(("KiB", "MiB", "GiB", "TiB"), start=1):
        if vmax >= 1024 ** k:
            unit, name = float(1024 ** k), nm
    return unit, name


def nice_scale(vmax: float) -> tuple[float, list[tuple[float, str]]]:
    """Axis top and tick (value, label) pairs in binary units, about 4-6 ticks."""
    vmax = max(float(vmax), 1.0)
    unit, name = binary_unit(vmax)
    step = _step(vmax / unit)
    n = max(1, math.ceil(vmax / unit / step - 1e-9))
    return n * step * unit, [(i * step * unit, f"{i * step:g} {name}") for i in range(n + 1)]


def _step(span: float, ticks: int = 5) -> float:
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(f * mag for f in (1, 2, 2.5, 5, 10) if f * mag >= raw)


def x_ticks(s: Series) -> list[tuple[float, str]]:
    """About 6-10 ticks (the 1000 px plot reads them all), from the axis start."""
    lo, hi = float(s.x[0]), float(s.x[-1])
    step = _step(hi - lo, 8) if hi > lo else 1.0
    first = math.ceil(lo / step - 0.05) * step  # 0 s when the first point is at 1.5 ms
    return [(v, f"{v:g}" if s.x_label.startswith("time") else f"{int(v)}")
            for v in np.arange(first, hi + step * 1e-9, step).round(9).tolist()]


def overlays(s: Series, predicted_title: str | None) -> list[tuple[str, str]]:
    """Legend entries (label, color) besides the categories."""
    out = [("peak", PEAK)]
    if s.predicted is not None:
        out.append((f"after the fix ({predicted_title or s.predicted_rule})", PREDICTED))
    if s.reserved is not None:
        out.append(("reserved by the allocator", RESERVED))
    return out


# ------------------------------------------------------------------------------------- SVG

W, H, L, R, T, B = 1000, 320, 78, 16, 26, 40


def svg(s: Series, esc: Callable[[str], str], script_json: Callable[[object], str],
        predicted_title: str | None = None) -> str:
    """The plot as inline SVG plus its hover data and legend (one `div.sf-plot`)."""
    pw, ph = W - L - R, H - T - B
    x0, x1 = float(s.x[0]), float(s.x[-1]) if s.x[-1] > s.x[0] else float(s.x[0]) + 1
    ymax = max(int(s.live.max()), int(s.reserved.max()) if s.reserved is not None else 0,
               int(s.predicted.max()) if s.predicted is not None else 0)
    top, yt = nice_scale(ymax)
    X = L + (s.x - x0) / (x1 - x0) * pw
    base = T + ph

    def Y(v: np.ndarray) -> np.ndarray:
        return base - v / top * ph

    def pts(xs: np.ndarray, ys: np.ndarray) -> str:
        return " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(xs.tolist(), ys.tolist()))

    out = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="live bytes by '
           f'category over {esc(s.x_label)}, device {s.device}">']
    for a, b, p in s.phase_runs():
        xa, xb = L + (a - x0) / (x1 - x0) * pw, L + (b - x0) / (x1 - x0) * pw
        out.append(f'<rect x="{xa:.1f}" y="{T}" width="{max(xb - xa, 0.5):.1f}" height="{ph}" '
                   f'fill="{color(p, PHASE_COLORS)}" fill-opacity="{PHASE_ALPHA}"/>')
    for v, label in yt:
        yy = base - v / top * ph
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#d5dae1"/>'
                   f'<text x="{L - 6}" y="{yy + 4:.1f}" text-anchor="end" font-size="12" '
                   f'fill="#5f6b7a">{esc(label)}</text>')
    # painter's order: each layer's area runs from the axis to its cumulative top, the tallest
    # drawn first, so one edge per layer is written (half the points of stacked bands)
    tops = np.cumsum(s.by_category, axis=0)
    xs = [f"{a:.1f}" for a in X.tolist()]
    for name, top_k in reversed(list(zip(s.categories, tops))):
        edge = " ".join(f"{a},{b:.0f}" for a, b in zip(xs, Y(top_k).tolist()))
        out.append(f'<polygon points="{L},{base} {edge} {W - R},{base}" fill="{color(name)}">'
                   f'<title>{esc(name)}</title></polygon>')
    if s.reserved is not None:
        out.append(f'<polyline points="{pts(X, Y(s.reserved))}" fill="none" stroke="{RESERVED}" '
                   'stroke-width="1.2" stroke-dasharray="5 3"/>')
    if s.predicted is not None:
        out.append(f'<polyline points="{pts(X, Y(s.predicted))}" fill="none" '
                   f'stroke="{PREDICTED}" stroke-width="1.8"/>')
    for index, xv in s.iterations if len(s.iterations) <= 200 else []:
        xx = L + (xv - x0) / (x1 - x0) * pw
        out.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{T}" y2="{base}" stroke="#5f6b7a" '
                   'stroke-dasharray="3 3"/>')
        if len(s.iterations) <= 16:
            out.append(f'<text x="{xx + 3:.1f}" y="{T - 8}" font-size="11" fill="#5f6b7a">'
                       f'iter {index}</text>')
    out.append(f'<line x1="{L}" x2="{W - R}" y1="{base}" y2="{base}" stroke="#8a94a3"/>')
    for v, label in x_ticks(s):
        xx = L + (v - x0) / (x1 - x0) * pw
        out.append(f'<text x="{xx:.1f}" y="{base + 16}" text-anchor="middle" font-size="12" '
                   f'fill="#5f6b7a">{esc(label)}</text>')
    out.append(f'<text x="{L + pw / 2:.1f}" y="{H - 4}" text-anchor="middle" font-size="12" '
               f'fill="#5f6b7a">{esc(s.x_label)}</text>')
    px, py = float(X[s.peak]), float(Y(s.live[s.peak:s.peak + 1])[0])
    right = px < L + pw * 0.7
    peak = human(int(s.live[s.peak]))
    out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="5" fill="{PEAK}" stroke="#fff" '
               f'stroke-width="1.5"/><text x="{px + (8 if right else -8):.1f}" '
               f'y="{max(py - 8, T + 12):.1f}" text-anchor="{"start" if right else "end"}" '
               f'font-size="13" font-weight="700" fill="{PEAK}">peak {esc(peak)}</text>')
    if s.predicted is not None:
        k = int(np.argmax(s.predicted))
        qx, qy, after = float(X[k]), float(Y(s.predicted[k:k + 1])[0]), int(s.predicted[k])
        right = qx < L + pw * 0.7
        out.append(f'<circle cx="{qx:.1f}" cy="{qy:.1f}" r="4" fill="{PREDICTED}" '
                   f'stroke="#fff" stroke-width="1.5"/><text x="{qx + (8 if right else -8):.1f}" '
                   f'y="{min(qy + 16, base - 4):.1f}" text-anchor="{"start" if right else "end"}" '
                   f'font-size="12.5" font-weight="700" fill="{PREDICTED}" stroke="#fff" '
                   f'stroke-width="3" paint-order="stroke">after the fix '
                   f'{esc(human(after))}</text>')
    out.append(f'<line class="sf-cursor" x1="0" x2="0" y1="{T}" y2="{base}" stroke="#1d2430" '
               'stroke-width="1" visibility="hidden"/>')
    out.append(f'<rect class="sf-hit" x="{L}" y="{T}" width="{pw}" height="{ph}" '
               'fill="transparent"/></svg>')
    legend = "".join(f'<span><span class="sw" style="background:{color(c)}"></span>{esc(c)}'
                     '</span>' for c in reversed(s.categories))
    legend += "".join(f'<span><span class="sw" style="background:{c};height:3px;'
                      f'vertical-align:3px"></span>{esc(label)}</span>'
                      for label, c in overlays(s, predicted_title))
    legend += ('<div class="phases"><span>background: the phase</span>' + "".join(
        f'<span><span class="sw" style="background:{color(p, PHASE_COLORS)};opacity:'
        f'{PHASE_ALPHA * 3:.2f}"></span>{esc(p)}</span>'
        for p in dict.fromkeys(p for _, _, p in s.phase_runs())))
    if s.iterations:
        legend += ('<span><span class="sw" style="border-left:1.5px dashed #5f6b7a;'
                   'width:0;background:none"></span>iteration start</span>')
    legend += "</div>"
    data = {"x0": L, "pw": pw, "W": W, "x": np.round(s.x, 4).tolist(), "rows": s.rows.tolist(),
            "xl": s.x_label,
            "reserved": s.reserved.tolist() if s.reserved is not None else None,
            "predicted": s.predicted.tolist() if s.predicted is not None else None,
            "phase": s.phase.tolist(), "phases": PHASE_LABELS,
            "cats": [cap(c, NAME) for c in s.categories], "by": s.by_category.tolist(),
            "stacks": [[cap(f, FRAME) for f in st] for st in s.stacks],
            "scat": [cap(c, NAME) for c in s.stack_category],
            "top": s.top_stacks.tolist(), "topb": s.top_bytes.tolist()}
    return (f'<div class="sf-plot">{"".join(out)}<div class="sf-tip" hidden></div>'
            f'<div class="legend">{legend}</div>'
            f'<script type="application/json" class="sf-data">{script_json(data)}</script>'
            '</div>')


def svg_before_after(series: list[tuple[np.ndarray, np.ndarray]], labels: list[str],
                     esc: Callable[[str], str]) -> str:
    """Two recordings' live bytes on one static SVG, x = % of each one's trace rows: A (the
    baseline) as a grey area, B as a line, each peak labelled. `labels` are ours."""
    pw, ph = W - L - R, H - T - B
    top, yt = nice_scale(max(float(v.max()) for _, v in series))
    base = T + ph
    out = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="live bytes before '
           'and after">']
    for v, label in yt:
        yy = base - v / top * ph
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#d5dae1"/>'
                   f'<text x="{L - 6}" y="{yy + 4:.1f}" text-anchor="end" font-size="12" '
                   f'fill="#5f6b7a">{esc(label)}</text>')
    for k in range(0, 101, 10):
        xx = L + k / 100 * pw
        out.append(f'<text x="{xx:.1f}" y="{base + 16}" text-anchor="middle" font-size="12" '
                   f'fill="#5f6b7a">{k}%</text>')
    out.append(f'<text x="{L + pw / 2:.1f}" y="{H - 4}" text-anchor="middle" font-size="12" '
               'fill="#5f6b7a">% of each recording\'s trace rows</text>')
    styles = [("#c9ccd1", "none", 0), (PREDICTED, "none", 1.8)]
    for (x, v), (fill, _, width), label in zip(series, styles, labels):
        xs, ys = L + x / 100 * pw, base - v / top * ph
        pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(xs.tolist(), ys.tolist()))
        if width:
            out.append(f'<polyline points="{pts}" fill="none" stroke="{fill}" '
                       f'stroke-width="{width}"/>')
        else:
            out.append(f'<polygon points="{L},{base} {pts} {xs[-1]:.1f},{base}" fill="{fill}"/>')
        k, ink = int(np.argmax(v)), PEAK if width else "#4b5563"
        out.append(f'<circle cx="{xs[k]:.1f}" cy="{ys[k]:.1f}" r="4" fill="{ink}"/>'
                   f'<text x="{xs[k] + 6:.1f}" y="{max(ys[k] - 6, T + 10):.1f}" font-size="12.5" '
                   f'font-weight="700" fill="{ink}">{esc(label)} peak '
                   f'{esc(human(int(v[k])))}</text>')
    out.append(f'<line x1="{L}" x2="{W - R}" y1="{base}" y2="{base}" stroke="#8a94a3"/></svg>')
    legend = (f'<div class="legend" style="display:flex;gap:16px;font-size:13px">'
              f'<span><span style="display:inline-block;width:14px;height:10px;'
              f'background:#c9ccd1"></span> {esc(labels[0])}</span><span><span '
              f'style="display:inline-block;width:14px;height:3px;vertical-align:3px;'
              f'background:{PREDICTED}"></span> {esc(labels[1])}</span></div>')
    return f'<div class="sf-plot">{"".join(out)}{legend}</div>'


CSS = """
.sf-plot{position:relative}
.sf-tip{position:absolute;z-index:5;pointer-events:none;background:#fff;color:#1d2430;
border:1px solid #c9d1db;border-radius:6px;box-shadow:0 4px 14px rgba(0,0,0,.12);
padding:6px 8px;font-size:11.5px;width:300px;line-height:1.3;opacity:.96}
.sf-tip .h{font-weight:650;margin-bottom:3px}.sf-tip table{margin:2px 0;font-size:11.5px;
border-collapse:collapse}.sf-tip td{padding:0 8px 0 0;border:0;background:none;color:inherit}
.sf-tip pre{margin:1px 0 4px;padding:3px 5px;font-size:10.5px;white-space:pre;overflow:hidden;
text-overflow:ellipsis;background:#f3f5f8;color:#1d2430}
.sf-plot .legend .phases{flex-basis:100%;display:flex;flex-wrap:wrap;gap:4px 14px}
"""

# Reads each plot's JSON and fills the tooltip with textContent only: no string from the
# snapshot is ever parsed as HTML.
JS = r"""
(function () {
  var TIP_ROWS = 6, TIP_STACKS = 2;  // the hover box stays a third of the plot
  function human(n) {
    var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (Math.abs(n) >= 1024 && i < 4) { n /= 1024; i++; }
    return i ? n.toFixed(1) + " " + u[i] : n + " B";
  }
  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }
  document.querySelectorAll(".sf-plot").forEach(function (box) {
    var d = JSON.parse(box.querySelector(".sf-data").textContent);
    var svg = box.querySelector("svg"), tip = box.querySelector(".sf-tip");
    var cur = svg.querySelector(".sf-cursor"), hit = svg.querySelector(".sf-hit");
    var n = d.x.length, x0 = d.x[0], x1 = d.x[n - 1] > x0 ? d.x[n - 1] : x0 + 1;
    function nearest(px) {  // the point whose x is closest to the pointer
      var v = x0 + (px - d.x0) / d.pw * (x1 - x0), lo = 0, hi = n - 1;
      while (lo < hi) { var m = (lo + hi) >> 1; if (d.x[m] < v) lo = m + 1; else hi = m; }
      return lo > 0 && v - d.x[lo - 1] < d.x[lo] - v ? lo - 1 : lo;
    }
    function show(ev) {
      var r = svg.getBoundingClientRect(), i = nearest((ev.clientX - r.left) * d.W / r.width);
      var cx = d.x0 + (d.x[i] - x0) / (x1 - x0) * d.pw;
      cur.setAttribute("x1", cx); cur.setAttribute("x2", cx);
      cur.setAttribute("visibility", "visible");
      var live = d.by.reduce(function (a, b) { return a + b[i]; }, 0);
      var head = (d.xl.indexOf("time") === 0 ? d.x[i].toFixed(3) + " s, " : "") +
        "row " + d.rows[i] + " · " + d.phases[d.phase[i]] + " · live " + human(live) +
        (d.reserved ? " · reserved " + human(d.reserved[i]) : "") +
        (d.predicted ? " · after fix " + human(d.predicted[i]) : "");
      tip.textContent = "";
      tip.appendChild(el("div", head, "h"));
      var t = el("table"), order = [];
      d.cats.forEach(function (c, k) { if (d.by[k][i] > 0) order.push(k); });
      order.sort(function (a, b) { return d.by[b][i] - d.by[a][i]; });
      var rest = order.slice(TIP_ROWS);
      order.slice(0, TIP_ROWS).forEach(function (k) {
        var tr = el("tr");
        tr.appendChild(el("td", d.cats[k]));
        tr.appendChild(el("td", human(d.by[k][i])));
        t.appendChild(tr);
      });
      if (rest.length) {
        var tr = el("tr");
        tr.appendChild(el("td", rest.length + " more"));
        tr.appendChild(el("td", human(rest.reduce(function (a, k) { return a + d.by[k][i]; },
                                                  0))));
        t.appendChild(tr);
      }
      tip.appendChild(t);
      d.top[i].slice(0, TIP_STACKS).forEach(function (s, j) {
        if (s < 0) return;
        tip.appendChild(el("div", human(d.topb[i][j]) + " (" + d.scat[s] + ") allocated by:"));
        tip.appendChild(el("pre", d.stacks[s].slice(0, 3).join("\n")));
      });
      tip.hidden = false;
      // beside the cursor, on the side already read: the curve ahead stays visible
      var r2 = box.getBoundingClientRect(), left = ev.clientX - r2.left;
      var x = left > box.clientWidth / 2 ? left - 14 - tip.offsetWidth : left + 14;
      tip.style.left = Math.max(0, Math.min(x, box.clientWidth - tip.offsetWidth)) + "px";
      tip.style.top = "24px";
    }
    hit.addEventListener("mousemove", show);
    hit.addEventListener("mouseleave", function () {
      tip.hidden = true;
      cur.setAttribute("visibility", "hidden");
    });
  });
})();
"""


# ------------------------------------------------------------------------------------- PNG

def mpl_text(s: str) -> str:
    """The PNG sink's neutralizer: printable and short (the texts drawn also get
    `parse_math=False`: matplotlib would read `$...$` as math, and fail on bad math)."""
    return "".join(c if c.isprintable() else "?" for c in cap(s, 80))


def png(series: list[Series]) -> bytes:
    """One PNG with a panel per device, drawn by matplotlib's Agg canvas (no display, no
    pyplot global state). Category names come from --category: they pass `mpl_text`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    series = panels(series)
    fig = Figure(figsize=(11, 3.9 * len(series)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(series), 1, squeeze=False)[:, 0]
    for ax, s in zip(axes, series):
        runs = s.phase_runs()  # one artist for all the shading (hundreds of runs)
        ax.broken_barh([(a, b - a) for a, b, _ in runs], (0, 1), alpha=0.13, lw=0,
                       facecolors=[color(p, PHASE_COLORS) for _, _, p in runs],
                       transform=ax.get_xaxis_transform())
        ax.stackplot(s.x, s.by_category, labels=[mpl_text(c) for c in s.categories],
                     colors=[color(c) for c in s.categories], alpha=0.85, lw=0)
        if s.reserved is not None:
            ax.plot(s.x, s.reserved, color=RESERVED, lw=1, ls="--",
                    label="reserved by the allocator")
        if s.predicted is not None:
            ax.plot(s.x, s.predicted, color=PREDICTED, lw=1.6,
                    label="predicted after the fix: " + mpl_text(s.predicted_rule or ""))
        if len(s.iterations) <= 200:
            ax.vlines([xv for _, xv in s.iterations], 0, 1, color="#5f6b7a", lw=0.7, ls=":",
                      transform=ax.get_xaxis_transform(), label="iteration start")
        for index, xv in s.iterations if len(s.iterations) <= 16 else []:
            ax.annotate(f"iter {index}", (xv, 1), xycoords=("data", "axes fraction"),
                        xytext=(3, -10), textcoords="offset points", fontsize=8,
                        color="#5f6b7a")
        if s.predicted is not None:
            k = int(np.argmax(s.predicted))
            after = int(s.predicted[k])
            ax.plot([s.x[k]], [after], "o", color=PREDICTED, ms=5)
            from matplotlib import patheffects

            ax.annotate(f"after the fix {human(after)}", (s.x[k], after), xytext=(6, -14),
                        textcoords="offset points", color=PREDICTED, fontweight="bold",
                        fontsize=9, path_effects=[patheffects.withStroke(linewidth=3,
                                                                         foreground="white")])
        peak = int(s.live[s.peak])
        ax.plot([s.x[s.peak]], [peak], "o", color=PEAK, ms=6)
        ax.annotate(f"peak {human(peak)}", (s.x[s.peak], peak), xytext=(6, 6),
                    textcoords="offset points", color=PEAK, fontweight="bold")
        top, yt = nice_scale(max(peak, int(s.reserved.max()) if s.reserved is not None else 0,
                                 int(s.predicted.max()) if s.predicted is not None else 0))
        ax.set_ylim(0, top * 1.06)
        ax.set_yticks([v for v, _ in yt], [lbl for _, lbl in yt])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human(v)))
        ax.set_xlim(s.x[0], s.x[-1] if s.x[-1] > s.x[0] else s.x[0] + 1)
        ax.set_xlabel(s.x_label)
        ax.set_xticks([v for v, _ in x_ticks(s)])
        ax.set_title(f"device {s.device}: live bytes by what made them", loc="left")
        from matplotlib.patches import Patch

        handles, labels = ax.get_legend_handles_labels()
        for p in dict.fromkeys(p for _, _, p in runs):  # the key of the shading
            handles.append(Patch(color=color(p, PHASE_COLORS), alpha=PHASE_ALPHA * 3, lw=0))
            labels.append(f"phase: {p}")
        leg = ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.0, -0.16),
                        fontsize=8, frameon=False, ncol=4)
        for t in leg.get_texts():
            t.set_parse_math(False)
        ax.grid(axis="y", color="#d5dae1", lw=0.6)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
