"""The timeline plot's series of one device (built by analysis/timeline.py), and its document
form: every diagnosis document (`Diagnosis.to_doc()`, what worker processes return and the
cache keeps) carries the series of the devices a report draws, so every report of every input
has its plot. Not part of the JSON contract (`Diagnosis.to_dict()`).

Bounded: at most POINTS points per series, HOVER_STACKS + HOVER_TOP hover stacks of at most
STACK_FRAMES frames each, and MAX_PANELS series per document (`panels`: the devices with the
highest peaks; every device stays in the tables). `Series.from_doc` checks every field's type,
length and range against these bounds (a document may come from a cache entry someone edited):
a renderer indexing the arrays can never read past them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from snapforensics.analysis.vocab import PHASE_LABELS

POINTS = 1200  # ~1 px per point on a wide screen; bounds the report for 1 GB inputs
HOVER_STACKS = 40  # candidate stacks for the hover: a point shows its top 3 among them
HOVER_TOP = 3
STACK_FRAMES = 6
# A report draws at most this many device panels, those with the highest peaks: a page (and a
# PNG of 11 x 3.9 in per panel at 110 dpi: 1,210 x 3,432 px at most) stays readable and
# bounded whatever number of devices a file claims; every device stays in the tables.
MAX_PANELS = 8


@dataclass
class Series:
    device: int
    rows: np.ndarray  # int64: the trace row drawn for each point
    x: np.ndarray  # float64: seconds since the first row when the file has times, else the row
    x_label: str
    live: np.ndarray  # int64: live bytes at each point
    phase: np.ndarray  # int8: phase code (PHASE_LABELS) at each point
    categories: list[str]  # stacked layers, bottom (most bytes on average) first
    by_category: np.ndarray  # int64 (categories, points): bytes alive per category
    reserved: np.ndarray | None  # int64: reserved bytes, bucket max (caching allocator only)
    predicted: np.ndarray | None  # int64: live bytes after the top fix, bucket max
    predicted_rule: str | None  # the finding whose fix `predicted` replays
    iterations: list[tuple[int, float]]  # (index, x of its first row)
    peak: int  # index of the highest point
    stacks: list[list[str]]  # text of the hover's candidate stacks (noise frames dropped)
    stack_category: list[str]  # what made each candidate stack's blocks
    top_stacks: np.ndarray  # int32 (points, <= HOVER_TOP): index into `stacks`, -1 = none
    top_bytes: np.ndarray  # int64 (points, <= HOVER_TOP)

    def phase_runs(self) -> list[tuple[float, float, str]]:
        """(x from, x to, phase name) of each run of points in one phase, for shading."""
        if not len(self.x):
            return []
        cut = np.flatnonzero(np.diff(self.phase)) + 1
        starts = np.concatenate([[0], cut])
        ends = np.concatenate([cut, [len(self.x) - 1]])
        return [(float(self.x[a]), float(self.x[b]), PHASE_LABELS[int(self.phase[a])])
                for a, b in zip(starts.tolist(), ends.tolist())]

    def timeline_rows(self) -> list[list]:
        """The JSON's `timeline`: [row, live bytes, phase] per point."""
        return [[r, b, PHASE_LABELS[p]] for r, b, p in
                zip(self.rows.tolist(), self.live.tolist(), self.phase.tolist())]

    def to_doc(self) -> dict[str, Any]:
        """Plain JSON data (lists, not arrays): `from_doc`'s input."""
        def a(v: np.ndarray | None) -> list | None:
            return None if v is None else v.tolist()

        return {"device": self.device, "rows": a(self.rows), "x": a(self.x),
                "x_label": self.x_label, "live": a(self.live), "phase": a(self.phase),
                "categories": list(self.categories), "by_category": a(self.by_category),
                "reserved": a(self.reserved), "predicted": a(self.predicted),
                "predicted_rule": self.predicted_rule,
                "iterations": [[i, x] for i, x in self.iterations], "peak": self.peak,
                "stacks": [list(s) for s in self.stacks],
                "stack_category": list(self.stack_category),
                "top_stacks": a(self.top_stacks), "top_bytes": a(self.top_bytes)}

    @classmethod
    def from_doc(cls, doc: Any) -> Series:
        """The series `to_doc` wrote; ValueError for anything else (a wrong type, length or
        index; more than the bounds above)."""
        if type(doc) is not dict:
            raise ValueError("plot: not an object")
        n = len(_list(doc, "live"))
        if not 1 <= n <= POINTS:
            raise ValueError(f"plot: {n} points (1 to {POINTS})")
        cats = _strings(doc, "categories")
        stacks = _list(doc, "stacks")
        if len(stacks) > HOVER_STACKS + HOVER_TOP or not all(
                type(s) is list and len(s) <= STACK_FRAMES and all(type(x) is str for x in s)
                for s in stacks):
            raise ValueError("plot.stacks: not the hover's stacks")
        its = _list(doc, "iterations")
        if not all(type(p) is list and len(p) == 2 and type(p[0]) is int
                   and type(p[1]) in (int, float) for p in its):
            raise ValueError("plot.iterations: not [index, x] pairs")
        peak, device = doc.get("peak"), doc.get("device")
        if type(peak) is not int or not 0 <= peak < n or type(device) is not int:
            raise ValueError("plot.peak or plot.device: not an index")
        x_label, rule = doc.get("x_label"), doc.get("predicted_rule")
        if type(x_label) is not str or not (rule is None or type(rule) is str):
            raise ValueError("plot.x_label or plot.predicted_rule: not a string")
        phase = _array(doc, "phase", (n,), np.int8, 0, len(PHASE_LABELS) - 1)
        # up to HOVER_TOP stacks a point: fewer when the device has fewer candidate stacks
        first = _list(doc, "top_stacks")[:1]
        k = len(first[0]) if first and type(first[0]) is list else 0
        if k > HOVER_TOP:
            raise ValueError(f"plot.top_stacks: {k} stacks a point (at most {HOVER_TOP})")
        top_stacks = _array(doc, "top_stacks", (n, k), np.int32, -1, len(stacks) - 1)
        stack_category = _strings(doc, "stack_category")
        if len(stack_category) != len(stacks):
            raise ValueError("plot.stack_category: one per stack")
        return cls(device=device, rows=_array(doc, "rows", (n,), np.int64),
                   x=_array(doc, "x", (n,), np.float64), x_label=x_label,
                   live=_array(doc, "live", (n,), np.int64), phase=phase,
                   categories=cats,
                   by_category=_array(doc, "by_category", (len(cats), n), np.int64),
                   reserved=_array(doc, "reserved", (n,), np.int64, none=True),
                   predicted=_array(doc, "predicted", (n,), np.int64, none=True),
                   predicted_rule=rule, iterations=[(i, float(x)) for i, x in its],
                   peak=peak, stacks=stacks, stack_category=stack_category,
                   top_stacks=top_stacks,
                   top_bytes=_array(doc, "top_bytes", (n, k), np.int64))


def _list(doc: dict, name: str) -> list:
    v = doc.get(name)
    if type(v) is not list:
        raise ValueError(f"plot.{name}: not a list")
    return v


def _strings(doc: dict, name: str) -> list[str]:
    v = _list(doc, name)
    if not all(type(x) is str for x in v):
        raise ValueError(f"plot.{name}: not a list of strings")
    return v


_KINDS = {np.int64: (int,), np.int32: (int,), np.int8: (int,), np.float64: (int, float)}


def _array(doc: dict, name: str, shape: tuple[int, ...], dtype: Any, lo: int | None = None,
           hi: int | None = None, none: bool = False) -> Any:
    """`doc[name]` as an array of `shape` and `dtype` (`none`: may be null), its values
    within [lo, hi] when given."""
    v = doc.get(name)
    if v is None and none:
        return None
    rows = v if len(shape) == 2 and type(v) is list else [v]
    if type(v) is not list or not all(type(r) is list and all(
            type(x) in _KINDS[dtype] for x in r) for r in rows):
        raise ValueError(f"plot.{name}: not a list of numbers")
    try:
        a = np.array(v, dtype=np.float64 if dtype is np.float64 else np.int64)
    except (ValueError, OverflowError) as e:
        raise ValueError(f"plot.{name}: {e}") from None
    if a.shape != shape and not (0 in shape and a.size == 0):
        raise ValueError(f"plot.{name}: shape {a.shape}, not {shape}")
    if dtype is np.float64 and not np.isfinite(a).all():
        raise ValueError(f"plot.{name}: not finite")
    if a.size and ((lo is not None and a.min() < lo) or (hi is not None and a.max() > hi)):
        raise ValueError(f"plot.{name}: out of range")
    return a.reshape(shape).astype(dtype)


def panels(series: list[Series]) -> list[Series]:
    """The series drawn: the MAX_PANELS with the highest peaks, in device order."""
    if len(series) <= MAX_PANELS:
        return list(series)
    top = sorted(series, key=lambda s: -int(s.live[s.peak]))[:MAX_PANELS]
    return sorted(top, key=lambda s: s.device)
