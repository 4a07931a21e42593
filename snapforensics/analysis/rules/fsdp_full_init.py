"""The full model materialized on the device before sharding.

Signature: before the first forward, memory peaks far above the sharded parameters the run
carries into training, and what makes the difference is freed before training starts: full-size
parameters built by the module's `__init__` / `reset_parameters` / `Module.to` / `_apply`, FSDP1
`_materialize_module` / `_move_module_to_device` / `flatten_tensors`, FSDP2
`_move_states_to_device`. It fires when those transient bytes at the init peak reach half of the
full model (`world_size` x the sharded parameters; world size from the recorder, else the
reduce-scatter input/output ratio): a full model on every rank. Only on traces with FSDP blocks
and a known world size above one: the world size is never assumed. Materializing one unit at a
time (FSDP1 with meta-device modules, a per-layer `param_init_fn`) stays far below.

Verdict `anomalous`: meta-device init + `to_empty` + `reset_parameters` removes it. The full
model scales with the world size while the training peak does not, so at small world sizes it may
not be the overall peak yet; the predicted init peak is in the evidence either way.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human, peaks, top_stacks
from snapforensics.analysis.vocab import CAT_CODE, FSDP_CATEGORIES, Category, Verdict

RULE = "fsdp.full_model_materialized_at_init"
_SHARE_OF_FULL_MODEL = 0.5

FIX = """\
# Build on the meta device, shard, then allocate only the local shards:
with torch.device("meta"):
    model = Transformer(...)
for block in model.layers:
    fully_shard(block)
fully_shard(model)
model.to_empty(device="cuda")
for m in model.modules():
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
# FSDP1: construct under torch.device("meta") and pass
#   FullyShardedDataParallel(model, device_id=..., param_init_fn=...)  (materialized per unit)
# Loading a checkpoint: torch.distributed.checkpoint / set_model_state_dict on the sharded model."""


def check(d: DeviceAnalysis) -> list[Finding]:
    if not d.tl.iterations or d.lt.rows == 0:
        return []
    start = d.tl.iterations[0].start
    if start <= 0:
        return []  # recording began in training: no init to judge
    if not d.mask(*FSDP_CATEGORIES).any():
        return []  # no FSDP: nothing was sharded
    world = d.fsdp.world.size
    if world is None or world <= 1:
        return []  # unknown or single-rank: no shard size to compare the init peak with
    live = d.lt.live
    peak_row = int(np.argmax(live[:start]))
    init_peak = int(live[peak_row])
    lt = d.lt
    carried = (lt.alloc_row < start) & (lt.free_row >= start)
    params = d.mask(Category.PARAMETER, Category.SHARDED_PARAM)
    sharded = int(lt.size[carried & params].sum())
    if sharded <= 0:
        return []
    at_peak = lt.alive_at(peak_row)
    transient_mask = at_peak & (lt.free_row < start) & (lt.alloc_row >= 0)
    transient = int(lt.size[transient_mask].sum())
    full_model = world * sharded
    if transient < _SHARE_OF_FULL_MODEL * full_model:
        return []
    param_like = int(lt.size[transient_mask & d.mask(Category.PARAMETER)].sum())
    if param_like < 0.5 * transient:
        return []  # init-time buffers of some other kind, not parameters
    # Counterfactual: meta-device init, no full-size parameters ever allocated.
    removed = (lt.alloc_row >= 0) & (lt.alloc_row < start) & (lt.free_row < start) & \
        (d.category == CAT_CODE[Category.PARAMETER])
    free_row = lt.free_row.copy()
    free_row[removed] = lt.alloc_row[removed]
    new_live = d.lt.replay(free_row=free_row)
    after = peaks(d, new_live)
    new_init = int(new_live[:start].max())
    blocks = np.flatnonzero(transient_mask)
    training_peak = int(live[start:].max()) if start < lt.rows else 0
    cause = (
        f"Before the first forward, memory peaked at {human(init_peak)} while the run carries "
        f"only {human(sharded)} of sharded parameters into training: {human(transient)} in "
        f"{len(blocks)} blocks alive at that moment was freed before training began, "
        f"{transient / full_model:.0%} of the full model ({human(full_model)} = "
        f"{world} x the shards). The full model was built on the device and only then "
        "sharded. It grows with the world size while the training peak does not: here the init "
        f"peak is {init_peak / max(training_peak, 1):.0%} of the training peak "
        f"({human(training_peak)}). With meta-device init the init peak is predicted at "
        f"{human(new_init)}.")
    return [Finding(
        rule=RULE, verdict=Verdict.ANOMALOUS,
        title="Full model materialized on the device before sharding",
        cause=cause, bytes=transient, blocks=int(len(blocks)), device=d.device, fix=FIX,
        predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=max(d.peak_bytes - after["overall_bytes"], 0),
        evidence={
            "init_peak_bytes": init_peak,
            "init_peak_row": peak_row,
            "predicted_init_peak_bytes": new_init,
            "init_saving_bytes": init_peak - new_init,
            "sharded_param_bytes": sharded,
            "full_model_bytes": full_model,
            "world_size": world,
            "world_size_estimated": d.fsdp.world.estimated,
            "training_peak_bytes": training_peak,
            "stacks": top_stacks(d, blocks, 1),
            "predicted_peaks": after,
        },
    )]
