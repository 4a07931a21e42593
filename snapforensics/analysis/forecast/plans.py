"""The forecast's plans: a counterfactual trace (each block's alloc and free rows, whether it
exists, copies made again) and the moves that turn the recorded strategy and checkpointing into
another (shard_grad_op, full_shard, no_shard; checkpointed or not), per FSDP unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.forecast.units import Unit
from snapforensics.analysis.fsdp.units import forward_end
from snapforensics.analysis.vocab import Category, Phase


@dataclass
class Plan:
    """A counterfactual trace: each block's rows, whether it exists, and copies of blocks
    (re-gathers, recomputes) as (source block, alloc row, free row)."""

    alloc_row: np.ndarray
    free_row: np.ndarray
    keep: np.ndarray
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    fixed_extra: list[tuple[int, int, int]] = field(default_factory=list)  # rule extras (bytes)


def base_plan(d: DeviceAnalysis) -> Plan:
    return Plan(d.lt.alloc_row.copy(), d.lt.free_row.copy(), np.ones(len(d.lt), bool))


def to_shard_grad_op(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """Keep each unit's forward unshard until its post-backward; no re-gather in backward."""
    for it in d.tl.iterations:
        fend = forward_end(it)
        for u in us[it.index]:
            if not u.bwd.size or (d.lt.free_row[u.fwd] > fend).all():
                continue
            p.free_row[u.fwd] = np.maximum(p.free_row[u.fwd], int(d.lt.free_row[u.bwd].max()))
            p.keep[u.bwd] = False
            p.keep[u.bwd_ag] = False


def to_full_shard(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """Free each unit's unshard at its post-forward; gather it again for its backward. FSDP's
    default backward prefetch issues the all-gather when the unit before it (in backward order)
    starts its backward: the all-gather output (FSDP1: the unsharded flat parameter itself) is
    allocated then; FSDP2 copies out into the unsharded parameters at the unit's pre-backward
    (where it is not in the trace: when the unit before it finished its backward)."""
    flat = d.fsdp.fsdp1_flat
    for it in d.tl.iterations:
        fend = forward_end(it)
        kept = [u for u in us[it.index] if u.fwd.size and (d.lt.free_row[u.fwd] > fend).all()]
        order = sorted(kept, key=lambda u: u.b1 if u.b1 >= 0 else d.lt.rows)
        prev_b0 = prev_b1 = it.backward_start
        for u in order:
            b0 = u.b0 if u.b0 >= 0 else prev_b1
            for b in u.fwd.tolist():
                fr = int(d.lt.free_row[b])
                p.free_row[b] = min(int(p.free_row[b]), u.f1)
                p.copies.append((b, prev_b0 if flat[b] else b0, fr))
            for b in u.fwd_ag.tolist():  # the all-gather output, alive until the copy-out
                p.copies.append((b, prev_b0, b0 + 1))
            prev_b0, prev_b1 = b0, (u.b1 if u.b1 >= 0 else b0)


def to_no_shard(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """No unshard at all: parameters are whole (shard factor 1), nothing is gathered."""
    for cat in (Category.UNSHARDED_PARAM, Category.ALL_GATHER):
        p.keep[d.mask(cat)] = False


def _unit_activations(d: DeviceAnalysis, u: Unit) -> np.ndarray:
    """Activations made in unit `u`'s forward and freed in its backward: what it saved."""
    m = d.mask(Category.ACTIVATION) & (d.lt.alloc_row >= u.f0) & (d.lt.alloc_row <= u.f1) & \
        (d.lt.free_row >= u.b0) & (d.lt.free_row <= u.b1)
    return np.flatnonzero(m)


def to_checkpointed(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """Checkpoint every unit: what it saved is freed right after its forward uses it and made
    again (recomputed) when its backward starts."""
    for it in d.tl.iterations:
        for u in us[it.index]:
            if u.b0 < 0 or u.b1 < 0:
                continue
            saved = _unit_activations(d, u)
            allocs = np.sort(d.lt.alloc_row[(d.lt.alloc_row > u.f0) & (d.lt.alloc_row <= u.f1)])
            for b in saved.tolist():
                a, fr = int(d.lt.alloc_row[b]), int(d.lt.free_row[b])
                nxt = allocs[np.searchsorted(allocs, a, side="right"):][:1]
                p.free_row[b] = min(fr, int(nxt[0]) if nxt.size else u.f1)
                p.copies.append((b, u.b0, fr))


def to_not_checkpointed(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """No checkpointing: what each unit's recompute made and its backward consumed is made in
    its forward instead (at the same offset from the unit's pre-forward) and kept; what the
    recompute made and freed itself was a forward transient, already in the trace."""
    rc_all = np.flatnonzero(d.mask(Category.RECOMPUTE_ACTIVATION) & (d.lt.alloc_row >= 0))
    rc_phase = d.tl.phase
    for it in d.tl.iterations:
        for u in us[it.index]:
            if u.b0 < 0 or u.b1 < 0:
                continue
            a = d.lt.alloc_row[rc_all]
            mine = rc_all[(a >= u.b0) & (a <= u.b1)]
            if not mine.size:
                continue
            start = int(d.lt.alloc_row[mine].min())
            for b in mine.tolist():
                fr = int(d.lt.free_row[b])
                if fr < d.lt.rows and rc_phase[fr] == Phase.RECOMPUTE:
                    p.keep[b] = False
                    continue
                p.alloc_row[b] = min(u.f0 + int(d.lt.alloc_row[b]) - start, u.f1)
