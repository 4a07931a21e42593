"""What kind of file this is: era, backend and quirks (`Snapshot.format`, `Snapshot.kind`), and
the rank a file name shows."""

from __future__ import annotations

import re

import numpy as np

from snapforensics.snapshot.intern import Interner
from snapforensics.snapshot.model import A, Backend, Format, Frame, Segment, Trace

RANK_PATTERNS = (
    # rank3.pickle, snapshot_rank_3
    re.compile(r"(?:^|[^a-z])rank[_-]?(\d{1,6})(?!\d)", re.IGNORECASE),
    re.compile(r"^(\d{6})_step_\d+(?:\D|$)"),  # torchtitan: 000003_step_10.pickle
    re.compile(r"^snapshot_\d{9,}_(\d{1,5})\.(?:pickle|pkl)\b"),  # MindSpeed-MM
)
_RANK_DIR = re.compile(r"^rank[_-]?(\d{1,6})$", re.IGNORECASE)


def rank_from_name(path: str) -> int | None:
    """The rank a file name shows, by the conventions seen in the wild; None when it shows none.

    Only these shapes count, so other digits (steps, timestamps, sizes) are never taken for a
    rank: `rank{R}` anywhere in the name (`rank3.pickle`, `snapshot_rank_3_step_2.pickle`),
    torchtitan `{rank:06d}_step_{N}.pickle`, MindSpeed-MM `snapshot_{time}_{rank}.pickle`, or,
    when the name shows none, a parent directory named exactly `rank{R}`.
    """
    parts = [x for x in re.split(r"[\\/]", str(path)) if x]
    if not parts:
        return None
    name = parts[-1]
    for pat in RANK_PATTERNS:
        m = pat.search(name)
        if m:
            return int(m.group(1))
    if len(parts) > 1:
        m = _RANK_DIR.match(parts[-2])
        if m:
            return int(m.group(1))
    return None


def _is_npu_frame(f: Frame) -> bool:
    fn, name = f.filename, f.name
    return ("torch_npu" in fn or "/npu/" in fn or "\\npu\\" in fn
            or "c10_npu::" in name or "NPUCachingAllocator" in name or "torch_npu" in name
            or "aclrtMalloc" in name)


_WIN_PATH = re.compile(r"^[A-Za-z]:[\\/]")


def detect_format(raw: dict, traces: list[Trace], segments: list[Segment], it: Interner,
                   provenance: dict, keys: set, fmt: dict) -> dict:
    rows = sum(len(t) for t in traces)
    has_time = rows > 0 and all(not np.isnan(t.time_us).all() for t in traces if len(t))
    fmt["has_time"] = has_time
    fmt["entries"] = rows
    workspace = sum(int((t.action == A["workspace_snapshot"]).sum()) for t in traces)
    npu_frame = next((f for f in it.frames if _is_npu_frame(f)), None)
    used_streams = set(it.streams)
    if isinstance(provenance.get("backend"), str) and provenance["backend"]:
        backend, why = provenance["backend"], "recorded by snapforensics"
    elif any(s.segment_type == "cpu" for s in segments):
        backend, why = "cpu", "cpu pseudo segments"
    elif workspace:
        backend, why = "npu", "workspace_snapshot entries (torch_npu only)"
    elif npu_frame is not None:
        backend, why = "npu", f"torch_npu frames ({npu_frame.filename or npu_frame.name})"
    elif not has_time and used_streams and 0 not in used_streams:
        # CUDA's default stream is handle 0 and every CUDA file since 2.2 has time_us; torch_npu
        # logs no time and its default stream is a pointer.
        backend, why = "npu", "no time_us and no default (0) stream: torch_npu stream pointers"
    else:
        backend, why = "cuda", "default"
    fmt["backend"] = backend
    fmt["backend_evidence"] = why
    # action codes index ACTIONS (>= 0): counting them is a pass, unique a sort
    actions = {a for t in traces for a in np.flatnonzero(np.bincount(t.action)).tolist()}
    if "pool_id" in keys or A["annotate"] in actions:
        era = "torch main (pool_id / annotate)"
    elif "user_metadata" in keys:
        era = "torch>=2.10"
    elif "compile_context" in keys:
        era = "torch>=2.8"
    elif "external_annotations" in raw:
        era = "torch>=2.5"
    elif A["user_defined"] in actions:
        era = "torch>=2.4"
    elif "allocator_settings" in raw:
        era = "torch>=2.3"
    elif has_time:
        era = "torch>=2.2"
    elif fmt.get("legacy_block_history"):
        era = "torch 2.0 (block history)"
    elif backend == "npu":
        era = "torch_npu (no time_us)"
    elif rows:
        era = "torch 2.1 (no time_us)"
    else:
        era = "unknown (no history)"
    if isinstance(provenance.get("torch_version"), str):
        era = f"torch {provenance['torch_version']}"
    fmt["era"] = era
    fmt["ranges"] = _ranges(raw, provenance, backend, A["user_defined"] in actions)
    fmt["trace_keys"] = sorted(k for k in keys if isinstance(k, str))
    fmt["expandable_segments"] = any(s.is_expandable for s in segments) or any(
        bool((t.action == A["segment_map"]).any()) for t in traces)
    fmt["cpp_frames"] = any(f.filename in ("", "??") or "::" in f.name for f in it.frames)
    fmt["windows_paths"] = any(_WIN_PATH.match(f.filename) for f in it.frames)
    if workspace:
        fmt["workspace_entries"] = workspace
    if it.pools:
        fmt["pools"] = [list(p) for p in it.pools]
    return fmt


def _version(v) -> tuple[int, int] | None:
    m = re.match(r"(\d{1,9})\.(\d{1,9})(?!\d)", v) if isinstance(v, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def _ranges(raw: dict, provenance: dict, backend: str, user_defined: bool) -> str:
    """Which record_function ranges the file can hold, by what recorded it. The allocator's
    RecordFunction callback is thread local before torch 2.8 (and in torch_npu): only the ranges
    of the thread that started recording are kept, not those the autograd engine's device
    thread opens in backward (FSDP's pre/post-backward hooks). `global_record_annotations=True`
    (torch 2.8) keeps every thread's; this project's recorder asks for it where torch has it.
    The CPU recorder's profiler sees every thread."""
    has = bool(raw.get("external_annotations")) or user_defined
    if backend == "cpu" or provenance.get("cpu_recorded"):
        return "every thread (profiler)" if has else "none"
    version = _version(provenance.get("torch_version"))
    if version is not None:  # recorded by snapforensics, which asks for every thread
        if backend != "npu" and version >= (2, 8):
            return "every thread (global_record_annotations)"
        if version < (2, 5) and not has:
            return "none (torch < 2.5 records none)"
        return ("recording thread only (torch < 2.8, torch_npu): backward's ranges, opened on "
                "the autograd thread, are missing")
    if not has:
        return "none"
    return "recording thread only, unless recorded with global_record_annotations=True (torch 2.8+)"


def kind(fmt: dict, provenance: dict) -> Format:
    backend = fmt.get("backend")
    backend = Backend(backend) if backend in set(Backend) else Backend.UNKNOWN
    cpu = backend == Backend.CPU or bool(provenance.get("cpu_recorded"))
    return Format(backend=backend, caching_allocator=not cpu,
                  expandable_segments=bool(fmt.get("expandable_segments")), cpu_recorded=cpu)
