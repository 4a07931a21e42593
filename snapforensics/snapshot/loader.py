"""The one loader: reads any snapshot file safely and owns every format quirk.

- Refuses every pickle global (no code from the file ever runs) while keeping the C unpickler.
- Accepts torch 2.0 (block `history`) to current, torch_npu files, gzip'd files, a bare segment
  list (`torch.cuda.memory_snapshot()`), missing `frames` / `time_us`, several devices.
- Validates every field it keeps: a wrong type or an impossible size is a one-line SnapError,
  never a silently wrong number.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np

from snapforensics.errors import SnapError
from snapforensics.snapshot.model import (
    A,
    Annotation,
    Block,
    Frame,
    NO_STACK,
    Segment,
    Snapshot,
    Trace,
)

MAX_BYTES = 1 << 56  # 64 PiB: no real allocation is larger; bigger means a corrupt file
BLOCK_STATES = {"active_allocated", "active_pending_free", "active_awaiting_free", "inactive"}


class _RefuseGlobals(pickle.Unpickler):
    """Snapshots hold only builtins; any global reference means the file is not one of ours."""

    def find_class(self, module: str, name: str) -> Any:
        raise SnapError(
            f"refused: the pickle references the global {module}.{name}; snapshots contain only "
            "plain data, so this file is either not a memory snapshot or unsafe to open")

    def persistent_load(self, pid: Any) -> Any:
        raise SnapError("refused: the pickle uses persistent ids; not a memory snapshot")


def read_raw(path: str | os.PathLike) -> tuple[Any, list[str]]:
    """Unpickle `path` safely. Returns the raw object and loader warnings."""
    p = Path(path)
    if not p.exists():
        raise SnapError(f"{p}: no such file")
    if p.is_dir():
        raise SnapError(f"{p}: is a directory, expected a snapshot file (e.g. {p}/rank0.pickle)")
    try:
        data = p.read_bytes()
    except PermissionError:
        raise SnapError(
            f"{p}: permission denied; torch_npu writes snapshots with mode 0200, "
            f"run `chmod 644 {p}` and retry") from None
    except OSError as e:
        raise SnapError(f"{p}: cannot read: {e.strerror or e}") from None
    warnings: list[str] = []
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise SnapError(f"{p}: corrupt gzip file: {e}") from None
    if not data:
        raise SnapError(f"{p}: empty file, not a snapshot")
    if data[:1] != b"\x80" and data[:1] not in (b"(", b"]", b"}"):
        raise SnapError(f"{p}: not a pickle file (a memory snapshot is the pickle that "
                        "torch.cuda.memory._dump_snapshot writes)")
    buf = io.BytesIO(data)
    try:
        obj = _RefuseGlobals(buf).load()
    except SnapError as e:
        raise SnapError(f"{p}: {e}") from None
    except RecursionError:
        raise SnapError(f"{p}: pickle nested too deeply, not a memory snapshot") from None
    except MemoryError:
        raise SnapError(f"{p}: pickle asks for more memory than this machine has") from None
    except Exception as e:  # truncated, corrupt: every pickle failure is bad input
        raise SnapError(f"{p}: truncated or corrupt pickle ({type(e).__name__}: {e})") from None
    stale = len(data) - buf.tell()
    if stale > 0:
        warnings.append(f"{stale} stale bytes after the pickle end (torch_npu rewrites snapshot "
                        "files without truncating them); ignored")
    return obj, warnings


def load(path: str | os.PathLike) -> Snapshot:
    raw, warnings = read_raw(path)
    return normalize(raw, source=str(path), warnings=warnings)


# ---------------------------------------------------------------------------------------------
# Normalization


class _Interner:
    """Frames by identity then value, stacks by value, strings by value."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.frame_ids: dict[Frame, int] = {}
        self.by_obj: dict[int, int] = {}
        self.keep_alive: list[Any] = []  # id() keys are only valid while the objects live
        self.stacks: list[tuple[int, ...]] = []
        self.stack_ids: dict[tuple[int, ...], int] = {}
        self.strings: list[str] = []
        self.string_ids: dict[str, int] = {}
        self.streams: list[int] = []
        self.stream_ids: dict[int, int] = {}

    def frame(self, f: Any, where: str) -> int:
        fid = self.by_obj.get(id(f))
        if fid is not None:
            return fid
        if not isinstance(f, dict):
            raise SnapError(f"{where}: a frame is {type(f).__name__}, expected a dict")
        filename = f.get("filename", "")
        name = f.get("name", "")
        line = f.get("line", 0)
        if not isinstance(filename, str) or not isinstance(name, str):
            raise SnapError(f"{where}: frame filename/name must be strings")
        if not isinstance(line, int) or isinstance(line, bool):
            raise SnapError(f"{where}: frame line must be an int, got {type(line).__name__}")
        frame = Frame(filename, line, name)
        fid = self.frame_ids.get(frame)
        if fid is None:
            fid = len(self.frames)
            self.frames.append(frame)
            self.frame_ids[frame] = fid
        self.by_obj[id(f)] = fid
        self.keep_alive.append(f)
        return fid

    def stack(self, frames: Any, where: str) -> int:
        if frames is None:
            return NO_STACK
        if not isinstance(frames, list | tuple):
            raise SnapError(f"{where}: frames must be a list, got {type(frames).__name__}")
        if not frames:
            return NO_STACK
        key = tuple(self.frame(f, where) for f in frames)
        sid = self.stack_ids.get(key)
        if sid is None:
            sid = len(self.stacks)
            self.stacks.append(key)
            self.stack_ids[key] = sid
        return sid

    def string(self, s: Any) -> int:
        if not isinstance(s, str) or s in ("", "N/A"):
            return -1
        sid = self.string_ids.get(s)
        if sid is None:
            sid = len(self.strings)
            self.strings.append(s)
            self.string_ids[s] = sid
        return sid

    def stream(self, s: Any, where: str) -> int:
        if s is None:
            s = 0
        if not isinstance(s, int) or isinstance(s, bool):
            raise SnapError(f"{where}: stream must be an int, got {type(s).__name__}")
        sid = self.stream_ids.get(s)
        if sid is None:
            sid = len(self.streams)
            self.streams.append(s)
            self.stream_ids[s] = sid
        return sid


def _int(v: Any, where: str, field: str, *, lo: int = 0, hi: int = (1 << 64) - 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise SnapError(f"{where}: {field} must be an int, got {type(v).__name__}")
    if v < lo or v > hi:
        raise SnapError(f"{where}: {field} {v} is out of range")
    return v


def _time(v: Any, where: str) -> float:
    if v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SnapError(f"{where}: time_us must be a number, got {type(v).__name__}")
    return float(v)


def _trace(entries: Any, device: int, it: _Interner, inline_ann: list[Annotation]) -> Trace:
    where_dev = f"device_traces[{device}]"
    if not isinstance(entries, list | tuple):
        raise SnapError(f"{where_dev} must be a list, got {type(entries).__name__}")
    n = len(entries)
    action = np.empty(n, np.int8)
    addr = np.empty(n, np.uint64)
    size = np.empty(n, np.int64)
    stream = np.empty(n, np.int32)
    time_us = np.empty(n, np.float64)
    stack = np.empty(n, np.int32)
    meta = np.empty(n, np.int32)
    device_free: dict[int, int] = {}
    other = A["other"]
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise SnapError(f"{where_dev}[{i}] is {type(e).__name__}, expected a dict")
        where = f"{where_dev}[{i}]"
        act = e.get("action")
        if not isinstance(act, str):
            raise SnapError(f"{where}: action must be a string")
        code = A.get(act, other)
        action[i] = code
        addr[i] = _int(e.get("addr", 0), where, "addr")
        size[i] = _int(e.get("size", 0), where, "size", hi=MAX_BYTES)
        stream[i] = it.stream(e.get("stream", 0), where)
        time_us[i] = _time(e.get("time_us"), where)
        frames = e.get("frames")
        if act == "user_defined" or act == "annotate":
            # 2.4-era inline annotations: frames [{name: START|END, filename: <name>}]
            stack[i] = NO_STACK
            name, stage = _inline_annotation(e, where)
            inline_ann.append(Annotation(device, stage, name, time_us[i], i))
        else:
            stack[i] = it.stack(frames, where)
        md = e.get("user_metadata")
        meta[i] = it.string(md) if md else it.string(e.get("compile_context"))
        if act == "oom" and "device_free" in e:
            device_free[i] = _int(e["device_free"], where, "device_free", hi=MAX_BYTES)
    return Trace(device, action, addr, size, stream, time_us, stack, meta, device_free)


def _inline_annotation(e: dict, where: str) -> tuple[str, str]:
    frames = e.get("frames") or []
    f = frames[0] if isinstance(frames, list) and frames and isinstance(frames[0], dict) else {}
    stage = str(e.get("stage") or f.get("name") or "START").upper()
    name = str(e.get("name") or f.get("filename") or "annotation")
    return name, ("END" if stage == "END" else "START")


def _segments(raw: Any, it: _Interner) -> list[Segment]:
    if not isinstance(raw, list | tuple):
        raise SnapError(f"segments must be a list, got {type(raw).__name__}")
    out = []
    for si, s in enumerate(raw):
        where = f"segments[{si}]"
        if not isinstance(s, dict):
            raise SnapError(f"{where} is {type(s).__name__}, expected a dict")
        blocks_raw = s.get("blocks", [])
        if not isinstance(blocks_raw, list | tuple):
            raise SnapError(f"{where}: blocks must be a list")
        blocks = []
        for bi, b in enumerate(blocks_raw):
            bw = f"{where}.blocks[{bi}]"
            if not isinstance(b, dict):
                raise SnapError(f"{bw} is {type(b).__name__}, expected a dict")
            bsize = _int(b.get("size", 0), bw, "size", hi=MAX_BYTES)
            frames = b.get("frames")
            if frames is None and isinstance(b.get("history"), list) and b["history"]:
                frames = b["history"][-1].get("frames") if isinstance(b["history"][-1], dict) else None
            state = b.get("state")
            if state is None:  # torch 2.0: history present means allocated
                state = "active_allocated" if b.get("history") else "inactive"
            if state not in BLOCK_STATES:
                raise SnapError(f"{bw}: unknown block state {state!r}")
            if state == "active_awaiting_free":
                state = "active_pending_free"
            blocks.append(Block(
                address=_int(b.get("address", 0), bw, "address"),
                size=bsize,
                requested_size=_int(b.get("requested_size", bsize), bw, "requested_size",
                                    hi=MAX_BYTES),
                state=state,
                stack=it.stack(frames, bw),
            ))
        total = _int(s.get("total_size", sum(b.size for b in blocks)), where, "total_size",
                     hi=MAX_BYTES)
        allocated = sum(b.size for b in blocks if b.state != "inactive")
        pool = s.get("segment_pool_id", (0, 0))
        out.append(Segment(
            device=_int(s.get("device", 0), where, "device", hi=1 << 16),
            address=_int(s.get("address", 0), where, "address"),
            total_size=total,
            allocated_size=_int(s.get("allocated_size", allocated), where, "allocated_size",
                                hi=MAX_BYTES),
            active_size=_int(s.get("active_size", allocated), where, "active_size", hi=MAX_BYTES),
            requested_size=_int(s.get("requested_size", allocated), where, "requested_size",
                                hi=MAX_BYTES),
            stream=it.stream(s.get("stream", 0), where),
            segment_type=str(s.get("segment_type", "")),
            pool_id=tuple(pool) if isinstance(pool, list | tuple) else (pool,),
            is_expandable=bool(s.get("is_expandable", False)),
            stack=it.stack(s.get("frames"), where),
            blocks=blocks,
        ))
    return out


def _place_annotations(raw: Any, traces: list[Trace]) -> list[Annotation]:
    """External annotations carry only a time: place each before the first later trace row."""
    if raw is None:
        return []
    if not isinstance(raw, list | tuple):
        raise SnapError("external_annotations must be a list")
    by_dev = {t.device: t for t in traces}
    out = []
    for i, a in enumerate(raw):
        where = f"external_annotations[{i}]"
        if not isinstance(a, dict):
            raise SnapError(f"{where} is {type(a).__name__}, expected a dict")
        stage = str(a.get("stage", "START")).upper()
        name = a.get("name", "")
        if not isinstance(name, str):
            raise SnapError(f"{where}: name must be a string")
        dev = a.get("device", 0)
        dev = dev if isinstance(dev, int) and not isinstance(dev, bool) else 0
        t = _time(a.get("time_us"), where)
        trace = by_dev.get(dev) or (traces[0] if traces else None)
        if trace is None or math.isnan(t):
            continue
        times = trace.time_us
        # START sits before rows of the same time, END after them.
        side = "left" if stage == "START" else "right"
        row = int(np.searchsorted(times, t, side=side)) if len(times) and \
            not np.isnan(times).any() else len(times)
        out.append(Annotation(trace.device, "END" if stage == "END" else "START", name, t, row))
    return out


RANK_PATTERNS = (
    re.compile(r"(?:^|[^a-z])rank[_-]?(\d+)", re.I),  # rank3.pickle, snapshot_rank_3
    re.compile(r"(?:^|/)(\d{6})_step_\d+"),  # torchtitan: 000003_step_10.pickle
    re.compile(r"snapshot_\d{9,}_(\d{1,5})\.p"),  # MindSpeed-MM: snapshot_{time}_{rank}.pickle
)


def rank_from_name(path: str) -> int | None:
    name = Path(path).name
    for pat in RANK_PATTERNS:
        m = pat.search(name)
        if m:
            return int(m.group(1))
    return None


def _detect_format(raw: dict, traces: list[Trace], segments: list[Segment], it: _Interner,
                   provenance: dict) -> dict:
    fmt: dict[str, Any] = {}
    sample = [e for t in raw.get("device_traces") or [] if isinstance(t, list) for e in t[:200]
              if isinstance(e, dict)]
    keys = set().union(*(e.keys() for e in sample)) if sample else set()
    rows = sum(len(t) for t in traces)
    has_time = rows > 0 and all(not np.isnan(t.time_us).all() for t in traces if len(t))
    fmt["has_time"] = has_time
    if provenance.get("backend"):
        backend = provenance["backend"]
    elif any(s.segment_type == "cpu" for s in segments):
        backend = "cpu"
    elif any("torch_npu" in f.filename or "/npu/" in f.filename for f in it.frames[:5000]) or \
            any(s > (1 << 40) for s in it.streams) or \
            any(t.action.size and (t.action == A["workspace_snapshot"]).any() for t in traces):
        backend = "npu"
    else:
        backend = "cuda"
    fmt["backend"] = backend
    if "user_metadata" in keys:
        era = "torch>=2.10"
    elif "compile_context" in keys:
        era = "torch>=2.8"
    elif "external_annotations" in raw or "allocator_settings" in raw:
        era = "torch>=2.3"
    elif has_time:
        era = "torch>=2.2"
    elif rows:
        era = "torch 2.1 or torch_npu (no time_us)"
    else:
        era = "unknown (no history)"
    if provenance.get("torch_version"):
        era = f"torch {provenance['torch_version']}"
    fmt["era"] = era
    fmt["expandable_segments"] = any(s.is_expandable for s in segments) or any(
        (t.action == A["segment_map"]).any() for t in traces)
    fmt["cpp_frames"] = any(f.filename in ("", "??") or "::" in f.name for f in it.frames[:5000])
    fmt["windows_paths"] = any(re.match(r"^[A-Za-z]:\\", f.filename) for f in it.frames[:5000])
    return fmt


def normalize(raw: Any, source: str = "<memory>", warnings: list[str] | None = None) -> Snapshot:
    warnings = list(warnings or [])
    it = _Interner()
    if isinstance(raw, list | tuple):
        raw = {"segments": list(raw), "device_traces": []}
        warnings.append("bare segment list (torch.cuda.memory_snapshot()): no allocation history")
    if not isinstance(raw, dict):
        raise SnapError(f"not a memory snapshot: the pickle holds a {type(raw).__name__}, "
                        "expected a dict with 'segments' and 'device_traces'")
    if "segments" not in raw and "device_traces" not in raw:
        raise SnapError("not a memory snapshot: no 'segments' or 'device_traces' key "
                        f"(keys: {', '.join(map(str, list(raw)[:6]))})")
    segments = _segments(raw.get("segments") or [], it)
    dt = raw.get("device_traces") or []
    if not isinstance(dt, list | tuple):
        raise SnapError(f"device_traces must be a list, got {type(dt).__name__}")
    inline: list[Annotation] = []
    traces = [_trace(entries, d, it, inline) for d, entries in enumerate(dt)]
    for t in traces:
        if len(t) and t.time_us.size and not np.isnan(t.time_us).any() and \
                (np.diff(t.time_us) < 0).any():
            if not (t.action == A["workspace_snapshot"]).any():
                warnings.append(f"device {t.device}: trace times go backwards; kept file order")
    annotations = sorted(_place_annotations(raw.get("external_annotations"), traces) + inline,
                         key=lambda a: (a.device, a.row))
    prov = raw.get("snapforensics")
    provenance = prov if isinstance(prov, dict) else {}
    settings = raw.get("allocator_settings")
    fmt = _detect_format(raw, traces, segments, it, provenance)
    fmt["bare_segment_list"] = "device_traces" not in raw or (
        not raw.get("device_traces") and any("bare segment" in w for w in warnings))
    rank = provenance.get("rank") if isinstance(provenance.get("rank"), int) else None
    if rank is None:
        rank = rank_from_name(source)
    return Snapshot(
        source=source,
        frames=it.frames,
        stacks=it.stacks,
        strings=it.strings,
        streams=it.streams,
        traces=traces,
        segments=segments,
        annotations=annotations,
        allocator_settings=settings if isinstance(settings, dict) else {},
        provenance=provenance,
        format=fmt,
        rank=rank,
        warnings=warnings,
    )
