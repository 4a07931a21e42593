"""Too many all-gathers in flight at once: prefetching several units ahead, no rate limit.

Signature: more than two units' all-gather outputs (FSDP2's flat all-gather buffer, FSDP1's
unsharded flat parameter) alive at the same time during forward or backward. FSDP needs two
(the unit computing, the next one being gathered); FSDP1 enforces that with
`limit_all_gathers=True` (its `_FreeEventQueue` rate limiter), FSDP2 with its implicit
prefetch of one unit. `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`
lists longer than one unit (or `limit_all_gathers=False`) gather more units ahead, each a full
unit of memory.

Not counted: parameters held across forward/backward on purpose (the root,
`reshard_after_forward=False`), those never resharded after backward (the seed bug's rule) and
stale prefetches (`fsdp.stale_prefetch_all_gather`).

Verdict `anomalous`: the gathers beyond two are removable (a prefetch depth of one unit hides
the communication as well in practice); `info` when the rate limit would lower the peak by less
than 5% (the extra gathers are not where the peak is). Predicted peak: the trace replayed with
a rate limiter of two, each extra gather allocated when the oldest unit in flight is resharded,
its copied-out parameters no earlier than that.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import by_module, counterfactual, human, top_stacks
from snapforensics.analysis.fsdp.units import forward_end, unit_of_event
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import BACKWARD_PHASES, CAT_CODE, Category, Phase, Verdict

LIMIT = 2
_MIN_SAVING = 0.05  # below this share of the peak the rate limit would not lower it: `info`

FIX = """\
# FSDP2: prefetch one unit ahead (the default), not several
for i, block in enumerate(blocks):
    block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
    block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])
# FSDP1: FullyShardedDataParallel(..., limit_all_gathers=True)  # the default"""


def _in_flight(d: DeviceAnalysis, params: bool = False) -> np.ndarray:
    """All-gather outputs (with `params`, also the unsharded parameters copied out of them)
    made in forward/backward that are neither kept across phases nor stale."""
    f = d.fsdp
    stale = f.stale
    what = f.primary | (d.category == CAT_CODE[Category.UNSHARDED_PARAM]) if params else f.primary
    m = what & ~stale & (d.lt.alloc_row >= 0) & (d.iteration >= 0) & \
        np.isin(d.phase, [Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE])
    idx = np.flatnonzero(m)
    keep = []
    for b in idx.tolist():
        it = d.tl.iterations[int(d.iteration[b])]
        fr = int(d.lt.free_row[b])
        if d.phase[b] == Phase.FORWARD and it.backward_start >= 0 and fr > forward_end(it):
            continue  # kept from forward to backward on purpose
        if it.backward_end >= 0 and fr > it.backward_end:
            continue  # never resharded after backward
        keep.append(b)
    return np.array(keep, np.int64)


def _effective_free(d: DeviceAnalysis, blocks: np.ndarray) -> dict[int, int]:
    """When each all-gather output stops standing for its unit: once its unit copied the
    parameters out of it, those parameters do (a buffer whose release the trace shows late,
    e.g. dropped on a thread the recorder does not see, is not a unit still in flight)."""
    return {b: c.done_row for b, c in _copy_outs(d, blocks).items()}


class CopyOut(NamedTuple):
    done_row: int  # the row its unit's copy-out is done with the all-gather output
    blocks: np.ndarray  # the unshard event's blocks copied out of it


class Concurrency(NamedTuple):
    units: int  # most distinct units alive at once
    row: int  # where (-1: none)
    alive: np.ndarray  # the blocks alive there


def _copy_outs(d: DeviceAnalysis, blocks: np.ndarray) -> dict[int, CopyOut]:
    """The copy-out of each FSDP2 all-gather output among `blocks`: the first unshard event of
    its unit after it (without unit names, of its size) that no earlier gather claimed, since
    one copy-out empties one gather and units are copied out in the order they were gathered.
    FSDP1's flat parameter is its own copy-out."""
    f = d.fsdp
    ev = f.event
    events: dict[int, list[int]] = {}
    for b in np.flatnonzero(ev >= 0).tolist():
        events.setdefault(int(ev[b]), []).append(b)
    starts = sorted((int(d.lt.alloc_row[v].min()), k) for k, v in
                    ((k, np.array(v)) for k, v in events.items()))
    rows = np.array([r for r, _ in starts], np.int64)
    out: dict[int, CopyOut] = {}
    claimed: set[int] = set()
    for b in blocks[np.argsort(d.lt.alloc_row[blocks], kind="stable")].tolist():
        if not f.primary[b] or f.fsdp1_flat[b]:
            continue
        a, fr, m = int(d.lt.alloc_row[b]), int(d.lt.free_row[b]), d.module_of(b)
        size = int(d.lt.size[b])
        for j in range(int(np.searchsorted(rows, a, side="right")), len(rows)):
            r, k = starts[j]
            if r > fr:
                break
            if k in claimed:
                continue
            blk = np.array(events[k])
            if m is not None:
                same = unit_of_event(d, blk) == m
            else:
                same = 0.9 * size <= int(d.lt.size[blk].sum()) <= size
            if same:
                out[b] = CopyOut(min(fr, int(d.lt.free_row[blk].max())), blk)
                claimed.add(k)
                break
    return out


def _max_concurrency(d: DeviceAnalysis, blocks: np.ndarray) -> Concurrency:
    if not blocks.size:
        return Concurrency(0, -1, blocks)
    eff = _effective_free(d, blocks)
    ev = []
    for b in blocks.tolist():
        ev.append((int(d.lt.alloc_row[b]), 1, b))
        ev.append((eff.get(b, int(d.lt.free_row[b])), 0, b))  # frees first at the same row
    ev.sort()
    alive: dict[int, None] = {}
    best, best_row = 0, -1
    best_set: list[int] = []
    for row, kind, b in ev:
        if kind:
            alive[b] = None
            units = {d.module_of(x) or ("block", x) for x in alive}
            if len(units) > best:
                best, best_row, best_set = len(units), row, list(alive)
        else:
            alive.pop(b, None)
    return Concurrency(best, best_row, np.array(best_set, np.int64))


def _rate_limited(d: DeviceAnalysis, blocks: np.ndarray) -> np.ndarray:
    """New alloc rows with at most LIMIT units in flight (from the all-gather until the unit's
    parameters are resharded): a gather waits for the oldest unit to reshard, and the unsharded
    parameters copied out of it are made no earlier than the delayed gather (their unit still
    copies them out when it runs: max of the two rows, never past their reshard)."""
    alloc = d.lt.alloc_row.copy()
    order = blocks[np.argsort(d.lt.alloc_row[blocks], kind="stable")]
    outs = _copy_outs(d, order)
    frees: list[int] = []  # heap of rows where the units in flight are resharded
    for b in order.tolist():
        a = int(alloc[b])
        while frees and frees[0] <= a:
            heapq.heappop(frees)
        if len(frees) >= LIMIT:
            a = min(max(a, heapq.heappop(frees)), int(d.lt.free_row[b]))
            while frees and frees[0] <= a:
                heapq.heappop(frees)
        alloc[b] = a
        blk = outs[b].blocks if b in outs else None
        if blk is not None and blk.size:
            alloc[blk] = np.minimum(np.maximum(d.lt.alloc_row[blk], a), d.lt.free_row[blk])
            heapq.heappush(frees, int(d.lt.free_row[blk].max()))
        else:
            heapq.heappush(frees, int(d.lt.free_row[b]))
    return alloc


def check(d: DeviceAnalysis) -> list[Finding]:
    blocks = _in_flight(d)
    if not blocks.size:
        return []
    # With unit names, a unit is in flight from its all-gather until its parameters are
    # resharded; without, each all-gather output stands for its unit. Decided per phase: before
    # torch 2.8 a CUDA recording names the units of forward only (backward's ranges are opened
    # on the autograd thread, which the allocator's thread-local callback does not see).
    with_params = _in_flight(d, params=True)
    per_phase = {}
    for name, phases in (("forward", [Phase.FORWARD]), ("backward", BACKWARD_PHASES)):
        gathers = blocks[np.isin(d.phase[blocks], phases)]
        named = all(d.module_of(b) is not None for b in gathers.tolist())
        counted = with_params if named else gathers
        sel = counted[np.isin(d.phase[counted], phases)]
        per_phase[name] = _max_concurrency(d, sel)
    phase = max(per_phase, key=lambda k: per_phase[k].units)
    n, row, alive = per_phase[phase]
    if n <= LIMIT:
        return []
    alive_bytes = int(d.lt.size[alive].sum())
    unit_bytes: dict = {}
    for b in alive.tolist():
        k = d.module_of(b) or ("block", b)
        unit_bytes[k] = unit_bytes.get(k, 0) + int(d.lt.size[b])
    excess = int(sum(sorted(unit_bytes.values(), reverse=True)[LIMIT:]))
    alloc = _rate_limited(d, blocks)
    after, replay = counterfactual(d, alloc_row=alloc)
    saving = max(d.peak_bytes - after["overall_bytes"], 0)
    verdict = Verdict.ANOMALOUS if saving >= _MIN_SAVING * d.peak_bytes else Verdict.INFO
    it = int(d.iteration[alive[0]]) if alive.size else -1
    cause = (
        f"{n} FSDP units had their all-gathered parameters in flight at once during {phase} "
        f"(row {row}, iteration {it}, {d.phase_name(row)}): "
        f"{human(alive_bytes)} of all-gathered memory alive together, {human(excess)} of it "
        f"beyond the {LIMIT} units FSDP needs (the one computing and the next). Prefetch lists "
        "reaching several units ahead (set_modules_to_forward_prefetch / "
        "set_modules_to_backward_prefetch), or FSDP1 limit_all_gathers=False, gather more "
        "units before the earlier ones are freed." + (
            "" if verdict == Verdict.ANOMALOUS else
            f" Rate-limiting them would lower the peak by only {human(saving)}: not what sets "
            "the peak here."))
    return [Finding(
        replay=replay,
        rule=RULE.id, verdict=verdict,
        title=f"{n} all-gathers in flight at once (more than {LIMIT}): no rate limit",
        cause=cause, bytes=alive_bytes, blocks=int(len(alive)), device=d.device, fix=FIX,
        members=alive,
        predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=saving,
        evidence={
            "phase": phase,
            "row": row,
            "iteration": it,
            "max_in_flight": n,
            "max_in_flight_by_phase": {k: v[0] for k, v in per_phase.items()},
            "excess_bytes": excess,
            "modules": by_module(d, alive),
            "stacks": top_stacks(d, alive, 1),
            "predicted_peaks": after,
        },
    )]


RULE = Rule(
    id="fsdp.too_many_concurrent_all_gathers", check=check, family=Family.FSDP_CONFIGURATION,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX)
