"""Normalization: the raw unpickled object in, the validated interned `Snapshot` out.

Each device's trace is converted column by column (`map(dict.get, ...)` + one numpy conversion
per column, types checked with `set(map(type, column))`, rows located only when a check fails);
segments and blocks are validated one by one (they are few); annotations (external ones carry
only a time) are placed in their device's trace. Every field kept is validated: a wrong type or
an impossible size is a one-line SnapError, never a silently wrong number.
"""

from __future__ import annotations

import os
import threading
from functools import partial
from itertools import repeat
from typing import Any

import numpy as np

from snapforensics.errors import SnapError
from snapforensics.snapshot.annotations import place as place_annotations
from snapforensics.snapshot.budget import Budget
from snapforensics.snapshot.child import in_child
from snapforensics.snapshot.columns import (
    LISTS,
    MAX_BYTES,
    MAX_DEVICE,
    MAX_TOTAL,
    absurd_times,
    check_int,
    check_size_total,
    check_types,
    clean_str,
    column,
    short,
    size_column,
    time_column,
    tname,
    uint64_column,
)
from snapforensics.snapshot.format import detect_format, kind, rank_from_name
from snapforensics.snapshot.graph_code import read as read_graph_code
from snapforensics.snapshot.intern import Interner, distinct_pools
from snapforensics.snapshot.metadata import metadata
from snapforensics.snapshot.model import (
    NO_STACK,
    A,
    Annotation,
    Snapshot,
    Trace,
)
from snapforensics.snapshot.native import native
from snapforensics.snapshot.segments import read_segments
from snapforensics.snapshot.stream import StreamTrace
from snapforensics.snapshot.stream import read_info as stream_info
from snapforensics.snapshot.tensors import read as read_tensors
from snapforensics.snapshot.unpickle import (
    address_limit,
    file_kind,
    gc_paused,
    load_budget,
    memory_guard,
    memory_message,
    on_stack,
    open_file,
    pickle_bound,
    read_raw_info,
)

OTHER = A["other"]
DEVICE_UNITS = 1024  # each device is analysed on its own: a fixed cost of about 1,000 rows
# (_stream.c charges the same per device with rows, so it declines what this refuses)


def load(path: str | os.PathLike, file: Any = None) -> Snapshot:
    """The model of the snapshot at `path` (`file`: `path` already opened by
    `unpickle.open_file`; consumed)."""
    # The GC stays off from the first unpickled object to the model: re-enabling it while the
    # raw graph is alive would make the next allocation walk millions of containers (a young
    # collection: every object made while the GC was off counts as young). So the raw graph is
    # freed before the GC comes back.
    # One memory limit for the whole read (the stream reader, its fallback, normalization),
    # proportional to the most pickle bytes the file can hold, set in each phase's thread.
    f = open_file(path) if file is None else file
    size, gzipped = file_kind(f, path)
    limit = address_limit(load_budget(pickle_bound(size, gzipped)))
    if limit is not None and _others():
        # The cap is the process's: here it would starve the other threads (a server's
        # requests, a Dask worker's comms). A forked child, with only this thread, reads under it.
        return in_child(partial(_load, path, f, size, limit), path, memory_message(path, size))
    return _load(path, f, size, limit)


def _others() -> bool:
    """Whether a thread runs here that is not this one nor one of the tool's own quiet ones
    (named "snapforensics-": the progress bar, which allocates within the cap's 256 MiB slack)."""
    me = threading.current_thread()
    return any(t is not me and not t.name.startswith("snapforensics-")
               for t in threading.enumerate())


def _load(path: str | os.PathLike, f: Any, size: int, limit: int | None) -> Snapshot:
    with gc_paused():
        try:
            with memory_guard(limit):
                got = stream_info(path, f)  # None: declined or not built: the Python path
            raw, warnings, info = got if got is not None else read_raw_info(path, f, limit)
            try:  # on the unpickling thread's stack size: the Python path may hold deep tuples
                snap = on_stack(partial(normalize, raw, source=str(path), warnings=warnings,
                                        file_info=info), info.get("tuple_bound", 0), limit)
            except SnapError as e:
                raise SnapError(f"{path}: {e}", e.exit_code) from None
        except MemoryError:
            raise SnapError(memory_message(path, size)) from None
        del raw
    return snap


def _trace(entries: Any, device: int, it: Interner, inline_ann: list[Annotation],
           keys_seen: set, untimed: list[str]) -> Trace:
    where_dev = f"device_traces[{device}]"
    if type(entries) is StreamTrace:
        return _stream_trace(entries, device, it, inline_ann, keys_seen, untimed)
    if type(entries) not in LISTS:
        raise SnapError(f"{where_dev} must be a list, got {tname(entries)}")
    n = len(entries)
    if n == 0:
        return Trace.empty(device)
    action, addr, size, stream, time_us, stack = (_native_columns(entries, where_dev, it)
                                                  or _checked_columns(entries, where_dev, it))
    # Which optional fields this file has: first and last entries suffice.
    for e in entries if n <= 1000 else entries[:500] + entries[-500:]:  # as _stream.c reads
        keys_seen.update(e)
    return _finish_trace(entries, device, (action, addr, size, stream, time_us, stack), it,
                         inline_ann, keys_seen, untimed, where_dev)


def _stream_trace(t: StreamTrace, device: int, it: Interner, inline_ann: list[Annotation],
                  keys_seen: set, untimed: list[str]) -> Trace:
    """A trace the streaming reader wrote as columns: interned exactly as `_native_columns`
    interns the C reader's columns (streams and stacks in order of first appearance)."""
    where_dev = f"device_traces[{device}]"
    if not len(t):
        return Trace.empty(device)
    cols = _intern_columns(t.action, t.addr, t.size, t.stream, t.time_us, t.group,
                           [(rep, r) for rep, r in zip(t.reps, t.first)], where_dev, it)
    keys_seen.update(t.keys)
    return _finish_trace(t, device, cols, it, inline_ann, keys_seen, untimed, where_dev)


def _finish_trace(entries: Any, device: int, cols: Columns, it: Interner,
                  inline_ann: list[Annotation], keys_seen: set, untimed: list[str],
                  where_dev: str) -> Trace:
    """What every trace gets after its columns: absurd times, pools, oom rows' device_free,
    inline annotations (`entries`: the entry dicts, or a StreamTrace)."""
    action, addr, size, stream, time_us, stack = cols
    n = len(action)
    row = entries.entry if type(entries) is StreamTrace else entries.__getitem__
    if absurd_times(time_us):  # one warning per file, in normalize
        untimed.append(f"device {device}")
        time_us = np.full(n, np.nan)

    # pool_id (newest torch) feeds format["pools"]: torch writes it on every entry of a file or on
    # none, so a field absent from the first and last 500 entries is absent.
    if "pool_id" in keys_seen:  # the streaming reader declines such files
        for v in distinct_pools(column(entries, "pool_id")):
            it.pool(v, where_dev)

    device_free: dict[int, int] = {}
    for i in np.flatnonzero(action == A["oom"]).tolist():
        df = row(i).get("device_free")
        if df is not None:
            device_free[i] = check_int(df, f"{where_dev}[{i}]", "device_free", hi=MAX_BYTES)

    compile_context = _compile_contexts(entries, where_dev)
    inline_rows = np.flatnonzero((action == A["user_defined"]) | (action == A["annotate"]))
    for i in inline_rows.tolist():
        # 2.4-era inline annotations: frames [{name: START|END, filename: <name>}]
        stack[i] = NO_STACK
        name, stage = _inline_annotation(row(i), f"{where_dev}[{i}]")
        inline_ann.append(Annotation(device, stage, name, float(time_us[i]), i))
    return Trace(device, action, addr, size, stream, time_us, stack, device_free, compile_context)


NO_COMPILE_CONTEXT = "N/A"  # c10's compile_context outside every torch.compile region


def _compile_contexts(entries: Any, where_dev: str) -> dict[int, str]:
    """Each entry's `compile_context` (torch 2.8+, `_record_memory_history(compile_context=True)`;
    the CPU recorder writes it too): c10 keeps a per-thread stack of the `Torch-Compiled Region:
    F/C` RecordFunction ranges Dynamo opens around a compiled frame's code and writes the top, or
    "N/A". Only rows inside a region are kept. The streaming reader hands over those rows."""
    if type(entries) is StreamTrace:
        col: Any = entries.extras.get("compile_context", {}).items()
    else:  # every row, as the streaming reader reads them (not only the first and last 500)
        col = [(i, v) for i, v in enumerate(column(entries, "compile_context"))
               if v is not None and not (type(v) is str and v == NO_COMPILE_CONTEXT)]
    out: dict[int, str] = {}
    for i, v in col:
        if type(v) is not str:
            raise SnapError(f"{where_dev}[{i}]: compile_context must be a string, got {tname(v)}")
        out[i] = clean_str(v)
    return out


Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _native_columns(entries: Any, where_dev: str, it: Interner) -> Columns | None:
    """A trace's columns from the C reader, in one pass over the entries; None when it is not
    built or when it finds anything irregular (then `_checked_columns` reads the trace and names
    the row). Streams and stacks are interned here exactly as `_checked_columns` does: in order
    of first appearance, one `it.stack` call per distinct frames list."""
    mod = native()
    if mod is None or type(entries) is not list:
        return None
    got = mod.trace_columns(entries, A, OTHER, MAX_BYTES)
    if got is None:
        return None
    a, ad, sz, st, tm, grp, first = got
    return _intern_columns(np.frombuffer(a, np.int8), np.frombuffer(ad, np.uint64),
                           np.frombuffer(sz, np.int64), np.frombuffer(st, np.int64),
                           np.frombuffer(tm, np.float64), np.frombuffer(grp, np.int32),
                           [(entries[r]["frames"], r) for r in np.frombuffer(first, np.int64)
                            .tolist()], where_dev, it)


def _intern_columns(action: np.ndarray, addr: np.ndarray, size: np.ndarray,
                    raw_stream: np.ndarray, time_us: np.ndarray, group: np.ndarray,
                    reps: list[tuple[Any, int]], where_dev: str, it: Interner) -> Columns:
    """The C readers' raw columns interned: streams and stacks in order of first appearance,
    one `it.stack` call per distinct frames list (`reps`: each with its first row)."""
    check_size_total(size, where_dev, "size")
    if (raw_stream == raw_stream[0]).all():
        stream = np.full(len(raw_stream), it.stream(int(raw_stream[0]), where_dev), np.int32)
    else:
        values, at_row, inv = np.unique(raw_stream, return_index=True, return_inverse=True)
        order = np.argsort(at_row, kind="stable")
        ids = np.empty(len(values), np.int32)
        ids[order] = [it.stream(v, where_dev) for v in values[order].tolist()]
        stream = ids[inv.reshape(-1)]
    sids = np.array([it.stack(fl, where_dev, r) for fl, r in reps], np.int32)
    stack = np.full(len(group), NO_STACK, np.int32)
    has = group >= 0
    stack[has] = sids[group[has]]
    return action, addr, size, stream, time_us, stack


def _checked_columns(entries: Any, where_dev: str, it: Interner) -> Columns:
    """A trace's columns, field by field, each value's type and range checked in Python: the
    path for a file the C reader declines, and the one that names the bad row."""
    if set(map(type, entries)) != {dict}:
        i = next(i for i, e in enumerate(entries) if type(e) is not dict)
        raise SnapError(f"{where_dev}[{i}] is {tname(entries[i])}, expected a dict")
    acts = column(entries, "action")
    check_types(acts, {str}, where_dev, "action", "a string")
    action = np.array(list(map(A.get, acts, repeat(OTHER))), np.int8)
    addr_col = column(entries, "addr", 0)
    if None in addr_col:  # oom entries carry device_free instead of an address
        addr_col = [0 if a is None else a for a in addr_col]
    addr = uint64_column(addr_col, where_dev, "addr")
    size = size_column(column(entries, "size", 0), where_dev, "size")
    stream = it.stream_column(column(entries, "stream", 0), where_dev)
    time_us = time_column(column(entries, "time_us"), where_dev)
    stack = it.stack_column(column(entries, "frames"), where_dev)
    return action, addr, size, stream, time_us, stack


def _inline_annotation(e: dict, where: str) -> tuple[str, str]:
    frames = e.get("frames")
    f = frames[0] if type(frames) in LISTS and frames and type(frames[0]) is dict else {}
    stage = e.get("stage")
    if stage is None:
        stage = f.get("name")
    name = e.get("name")
    if name is None:
        name = f.get("filename")
    if stage is not None and type(stage) is not str:
        raise SnapError(f"{where}: annotation stage must be a string, got {tname(stage)}")
    if name is not None and type(name) is not str:
        raise SnapError(f"{where}: annotation name must be a string, got {tname(name)}")
    stage = (stage or "START").upper()
    return clean_str(name or "annotation"), ("END" if stage == "END" else "START")



def normalize(raw: Any, source: str = "<memory>", warnings: list[str] | None = None,
              file_info: dict | None = None) -> Snapshot:
    warnings = list(warnings or [])
    it = Interner(Budget(file_info.get("pickle_bytes") if file_info else None))
    it.keep_alive.append(raw)
    fmt: dict[str, Any] = {}
    bare = False
    if type(raw) in LISTS:
        raw = {"segments": list(raw), "device_traces": []}
        bare = True
        warnings.append("bare segment list (torch.cuda.memory_snapshot()): no allocation history")
    if type(raw) is not dict:
        raise SnapError(f"not a memory snapshot: the pickle holds a {tname(raw)}, "
                        "expected a dict with 'segments' and 'device_traces'")
    if "segments" not in raw and "device_traces" not in raw:
        shown = ", ".join(short(k) for k in list(raw)[:6])
        raise SnapError(f"not a memory snapshot: no 'segments' or 'device_traces' key "
                        f"(keys: {shown or 'none'})")
    segments = read_segments(raw.get("segments") or [], it, fmt)
    seg_devices = {s.device for s in segments}
    it.budget.add(DEVICE_UNITS * len(seg_devices), "units of per-device analysis")
    dt = raw.get("device_traces")
    if dt is None:
        dt = []
    if type(dt) not in LISTS:
        raise SnapError(f"device_traces must be a list, got {tname(dt)}")
    if len(dt) > MAX_DEVICE:
        raise SnapError(f"device_traces has {len(dt)} lists, more than any machine has devices")
    it.budget.add(len(dt), "device traces")
    # each device with rows is analysed on its own: counted before any trace is read
    trace_devices = {d for d, e in enumerate(dt) if (type(e) in LISTS or type(e) is StreamTrace)
                     and len(e)} - seg_devices
    it.budget.add(DEVICE_UNITS * len(trace_devices), "units of per-device analysis")
    it.budget.add(sum(len(e) for e in dt if type(e) in LISTS or type(e) is StreamTrace),
                  "trace entries")
    inline: list[Annotation] = []
    keys: set = set()
    untimed: list[str] = []
    traces = [_trace(entries, d, it, inline, keys, untimed) for d, entries in enumerate(dt)]
    if float(sum(float(t.size.sum(dtype=np.float64)) for t in traces)) > MAX_TOTAL:
        raise SnapError("trace sizes add up to more memory than any device could hold")
    for t in traces:
        if (len(t) > 1 and not np.isnan(t.time_us).any() and (np.diff(t.time_us) < 0).any()
                and not (t.action == A["workspace_snapshot"]).any()):
            warnings.append(f"device {t.device}: trace times go backwards; kept file order")
    annotations = sorted(place_annotations(raw.get("external_annotations"), traces, it, untimed)
                         + inline, key=lambda a: (a.device, a.row))
    if untimed:
        shown = ", ".join(untimed[:3]) + (f" and {len(untimed) - 3} more" if len(untimed) > 3
                                          else "")
        warnings.append(f"time_us infinite or beyond ±2^53 µs ({shown}): no clock reads that; "
                        "treated as untimed (rows in file order)")
    it.check_strings(sum(len(a.name) for a in annotations))
    provenance = metadata(raw, "snapforensics", warnings)
    settings = metadata(raw, "allocator_settings", warnings)
    detect_format(raw, traces, segments, it, provenance, keys, fmt)
    fmt["bare_segment_list"] = bare
    if file_info:
        fmt["gzip"] = bool(file_info.get("gzip"))
        if file_info.get("stale_bytes"):
            fmt["stale_bytes"] = int(file_info["stale_bytes"])
    if fmt.get("segments_not_tiled"):
        warnings.append(f"{fmt['segments_not_tiled']} segments whose blocks do not add up to "
                        "their total_size (synthetic or edited file); segment totals are taken "
                        "from total_size")
    rank = provenance.get("rank")
    if type(rank) is not int or not 0 <= rank < (1 << 31):
        rank = rank_from_name(source)
    return Snapshot(
        source=source,
        frames=it.frames,
        stacks=it.stacks,
        streams=it.streams,
        traces=traces,
        segments=segments,
        annotations=annotations,
        allocator_settings=settings,
        provenance=provenance,
        format=fmt,
        rank=rank,
        warnings=warnings,
        kind=kind(fmt, provenance),
        tensors=read_tensors(raw, warnings),
        graph_code=read_graph_code(raw, warnings),
    )
