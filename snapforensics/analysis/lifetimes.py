"""Allocation lifetimes and the live-bytes timeline of one device, in one pass over its trace.

Every `alloc` row opens a block at its address; the first `free_requested` (or, in files that
only log it, `free_completed`) closes it. That is the memory a tensor holds, the quantity the
"Active Memory Timeline" of torch's viewer draws. The `free_completed` row that follows gives
the record_stream delay.

What the trace cannot show is kept honest, not guessed:
- a free with no alloc (ring buffer wrapped, or recording started mid-run) is a block that was
  alive before the first row: it counts from row 0 (`alloc_row == -1`);
- a block alive in `segments` at dump time with no alloc row was also alive before the first
  row and never freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from snapforensics.snapshot.model import (
    ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    NO_STACK,
    Snapshot,
    Trace,
)


@dataclass
class Lifetimes:
    device: int
    rows: int
    addr: np.ndarray  # uint64
    size: np.ndarray  # int64
    stack: np.ndarray  # int32
    alloc_row: np.ndarray  # int64, -1 = alive before the first row
    free_row: np.ndarray  # int64, rows = still alive at dump
    completed_row: np.ndarray  # int64, -1 = none logged
    live: np.ndarray  # int64 per row: bytes allocated right after the row
    baseline: int  # bytes alive before the first row (from orphans and unseen blocks)
    orphan_frees: int  # frees with no alloc in the trace
    unseen_live: int  # blocks alive at dump with no alloc in the trace
    reused_addresses: int = 0  # allocs at an address whose block had no free: closed there

    @property
    def truncated(self) -> bool:
        return self.orphan_frees > 0 or self.unseen_live > 0

    def __len__(self) -> int:
        return len(self.size)

    def alive_at(self, row: int) -> np.ndarray:
        """Mask of blocks alive right after `row`."""
        return (self.alloc_row <= row) & (self.free_row > row)

    def replay(self, free_row: np.ndarray | None = None, alloc_row: np.ndarray | None = None,
               size: np.ndarray | None = None, extra: Sequence[tuple[int, int, int]] = ()
               ) -> np.ndarray:
        """Live bytes per row; with blocks' alloc/free rows or sizes changed, plus `extra`
        (start_row, end_row, bytes) intervals, the live bytes of a counterfactual trace."""
        fr = self.free_row if free_row is None else free_row
        ar = self.alloc_row if alloc_row is None else alloc_row
        sz = self.size if size is None else size
        delta = np.zeros(self.rows + 1, np.int64)
        born = ar >= 0
        np.add.at(delta, ar[born], sz[born])
        dies = fr < self.rows
        np.add.at(delta, fr[dies], -sz[dies])
        for s, e, n in extra:
            if s < self.rows and e > s:
                delta[max(s, 0)] += n
                delta[min(e, self.rows)] -= n
        start = int(sz[~born].sum())
        return start + np.cumsum(delta[: self.rows])


def compute(snapshot: Snapshot, trace: Trace) -> Lifetimes:
    n = len(trace)
    action = trace.action
    addr = trace.addr
    size = trace.size
    open_at: dict[int, int] = {}  # address -> block index
    a_addr: list[int] = []
    a_size: list[int] = []
    a_stack: list[int] = []
    a_alloc: list[int] = []
    a_free: list[int] = []
    a_done: list[int] = []
    closed_last: dict[int, int] = {}  # address -> block whose free_completed is pending
    orphans = 0
    reused = 0
    logs_requests = bool((action == FREE_REQUESTED).any())
    rows = np.flatnonzero((action == ALLOC) | (action == FREE_REQUESTED) |
                          (action == FREE_COMPLETED))
    stack = trace.stack
    for i in rows.tolist():
        act = action[i]
        ad = int(addr[i])
        if act == ALLOC:
            prev = open_at.get(ad)
            if prev is not None:  # never freed in the trace, yet its memory was handed out again
                a_free[prev] = i
                reused += 1
            open_at[ad] = len(a_addr)
            a_addr.append(ad)
            a_size.append(int(size[i]))
            a_stack.append(int(stack[i]))
            a_alloc.append(i)
            a_free.append(n)
            a_done.append(-1)
            continue
        b = open_at.pop(ad, None)
        if b is not None:
            a_free[b] = i
            if act == FREE_COMPLETED:
                a_done[b] = i
            else:
                closed_last[ad] = b
            continue
        if act == FREE_COMPLETED:
            b = closed_last.pop(ad, None)
            if b is not None:
                a_done[b] = i
                continue
            if logs_requests:  # its request came before the first row: not live in the trace
                continue
            # a completed free with neither alloc nor request: alive before the first row
        elif act != FREE_REQUESTED:
            continue
        orphans += 1
        a_addr.append(ad)
        a_size.append(int(size[i]))
        a_stack.append(int(stack[i]))
        a_alloc.append(-1)
        a_free.append(i)
        a_done.append(i if act == FREE_COMPLETED else -1)
        if act == FREE_REQUESTED:
            closed_last[ad] = len(a_addr) - 1
    # Blocks alive at dump that the trace never saw allocated.
    unseen = 0
    if n:
        for seg in snapshot.segments:
            if seg.device != trace.device:
                continue
            for blk in seg.blocks:
                # Pending-free blocks whose free request is in the trace are already closed.
                if blk.state == "inactive" or blk.address in open_at or (
                        blk.state == "active_pending_free" and blk.address in closed_last):
                    continue
                unseen += 1
                a_addr.append(blk.address)
                # torch's viewer counts pre-existing blocks by requested size; so do we
                a_size.append(blk.requested_size or blk.size)
                a_stack.append(blk.stack if blk.stack is not None else NO_STACK)
                a_alloc.append(-1)
                a_free.append(n)
                a_done.append(-1)
    lt = Lifetimes(
        device=trace.device,
        rows=n,
        addr=np.array(a_addr, np.uint64),
        size=np.array(a_size, np.int64),
        stack=np.array(a_stack, np.int32),
        alloc_row=np.array(a_alloc, np.int64),
        free_row=np.array(a_free, np.int64),
        completed_row=np.array(a_done, np.int64),
        live=np.zeros(0, np.int64),
        baseline=0,
        orphan_frees=orphans,
        unseen_live=unseen,
        reused_addresses=reused,
    )
    lt.live = lt.replay()
    lt.baseline = int(lt.size[lt.alloc_row < 0].sum())
    return lt
