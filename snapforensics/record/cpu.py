"""Turn a CPU profile (``profile_memory=True, with_stack=True``) into a memory snapshot dict.

The output has the shape of ``torch.cuda.memory._snapshot()`` (see
``/work/shared/reference/snapshot-format.md``) so that every reader downstream is
backend-agnostic:

- ``device_traces``: ``[trace]``, one list for the CPU, oldest first, only the last
  ``max_entries`` entries (ring-buffer semantics). An allocation becomes an ``alloc`` entry, a
  free becomes ``free_requested`` then ``free_completed`` (the CPU allocator frees at once).
  ``time_us`` is a float (epoch microseconds, sub-microsecond order kept).
- ``segments``: one pseudo segment (``segment_type`` ``"cpu"``) per block still alive when the
  profile stopped, holding one ``active_allocated`` block; sorted by address.
- ``external_annotations``: START/END for every ``record_function`` range (``FSDP::...``,
  ``Optimizer.step#...``, ``ProfilerStep#N``, user ranges), sorted by time.

Frames are innermost first, ``{"filename", "line", "name"}``:

- Python functions: ``{"filename": "torch/distributed/fsdp/.../_fsdp_collectives.py", "line": 190,
  "name": "foreach_all_gather"}`` (the line is the function's first line: that is what the
  profiler keeps; paths are shortened by the profiler to be relative to their ``sys.path``
  entry);
- module calls: ``{"filename": "<nn.Module>", "line": 0, "name": "Linear_3"}``;
- operators: ``{"filename": "<op>", "line": 0, "name": "aten::empty"}`` (also
  ``c10d::_allgather_base_``, ``fsdp::all_gather_copy_in``, ``AddmmBackward0``, ...);
- ``record_function`` ranges: ``{"filename": "<record_function>", "line": 0,
  "name": "FSDP::pre_forward (layers.0)"}``.

The recorder's own frames (``runpy``, the bootstrap) above the script's ``<module>`` are
dropped. Identical frames, and identical stacks, are the same Python objects so that pickle
memoizes them.
"""

from __future__ import annotations

import re
from typing import Any

_PYCALL = re.compile(r"^(.*)\((\d+)\): (.*)$")
_MODULE_PREFIX = "nn.Module: "


def _event_types():
    from torch._C._profiler import _EventType, RecordScope  # type: ignore[attr-defined]

    return _EventType, RecordScope


def _is_cpu(device: Any) -> bool:
    t = getattr(device, "type", None)
    if t is None:  # older bindings: a string, or (type, index)
        t = str(device)
    return t == "cpu"


def profile_to_snapshot(prof: Any, max_entries: int = 1_000_000) -> dict:
    """Convert a finished ``torch.profiler.profile`` (CPU, ``profile_memory=True``) to a snapshot.

    ``prof`` is the profiler object after ``__exit__`` (or anything with
    ``.profiler.kineto_results``). Cost: one pass over the event tree; a few thousand
    allocations under ~0.6 M profiler events take about a second.
    """
    EventType, RecordScope = _event_types()
    roots = prof.profiler.kineto_results.experimental_event_tree()
    return events_to_snapshot(roots, max_entries, EventType, RecordScope)


def events_to_snapshot(roots: list, max_entries: int, EventType: Any, RecordScope: Any) -> dict:
    """The conversion proper, over the roots of ``experimental_event_tree()``."""
    ALLOC = EventType.Allocation
    TORCH_OP = EventType.TorchOp
    PY_CALL = EventType.PyCall
    USER_SCOPE = RecordScope.USER_SCOPE

    frame_cache: dict[tuple, dict] = {}
    stack_cache: dict[tuple, list] = {}

    def intern_frame(filename: str, line: int, name: str) -> dict:
        key = (filename, line, name)
        f = frame_cache.get(key)
        if f is None:
            f = frame_cache[key] = {"filename": filename, "line": line, "name": name}
        return f

    _STOP = object()  # marks a runpy frame: the recorder's own frames start here
    pycall_frames: dict[str, Any] = {}

    def frame_of_pycall(name: str):
        f = pycall_frames.get(name)
        if f is not None:
            return f
        if name.startswith(_MODULE_PREFIX):
            f = intern_frame("<nn.Module>", 0, name[len(_MODULE_PREFIX):])
        else:
            m = _PYCALL.match(name)
            if m is None:
                f = intern_frame(name, 0, "")
            elif m.group(1) == "<frozen runpy>" and m.group(3) == "_run_code":
                f = _STOP
            else:
                f = intern_frame(m.group(1), int(m.group(2)), m.group(3))
        pycall_frames[name] = f
        return f

    # Depth-first, children in time order. `path` holds, for each ancestor of the current event,
    # a [event, kind, frame] cell; frames are computed only when an allocation needs them.
    allocs: list[tuple[int, int, int, int, list]] = []  # (time_ns, seq, ptr, size, frames)
    annotations: list[tuple[float, int, str, str]] = []  # (time_us, seq, stage, name)
    path: list[list] = []
    seq = 0

    def frames_for_path() -> list:
        out = []
        for cell in reversed(path):
            f = cell[2]
            if f is None:
                ev, kind = cell[0], cell[1]
                if kind == 1:  # torch op
                    ef = ev.extra_fields
                    if ef.scope == USER_SCOPE:
                        f = intern_frame("<record_function>", 0, ev.name)
                    else:
                        f = intern_frame("<op>", 0, ev.name)
                else:  # python call
                    f = frame_of_pycall(ev.name)
                cell[2] = f
            if f is False:  # not a frame (PyCCall, ...)
                continue
            if f is _STOP:
                break
            out.append(f)
        key = tuple(map(id, out))
        cached = stack_cache.get(key)
        if cached is None:
            cached = stack_cache[key] = out
        return cached

    work: list = [(0, ev) for ev in reversed(_sorted_roots(roots))]
    while work:
        depth, ev = work.pop()
        del path[depth:]
        tag = ev.tag
        if tag == ALLOC:
            ef = ev.extra_fields
            if _is_cpu(ef.device):
                allocs.append((ev.start_time_ns, seq, ef.ptr, ef.alloc_size, frames_for_path()))
                seq += 1
            continue
        if tag == TORCH_OP:
            path.append([ev, 1, None])
            if ev.extra_fields.scope == USER_SCOPE:
                name = ev.name
                annotations.append((ev.start_time_ns / 1000.0, seq, "START", name))
                annotations.append((ev.end_time_ns / 1000.0, seq + 1, "END", name))
                seq += 2
        elif tag == PY_CALL:
            path.append([ev, 2, None])
        else:  # PyCCall, Kineto, Backend, Vulkan, ...: not a frame, but keep the depth
            path.append([ev, 3, False])
        children = ev.children
        if children:
            d = depth + 1
            work.extend((d, c) for c in reversed(children))

    allocs.sort(key=lambda a: (a[0], a[1]))
    trace, live = _build_trace(allocs)
    if max_entries is not None and max_entries >= 0 and len(trace) > max_entries:
        trace = trace[len(trace) - max_entries:] if max_entries else []

    annotations.sort(key=lambda a: (a[0], a[1]))
    external = [{"stage": st, "name": nm, "device": 0, "time_us": t} for t, _, st, nm in annotations]

    segments = []
    for addr in sorted(live):
        size, frames = live[addr]
        segments.append({
            "device": 0,
            "address": addr,
            "total_size": size,
            "allocated_size": size,
            "active_size": size,
            "requested_size": size,
            "stream": 0,
            "segment_type": "cpu",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": frames,
            "blocks": [{
                "address": addr,
                "size": size,
                "requested_size": size,
                "state": "active_allocated",
                "frames": frames,
            }],
        })
    return {
        "segments": segments,
        "device_traces": [trace],
        "external_annotations": external,
    }


def _sorted_roots(roots: list) -> list:
    return sorted(roots, key=lambda e: e.start_time_ns)


def _build_trace(allocs: list) -> tuple[list, dict]:
    trace: list[dict] = []
    live: dict[int, tuple[int, list]] = {}
    append = trace.append
    for t_ns, _, ptr, size, frames in allocs:
        t_us = t_ns / 1000.0
        if size >= 0:
            live[ptr] = (size, frames)
            append({"action": "alloc", "addr": ptr, "size": size, "stream": 0,
                    "time_us": t_us, "frames": frames})
        else:
            prev = live.pop(ptr, None)
            n = prev[0] if prev is not None else -size
            append({"action": "free_requested", "addr": ptr, "size": n, "stream": 0,
                    "time_us": t_us, "frames": frames})
            append({"action": "free_completed", "addr": ptr, "size": n, "stream": 0,
                    "time_us": t_us, "frames": frames})
    return trace, live
