"""Tensor parallelism without SequenceParallel: every TP rank holds the same full-sequence
activations outside the parallelized attention/MLP (the norms' inputs and internals, the
residual stream, the loss), because `RowwiseParallel`'s output is all-reduced to `Replicate`
(`tp.all_reduce` blocks in forward) instead of reduce-scattered along the sequence
(`output_layouts=Shard(1)`). `SequenceParallel()` on the norms shards those along the sequence:
each is 1/tp of its bytes; what the next `ColwiseParallel` reads is all-gathered back (a
full-size `tp.all_gather` block that replaces the norm's full output, the same bytes).

Seen by: forward `tp.all_reduce` blocks and no forward `tp.reduce_scatter` (SP off). F, the
full activation, is the all-reduce's output size; the TP modules are the parents of the
modules that made those all-reduces (the `<nn.Module>` frames: `Attention_0`, `MLP_0`), except
a parent that holds another (a RowwiseParallel embedding's parent is the model). The
threshold is the mechanism: anomalous when the replay lowers this run's peak (SP costs no extra
communication: an all-reduce is a reduce-scatter plus an all-gather), info otherwise.

The replay (sizes, not rows): every block of F bytes made outside the TP modules shrinks to
F / tp, except a forward one made right before a block inside a TP module (the norm's output the
TP module reads: under SP the all-gathered copy of the same size takes its place). A recording
without `<nn.Module>` frames gets the finding without a prediction.

Megatron-Core (`megatron/core/tensor_parallel/`) all-reduces its row-parallel outputs in place
(`_reduce`: no block), so there SP off is seen by its TP linears (frames in
`tensor_parallel/layers.py` in forward) with no forward `tp.all_gather` / `tp.reduce_scatter`
(its SP all-gathers every column-parallel input). F is the residual stream's size (the forward
blocks its bias-dropout-add makes, `fusions/fused_bias_dropout.py`). Its SP saves more than
DTensor's: the linear keeps the sequence shard for backward and gathers into one shared buffer
(`get_global_memory_buffer`), so the replay shrinks every forward block of F bytes made outside
the TP linears to F / tp and adds that one buffer of F. TP above 1 is read from the
vocabulary-parallel embedding masking token ids (its module frame: the CPU recorder's; a dump
without module frames gets no finding: a data-parallel-only run has the same linears). Checked
on megatron_gpt's TP 2 run against its `--sp` twin.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.classify import MEGATRON_LAYERS, megatron_rel
from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding, Replay
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import CAT_CODE, Category, Phase, Verdict

FIX = """\
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module)

# per transformer block: shard the norms along the sequence, reduce-scatter the row-wise
# outputs into sequence shards and gather them back before the column-wise projections
parallelize_module(block, tp_mesh, {
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                    desired_input_layouts=(Replicate(),)),
    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),  # was Replicate()
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                       desired_input_layouts=(Replicate(),)),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
})
# and the block's input arrives sequence-sharded (the embedding's
# RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
# torchtitan: parallelism.enable_sequence_parallel = true (ParallelismConfig; the default)
"""


# what SequenceParallel can shard: activations (and the batch itself, `other`) and the all-reduced
# RowwiseParallel outputs. A parameter, gradient or FSDP buffer of the same size is none of them
# (FSDP2 on a 2-D mesh: an MLP weight's unsharded TP shard, dim x 4 dim / tp, is batch x seq x dim
# when batch x seq = 4 dim / tp)
_SEQUENCE = [CAT_CODE[c] for c in (Category.ACTIVATION, Category.RECOMPUTE_ACTIVATION,
                                   Category.OTHER, Category.TP_ALL_REDUCE)]


# how many blocks past a norm's output its own module may still make (LayerNorm: mean, rstd)
_SAME_MODULE_SPAN = 8


def _modules(d: DeviceAnalysis, b: int) -> list[str]:
    sid = int(d.lt.stack[b])
    if sid < 0:
        return []
    return [f.name for f in d.snapshot.stack_frames(sid) if f.filename == "<nn.Module>"]


def _tp_modules(chains: list[list[str]]) -> set[str]:
    """The TP modules, from the module frames (innermost first) of the forward all-reduces: each
    RowwiseParallel module's parent (the attention or MLP whose column-wise projections feed
    it), unless that parent holds another one (a RowwiseParallel embedding's parent is the
    model itself, which holds every block: not a TP module; its output, the all-reduce, is
    what SP shards)."""
    parents = {c[1] for c in chains if len(c) > 1}
    holders = {m for c in chains for i, t in enumerate(c) if t in parents for m in c[i + 1:]}
    return parents - holders


MEGATRON_FIX = """\
# Megatron-LM: --sequence-parallel (with --tensor-model-parallel-size > 1)
# Megatron-Core (or NeMo's config):
config = TransformerConfig(..., tensor_model_parallel_size=tp, sequence_parallel=True)
"""


def _megatron_file(d: DeviceAnalysis, sid: int) -> str | None:
    """The innermost Megatron file of stack `sid` (classify's reading), None outside it."""
    frames = d.snapshot.stack_frames(sid) if sid >= 0 else []
    return next((r for f in frames if (r := megatron_rel(f.filename)) is not None), None)


def _vocab_masked(d: DeviceAnalysis, sid: int) -> bool:
    """Stack `sid` is the vocabulary-parallel embedding's masking of token ids outside this
    rank's vocabulary shard, which `VocabParallelEmbedding.forward` does only when the TP degree
    is above 1 (the evidence that this run's TP is > 1: a data-parallel-only run makes none)."""
    frames = d.snapshot.stack_frames(sid) if sid >= 0 else []
    mod = next((f.name for f in frames if f.filename == "<nn.Module>"), "")
    return mod.startswith("VocabParallelEmbedding") and not any(
        f.name == "embedding" and f.filename.endswith("nn/functional.py") for f in frames)


def _megatron(d: DeviceAnalysis) -> list[Finding]:
    lt = d.lt
    fwd = np.flatnonzero(d.phase == Phase.FORWARD)
    sp = {CAT_CODE[Category.TP_ALL_GATHER], CAT_CODE[Category.TP_REDUCE_SCATTER]}
    layout = d.layout
    tp = layout.degree("tp")
    if not len(fwd) or np.isin(d.category[fwd], list(sp)).any() or d.peak_row < 0 or \
            not (type(tp) is int and tp > 1):
        return []
    # once per distinct stack of the forward's blocks, never per block
    stacks, back = np.unique(lt.stack[fwd], return_inverse=True)
    files = np.array([_megatron_file(d, int(s)) for s in stacks.tolist()], object)[back]
    linear = np.isin(files, MEGATRON_LAYERS)
    residual = fwd[files == "fusions/fused_bias_dropout.py"]
    if not linear.any() or not len(residual) or \
            not any(_vocab_masked(d, int(s)) for s in stacks.tolist()):
        return []
    full = int(np.bincount(lt.size[residual]).argmax())
    shrink = np.zeros(len(lt), bool)
    shrink[fwd[~linear & (lt.size[fwd] == full) & (lt.alloc_row[fwd] >= 0)
               & np.isin(d.category[fwd], _SEQUENCE)]] = True
    held = lt.alive_at(d.peak_row) & shrink
    held_bytes = int(lt.size[held].sum())
    split = tuple((int(lt.alloc_row[b]), int(lt.free_row[b]), full, tp)
                  for b in np.flatnonzero(shrink).tolist())
    first = int(lt.alloc_row[fwd].min())  # the shared gather buffer, from the first forward on
    extra = tuple((a, e, -(full - full // tp)) for a, e, _, _ in split) + \
        ((first, lt.rows, full),)
    predicted = max(int(lt.replay(extra=extra).max()), lt.baseline)
    saving = d.peak_bytes - predicted
    anomalous = saving > 0
    evidence = {"full_activation_bytes": full, "tp_degree": tp,
                "tp_degree_from": layout.source("tp"), "framework": "megatron",
                "replicated_at_peak": held_bytes, "global_buffer_bytes": full,
                "stacks": top_stacks(d, np.flatnonzero(held), 1)}
    cause = (f"Megatron-Core tensor parallelism without sequence parallelism: at the peak "
             f"{human(held_bytes)} of full-sequence activations ({human(full)} each: the residual "
             "stream, the norms' outputs, dropout masks) outside the TP linears are the same on "
             f"every TP rank; --sequence-parallel keeps 1/tp of each. TP degree {tp}, from "
             f"{layout.source('tp')}.")
    return [Finding.replayed(
        anomalous, rule=RULE.id,
        title="Tensor-parallel activations replicated on every TP rank (Megatron, SP off)",
        cause=cause, bytes=held_bytes, blocks=int(held.sum()), device=d.device,
        fix=MEGATRON_FIX, predicted=predicted, saving=saving, evidence=evidence,
        replay=Replay(extra=extra, split=split), members=np.flatnonzero(held))]


def check(d: DeviceAnalysis) -> list[Finding]:
    if any(megatron_rel(f.filename) is not None for f in d.snapshot.frames):
        return _megatron(d)
    lt = d.lt
    fwd = d.phase == Phase.FORWARD
    ar = np.flatnonzero((d.category == CAT_CODE[Category.TP_ALL_REDUCE]) & fwd)
    if not len(ar) or ((d.category == CAT_CODE[Category.TP_REDUCE_SCATTER]) & fwd).any() \
            or d.peak_row < 0:
        return []
    full = int(np.bincount(lt.size[ar]).argmax())
    tp_mods = _tp_modules([_modules(d, b) for b in ar.tolist()])
    layout = d.layout
    tp = layout.degree("tp")
    alive = lt.alive_at(d.peak_row)
    replicated = (lt.size == full) & (lt.alloc_row >= 0) & np.isin(d.category, _SEQUENCE)
    inside = np.zeros(len(lt), bool)
    for b in np.flatnonzero(replicated).tolist():
        inside[b] = bool(set(_modules(d, b)) & tp_mods)
    shrink = replicated & ~inside
    # what reads its input whole under SP: the TP modules (their ColwiseParallel projections) and
    # a module whose forward all-gathers its output (a ColwiseParallel head, output Replicate:
    # with SP its input, the final norm's, arrives sequence-sharded and is all-gathered)
    gathers = np.flatnonzero((d.category == CAT_CODE[Category.TP_ALL_GATHER]) & fwd)
    readers = tp_mods | {m[0] for m in (_modules(d, b) for b in gathers.tolist()) if m}
    # a forward block whose module makes no other full-size block before a reader makes its
    # next: that reader's input (the norm's output; a LayerNorm makes its mean and rstd after
    # it, smaller, in the same module; an RMSNorm written out makes its output last)
    order = np.argsort(lt.alloc_row, kind="stable")
    pos = np.empty(len(lt), np.int64)
    pos[order] = np.arange(len(lt))
    for b in np.flatnonzero(shrink & fwd).tolist():
        own = _modules(d, b)
        for n in order[pos[b] + 1:pos[b] + 1 + _SAME_MODULE_SPAN].tolist():
            mods = _modules(d, n)
            if mods != own:
                if set(mods) & readers:
                    shrink[b] = False
                break
            if lt.size[n] == full:  # not the module's output: another full-size block follows
                break
    held = alive & shrink
    held_bytes = int(lt.size[held].sum())
    evidence = {"full_activation_bytes": full, "all_reduces": len(ar), "tp_modules":
                sorted(tp_mods), "replicated_at_peak": held_bytes,
                "stacks": top_stacks(d, np.flatnonzero(held), 1)}
    title = "Tensor-parallel activations replicated on every TP rank (no SequenceParallel)"
    cause = (f"RowwiseParallel outputs are all-reduced to Replicate ({len(ar)} forward all-reduces "
             f"of {human(full)}): at the peak {human(held_bytes)} of full-sequence activations "
             "outside the parallelized modules (norms, residual stream) are the same on every "
             "TP rank; SequenceParallel would shard them along the sequence.")
    if not tp_mods or not (type(tp) is int and tp > 1):
        return [Finding(rule=RULE.id, verdict=Verdict.INFO, title=title, bytes=held_bytes,
                        cause=cause + " The TP degree or the module frames are not in this file "
                        "(record with `snapforensics record` for the saving).",
                        blocks=int(held.sum()), device=d.device, evidence=evidence,
                        members=np.flatnonzero(held))]
    # each RowwiseParallel output becomes a sequence shard too, and its reduce-scatter costs
    # what the all-reduce did not, for the collective's duration: the functional collective
    # concatenates the sequence chunks into a full-size input (`reduce_scatter_tensor` with
    # scatter_dim 1 != 0: `torch.cat(torch.chunk(x, group_size, dim=1))`), and gloo reduce-
    # scatters through an all-reduce of a full-size clone of it (CPU recordings)
    cut = np.union1d(np.flatnonzero(shrink), ar)
    transient = full * (2 if d.snapshot.kind.cpu_recorded else 1)
    split = tuple((int(lt.alloc_row[b]), int(lt.free_row[b]), full, tp) for b in cut.tolist())
    extra = tuple((a, e, -(full - full // tp)) for a, e, _, _ in split) + tuple(
        (int(lt.alloc_row[b]), int(lt.alloc_row[b]) + 1, transient) for b in ar.tolist())
    predicted = max(int(lt.replay(extra=extra).max()), lt.baseline)
    saving = d.peak_bytes - predicted
    evidence.update(tp_degree=tp, tp_degree_from=layout.source("tp"))
    anomalous = saving > 0
    return [Finding.replayed(
        anomalous, rule=RULE.id, title=title,
        cause=cause + f" TP degree {tp}, from {layout.source('tp')}.", bytes=held_bytes,
        blocks=int(held.sum()), device=d.device, fix=FIX, predicted=predicted, saving=saving,
        evidence=evidence, replay=Replay(extra=extra, split=split),
        members=np.flatnonzero(held))]


RULE = Rule(
    id="tp.sequence_parallel_off", check=check, family=Family.PARALLELISM,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX)
