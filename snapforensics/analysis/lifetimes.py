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
from snapforensics.snapshot.native import native


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
    """Pair the trace's allocs and frees per address: events sorted by address, then one walk
    over each address's events (`_native.c`'s `pair_events`, or the same walk as numpy array
    operations in `_pair_numpy` where the C extension is not built).

    Events (alloc, free_requested, free_completed rows) are sorted by (address, row); within an
    address, an event closes the block opened by the event right before it when that one is an
    alloc. A `free_completed` whose previous event is not an alloc is "free-standing": the first
    one after a `free_requested` completes the block that request closed; the others (and those
    with no request before them) are orphans, or, when the file logs requests, completions whose
    request came before the first row (ignored).
    """
    n = len(trace)
    action = trace.action
    rows = np.flatnonzero((action == ALLOC) | (action == FREE_REQUESTED)
                          | (action == FREE_COMPLETED))
    logs_requests = bool((action == FREE_REQUESTED).any())
    ev_addr = trace.addr[rows]
    order = np.argsort(ev_addr, kind="stable")  # by address, then row (rows are ascending)
    row = rows[order]
    ad = ev_addr[order]
    act = action[row]
    mod = native()
    pair = _pair_native if mod is not None else _pair_numpy
    ev, free_row, comp, alloc_row, open_end, pending_end, reused = pair(
        row, ad, act, n, logs_requests)
    # blocks in the order the rows made them (each row makes at most one: a scatter, not a sort)
    at_row = np.full(n, -1, np.int64)
    at_row[row[ev]] = np.arange(len(ev))
    by_row = at_row[at_row >= 0]
    ev, free_row, comp, alloc_row = ev[by_row], free_row[by_row], comp[by_row], alloc_row[by_row]
    src = row[ev]
    # Blocks alive at dump that the trace never saw allocated.
    u_addr: list[int] = []
    u_size: list[int] = []
    u_stack: list[int] = []
    if n:
        for seg in snapshot.segments_on(trace.device):
            for blk in seg.blocks:
                # Pending-free blocks whose free request is in the trace are already closed.
                if blk.state == "inactive" or blk.address in open_end or (
                        blk.state == "active_pending_free" and blk.address in pending_end):
                    continue
                u_addr.append(blk.address)
                # torch's viewer counts pre-existing blocks by requested size; so do we
                u_size.append(blk.requested_size or blk.size)
                u_stack.append(blk.stack if blk.stack is not None else NO_STACK)
    u = len(u_addr)
    lt = Lifetimes(
        device=trace.device,
        rows=n,
        addr=np.concatenate([trace.addr[src], np.array(u_addr, np.uint64)]),
        size=np.concatenate([trace.size[src], np.array(u_size, np.int64)]).astype(np.int64),
        stack=np.concatenate([trace.stack[src], np.array(u_stack, np.int32)]).astype(np.int32),
        alloc_row=np.concatenate([alloc_row, np.full(u, -1)]).astype(np.int64),
        free_row=np.concatenate([free_row, np.full(u, n)]).astype(np.int64),
        completed_row=np.concatenate([comp, np.full(u, -1)]).astype(np.int64),
        live=np.zeros(0, np.int64),
        baseline=0,
        orphan_frees=int((alloc_row < 0).sum()),  # blocks made by a free
        unseen_live=u,
        reused_addresses=reused,
    )
    lt.live = lt.replay()
    lt.baseline = int(lt.size[lt.alloc_row < 0].sum())
    return lt


Pairing = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, set, set, int]


def _pair_numpy(row: np.ndarray, ad: np.ndarray, act: np.ndarray, n: int,
                logs_requests: bool) -> Pairing:
    """The blocks the events make, events sorted by (address, row): (event index, free row,
    completed row, alloc row) per block, the addresses open and pending at dump, and the allocs
    that reused an address whose block had no free. `_native.c`'s `pair_events` is the same walk
    in C, used when it is built."""
    m = len(row)
    k = np.arange(m)
    first = np.ones(m, bool)  # first event of its address
    first[1:] = ad[1:] != ad[:-1]
    last = np.ones(m, bool)
    last[:-1] = first[1:]
    is_a, is_r, is_c = act == ALLOC, act == FREE_REQUESTED, act == FREE_COMPLETED
    prev_a = np.zeros(m, bool)  # the previous event of this address is an alloc: its block is open
    prev_a[1:] = is_a[:-1] & ~first[1:]
    start = np.maximum.accumulate(np.where(first, k, 0))  # index of the address's first event
    # The block each alloc opens ends at the address's next event (free or reuse) or stays alive.
    nxt = np.minimum(k + 1, m - 1)
    a_free = np.where(last, n, row[nxt])
    a_done = np.where(~last & is_c[nxt], a_free, -1)
    reused = int((is_a & ~last & is_a[nxt]).sum())
    # The request each free-standing completion may complete: the latest request before it,
    # unless another free-standing completion came in between.
    standing_c = is_c & ~prev_a
    last_r = np.maximum.accumulate(np.where(is_r, k, -1))
    has_r = last_r >= start
    n_standing = np.cumsum(standing_c)
    since_r = n_standing - np.where(has_r, n_standing[np.maximum(last_r, 0)], 0)
    consumes = standing_c & has_r & (since_r == 1)  # itself only
    orphan_r = is_r & ~prev_a
    orphan_c = standing_c & ~consumes & (not logs_requests)
    # Completion rows land on the block the request closed: the alloc before the request, or
    # the orphan block the request itself made.
    r_of = last_r[consumes]
    owner = np.where(prev_a[r_of], r_of - 1, r_of)  # event index that made that block
    done = np.full(m, -1, np.int64)
    done[owner] = row[consumes]
    # Every block, keyed by the event that made it (an alloc or an orphan free).
    makes = is_a | orphan_r | orphan_c
    ev = np.flatnonzero(makes)
    free_row = np.where(is_a, a_free, row)[ev]
    comp = np.where(is_a, np.maximum(a_done, done), np.where(orphan_c, row, done))[ev]
    alloc_row = np.where(is_a, row, -1)[ev]
    open_end = set(ad[last & is_a].tolist())
    pending_end = set(ad[last & ~is_a & has_r & (since_r == 0)].tolist())  # open is not pending
    return ev, free_row, comp, alloc_row, open_end, pending_end, reused


def _pair_native(row: np.ndarray, ad: np.ndarray, act: np.ndarray, n: int,
                 logs_requests: bool) -> Pairing:
    mod = native()
    assert mod is not None  # chosen by compute() only when built
    makes, free, done, born, end, reused = mod.pair_events(
        np.ascontiguousarray(row, np.int64), np.ascontiguousarray(ad, np.uint64),
        np.ascontiguousarray(act, np.int8), n, logs_requests,
        ALLOC, FREE_REQUESTED, FREE_COMPLETED)
    ev = np.flatnonzero(np.frombuffer(makes, np.int8))
    end_at = np.frombuffer(end, np.int8)
    return (ev, np.frombuffer(free, np.int64)[ev], np.frombuffer(done, np.int64)[ev],
            np.frombuffer(born, np.int64)[ev], set(ad[end_at == 1].tolist()),
            set(ad[end_at == 2].tolist()), reused)
