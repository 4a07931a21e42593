"""All-gathers issued during backward that nothing used: forward prefetch inside the recompute,
or a mistargeted backward prefetch.

Signature (see `FsdpUnits.stale`): a unit's all-gather output (FSDP1: its unsharded
flat parameter) allocated during backward or recompute that no copy-out of that unit consumed and
that stays alive until FSDP finalizes backward (`finalize_backward` / FSDP1
`_catch_all_reshard`), i.e. freed after the backward's last reduce-scatter. Typical cause: a
`fully_shard` unit inside a checkpointed region runs its full pre-forward in the recompute and
its `set_modules_to_forward_prefetch` list all-gathers units whose backward already ran (or will
be gathered again by their own pre-backward), one buffer per layer accumulating through backward.

Verdict `anomalous` when dropping them lowers the peak (`evidence.lowers_peak`), else `info`
(each is still one wasted all-gather). Predicted peak: the trace replayed without them.
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
    per_iteration,
    seen_in,
    top_stacks,
)
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Verdict

FIX = """\
# Prefetch lists only between units at the same level (whole blocks), never from a unit nested
# inside a checkpointed block: the recompute re-runs its pre-forward and prefetches again.
for i, block in enumerate(blocks):
    block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])   # not attn/mlp inside blocks
    block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])
# Better: fully_shard the checkpointed block itself (AC inside, FSDP outside, torchtitan order):
#   block = checkpoint_wrapper(block); fully_shard(block)
# and use a torch with pytorch PR 164009 (recompute does not re-run FSDP's forward logic)."""


def check(d: DeviceAnalysis) -> list[Finding]:
    mask = d.fsdp.stale.copy()
    if mask.any():
        # FSDP1 flat parameters left for the final callback are also unsharded params the seed
        # rule (fsdp.unsharded_params_not_resharded) reports: one finding per block.
        mask[d.fsdp.leaked] = False
    stale = np.flatnonzero(mask)
    if not stale.size:
        return []
    per_iter = per_iteration(d, stale)
    worst = max(per_iter, key=per_iter.__getitem__)
    blocks = stale[d.iteration[stale] == worst]
    # Alive together at worst (they accumulate): the most bytes alive at once in that iteration.
    at_once = max_alive(d, blocks)
    free_row = d.lt.free_row.copy()
    free_row[stale] = d.lt.alloc_row[stale]  # never allocated
    after, replay = counterfactual(d, free_row)
    paths = by_path(d, blocks)
    at_peak = lowers_peak(d, d.peak_bytes - after["overall_bytes"])
    via = ", ".join(f"{p} ({human(v)})" for p, v in sorted(paths.items(), key=lambda x: -x[1]))
    cause = (
        f"{len(blocks)} all-gather(s) issued during backward "
        f"({seen_in(d, per_iter, worst)}) were never "
        f"used by their unit and were released only when FSDP finalized backward: "
        f"{human(per_iter[worst])} in total, up to {human(at_once)} alive at once, made via "
        f"{via}. A unit's forward prefetch fired inside the recompute (a fully_shard unit nested "
        "in a checkpointed region runs its whole pre-forward again there) or a backward prefetch "
        "targeted a unit that did not run next, so each such buffer sits until the end of "
        "backward and they pile up layer by layer. "
        + (f"Without them the peak is {human(after['overall_bytes'])} instead of "
           f"{human(d.peak_bytes)}." if at_peak else
           f"They are not what sets the peak ({human(d.peak_bytes)}): without them it would be "
           f"{human(after['overall_bytes'])}; they still cost one wasted all-gather each."))
    return [Finding(
        replay=replay,
        rule=RULE.id, verdict=Verdict.ANOMALOUS if at_peak else Verdict.INFO,
        title="Unused all-gather buffers from prefetch during backward, freed only at the end",
        cause=cause, bytes=per_iter[worst], blocks=int(len(blocks)), device=d.device, fix=FIX,
        members=blocks,
        predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=max(d.peak_bytes - after["overall_bytes"], 0),
        evidence={
            "iteration": worst,
            "max_alive_bytes": at_once,
            "per_iteration_bytes": {str(k): v for k, v in sorted(per_iter.items())},
            "by_path": paths,
            "modules": by_module(d, blocks),
            "stacks": top_stacks(d, blocks, 1),
            "predicted_peaks": after,
        },
    )]


RULE = Rule(
    id="fsdp.stale_prefetch_all_gather", check=check, family=Family.FSDP_CONFIGURATION,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX)
