"""The forecast's scaling classes: how each block's size changes with the world size and the
micro-batch (shard, full unit, micro-batch, constant; the model in `forecast.py`'s docstring), and
the scaled sizes of a scenario.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.forecast.documents import Scenario
from snapforensics.analysis.fsdp import ranges as fsdp_ranges
from snapforensics.analysis.vocab import BACKWARD_PHASES, CAT_CODE, Category, Phase
from snapforensics.snapshot.tensors import KINDS

# Scaling classes.
CONST, SHARD, UNIT, BATCH = range(4)
SCALING = ("constant", "shard", "unit", "micro_batch")  # stable ids (JSON `by_scaling`)
SCALING_TEXT = {"constant": "constant", "shard": "1/W", "unit": "unit size",
                "micro_batch": "x micro-batch"}
# A tensor of at most 8 elements of 8 bytes is a scalar (AdamW's step, a collective's divisor,
# RNG offsets): it is not a piece of a parameter and does not grow with the batch.
SCALAR_BYTES = 64
# The caching allocator hands out blocks in multiples of 512 bytes (kMinBlockSize): on CUDA/NPU
# a forecast size is rounded when the recorded one was; CPU recordings keep exact sizes.
ALLOC_ROUND = 512

# Frames under which FSDP consumes a parameter's unsharded gradient (reduce-scatter copy-in).
_REDUCE_FRAMES = {"foreach_reduce", "post_backward", "_post_backward_hook", "_reduce_grad",
                  "_reduce_grad_no_shard", "foreach_reduce_scatter_copy_in"}
_SPLIT_BACKWARD = "SplitWithSizesBackward0"


def _kind(name: str) -> str:
    r = fsdp_ranges.parse(name)
    return r.kind if r else ""


def _param_grads(d: DeviceAnalysis, blocks: np.ndarray, flat_sizes: set[int]) -> np.ndarray:
    """Which gradient `blocks` are parameters' unsharded gradients (full unit size, not
    activation gradients): those FSDP's post-backward frees (its reduce-scatter copy-in), those
    FSDP1's flat parameter gathers (`use_orig_params` views: the flat gradient is the
    concatenation of theirs, `SplitWithSizesBackward0`), and the flat gradient itself (a block
    of an FSDP1 flat parameter's size made in backward)."""
    out = np.isin(d.lt.size[blocks], np.array(sorted(flat_sizes), np.int64))
    seen: dict[tuple[int, int], bool] = {}
    for k, b in enumerate(blocks.tolist()):
        fr = int(d.lt.free_row[b])
        if out[k] or fr >= d.lt.rows:
            continue
        key = (int(d.trace.stack[fr]), int(d.tl.ctx[fr]))
        if key not in seen:
            names = {f.name for f in d.snapshot.stack_frames(key[0])} if key[0] >= 0 else set()
            ranges = d.tl.contexts[key[1]] if d.tl.contexts else ()
            seen[key] = bool(names & _REDUCE_FRAMES) or any(
                r.startswith("FullyShardedDataParallel._post_backward")
                or _kind(r).startswith("post_backward") for r in ranges) or any(
                n.endswith(_SPLIT_BACKWARD) for n in names)
        out[k] = seen[key]
    return out


def scaling(d: DeviceAnalysis, w0: int | None) -> np.ndarray:
    """The scaling class of every block (see the module docstring)."""
    cat, size = d.category, d.lt.size
    cls = np.full(len(size), CONST, np.int8)
    isin = lambda *cs: np.isin(cat, [CAT_CODE[c] for c in cs])  # noqa: E731
    # what the training loop makes around the model (data, the loss's log-softmax) is
    # unclassified but made in forward/backward: it grows with the batch like activations
    step = np.isin(d.phase, [Phase.FORWARD, *BACKWARD_PHASES])
    cls[isin(Category.ACTIVATION, Category.RECOMPUTE_ACTIVATION, Category.GRADIENT) |
        (isin(Category.OTHER) & step)] = BATCH
    cls[isin(Category.UNSHARDED_PARAM, Category.UNSHARDED_GRAD, Category.ALL_GATHER)] = UNIT
    cls[isin(Category.SHARDED_PARAM, Category.SHARDED_GRAD, Category.OPTIMIZER_STATE)] = SHARD
    if w0:
        f = d.fsdp
        cls[f.ag_input] = SHARD
        # Unsharded sizes: each parameter's, each unit's flat buffer, each unshard event's sum.
        un = isin(Category.UNSHARDED_PARAM) | (isin(Category.ALL_GATHER) & f.primary)
        fulls = set(size[un].tolist())
        ev = f.event[f.event >= 0]
        if ev.size:
            fulls |= set(np.bincount(ev, weights=size[f.event >= 0]).astype(np.int64).tolist())
        fulls.discard(0)
        if f.ag_input.any():  # mixed precision: an fp32 shard of a bf16 unsharded parameter
            fulls |= {2 * x for x in fulls}
        shard_like = np.isin(size * w0, np.array(sorted(fulls), np.int64))
        # a parameter's gradient that FSDP's post-backward reduces is the full unit's
        grads = np.flatnonzero(isin(Category.GRADIENT) & (size > SCALAR_BYTES))
        weight_grad = np.zeros(len(size), bool)
        weight_grad[grads[_param_grads(d, grads, set(size[f.fsdp1_flat].tolist()))]] = True
        # a shard is made at init or by the optimizer, never by forward or backward
        cls[isin(Category.PARAMETER, Category.OTHER, Category.UNTRACED) & shard_like & ~step] = \
            SHARD
        cls[isin(Category.REDUCE_SCATTER) & shard_like] = SHARD
        cls[isin(Category.REDUCE_SCATTER) & ~shard_like] = UNIT
        cls[weight_grad] = UNIT
    cls[size <= SCALAR_BYTES] = CONST
    return cls


# what parameters make: sharded by TP as their parameters are, when no tensor of theirs was seen
_PARAM_MADE = (Category.SHARDED_PARAM, Category.UNSHARDED_PARAM,
               Category.ALL_GATHER, Category.REDUCE_SCATTER, Category.SHARDED_GRAD,
               Category.UNSHARDED_GRAD, Category.OPTIMIZER_STATE)
# a plain parameter, gradient or optimizer state is whole (TP splits parameters as DTensors);
# a plain saved activation may be a sequence shard SequenceParallel's module handed on
_OWN_KINDS = ("parameter", "gradient", "optimizer_state")
_TP_COLLECTIVES = (Category.TP_ALL_GATHER, Category.TP_REDUCE_SCATTER, Category.TP_ALL_REDUCE)


def tp_shares(d: DeviceAnalysis, cls: np.ndarray) -> tuple[int | None, np.ndarray]:
    """The recorded TP degree (the most ways the recorder saw TP split a tensor; None when it
    saw none) and, per block, the share of its bytes TP splits (scaled by tp0 / tp):

    - a block the recorder named: the bytes of its tensors TP splits (DTensor placements on the
      mesh's ``tp`` dim; a saved activation between a column-wise module and its row-wise one),
      0 for a parameter, gradient or optimizer state it saw as a plain tensor;
    - a parameter's block it did not name (FSDP's flat all-gather and reduce-scatter buffers,
      a parameter's gradient): the share of the named parameters' bytes TP splits;
    - a TP collective's buffer (``tp.*``) 1/tp0 the size of another: the shard side of an
      all-gather or reduce-scatter;
    - an unnamed block of the batch of the size of a split named block and of no whole one: an
      activation's gradient (backward makes them, unnamed; a gradient has its tensor's shape,
      so it is split as the tensor is), and a tensor autograd did not save (the logits a script
      holds through backward: loss_parallel keeps them sharded over the vocabulary; taken as
      replicated, a Llama-like model's TP 4 from 2 was 7.9% high). Where a split size equals a
      whole activation's, as TP 4's MLP hidden and the residual stream can, it stays constant;
      a whole parameter, gradient or optimizer state of that size does not count (at TP 8 the
      logits' shard is the whole embedding table's size);
    - the rest: 0 (constant: what TP replicates, and what nothing says)."""
    nm = d.names
    size = d.lt.size.astype(np.int64)
    share = np.zeros(len(size), np.float64)
    if nm is None or not (nm.tp > 1).any():
        return None, share
    tp0 = int(nm.tp.max())
    # known: a split recorded, or a parameter, gradient or state the recorder saw as a plain
    # tensor (whole); FSDP's flat buffers and unsharded gradients are plain tensors of
    # parameters TP may split: not known from that
    own = np.isin(nm.kinds, [KINDS.index(k) for k in _OWN_KINDS])
    named = (nm.tp > 0) | own
    share[named] = np.minimum(nm.tp_bytes[named] / np.maximum(size[named], 1), 1.0)
    named = _same_site(d.lt.stack, size, named, share)
    batch = (cls == BATCH) & ~named
    if batch.any():  # a whole parameter, gradient or state does not veto a size (TP 8's
        # vocabulary-sharded logits are the whole embedding table's size); a whole activation does,
        # and so does what a forward all-gather makes (its output is replicated: a ColwiseParallel
        # head's gathered logits, whose gradients the loss makes unnamed in backward; taken as
        # split, a GPT-2-like TP 4 from 2 was 4.1% low)
        gathered = (d.category == CAT_CODE[Category.TP_ALL_GATHER]) & \
            (d.phase == Phase.FORWARD)
        whole = np.union1d(size[named & ~own & (share == 0)], size[gathered])
        split_sizes = np.setdiff1d(size[named & (share >= 1)], whole)
        share[batch & np.isin(size, split_sizes)] = 1.0
    params = nm.kinds == KINDS.index("parameter")
    if params.any() and size[params].sum():
        p_share = min(float(nm.tp_bytes[params].sum() / size[params].sum()), 1.0)
        made = np.isin(d.category, [CAT_CODE[c] for c in _PARAM_MADE]) | \
            np.isin(cls, [SHARD, UNIT])
        share[made & ~named] = p_share
    coll = np.isin(d.category, [CAT_CODE[c] for c in _TP_COLLECTIVES])
    if coll.any():
        share[coll & np.isin(size * tp0, size[coll])] = 1.0
    return tp0, share


def _same_site(stack: np.ndarray, size: np.ndarray, named: np.ndarray,
               share: np.ndarray) -> np.ndarray:
    """An unnamed block made where a named one was (the same stack, the same size: the same
    tensor in another step, one whose saved-tensor hooks the script or a checkpoint pushed)
    takes that site's share; `named` with them added."""
    traced = stack >= 0
    if not (named & traced).any():
        return named
    key = np.unique(np.stack([stack[traced], size[traced]]), axis=1, return_inverse=True)[1]
    key = key.reshape(-1)
    idx = np.flatnonzero(traced)
    k_named = named[idx]
    n = int(key.max()) + 1
    total = np.bincount(key[k_named], weights=share[idx][k_named], minlength=n)
    count = np.bincount(key[k_named], minlength=n)
    take = ~k_named & (count[key] > 0)
    share[idx[take]] = total[key[take]] / count[key[take]]
    out = named.copy()
    out[idx[take]] = True
    return out


def scaled_sizes(d: DeviceAnalysis, cls: np.ndarray, w0: int | None, sc: Scenario,
                 tp: tuple[int | None, np.ndarray | None] = (None, None)) -> np.ndarray:
    """The blocks' sizes in scenario `sc`; `tp`: `tp_shares`, for a scenario's TP degree."""
    size = d.lt.size.astype(np.int64)
    out = size.copy()
    w = sc.shard_factor()
    if w0 and w != w0:
        gran = 4  # bytes per element: FSDP pads in elements; fp32 unless the size says less
        g = np.where(size % 4 == 0, gran, np.where(size % 2 == 0, 2, 1))
        full_el = np.ceil(size * w0 / g)  # elements of the padded full (shard blocks)
        sh = cls == SHARD
        out[sh] = (np.ceil(full_el[sh] / w) * g[sh]).astype(np.int64)
        un = cls == UNIT
        el = np.ceil(size[un] / g[un])
        out[un] = (np.ceil(el / w) * w * g[un]).astype(np.int64)
    if sc.micro_batch_scale != 1:
        b = cls == BATCH
        out[b] = np.ceil(size[b] * sc.micro_batch_scale).astype(np.int64)
    tp0, share = tp
    if sc.tp and tp0 and share is not None and sc.tp != tp0:
        out = np.ceil(out * (1 - share) + out * share * tp0 / sc.tp).astype(np.int64)
    if d.snapshot.kind.caching_allocator:  # sizes the trace records rounded stay rounded
        rounded = (size % ALLOC_ROUND == 0) & (out != size)
        out = np.where(rounded, -(-out // ALLOC_ROUND) * ALLOC_ROUND, out)
    return out
