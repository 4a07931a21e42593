"""The explorer's queries: pure functions over a diagnosed snapshot (`api.Report`), no HTTP.

Every answer is JSON-ready data. Block ids are the rows of `Report.blocks` (devices in order);
nothing here re-derives the analysis: lifetimes, categories, units, findings and the replay of
a fix are the ones `diagnose` made. Strings from the snapshot pass `sanitize.cap` (the JSON
sink's neutralizer: bounded length); the page inserts them as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.fleet import Fleet
from snapforensics.analysis.stacks import is_native
from snapforensics.api import Report, _seconds
from snapforensics.report.sanitize import FRAME, cap

# a window's answer holds at most this many blocks per pixel column of width: the rest are
# merged per category into bands (one value per column), so the answer is O(width), never
# O(trace)
BLOCKS_PER_COLUMN = 1
MAX_WIDTH = 4096


# diagnosed snapshots a server keeps at once (a fleet's ranks are opened one by one)
KEEP = 4


class Sources:
    """The snapshots a server was given, by index (0 = the first): paths, or Reports already
    made. `sources[i]` is snapshot i's Report, diagnosed on first use (the loaded model and
    the blocks' lifetimes read from and written to the cache, `doccache.report`); the KEEP
    most recently used stay in memory. No other path is ever read (the cache's own folder aside)."""

    def __init__(self, items: Sequence[str | Path | Report]) -> None:
        self.items = list(items)
        self._get = lru_cache(maxsize=KEEP)(self._diagnose)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Report:
        if not 0 <= i < len(self.items):
            raise KeyError(f"snapshot {i}: this server was given {len(self.items)}")
        return self._get(i)

    def _diagnose(self, i: int) -> Report:
        from snapforensics import doccache

        it = self.items[i]  # a path: its model and lifetimes from the cache when there
        return it if isinstance(it, Report) else doccache.report(it)

    def source(self, i: int) -> str:
        it = self.items[i]
        return it.diagnosis.source if isinstance(it, Report) else str(it)


def open_inputs(args: Sequence[str]) -> tuple[Sources, dict[str, Any] | None]:
    """What `explore` was given: one snapshot, two (A then B: before/after, or two ranks), or
    one run folder (or glob) of several rank files: a fleet, its strip made at once (every
    rank diagnosed in parallel through the cache, `runner.fleet_paths`). The snapshot opened
    first is diagnosed here, so an unreadable input fails before the server starts."""
    from snapforensics.errors import SnapError
    from snapforensics.parallel import expand
    from snapforensics.runner import fleet_paths

    files = expand(args)
    if len(args) == 1 and len(files) > 1:
        srcs = Sources(files)
        strip = fleet(fleet_paths(files), files)
        if strip["worst"] is not None:
            srcs[strip["worst"]]
        return srcs, strip
    if len(files) > 2 or len(files) != len(args):
        raise SnapError("explore opens one snapshot, one run folder, or two snapshots to "
                        f"overlay; {' '.join(args)} names {len(files)}")
    srcs = Sources(files)
    for i in range(len(files)):
        srcs[i]
    return srcs, None


def _text(s: Any, limit: int = FRAME) -> str:
    """A snapshot string for the JSON sink: a plain str, bounded."""
    return cap(str(s), limit)


def _device(rep: Report, device: int) -> tuple[DeviceAnalysis, int]:
    """The analysis of `device` and the id of its first block."""
    offset = 0
    for d in rep.analyses:
        if d.device == device:
            return d, offset
        offset += len(d.lt)
    raise KeyError(f"no trace for device {device}")


def _locate(rep: Report, block: int) -> tuple[DeviceAnalysis, int]:
    offset = 0
    for d in rep.analyses:
        if 0 <= block - offset < len(d.lt):
            return d, block - offset
        offset += len(d.lt)
    raise KeyError(f"no block {block}")


def _primary(rep: Report) -> DeviceAnalysis:
    """The device with the highest peak (the one `compare` and the fleet speak of)."""
    if not rep.analyses:
        raise KeyError(f"{rep.diagnosis.source}: no allocation history")
    return max(rep.analyses, key=lambda d: d.peak_bytes)


def overview(rep: Report) -> dict[str, Any]:
    """What the page opens with: per device its rows, peak, categories (with the report's
    colours), FSDP units and the x axes it can draw (`time` only when the file has times);
    the phases' colours (the report's shading); the findings."""
    from snapforensics.report.plot import PHASE_ALPHA, PHASE_COLORS, color

    d = rep.diagnosis
    return {"source": _text(d.source), "peaks": d.peaks,
            "caching_allocator": bool(rep.snapshot.kind.caching_allocator),
            "devices": [{"device": a.device, "rows": a.lt.rows, "blocks": len(a.lt),
                         "peak_row": a.peak_row, "peak_bytes": a.peak_bytes,
                         "categories": [_text(c, FRAME) for c in a.category_names],
                         "colors": {_text(c, FRAME): color(str(c)) for c in a.category_names},
                         "units": [_text(u, FRAME) for u in _unit_names(a)[0]],
                         "axes": [ax for ax in WINDOW_AXES if ax == "row" or _timed(a)]}
                        for a in rep.analyses],
            "phase_colors": PHASE_COLORS, "phase_alpha": PHASE_ALPHA,
            "findings": findings(rep)}


def _unit_names(d: DeviceAnalysis) -> tuple[list[str], np.ndarray]:
    """The FSDP units (module paths) of the device's blocks, sorted, and each block's index
    into them (-1: none), as `module_of` says, without a Python loop over the blocks."""
    mods = [i.module for i in d.infos] + [m for m in d.block_module.values() if m]
    names = sorted({m for m in mods if m})
    at = {m: k for k, m in enumerate(names)}
    per_info = np.array([at.get(i.module, -1) if i.module else -1 for i in d.infos], np.int64)
    code = per_info[d.info] if len(d.info) else np.full(len(d.lt), -1, np.int64)
    for b, m in d.block_module.items():
        if m is not None:
            code[int(b)] = at[m]
    return names, code


def _timed(d: DeviceAnalysis) -> bool:
    return bool(d.lt.rows) and bool(np.isfinite(_seconds(d.trace.time_us, d.lt.rows)).all())


WINDOW_AXES = ("row", "time")


def _memo(d: DeviceAnalysis, key: str, make) -> Any:
    """`make()`, computed once per device analysis (what every window of it reads: the x of
    each row, each block's clipped rows)."""
    memo = d.__dict__.setdefault("_explore_memo", {})
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _xs(d: DeviceAnalysis, axis: str) -> np.ndarray:
    """Each row's x on the window's `axis` and, last, where the trace ends (rows + 1 values,
    never decreasing): `row`, the row itself; `time`, seconds since the first row (as the
    report's plot). Made once per device and axis."""
    if axis not in WINDOW_AXES:
        raise ValueError(f"axis {axis!r}: one of {', '.join(WINDOW_AXES)}")
    return _memo(d, "x_" + axis, lambda: _make_xs(d, axis))


def _make_xs(d: DeviceAnalysis, axis: str) -> np.ndarray:
    n = d.lt.rows
    if axis == "row":
        return np.arange(n + 1, dtype=np.float64)
    if axis != "time":
        raise ValueError(f"axis {axis!r}: one of {', '.join(WINDOW_AXES)}")
    if not _timed(d):
        raise ValueError("no times recorded on this device; use axis=row")
    x = np.maximum.accumulate(_seconds(d.trace.time_us, n))
    return np.append(x, np.nextafter(x[-1], np.inf))


def window(rep: Report, device: int, lo: int, hi: int, width: int,
           keep: np.ndarray | None = None, axis: str = "row", x0: float | None = None,
           x1: float | None = None) -> dict[str, Any]:
    """Rows [lo, hi) drawn `width` pixels wide; on axis `time`, [x0, x1) seconds (the rows are
    those alive in it) in columns of equal time. A block at least one column wide (its lifetime
    in the window) is drawn on its own, up to BLOCKS_PER_COLUMN * width of them, largest first;
    every other block alive in the window is merged with its category into a band: the bytes
    of the blocks alive in each column. `keep`: a mask of the blocks a filter kept; the others
    go to the "filtered out" band (grey), so the totals stay honest. With them: `live` (each
    column's max of the trace's live bytes), the phases of the rows shaded (`phases`), the
    iteration starts, the peak's column, and `moment` (the row each column's `live` is of: a
    click asks for the allocator's state there).

    Unfiltered answers are kept (the WINDOWS_KEPT last asked, per device): the whole trace,
    asked at first paint and on every zoom back out, is the costliest (every block and row:
    0.4 s on a 1 GB file) and the same each time."""
    if keep is not None:
        return _window(rep, device, lo, hi, width, keep, axis, x0, x1)
    d, _ = _device(rep, device)
    kept = _memo(d, "windows", dict)
    k = (int(lo), int(hi), int(width), axis, x0, x1)
    if k not in kept:
        if len(kept) >= WINDOWS_KEPT:
            del kept[next(iter(kept))]
        kept[k] = _window(rep, device, lo, hi, width, None, axis, x0, x1)
    kept[k] = kept.pop(k)  # the most recently asked last
    return kept[k]


# unfiltered window answers kept per device (each O(width): a few hundred KiB at most)
WINDOWS_KEPT = 8


def _window(rep: Report, device: int, lo: int, hi: int, width: int,
            keep: np.ndarray | None, axis: str, x0: float | None, x1: float | None
            ) -> dict[str, Any]:
    d, off = _device(rep, device)
    lt = d.lt
    width = int(min(max(width, 1), MAX_WIDTH))
    X = _xs(d, axis)
    if axis == "row" or x0 is None or x1 is None:
        lo, hi = max(int(lo), 0), min(int(hi), lt.rows)
        hi = max(hi, lo + 1)
        x0, x1 = float(X[lo]), float(X[hi])
    else:
        x0, x1 = float(x0), float(x1)
        if not x1 > x0:
            raise ValueError(f"x1 ({x1}) must be above x0 ({x0})")
        lo = max(int(np.searchsorted(X[:-1], x0, "right")) - 1, 0)
        hi = min(max(int(np.searchsorted(X[:-1], x1, "left")), lo + 1), lt.rows)
    span = x1 - x0

    def col(x: np.ndarray) -> np.ndarray:  # column position (float) of each x
        return (np.clip(x, x0, x1) - x0) / span * width

    start, end = _memo(d, "rows", lambda: (np.maximum(lt.alloc_row, 0),
                                           np.minimum(lt.free_row, lt.rows)))
    vis = np.flatnonzero((start < hi) & (end > lo))
    a, b, size = np.maximum(start[vis], lo), np.minimum(end[vis], hi), lt.size[vis]
    ca, cb = col(X[a]), col(X[b])
    c0 = np.minimum(ca.astype(np.int64), width - 1)
    c1 = np.maximum(np.ceil(cb).astype(np.int64), c0 + 1)
    kept = np.ones(len(vis), bool) if keep is None else keep[vis]
    # at least one column of the window: smaller ones are merged
    wide = np.flatnonzero((cb - ca >= 1) & kept)
    drawn = wide[np.argsort(-size[wide], kind="stable")[:BLOCKS_PER_COLUMN * width]]
    names = list(d.category_names) + ["filtered out"]
    cat = d.category[vis].astype(np.int64)
    if keep is not None:
        cat[~kept] = len(names) - 1
    # every category's band at once: +size at its first column, -size past its last, over every
    # block in the window less the ones drawn on their own (a gather of the merged ones, nearly
    # all of them, cost more than the sums); bincount, not np.add.at (ten times slower)
    w1 = width + 1
    n = len(names) * w1
    sz = size.astype(np.float64)
    i0, i1 = cat * w1 + c0, cat * w1 + np.minimum(c1, width)

    def sums(i: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.bincount(i, w, n)

    delta = sums(i0, sz) - sums(i1, sz) - (sums(i0[drawn], sz[drawn]) - sums(i1[drawn], sz[drawn]))
    live = np.cumsum(np.rint(delta).astype(np.int64).reshape(len(names), w1)[:, :width], axis=1)
    merged_per_cat = np.bincount(cat, minlength=len(names)) - \
        np.bincount(cat[drawn], minlength=len(names))
    bands = {_text(names[code], FRAME): live[code].tolist()
             for code in np.flatnonzero(merged_per_cat).tolist()}
    blocks = [{"id": int(off + vis[i]), "c0": int(c0[i]), "c1": int(c1[i]),
               "size": int(size[i]), "category": _text(names[cat[i]], FRAME)}
              for i in drawn[np.argsort(a[drawn], kind="stable")].tolist()]
    first = _firsts(X, lo, hi, x0, span, width)
    top, moment = _moments(lt.live, lo, hi, first, width)
    peak = d.peak_row
    return {"device": device, "axis": axis, "lo": lo, "hi": hi, "x0": x0, "x1": x1,
            "x_end": float(X[-1]), "width": width, "rows_per_column": (hi - lo) / width,
            "live": top, "moment": moment, "bands": bands, "blocks": blocks,
            "merged_blocks": int(len(vis) - len(drawn)),
            "phases": _phase_spans(d, lo, hi, X, col, first, width),
            "iterations": _iterations(d, lo, hi, X, col, width),
            "peak": {"row": peak, "bytes": d.peak_bytes,
                     "c": float(col(X[peak])) if lo <= peak < hi else None}}


def _iterations(d: DeviceAnalysis, lo: int, hi: int, X: np.ndarray, col, width: int
                ) -> list[dict[str, Any]]:
    """The iterations starting in rows [lo, hi) (at most `width`), with their columns."""
    its = [it for it in d.tl.iterations if lo <= it.start < hi][:width]
    cs = col(X[np.array([it.start for it in its], np.int64)]).tolist() if its else []
    return [{"index": it.index, "row": it.start, "c": float(c)} for it, c in zip(its, cs)]


def _firsts(X: np.ndarray, lo: int, hi: int, x0: float, span: float, width: int
            ) -> np.ndarray:
    """Per column of the window, the first of rows [lo, hi) (counted from lo) at or past its
    left edge: column k holds rows [first[k], first[k + 1]) (empty when equal). A binary search
    per column over the rows' x (never decreasing), not a column per row: O(width log rows)."""
    first = np.searchsorted(X[lo:hi], x0 + np.arange(width) * (span / width), "left")
    first[0] = 0  # the window's first row is in its first column (time axis: x <= x0)
    return first


def _moments(live: np.ndarray, lo: int, hi: int, first: np.ndarray, width: int
             ) -> tuple[list[int], list[int]]:
    """Per column (`first`: `_firsts`): the max of the live bytes and the first row that has
    it; a column no row starts in shows the row before it (nothing changed since)."""
    v = live[lo:hi]
    ends = np.append(first[1:], len(v))
    has = ends > first
    top = np.zeros(width, np.int64)
    top[has] = np.maximum.reduceat(v, first[has])  # runs of rows, one per column with rows
    row = np.maximum(first - 1, 0)  # the last row before an empty column
    for k in np.flatnonzero(has).tolist():
        row[k] = first[k] + int(np.argmax(v[first[k]:ends[k]]))  # the first row at its max
    empty = ~has
    top[empty] = v[row[empty]]
    return top.tolist(), (row + lo).tolist()


def _phase_spans(d: DeviceAnalysis, lo: int, hi: int, X: np.ndarray, col, first: np.ndarray,
                 width: int) -> list[dict[str, Any]]:
    """The runs of one phase among rows [lo, hi), from the diagnosis' per-row phases
    (`Timeline.phase`, the report's shading): rows [lo, hi) of each and its columns [c0, c1).
    More runs than columns: each column takes the phase of its first row, and runs of
    columns are merged (the shading stays O(width))."""
    from snapforensics.analysis.vocab import PHASE_LABELS

    ph = d.tl.phase[lo:hi]
    cut = np.flatnonzero(np.diff(ph)) + 1
    if len(cut) >= width:
        firsts = np.unique(first)
        firsts = firsts[firsts < len(ph)]
        keep = np.flatnonzero(np.diff(ph[firsts])) + 1
        cut = firsts[keep]
    starts = np.concatenate([[0], cut]).astype(np.int64) + lo
    ends = np.concatenate([cut + lo, [hi]]).astype(np.int64)
    c0, c1 = col(X[starts]), col(X[ends])
    return [{"phase": PHASE_LABELS[int(d.tl.phase[a])], "lo": int(a), "hi": int(b),
             "c0": float(u), "c1": float(v)}
            for a, b, u, v in zip(starts.tolist(), ends.tolist(), c0.tolist(), c1.tolist())]


def _columns(values: np.ndarray, width: int) -> list[int]:
    """Each column's max (the peak is never averaged away)."""
    if not len(values):
        return [0] * width
    edges = np.linspace(0, len(values), width + 1).astype(np.int64)
    edges[1:] = np.maximum(edges[1:], edges[:-1] + 1)
    edges = np.minimum(edges, len(values))
    return [int(values[a:max(b, a + 1)].max()) if a < len(values) else int(values[-1])
            for a, b in zip(edges[:-1], edges[1:])]


AXES = ("fraction", "time")


def _axis(rep: Report, axis: str) -> tuple[DeviceAnalysis, np.ndarray, float]:
    """The primary device, each of its rows' x on `axis` and where its trace ends: `fraction`,
    row r at r / rows (the trace ends at 1); `time`, seconds since its first row (as the
    report's plot; it ends at its last row)."""
    d = _primary(rep)
    n = d.lt.rows
    if axis == "fraction":
        return d, np.arange(n, dtype=np.float64) / max(n, 1), 1.0
    if axis != "time":
        raise ValueError(f"axis {axis!r}: one of {', '.join(AXES)}")
    x = _seconds(d.trace.time_us, n)
    if not n or not np.isfinite(x).all():
        raise ValueError(f"{_text(rep.diagnosis.source)}: no times recorded; use axis=fraction")
    return d, np.maximum.accumulate(x), float(np.nextafter(x[-1], np.inf))


def _binned(x: np.ndarray, live: np.ndarray, end: float, x0: float, x1: float,
            width: int) -> list[int | None]:
    """Live bytes on [x0, x1) in `width` columns: row i is in column floor((x[i] - x0) /
    (x1 - x0) * width); a column's value is the max of its rows, or, with none, the live bytes
    of the last row before it (nothing changed since); None before the first row and from
    `end` on (that run had ended)."""
    col = np.floor((x - x0) / (x1 - x0) * width).astype(np.int64)
    idx = np.searchsorted(col, np.arange(width + 1), side="left")
    full = idx[1:] > idx[:-1]
    top = np.maximum.reduceat(live, np.minimum(idx[:-1], len(live) - 1)) if len(live) else \
        np.zeros(width, np.int64)
    starts = x0 + (x1 - x0) * np.arange(width) / width
    out: list[int | None] = []
    for k in range(width):
        if full[k]:
            out.append(int(top[k]))
        elif idx[k] == 0 or starts[k] >= end:
            out.append(None)
        else:
            out.append(int(live[idx[k] - 1]))
    return out


def overlay(a: Report, b: Report, axis: str = "fraction", x0: float | None = None,
            x1: float | None = None, width: int = 800) -> dict[str, Any]:
    """Two runs' live bytes on one axis (`_axis`: `fraction` of the trace, or `time` in seconds
    since each run's first row), each its primary device, over [x0, x1) (default: all of the
    longer) at `width` columns (`_binned`), and `diff` = b - a where both have a value."""
    width = int(min(max(width, 1), MAX_WIDTH))
    (da, xa, ea), (db, xb, eb) = _axis(a, axis), _axis(b, axis)
    x0 = 0.0 if x0 is None else float(x0)
    x1 = max(ea, eb) if x1 is None else float(x1)
    if not x1 > x0:
        raise ValueError(f"x1 ({x1}) must be above x0 ({x0})")
    sa, sb = _binned(xa, da.lt.live, ea, x0, x1, width), _binned(xb, db.lt.live, eb, x0, x1,
                                                                 width)
    diff = [None if u is None or v is None else v - u for u, v in zip(sa, sb)]

    def side(rep: Report, d: DeviceAnalysis, x: np.ndarray, end: float) -> dict[str, Any]:
        return {"source": _text(rep.diagnosis.source), "device": d.device, "rows": d.lt.rows,
                "end": end, "peak_bytes": d.peak_bytes,
                "peak_x": float(x[d.peak_row]) if d.lt.rows else None}

    return {"axis": axis, "x0": x0, "x1": x1, "width": width,
            "axes": [ax for ax in AXES if ax == "fraction" or all(
                np.isfinite(_seconds(d.trace.time_us, d.lt.rows)).all() and d.lt.rows
                for d in (da, db))],
            "a": side(a, da, xa, ea), "b": side(b, db, xb, eb), "live_a": sa, "live_b": sb,
            "diff": diff}


def compare(a: Report, b: Report, axis: str = "fraction", x0: float | None = None,
            x1: float | None = None, width: int = 800) -> dict[str, Any]:
    """`sf.compare(a, b)` (peaks, categories and findings, B against A) and the `overlay`."""
    from snapforensics.api import compare as _compare

    return {"comparison": _compare(a, b).to_dict(),
            "overlay": overlay(a, b, axis, x0, x1, width)}


def fleet(fl: Fleet, files: Sequence[str]) -> dict[str, Any]:
    """A fleet's strip: every rank's peak in the order of `files` (the folder's rank order),
    with the snapshot index that opens its timeline; `worst`: the snapshot of the fleet's
    worst rank (most anomalous rules, then highest peak); the unreadable ones as errors."""
    at = {str(f): i for i, f in enumerate(files)}
    ranks = sorted(({"snapshot": at[r["source"]], "label": _text(r["label"]), "rank": r["rank"],
                     "peak_bytes": r["peaks"]["overall_bytes"],
                     "deviation_pct": r["deviation_pct"], "anomalies": r["anomalies"],
                     "findings": r["findings"]} for r in fl.ranks), key=lambda r: r["snapshot"])
    return {"mode": fl.mode, "ranks": ranks,
            "worst": at[fl.ranks[0]["source"]] if fl.ranks else None,
            "spread": {k: v for k, v in (fl.spread or {}).items() if k != "ranks"},
            "errors": [{"snapshot": at.get(e["source"]), "error": _text(e["error"])}
                       for e in fl.errors]}


def block(rep: Report, block_id: int) -> dict[str, Any]:
    """One block: every column of `Report.blocks` for it, why its category, its full stack
    (Python frames first, C++ frames after, as `native`), and the findings it belongs to."""
    d, i = _locate(rep, block_id)
    row = rep.blocks.iloc[block_id]
    info = d.infos[d.info[i]] if len(d.info) else None
    frames = rep.stack(int(row["stack_id"]))
    py = [f for f in frames if not is_native(f)]
    native = [f for f in frames if is_native(f)]
    return {
        "id": int(block_id), "device": int(row["device"]), "address": int(row["address"]),
        "size": int(row["size"]), "alloc_row": int(row["alloc_row"]),
        "free_row": int(row["free_row"]),
        "alloc_time_us": _num(row["alloc_time_us"]), "free_time_us": _num(row["free_time_us"]),
        "phase": str(row["phase"]), "iteration": int(row["iteration"]),
        "category": _text(row["category"], FRAME),
        "decided_by": _text(row["top_frame"], FRAME) if isinstance(row["top_frame"], str) else None,
        "fsdp_unit": _text(d.module_of(i), FRAME) if d.module_of(i) else None,
        "fsdp_path": info.path if info is not None else None,
        **{k: _text(row[k], FRAME) if isinstance(row[k], str) else None for k in
           ("tensor", "compiled_region", "compiled_pass", "compiled_source", "compiled_buffer",
            "compiled_line")},
        "stack_id": int(row["stack_id"]),
        "stack": [_frame(f) for f in py], "native_frames": [_frame(f) for f in native],
        "findings": [n for n, f in enumerate(rep.diagnosis.findings)
                     if f.device == d.device and f.members is not None
                     and i in set(np.asarray(f.members).tolist())],
    }


def _frame(f) -> dict[str, Any]:
    return {"name": _text(f.name, FRAME), "file": _text(f.filename, FRAME), "line": int(f.line)}


def _num(v: Any) -> float | None:
    return None if v != v else float(v)  # NaN: no time recorded


def findings(rep: Report) -> list[dict[str, Any]]:
    return [{"index": n, "rule": f.rule, "verdict": str(f.verdict), "title": _text(f.title, FRAME),
             "device": f.device, "bytes": f.bytes, "blocks": f.blocks,
             "predicted_peak_bytes": f.predicted_peak_bytes, "saving_bytes": f.saving_bytes,
             "itemised": f.members is not None}
            for n, f in enumerate(rep.diagnosis.findings)]


def finding(rep: Report, index: int, width: int = 800) -> dict[str, Any]:
    """A finding's block ids and, where it has a fix, the live bytes the report's replay gives
    after it (`Lifetimes.replay` of `Finding.replay`), per column over the whole trace."""
    f = rep.diagnosis.findings[index]
    out = findings(rep)[index]
    try:
        d, off = _device(rep, f.device)
    except KeyError:
        return out | {"block_ids": [], "after_fix": None}
    ids = [] if f.members is None else (off + np.asarray(f.members, np.int64)).tolist()
    after = None
    if f.replay is not None:
        r = f.replay
        live = d.lt.replay(free_row=r.free_row, alloc_row=r.alloc_row, extra=r.extra)
        after = _columns(live, int(min(max(width, 1), MAX_WIDTH)))
    return out | {"block_ids": ids, "after_fix": after}


def segments(rep: Report, device: int, row: int | None = None) -> dict[str, Any]:
    """The allocator's segments by address with their blocks and free gaps: as the file holds
    them at dump (`row` None: a snapshot records segments only then), or right after trace row
    `row` (`allocator_at`); a plain statement on a recording without a caching allocator."""
    snap = rep.snapshot
    if not snap.kind.caching_allocator:
        return {"device": device, "caching_allocator": False, "segments": [], "row": row,
                "statement": "This is a CPU recording: there is no caching allocator, so no "
                             "segments; every block is its own allocation."}
    if row is not None:
        return allocator_at(rep, device, row)
    segs = sorted((s for s in snap.segments if s.device == device), key=lambda s: s.address)
    try:
        pools = _pools(_device(rep, device)[0])
    except KeyError:  # segments but no trace for this device
        pools = []
    return {"device": device, "caching_allocator": True, "at": "dump", "statement": None,
            "pools": pools,
            "segments": [{"address": s.address, "total_size": s.total_size,
                          "allocated_size": s.allocated_size, "stream": s.stream,
                          "pool": list(_pool_key(s.pool_id)),
                          "reserved_unused": s.total_size - s.allocated_size,
                          "blocks": [{"address": int(b.address), "size": int(b.size),
                                      "state": _text(b.state)} for b in s.blocks]} for s in segs]}


def _pool_key(pool_id: tuple) -> tuple[int, int]:
    return tuple((tuple(pool_id) + (0, 0))[:2])  # type: ignore[return-value]


def _pools(d) -> list[dict[str, Any]]:
    """The device's memory pools at dump, each with its owner (`Allocator.pools`): a private
    pool (CUDA graph, MemPool) apart from the regular one."""
    return [{"pool": list(p.pool_id), "owner": p.owner, "segments": p.segments,
             "reserved_bytes": p.reserved, "allocated_bytes": p.allocated,
             "reserved_across_peak_bytes": p.across_peak} for p in d.allocator.pools]


# the caching allocator splits a block only when what remains is at least this big: less stays
# with the block (c10 CUDACachingAllocator `should_split`: 512 B in the small pool, whose
# segments are 2 MiB; more than 1 MiB in the large pool)
SMALL_SEGMENT, SMALL_SPLIT, LARGE_SPLIT = 2 << 20, 512, (1 << 20) + 1
MIN_BLOCK = 512  # every block is a multiple of it (kMinBlockSize)

# a segment's answer lists at most this many blocks and as many gaps (its totals stay exact)
SEGMENT_ITEMS = 512


def allocator_at(rep: Report, device: int, row: int) -> dict[str, Any]:
    """The caching allocator right after trace row `row`: its segments by address, each with
    the blocks alive then (`Lifetimes.alive_at`, the timeline's blocks) and the free gaps
    between them (reserved but unused: cached by the allocator, no tensor in it).

    The segments are the dump's, walked back to `row`: each segment_alloc / segment_map row
    after it undone (its range was not reserved yet), each segment_free / segment_unmap after
    it redone (its range still was); map and unmap ranges (expandable segments) join the
    segment next to them. A gap after a block too small for the allocator to have split off
    is that block's tail, not a free gap: `tail_bytes`, what the blocks were given beyond
    their requests (rounding, unsplit tails), is what `reserved_unused` (total - the bytes
    of the blocks alive) holds besides the free gaps. `reserved_bytes`: the segments' total;
    `unplaced`: the blocks alive then that no segment holds (0 on a consistent file)."""
    from bisect import bisect_right

    from snapforensics.snapshot.model import SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP

    d, off = _device(rep, device)
    n = d.lt.rows
    row = min(max(int(row), 0), max(n - 1, 0))
    # [start, end, stream] sorted by start; the pool of each range: the dump segment's that
    # holds its start. A range freed before the dump is shown in the regular pool (0, 0): the
    # trace's segment rows this reader keeps carry no pool id, so its pool is not known
    segs = sorted([int(s.address), int(s.address) + int(s.total_size), int(s.stream)]
                  for s in d.allocator.segments)
    pool_at = sorted((int(s.address), int(s.address) + int(s.total_size), _pool_key(s.pool_id))
                     for s in d.allocator.segments)
    act = d.trace.action
    later = np.flatnonzero(((act == SEGMENT_ALLOC) | (act == SEGMENT_FREE) | (act == SEGMENT_MAP)
                            | (act == SEGMENT_UNMAP)) & (np.arange(len(act)) > row))
    for k in later[::-1].tolist():
        a, z = int(d.trace.addr[k]), int(d.trace.addr[k]) + int(d.trace.size[k])
        if act[k] in (SEGMENT_ALLOC, SEGMENT_MAP):  # not reserved before row k: cut it out
            cut = []
            for s in segs:
                if s[1] <= a or s[0] >= z:
                    cut.append(s)
                    continue
                if s[0] < a:
                    cut.append([s[0], a, s[2]])
                if s[1] > z:
                    cut.append([z, s[1], s[2]])
            segs = cut
        else:  # freed after row: it was reserved then
            i = bisect_right([s[0] for s in segs], a)
            new = [a, z, int(d.trace.stream[k])]
            if act[k] == SEGMENT_UNMAP and i and segs[i - 1][1] == a:
                segs[i - 1][1] = z
                new = segs.pop(i - 1)
                i -= 1
            if act[k] == SEGMENT_UNMAP and i < len(segs) and segs[i][0] == z:
                new[1] = segs.pop(i)[1]
            segs.insert(i, new)
    alive = np.flatnonzero(d.lt.alive_at(row))
    addr = d.lt.addr[alive].astype(np.int64)
    order = np.argsort(addr, kind="stable")
    alive, addr, size = alive[order], addr[order], d.lt.size[alive[order]]
    starts = np.array([s[0] for s in segs], np.int64)
    ends = np.array([s[1] for s in segs], np.int64)
    home = np.searchsorted(starts, addr, "right") - 1
    placed = (home >= 0) & (addr + size <= ends[np.maximum(home, 0)]) if len(segs) else \
        np.zeros(len(addr), bool)
    out = []
    for j, (a, z, stream) in enumerate(segs):
        k = np.flatnonzero(placed & (home == j))
        ba, bs = addr[k], size[k]
        # the gaps: from the segment's start and each block's end (its size rounded as the
        # allocator rounds a request, to MIN_BLOCK) to the next block's start
        ext = np.maximum(-(-bs // MIN_BLOCK) * MIN_BLOCK, MIN_BLOCK)
        g0 = np.concatenate([[a], np.maximum.accumulate(ba + ext)]) if len(k) else np.array([a])
        g1 = np.concatenate([ba, [z]]) if len(k) else np.array([z])
        g = np.flatnonzero(g1 > g0)
        gap = g1[g] - g0[g]
        # a gap right after a block that the allocator would not have split off is the
        # block's own tail (its request rounded to the block it was given), not a free block
        tail = (g > 0) & (gap < (SMALL_SPLIT if z - a <= SMALL_SEGMENT else LARGE_SPLIT))
        g, gap = g[~tail], gap[~tail]
        live = int(bs.sum())
        i = bisect_right(pool_at, (a, float("inf"))) - 1
        pool = pool_at[i][2] if i >= 0 and pool_at[i][0] <= a < pool_at[i][1] else (0, 0)
        out.append({"address": a, "total_size": z - a, "stream": stream, "allocated_size": live,
                    "pool": list(pool),
                    "tail_bytes": z - a - live - int(gap.sum()), "reserved_unused": z - a - live,
                    "blocks_count": len(k), "gaps_count": len(g), "gap_bytes": int(gap.sum()),
                    "largest_gap": int(gap.max()) if len(g) else 0,
                    "blocks": [{"id": int(off + i), "address": int(x), "size": int(y)}
                               for i, x, y in zip(alive[k][:SEGMENT_ITEMS].tolist(),
                                                  ba[:SEGMENT_ITEMS].tolist(),
                                                  bs[:SEGMENT_ITEMS].tolist())],
                    "gaps": [{"address": int(x), "size": int(y)} for x, y in
                             zip(g0[g][:SEGMENT_ITEMS].tolist(), gap[:SEGMENT_ITEMS].tolist())]})
    reserved = int(ends.sum() - starts.sum()) if len(segs) else 0
    allocated = sum(x["allocated_size"] for x in out)
    return {"device": device, "caching_allocator": True, "at": "row", "row": row,
            "statement": None, "pools": _pools(d), "segments": out, "reserved_bytes": reserved,
            "allocated_bytes": allocated, "reserved_unused": reserved - allocated,
            "live_bytes": int(d.lt.live[row]) if n else 0,
            "unplaced": int((~placed).sum())}


def keep_mask(rep: Report, device: int, category: str | None = None,
              finding_index: int | None = None, unit: str | None = None, min_size: int = 0,
              text: str | None = None) -> np.ndarray | None:
    """The blocks a filter keeps (None: no filter). `text` is matched (a substring, case
    folded) on each distinct stack's frames, once per stack."""
    d, _ = _device(rep, device)
    if not (category or finding_index is not None or unit or min_size or text):
        return None
    m = d.lt.size >= int(min_size)
    if category:
        names = list(d.category_names)
        m &= d.category == (names.index(category) if category in names else -1)
    if finding_index is not None:
        f = rep.diagnosis.findings[finding_index]
        sel = np.zeros(len(m), bool)
        if f.device == device and f.members is not None:
            sel[np.asarray(f.members, np.int64)] = True
        m &= sel
    if unit:  # the unit or any module inside it
        names, code = _unit_names(d)
        hit = np.array([n == unit or n.startswith(unit + ".") for n in names] + [False], bool)
        m &= hit[code]
    if text:
        t = text.casefold()
        uniq, inv = np.unique(d.lt.stack, return_inverse=True)
        hit = np.array([any(t in str(f).casefold() for f in rep.snapshot.stack_frames(s))
                        for s in uniq.tolist()], bool)
        m &= hit[inv] if len(uniq) else np.zeros(len(m), bool)
    return m
