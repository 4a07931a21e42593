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

Verdict `anomalous` when the start-up peak is the run's peak (meta-device init + `to_empty` +
`reset_parameters` then lowers it), else `info`. The full model is the same at every world size
while the sharded part of the training peak (sharded parameters, gradients, optimizer state)
falls as 1/world_size: the finding gives the world size at which the start-up peak would take
over, `T = U + S * W / W'` solved for `W'` with `U` the training peak's unsharded part and `S`
its sharded part at world size `W`.
"""

from __future__ import annotations

import re

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human, lowers_peak, peaks, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import CAT_CODE, FSDP_CATEGORIES, Category, Verdict

_SHARE_OF_FULL_MODEL = 0.5

def fix_for(d: DeviceAnalysis, evidence: dict) -> str:
    """Meta-device init for this run's device and (when units are named) its block container."""
    container = _container(d)
    return f"""\
import torch
from torch.distributed.fsdp import fully_shard

# Build on the meta device, shard, then allocate only the local shards:
with torch.device("meta"):
    model = build_model()  # your model's constructor
for block in model.{container}:
    fully_shard(block)
fully_shard(model)
model.to_empty(device="{d.snapshot.kind.device_name}")
for m in model.modules():
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
# FSDP1: construct under torch.device("meta") and pass
#   FullyShardedDataParallel(model, device_id=..., param_init_fn=...)  (materialized per unit)
# Loading a checkpoint: torch.distributed.checkpoint / set_model_state_dict on the sharded model"""


def _container(d: DeviceAnalysis) -> str:
    """The attribute holding the repeated blocks, from unit names like "layers.3" ("layers")."""
    units = {i.module for i in d.infos if i.module}
    names = {m.rsplit(".", 1)[0] for m in units if re.fullmatch(r".+\.\d+", m)}
    names = {n for n in names if re.fullmatch(r"[A-Za-z_][\w.]*", n)}
    return min(names, key=lambda n: (n.count("."), n)) if names else "layers"



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
    takeover = _takeover_world(d, start, init_peak, world)
    starts_at_peak = init_peak >= training_peak and \
        lowers_peak(d, d.peak_bytes - after["overall_bytes"])
    if starts_at_peak:
        effect = (f"It is this run's peak ({human(init_peak)}, training peaks at "
                  f"{human(training_peak)}).")
    else:
        effect = (f"Here it is {init_peak / max(training_peak, 1):.0%} of the training peak "
                  f"({human(training_peak)}), so it does not set the run's peak yet; "
                  + (f"with the same per-rank batch it would from about {takeover[0]} ranks."
                     if takeover[0] else
                     f"the training peak's part that does not shrink with more ranks "
                     f"({human(takeover[1])}: activations, gathered units, communication "
                     "buffers) stays above it at any world size."))
    cause = (
        f"Before the first forward, memory peaked at {human(init_peak)} while the run carries "
        f"only {human(sharded)} of sharded parameters into training: {human(transient)} in "
        f"{len(blocks)} blocks alive at that moment was freed before training began, "
        f"{transient / full_model:.0%} of the full model ({human(full_model)} = "
        f"{world} x the shards). The full model was built on the device and only then "
        "sharded. Its size does not shrink with more ranks while the sharded part of the "
        f"training peak falls as 1/world size. {effect} With meta-device init the start-up "
        f"peak is predicted at {human(new_init)}.")
    evidence = {
        "init_peak_bytes": init_peak,
        "init_peak_row": peak_row,
        "predicted_init_peak_bytes": new_init,
        "init_saving_bytes": init_peak - new_init,
        "sharded_param_bytes": sharded,
        "full_model_bytes": full_model,
        "world_size": world,
        "world_size_estimated": d.fsdp.world.estimated,
        "training_peak_bytes": training_peak,
        "becomes_peak_at_world_size": takeover[0],
        "stacks": top_stacks(d, blocks, 1),
        "predicted_peaks": after,
    }
    return [Finding(
        rule=RULE.id, verdict=Verdict.ANOMALOUS if starts_at_peak else Verdict.INFO,
        title="Full model materialized on the device before sharding",
        cause=cause, bytes=transient, blocks=int(len(blocks)), members=blocks, device=d.device,
        fix=fix_for(d, evidence), predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=max(d.peak_bytes - after["overall_bytes"], 0), evidence=evidence,
    )]


_SHARDED_STATE = (Category.SHARDED_PARAM, Category.SHARDED_GRAD, Category.OPTIMIZER_STATE)


def _takeover_world(d: DeviceAnalysis, start: int, init_peak: int, world: int
                    ) -> tuple[int | None, int]:
    """The smallest world size at which the start-up peak would reach the training peak, if
    only the training peak's sharded part shrinks (as 1/world size), None if it never would;
    and the training peak's unsharded part."""
    row = start + int(np.argmax(d.lt.live[start:]))
    alive = d.lt.alive_at(row)
    training = int(d.lt.live[row])
    sharded = int(d.lt.size[alive & d.mask(*_SHARDED_STATE)].sum())
    rest = training - sharded
    if init_peak <= rest or sharded <= 0:
        return None, rest
    return max(int(np.ceil(sharded * world / (init_peak - rest))), world), rest


RULE = Rule(
    id="fsdp.full_model_materialized_at_init", check=check, family=Family.FSDP_CONFIGURATION,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=fix_for)
