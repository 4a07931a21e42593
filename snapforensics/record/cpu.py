"""Turn a CPU profile (``profile_memory=True, with_stack=True``) into a memory snapshot dict.

The output has the shape of ``torch.cuda.memory._snapshot()`` (documented in that function's
docstring, ``torch/cuda/memory.py``; what the loader reads is ``snapshot/normalization.py``) so
that every reader downstream is backend-agnostic:

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
gloo worker dropping the last reference to the work that holds it, e.g. the clone its
reduce-scatter makes) has no free event. Such frees are recovered from the allocator's own
accounting and placed where the collective ended (see ``_recover_lost_frees``), get the single frame
``{"filename": "<snapforensics>", "line": 0, "name": "free_on_untraced_thread"}``, and are counted
in the returned ``snapshot["snapforensics"]["cpu_inferred_frees"]``.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

_PYCALL = re.compile(r"^(.*)\((\d+)\): (.*)$")
_MODULE_PREFIX = "nn.Module: "
INFERRED_FREE_FRAME = ("<snapforensics>", 0, "free_on_untraced_thread")
UNRECORDED_FRAME = ("<snapforensics>", 0, "allocated_before_recording")
UNDECODABLE_NAME = "<undecodable name>"
COMPILED_REGION = "Torch-Compiled Region"  # Dynamo's range name; c10 matches this prefix
NO_COMPILE_CONTEXT = "N/A"  # c10's value outside every compiled region
# How late a collective's worker thread may drop its last reference and still be taken as that
# collective's free: a runnable thread waits at most a few scheduler periods for a core (CFS:
# 6-24 ms on a loaded machine); a tensor a thread holds on purpose is held far longer.
WAKE_UP_NS = 250_000_000


class Cell(IntEnum):
    """What an ancestor of an allocation contributes to its stack."""

    OP = 1  # a TorchOp: an ``<op>`` frame, or a ``<record_function>`` frame for a user scope
    PYCALL = 2  # a Python function or an ``nn.Module`` call
    NOT_A_FRAME = 3  # a C call from Python, a Kineto/backend event: keeps the depth only


# A path cell is a list [event, Cell, frame, start_ns] (lists: a million of them are made per
# recording, a class instance costs ~4x more). frame: None until an allocation needs it, then the
# interned frame, False for "not a frame", or _STOP (the recorder's own frames start there).
EVENT, KIND, FRAME, START = range(4)
@dataclass
class _Alloc:
    """One allocator event (``size`` < 0 for a free) on the profiler's CPU device."""

    # slots=True needs Python 3.10; the fields have no defaults, so __slots__ does the same
    __slots__ = ("time_ns", "seq", "ptr", "size", "frames", "tid", "starts", "total")
    time_ns: int
    seq: int
    ptr: int
    size: int
    frames: list
    tid: int
    starts: list  # each frame's start time (ns), to place record_function ranges among them
    total: int | None  # the allocator's own running total after this event (all threads)


_STOP = object()  # a runpy frame: the recorder's own frames start here


def _event_types():
    from torch._C._profiler import RecordScope, _EventType  # type: ignore[attr-defined]

    return _EventType, RecordScope


def _is_cpu(device: Any) -> bool:
    t = getattr(device, "type", None)
    if t is None:  # older bindings: a string, or (type, index)
        t = str(device)
    return t == "cpu"


def profile_to_snapshot(prof: Any, max_entries: int = 1_000_000,
                        seen: list[tuple[int, int]] | None = None) -> dict:
    """Convert a finished ``torch.profiler.profile`` (CPU, ``profile_memory=True``) to a snapshot.

    ``prof`` is the profiler object after ``__exit__`` (or anything with
    ``.profiler.kineto_results``). Cost: one pass over the event tree; a few thousand
    allocations under ~0.6 M profiler events take about a second. ``seen``: ``(storage address,
    time_ns)`` of storages known alive at that time (the tensor names' observations,
    identity.py), evidence for placing the frees the profiler did not see.
    """
    EventType, RecordScope = _event_types()
    roots = prof.profiler.kineto_results.experimental_event_tree()
    return events_to_snapshot(roots, max_entries, EventType, RecordScope, seen)


def events_to_snapshot(roots: list, max_entries: int, EventType: Any, RecordScope: Any,
                       seen: list[tuple[int, int]] | None = None) -> dict:
    """The conversion proper, over the roots of ``experimental_event_tree()``."""
    frames = _Frames(RecordScope.USER_SCOPE)
    allocs, ranges = _walk(roots, EventType, frames)
    allocs.sort(key=lambda a: (a.time_ns, a.seq))
    _add_range_frames(allocs, ranges, frames)
    main_tid = _main_thread(allocs)
    events, inferred = _recover_lost_frees(allocs, frames, _worker_ranges(ranges, main_tid),
                                           seen)
    trace, live = _build_trace(events)
    return {
        "segments": _segments(live, _unrecorded_bytes(allocs, live), frames),
        "device_traces": [_last(trace, max_entries)],
        "external_annotations": _annotations(ranges, main_tid),
        "snapforensics": {"cpu_inferred_frees": inferred,
                          "cpu_undecodable_names": frames.undecodable},
    }


class _Frames:
    """Interned frames and stacks: identical ones are the same objects, so pickle memoizes them."""

    def __init__(self, user_scope: Any) -> None:
        self.user_scope = user_scope
        self._frames: dict[tuple, dict] = {}
        self._stacks: dict[tuple, list] = {}
        self._pycalls: dict[str, Any] = {}
        self.undecodable = 0

    def intern(self, filename: str, line: int, name: str) -> dict:
        key = (filename, line, name)
        f = self._frames.get(key)
        if f is None:
            f = self._frames[key] = {"filename": filename, "line": line, "name": name}
        return f

    def stack(self, frames: list) -> list:
        key = tuple(map(id, frames))
        cached = self._stacks.get(key)
        if cached is None:
            cached = self._stacks[key] = frames
        return cached

    def of_pycall(self, name: str):
        """``path(LINE): func`` or ``nn.Module: Name_N``; ``_STOP`` for runpy's ``_run_code``."""
        f = self._pycalls.get(name)
        if f is not None:
            return f
        if name == UNDECODABLE_NAME:
            f = self.intern("<snapforensics>", 0, UNDECODABLE_NAME)
        elif name.startswith(_MODULE_PREFIX):
            f = self.intern("<nn.Module>", 0, name[len(_MODULE_PREFIX):])
        else:
            m = _PYCALL.match(name)
            if m is None:
                f = self.intern(name, 0, "")
            elif m.group(1) == "<frozen runpy>" and m.group(3) == "_run_code":
                f = _STOP
            else:
                f = self.intern(m.group(1), int(m.group(2)), m.group(3))
        self._pycalls[name] = f
        return f

    def of_cell(self, cell: list):
        ev = cell[EVENT]
        if cell[KIND] is Cell.OP:
            kind = "<record_function>" if ev.extra_fields.scope == self.user_scope else "<op>"
            return self.intern(kind, 0, self.name(ev))
        return self.of_pycall(self.name(ev))

    def name(self, ev) -> str:
        """``ev.name``; an event whose name is not valid UTF-8 (pybind raises
        UnicodeDecodeError reading it) gets ``UNDECODABLE_NAME`` and is counted, so that one
        such name does not cost the recording."""
        try:
            return ev.name
        except UnicodeDecodeError:
            self.undecodable += 1
            return UNDECODABLE_NAME

    def of_path(self, path: list[list]) -> tuple[list, list]:
        """The interned stack above the current event (innermost first), and each frame's start."""
        out = []
        starts = []
        for cell in reversed(path):
            f = cell[FRAME]
            if f is None:
                f = cell[FRAME] = self.of_cell(cell)
                cell[START] = cell[EVENT].start_time_ns
            if f is False:
                continue
            if f is _STOP:
                break
            out.append(f)
            starts.append(cell[START])
        return self.stack(out), starts


def _walk(roots: list, EventType: Any, frames: _Frames) -> tuple[list[_Alloc], list[tuple]]:
    """Depth-first over the tree, children in time order: the CPU allocator events with their
    stacks, and the record_function ranges ``(start_ns, end_ns, seq, name, tid)``."""
    ALLOC, TORCH_OP = EventType.Allocation, EventType.TorchOp
    PY_CALL, PY_CCALL = EventType.PyCall, EventType.PyCCall
    user_scope = frames.user_scope
    allocs: list[_Alloc] = []
    ranges: list[tuple] = []
    path: list[list] = []
    not_a_frame = [None, Cell.NOT_A_FRAME, False, 0]  # shared: nothing in it is ever read
    seq = 0
    _EXIT = object()  # marks the end of an event's children: pop its path cell
    work: list = sorted(roots, key=lambda e: e.start_time_ns, reverse=True)
    pop, push, extend = work.pop, path.append, work.extend
    while work:  # tags tested most frequent first (C calls, Python calls, ops, allocations)
        ev = pop()
        if ev is _EXIT:
            path.pop()
            continue
        tag = ev.tag
        if tag == PY_CCALL:
            cell = not_a_frame
        elif tag == PY_CALL:
            cell = [ev, Cell.PYCALL, None, 0]
        elif tag == TORCH_OP:
            cell = [ev, Cell.OP, None, 0]
            if ev.extra_fields.scope == user_scope:
                ranges.append((ev.start_time_ns, ev.end_time_ns, seq, frames.name(ev),
                               ev.start_tid))
                seq += 1
        elif tag == ALLOC:
            ef = ev.extra_fields
            if _is_cpu(ef.device):
                stack, starts = frames.of_path(path)
                allocs.append(_Alloc(ev.start_time_ns, seq, ef.ptr, ef.alloc_size, stack,
                                     ev.start_tid, starts, getattr(ef, "total_allocated", None)))
                seq += 1
            continue
        else:  # Kineto, Backend, Vulkan, ...
            cell = not_a_frame
        children = ev.children
        if children:
            push(cell)
            work.append(_EXIT)
            extend(reversed(children))
    return allocs, ranges


def _add_range_frames(allocs: list[_Alloc], ranges: list, frames: _Frames) -> None:
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
        t, tid = a.time_ns, a.tid
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
        if enclosing:
            a.frames = _merge_ranges(a.frames, a.starts, enclosing, frames)


def _merge_ranges(stack: list, starts: list, enclosing: list, frames: _Frames) -> list:
    """``stack`` with the enclosing ranges not already in it, each placed by its start time."""
    present = {id(f) for f in stack}
    extra = []
    for r in enclosing:
        f = frames.intern("<record_function>", 0, r[3])
        if id(f) not in present:
            extra.append((r[0], f))
    if not extra:
        return stack
    extra.sort(key=lambda x: -x[0])  # innermost (latest start) first
    merged = []
    j = 0
    for f, st in zip(stack, starts):
        while j < len(extra) and extra[j][0] > st:
            merged.append(extra[j][1])
            j += 1
        merged.append(f)
    merged.extend(f for _, f in extra[j:])
    return frames.stack(merged)


def _main_thread(allocs: list[_Alloc]):
    counts: dict = {}
    for a in allocs:
        counts[a.tid] = counts.get(a.tid, 0) + 1
    return max(counts, key=counts.get) if counts else None


def _lost_blocks(allocs: list[_Alloc]) -> list[tuple[int, int | None]]:
    """Allocations with no recorded free: ``(index, deadline)``, where ``deadline`` is the index
    of the allocation that hands the same address out again (the CPU allocator never gives out a
    live address, so the block was freed before it), or None for a block that looks alive at the
    end."""
    live: dict[int, int] = {}
    lost = []
    for i, a in enumerate(allocs):
        if a.size >= 0:
            old = live.get(a.ptr)
            if old is not None:
                lost.append((old, i))
            live[a.ptr] = i
        else:
            live.pop(a.ptr, None)
    lost.extend((i, None) for i in live.values())
    return sorted(lost)


def _unseen_frees(allocs: list[_Alloc]) -> list[tuple[int, int]]:
    """``(index, bytes)``: bytes the allocator freed, on threads the profiler does not trace,
    between event ``index - 1`` and event ``index``.

    Each event carries the allocator's running total over all threads (``total_allocated``;
    the recorder turns on the CPU allocator's process-wide accounting, see ``backends``), so a
    total lower than the previous one plus this event's size is a free nobody recorded. Two
    events of different threads can reach the allocator in the opposite order of their time
    stamps; such a pair is read in the order its totals agree with.
    """
    order = list(range(len(allocs)))
    for k in range(1, len(order)):  # one pass of local swaps for races between threads
        a, b = allocs[order[k - 1]], allocs[order[k]]
        if (a.tid != b.tid and a.total is not None and b.total is not None
                and b.total != a.total + b.size and a.total == b.total + a.size):
            order[k - 1], order[k] = order[k], order[k - 1]
    drops = []
    prev = None
    for i in order:
        a = allocs[i]
        if a.total is None:
            prev = None
            continue
        if prev is not None:
            unseen = a.total - a.size - prev
            if unseen < 0:
                drops.append((i, -unseen))
        prev = a.total
    return drops


def _worker_ranges(ranges: list, main_tid) -> list[tuple[int, int, int]]:
    """``(start_ns, end_ns, tid)`` of the ranges other threads ran, by start: collectives
    executed by a process group's worker threads (``gloo:all_reduce``, ``gloo:all_gather``,
    ...)."""
    return sorted((start, end, tid) for start, end, _, _, tid in ranges if tid != main_tid)


def _last_seen(allocs: list[_Alloc], lost: list[tuple[int, int | None]],
               seen: list[tuple[int, int]] | None) -> dict[int, int]:
    """Lost block -> the last time (ns) a storage at its address was seen alive during its
    lifetime (after its allocation, before its address was handed out again)."""
    if not seen:
        return {}
    times: dict[int, list[int]] = {}
    for ptr, t in seen:
        times.setdefault(ptr, []).append(t)
    out = {}
    for idx, deadline in lost:
        a = allocs[idx]
        end = allocs[deadline].time_ns if deadline is not None else None
        ts = [t for t in times.get(a.ptr, ()) if t >= a.time_ns and (end is None or t < end)]
        if ts:
            out[idx] = max(ts)
    return out


def _recover_lost_frees(allocs: list[_Alloc], frames: _Frames,
                        worker_ranges: list[tuple[int, int, int]] | None = None,
                        seen: list[tuple[int, int]] | None = None) -> tuple[list, int]:
    """Add the frees the profiler could not see, from the allocator's own accounting.

    Every unseen drop of the allocator's total is matched to blocks with no recorded free that
    are alive at that moment (same byte count; the oldest first). A lost block left unmatched
    (accounting unavailable) is freed just before its address is handed out again.

    Where: such a block's last reference was held by a collective's worker thread, which drops
    it when it gets the CPU back after finishing its collective, some microseconds to tens of ms
    later depending on scheduling, while the program (which waited for the collective) has
    already let go. So the free is placed at the end of the collective that held the block
    (``_Collectives.holder_end``), not where the drop was seen: recording the scheduler's delay
    would make the same run's peak differ from one recording to the next (gloo's reduce-scatter
    clones its input and frees the clone this way; dropped after the next unit's all-gather,
    the clone adds its bytes to that all-gather's peak). With no such collective, the free goes
    where the drop was seen.

    Returns the merged event list ``(time_ns, order, ptr, size, frames, inferred_size)``
    (``size`` None = inferred free) and the number of inferred frees.
    """
    lost = _lost_blocks(allocs)
    if not lost:
        return [(a.time_ns, a.seq, a.ptr, a.size, a.frames, None) for a in allocs], 0
    free_at: dict[int, int] = {}  # lost alloc index -> index of the event it is freed before
    last_seen = _last_seen(allocs, lost, seen)
    for at, nbytes in _unseen_frees(allocs):
        for idx in _match(lost, free_at, at, nbytes, allocs, last_seen):
            free_at[idx] = at
    for idx, deadline in lost:
        if idx not in free_at and deadline is not None:
            free_at[idx] = deadline
    inferred_stack = frames.stack([frames.intern(*INFERRED_FREE_FRAME)])
    collectives = _Collectives(worker_ranges or [])
    events = [(a.time_ns, a.seq, a.ptr, a.size, a.frames, None) for a in allocs]
    for idx, at in free_at.items():
        a, b = allocs[idx], allocs[at]
        when, order = b.time_ns, b.seq - 0.5
        end = collectives.holder_end(a, b.time_ns)
        if end is not None:
            when, order = end, -1  # before anything stamped at that instant
        events.append((when, order, a.ptr, None, inferred_stack, a.size))
    events.sort(key=lambda e: (e[0], e[1]))
    return events, len(free_at)


class _Collectives:
    """The worker threads' ranges, to find the collective that held a block (``holder_end``)."""

    def __init__(self, ranges: list[tuple[int, int, int]]) -> None:
        self.ranges = sorted(ranges)
        self.starts = [r[0] for r in self.ranges]
        self.by_tid: dict = {}
        for r in self.ranges:
            self.by_tid.setdefault(r[2], []).append(r)

    def holder_end(self, a: _Alloc, seen_ns: int) -> int | None:
        """End of the collective that held lost block ``a`` until its drop, seen at ``seen_ns``.

        A process group's work queue is first in, first out (gloo: ``ProcessGroupGloo::enqueue``
        appends; each worker's ``runLoop`` pops the front, runs the work and only then, having
        taken the queue's lock again, drops its reference: a preempted worker drops it late). A
        block the program made for a collective (gloo's reduce-scatter clones its input, then
        enqueues) is held by the first collective to start after it was made; a block a worker
        allocated inside its collective, by that collective. The holder ended before the drop
        was seen, and at most ``WAKE_UP_NS`` before it (a thread that holds a block longer holds
        it on purpose). Not "the last collective that ended before the drop": a worker
        preempted past the next collective would move the free there, at the scheduler's whim.
        None when no collective held it.
        """
        t = a.time_ns
        own = self.by_tid.get(a.tid, [])
        j = bisect_left(own, (t + 1,)) - 1  # the range the allocating thread was running
        end = own[j][1] if j >= 0 and own[j][1] >= t else None
        k = bisect_left(self.starts, t)
        while end is None and k < len(self.ranges) and self.starts[k] <= seen_ns:
            if self.ranges[k][1] <= seen_ns:  # the first to start after it and end before the drop
                end = self.ranges[k][1]
            k += 1
        if end is None or not end <= seen_ns or seen_ns - end > WAKE_UP_NS:
            return None
        return end


def _match(lost: list, taken: dict, at: int, nbytes: int, allocs: list[_Alloc],
           last_seen: dict[int, int] | None = None) -> list[int]:
    """Lost blocks alive before event ``at`` whose sizes add up to ``nbytes``: the fewest blocks
    that do (one of that size, else two, ... up to ``_MOST_IN_A_DROP``), the oldest first; []
    when none add up.

    Blocks whose address is handed out again later (a deadline) are tried first: they were
    certainly freed, only when is unknown. A block with no deadline may still be alive at the
    end (a parameter made before the first step), and taking it for part of a drop of several
    blocks (two 768 KiB activations freed together) would free it in the trace while the
    allocator still holds it, and leave the blocks that were freed alive until their deadlines.
    Not the oldest blocks that fit one after the other: an 8-byte block made first (the device
    mesh's) then fits every drop, and the two blocks the drop was are no longer found.
    A block seen alive after the drop (``last_seen``: a parameter or optimizer state the tensor
    names observed at a later optimizer step) is not part of it: DeepSpeed's fp32 partition
    and the flat gradient bucket it all-reduces are the same size, and oldest first took the
    partition for the bucket's drop.
    """
    when = allocs[at].time_ns
    seen = last_seen or {}
    alive = [(idx, deadline) for idx, deadline in lost if idx < at and idx not in taken
             and (deadline is None or deadline >= at) and seen.get(idx, -1) < when]
    for tier in ([i for i, d in alive if d is not None], [i for i, _ in alive]):
        sizes = [allocs[i].size for i in tier]
        for k in range(1, _MOST_IN_A_DROP + 1):
            got = _subset(sizes, nbytes, k, [_SEARCH_STEPS])
            if got is not None:
                return [tier[j] for j in got]
    return []


_MOST_IN_A_DROP = 4  # blocks one unseen drop may be (a work's tensors, dropped with it)
_SEARCH_STEPS = 20_000  # per search: bounded whatever the number of lost blocks


def _subset(sizes: list[int], target: int, k: int, steps: list[int],
            start: int = 0) -> list[int] | None:
    """Indices of ``k`` of ``sizes`` (from ``start``, in order) adding up to ``target``, the
    earliest such; None when none do or the search ran out of ``steps``."""
    for j in range(start, len(sizes)):
        steps[0] -= 1
        if steps[0] < 0:
            return None
        if k == 1:
            if sizes[j] == target:
                return [j]
        elif sizes[j] < target:
            rest = _subset(sizes, target - sizes[j], k - 1, steps, j + 1)
            if rest is not None:
                return [j, *rest]
    return None


def _compile_context(frames: list, memo: dict) -> str:
    """What CUDA's allocator writes as an entry's ``compile_context`` (``_record_memory_history(
    compile_context=True)``): the innermost enclosing ``Torch-Compiled Region: F/C`` range (the
    RecordFunction Dynamo's eval-frame opens around each compiled frame's cached code; c10 keeps
    a per-thread stack of them), or ``"N/A"`` outside every compiled frame. The profiler makes that
    range an ancestor ``<op>`` of the allocation, so it is read from the stack."""
    got = memo.get(id(frames))
    if got is None:
        got = next((f["name"] for f in frames if f["name"].startswith(COMPILED_REGION)
                    and f["filename"] in ("<op>", "<record_function>")), NO_COMPILE_CONTEXT)
        memo[id(frames)] = got
    return got


def _build_trace(events: list) -> tuple[list, dict]:
    """The snapshot trace entries, and the blocks alive at the end: ``{ptr: (size, frames)}``."""
    trace: list[dict] = []
    live: dict[int, tuple[int, list]] = {}
    append = trace.append
    memo: dict = {}
    for t_ns, _, ptr, size, frames, _inferred_size in events:
        t_us = t_ns / 1000.0
        cc = _compile_context(frames, memo)
        if size is not None and size >= 0:
            live[ptr] = (size, frames)
            append({"action": "alloc", "addr": ptr, "size": size, "stream": 0,
                    "time_us": t_us, "frames": frames, "compile_context": cc})
            continue
        prev = live.pop(ptr, None)
        if size is None:  # inferred free
            if prev is None:
                continue
            n = prev[0]
        else:
            n = prev[0] if prev is not None else -size
        append({"action": "free_requested", "addr": ptr, "size": n, "stream": 0,
                "time_us": t_us, "frames": frames, "compile_context": cc})
        append({"action": "free_completed", "addr": ptr, "size": n, "stream": 0,
                "time_us": t_us, "frames": frames, "compile_context": cc})
    return trace, live


def _last(trace: list, max_entries: int | None) -> list:
    """Ring-buffer semantics: only the last ``max_entries`` entries."""
    if max_entries is not None and max_entries >= 0 and len(trace) > max_entries:
        return trace[len(trace) - max_entries:] if max_entries else []
    return trace


def _annotations(ranges: list, main_tid) -> list[dict]:
    """START/END entries of the script's own thread's ranges, sorted by time.

    A worker thread's ranges (gloo:all_gather, ...) overlap the main thread's and would break
    START/END nesting for a reader. At one instant: ENDs first (inner before outer), then STARTs
    (outer first).
    """
    marks = []
    for start, end, rseq, name, tid in ranges:
        if tid == main_tid or main_tid is None:
            marks.append((start / 1000.0, 1, rseq, "START", name))
            marks.append((end / 1000.0, 0, -rseq, "END", name))
    marks.sort(key=lambda a: (a[0], a[1], a[2]))
    return [{"stage": st, "name": nm, "device": 0, "time_us": t} for t, _, _, st, nm in marks]


def _unrecorded_bytes(allocs: list[_Alloc], live: dict) -> int:
    """Bytes alive at the end that no recorded allocation explains: the allocator's own total
    after the last event minus the blocks the trace leaves alive. These blocks were allocated
    before recording started (``--steps``) or on a thread the profiler does not trace."""
    last = next((a.total for a in reversed(allocs) if a.total is not None), None)
    if last is None:
        return 0
    return max(0, last - sum(size for size, _ in live.values()))


def _segments(live: dict, unrecorded: int, frames: _Frames) -> list[dict]:
    """One pseudo segment per block alive at the end, holding that block; sorted by address.
    ``unrecorded`` bytes become one more block at address 0 (no real block has it), with no
    alloc in the trace: a reader counts it as alive since before the first entry."""
    live = dict(live)
    if unrecorded:
        live[0] = (unrecorded, frames.stack([frames.intern(*UNRECORDED_FRAME)]))
    segments = []
    for addr in sorted(live):
        size, stack = live[addr]
        segments.append({
            "device": 0, "address": addr, "total_size": size, "allocated_size": size,
            "active_size": size, "requested_size": size, "stream": 0, "segment_type": "cpu",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": stack,
            "blocks": [{"address": addr, "size": size, "requested_size": size,
                        "state": "active_allocated", "frames": stack}],
        })
    return segments
