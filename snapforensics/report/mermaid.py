"""The timeline as a Mermaid chart (`xychart-beta`), so a Markdown report pasted into a GitHub
or GitLab issue carries its picture as text: both render Mermaid fences, no file to attach.

The chart is the envelope of the plot (report/plot.py): the live bytes as bars, the curve
predicted after the top fix as a line, in at most `BARS` equal slices of the x axis, each slice
drawn by its highest point (so the peak is a bar, exact to the rounding of the unit). It has
no categories or phases (Mermaid's xychart stacks nothing and has no legend): the PNG beside
the report has those. Every string in it is ours (axis titles, the unit): nothing from the
snapshot, so nothing here needs a sink.

Input: the plot's series when the diagnosis carries it, else the JSON's `timeline` points
([row, live bytes, phase]), which every diagnosis has, so the fleet and the stdout paths draw
it too.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.diagnosis import DeviceSummary
from snapforensics.report.plot import PREDICTED, binary_unit, nice_scale

BARS = 60  # readable as bars in an issue's width (~12 px each at GitHub's 760 px)
RECORDED = "#7aa6e8"  # the bars: light, so the predicted line (plot.PREDICTED) reads on them
BASELINE = "#c9ccd1"  # compare: the baseline's bars, grey under the new run's line


def chart(dev: DeviceSummary) -> list[str]:
    """The fenced ```mermaid block for one device, [] when it has no timeline."""
    s = dev.plot
    if s is not None and len(s.x):
        x, live = s.x.astype(np.float64), s.live.astype(np.float64)
        predicted = None if s.predicted is None else (x, s.predicted.astype(np.float64))
        x_label = "time (s)" if s.x_label.startswith("time") else "trace row"
    elif dev.timeline:
        pts = np.asarray([p[:2] for p in dev.timeline], dtype=np.float64)
        x, live, predicted, x_label = pts[:, 0], pts[:, 1], None, "trace row"
    else:
        return []
    title = ("Live bytes: bars as recorded, line predicted after the fix"
             if predicted is not None else "Live bytes as recorded")
    return xychart(title, x_label, (x, live), predicted)


def progress(timeline: list[list]) -> tuple[np.ndarray, np.ndarray]:
    """A JSON timeline ([row, live bytes, phase] points) over the share (%) of its trace rows:
    two recordings' row counts differ, their progress does not."""
    pts = np.asarray([p[:2] for p in timeline], dtype=np.float64)
    span = max(pts[-1, 0] - pts[0, 0], 1.0)
    return 100 * (pts[:, 0] - pts[0, 0]) / span, pts[:, 1]


def before_after(a: list[list], b: list[list], title: str) -> list[str]:
    """Two recordings on one chart: A (the baseline) as bars, B as a line."""
    if not a or not b:
        return []
    return xychart(title, "% of each recording's trace rows", progress(a), progress(b),
                   colors=(BASELINE, RECORDED))


def xychart(title: str, x_label: str, bars: tuple[np.ndarray, np.ndarray],
            line: tuple[np.ndarray, np.ndarray] | None,
            colors: tuple[str, str] = ("", "")) -> list[str]:
    """An xychart-beta block: `bars` and `line` ((x, bytes) each) drawn as their envelopes
    over BARS equal slices of the x range they share."""
    xs = [bars[0]] + ([line[0]] if line is not None else [])
    lo, hi = min(float(x[0]) for x in xs), max(float(x[-1]) for x in xs)
    hi = hi if hi > lo else lo + 1
    edges = np.linspace(lo, hi, min(BARS, max(len(x) for x in xs)) + 1)
    vmax = max(float(bars[1].max()), float(line[1].max()) if line is not None else 0.0, 1.0)
    top, _ = nice_scale(vmax)
    unit, name = binary_unit(vmax)  # the unit nice_scale's ticks are in

    def envelope(x: np.ndarray, v: np.ndarray) -> str:
        slot = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
        out = np.full(len(edges) - 1, np.nan)
        np.fmax.at(out, slot, v)
        for i in range(len(out)):  # a slice with no point keeps the level before it
            if np.isnan(out[i]):
                out[i] = out[i - 1] if i else v[0]
        return "[" + ", ".join(f"{b / unit:.1f}" for b in out.tolist()) + "]"

    fmt = (lambda v: f"{v:.2f}") if x_label.startswith("time") else (lambda v: f"{int(v)}")
    palette = (colors[0] or RECORDED) + (f", {colors[1] or PREDICTED}" if line else "")
    out = ["```mermaid",
           '%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": "' + palette
           + '"}}}}%%',
           "xychart-beta",
           f'    title "{title}"',
           f'    x-axis "{x_label}" {fmt(lo)} --> {fmt(hi)}',
           f'    y-axis "{name}" 0 --> {top / unit:g}',
           f"    bar {envelope(*bars)}"]
    if line is not None:
        out.append(f"    line {envelope(*line)}")
    return [*out, "```"]
