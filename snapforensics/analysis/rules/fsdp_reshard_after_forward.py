"""Parameters kept unsharded from forward to backward: `reshard_after_forward=False` (FSDP2) or
`ShardingStrategy.SHARD_GRAD_OP` (FSDP1).

Signature: a unit's unsharded parameters allocated during forward are still alive when forward
ends and are freed in that unit's post-backward, so the end of forward carries (almost) the whole
model unsharded in param_dtype. FSDP keeps the *root* unit unsharded after forward by design
(FSDP2 `reshard_after_forward=None` and FSDP1 FULL_SHARD both skip the root's post-forward
reshard, since backward starts with it), so the root is never counted: by name when the trace
carries FSDP2's ranges ("(root)"), else it is the first unit unsharded in forward that is still
unsharded when forward ends (the root's pre-forward runs first). Nor is the last unit to run
forward: its backward runs first, so keeping it is free (torchtitan does it on purpose).

Verdict `expected`: it is what the setting is designed to cost (it trades memory for one fewer
all-gather per unit in backward). The finding gives the cost and what `reshard_after_forward=True`
on non-root units would save, predicted by replaying the trace with each kept unit freed at its
post-forward and re-gathered for its backward: one unit ahead when the trace shows backward
prefetch (`FsdpUnits.backward_prefetch`: a unit gathered for backward on FSDP's prefetch path),
at its own pre-backward when it shows none (the backward order starts with the uncounted last
unit: the first kept unit is gathered during its backward, not beside it); when no unit was
gathered in backward at all (every unit kept, the usual case here) the headline assumes FSDP's
default (prefetch) and the evidence also gives the peak without it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human, peaks, seen_in, top_stacks
from snapforensics.analysis.fsdp.units import ROOT, forward_end
from snapforensics.analysis.phases import Iteration
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Category, Phase, Verdict

# A kept unit counts when it holds at least this share of the iteration's forward unshards
# (non-root): ignores a stray small module, not a real layer.
_MIN_SHARE = 0.02

FIX = """\
from torch.distributed.fsdp import fully_shard

# FSDP2: reshard every non-root unit after forward (the root stays unsharded by design)
for block in model.layers:
    fully_shard(block, reshard_after_forward=True)
fully_shard(model)  # root: reshard_after_forward=None keeps it unsharded for backward
# FSDP1: FullyShardedDataParallel(..., sharding_strategy=ShardingStrategy.FULL_SHARD)"""


# A unit's key: its FQN, else ("event", id) of its unshard event.
UnitKey = Union[str, tuple[str, int]]  # evaluated at run time: no `|` before Python 3.10


class Kept(NamedTuple):
    """One iteration's forward unshards kept unsharded into backward."""

    kept: dict[UnitKey, np.ndarray]  # non-root units still unsharded after forward: blocks
    units: dict[UnitKey, np.ndarray]  # every unit unsharded in forward, in forward order
    root: UnitKey | None
    last: np.ndarray  # the last unit's blocks still unsharded after forward (kept for free)


def _units(d: DeviceAnalysis, blocks: np.ndarray, ev: np.ndarray) -> dict[UnitKey, np.ndarray]:
    """unit key -> blocks (forward unshards of one iteration), in first-allocation order."""
    units: dict[UnitKey, list[int]] = {}
    for b in blocks[np.argsort(d.lt.alloc_row[blocks], kind="stable")].tolist():
        m = d.module_of(b)
        key: UnitKey = m if m is not None else ("event", int(ev[b]))
        units.setdefault(key, []).append(b)
    return {k: np.array(v, np.int64) for k, v in units.items()}


def _forward_unshards(d: DeviceAnalysis) -> dict[int, np.ndarray]:
    """iteration -> unsharded-param blocks allocated in its forward."""
    fw = np.flatnonzero(d.mask(Category.UNSHARDED_PARAM) & (d.phase == Phase.FORWARD) &
                        (d.iteration >= 0) & (d.lt.alloc_row >= 0))
    out: dict[int, list[int]] = {}
    for b, i in zip(fw.tolist(), d.iteration[fw].tolist()):
        out.setdefault(i, []).append(b)
    return {i: np.array(v, np.int64) for i, v in out.items()}


def _kept(d: DeviceAnalysis, it: Iteration, ev: np.ndarray, fw: np.ndarray | None) -> Kept:
    if fw is None or not fw.size or it.backward_start < 0:
        return Kept({}, {}, None, np.zeros(0, np.int64))
    units = _units(d, fw, ev)
    end = forward_end(it)
    alive_keys = [k for k, v in units.items() if (d.lt.free_row[v] > end).any()]
    root: UnitKey | None
    if ROOT in units:
        root = ROOT
    elif alive_keys and all(not isinstance(k, str) for k in units):
        root = alive_keys[0]  # unnamed units: the root's pre-forward unshards first
    else:
        root = None
    # The last unit to run forward runs backward first: resharding it would re-gather it at
    # once (torchtitan keeps the last block unsharded on purpose), so it is not counted either.
    last = alive_keys[-1] if alive_keys and list(units)[-1] == alive_keys[-1] else None
    total = sum(int(d.lt.size[v].sum()) for k, v in units.items() if k != root) or 1
    kept: dict[UnitKey, np.ndarray] = {}
    for k, v in units.items():
        if k == root or k == last:
            continue
        alive = v[d.lt.free_row[v] > end]
        if alive.size and d.lt.size[alive].sum() >= _MIN_SHARE * total:
            kept[k] = alive
    last_alive = units[last][d.lt.free_row[units[last]] > end] if last is not None else \
        np.zeros(0, np.int64)
    return Kept(kept, units, root, last_alive)


def _counterfactual(d: DeviceAnalysis, plans: dict[int, Kept], prefetch: bool
                    ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Free rows and extra (start, end, bytes) intervals of the trace replayed with each kept
    unit freed at its post-forward and re-gathered for its backward: while the unit before it
    (in backward order) runs its backward with `prefetch`, else when that unit's backward is
    done (its pre-backward)."""
    free_row = d.lt.free_row.copy()
    extra = []
    for i, (kept, units, _, last) in plans.items():
        it = d.tl.iterations[i]
        order = list(units)  # forward order
        end = forward_end(it)
        for k, blocks in kept.items():
            i = order.index(k)
            nxt = [int(d.lt.alloc_row[units[o]].min()) for o in order[i + 1:]]
            post_forward = min(nxt) if nxt else end
            post_forward = max(post_forward, int(d.lt.alloc_row[blocks].max()) + 1)
            free_row[blocks] = np.minimum(free_row[blocks], post_forward)
        # backward order: by when each unit's kept params were freed (its post-backward); the
        # last unit to run forward, kept unsharded as it is, runs backward first and is part of
        # that order (the unit after it is gathered during its backward, not beside it)
        alive = [(v, True) for v in kept.values()] + ([(last, False)] if last.size else [])
        alive.sort(key=lambda x: int(d.lt.free_row[x[0]].min()))
        need = [it.backward_start] + [int(d.lt.free_row[v].min()) for v, _ in alive[:-1]]
        for j, (v, counted) in enumerate(alive):
            if not counted:
                continue
            gather = need[max(j - 1, 0)] if prefetch else need[j]
            for b in v.tolist():
                fr = int(d.lt.free_row[b])
                if fr > gather:
                    extra.append((gather, fr, int(d.lt.size[b])))
    return free_row, extra


def check(d: DeviceAnalysis) -> list[Finding]:
    f = d.fsdp
    per_iter: dict[int, Kept] = {}  # iteration -> what it kept (its replay plan)
    fw = _forward_unshards(d)
    for it in d.tl.iterations:
        k = _kept(d, it, f.event, fw.get(it.index))
        if k.kept:
            per_iter[it.index] = k
    if not per_iter:
        return []
    worst = max(per_iter, key=lambda i: sum(int(d.lt.size[v].sum())
                                            for v in per_iter[i].kept.values()))
    kept, _, root, _ = per_iter[worst]
    blocks = np.concatenate(list(kept.values()))
    kept_bytes = int(d.lt.size[blocks].sum())
    if d.fsdp.replicated:
        return [_replicated(d, per_iter, worst, blocks)]
    if d.fsdp.post_forward_shards[blocks].all():
        return [_resharded_to_fewer(d, per_iter, worst, blocks)]
    # FSDP's backward prefetch as the trace shows it; when no unit was gathered in backward
    # (all kept) the trace cannot tell: the headline assumes prefetch (FSDP2 always prefetches,
    # FSDP1 defaults to BACKWARD_PRE) and the evidence gives the peak without it too
    seen = d.fsdp.backward_prefetch
    free_row, extra = _counterfactual(d, per_iter, seen is not False)
    after = peaks(d, d.lt.replay(free_row=free_row, extra=extra))
    no_pf = after if seen is False else peaks(
        d, d.lt.replay(free_row=free_row, extra=_counterfactual(d, per_iter, False)[1]))
    before = d.peak_bytes
    named = [k for k in kept if isinstance(k, str)]
    mods: list[dict[str, Any]] = [
        {"module": k if isinstance(k, str) else f"(unit {n})",
         "bytes": int(d.lt.size[v].sum()), "blocks": int(len(v))}
        for n, (k, v) in enumerate(kept.items())]
    mods.sort(key=lambda r: -r["bytes"])
    it = d.tl.iterations[worst]
    share = kept_bytes / before if before else 0.0
    root_txt = ("the root unit" if root == ROOT else
                "the first unit unsharded in forward and kept (taken as the root)"
                if root is not None else "no unit named as the root")
    cause = (
        f"{len(kept)} FSDP unit(s) kept their parameters unsharded from forward to backward: "
        f"{human(kept_bytes)} in {len(blocks)} blocks was still unsharded when forward ended "
        f"({seen_in(d, per_iter, worst)}: {share:.0%} of the peak), each freed only in its unit's "
        "post-backward. That is reshard_after_forward=False (FSDP2) or "
        "ShardingStrategy.SHARD_GRAD_OP (FSDP1): it saves one all-gather per unit in backward "
        f"at the cost of holding the model unsharded across the forward/backward boundary. "
        f"Not counted: {root_txt}, which FSDP keeps unsharded after forward by design, and the "
        "last unit to run forward (its backward runs first, keeping it costs nothing). "
        f"With reshard_after_forward=True on the non-root units the peak is predicted at "
        f"{human(after['overall_bytes'])} instead of {human(before)}"
        + (" (with backward prefetch, as this run shows it)." if seen else
           " (no backward prefetch, as this run shows it)." if seen is False else
           f" with FSDP's default backward prefetch, {human(no_pf['overall_bytes'])} without "
           "it (no unit was gathered in backward here, so the trace cannot tell which)."))
    return [Finding(
        rule=RULE.id, verdict=Verdict.EXPECTED,
        title="Parameters kept unsharded from forward to backward (reshard_after_forward=False "
              "/ SHARD_GRAD_OP)",
        cause=cause, bytes=kept_bytes, blocks=int(len(blocks)), device=d.device, fix=FIX,
        members=blocks,
        predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=max(before - after["overall_bytes"], 0),
        evidence={
            "iteration": worst,
            "forward_end_row": forward_end(it),
            "units_kept": len(kept),
            "named_units": len(named),
            "per_iteration_bytes": {str(i): int(sum(int(d.lt.size[v].sum())
                                                    for v in p.kept.values()))
                                    for i, p in sorted(per_iter.items())},
            "modules": mods[:12],
            "stacks": top_stacks(d, blocks, 1),
            "predicted_peaks": after,
            "backward_prefetch": {True: "seen", False: "off", None: "unknown"}[seen],
            "predicted_peaks_without_backward_prefetch": no_pf,
        },
    )]


def _replicated(d: DeviceAnalysis, per_iter: dict[int, Kept], worst: int,
                blocks: np.ndarray) -> Finding:
    """At shard size 1 (`FsdpUnits.replicated`: replicate(), torchtitan's DDP) the kept copies
    are what replicate costs: it has no reshard_after_forward to set (FSDPModule.
    set_reshard_after_forward asserts a sharding mesh: fsdp/_fully_shard/_fully_shard.py), so
    no fix is given and no peak predicted."""
    kept_bytes = int(d.lt.size[blocks].sum())
    share = kept_bytes / d.peak_bytes if d.peak_bytes else 0.0
    cause = (
        f"Every parameter is whole on each rank (shard size 1: replicate(), FSDP2's machinery "
        f"over a replicate-only mesh, as torchtitan's DDP applies it, or fully_shard over a mesh "
        f"whose shard dimension has one rank), yet each unit copies its "
        f"parameters into an unsharded buffer at its pre-forward (FSDPParamGroup."
        f"wait_for_unshard) and frees the copy only in its post-backward: {human(kept_bytes)} in "
        f"{len(blocks)} blocks was still copied when forward ended ({seen_in(d, per_iter, worst)}"
        f": {share:.0%} of the peak; not counted: the root and the last unit to run forward). "
        "This is how replicate() runs, not a setting: it has no reshard_after_forward "
        "(set_reshard_after_forward asserts a sharding mesh; under fully_shard at shard size 1 "
        "it would free the copies after forward). DistributedDataParallel computes "
        "on the parameters themselves (its buckets hold a gradient copy instead); fully_shard "
        "over the same ranks shards the parameters and frees them after forward.")
    return Finding(
        rule=RULE.id, verdict=Verdict.EXPECTED,
        title="Parameters copied whole from forward to backward (replicate(): FSDP2 at shard "
              "size 1)",
        cause=cause, bytes=kept_bytes, blocks=int(len(blocks)), device=d.device, members=blocks,
        evidence={"iteration": worst, "replicated": True, "units_kept": len(per_iter[worst].kept),
                  "stacks": top_stacks(d, blocks, 1)})


def _resharded_to_fewer(d: DeviceAnalysis, per_iter: dict[int, Kept], worst: int,
                        blocks: np.ndarray) -> Finding:
    """reshard_after_forward=N (an int): each unit keeps a 1/N post-forward shard from its
    post-forward to its backward (`FsdpUnits.post_forward_shards`), where True keeps nothing
    and False the whole unit. Its backward gathers the unit either way (over N ranks instead of
    W), so the fix's peak is the trace with every post-forward shard dropped; the gathers stay
    where they ran."""
    kept_bytes = int(d.lt.size[blocks].sum())
    shards = np.flatnonzero(d.fsdp.post_forward_shards)
    free_row = d.lt.free_row.copy()
    free_row[shards] = d.lt.alloc_row[shards]
    after = peaks(d, d.lt.replay(free_row=free_row))
    before = d.peak_bytes
    share = kept_bytes / before if before else 0.0
    cause = (
        f"{len(per_iter[worst].kept)} FSDP unit(s) kept a slice of their parameters from forward "
        f"to backward: {human(kept_bytes)} in {len(blocks)} blocks cloned at each unit's "
        f"post-forward (FSDPParam.to_sharded_post_forward) was alive when forward ended "
        f"({seen_in(d, per_iter, worst)}: {share:.0%} of the peak). That is "
        "reshard_after_forward=N, an int: parameters resharded to N ranks after forward, not "
        "the W they are sharded over, so backward gathers over N ranks (within a node) at the "
        "cost of holding 1/N of each unit instead of 1/W across the forward/backward boundary. "
        f"With reshard_after_forward=True the peak is predicted at "
        f"{human(after['overall_bytes'])} instead of {human(before)} (backward gathers each "
        "unit either way; their all-gathers then span all W ranks).")
    return Finding(
        rule=RULE.id, verdict=Verdict.EXPECTED,
        title="Parameters kept partly sharded from forward to backward (reshard_after_forward=N)",
        cause=cause, bytes=kept_bytes, blocks=int(len(blocks)), device=d.device, fix=FIX,
        members=blocks, predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=max(before - after["overall_bytes"], 0),
        evidence={"iteration": worst, "post_forward_shards": True,
                  "units_kept": len(per_iter[worst].kept), "predicted_peaks": after,
                  "stacks": top_stacks(d, blocks, 1)})


RULE = Rule(
    id="fsdp.reshard_after_forward_disabled", check=check, family=Family.FSDP_CONFIGURATION,
    verdicts=frozenset({Verdict.EXPECTED}), fix=FIX)
