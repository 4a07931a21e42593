"""The forecast's FSDP units: each unit's forward and backward rows and unshards per iteration,
found from FSDP's ranges or its unshard events, and the sharding strategy they show.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.forecast.documents import FULL_SHARD, NO_SHARD, SHARD_GRAD_OP
from snapforensics.analysis.fsdp import ranges as fsdp_ranges
from snapforensics.analysis.fsdp.units import ROOT, forward_end
from snapforensics.analysis.vocab import BACKWARD_PHASES, Category, Phase


@dataclass
class Unit:
    """One FSDP unit in one iteration: rows of its forward and backward, its unshards."""

    key: object
    f0: int  # pre-forward (its forward unshard)
    f1: int  # post-forward (reshard, or where its forward ends)
    b0: int = -1  # pre-backward
    b1: int = -1  # post-backward
    fwd: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # forward unshards
    bwd: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # backward unshards
    fwd_ag: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # all-gather bufs
    bwd_ag: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def units(d: DeviceAnalysis, it) -> tuple[list[Unit], object]:
    """Non-root FSDP units of iteration `it` in forward order, and the root's key.

    Forward unshard events name the units (by FQN when the trace carries FSDP2's ranges, else by
    event); backward unshards of the same unit are matched by name, else last-in-first-out by
    size (backward runs the units in reverse). Unit boundaries come from FSDP's own ranges when
    present, else from when its unshards were allocated and freed."""
    f = d.fsdp
    hi = it.end
    un = np.flatnonzero(d.mask(Category.UNSHARDED_PARAM) & (d.iteration == it.index) &
                        (d.lt.alloc_row >= 0))
    un = un[np.argsort(d.lt.alloc_row[un], kind="stable")]
    fw = un[d.phase[un] == Phase.FORWARD]
    bw = un[np.isin(d.phase[un], BACKWARD_PHASES)]
    fend = forward_end(it)

    def group(blocks):
        out: dict = {}
        for b in blocks.tolist():
            m = d.module_of(b)
            out.setdefault(m if m is not None else ("event", int(f.event[b])), []).append(b)
        return {k: np.array(v, np.int64) for k, v in out.items()}

    fg, bg = group(fw), group(bw)
    named = d.annotation_rows(fsdp_ranges.RANGE)
    pre_fw = fsdp_ranges.rows_by_unit(named, ("pre_forward",))
    # a unit whose parameters are still unsharded when its forward starts (FSDP2 with
    # reshard_after_backward=False after the first step, or kept by the previous iteration)
    # gathers nothing in forward: FSDP's own pre_forward range still marks it
    empty = np.zeros(0, np.int64)
    for fqn, rows in pre_fw.items():
        if fqn not in fg and fqn not in ("", ROOT) and any(it.start <= r <= fend for r in rows):
            fg[fqn] = empty

    def start_of(k) -> int:
        if fg[k].size:
            return int(d.lt.alloc_row[fg[k]].min())
        return next(r for r in pre_fw[k] if it.start <= r <= fend)

    if not fg:
        return [], None
    keys = sorted(fg, key=start_of)
    alive = [k for k in keys if (d.lt.free_row[fg[k]] > fend).any()]
    root = ROOT if ROOT in fg else (
        alive[0] if alive and all(not isinstance(k, str) for k in keys) else None)
    # backward unshards of unnamed units: match to forward units last-in-first-out by size
    if any(not isinstance(k, str) for k in bg):
        pending = [k for k in keys if k != root]
        matched: dict = {}
        for k, v in bg.items():
            if isinstance(k, str):
                matched[k] = v
                continue
            size = int(d.lt.size[v].sum())
            for cand in reversed(pending):
                if int(d.lt.size[fg[cand]].sum()) == size:
                    pending.remove(cand)
                    matched[cand] = v
                    break
        bg = matched
    post_fw = fsdp_ranges.rows_by_unit(named, ("post_forward",))
    pre_bw = fsdp_ranges.rows_by_unit(named, ("pre_backward",))
    post_bw = fsdp_ranges.rows_by_unit(named, fsdp_ranges.POST_BACKWARD)

    def first_in(rows, a, b):
        r = [x for x in rows if a <= x <= b]
        return r[0] if r else -1

    ag = np.flatnonzero(d.mask(Category.ALL_GATHER) & f.primary & (d.iteration == it.index))
    out = []
    starts = [start_of(k) for k in keys]
    for i, k in enumerate(keys):
        if k == root:
            continue
        v = fg[k]
        f0 = starts[i]
        nxt = next((s for s in starts[i + 1:] if s > f0), fend)
        name = k if isinstance(k, str) else None
        f1 = first_in(post_fw.get(name, []), f0, hi) if name else -1
        if f1 < 0:
            freed = d.lt.free_row[v]
            f1 = int(freed.max()) if v.size and (freed <= fend).all() else nxt
        b = bg.get(k, np.zeros(0, np.int64))
        b0 = first_in(pre_bw.get(name, []), fend, hi) if name else -1
        if b0 < 0 and b.size:
            b0 = int(d.lt.alloc_row[b].min())
        b1 = first_in(post_bw.get(name, []), max(b0, fend), hi) if name else -1
        if b1 < 0:
            held = b if b.size else v[d.lt.free_row[v] > fend]
            b1 = int(d.lt.free_row[held].min()) if held.size else -1
        if name is not None:
            mods = np.array([d.module_of(x) == name for x in ag.tolist()], bool)
            mine = ag[mods] if ag.size else ag
        else:  # unnamed (FSDP1): its unsharded flat parameter is the all-gather output itself
            mine = np.zeros(0, np.int64)
        fa = mine[d.phase[mine] == Phase.FORWARD] if mine.size else mine
        ba = mine[np.isin(d.phase[mine], BACKWARD_PHASES)] if mine.size else mine
        out.append(Unit(k, f0, f1, b0, b1, v, b, fa, ba))
    # a unit never gathered in backward (kept from forward) starts its backward when the unit
    # before it in backward order finished its own (its post-backward)
    ends = sorted(u.b1 for u in out if u.b1 >= 0)
    for u in out:
        if u.b0 < 0 <= u.b1:
            before = [e for e in ends if e < u.b1]
            u.b0 = before[-1] if before else it.backward_start
    return out, root


def detect_strategy(d: DeviceAnalysis, us: dict) -> str:
    """shard_grad_op when non-root units keep forward unshards alive into backward; no_shard
    at shard size 1 (replicate(): FsdpUnits.replicated)."""
    if d.fsdp.replicated:
        return NO_SHARD
    for it in d.tl.iterations:  # the first iteration with gathering units decides
        if any(u.fwd.size for u in us[it.index]):
            fend = forward_end(it)
            gathered = [u for u in us[it.index] if u.fwd.size]
            kept = sum(1 for u in gathered if (d.lt.free_row[u.fwd] > fend).all())
            return SHARD_GRAD_OP if kept > len(gathered) // 2 else FULL_SHARD
    return FULL_SHARD
