"""Activations dominate the peak and nothing is recomputed: activation checkpointing would help.

Verdict `info`, with the fix and its estimated saving: keeping activations for backward is what
training without checkpointing is designed to cost, and checkpointing buys the memory back with
about one extra forward per step. Whether that trade is worth it depends on whether the job is
memory-bound, which a snapshot cannot tell, so this is advice, not a defect. (The `oom.report`
rule names activations when they are what filled the device at an OOM.)

Fires when a training iteration (one with a backward) has no recompute anywhere in the trace,
activations made by this iteration's forward are the largest category alive at its forward peak
and at least 30% of it, and the estimated saving on the overall peak is at least 5% of it.

Saving estimate. With every repeated layer checkpointed, what stays alive of a layer's
activations is its input (one hidden-state tensor), plus one layer's full activations while it
runs (forward) or is recomputed (backward). Layers are counted from the trace: the activation
blocks alive at the forward peak are grouped by allocating stack (with `<nn.Module>` instance
numbers dropped), and the repeat count carrying the most bytes is the number of layers L. One
layer's worth is the bytes of the repeating stacks divided by L; the layer input is the most
frequent block size among them. Kept = one layer + L inputs; saving = activations alive at the
row - kept, computed at the overall peak (and at the forward peak, in evidence). Activations
outside the repeated layers (embedding, head, loss) are assumed kept.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.stacks import generic_keys, hugging_face, repeated_module
from snapforensics.analysis.vocab import CAT_CODE, CATEGORIES, Category, Phase, Verdict

MIN_SHARE = 0.30  # activations / forward peak
MIN_SAVING = 0.05  # of the overall peak

FIX = """\
from functools import partial
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

# wrap every repeated layer ({layer}) BEFORE fully_shard / FSDP(...) wraps the model:
apply_activation_checkpointing(
    model,
    checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
    check_fn=lambda m: isinstance(m, {layer}),
)"""
_HF_FIX = """\
# a Hugging Face model: its own switch (non-reentrant checkpointing of every decoder layer)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})"""


def fix_for(d: DeviceAnalysis, evidence: dict) -> str:
    """HF's switch on a Hugging Face model, else checkpoint_wrapper on the repeated class."""
    layer = evidence.get("layer_class") or "TransformerBlock"
    return _HF_FIX if hugging_face(d) else FIX.format(layer=layer)


class Layers(NamedTuple):
    repeats: int  # L repetitions of the same layer
    layer_bytes: int  # activations of one layer
    input_bytes: int  # one layer's input (what checkpointing keeps per layer)
    blocks: np.ndarray  # the repeating blocks


class Saving(NamedTuple):
    activations: int  # activations of the iteration alive at the row
    saved: int  # what checkpointing saves there


def _layers(d: DeviceAnalysis, blocks: np.ndarray) -> Layers:
    if not blocks.size:
        return Layers(0, 0, 0, blocks)
    keys = generic_keys(d, d.lt.stack[blocks])
    uk, kinv, counts = np.unique(keys, return_inverse=True, return_counts=True)
    per_block_count = counts[kinv]
    by_count: Counter[int] = Counter()
    for c, s in zip(per_block_count.tolist(), d.lt.size[blocks].tolist()):
        if c > 1:
            by_count[c] += s
    if not by_count:
        return Layers(0, 0, 0, blocks[:0])
    # A stack called twice per layer (two norms on one line) repeats 2L times: the layer count
    # is the repeat count whose multiples carry the most bytes, among counts that carry a
    # real share (>= 25%) of the repeating bytes on their own (so a stray 2 does not win).
    total = sum(by_count.values())
    cands = [c for c, b in by_count.items() if b >= 0.25 * total] or list(by_count)

    def covered(c: int) -> int:
        return sum(b for k, b in by_count.items() if k % c == 0)

    L = max(cands, key=lambda c: (covered(c), c))
    rep = blocks[per_block_count % L == 0]
    layer = int(d.lt.size[rep].sum()) // L
    sizes = Counter(d.lt.size[rep].tolist())
    h = max(sizes, key=lambda s: (sizes[s], s)) if sizes else 0
    return Layers(int(L), layer, int(h), rep)


def _saving(d: DeviceAnalysis, row: int, it_index: int, kept_cap: int) -> Saving:
    """Activations of iteration `it_index` alive after `row`, and what checkpointing saves."""
    m = d.lt.alive_at(row) & (d.category == CAT_CODE[Category.ACTIVATION]) & \
        (d.iteration == it_index)
    a = int(d.lt.size[m].sum())
    return Saving(a, max(0, a - min(a, kept_cap)))


def check(d: DeviceAnalysis) -> list[Finding]:
    if (d.tl.phase == Phase.RECOMPUTE).any() or d.mask(Category.RECOMPUTE_ACTIVATION).any():
        return []
    its = [it for it in d.tl.iterations if it.backward_start >= 0 and it.forward_peak_row >= 0]
    if not its or d.peak_bytes <= 0:
        return []
    it = max(its, key=lambda i: i.forward_peak)
    r = it.forward_peak_row
    alive = np.flatnonzero(d.lt.alive_at(r))
    by_cat = np.bincount(d.category[alive], weights=d.lt.size[alive], minlength=len(CATEGORIES))
    act_blocks = alive[(d.category[alive] == CAT_CODE[Category.ACTIVATION]) &
                       (d.iteration[alive] == it.index)]
    act = int(d.lt.size[act_blocks].sum())
    fwd = int(d.lt.live[r])
    if fwd <= 0 or act < MIN_SHARE * fwd or by_cat.argmax() != CAT_CODE[Category.ACTIVATION]:
        return []
    L, layer, h, rep = _layers(d, act_blocks)
    if L < 2:
        return []  # no repeated layers to checkpoint (or no stacks to see them)
    other = act - int(d.lt.size[rep].sum())  # embedding, head, loss: kept
    kept_cap = layer + L * h + max(other, 0)
    _, save_fwd = _saving(d, r, it.index, kept_cap)
    p = d.peak_row
    pit = d.tl.iteration_of(p)
    act_p, save_peak = _saving(d, p, pit.index, kept_cap) if pit else Saving(0, 0)
    if save_peak < MIN_SAVING * d.peak_bytes:
        return []
    name = repeated_module(d, d.lt.stack[rep], L)
    predicted = d.peak_bytes - save_peak
    cause = (
        f"At the forward peak of iteration {it.index} ({human(fwd)}), {human(act)} "
        f"({act / fwd:.0%}) is activations kept for backward, the largest category, and this "
        f"run recomputes nothing. They come from {L} repetitions of the same layer"
        + (f" ({name})" if name else "")
        + f", about {human(layer)} each. Checkpointing each layer keeps only its input "
        f"(~{human(h)}) plus one layer's activations while it runs: about "
        f"{human(save_peak)} less at the overall peak ({d.phase_name(p)}), for one extra "
        f"forward per step.")
    evidence = {
        "iteration": it.index,
        "forward_peak_bytes": fwd,
        "forward_peak_row": r,
        "activation_bytes_at_forward_peak": act,
        "activation_share": round(act / fwd, 3),
        "categories_at_forward_peak": {CATEGORIES[i]: int(v) for i, v in enumerate(by_cat)
                                       if v},
        "layers": L,
        "layer_class": name,
        "per_layer_bytes": layer,
        "layer_input_bytes": h,
        "outside_layers_bytes": other,
        "kept_with_checkpointing_bytes": kept_cap,
        "saving_at_forward_peak_bytes": save_fwd,
        "activation_bytes_at_overall_peak": act_p,
        "saving_at_overall_peak_bytes": save_peak,
        "estimate": "kept = one layer's activations + one input per layer + activations "
                    "outside the repeated layers; layers = repeat count (by bytes) of the "
                    "activation stacks alive at the forward peak",
        "stacks": top_stacks(d, act_blocks, 3),
    }
    return [Finding(
        rule=RULE.id, verdict=Verdict.INFO,
        title="Activations dominate the peak and nothing is checkpointed",
        cause=cause, bytes=act, blocks=int(act_blocks.size), members=act_blocks, device=d.device,
        fix=fix_for(d, evidence),
        predicted_peak_bytes=predicted, saving_bytes=save_peak, evidence=evidence,
    )]


RULE = Rule(
    id="activations.no_checkpointing", check=check, family=Family.LIFECYCLE,
    verdicts=frozenset({Verdict.INFO}), fix=fix_for)
