"""The cache's entry format: the interned model (`Snapshot`) as numpy arrays in ONE uncompressed
`.npz` file (strings as one UTF-8 text + offsets per table, the small dicts as JSON bytes), never
a pickle.

    save(snap, f)             # write an entry to an open binary file
    snap = read(f, source)    # the validated model in an entry; BadEntry for anything else

Reading never unpickles and never trusts a size: every member must be stored (not deflated, so
nothing expands), a plain numeric dtype, 1-D, and its header must match its member's size before
it is read. Then every array is validated like the loader validates a file (dtype, shape, id
ranges, sizes <= MAX_BYTES, totals).
"""

from __future__ import annotations

import io
import mmap
import zipfile
from dataclasses import fields
from typing import Any

import numpy as np
import orjson

from snapforensics.snapshot import graph_code
from snapforensics.snapshot.columns import MAX_BYTES, MAX_DEVICE, MAX_TOTAL
from snapforensics.snapshot.format import rank_from_name
from snapforensics.snapshot.model import (
    ACTIONS,
    Annotation,
    Backend,
    Block,
    Format,
    Frame,
    Segment,
    Snapshot,
    Trace,
)
from snapforensics.snapshot.tensors import KINDS, MAX_TP, Identity, TensorTable

SCHEMA = 5  # 2: the recorder's tensor names (snapshot/tensors.py); 3: compile_context rows;
# 4: the recorder's map of compiled code (snapshot/graph_code.py); 5: names' TP split
STATES = ("active_allocated", "active_pending_free", "inactive")
STAGES = ("START", "END")
_ALLOWED = {np.dtype(t) for t in ("i1", "i4", "i8", "u1", "u8", "f8", "?")}


class BadEntry(Exception):
    """A cache entry that is not exactly what this version writes: ignored and rewritten."""


def _strs(arrays: dict, name: str, items: list[str]) -> None:
    """A table of strings: one text and the character offset where each string ends."""
    arrays[name + "_text"] = np.frombuffer("".join(items).encode("utf-8"), np.uint8)
    arrays[name + "_end"] = np.cumsum([len(s) for s in items], dtype=np.int64)


def save(s: Snapshot, f) -> None:
    a: dict[str, np.ndarray] = {}
    _strs(a, "frame_file", [fr.filename for fr in s.frames])
    _strs(a, "frame_name", [fr.name for fr in s.frames])
    a["frame_line"] = np.array([fr.line for fr in s.frames], np.int64)
    a["stack_frames"] = np.fromiter((x for st in s.stacks for x in st), np.int64)
    a["stack_end"] = np.cumsum([len(st) for st in s.stacks], dtype=np.int64)
    for t in s.traces:
        p = f"t{t.device}_"
        for col in ("action", "addr", "size", "stream", "time_us", "stack"):
            a[p + col] = getattr(t, col)
        a[p + "oom_row"] = np.array(list(t.device_free), np.int64)
        a[p + "oom_free"] = np.array(list(t.device_free.values()), np.int64)
        a[p + "cc_row"] = np.array(list(t.compile_context), np.int64)
        _strs(a, p + "cc", list(t.compile_context.values()))
    seg = s.segments
    a["seg_device"] = np.array([x.device for x in seg], np.int64)
    a["seg_address"] = np.array([x.address for x in seg], np.uint64)
    for col in ("total_size", "allocated_size", "active_size", "requested_size"):
        a["seg_" + col] = np.array([getattr(x, col) for x in seg], np.int64)
    a["seg_stream"] = np.array([x.stream for x in seg], np.int64)
    a["seg_expandable"] = np.array([x.is_expandable for x in seg], bool)
    a["seg_stack"] = np.array([x.stack for x in seg], np.int64)
    a["seg_blocks_end"] = np.cumsum([len(x.blocks) for x in seg], dtype=np.int64)
    _strs(a, "seg_type", [x.segment_type for x in seg])
    blocks = [b for x in seg for b in x.blocks]
    a["blk_address"] = np.array([b.address for b in blocks], np.uint64)
    a["blk_size"] = np.array([b.size for b in blocks], np.int64)
    a["blk_requested"] = np.array([b.requested_size for b in blocks], np.int64)
    a["blk_state"] = np.array([STATES.index(b.state) for b in blocks], np.int8)
    a["blk_stack"] = np.array([b.stack for b in blocks], np.int64)
    an = s.annotations
    a["ann_device"] = np.array([x.device for x in an], np.int64)
    a["ann_stage"] = np.array([STAGES.index(x.stage) for x in an], np.int8)
    a["ann_time_us"] = np.array([x.time_us for x in an], np.float64)
    a["ann_row"] = np.array([x.row for x in an], np.int64)
    _strs(a, "ann_name", [x.name for x in an])
    nm = s.tensors
    if nm is not None:
        a["nm_ptr"], a["nm_offset"], a["nm_nbytes"] = nm.ptr, nm.offset, nm.nbytes
        a["nm_time_us"], a["nm_identity"] = nm.time_us, nm.identity
    tensors = None if nm is None else {
        "identities": [[i.tensor, i.kind, i.module, list(i.shape), i.dtype, i.device, i.tp]
                       for i in nm.identities], "notes": nm.notes}
    meta = {"schema": SCHEMA, "traces": len(s.traces), "streams": s.streams,
            "tensors": tensors,
            "graph_code": None if s.graph_code is None else s.graph_code.raw(),
            "seg_pool_id": [list(x.pool_id) for x in seg],
            "allocator_settings": s.allocator_settings, "provenance": s.provenance,
            "format": s.format, "warnings": s.warnings,
            "kind": {f.name: getattr(s.kind, f.name) for f in fields(s.kind)}}
    a["meta"] = np.frombuffer(orjson.dumps(meta, option=orjson.OPT_NON_STR_KEYS), np.uint8)
    savez(f, a)


ALIGN = 64  # every member's data starts at a multiple of this in the file (numpy's ARRAY_ALIGN)
_PAD_ID = 0xD935  # the extra field that pads a zip member's local header (zipalign's)


def savez(f: Any, arrays: dict[str, Any]) -> None:
    """`arrays` as an npz (`np.load` reads it: stored members, `.npy` v1.0 headers) whose
    members' data are aligned in the file: the reader maps the file and views each array in
    place (`_arrays`). np.savez puts a member's data wherever its zip header ends, and a view of
    unaligned int64s made every numpy operation on them take the slow path (a max over 6.4M
    rows: 5 ms aligned, 170 ms not)."""
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, v in arrays.items():
            a = np.ascontiguousarray(v)
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(a))
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.file_size = len(head.getvalue()) + a.nbytes
            big = info.file_size > zipfile.ZIP64_LIMIT  # then zipfile adds a 20-byte zip64 field
            at = f.tell() + 30 + len(info.filename.encode()) + len(head.getvalue()) + 20 * big
            pad = -at % ALIGN
            pad += ALIGN if 0 < pad < 4 else 0  # an extra field is 4 bytes at least
            if pad:
                info.extra = (_PAD_ID).to_bytes(2, "little") + \
                    (pad - 4).to_bytes(2, "little") + bytes(pad - 4)
            with z.open(info, "w", force_zip64=big) as out:
                out.write(head.getvalue())
                out.write(a.view(np.uint8).data if a.nbytes else b"")


def read(entry: Any, source: str) -> Snapshot:
    """The model in `entry` (an open binary file), validated; BadEntry for anything but exactly
    what `save` writes. `source`: the snapshot's path (the rank may come from its name)."""
    try:
        return _build(_arrays(entry), source)
    except BadEntry:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError, OverflowError,
            zipfile.BadZipFile, UnicodeDecodeError, orjson.JSONDecodeError) as e:
        raise BadEntry(f"{type(e).__name__}: {e}") from None


def _arrays(entry: Any) -> dict[str, np.ndarray]:
    """Every member of the npz, each checked before its data is read: stored (not deflated),
    a plain numeric dtype, a 1-D shape whose bytes are exactly the member's. The data is read
    straight into each array from `entry` at the member's offset (a stored member is its
    bytes), not through zipfile's reader: that one copied it twice and summed its CRC, 0.6 s
    of a 1 GB snapshot's 1.1 s of cached model and lifetimes."""
    out = {}
    mapped = _mapped(entry)
    with zipfile.ZipFile(entry) as z:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                raise BadEntry(f"member {info.filename!r} is not a stored .npy")
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0)):
                    raise BadEntry("npy version")
                header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                          else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = header(f, max_header_size=1024)
                if dtype not in _ALLOWED or len(shape) != 1 or fortran:
                    raise BadEntry(f"member {info.filename!r}: {dtype} {shape}")
                n = shape[0] * dtype.itemsize
                if f.tell() + n != info.file_size:
                    raise BadEntry(f"member {info.filename!r}: size does not match its shape")
                at = f.tell()
            if not n:
                out[info.filename[:-4]] = np.empty(0, dtype)
                continue
            entry.seek(info.header_offset)
            local = entry.read(30)  # the member's local header, then its name and extra
            if len(local) != 30 or local[:4] != b"PK\x03\x04":
                raise BadEntry(f"member {info.filename!r}: no local header")
            skip = int.from_bytes(local[26:28], "little") + \
                int.from_bytes(local[28:30], "little")
            start = info.header_offset + 30 + skip + at
            if mapped is not None and start % ALIGN == 0:  # aligned: viewed where it lies
                if start + n > len(mapped):
                    raise BadEntry(f"member {info.filename!r}: truncated")
                arr = np.frombuffer(mapped, dtype, shape[0], start)
            else:
                arr = np.empty(shape[0], dtype)
                entry.seek(start)
                if entry.readinto(arr.view(np.uint8)) != n:
                    raise BadEntry(f"member {info.filename!r}: truncated")
            out[info.filename[:-4]] = arr
    return out


def _mapped(entry: Any) -> mmap.mmap | None:
    """`entry`'s bytes mapped copy-on-write (the arrays are views of the file's cached pages,
    writable, a page copied only where written), None where it cannot be (not a file). Reading
    each member into a new array instead was a copy and a page fault per page of fresh memory:
    1.3 s of a 1 GB snapshot's 4 s warm start on a 2-core VM. Cache entries are replaced by
    rename, never rewritten in place, so a mapping stays whole."""
    try:
        fd = entry.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    try:  # private: copy-on-write; pages come in as they are touched (MAP_POPULATE, all at
        # once, took 0.7 s for the 1 GB file's 400 MB of entries, more than what is touched)
        return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, AttributeError):  # AttributeError: no MAP_PRIVATE (Windows)
        return None


def _arr(a: dict, name: str, dtype: str, n: int | None = None, lo: int | None = None,
         hi: int | None = None) -> np.ndarray:
    v = a[name]
    if v.dtype != np.dtype(dtype):
        raise BadEntry(f"{name}: dtype {v.dtype}, expected {dtype}")
    if n is not None and len(v) != n:
        raise BadEntry(f"{name}: {len(v)} rows, expected {n}")
    if len(v) and lo is not None and int(v.min()) < lo:
        raise BadEntry(f"{name}: below {lo}")
    if len(v) and hi is not None and int(v.max()) > hi:
        raise BadEntry(f"{name}: above {hi}")
    return v


def _table(a: dict, name: str) -> list[str]:
    text = _arr(a, name + "_text", "u1").tobytes().decode("utf-8")
    end = _arr(a, name + "_end", "i8", lo=0, hi=len(text))
    if len(end) and (np.any(np.diff(end) < 0) or int(end[-1]) != len(text)):
        raise BadEntry(f"{name}: offsets")
    if not len(end) and text:
        raise BadEntry(f"{name}: text without offsets")
    ends = end.tolist()
    return [text[i:j] for i, j in zip([0] + ends[:-1], ends)]


def _build(a: dict, source: str) -> Snapshot:
    meta = orjson.loads(_arr(a, "meta", "u1").tobytes())
    if type(meta) is not dict or meta.get("schema") != SCHEMA:
        raise BadEntry("schema")
    lim = MAX_BYTES
    files, names = _table(a, "frame_file"), _table(a, "frame_name")
    line = _arr(a, "frame_line", "i8", len(files), -(1 << 31), (1 << 31) - 1)
    if len(names) != len(files):
        raise BadEntry("frames")
    frames = [Frame(f, ln, nm) for f, ln, nm in zip(files, line.tolist(), names)]
    send = _arr(a, "stack_end", "i8", lo=1)
    flat = _arr(a, "stack_frames", "i8", lo=0, hi=len(frames) - 1)
    if len(send) and (np.any(np.diff(send) <= 0) or int(send[-1]) != len(flat)) or \
            (not len(send) and len(flat)):
        raise BadEntry("stack offsets")
    fl = flat.tolist()
    stacks = [tuple(fl[i:j]) for i, j in zip([0] + send[:-1].tolist(), send.tolist())]
    streams = meta["streams"]
    if not all(type(s) is int and -(1 << 63) <= s < (1 << 64) for s in streams):
        raise BadEntry("streams")
    ntraces = meta["traces"]
    if type(ntraces) is not int or not 0 <= ntraces <= MAX_DEVICE:
        raise BadEntry("traces")
    traces, total = [], 0.0
    for d in range(ntraces):
        p = f"t{d}_"
        action = _arr(a, p + "action", "i1", None, 0, len(ACTIONS) - 1)
        n = len(action)
        size = _arr(a, p + "size", "i8", n, 0, lim)
        total += float(size.sum(dtype=np.float64))
        rows = _arr(a, p + "oom_row", "i8", None, 0, n - 1)
        free = _arr(a, p + "oom_free", "i8", len(rows), 0, lim)
        cc_rows = _arr(a, p + "cc_row", "i8", None, 0, n - 1)
        cc = _table(a, p + "cc")
        if len(cc) != len(cc_rows):
            raise BadEntry(p + "cc")
        traces.append(Trace(
            d, action, _arr(a, p + "addr", "u8", n), size,
            _arr(a, p + "stream", "i4", n, 0, len(streams) - 1),
            _arr(a, p + "time_us", "f8", n),
            _arr(a, p + "stack", "i4", n, -1, len(stacks) - 1),
            dict(zip(rows.tolist(), free.tolist())), dict(zip(cc_rows.tolist(), cc))))
    if total > MAX_TOTAL:
        raise BadEntry("trace sizes")
    segments = _segments(a, meta, len(stacks), len(streams))
    ann_names = _table(a, "ann_name")
    na = len(ann_names)
    lens = [len(t) for t in traces]
    ann_dev = _arr(a, "ann_device", "i8", na, 0, max(ntraces - 1, 0)).tolist()
    ann_row = _arr(a, "ann_row", "i8", na, 0).tolist()
    if any(r > lens[d] for d, r in zip(ann_dev, ann_row)):
        raise BadEntry("annotation rows")
    annotations = [Annotation(d, STAGES[s], nm, t, r) for d, s, nm, t, r in zip(
        ann_dev, _arr(a, "ann_stage", "i1", na, 0, 1).tolist(), ann_names,
        _arr(a, "ann_time_us", "f8", na).tolist(), ann_row)]
    for k in ("allocator_settings", "provenance", "format"):
        if type(meta[k]) is not dict:
            raise BadEntry(k)
    if type(meta["warnings"]) is not list or not all(type(w) is str for w in meta["warnings"]):
        raise BadEntry("warnings")
    kind = meta["kind"]
    fmt = Format(backend=Backend(kind["backend"]), caching_allocator=bool(
        kind["caching_allocator"]), expandable_segments=bool(kind["expandable_segments"]),
        cpu_recorded=bool(kind["cpu_recorded"]))
    rank = _rank(meta["provenance"], source)
    tensors = _tensors(a, meta.get("tensors"))
    try:
        gc = None if meta.get("graph_code") is None else graph_code.parse(meta["graph_code"])
    except ValueError:
        raise BadEntry("graph_code") from None
    return Snapshot(source=source, frames=frames, stacks=stacks, streams=streams,
                    traces=traces, segments=segments, annotations=annotations,
                    allocator_settings=meta["allocator_settings"],
                    provenance=meta["provenance"], format=meta["format"], rank=rank,
                    warnings=meta["warnings"], kind=fmt, tensors=tensors, graph_code=gc)


def _tensors(a: dict, meta: Any) -> TensorTable | None:
    if meta is None:
        return None
    if type(meta) is not dict or type(meta.get("identities")) is not list or \
            type(meta.get("notes")) is not dict:
        raise BadEntry("tensors")
    ids = []
    for e in meta["identities"]:
        if type(e) is not list or len(e) != 7 or e[1] not in KINDS or type(e[6]) is not int \
                or not 0 <= e[6] <= MAX_TP or type(e[5]) is not int \
                or not 0 <= e[5] < MAX_DEVICE or type(e[3]) is not list \
                or not all(type(x) is int and 0 <= x < (1 << 62) for x in e[3]) \
                or type(e[4]) is not str \
                or not all(x is None or type(x) is str for x in (e[0], e[2])):
            raise BadEntry("tensor identities")
        ids.append(Identity(e[0], e[1], e[2], tuple(e[3]), e[4], e[5], e[6]))
    n = len(_arr(a, "nm_ptr", "u8"))
    return TensorTable(ids, a["nm_ptr"], _arr(a, "nm_offset", "i8", n, 0, MAX_BYTES),
                       _arr(a, "nm_nbytes", "i8", n, 0, MAX_BYTES), _arr(a, "nm_time_us", "f8", n),
                       _arr(a, "nm_identity", "i4", n, 0, max(len(ids) - 1, 0)), meta["notes"])


def _rank(provenance: dict, source: str) -> int | None:
    """As the loader decides it: the recorder's rank, else the one the file's name shows (an
    entry may serve a copy of the file under another name)."""
    rank = provenance.get("rank")
    return rank if type(rank) is int and 0 <= rank < (1 << 31) else rank_from_name(source)


def _segments(a: dict, meta: dict, nstacks: int, nstreams: int) -> list[Segment]:
    lim = MAX_BYTES
    types = _table(a, "seg_type")
    n = len(types)
    bend = _arr(a, "seg_blocks_end", "i8", n, 0)
    nb = int(bend[-1]) if n else 0
    if n and np.any(np.diff(bend) < 0):
        raise BadEntry("block offsets")
    cols = {c: _arr(a, "seg_" + c, "i8", n, 0, lim).tolist()
            for c in ("total_size", "allocated_size", "active_size", "requested_size")}
    if sum(map(float, cols["total_size"])) > MAX_TOTAL:
        raise BadEntry("segment sizes")
    pool_ids = meta["seg_pool_id"]
    if type(pool_ids) is not list or len(pool_ids) != n or not all(
            type(p) is list and len(p) <= 4 and all(type(x) is int for x in p)
            for p in pool_ids):
        raise BadEntry("segment pools")
    blocks = [Block(ad, sz, rq, STATES[st], sk) for ad, sz, rq, st, sk in zip(
        _arr(a, "blk_address", "u8", nb).tolist(), _arr(a, "blk_size", "i8", nb, 0, lim).tolist(),
        _arr(a, "blk_requested", "i8", nb, 0, lim).tolist(),
        _arr(a, "blk_state", "i1", nb, 0, len(STATES) - 1).tolist(),
        _arr(a, "blk_stack", "i8", nb, -1, nstacks - 1).tolist())]
    starts = [0] + bend[:-1].tolist()
    return [Segment(dev, addr, cols["total_size"][i], cols["allocated_size"][i],
                    cols["active_size"][i], cols["requested_size"][i], stream, types[i],
                    tuple(pool_ids[i]), bool(exp), stack, blocks[starts[i]:int(bend[i])])
            for i, (dev, addr, stream, exp, stack) in enumerate(zip(
                _arr(a, "seg_device", "i8", n, 0, MAX_DEVICE).tolist(),
                _arr(a, "seg_address", "u8", n).tolist(),
                _arr(a, "seg_stream", "i8", n, 0, nstreams - 1).tolist(),
                _arr(a, "seg_expandable", "?", n).tolist(),
                _arr(a, "seg_stack", "i8", n, -1, nstacks - 1).tolist()))]


__all__ = ["SCHEMA", "BadEntry", "save", "read"]
