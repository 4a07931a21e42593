"""The timeline plot's series for one device, built once for every renderer and the API.

Bounded whatever the trace length: the rows are cut into at most POINTS equal buckets and each
bucket is drawn by its row with the most live bytes, so the peak is always a point and the
curve's maxima are exact (dips narrower than a bucket are not drawn). At each point: the bytes
alive by category (stacked), the allocator's reserved bytes (caching allocator only), the live
bytes after the top fix (its finding's `replay`: the rows the rule moved to predict its
`predicted_peak_bytes`, replayed again, one cumulative sum) and the stacks
holding the most bytes, for the HTML's hover. Reserved and predicted keep each bucket's max.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.lifetimes import Lifetimes
from snapforensics.analysis.series import HOVER_STACKS, HOVER_TOP, POINTS, STACK_FRAMES, Series

__all__ = ["POINTS", "Series", "alive_by", "bucket_max", "buckets", "build"]


def buckets(n: int, points: int = POINTS) -> np.ndarray:
    """Edges of at most `points` buckets of rows [0, n)."""
    return np.unique(np.linspace(0, n, min(points, n) + 1).astype(np.int64))


def bucket_max(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    return np.maximum.reduceat(values, edges[:-1])


def alive_by(lt: Lifetimes, group: np.ndarray, n_groups: int, rows: np.ndarray,
             keep: np.ndarray | None = None) -> np.ndarray:
    """Bytes alive right after each of `rows`, per group of blocks: (n_groups, len(rows)).

    Sorted keys and binary search, no array per row: a block counts where
    alloc_row <= row < free_row (alloc_row -1 = alive before the first row)."""
    span = lt.rows + 2
    sel = np.flatnonzero(keep) if keep is not None else slice(None)
    g = group[sel].astype(np.int64) * span
    size = lt.size[sel]
    first = np.arange(n_groups, dtype=np.int64)[:, None] * span

    def upto(at: np.ndarray, query: np.ndarray) -> np.ndarray:
        key = g + at
        order = np.argsort(key, kind="stable")
        cum = np.concatenate([[0], np.cumsum(size[order])])
        k = key[order]
        return cum[np.searchsorted(k, first + query, "right")] - \
            cum[np.searchsorted(k, first, "left")]

    return upto(lt.alloc_row[sel] + 1, rows[None, :] + 1) - upto(lt.free_row[sel], rows[None, :])


def build(d: DeviceAnalysis, top: Finding | None, reserved: np.ndarray | None,
          points: int = POINTS) -> Series | None:
    """The series of one device; `top` is the finding whose predicted curve is overlaid."""
    lt, n = d.lt, d.lt.rows
    if not n:
        return None
    live = lt.live
    edges = buckets(n, points)
    rows = np.array([a + int(np.argmax(live[a:b])) for a, b in
                     zip(edges[:-1].tolist(), edges[1:].tolist())], np.int64)
    t = d.trace.time_us
    timed = bool(len(t)) and bool(np.isfinite(t).all()) and float(t.max() - t.min()) > 0
    x = (np.maximum.accumulate(t[rows]) - t[0]) / 1e6 if timed else rows.astype(np.float64)
    names = [str(c) for c in d.category_names]
    by_cat = alive_by(lt, d.category, len(names), rows)
    used = np.flatnonzero(by_cat.any(axis=1))
    used = used[np.argsort(-by_cat[used].mean(axis=1), kind="stable")]
    r = top.replay if top is not None else None  # the rule's own counterfactual
    pred = lt.replay(free_row=r.free_row, alloc_row=r.alloc_row, extra=list(r.extra)) \
        if r is not None else None
    starts = np.minimum(np.searchsorted(rows, [it.start for it in d.tl.iterations]), len(x) - 1)
    pts = live[rows]
    stacks, stack_cat, top_idx, top_b = _hover(d, rows)
    return Series(
        device=d.device, rows=rows, x=x, x_label="time (s)" if timed else "trace row",
        live=pts, phase=d.tl.phase[rows], categories=[names[i] for i in used.tolist()],
        by_category=by_cat[used], reserved=bucket_max(reserved, edges)
        if reserved is not None else None,
        predicted=bucket_max(pred, edges) if pred is not None else None,
        predicted_rule=top.rule if top is not None and pred is not None else None,
        iterations=[(it.index, float(x[k])) for it, k in zip(d.tl.iterations, starts.tolist())],
        peak=int(np.argmax(pts)), stacks=stacks, stack_category=stack_cat,
        top_stacks=top_idx, top_bytes=top_b)


def _hover(d: DeviceAnalysis, rows: np.ndarray):
    """The stacks holding the most bytes at each point, among candidates: the stacks with the
    largest bytes x rows alive (what fills the plot) and those alive at the peak."""
    lt = d.lt
    group = lt.stack.astype(np.int64) + 1  # 0 = no frames
    n_groups = len(d.snapshot.stacks) + 1
    span = np.minimum(lt.free_row, lt.rows) - np.maximum(lt.alloc_row, 0)
    area = np.bincount(group, weights=lt.size * span.astype(np.float64), minlength=n_groups)
    at_peak = np.bincount(group, weights=lt.size * lt.alive_at(d.peak_row), minlength=n_groups)
    cand = np.unique(np.concatenate([np.argsort(-area)[:HOVER_STACKS],
                                     np.argsort(-at_peak)[:HOVER_TOP]]))
    cand = cand[(area[cand] > 0) | (at_peak[cand] > 0)]
    index = np.full(n_groups, -1, np.int64)
    index[cand] = np.arange(len(cand))
    keep = index[group] >= 0
    alive = alive_by(lt, index[group].clip(0), len(cand), rows, keep)  # (cand, points)
    order = np.argsort(-alive, axis=0, kind="stable")[:HOVER_TOP].T  # (points, HOVER_TOP)
    top_b = np.take_along_axis(alive.T, order, axis=1)
    top_idx = np.where(top_b > 0, order, -1).astype(np.int32)
    first = np.zeros(n_groups, np.int64)
    first[group[::-1]] = np.arange(len(group))[::-1]  # some block of each stack
    names = d.category_names
    return ([_frames(d, int(g) - 1) for g in cand.tolist()],
            [str(names[d.category[first[g]]]) for g in cand.tolist()], top_idx, top_b)


def _frames(d: DeviceAnalysis, stack_id: int) -> list[str]:
    """A stack as the hover shows it: the meaningful frames, op-name frames (`<op>`) dropped
    when the stack has others."""
    lines = d.stack_text(stack_id, limit=64)
    return ([x for x in lines if not x.endswith("  [op]")] or lines)[:STACK_FRAMES]
