"""Phases per row (init, forward, backward, recompute inside backward, optimizer) and iterations.

Each row gets the phase its stack and open record_function ranges show. Rows that show none (on
CUDA the autograd thread runs backward ops with no Python frames) take the phase of the row
before them; a frameless row right after recompute rows is backward, since recompute itself
always runs Python (the checkpoint unpack hook). An iteration starts where forward follows
backward or the optimizer.

An iteration is one forward + backward: with gradient accumulation, one micro-batch. The
iterations up to and including one that runs the optimizer form one optimizer step (`step`,
`micro_batch` within it, `last_micro_batch`). A trace whose optimizer allocates nothing shows
no step boundary: each iteration is then its own step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapforensics.analysis.vocab import Phase
from snapforensics.snapshot.model import NO_STACK, Annotation, Trace


@dataclass
class Iteration:
    index: int
    start: int  # first row
    end: int  # last row (inclusive)
    backward_start: int  # -1 when the iteration has no backward
    backward_end: int  # last backward/recompute row, -1 when none
    forward_peak: int
    backward_peak: int
    forward_peak_row: int
    backward_peak_row: int
    step: int = 0  # the optimizer step this micro-batch belongs to
    micro_batch: int = 0  # its index within that step
    last_micro_batch: bool = True  # the step's optimizer runs in it (or the trace ends)


@dataclass
class Timeline:
    phase: np.ndarray  # int8 per row
    iteration: np.ndarray  # int32 per row, -1 before the first forward
    ctx: np.ndarray  # int32 per row: id into `contexts` of the ranges open at that row
    contexts: list[tuple[str, ...]]
    iterations: list[Iteration]

    def last_of_step(self, it: Iteration) -> Iteration:
        """The micro-batch that ends `it`'s optimizer step (the one that reshards and syncs)."""
        k = it.index
        while not self.iterations[k].last_micro_batch:
            k += 1
        return self.iterations[k]

    def iteration_of(self, row: int) -> Iteration | None:
        if row < 0 or row >= len(self.iteration):
            return None
        i = int(self.iteration[row])
        return self.iterations[i] if i >= 0 else None


def range_context(annotations: list[Annotation], device: int, rows: int
                  ) -> tuple[np.ndarray, list[tuple[str, ...]]]:
    """For every row, the record_function ranges open around it (outermost first)."""
    ctx = np.zeros(rows, np.int32)
    contexts: list[tuple[str, ...]] = [()]
    ids: dict[tuple[str, ...], int] = {(): 0}
    open_: list[str] = []
    prev = 0
    for a in annotations:
        if a.device != device:
            continue
        row = min(max(a.row, 0), rows)
        if row > prev:
            key = tuple(open_)
            if key not in ids:
                ids[key] = len(contexts)
                contexts.append(key)
            ctx[prev:row] = ids[key]
            prev = row
        if a.stage == "START":
            open_.append(a.name)
        elif a.name in open_:
            idx = len(open_) - 1 - open_[::-1].index(a.name)
            del open_[idx]
    if prev < rows:
        key = tuple(open_)
        if key not in ids:
            ids[key] = len(contexts)
            contexts.append(key)
        ctx[prev:] = ids[key]
    return ctx, contexts


def assign(trace: Trace, hints: np.ndarray, live: np.ndarray,
           ctx: np.ndarray, contexts: list[tuple[str, ...]],
           pyless: np.ndarray | None = None) -> Timeline:
    """`hints` is the phase hint of each row (UNKNOWN where the row shows none); `pyless` marks
    the rows with no Python frame (default: the rows with no frames at all)."""
    n = len(trace)
    rows = np.arange(n)
    fwd = np.flatnonzero(hints == Phase.FORWARD)
    first_fwd = int(fwd[0]) if fwd.size else n
    # A row sets the phase when its hint is known (an init hint only before the first forward).
    known = (hints != Phase.UNKNOWN) & ~((hints == Phase.INIT) & (rows > first_fwd))
    last = np.maximum.accumulate(np.where(known, rows, -1)) if n else rows
    phase = np.where(last >= 0, hints[np.maximum(last, 0)], Phase.INIT).astype(np.int8)
    # After recompute rows, a frameless row (a backward op on the autograd thread) means
    # backward again, for it and every unknown row after it until the next known hint.
    if pyless is None:
        pyless = trace.stack == NO_STACK
    frameless = np.cumsum(~known & pyless)
    since = frameless - np.where(last >= 0, frameless[np.maximum(last, 0)], 0) if n else rows
    phase[(phase == Phase.RECOMPUTE) & ~known & (since > 0)] = Phase.BACKWARD
    # An iteration starts at the first forward and where forward follows backward/optimizer.
    prev = np.concatenate([[Phase.INIT], phase[:-1]]) if n else phase
    after = np.isin(prev, [Phase.BACKWARD, Phase.RECOMPUTE, Phase.OPTIMIZER])
    starts = (phase == Phase.FORWARD) & (after | (rows == first_fwd))
    iteration = (np.cumsum(starts) - 1).astype(np.int32)
    return timeline(phase, iteration, live, ctx, contexts)


def timeline(phase: np.ndarray, iteration: np.ndarray, live: np.ndarray, ctx: np.ndarray,
             contexts: list[tuple[str, ...]]) -> Timeline:
    """The Timeline of per-row phases and iterations (`assign`'s, or the cache's: the
    explorer's `doccache.report`): its iterations, their peaks and optimizer steps."""
    n = len(phase)
    it = int(iteration[-1]) if n else -1
    iterations = []
    # iteration numbers only grow along the trace: each iteration is one contiguous slice
    bounds = np.searchsorted(iteration, np.arange(it + 2))
    for k in range(it + 1):
        start, end = int(bounds[k]), int(bounds[k + 1]) - 1
        ph = phase[start:end + 1]
        seg = live[start:end + 1]
        bw = np.flatnonzero((ph == Phase.BACKWARD) | (ph == Phase.RECOMPUTE))
        fw = np.flatnonzero(ph == Phase.FORWARD)
        fpk = int(fw[np.argmax(seg[fw])]) if fw.size else -1
        bpk = int(bw[np.argmax(seg[bw])]) if bw.size else -1
        iterations.append(Iteration(
            index=k, start=start, end=end,
            backward_start=start + int(bw[0]) if bw.size else -1,
            backward_end=start + int(bw[-1]) if bw.size else -1,
            forward_peak=int(seg[fpk]) if fpk >= 0 else 0,
            backward_peak=int(seg[bpk]) if bpk >= 0 else 0,
            forward_peak_row=start + fpk if fpk >= 0 else -1,
            backward_peak_row=start + bpk if bpk >= 0 else -1,
        ))
    _steps(iterations, phase)
    return Timeline(phase, iteration, ctx, contexts, iterations)


def _steps(iterations: list[Iteration], phase: np.ndarray) -> None:
    """Group micro-batches into optimizer steps: a step ends with the iteration that runs the
    optimizer (after its backward). No optimizer rows at all: one step per iteration."""
    opt = [it.backward_end >= 0 and bool((phase[it.backward_end:it.end + 1] ==
                                          Phase.OPTIMIZER).any()) for it in iterations]
    if not any(opt):
        for it in iterations:
            it.step, it.micro_batch, it.last_micro_batch = it.index, 0, True
        return
    step = micro = 0
    for it, ends in zip(iterations, opt):
        it.step, it.micro_batch = step, micro
        it.last_micro_batch = ends or it is iterations[-1]
        if ends:
            step, micro = step + 1, 0
        else:
            micro += 1


__all__ = ["Iteration", "Timeline", "range_context", "assign"]
