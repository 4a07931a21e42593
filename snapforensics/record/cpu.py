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

Record_function ranges opened from Python are not parents of the calls they enclose in the
profiler's tree, so they are placed in each stack by time (per thread, by start time among the
Python frames). The recorder's own frames (``runpy``, the bootstrap) above the script's
``<module>`` are dropped. Identical frames, and identical stacks, are the same Python objects so
that pickle memoizes them. Sizes are the profiler's ``alloc_size`` (bytes requested).

Threads: allocations on every thread the profiler saw are kept (gloo worker threads allocate
under ``gloo:all_gather`` / ``gloo:all_reduce``); annotations come from the script's thread only
(the one with the most allocations). A tensor freed on a thread the profiler does not trace (a
gloo worker dropping the last reference to a collective's buffer) has no free event; such frees
are inferred (see ``_infer_lost_frees``), get the single frame
``{"filename": "<snapforensics>", "line": 0, "name": "free_on_untraced_thread"}``, and are counted
in the returned ``snapshot["snapforensics"]["cpu_inferred_frees"]``.
"""

from __future__ import annotations

import re
from typing import Any

_PYCALL = re.compile(r"^(.*)\((\d+)\): (.*)$")
_MODULE_PREFIX = "nn.Module: "


def _event_types():
    from torch._C._profiler import RecordScope, _EventType  # type: ignore[attr-defined]

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
    PY_CCALL = EventType.PyCCall
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
    allocs: list[tuple] = []  # (time_ns, seq, ptr, size, frames, tid)
    ranges: list[tuple] = []  # (start_ns, end_ns, seq, name, tid) of record_function ranges
    path: list[list] = []
    seq = 0

    def frames_for_path() -> tuple[list, list]:
        """The interned stack above the current event, and each frame's start time (ns)."""
        out = []
        starts = []
        for cell in reversed(path):
            f = cell[2]
            if f is None:
                ev, kind = cell[0], cell[1]
                if kind == 1:  # torch op
                    if ev.extra_fields.scope == USER_SCOPE:
                        f = intern_frame("<record_function>", 0, ev.name)
                    else:
                        f = intern_frame("<op>", 0, ev.name)
                else:  # python call
                    f = frame_of_pycall(ev.name)
                cell[2] = f
                cell.append(ev.start_time_ns)
            if f is False:  # not a frame (PyCCall, ...)
                continue
            if f is _STOP:
                break
            out.append(f)
            starts.append(cell[3])
        key = tuple(map(id, out))
        cached = stack_cache.get(key)
        if cached is None:
            cached = stack_cache[key] = out
        return cached, starts

    # Iterative DFS; _EXIT marks the end of an event's children (pop its path cell). Tags are
    # tested most frequent first (C calls, Python calls, ops, allocations).
    _EXIT = object()
    work: list = list(reversed(_sorted_roots(roots)))
    pop, push, extend = work.pop, path.append, work.extend
    while work:
        ev = pop()
        if ev is _EXIT:
            path.pop()
            continue
        tag = ev.tag
        if tag == PY_CCALL:
            cell = [ev, 3, False]  # not a frame, but keeps the depth
        elif tag == PY_CALL:
            cell = [ev, 2, None]
        elif tag == TORCH_OP:
            cell = [ev, 1, None]
            if ev.extra_fields.scope == USER_SCOPE:
                ranges.append((ev.start_time_ns, ev.end_time_ns, seq, ev.name, ev.start_tid))
                seq += 1
        elif tag == ALLOC:
            ef = ev.extra_fields
            if _is_cpu(ef.device):
                frames, starts = frames_for_path()
                allocs.append([ev.start_time_ns, seq, ef.ptr, ef.alloc_size, frames,
                               ev.start_tid, starts])
                seq += 1
            continue
        else:  # Kineto, Backend, Vulkan, ...
            cell = [ev, 3, False]
        children = ev.children
        if children:
            push(cell)
            work.append(_EXIT)
            extend(reversed(children))

    allocs.sort(key=lambda a: (a[0], a[1]))
    _add_range_frames(allocs, ranges, intern_frame, stack_cache)
    main_tid = _main_thread(allocs)
    comm_ends = sorted((r[0], r[1]) for r in ranges
                       if r[4] != main_tid and r[3].startswith(_COMM_RANGE_PREFIXES))
    events, inferred = _infer_lost_frees(allocs, comm_ends, intern_frame)
    trace, live = _build_trace(events)
    if max_entries is not None and max_entries >= 0 and len(trace) > max_entries:
        trace = trace[len(trace) - max_entries:] if max_entries else []

    # Ranges of the script's own thread only: a worker thread's ranges (gloo:all_gather, ...)
    # overlap the main thread's and would break START/END nesting for a reader.
    annotations = []
    for start, end, rseq, name, tid in ranges:
        if tid == main_tid or main_tid is None:
            # at one instant: ENDs first (inner before outer), then STARTs (outer first)
            annotations.append((start / 1000.0, 1, rseq, "START", name))
            annotations.append((end / 1000.0, 0, -rseq, "END", name))
    annotations.sort(key=lambda a: (a[0], a[1], a[2]))
    external = [{"stage": st, "name": nm, "device": 0, "time_us": t}
                for t, _, _, st, nm in annotations]

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
        "snapforensics": {"cpu_inferred_frees": inferred},
    }


def _add_range_frames(allocs: list, ranges: list, intern_frame, stack_cache: dict) -> None:
    """Put the record_function ranges enclosing each allocation into its stack.

    The profiler's tree does not make a Python-opened ``record_function`` range (``FSDP::...``)
    the parent of the calls it encloses, so enclosure is computed from times, per thread (ranges
    nest on a thread), and each range is placed among the frames by its start time.
    """
    by_tid: dict = {}
    for r in ranges:
        by_tid.setdefault(r[4], []).append(r)
    for tid_ranges in by_tid.values():
        tid_ranges.sort(key=lambda r: (r[0], r[2]))
    pos = dict.fromkeys(by_tid, 0)
    open_: dict = {tid: [] for tid in by_tid}
    for a in allocs:
        t, tid = a[0], a[5]
        rs = by_tid.get(tid)
        if not rs:
            continue
        stack = open_[tid]
        i = pos[tid]
        while i < len(rs) and rs[i][0] <= t:
            r = rs[i]
            while stack and stack[-1][1] < r[0]:
                stack.pop()
            stack.append(r)
            i += 1
        pos[tid] = i
        while stack and stack[-1][1] < t:
            stack.pop()
        enclosing = [r for r in stack if r[0] <= t <= r[1]]
        if not enclosing:
            continue
        frames, starts = a[4], a[6]
        present = {id(f) for f in frames}
        extra = []
        for r in enclosing:
            f = intern_frame("<record_function>", 0, r[3])
            if id(f) not in present:
                extra.append((r[0], f))
        if not extra:
            continue
        extra.sort(key=lambda x: -x[0])  # innermost (latest start) first
        merged = []
        j = 0
        for f, st in zip(frames, starts):
            while j < len(extra) and extra[j][0] > st:
                merged.append(extra[j][1])
                j += 1
            merged.append(f)
        merged.extend(f for _, f in extra[j:])
        key = tuple(map(id, merged))
        cached = stack_cache.get(key)
        if cached is None:
            cached = stack_cache[key] = merged
        a[4] = cached


_COMM_RANGE_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:")
INFERRED_FREE_FRAME = ("<snapforensics>", 0, "free_on_untraced_thread")


def _main_thread(allocs: list):
    counts: dict = {}
    for a in allocs:
        counts[a[5]] = counts.get(a[5], 0) + 1
    return max(counts, key=counts.get) if counts else None


def _under_collective(frames: list) -> bool:
    for f in frames:
        if f["filename"] == "<op>" and f["name"].startswith("c10d::"):
            return True
    return False


def _infer_lost_frees(allocs: list, comm_ends: list, intern_frame) -> tuple[list, int]:
    """Add the frees the profiler could not see.

    A tensor freed on a thread the profiler does not trace (a gloo worker dropping the last
    reference to a collective's internal buffer, e.g. the input clone of
    ``c10d::_reduce_scatter_base_``) leaves an allocation with no free: the address is then
    handed out again while the block still looks live. The CPU allocator cannot give out a live
    address, so the block was freed before the reuse. For buffers allocated inside a ``c10d::``
    op the free is placed at the end of the first communication range (``gloo:*``) on another
    thread that starts after the allocation (when the collective finished), else just before the
    reuse. Buffers of collectives never reused are freed the same way. Returns the merged event
    list ``(time_ns, order, ptr, size, frames)`` (size None = inferred free) and the count.
    """
    import bisect

    starts = [r[0] for r in comm_ends]

    def collective_end(t_alloc: int):
        i = bisect.bisect_right(starts, t_alloc)
        return comm_ends[i][1] if i < len(comm_ends) else None

    frame = intern_frame(*INFERRED_FREE_FRAME)
    frames_inferred = [frame]
    live: dict[int, tuple] = {}
    extra: list[tuple] = []
    for t, order, ptr, size, frames, _tid, _starts in allocs:
        if size >= 0:
            old = live.get(ptr)
            if old is not None:
                ft = collective_end(old[0]) if _under_collective(old[3]) else None
                if ft is None or ft >= t:
                    extra.append((t, order - 0.5, ptr, None, frames_inferred, old[2]))
                else:
                    extra.append((ft, -1, ptr, None, frames_inferred, old[2]))
            live[ptr] = (t, order, size, frames)
        else:
            live.pop(ptr, None)
    for ptr, (t0, _order, size, frames) in live.items():
        if _under_collective(frames):
            ft = collective_end(t0)
            if ft is not None:
                extra.append((ft, -1, ptr, None, frames_inferred, size))
    if not extra:
        return [(a[0], a[1], a[2], a[3], a[4], None) for a in allocs], 0
    merged = [(a[0], a[1], a[2], a[3], a[4], None) for a in allocs] + extra
    merged.sort(key=lambda e: (e[0], e[1]))
    return merged, len(extra)


def _sorted_roots(roots: list) -> list:
    return sorted(roots, key=lambda e: e.start_time_ns)


def _build_trace(events: list) -> tuple[list, dict]:
    trace: list[dict] = []
    live: dict[int, tuple[int, list]] = {}
    append = trace.append
    for t_ns, _, ptr, size, frames, _inferred_size in events:
        t_us = t_ns / 1000.0
        if size is not None and size >= 0:
            live[ptr] = (size, frames)
            append({"action": "alloc", "addr": ptr, "size": size, "stream": 0,
                    "time_us": t_us, "frames": frames})
            continue
        prev = live.pop(ptr, None)
        if size is None:  # inferred free
            if prev is None:
                continue
            n = prev[0]
        else:
            n = prev[0] if prev is not None else -size
        append({"action": "free_requested", "addr": ptr, "size": n, "stream": 0,
                "time_us": t_us, "frames": frames})
        append({"action": "free_completed", "addr": ptr, "size": n, "stream": 0,
                "time_us": t_us, "frames": frames})
    return trace, live
