"""Parameters kept unsharded between micro-batches on purpose (gradient accumulation).

Signature (see `FsdpUnits.deferred`): unsharded parameters gathered in a non-final micro-batch's
backward outlive it and are freed by the end of the step's final micro-batch. That is
`set_reshard_after_backward(is_last_microbatch)`, the recipe the method's docstring gives: the
next micro-batch finds the units already unsharded and skips their all-gathers.

Verdict `expected`: the configuration trades this memory for fewer all-gathers. The finding
states both: the bytes kept (and the peak if every micro-batch resharded), and the all-gather
traffic saved per step. No fix is needed; the snippet shows how to reshard every micro-batch
when memory matters more than communication.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import by_module, counterfactual, human, max_alive, top_stacks
from snapforensics.analysis.fsdp.units import reshard_rows
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Verdict

FIX = """\
# only if memory matters more than all-gather traffic: reshard after every micro-batch
for mb, is_last in enumerate(is_last_flags):
    model.set_requires_gradient_sync(is_last)
    model.set_reshard_after_backward(True)  # instead of is_last"""


def check(d: DeviceAnalysis) -> list[Finding]:
    blocks = d.fsdp.deferred
    if not blocks.size:
        return []
    steps = {d.tl.iterations[int(i)].step for i in d.iteration[blocks]}
    kept = max_alive(d, blocks)
    free_row = d.lt.free_row.copy()
    free_row[blocks] = reshard_rows(d, blocks, per_micro_batch=True)
    after, replay = counterfactual(d, free_row)
    saving = max(d.peak_bytes - after["overall_bytes"], 0)
    per_step = int(d.lt.size[blocks].sum()) // max(len(steps), 1)
    micro = max(d.tl.iterations[int(i)].micro_batch for i in d.iteration[blocks]) + 2
    cause = (
        f"Up to {human(kept)} of unsharded parameters gathered in a non-final micro-batch's "
        f"backward were kept until the last micro-batch of their optimizer step resharded them "
        f"({len(blocks)} blocks over {len(steps)} step(s) of {micro} micro-batches): "
        "reshard_after_backward is False on non-final micro-batches, the gradient-accumulation "
        f"recipe. It buys fewer all-gathers: about {human(per_step)} of parameters per step are "
        "not gathered again by the next micro-batch. "
        + (f"Resharding every micro-batch would put the peak at {human(after['overall_bytes'])} "
           f"instead of {human(d.peak_bytes)}." if saving else
           f"Resharding every micro-batch would not lower the peak ({human(d.peak_bytes)}): "
           "the kept parameters are not where it is."))
    return [Finding(
        replay=replay,
        rule=RULE.id, verdict=Verdict.EXPECTED,
        title="Parameters kept unsharded between micro-batches (gradient accumulation)",
        cause=cause, bytes=kept, blocks=int(len(blocks)), members=blocks, device=d.device, fix=FIX,
        predicted_peak_bytes=after["overall_bytes"], saving_bytes=saving,
        evidence={
            "steps": sorted(steps),
            "all_gather_bytes_saved_per_step": per_step,
            "modules": by_module(d, blocks),
            "stacks": top_stacks(d, blocks, 1),
            "predicted_peaks": after,
            "iterations": sorted({int(i) for i in np.unique(d.iteration[blocks])}),
        },
    )]


RULE = Rule(
    id="fsdp.reshard_deferred_to_last_micro_batch", check=check, family=Family.FSDP_SHARDING,
    verdicts=frozenset({Verdict.EXPECTED}), fix=FIX)
