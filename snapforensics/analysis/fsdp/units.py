"""What FSDP did on one device: unshard events and units, the world size, stale, leaked and
deferred unshards, where a reshard would have freed them.

The `fsdp_*` rules share these facts through `DeviceAnalysis.fsdp`: each is computed from the
per-block arrays of one DeviceAnalysis on first use and kept, so each rule stays one numpy pass.

An *unshard event* is one all-gather of one FSDP unit: for FSDP2 the run of per-parameter
unsharded-param blocks that one `foreach_all_gather_copy_out` allocates back to back, for FSDP1
the padded unsharded flat parameter (`_alloc_padded_unsharded_flat_param`, which is the
all-gather output itself). A *unit* is named by its FQN when the trace carries FSDP2's
`FSDP::... (fqn)` ranges (the root is "(root)"); otherwise events stand for units.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from snapforensics.analysis.classify import PATHS
from snapforensics.analysis.fsdp import ranges as fsdp_ranges
from snapforensics.analysis.phases import Iteration
from snapforensics.analysis.stacks import python_frames
from snapforensics.analysis.vocab import BACKWARD_PHASES, CAT_CODE, Category, Phase

if TYPE_CHECKING:
    from snapforensics.analysis.context import DeviceAnalysis

ROOT = "(root)"

# Transient copies a collective backend makes of an all-gather buffer (gloo's same-size buffer,
# c10d's list all-gather): not a unit's unsharded memory.
_BACKEND_PREFIXES = ("c10d::", "gloo:", "nccl:", "hccl:")
# All-gather *inputs* (the shard cast to param_dtype): FSDP2, FSDP1's `_mp_shard`.
_AG_INPUT_FUNCS = {"_get_param_all_gather_inputs", "_use_low_precision_shard"}
_FSDP1_FLAT = "_alloc_padded_unsharded_flat_param"
_UNSHARD, _COPY_OUT = "wait_for_unshard", "foreach_all_gather_copy_out"  # FSDP2's param group
_NO_SHARD_REDUCE = "_reduce_grad_no_shard"  # FSDP1's post-backward under NO_SHARD
_REPLICATE_FILE = "_composable/replicate_with_fsdp.py"
_POST_FORWARD = "to_sharded_post_forward"  # FSDP2's reshard to N ranks (reshard_after_forward=N)
_C10D = "<c10d>"
_C10D_FILES = ("distributed/distributed_c10d.py", "distributed/c10d_logger.py",
               "distributed/_functional_collectives.py")

# A unit's parameters gathered for its backward are freed by its own post-backward. One other
# unit's gradient reduction may happen meanwhile (the next unit is prefetched while the current
# one finishes); living through more of them means nobody resharded it.
MAX_FOREIGN_REDUCTIONS = 2


class StackFlags(NamedTuple):
    """Per-block flags read off the stacks of all-gather / unsharded-param blocks."""

    primary: np.ndarray  # bool: a unit's full unshard output
    ag_input: np.ndarray  # bool: an all-gather input (mp shard)
    fsdp1_flat: np.ndarray  # bool: FSDP1 unsharded flat param


class WorldSize(NamedTuple):
    size: int | None  # None when neither the recorder nor the reduce-scatters say it
    estimated: bool  # from reduce-scatter sizes near each other, not the recorder


class FsdpUnits:
    """The FSDP facts of one device; each is computed on first use, then kept."""

    def __init__(self, d: DeviceAnalysis) -> None:
        self._d = d
        self._names: dict[int, frozenset[str]] = {}

    def names(self, stack_id: int) -> frozenset[str]:
        """`_stack_names` of one stack, read once for every fact below."""
        names = self._names.get(stack_id)
        if names is None:
            names = self._names[stack_id] = _stack_names(self._d, stack_id)
        return names

    @cached_property
    def flags(self) -> StackFlags:
        d = self._d
        n = len(d.lt)
        primary, ag_input, fsdp1_flat = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
        ag = d.category == CAT_CODE[Category.ALL_GATHER]
        un = d.category == CAT_CODE[Category.UNSHARDED_PARAM]
        for b in np.flatnonzero(ag | un).tolist():
            names = self.names(int(d.lt.stack[b]))
            if un[b]:
                if _FSDP1_FLAT in names:
                    fsdp1_flat[b] = primary[b] = True
                continue
            if names & _AG_INPUT_FUNCS:
                ag_input[b] = True
            elif names and _C10D not in names and \
                    not any(x.startswith(_BACKEND_PREFIXES) for x in names):
                # FSDP allocates its all-gather output from Python (`allocate`,
                # `all_gather_copy_in`): a frameless all-gather block is a collective's
                # worker-thread buffer.
                primary[b] = True
        return StackFlags(primary, ag_input, fsdp1_flat)

    @property
    def primary(self) -> np.ndarray:
        return self.flags.primary

    @property
    def ag_input(self) -> np.ndarray:
        return self.flags.ag_input

    @property
    def fsdp1_flat(self) -> np.ndarray:
        return self.flags.fsdp1_flat

    @cached_property
    def event(self) -> np.ndarray:
        """Unshard event id per block (-1 if none): unsharded-param blocks grouped into events
        (see the module docstring)."""
        d = self._d
        flat = self.fsdp1_flat
        ev = np.full(len(d.lt), -1, np.int64)
        idx = np.flatnonzero((d.category == CAT_CODE[Category.UNSHARDED_PARAM]) &
                             (d.lt.alloc_row >= 0))
        if not idx.size:
            return ev
        idx = idx[np.argsort(d.lt.alloc_row[idx], kind="stable")]
        cur = -1
        prev: tuple[int, tuple] | None = None
        for b in idx.tolist():
            key = (d.module_of(b), int(d.phase[b]), int(d.path[b]), int(d.iteration[b]))
            new = prev is None or flat[b] or b != prev[0] + 1 or key != prev[1] or \
                flat[prev[0]]
            if new:
                cur += 1
            ev[b] = cur
            prev = (b, key)
        return ev

    @cached_property
    def post_forward_shards(self) -> np.ndarray:
        """bool per block: a parameter's post-forward shard (`FSDPParam.to_sharded_post_forward`,
        fsdp/_fully_shard/_fsdp_param.py): what FSDP2 keeps from forward to backward under
        `reshard_after_forward=N` (an int: resharded to N ranks, not the W it shards over), a
        1/N slice cloned out of the all-gather output at the unit's post-forward."""
        d = self._d
        out = np.zeros(len(d.lt), bool)
        un = np.flatnonzero(d.mask(Category.UNSHARDED_PARAM))
        for sid in np.unique(d.lt.stack[un]).tolist():
            if _POST_FORWARD in self.names(int(sid)):
                out[un[d.lt.stack[un] == sid]] = True
        return out

    @cached_property
    def replicated(self) -> bool:
        """The FSDP units hold every parameter whole on ranks that run data parallel (shard
        size 1 over a world above 1): `replicate()` (torch/distributed/_composable/
        replicate_with_fsdp.py, torchtitan's DDP), FSDP1's NO_SHARD. At shard size 1 FSDP2
        gathers nothing: `wait_for_unshard` copies each parameter into its unsharded buffer
        itself, where a sharded group fills that buffer in `foreach_all_gather_copy_out`
        (fsdp/_fully_shard/_fsdp_param_group.py); every unit must show it (a MoE's experts at
        shard size 1 beside sharded layers gather the rest), and the world must be wider than
        one rank or replicate's own frames be there (fully_shard on one GPU is not data
        parallel). FSDP1's NO_SHARD unshards nothing at all: a trace whose forward ran under
        FSDP1's `forward` with no unsharded flat parameter, or one that shows its post-backward
        all-reducing a gradient whole (`_reduce_grad_no_shard`, fsdp/_runtime_utils.py: on CUDA
        that divides in place and allocates nothing)."""
        d = self._d
        if d.mask(Category.ALL_GATHER).any():
            return False
        un = np.flatnonzero(d.mask(Category.UNSHARDED_PARAM))
        if not un.size:
            return any(f.name == _NO_SHARD_REDUCE or _is_fsdp1_forward(f)
                       for f in d.snapshot.frames) and (d.phase == Phase.FORWARD).any()
        for sid in np.unique(d.lt.stack[un]).tolist():
            names = self.names(int(sid))
            if _UNSHARD not in names or _COPY_OUT in names:
                return False
        world = d.layout.world or 1
        return world > 1 or any(f.filename.replace("\\", "/").endswith(_REPLICATE_FILE)
                                for f in d.snapshot.frames)

    @cached_property
    def world(self) -> WorldSize:
        """The number of ranks parameters are sharded over: the reduce-scatter input/output ratio
        of one unit (HSDP shards over one dimension of its mesh, fewer than the recorder's world
        size), else the dp_shard degree the recorder noted (analysis/mesh.py: its process group,
        or the world size); `estimated` when the recorder did not say. 1 at shard size 1
        (`replicated`)."""
        d = self._d
        if self.replicated:  # every rank holds every parameter whole
            return WorldSize(1, False)
        recorded = d.layout.degree("dp_shard")
        rs = np.flatnonzero(d.mask(Category.REDUCE_SCATTER))
        sg = np.flatnonzero(d.mask(Category.SHARDED_GRAD))
        ratios = []
        if rs.size and sg.size:
            rs_rows = d.lt.alloc_row[rs]
            for b in sg.tolist():  # the reduce input is allocated a few rows from its output
                a, n = int(d.lt.alloc_row[b]), int(d.lt.size[b])
                near = rs[(np.abs(rs_rows - a) <= 64) & (d.lt.size[rs] > n)]
                if near.size and n:
                    nearest = near[np.argmin(np.abs(d.lt.alloc_row[near] - a))]
                    ratios.append(int(d.lt.size[nearest]) / n)
        if ratios:
            r = float(np.median(ratios))
            fits = recorded is None or round(r) <= recorded
            if r >= 1.5 and abs(r - round(r)) < 0.1 and fits:
                return WorldSize(int(round(r)), recorded is None)
        if recorded is not None:
            return WorldSize(recorded, False)
        return WorldSize(None, False)

    @cached_property
    def backward_prefetch(self) -> bool | None:
        """Does this run gather a unit's parameters for backward ahead of its pre-backward
        (backward prefetch)? True when a backward unshard was made on FSDP's prefetch path
        (FSDP2 `_backward_prefetch`, FSDP1 `_prefetch_handle` under `_pre_backward_prefetch` /
        `_post_backward_prefetch`: FSDP1 enters those ranges with prefetch off too, but then
        returns before unsharding, so nothing is made there), False when an iteration gathered
        two or more units in backward and none of them so, None when no iteration did (units
        kept from forward, SHARD_GRAD_OP / reshard_after_forward=False: the trace cannot say)."""
        d = self._d
        bw = np.isin(d.phase, BACKWARD_PHASES) & (d.iteration >= 0) & ~self.stale
        gathers = bw & (self.primary | (self.event >= 0))  # all-gather outputs, unshards
        if (d.path[gathers] == PATHS.index("prefetch")).any():
            return True
        un = bw & (self.event >= 0)
        if not un.any():
            return None
        pairs = np.unique(np.stack([d.iteration[un], self.event[un]]), axis=1)
        _, counts = np.unique(pairs[0], return_counts=True)
        return False if (counts >= 2).any() else None

    @cached_property
    def stale(self) -> np.ndarray:
        """Bool per block: an unshard made during backward that nothing used, freed only when
        backward finalizes.

        A block counts when it is a unit's all-gather output (or FSDP1 flat parameter) allocated
        in backward/recompute, freed before its iteration's backward ends (later is the
        not-resharded bug) and released only by FSDP's end-of-backward cleanup
        (`finalize_backward`, FSDP1 `_catch_all_reshard`): freed after that backward's last
        reduce-scatter. When units are named, an FSDP2 all-gather buffer must also be unused (no
        copy-out of its unit while it was alive), and then also counts when it outlived two
        other units' all-gathers.
        """
        d = self._d
        primary, fsdp1_flat = self.primary, self.fsdp1_flat
        out = np.zeros(len(d.lt), bool)
        cand = primary & np.isin(d.phase, BACKWARD_PHASES) & \
            (d.iteration >= 0) & (d.lt.alloc_row >= 0)
        rs = np.flatnonzero(d.mask(Category.REDUCE_SCATTER, Category.SHARDED_GRAD) &
                            (d.iteration >= 0))
        un = np.flatnonzero(d.mask(Category.UNSHARDED_PARAM) & ~fsdp1_flat)
        last_rs: dict[int, int] = {}
        for b in rs.tolist():
            i = int(d.iteration[b])
            last_rs[i] = max(last_rs.get(i, -1), int(d.lt.alloc_row[b]))
        acc: dict[str, list[int]] = {}
        for b in un.tolist():
            m = d.module_of(b)
            if m is not None:
                acc.setdefault(m, []).append(int(d.lt.alloc_row[b]))
        un_by_mod = {m: np.array(sorted(v), np.int64) for m, v in acc.items()}
        prim = np.flatnonzero(primary & (d.lt.alloc_row >= 0))
        prim = prim[np.argsort(d.lt.alloc_row[prim], kind="stable")]
        prim_rows = d.lt.alloc_row[prim]
        for b in np.flatnonzero(cand).tolist():
            it = d.tl.iterations[int(d.iteration[b])]
            a, fr = int(d.lt.alloc_row[b]), int(d.lt.free_row[b])
            if it.backward_end < 0 or fr > it.backward_end:
                continue
            lr = last_rs.get(it.index, -1)
            tail = lr >= 0 and a < lr < fr
            m = d.module_of(b)
            if m is None or fsdp1_flat[b]:
                out[b] = tail  # unnamed: released only by the final callback
                continue
            rows = un_by_mod.get(m, np.zeros(0, np.int64))
            lo, hi = np.searchsorted(rows, [a, fr], side="right")
            if hi > lo:
                continue  # its unit copied out of it: used
            # unused, and released at the end or alive across two other units' all-gathers
            lo, hi = np.searchsorted(prim_rows, [a, fr], side="right")
            if tail or len({d.module_of(o) for o in prim[lo:hi].tolist()} - {m}) >= 2:
                out[b] = True
        return out

    @cached_property
    def leaked(self) -> np.ndarray:
        """Blocks of `outlived` that nothing deliberate explains: never resharded within their
        optimizer step (the seed bug), or released only by the final callback."""
        return np.setdiff1d(self.outlived, self.deferred)

    @cached_property
    def deferred(self) -> np.ndarray:
        """Blocks of `outlived` kept on purpose for gradient accumulation: made in a non-final
        micro-batch and freed by the end of its step's final micro-batch's backward, which is
        what `set_reshard_after_backward(is_last_microbatch)` does (the recipe its docstring
        gives: parameters stay unsharded between micro-batches and are resharded on the last)."""
        d = self._d
        out = []
        for b in self.outlived.tolist():
            it = d.tl.iterations[int(d.iteration[b])]
            if it.last_micro_batch:
                continue
            last = d.tl.last_of_step(it)
            if 0 <= last.backward_end and int(d.lt.free_row[b]) <= last.backward_end:
                out.append(b)
        return np.array(out, np.int64)

    @cached_property
    def outlived(self) -> np.ndarray:
        """Unsharded-param blocks made in backward that outlive their unit's backward.

        Either still alive when the iteration's backward ends (never resharded), or alive across
        more than MAX_FOREIGN_REDUCTIONS other units' gradient reductions (released only by the
        root's final callback, i.e. at the end of backward).
        """
        d = self._d
        idx = np.flatnonzero(d.mask(Category.UNSHARDED_PARAM) &
                             np.isin(d.phase, BACKWARD_PHASES) &
                             (d.iteration >= 0))
        if not idx.size:
            return idx
        ends = np.array([d.tl.iterations[i].backward_end for i in d.iteration[idx]], np.int64)
        past_end = (ends >= 0) & (d.lt.free_row[idx] > ends)
        grads = np.flatnonzero(d.mask(Category.SHARDED_GRAD, Category.REDUCE_SCATTER))
        order = np.argsort(d.lt.alloc_row[grads])
        g_rows = d.lt.alloc_row[grads][order]
        g_mod = [d.module_of(int(b)) for b in grads[order]]
        # Without unit names, one reduction = one run of reduce-scatter allocations with no
        # other allocation between them (input, output, casts: however many the version makes).
        alloc_rank = np.searchsorted(np.sort(d.lt.alloc_row[d.lt.alloc_row >= 0]), g_rows)
        g_event = np.concatenate([[0], np.cumsum(np.diff(alloc_rank) > 1)]) if len(g_rows) \
            else g_rows
        lo = np.searchsorted(g_rows, d.lt.alloc_row[idx], side="right")
        hi = np.searchsorted(g_rows, d.lt.free_row[idx], side="left")
        foreign = np.zeros(len(idx), bool)
        for k, b in enumerate(idx.tolist()):
            if hi[k] - lo[k] > MAX_FOREIGN_REDUCTIONS:
                own = d.module_of(b)
                mods = {m for m in g_mod[lo[k]:hi[k]] if m is None or m != own}
                n = len(mods) if None not in mods else len(set(g_event[lo[k]:hi[k]].tolist()))
                foreign[k] = n > MAX_FOREIGN_REDUCTIONS
        return idx[past_end | foreign]


def reshard_rows(d: DeviceAnalysis, blocks: np.ndarray, *, per_micro_batch: bool = False
                 ) -> np.ndarray:
    """Where a reshard would have freed each block: its unit's post-backward, in the final
    micro-batch of the block's optimizer step (what `set_reshard_after_backward(is_last)` does),
    or with `per_micro_batch` in the block's own micro-batch (resharding every micro-batch).

    Prefer the unit's own `FSDP::post_backward_* (fqn)` range; else the first reduce-scatter
    allocated for that unit; else the first reduce-scatter after the block; else backward end.
    """
    post = fsdp_ranges.rows_by_unit(d.annotation_rows(fsdp_ranges.RANGE),
                                    fsdp_ranges.POST_BACKWARD)
    rs = np.flatnonzero(d.mask(Category.REDUCE_SCATTER, Category.SHARDED_GRAD))
    rs_rows = np.sort(d.lt.alloc_row[rs])
    rs_by_mod: dict[str, list[int]] = {}
    for b in rs.tolist():
        m = d.module_of(b)
        if m:
            rs_by_mod.setdefault(m, []).append(int(d.lt.alloc_row[b]))
    out = d.lt.free_row[blocks].copy()
    for k, b in enumerate(blocks.tolist()):
        a = int(d.lt.alloc_row[b])
        it = d.tl.iteration_of(a)
        if it is not None and not per_micro_batch:
            it = d.tl.last_of_step(it)
        end = it.backward_end if it else d.lt.rows - 1
        after = max(a, it.backward_start) if it is not None else a
        unit = d.module_of(b) or ""
        cands = post.get(unit, []) or sorted(rs_by_mod.get(unit, []))
        nxt = [r for r in cands if r > after]
        if not nxt and not cands:
            nxt = rs_rows[rs_rows > after][:1].tolist()
        target = nxt[0] if nxt and nxt[0] <= end else end + 1
        out[k] = min(int(out[k]), target)
    return out


def _stack_names(d: DeviceAnalysis, stack_id: int) -> frozenset[str]:
    """Frame names of a stack, plus the marker _C10D when a frame is in the c10d Python layer
    (the collective's own allocation, e.g. gloo's same-size all-gather buffer)."""
    frames = python_frames(d.snapshot.stack_frames(stack_id)) if stack_id >= 0 else []
    names = {fr.name for fr in frames}
    if any(fr.filename.replace("\\", "/").endswith(_C10D_FILES) for fr in frames):
        names.add(_C10D)
    return frozenset(names)


def unit_of_event(d: DeviceAnalysis, blocks: np.ndarray) -> str | None:
    """The unit an unshard event's blocks belong to (None when unnamed or mixed)."""
    mods = {d.module_of(b) for b in blocks.tolist()} - {None}
    return next(iter(mods)) if len(mods) == 1 else None


def forward_end(it: Iteration) -> int:
    """Last row of an iteration's forward (the row before its backward starts)."""
    return (it.backward_start - 1) if it.backward_start >= 0 else it.end


# FSDP1's forward (`FullyShardedDataParallel.forward`): a module frame whose own frames (those
# down to the next module frame inward) hold it is an FSDP1 wrapper, whatever its class is
# called (a subclass of FullyShardedDataParallel is named after itself: `OnCPU_0`).
_FSDP1_FORWARD = ("forward", "distributed/fsdp/fully_sharded_data_parallel.py")


def _is_fsdp1_forward(f) -> bool:
    return f.name == _FSDP1_FORWARD[0] and \
        f.filename.replace("\\", "/").endswith(_FSDP1_FORWARD[1])


# wrappers between an FSDP1 unit and the module it holds (checkpoint_wrapper, offload_wrapper)
_WRAPPERS = re.compile(r"^(CheckpointWrapper|OffloadWrapper)_\d+$")


def _module_chain(frames: list) -> list[tuple[str, bool]]:
    """(module instance, is an FSDP1 wrapper) of a stack's module frames, outermost first.

    The CPU recorder writes a module's frame just outside the frames of its `forward`, so a
    module frame is an FSDP1 wrapper when FSDP1's `forward` is among the frames between it and
    the next module frame inward (its own forward, and a subclass's forward around it)."""
    out: list[tuple[str, bool]] = []
    fsdp_forward = False
    for f in frames:  # innermost first
        if f.filename == "<nn.Module>":
            out.append((f.name, fsdp_forward))
            fsdp_forward = False
        elif _is_fsdp1_forward(f):
            fsdp_forward = True
    return out[::-1]


def name_fsdp1_units(snapshot, infos: list, stack_ids: list[int]) -> list:
    """FSDP1 units named from the module frames the CPU recorder writes (FSDP1's ranges name no
    unit, and its flat parameter has no FQN in the trace).

    An FSDP1 wrapper's module frame (`FullyShardedDataParallel_K`, or a subclass's: known by
    FSDP1's `forward` running in it, see `_module_chain`) is followed, on the stacks where its
    module runs, by the module it wraps (`LlamaDecoderLayer_2`; through a `CheckpointWrapper_J`):
    that instance names the unit. The outermost wrapper (no wrapper around it on any stack) is
    the root, "(root)" as for FSDP2. An FSDP block whose innermost wrapper frame is K gets K's
    name; blocks with no wrapper frame (made on the autograd thread in backward) are named by
    `name_fsdp1_backward`. `stack_ids[i]` is infos[i]'s stack.
    """
    from dataclasses import replace

    from snapforensics.analysis.vocab import FSDP_CATEGORIES

    chains: dict[int, list[tuple[str, bool]]] = {}
    for s in set(stack_ids):
        if s < 0:
            continue
        mods = _module_chain(snapshot.stack_frames(s))
        if any(w for _, w in mods):
            chains[s] = mods  # outermost first
    if not chains:
        return infos
    wraps: dict[str, str] = {}
    nested: set[str] = set()
    for mods in chains.values():
        seen_wrapper = False
        for i, (m, wrapper) in enumerate(mods):
            if not wrapper:
                continue
            if seen_wrapper:
                nested.add(m)
            seen_wrapper = True
            inner = next((x for x in mods[i + 1:] if not _WRAPPERS.match(x[0])), None)
            if inner is not None and not inner[1]:
                wraps.setdefault(m, inner[0])
    out = list(infos)
    for i, (info, s) in enumerate(zip(infos, stack_ids)):
        if info.module is not None or info.category not in FSDP_CATEGORIES or s not in chains:
            continue
        unit = [m for m, wrapper in chains[s] if wrapper][-1]
        name = ROOT if unit not in nested else wraps.get(unit)
        if name:
            out[i] = replace(info, module=name)
    return out


def name_fsdp1_from_names(d: DeviceAnalysis) -> None:
    """FSDP1 unshards named by the recorder's names (`record/identity.py`) where no module
    frame names any of them (CUDA traces have none; where frames name some,
    `name_fsdp1_units` / `name_fsdp1_backward` name them all, in their scheme): the padded
    unsharded flat parameter is observed after its all-gather as the unit's
    (`<unit>._flat_param`, module the path of the handle's module). The path's FSDP wrapper
    segments are dropped (`_fsdp_wrapped_module`): the outermost unit, whose module is the
    root's, is "(root)"."""
    from snapforensics.analysis.identity import WRAPPERS

    names = d.names
    if names is None or not names.matched:
        return
    flat = np.flatnonzero(d.fsdp.fsdp1_flat)
    if any(d.module_of(b) is not None for b in flat.tolist()):
        return  # module frames name the units (CPU recordings): one naming, theirs
    for b in flat.tolist():
        if names.kind(b) != "unsharded_parameter":
            continue
        module = names.module(b)
        if module is None:
            continue
        d.block_module[b] = WRAPPERS.sub("", module).strip(".") or ROOT


def name_fsdp1_backward(d: DeviceAnalysis) -> None:
    """FSDP1 gathers made for backward on the autograd thread carry no module frame: each is
    named after the unit it gathers, so that a unit's gathers are named alike in forward and
    backward (a run with some of them named and others not hid a unit gathered twice).

    FSDP1's pre-backward gathers run the units in reverse forward order (prefetch only moves
    them earlier, not out of order): in each iteration, each unnamed backward gather takes the
    name of the last unit resharded in forward (freed before forward ended) not yet taken, of
    the same flat-parameter size. A named backward gather (a reentrant recompute re-running the
    unit's forward, with its module frames) takes none: its unit's backward gathers again.
    Nothing is named where no forward gather is named (CUDA traces: no module frames)."""
    from snapforensics.analysis.vocab import BACKWARD_PHASES, Phase

    flat = d.fsdp.fsdp1_flat & (d.lt.alloc_row >= 0) & (d.iteration >= 0)
    if not flat.any():
        return
    for it in d.tl.iterations:
        blocks = np.flatnonzero(flat & (d.iteration == it.index))
        blocks = blocks[np.argsort(d.lt.alloc_row[blocks], kind="stable")]
        end = forward_end(it)
        pending = [b for b in blocks.tolist() if d.phase[b] == Phase.FORWARD and
                   d.module_of(b) not in (None, ROOT) and d.lt.free_row[b] <= end]
        if not pending:
            continue
        for b in blocks.tolist():
            if d.phase[b] not in BACKWARD_PHASES or d.module_of(b) is not None:
                continue
            size = int(d.lt.size[b])
            j = next((j for j in range(len(pending) - 1, -1, -1)
                      if int(d.lt.size[pending[j]]) == size), None)
            if j is not None:
                name = d.module_of(pending.pop(j))
                if name is not None:
                    d.block_module[b] = name
