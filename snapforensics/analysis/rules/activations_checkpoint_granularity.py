"""Activation checkpointing finer than the FSDP unit: several checkpoint regions (or the same
layer recomputed twice) inside one unit's backward.

Where it comes from. `checkpoint_wrapper` applied to each sub-module of a layer (attention, MLP)
while `fully_shard` / FSDP wraps the whole layer; accelerate's FSDP2 plugin with
`activation_checkpointing=True` does this whenever its auto-wrap policy matches modules below the
layer: accelerate 1.15's `fsdp2_apply_ac` (utils/fsdp_utils.py) walks the model bottom-up
(`get_module_children_bottom_up`) and wraps every module the policy accepts in its own
`checkpoint_wrapper(..., preserve_rng_state=False)`: with `transformer_based_wrap` that is each
listed layer class (one region per unit, not this rule), with `size_based_wrap` every module
above `min_num_params` (projections, MLPs, and the layers holding them, nested). Also HF's
`gradient_checkpointing_enable` and FSDP's own activation checkpointing both on (a checkpoint
inside a checkpoint: the layer's forward runs three times).

Signature. In one FSDP unit's backward (its `pre_backward` to `post_backward` range) the trace
has two or more separate recompute runs (rows in the recompute phase separated by backward
rows). One checkpoint per unit recomputes once, at the start of the unit's backward; FSDP2 units
need the FSDP2 ranges (`FSDP::pre_backward (fqn)`) to be placed.

Why it costs memory. A checkpoint keeps its region's inputs from forward to backward. With k
regions per layer, each layer keeps k inputs, plus the activations of every op between the
regions (norms, residual adds, the glue the regions leave out), for the whole forward-backward
span, for every layer; one checkpoint per layer keeps one input. What finer regions buy is a
smaller recompute working set: one region's activations alive during backward instead of a whole
layer's. So which is lower depends on the layer count and the layer's shape, and the replay
decides: each unit's forward-saved activations are dropped after its forward and made again at
the unit's pre-backward (one recompute of the whole unit), what the unit's region recomputes
made and backward consumed is made at the unit's pre-backward too; the trace is replayed. The
unit's parameters are unsharded once per unit backward either way (FSDP2's pre-backward gathers
them before any recompute), so they do not move.

Verdict: `anomalous` when one checkpoint per unit lowers the peak by `evidence.MIN_PEAK_SAVING`
(re-recording noise); `info` when it lowers it less (extra recompute launches, no memory at
stake); no finding when the finer regions are the lower-peak choice (a deliberate trade).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import counterfactual, human, lowers_peak, seen_in
from snapforensics.analysis.fsdp import ranges as fsdp_ranges
from snapforensics.analysis.fsdp.units import ROOT
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Category, Phase, Verdict

FIX = """\
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard

# one checkpoint per FSDP unit: the whole layer (TransformerBlock), not its sub-modules, and no
# second checkpoint around or inside it (the model's own gradient checkpointing off)
for i, layer in enumerate(model.layers):
    model.layers[i] = checkpoint_wrapper(layer)  # the plain layer, no wrapper inside
    fully_shard(model.layers[i])
fully_shard(model)"""


class UnitBackward(NamedTuple):
    fqn: str
    iteration: int
    f0: int  # pre_forward row
    f1: int  # post_forward row
    b0: int  # pre_backward row
    b1: int  # post_backward row
    runs: int  # separate recompute runs in [b0, b1]


def _first(rows: list[int], lo: int, hi: int) -> int:
    return next((r for r in rows if lo <= r <= hi), -1)


def _runs(phase: np.ndarray, lo: int, hi: int) -> int:
    """Separate recompute runs among the backward rows of [lo, hi] (other phases ignored:
    a collective's worker rows carry none)."""
    ph = phase[lo:hi + 1]
    ph = ph[(ph == Phase.RECOMPUTE) | (ph == Phase.BACKWARD)]
    rc = ph == Phase.RECOMPUTE
    return int(np.count_nonzero(rc[1:] & ~rc[:-1]) + (1 if rc.size and rc[0] else 0))


def unit_backwards(d: DeviceAnalysis) -> list[UnitBackward]:
    """Every named FSDP unit's forward and backward rows in every training iteration, with the
    recompute runs of its backward."""
    named = d.annotation_rows(fsdp_ranges.RANGE)
    pre_f = fsdp_ranges.rows_by_unit(named, ("pre_forward",))
    post_f = fsdp_ranges.rows_by_unit(named, ("post_forward",))
    pre_b = fsdp_ranges.rows_by_unit(named, ("pre_backward",))
    post_b = fsdp_ranges.rows_by_unit(named, fsdp_ranges.POST_BACKWARD)
    out = []
    for it in d.tl.iterations:
        if it.backward_start < 0:
            continue
        for fqn, rows in pre_f.items():
            if fqn in ("", ROOT):
                continue
            f0 = _first(rows, it.start, it.backward_start)
            f1 = _first(post_f.get(fqn, []), max(f0, 0), it.backward_start)
            b0 = _first(pre_b.get(fqn, []), it.backward_start, it.end)
            b1 = _first(post_b.get(fqn, []), max(b0, 0), it.end)
            if min(f0, f1, b0, b1) < 0:
                continue
            out.append(UnitBackward(fqn, it.index, f0, f1, b0, b1, _runs(d.tl.phase, b0, b1)))
    return out


def _replay(d: DeviceAnalysis, units: list[UnitBackward]):
    """One checkpoint per unit: what each unit's forward saved is freed after its next
    allocation and made again at the unit's pre-backward; what its recomputes made and its
    backward consumed is made at the pre-backward too."""
    lt = d.lt
    free_row, alloc_row = lt.free_row.copy(), lt.alloc_row.copy()
    extra = []
    act = d.mask(Category.ACTIVATION)
    rc = d.mask(Category.RECOMPUTE_ACTIVATION) & (lt.alloc_row >= 0)
    allocs = np.sort(lt.alloc_row[lt.alloc_row >= 0])
    saved_by_it: dict[int, int] = {}
    for u in units:
        saved = np.flatnonzero(act & (lt.alloc_row >= u.f0) & (lt.alloc_row <= u.f1) &
                               (lt.free_row >= u.b0) & (lt.free_row <= u.b1))
        for b in saved.tolist():
            a, fr = int(lt.alloc_row[b]), int(lt.free_row[b])
            nxt = allocs[np.searchsorted(allocs, a, side="right"):][:1]
            free_row[b] = min(fr, int(nxt[0]) if nxt.size else u.f1)
            extra.append((u.b0, fr, int(lt.size[b])))
        made = np.flatnonzero(rc & (lt.alloc_row > u.b0) & (lt.alloc_row <= u.b1) &
                              (lt.free_row <= u.b1))
        fr_ph = d.tl.phase[np.minimum(lt.free_row[made], lt.rows - 1)]
        consumed = made[fr_ph == Phase.BACKWARD]  # by backward, not a recompute transient
        alloc_row[consumed] = u.b0
        saved_by_it[u.iteration] = saved_by_it.get(u.iteration, 0) + int(lt.size[saved].sum())
    return free_row, alloc_row, tuple(extra), saved_by_it


def check(d: DeviceAnalysis) -> list[Finding]:
    if not (d.tl.phase == Phase.RECOMPUTE).any():
        return []
    units = unit_backwards(d)
    finer = [u for u in units if u.runs >= 2]
    if not finer:
        return []
    free_row, alloc_row, extra, per_it = _replay(d, finer)
    after, replay = counterfactual(d, free_row, alloc_row, extra)
    saving = d.peak_bytes - after["overall_bytes"]
    if saving <= 0:
        return []  # the finer regions are the lower-peak choice here: a deliberate trade
    anomalous = lowers_peak(d, saving)
    worst = max(per_it, key=lambda k: (per_it[k], -k))
    kept_bytes = per_it[worst]
    mine = [u for u in finer if u.iteration == worst]
    runs = sorted({u.runs for u in mine})
    cause = (
        f"{len(mine)} FSDP unit(s) recompute in {'/'.join(map(str, runs))} separate "
        f"checkpoint regions during their backward ({seen_in(d, per_it, worst)}): activation "
        "checkpointing is finer than the FSDP unit (a checkpoint around each sub-module, or a "
        f"checkpoint inside a checkpoint). Each region keeps its own inputs, and the ops between "
        f"regions keep their activations, from forward to backward in every layer: "
        f"{human(kept_bytes)} saved by these units' forwards in iteration {worst}. "
        + (f"One checkpoint per unit puts the peak at {human(after['overall_bytes'])} instead "
           f"of {human(d.peak_bytes)}." if anomalous else
           f"One checkpoint per unit would lower the peak only by {human(saving)}: this costs "
           "extra recompute launches, not memory."))
    return [Finding(
        replay=replay,
        rule=RULE.id, verdict=Verdict.ANOMALOUS if anomalous else Verdict.INFO,
        title="Activation checkpointing finer than the FSDP unit",
        cause=cause, bytes=kept_bytes, blocks=len(finer), device=d.device,
        fix=FIX,
        predicted_peak_bytes=after["overall_bytes"], saving_bytes=max(saving, 0),
        evidence={
            "iteration": worst,
            "units": [u.fqn for u in mine],
            "recompute_runs_per_unit": {u.fqn: u.runs for u in mine},
            "units_per_iteration": {str(k): sum(1 for u in finer if u.iteration == k)
                                    for k in sorted(per_it)},
            "saved_in_forward_bytes": kept_bytes,
            "saved_in_forward_per_iteration_bytes": {str(k): v for k, v in sorted(per_it.items())},
            "predicted_peaks": after,
            "estimate": "replay: each such unit's forward-saved activations freed after "
                        "forward and made again at its pre-backward; its recompute "
                        "activations made at its pre-backward",
        },
    )]


RULE = Rule(
    id="activations.checkpoint_finer_than_unit", check=check, family=Family.LIFECYCLE,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX)
