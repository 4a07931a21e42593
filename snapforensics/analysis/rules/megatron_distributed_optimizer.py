"""Megatron-Core without its distributed optimizer: every data-parallel rank keeps the whole fp32
optimizer.

Megatron's mixed-precision optimizer keeps fp32 main copies of the bf16/fp16 parameters and the
inner optimizer's states of them (Adam: exp_avg and exp_avg_sq, fp32). The non-distributed one
(`Float16OptimizerWithFloat16Params`, `optimizer/optimizer.py`: its `__init__` clones every
parameter to fp32) keeps all of them on every data-parallel rank; the distributed optimizer
(`DistributedOptimizer`, `optimizer/distrib_optimizer.py`) gives each rank the shard of the
buffers' range it owns (`_build_model_and_main_param_groups`), so main parameters and states are
1/dp of the model per rank, the gradients reduce-scattered into the same contiguous grad buffer
and the updated parameters all-gathered back into the param buffer the parameters are views of
(no extra copy: the bf16 parameters move into it). Nothing else changes size.

The threshold is the mechanism: the shards hold the same values, so any byte the replay takes
off is a saving; anomalous when the data-parallel degree (the recorder's process groups, else
the world size) is above 1 and the replay lowers the peak, info when the degree is 1 or unknown.
The replay makes every main-parameter block of the non-distributed optimizer and every
optimizer-state block 1/dp of its size (the inner optimizer's step works on the shard too).
The real shards are not exactly 1/dp (Megatron pads each bucket to a multiple of the
data-parallel size; on TP 2 x DP 2 the running optimizers' shards x dp were 1,344 B short of the
whole, of 2.2 MB): within the 5% the twins are checked at (measured -0.12% there).
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.classify import megatron_rel
from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding, Replay
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import CAT_CODE, Category, Verdict

FIX = """\
# Megatron-LM: add --use-distributed-optimizer to the training arguments
# Megatron-Core: the distributed optimizer in both configs
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                           use_distributed_optimizer=True)
model = DistributedDataParallel(config, ddp_config, model)
optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", bf16=True,
                                                   use_distributed_optimizer=True), [model])
# NeMo 2: MegatronOptimizerModule(config=OptimizerConfig(..., use_distributed_optimizer=True))
"""


def fix_for(d: DeviceAnalysis, evidence: dict) -> str:
    return FIX


def _whole_main_params(d: DeviceAnalysis) -> np.ndarray:
    """Blocks of the non-distributed optimizer's fp32 main parameters (made in its __init__)."""
    main = np.flatnonzero(d.category == CAT_CODE[Category.MEGATRON_MAIN_PARAM])
    if not len(main):
        return main
    stacks = np.unique(d.lt.stack[main])
    whole = {int(s) for s in stacks.tolist() if s >= 0 and _made_whole(d.snapshot.stack_frames(s))}
    return main[np.isin(d.lt.stack[main], np.fromiter(whole, np.int64, len(whole)))]


def _made_whole(frames) -> bool:
    """Made by the non-distributed optimizer's __init__: its innermost Megatron frame is
    `optimizer/optimizer.py` `__init__` and no `DistributedOptimizer` is on the stack (whose
    __init__ runs the base class's too, for a few bytes of flags)."""
    rels = [(f.name, r) for f in frames if (r := megatron_rel(f.filename)) is not None]
    return bool(rels) and rels[0] == ("__init__", "optimizer/optimizer.py") and not any(
        r == "optimizer/distrib_optimizer.py" for _, r in rels)


def check(d: DeviceAnalysis) -> list[Finding]:
    lt = d.lt
    if d.peak_row < 0:
        return []
    main = _whole_main_params(d)
    if not len(main):
        return []  # the distributed optimizer, or no Megatron optimizer in this file
    states = np.flatnonzero(d.category == CAT_CODE[Category.OPTIMIZER_STATE])
    shrink = np.union1d(main, states)
    alive = lt.alive_at(d.peak_row)
    held = shrink[alive[shrink]]
    held_bytes = int(lt.size[held].sum())
    m = d.layout
    dp = m.degree("dp")
    evidence = {"main_param_bytes_at_peak": int(lt.size[main[alive[main]]].sum()),
                "optimizer_state_bytes_at_peak": int(lt.size[states[alive[states]]].sum()),
                "dp": dp, "dp_from": m.source("dp"),
                "stacks": top_stacks(d, main, 1)}
    title = "Megatron's optimizer is not distributed: every data-parallel rank holds all of it"
    cause = (f"Megatron's non-distributed mixed-precision optimizer keeps fp32 main copies of "
             f"every parameter and the optimizer's states of them on each rank: "
             f"{human(held_bytes)} alive at the peak.")
    base = dict(rule=RULE.id, title=title, bytes=held_bytes, blocks=len(held), device=d.device,
                evidence=evidence, members=held)
    if type(dp) is not int or dp <= 1:
        why = "unknown" if dp is None else "1"
        return [Finding(verdict=Verdict.INFO, cause=cause + f" The data-parallel degree is "
                        f"{why} here: the distributed optimizer would shard them over it.",
                        **base)]
    size = lt.size[shrink]
    extra = tuple(zip(lt.alloc_row[shrink].tolist(), lt.free_row[shrink].tolist(),
                      (-(size - -(-size // dp))).tolist()))
    predicted = max(int(lt.replay(extra=extra).max()), lt.baseline)
    saving = d.peak_bytes - predicted
    cause += (f" The distributed optimizer (--use-distributed-optimizer) shards them over the "
              f"{dp} data-parallel ranks ({m.source('dp')}): each keeps 1/{dp}, the gradients "
              f"reduce-scattered and the parameters all-gathered through the same buffers.")
    return [Finding.replayed(saving > 0, cause=cause, fix=FIX, predicted=predicted,
                             saving=saving, replay=Replay(extra=extra), **base)]


RULE = Rule(
    id="megatron.distributed_optimizer_off", check=check, family=Family.PARALLELISM,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=fix_for)
