"""Sharded gradients growing through backward: what FSDP is designed to cost (expected)."""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import by_module, human, per_iteration, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import BACKWARD_PHASES, Category, Verdict


def check(d: DeviceAnalysis) -> list[Finding]:
    idx = np.flatnonzero(d.mask(Category.SHARDED_GRAD) & np.isin(d.phase, BACKWARD_PHASES))
    if not idx.size:
        return []
    per_iter = per_iteration(d, idx)
    worst = max(per_iter, key=per_iter.__getitem__)
    blocks = idx[d.iteration[idx] == worst]
    n_mod = len({d.module_of(b) for b in blocks.tolist()})
    grows = (f"{human(per_iter[worst])} in {len(blocks)} blocks over {n_mod} unit(s) grows layer "
             "by layer through backward.")
    if d.fsdp.replicated:  # replicate(), NO_SHARD: all-reduced, whole (FsdpUnits.replicated)
        title = "Gradients (all-reduced, whole) accumulate through backward"
        cause = ("Each unit's gradient is all-reduced after its backward (FSDP at shard size "
                 "1: replicate() or NO_SHARD, nothing sharded) and kept as param.grad until the "
                 f"optimizer step: {grows} This is what gradients cost; it is not a leak.")
    else:
        title = "Reduce-scatter outputs (sharded gradients) accumulate through backward"
        cause = ("Each unit's gradient is reduce-scattered after its backward and the "
                 "1/world_size output is kept as the sharded param.grad until the optimizer "
                 f"step: {grows} This is what sharded gradients cost; it is not a leak.")
    return [Finding(
        rule=RULE.id, verdict=Verdict.EXPECTED, title=title, cause=cause,
        bytes=per_iter[worst], blocks=int(len(blocks)), members=blocks, device=d.device,
        evidence={"iteration": worst, "modules": by_module(d, blocks),
                  "stacks": top_stacks(d, blocks, 1)},
    )]


RULE = Rule(
    id="fsdp.reduce_scatter_accumulation", check=check, family=Family.FSDP_SHARDING,
    verdicts=frozenset({Verdict.EXPECTED}), fix=None)
