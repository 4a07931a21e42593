"""Gradient synchronization turned off across micro-batches: unsharded gradients held.

Signature: an iteration (micro-batch) of an FSDP run whose backward made no reduce-scatter at
all, while gradients it produced (autograd's unsharded grads, FSDP2's accumulated unsharded grads)
stay alive past its backward into the next micro-batch. That is FSDP2
`set_requires_gradient_sync(False)` / FSDP1 `no_sync()`: each rank keeps full, unsharded
gradients (the whole model's, in the gradient dtype) until the micro-batch that syncs.

Verdict `expected`: gradient accumulation without sync trades this memory for fewer
reduce-scatters. Fix: sync every micro-batch (the grads are reduce-scattered and only the
1/world_size shards accumulate), or accept the cost. Predicted peak with sync: each held gradient
freed at its unit's post-backward (where the unit's parameters are resharded), a 1/world_size
sharded gradient kept instead.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human, peaks, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import BACKWARD_PHASES, CAT_CODE, Category, Phase, Verdict

# Held gradients must reach this share of the model's unsharded size as the iteration gathered it
# (all of the model's gradients is ~1.0): a few leftover tensors are not gradient accumulation.
_MIN_SHARE_OF_PARAMS = 0.25

FIX = """\
# Reduce-scatter every micro-batch (only 1/world_size sharded grads accumulate):
for batch in micro_batches:
    model.set_requires_gradient_sync(True)  # FSDP2; FSDP1: do not enter model.no_sync()
    loss_fn(model(batch)).backward()
# or keep sync off on non-final micro-batches and accept holding unsharded grads"""


def check(d: DeviceAnalysis) -> list[Finding]:
    lt = d.lt
    grads = d.mask(Category.GRADIENT, Category.UNSHARDED_GRAD) & \
        np.isin(d.phase, BACKWARD_PHASES) & (d.iteration >= 0)
    rs_iters = set(d.iteration[d.mask(Category.REDUCE_SCATTER, Category.SHARDED_GRAD)].tolist())
    un = d.category == CAT_CODE[Category.UNSHARDED_PARAM]
    n_it = len(d.tl.iterations)
    if not n_it:
        return []
    # The model's unsharded size as this iteration gathered it: its forward's or its backward's
    # all-gathers (each gathers every unit once), whichever is larger.
    sel = un & (d.iteration >= 0)
    fw = sel & (d.phase == Phase.FORWARD)
    bw = sel & np.isin(d.phase, BACKWARD_PHASES)
    gathered_by_it = np.maximum(
        np.bincount(d.iteration[fw], weights=lt.size[fw], minlength=n_it),
        np.bincount(d.iteration[bw], weights=lt.size[bw], minlength=n_it))
    bw_end = np.array([it.backward_end for it in d.tl.iterations], np.int64)
    cand = np.flatnonzero(grads)
    cand = cand[(bw_end[d.iteration[cand]] >= 0) & (lt.free_row[cand] > bw_end[d.iteration[cand]])]
    held_by_it: dict[int, list[int]] = {}
    for b, i in zip(cand.tolist(), d.iteration[cand].tolist()):
        held_by_it.setdefault(i, []).append(b)
    found = {}
    for i, blocks in held_by_it.items():
        if i in rs_iters or i + 1 >= n_it:
            continue
        gathered = int(gathered_by_it[i])
        if gathered <= 0:
            continue  # no FSDP unshard in this iteration: not an FSDP micro-batch
        held = np.array(blocks, np.int64)
        nbytes = int(lt.size[held].sum())
        if nbytes >= _MIN_SHARE_OF_PARAMS * gathered:
            found[i] = (held, nbytes, gathered)
    if not found:
        return []
    world = d.fsdp.world.size or 1
    # Counterfactual: free each held grad at the first reshard (unsharded-param free) after it,
    # keep a 1/world sharded grad from there until the held grad's original free.
    un_frees = np.sort(lt.free_row[un & np.isin(d.phase, BACKWARD_PHASES)])
    free_row = lt.free_row.copy()
    extra = []
    for k, (held, _, _) in found.items():
        end = d.tl.iterations[k].backward_end
        for b in held.tolist():
            a = int(lt.alloc_row[b])
            j = np.searchsorted(un_frees, a, side="right")
            post = int(un_frees[j]) if j < len(un_frees) and un_frees[j] <= end else end
            orig = int(lt.free_row[b])
            free_row[b] = max(min(post, orig), a + 1)
            if world > 1:
                extra.append((int(free_row[b]), orig, int(lt.size[b]) // world))
    after = peaks(d, d.lt.replay(free_row=free_row, extra=extra))
    worst = max(found, key=lambda i: found[i][1])
    held, nbytes, gathered = found[worst]
    it = d.tl.iterations[worst]
    # the micro-batch that synced: the first later one with a reduce-scatter
    nxt = next((x for x in d.tl.iterations[worst + 1:] if x.index in rs_iters),
               d.tl.iterations[worst + 1])
    cause = (
        f"{_name(d, it)} ran backward with no reduce-scatter at all and kept "
        f"{human(nbytes)} of unsharded gradients in {len(held)} blocks alive into the next "
        f"micro-batch ({nbytes / gathered:.0%} of the model's {human(gathered)} of unsharded "
        f"parameters), released only in the synced backward of {_name(d, nxt).lower()}. Gradient "
        "sync was off (FSDP2 set_requires_gradient_sync(False), FSDP1 no_sync()): every rank "
        "holds full-size gradients instead of 1/world_size shards while accumulating, and "
        "saves one reduce-scatter per unit per non-final micro-batch. "
        + _effect(d, after["overall_bytes"], "Syncing every micro-batch"))
    return [Finding(
        rule=RULE.id, verdict=Verdict.EXPECTED,
        title="Gradient sync off across micro-batches: unsharded gradients held",
        cause=cause, bytes=nbytes, blocks=int(len(held)), members=held, device=d.device, fix=FIX,
        predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=max(d.peak_bytes - after["overall_bytes"], 0),
        evidence={
            "iteration": worst,
            "backward_end_row": it.backward_end,
            "released_in_iteration": nxt.index,
            "iterations_without_reduce_scatter": sorted(found),
            "per_iteration_bytes": {str(k): v[1] for k, v in sorted(found.items())},
            "gathered_param_bytes": gathered,
            "world_size": world,
            "stacks": top_stacks(d, held, 1),
            "predicted_peaks": after,
        },
    )]


def _name(d: DeviceAnalysis, it) -> str:
    """"Micro-batch 0 of optimizer step 1 (iteration 2)", or "Iteration 2" when the trace shows
    no optimizer step with several micro-batches."""
    if not any(x.micro_batch for x in d.tl.iterations):
        return f"Iteration {it.index}"
    return f"Micro-batch {it.micro_batch} of optimizer step {it.step} (iteration {it.index})"


def _effect(d: DeviceAnalysis, predicted: int, change: str) -> str:
    if predicted < d.peak_bytes:
        return f"{change} would put the peak at {human(predicted)} instead of " \
               f"{human(d.peak_bytes)}."
    return f"{change} would not lower the peak ({human(d.peak_bytes)}): it is set elsewhere."


RULE = Rule(
    id="fsdp.gradient_sync_disabled", check=check, family=Family.FSDP_CONFIGURATION,
    verdicts=frozenset({Verdict.EXPECTED}), fix=FIX)
