"""One device's analysed trace: lifetimes, phases and the classification of every block.

Built once per device in a single pass; every rule reads it and none re-walks the raw trace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from snapforensics.analysis import compiled, identity, lifetimes, phases
from snapforensics.analysis.allocator import Allocator
from snapforensics.analysis.classify import PATHS, StackInfo, classify
from snapforensics.analysis.fsdp.units import (
    FsdpUnits,
    name_fsdp1_backward,
    name_fsdp1_from_names,
    name_fsdp1_units,
)
from snapforensics.analysis.identity import BlockNames
from snapforensics.analysis.mesh import Mesh, mesh, shown
from snapforensics.analysis.stacks import is_native, is_noise
from snapforensics.analysis.vocab import BACKWARD_PHASES, CAT_CODE, CATEGORIES, Category, Phase
from snapforensics.snapshot.model import ALLOC, NO_STACK, Snapshot, Trace

PATH_CODE = {p: i for i, p in enumerate(PATHS)}

@dataclass
class DeviceAnalysis:
    snapshot: Snapshot
    trace: Trace
    lt: lifetimes.Lifetimes
    tl: phases.Timeline
    infos: list[StackInfo]  # distinct (stack, ranges) classifications
    info: np.ndarray  # int32 per block: index into infos
    category: np.ndarray  # int8 per block: index into CATEGORIES
    path: np.ndarray  # int8 per block: index into PATHS, -1 none
    phase: np.ndarray  # int8 per block: phase at its alloc row
    iteration: np.ndarray  # int32 per block: iteration of its alloc row, -1 none
    # names of the codes in `category`: the built-in CATEGORIES, then user categories
    category_names: tuple[str, ...] = CATEGORIES
    # a block's FSDP unit where its stack does not say it (FSDP1 backward gathers, named by
    # `fsdp_units.name_fsdp1_backward`)
    block_module: dict[int, str] = field(default_factory=dict)
    # the distinct (stack, ranges) keys `infos` classify (stack * contexts + context), in order
    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    # Facts several rules share, by family: each computed on first use, once per device.
    @cached_property
    def fsdp(self) -> FsdpUnits:
        return FsdpUnits(self)

    @cached_property
    def allocator(self) -> Allocator:
        return Allocator(self)

    @cached_property
    def names(self) -> BlockNames | None:
        """The recorder's tensor names joined to this device's blocks (analysis/identity.py);
        None when the file has none."""
        t = self.snapshot.tensors
        return identity.join(t, self.lt, self.trace) if t is not None else None

    @cached_property
    def compiled(self) -> compiled.Compiled | None:
        """The torch.compile graph (region, forward or backward) that made each block
        (analysis/compiled.py); None when no row ran compiled code."""
        return compiled.attribute(self)

    @cached_property
    def layout(self) -> Mesh:
        """This rank's place in the parallel layout (analysis/mesh.py): the recorder's process
        groups, with the dimensions this device's blocks show in use."""
        return mesh(self.snapshot.provenance, shown(self.present))

    @property
    def present(self) -> list[str]:
        """The names of the categories of the blocks this device made in a training step
        (forward, backward, recompute): what a stray collective around the step makes (a
        DTensor norm's all-reduce in `clip_grad_norm_` reads as TP's) is left out."""
        step = np.isin(self.phase, [Phase.FORWARD, *BACKWARD_PHASES])
        return [self.category_names[c] for c in np.unique(self.category[step]).tolist()]

    @property
    def device(self) -> int:
        return self.trace.device

    @cached_property
    def peak_row(self) -> int:
        return int(np.argmax(self.lt.live)) if self.lt.rows else -1

    @cached_property
    def peak_bytes(self) -> int:
        """Most bytes allocated at once, counting the moment before the first row (a truncated
        trace that opens with frees was higher before it than anywhere in it)."""
        return max(int(self.lt.live[self.peak_row]), self.lt.baseline) if self.lt.rows else 0

    def module_of(self, block: int) -> str | None:
        m = self.block_module.get(int(block))
        return m if m is not None else self.infos[self.info[block]].module

    def mask(self, *categories: Category) -> np.ndarray:
        codes = [CAT_CODE[c] for c in categories]
        return np.isin(self.category, codes)

    def stack_text(self, stack_id: int, limit: int = 12) -> list[str]:
        frames = self.snapshot.stack_frames(stack_id)
        if not frames:
            return ["(no frames recorded for this allocation)"]
        kept = [f for f in frames if not is_noise(f) and not is_native(f)] or \
            [f for f in frames if not is_noise(f)] or frames
        return [str(f) for f in kept[:limit]]

    def annotation_rows(self, pattern: re.Pattern) -> list[tuple[int, str]]:
        """(row, name) of START annotations on this device whose name matches."""
        return [(a.row, a.name) for a in self.snapshot.annotations
                if a.device == self.device and a.stage == "START" and pattern.search(a.name)]

    def add_categories(self, user: dict[str, re.Pattern]) -> None:
        """User categories (`--category NAME=REGEX`): a block whose stack frames (`name
        file:line`) or open record_function ranges match NAME's regex becomes NAME, the first
        match in the given order winning. Applied after the built-in classification and after
        the rules ran, so rules always see the built-in categories."""
        if not user or not len(self.lt):
            return
        _ = self.layout  # the dimensions in use, read from the built-in categories first
        names = list(self.category_names)
        codes = []
        for name in user:
            if name not in names:
                names.append(name)
            codes.append(names.index(name))
        if len(names) > np.iinfo(self.category.dtype).max:
            raise ValueError(f"too many categories ({len(names)})")
        ctx_of = self.tl.ctx[np.clip(self.lt.alloc_row, 0, None)] if len(self.tl.ctx) else \
            np.zeros(len(self.lt), np.int32)
        ctx_of = np.where(self.lt.alloc_row >= 0, ctx_of, 0)
        n_ctx = max(len(self.tl.contexts), 1)
        keys, inverse = _distinct(self.lt.stack.astype(np.int64) * n_ctx + ctx_of)
        new = np.full(len(keys), -1, np.int64)
        for i, k in enumerate(keys.tolist()):  # once per distinct (stack, ranges) pair
            stack_id, c = divmod(k, n_ctx)
            texts = [f"{f.name} {f.filename}:{f.line}"
                     for f in self.snapshot.stack_frames(stack_id)]
            texts += list(self.tl.contexts[c]) if self.tl.contexts else []
            new[i] = next((code for code, pat in zip(codes, user.values())
                           if any(pat.search(t) for t in texts)), -1)
        hit = new[inverse]
        self.category[hit >= 0] = hit[hit >= 0]
        self.category_names = tuple(names)

    def phase_name(self, row: int) -> str:
        return Phase(int(self.tl.phase[row])).label if 0 <= row < len(self.tl.phase) else "init"


def _distinct(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(keys, return_inverse=True)` for (stack, ranges) keys. They are dense (stack
    ids count up from -1, ranges contexts from 0), so a table over their span replaces the sort
    when the span is within a few times their number (a 3M-key sort was 0.3 s)."""
    if not len(keys):
        return keys, np.zeros(0, np.intp)
    lo, hi = int(keys.min()), int(keys.max())
    if hi - lo > 4 * len(keys) + 1024:
        return np.unique(keys, return_inverse=True)
    seen = np.zeros(hi - lo + 1, bool)
    seen[keys - lo] = True
    slot = np.cumsum(seen) - 1
    return np.flatnonzero(seen) + lo, slot[keys - lo]


def analyse(snapshot: Snapshot, trace: Trace, lt: lifetimes.Lifetimes | None = None,
            cols: dict[str, np.ndarray] | None = None) -> DeviceAnalysis:
    """The analysis of one device's trace; `lt`: its lifetimes already paired (the cache's,
    `doccache.report`), else paired here; `cols`: the columns `columns` gave of an earlier
    analysis of this trace and these lifetimes (the cache's): the distinct (stack, ranges)
    keys, each block's index into them and each row's phase and iteration, so that only the
    classification of each key (the stacks' text) runs again."""
    lt = lifetimes.compute(snapshot, trace) if lt is None else lt
    ctx, contexts = phases.range_context(snapshot.annotations, trace.device, len(trace))
    # Classify each distinct (stack, ranges) pair once: rows first (phase hints), then blocks.
    n_ctx = max(len(contexts), 1)
    if cols is None:
        row_key = trace.stack.astype(np.int64) * n_ctx + ctx
        blk_ctx = np.where(lt.alloc_row >= 0,
                           ctx[np.clip(lt.alloc_row, 0, max(len(ctx) - 1, 0))]
                           if len(ctx) else 0, 0)
        blk_key = lt.stack.astype(np.int64) * n_ctx + blk_ctx
        keys, inverse = _distinct(np.concatenate([row_key, blk_key]))
    else:
        keys = cols["keys"]
    infos = []
    for k in keys.tolist():
        stack_id, c = divmod(k, n_ctx)
        frames = snapshot.stack_frames(stack_id) if stack_id != NO_STACK else []
        infos.append(classify(frames, contexts[c] if contexts else ()))
    infos = name_fsdp1_units(snapshot, infos, [k // n_ctx for k in keys.tolist()])
    hint_of = np.array([i.phase for i in infos], np.int8)
    # no Python frame: on CUDA, made by a backward op on the autograd thread (C++ frames only
    # with stacks="all", none with "python")
    pyless = np.array([not i.has_frames for i in infos], bool)
    engine = np.array([i.autograd for i in infos], bool)
    if cols is None:
        row_info = inverse[: len(row_key)]
        blk_info = inverse[len(row_key):].astype(np.int32)
        hints = hint_of[row_info]
        # an allocation the autograd engine made (C++ frames) with no other hint is backward
        hints[(hints == Phase.UNKNOWN) & engine[row_info] & (trace.action == ALLOC)] = \
            Phase.BACKWARD
        tl = phases.assign(trace, hints, lt.live, ctx, contexts, pyless[row_info])
    else:
        blk_info = cols["info"]
        tl = phases.timeline(cols["phase"], cols["iteration"], lt.live, ctx, contexts)

    cat = np.array([CAT_CODE[i.category] for i in infos], np.int8)[blk_info] if len(infos) \
        else np.zeros(0, np.int8)
    path = np.array([PATH_CODE[i.path] if i.path else -1 for i in infos], np.int8)[blk_info] \
        if len(infos) else np.zeros(0, np.int8)
    born = lt.alloc_row >= 0
    rows = np.clip(lt.alloc_row, 0, max(len(trace) - 1, 0))
    phase = np.where(born, tl.phase[rows] if len(trace) else Phase.INIT, Phase.INIT).astype(np.int8)
    iteration = np.where(born, tl.iteration[rows] if len(trace) else -1, -1).astype(np.int32)
    # A block whose stack names no category is what the phase of its alloc row makes: one with
    # no Python frames (on CUDA: a backward op on the autograd thread), and one made by the
    # user's own code outside any module call (a loss computed after `model(x)`, a function
    # called on a module's output: MAGMA27's `cross_entropy` -> `log_softmax`, 7% of its peak).
    # Only the phases whose product is certain: init and optimizer-phase user code makes
    # inputs, temporaries and leaks as much as parameters or states, so those stay `other`.
    unnamed = cat == CAT_CODE[Category.OTHER]
    for ph, c in ((Phase.FORWARD, Category.ACTIVATION), (Phase.BACKWARD, Category.GRADIENT),
                  (Phase.RECOMPUTE, Category.RECOMPUTE_ACTIVATION)):
        cat[unnamed & (phase == ph)] = CAT_CODE[c]
    # ... and one made before any forward (a model of plain functions, no module call to mark
    # it: silmont2000's attention, 17% of its peak) that a backward frees: the autograd engine
    # frees what a forward saved once the backward consumed it, so it was an activation.
    if len(trace):
        freed = lt.free_row < lt.rows
        fph = tl.phase[np.clip(lt.free_row, 0, len(trace) - 1)]
        cat[unnamed & (cat == CAT_CODE[Category.OTHER]) & np.isin(phase, (Phase.INIT,
            Phase.UNKNOWN)) & born & freed & np.isin(fph, BACKWARD_PHASES)] = \
            CAT_CODE[Category.ACTIVATION]
    # A free with no alloc only shows where it was freed; what made it is not in the file.
    untraced = (lt.alloc_row < 0) & ((lt.free_row < lt.rows) | pyless[blk_info]) if len(infos) \
        else lt.alloc_row < 0
    cat[untraced] = CAT_CODE[Category.UNTRACED]
    d = DeviceAnalysis(snapshot, trace, lt, tl, infos, blk_info, cat, path, phase, iteration,
                       keys=keys)
    _split_sharded_grads(d)
    _split_ddp_grad_copies(d)
    _split_moe_exchanges(d)
    name_fsdp1_from_names(d)
    name_fsdp1_backward(d)
    return d


def columns(d: DeviceAnalysis) -> dict[str, np.ndarray]:
    """What `analyse(..., cols=)` takes again of `d` (its keys, each block's index into them,
    each row's phase and iteration)."""
    return {"keys": d.keys, "info": d.info, "phase": d.tl.phase, "iteration": d.tl.iteration}


# DDP's forward is a record_function range (`DistributedDataParallel.forward`, in every CPU
# recording and on CUDA with `global_record_annotations`): a run whose buckets were made before
# the recording started still shows it.
DDP_FORWARD_RANGE = "DistributedDataParallel.forward"


def _is_ddp(d: DeviceAnalysis) -> bool:
    return bool(d.mask(Category.DDP_BUCKET).any()) or any(
        DDP_FORWARD_RANGE in c for c in d.tl.contexts)


def _split_ddp_grad_copies(d: DeviceAnalysis) -> None:
    """Under DDP a gradient made in backward that outlives that backward is a parameter's
    `.grad` kept as its own tensor beside the bucket slice holding the same values
    (`gradient_as_bucket_view=False`: the Reducer copies it into the bucket, all-reduces the
    bucket, copies it back). With the views the autograd engine's fresh gradient is freed in the
    Reducer's hook, inside the backward that made it: nothing made in backward outlives it but
    what the user keeps."""
    if not _is_ddp(d):
        return
    lt = d.lt
    grads = np.flatnonzero((d.category == CAT_CODE[Category.GRADIENT]) & (lt.size > 64) &
                           np.isin(d.phase, BACKWARD_PHASES) & (lt.alloc_row >= 0))
    for b in grads.tolist():
        it = d.tl.iteration_of(int(lt.alloc_row[b]))
        end = it.backward_end if it and it.backward_end >= 0 else -1
        if end >= 0 and lt.free_row[b] > end:
            d.category[b] = CAT_CODE[Category.DDP_GRAD_COPY]


def _split_moe_exchanges(d: DeviceAnalysis) -> None:
    """An MoE all-to-all no dispatch- or combine-named call made (`classify._moe_category`:
    DeepSpeed's and fairscale's `_AllToAll`, called from `MOELayer.forward` both ways) takes its
    kind from the forward around it: the one made after the experts' work (a block of the
    forward that is no MoE buffer, made since the last dispatch buffer) is the combine's; one
    made right after a combine buffer (a tensor-parallel `gather_tokens` after the exchange
    back) is the combine's too; any other starts or continues a dispatch."""
    if not any(i.exchange for i in d.infos):
        return
    lt = d.lt
    exchange = np.array([i.exchange for i in d.infos], bool)[d.info]
    disp, comb = CAT_CODE[Category.MOE_DISPATCH], CAT_CODE[Category.MOE_COMBINE]
    fwd = np.flatnonzero((d.phase == Phase.FORWARD) & (lt.alloc_row >= 0))
    fwd = fwd[np.argsort(lt.alloc_row[fwd], kind="stable")]
    at = np.flatnonzero(np.isin(d.category[fwd], (disp, comb)))  # the MoE blocks' places
    # work since the previous MoE block: another forward block made between the two
    work = np.diff(at, prepend=-1) > 1
    last = -1
    for b, w in zip(fwd[at].tolist(), work.tolist()):
        c = int(d.category[b])
        if exchange[b]:
            after_experts, gather_back = last == disp and w, last == comb and not w
            c = comb if after_experts or gather_back else disp
            d.category[b] = c
        last = c


def _split_sharded_grads(d: DeviceAnalysis) -> None:
    """A reduce-scatter output that outlives its backward became `param.grad`: a sharded grad."""
    rs = np.flatnonzero(d.category == CAT_CODE[Category.REDUCE_SCATTER])
    for b in rs.tolist():
        it = d.tl.iteration_of(int(d.lt.alloc_row[b]))
        end = it.backward_end if it and it.backward_end >= 0 else -1
        if d.phase[b] in BACKWARD_PHASES and end >= 0 and d.lt.free_row[b] > end:
            d.category[b] = CAT_CODE[Category.SHARDED_GRAD]
