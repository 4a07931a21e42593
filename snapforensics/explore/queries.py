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
    made. `sources[i]` is snapshot i's Report, diagnosed on first use (the loaded model read
    from and written to the snapshot cache, as `diagnose` does); the KEEP most recently used
    stay in memory. No other path is ever read (the cache's own folder aside)."""

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
        from snapforensics.api import diagnose
        from snapforensics.snapshot import cache

        it = self.items[i]  # a path: its model from the cache when it is there (as diagnose's)
        return it if isinstance(it, Report) else diagnose(cache.load(it))

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
    d = rep.diagnosis
    return {"source": _text(d.source), "peaks": d.peaks,
            "caching_allocator": bool(rep.snapshot.kind.caching_allocator),
            "devices": [{"device": a.device, "rows": a.lt.rows, "blocks": len(a.lt),
                         "peak_row": a.peak_row, "peak_bytes": a.peak_bytes,
                         "categories": [_text(c, FRAME) for c in a.category_names]}
                        for a in rep.analyses],
            "findings": findings(rep)}


def window(rep: Report, device: int, lo: int, hi: int, width: int,
           keep: np.ndarray | None = None) -> dict[str, Any]:
    """Rows [lo, hi) drawn `width` pixels wide. A block at least one column wide (its lifetime
    in the window) is drawn on its own, up to BLOCKS_PER_COLUMN * width of them, largest first;
    every other block alive in the window is merged with its category into a band: its live
    bytes per column (the column's max, as the report's timeline keeps peaks). `keep`: a mask
    of the blocks a filter kept; the others go to the "filtered out" band (grey), so the
    totals stay honest."""
    d, off = _device(rep, device)
    lt = d.lt
    width = int(min(max(width, 1), MAX_WIDTH))
    lo, hi = max(int(lo), 0), min(int(hi), lt.rows)
    hi = max(hi, lo + 1)
    per_col = (hi - lo) / width
    start = np.maximum(lt.alloc_row, 0)
    end = np.minimum(lt.free_row, lt.rows)
    vis = np.flatnonzero((start < hi) & (end > lo))
    a, b, size = np.maximum(start[vis], lo), np.minimum(end[vis], hi), lt.size[vis]
    c0 = ((a - lo) / per_col).astype(np.int64)
    c1 = np.ceil((b - lo) / per_col).astype(np.int64)
    kept = np.ones(len(vis), bool) if keep is None else keep[vis]
    # at least one column of the window: smaller ones are merged
    wide = np.flatnonzero((b - a >= per_col) & kept)
    drawn = wide[np.argsort(-size[wide], kind="stable")[:BLOCKS_PER_COLUMN * width]]
    rest = np.ones(len(vis), bool)
    rest[drawn] = False
    merged = np.flatnonzero(rest)
    names = list(d.category_names) + ["filtered out"]
    cat = np.where(kept, d.category[vis].astype(np.int64), len(names) - 1)
    # every category's band at once: +size at its first column, -size past its last
    cm, sm, w1 = cat[merged], size[merged], width + 1
    delta = np.zeros(len(names) * w1, np.int64)
    np.add.at(delta, cm * w1 + np.clip(c0[merged], 0, width), sm)
    np.add.at(delta, cm * w1 + np.clip(np.maximum(c1[merged], c0[merged] + 1), 0, width), -sm)
    live = np.cumsum(delta.reshape(len(names), w1)[:, :width], axis=1)
    bands = {_text(names[code], FRAME): live[code].tolist()
             for code in np.flatnonzero(np.bincount(cm, minlength=len(names))).tolist()}
    blocks = [{"id": int(off + vis[i]), "c0": int(c0[i]), "c1": int(c1[i]),
               "size": int(size[i]), "category": _text(names[cat[i]], FRAME)}
              for i in drawn[np.argsort(a[drawn], kind="stable")].tolist()]
    return {"device": device, "lo": lo, "hi": hi, "width": width, "rows_per_column": per_col,
            "live": _columns(lt.live[lo:hi], width), "bands": bands, "blocks": blocks,
            "merged_blocks": int(len(merged))}


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


def segments(rep: Report, device: int) -> dict[str, Any]:
    """The allocator's segments by address with their blocks and free gaps, as the file holds
    them (at dump time: a snapshot records segments only then); a plain statement on a
    recording without a caching allocator."""
    snap = rep.snapshot
    if not snap.kind.caching_allocator:
        return {"device": device, "caching_allocator": False, "segments": [],
                "statement": "This is a CPU recording: there is no caching allocator, so no "
                             "segments; every block is its own allocation."}
    segs = sorted((s for s in snap.segments if s.device == device), key=lambda s: s.address)
    return {"device": device, "caching_allocator": True, "at": "dump", "statement": None,
            "segments": [{"address": s.address, "total_size": s.total_size,
                          "allocated_size": s.allocated_size, "stream": s.stream,
                          "reserved_unused": s.total_size - s.allocated_size,
                          "blocks": [{"address": int(b.address), "size": int(b.size),
                                      "state": _text(b.state)} for b in s.blocks]} for s in segs]}


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
    if unit:
        m &= np.array([(d.module_of(i) or "") == unit or (d.module_of(i) or "").startswith(
            unit + ".") for i in range(len(m))], bool)
    if text:
        t = text.casefold()
        uniq, inv = np.unique(d.lt.stack, return_inverse=True)
        hit = np.array([any(t in str(f).casefold() for f in rep.snapshot.stack_frames(s))
                        for s in uniq.tolist()], bool)
        m &= hit[inv] if len(uniq) else np.zeros(len(m), bool)
    return m
