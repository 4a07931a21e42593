"""FSDP parameters unsharded in backward (or recompute) and never resharded: the seed bug.

With `reshard_after_backward=False` (or a recompute path that unshards with no matching
reshard), every unit's parameters gathered during backward stay allocated after its backward
ends, so live bytes climb one layer at a time and backward peaks far above forward.

Parameters kept between the micro-batches of one optimizer step and resharded by the last one
(`set_reshard_after_backward(is_last_microbatch)`) are not this bug: see
`fsdp.reshard_deferred_to_last_micro_batch`. Verdict `anomalous` when resharding at each unit's
post-backward (in the step's final micro-batch) lowers the peak (`evidence.lowers_peak`), else
`info`: the parameters outlive their backward but not where the peak is.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import (
    by_module,
    by_path,
    counterfactual,
    human,
    lowers_peak,
    max_alive,
    seen_in,
    top_stacks,
)
from snapforensics.analysis.fsdp.units import reshard_rows
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Verdict

FIX = """\
from torch.distributed.fsdp import FSDPModule

# after fully_shard(...) on each block (and on the root):
for module in model.modules():
    if isinstance(module, FSDPModule):
        module.set_reshard_after_backward(True)
# with gradient accumulation, keep False only on non-final micro-batches:
#   model.set_reshard_after_backward(is_last_microbatch)"""


MIN_SHARE = 0.01  # of the peak: below it the leftover is noise, not a finding


def check(d: DeviceAnalysis) -> list[Finding]:
    blocks = d.fsdp.leaked
    if not blocks.size:
        return []
    # Most bytes left unsharded at once in each backward; report the worst iteration.
    per_iter = {int(i): max_alive(d, blocks[d.iteration[blocks] == i])
                for i in np.unique(d.iteration[blocks])}
    worst = max(per_iter, key=per_iter.__getitem__)
    if per_iter[worst] < MIN_SHARE * d.peak_bytes:
        return []
    worst_blocks = blocks[d.iteration[blocks] == worst]
    free_row = d.lt.free_row.copy()
    free_row[blocks] = reshard_rows(d, blocks)
    after, replay = counterfactual(d, free_row)
    saving = d.peak_bytes - after["overall_bytes"]
    at_peak = lowers_peak(d, saving)
    paths = by_path(d, worst_blocks)
    n_mod = len({d.module_of(b) for b in worst_blocks.tolist()})
    it = d.tl.iterations[worst]
    where = seen_in(d, per_iter, worst) + ("" if it.step == worst else
        f"; iteration {worst} is micro-batch {it.micro_batch} of optimizer step {it.step}")
    via = ", ".join(f"{p} ({human(v)})" for p, v in sorted(paths.items(), key=lambda x: -x[1]))
    effect = (f"Resharding each unit at its post-backward puts the peak at "
              f"{human(after['overall_bytes'])} instead of {human(d.peak_bytes)}."
              if at_peak else
              f"They are not what sets the peak ({human(d.peak_bytes)}): resharding them would "
              f"leave it at {human(after['overall_bytes'])}.")
    cause = (
        f"FSDP parameters all-gathered during backward were never resharded: "
        f"up to {human(per_iter[worst])} from {len(worst_blocks)} blocks across {n_mod} unit(s) "
        f"stayed unsharded past their unit's backward ({where}), unsharded via {via}. "
        "Each unit's post-backward skipped its reshard (reshard_after_backward=False, or a "
        "fully_shard unit nested in a checkpointed region re-unsharded by the recompute's "
        "pre-forward / pre-backward hooks), so parameter memory climbs layer by layer through "
        "backward instead of staying at one or two layers. " + effect)
    return [Finding(
        replay=replay,
        rule=RULE.id, verdict=Verdict.ANOMALOUS if at_peak else Verdict.INFO,
        title="Parameters unsharded in backward/recompute are not resharded",
        cause=cause, bytes=per_iter[worst], blocks=int(len(worst_blocks)), device=d.device,
        members=worst_blocks,
        fix=FIX, predicted_peak_bytes=after["overall_bytes"], saving_bytes=max(saving, 0),
        evidence={
            "iteration": worst,
            "optimizer_step": it.step,
            "micro_batch": it.micro_batch,
            "per_iteration_bytes": {str(k): v for k, v in sorted(per_iter.items())},
            "by_path": paths,
            "modules": by_module(d, worst_blocks),
            "stacks": top_stacks(d, worst_blocks),
            "predicted_peaks": after,
        },
    )]


RULE = Rule(
    id="fsdp.unsharded_params_not_resharded", check=check, family=Family.FSDP_SHARDING,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX)
