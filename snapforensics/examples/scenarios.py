"""A matrix of small training layouts, each recorded into its own snapshot, with ground truth.

    python -m snapforensics.examples.scenarios --out DIR                 # every 2-rank layout
    python -m snapforensics.examples.scenarios --out DIR --world 4       # the 2x2-mesh ones
    python -m snapforensics.examples.scenarios --out DIR --only f2_block_cw,f2_block_cw_rab_false
    python -m snapforensics.examples.scenarios --list

One torch.distributed job (gloo, CPU; ``torch.multiprocessing.spawn`` unless already under
torchrun) runs the layouts in sequence. Each layout is recorded with the project's CPU recorder
(``snapforensics.record.inprocess.recording``) from before the model is built to after its last
optimizer step, into ``DIR/<layout>/rank{R}.pickle``.

``--check`` (on by default; ``--no-check`` to skip) reads FSDP's own state during the run and
writes ``DIR/<layout>/truth.rank{R}.json``: after every forward and backward, the bytes of
unsharded parameter storage still alive (FSDP2: each ``FSDPParam``'s ``all_gather_outputs``
storages; FSDP1: each handle's ``_full_param_padded``), root and non-root separately; the bytes
of unsharded gradients; per backward, how many all-gathers each unit issued and how many of those
were consumed (``wait_for_unshard`` with a pending result), and how many were still pending when
FSDP finalized the backward (issued, never used); the full model's bytes when it was built
before sharding; the bytes a module-held cache keeps after each step. The expected verdicts of a
test come from this file and the layout's configuration, never from ``diagnose``.

Layouts vary: FSDP2 / FSDP1 / DDP / none; units per block, per submodule, grouped
(``fully_shard([a, b])``), root only; ``checkpoint_wrapper``, ``apply_activation_checkpointing``,
``torch.utils.checkpoint`` inside the block (reentrant or not), selective checkpointing,
composable ``checkpoint``, none; meta-device init or build-then-shard; mixed precision; CPU
offload; HSDP on a 2x2 mesh; gradient accumulation done right and wrong; explicit prefetch;
``reshard_after_forward=False`` on some units; a leak through a module-held cache; three model
families (GPT-style transformer, residual MLP, encoder with tied embeddings). Small models (a few
MiB), 3 optimizer steps.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from snapforensics.examples.fsdp_ckpt import Block, Transformer

# ---------------------------------------------------------------------------- models

VOCAB, DIM, HEADS, LAYERS, BATCH, SEQ = 512, 128, 4, 4, 2, 64


class CkptBlock(Block):
    """A block that checkpoints its own body with ``torch.utils.checkpoint`` (inside the unit)."""

    def __init__(self, dim: int, heads: int, mode: str = "nonreentrant"):
        super().__init__(dim, heads)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        body = super().forward
        if self.mode == "reentrant":
            return checkpoint(body, x, use_reentrant=True)
        if self.mode == "selective":
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            save = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
            ctx = functools.partial(create_selective_checkpoint_contexts, save)
            return checkpoint(body, x, use_reentrant=False, context_fn=ctx)
        return checkpoint(body, x, use_reentrant=False)


class CachingBlock(Block):
    """A block that keeps every output it made "for later inspection": a leak through a module."""

    def __init__(self, dim: int, heads: int):
        super().__init__(dim, heads)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        self.seen.append(y)  # holds the output and, through it, its autograd graph
        return y


class TiedEncoder(Transformer):
    """Embedding -> blocks -> norm -> head whose weight *is* the embedding's."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__(vocab, dim, layers, heads)
        self.head.weight = self.embed.weight


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResMLP(nn.Module):
    """A residual MLP classifier (no attention, no embedding)."""

    def __init__(self, dim: int, layers: int, classes: int = 64):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(ResBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


# ---------------------------------------------------------------------------- layouts


@dataclass
class Layout:
    """One scenario: how the model is built, wrapped and trained."""

    name: str
    wrap: Callable  # (Ctx, model) -> model to train (may be the same object)
    family: str = "gpt"  # gpt | encoder | mlp
    block: str = "plain"  # plain | reentrant | nonreentrant | selective | caching
    init: str = "meta"  # meta | build (materialize the full model, then wrap) | local
    world: int = 2
    layers: int = LAYERS
    dim: int = DIM
    micro_batches: int = 1
    accumulation: str = "none"  # none | right | wrong | sync_only | no_sync
    optimizer: str = "adamw"  # adamw | sgd
    steps: int = 3
    twin: str | None = None  # the fixed layout this one should match once its bug is removed
    note: str = ""


@dataclass
class Ctx:
    rank: int
    world: int
    device: torch.device
    mesh: object = None
    mesh2d: object = None


def _fsdp2():
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _shard_blocks(ctx: Ctx, model, *, ac: str = "none", rab: bool = True, mesh=None, last_raf=None,
                  **kw):
    """fully_shard each block (optionally checkpoint_wrapper / composable checkpoint first)."""
    fully_shard = _fsdp2()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    mesh = mesh or ctx.mesh
    units = []
    for i, block in enumerate(model.layers):
        if ac == "wrapper":
            block = checkpoint_wrapper(block)
        elif ac == "composable":
            from torch.distributed._composable import checkpoint

            checkpoint(block)
        extra = dict(kw)
        if last_raf is not None and i >= len(model.layers) - last_raf:
            extra["reshard_after_forward"] = False
        fully_shard(block, mesh=mesh, **extra)
        block.set_reshard_after_backward(rab)
        model.layers[i] = block
        units.append(block)
    root_kw = {k: v for k, v in kw.items() if k in ("mp_policy", "offload_policy")}
    fully_shard(model, mesh=mesh, **root_kw)
    return units


def w_block(ac="none", rab=True, **kw):
    def wrap(ctx, model):
        _shard_blocks(ctx, model, ac=ac, rab=rab, **kw)
        return model
    return wrap


def w_aac(ctx, model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, (Block, ResBlock)))
    _shard_blocks(ctx, model)
    return model


def w_submodules(prefetch: int = 0):
    """fully_shard(attn), fully_shard(mlp) inside checkpoint_wrapper(block)."""
    def wrap(ctx, model):
        fully_shard = _fsdp2()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        units = []
        for i, block in enumerate(model.layers):
            fully_shard(block.attn, mesh=ctx.mesh)
            fully_shard(block.mlp, mesh=ctx.mesh)
            units += [block.attn, block.mlp]
            model.layers[i] = checkpoint_wrapper(block)
        fully_shard(model, mesh=ctx.mesh)
        if prefetch:
            for k, unit in enumerate(units[:-1]):
                unit.set_modules_to_forward_prefetch(units[k + 1:k + 1 + prefetch])
        return model
    return wrap


def w_grouped(ctx, model):
    """checkpoint_wrapper per block, one fully_shard over each pair of blocks."""
    fully_shard = _fsdp2()
    _checkpoint_blocks(model)
    blocks = list(model.layers)
    for k in range(0, len(blocks), 2):
        fully_shard(blocks[k:k + 2], mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    return model


def w_root_only(ac="none"):
    def wrap(ctx, model):
        if ac == "wrapper":
            _checkpoint_blocks(model)
        _fsdp2()(model, mesh=ctx.mesh)
        return model
    return wrap


def w_prefetch(ctx, model):
    """torchtitan-style explicit prefetch: forward one block ahead, backward one block behind."""
    units = _shard_blocks(ctx, model, ac="wrapper")
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])
    return model


def w_mixed(ctx, model):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _shard_blocks(ctx, model, ac="wrapper", mp_policy=mp)
    return model


def w_offload(ctx, model):
    from torch.distributed.fsdp import CPUOffloadPolicy

    _shard_blocks(ctx, model, ac="wrapper", offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model


def w_hsdp(rab=True):
    def wrap(ctx, model):
        _shard_blocks(ctx, model, ac="wrapper", rab=rab, mesh=ctx.mesh2d)
        return model
    return wrap


def _fsdp1(ctx, model, *, strategy="FULL_SHARD", mp=False, blocks=True, aac=True):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    wrap_policy = ModuleWrapPolicy({Block, ResBlock}) if blocks else None
    wrapped = FSDP(model, auto_wrap_policy=wrap_policy,
                   sharding_strategy=ShardingStrategy[strategy], use_orig_params=True,
                   device_id=ctx.device, mixed_precision=policy)
    if aac:
        apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, (Block, ResBlock)))
    return wrapped


def w_fsdp1(**kw):
    return lambda ctx, model: _fsdp1(ctx, model, **kw)


class OuterCheckpoint(nn.Module):
    """HF-style gradient checkpointing: ``checkpoint`` around an (FSDP-wrapped) block."""

    def __init__(self, block: nn.Module, reentrant: bool):
        super().__init__()
        self.block = block
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=self.reentrant)


def w_fsdp1_outer(reentrant: bool):
    def wrap(ctx, model):
        for i, block in enumerate(model.layers):
            model.layers[i] = OuterCheckpoint(block, reentrant)
        return _fsdp1(ctx, model, aac=False)
    return wrap


def _checkpoint_blocks(model) -> None:
    """checkpoint_wrapper(block) for every block, in place."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)


def w_ddp(ac=True):
    def wrap(ctx, model):
        from torch.nn.parallel import DistributedDataParallel as DDP

        if ac:
            _checkpoint_blocks(model)
        return DDP(model)
    return wrap


def w_none(ac=False):
    def wrap(ctx, model):
        if ac:
            _checkpoint_blocks(model)
        return model
    return wrap


def _layouts() -> list[Layout]:
    L = Layout
    cw = w_block(ac="wrapper")
    out = [
        # ---- FSDP2, GPT-style transformer, one unit per block
        L("f2_block_cw", cw, note="checkpoint_wrapper(block), fully_shard(block), meta init"),
        L("f2_block_cw_rab_false", w_block(ac="wrapper", rab=False), twin="f2_block_cw",
          note="the seed bug: set_reshard_after_backward(False), never resharded"),
        L("f2_block_aac", w_aac, note="apply_activation_checkpointing, then fully_shard per block"),
        L("f2_block_inner_ckpt", w_block(), block="nonreentrant",
          note="torch.utils.checkpoint(use_reentrant=False) inside each unit's forward"),
        L("f2_block_inner_reentrant", w_block(), block="reentrant",
          note="torch.utils.checkpoint(use_reentrant=True) inside each unit's forward"),
        L("f2_block_selective", w_block(), block="selective",
          note="selective checkpointing (save matmuls) inside each unit"),
        L("f2_block_composable", w_block(ac="composable"),
          note="torch.distributed._composable.checkpoint(block), fully_shard(block)"),
        L("f2_block_noac", w_block(), note="no checkpointing"),
        L("f2_block_noac_rab_false", w_block(rab=False), twin="f2_block_noac",
          note="no checkpointing, set_reshard_after_backward(False)"),
        L("f2_submodules", w_submodules(), note="fully_shard(attn), fully_shard(mlp) inside "
          "checkpoint_wrapper(block)"),
        L("f2_submodules_prefetch", w_submodules(prefetch=2), twin="f2_submodules",
          note="nested units prefetching the next two: recompute re-gathers a finished unit"),
        L("f2_grouped", w_grouped, note="fully_shard([block_k, block_k+1]), checkpoint_wrapper"),
        L("f2_root_only", w_root_only(), note="fully_shard(model) only, no checkpointing"),
        L("f2_root_only_cw", w_root_only("wrapper"),
          note="fully_shard(model) only, checkpoint_wrapper per block"),
        L("f2_build_then_shard", cw, init="build", twin="f2_block_cw",
          note="model = Net() on the device, then fully_shard (no meta init)"),
        L("f2_mixed_precision", w_mixed, note="MixedPrecisionPolicy(bf16 params, fp32 reduce)"),
        L("f2_cpu_offload", w_offload, note="CPUOffloadPolicy (pin_memory=False)"),
        L("f2_prefetch", w_prefetch, note="explicit forward/backward prefetch, one block"),
        L("f2_raf_false_last2", w_block(ac="wrapper", last_raf=2),
          note="reshard_after_forward=False on the last two blocks"),
        L("f2_ga_right", cw, micro_batches=2, accumulation="right",
          note="gradient accumulation: set_requires_gradient_sync(is_last) and "
               "set_reshard_after_backward(is_last) per micro-batch"),
        L("f2_ga_wrong", cw, micro_batches=2, accumulation="wrong", twin="f2_ga_right",
          note="gradient accumulation with set_reshard_after_backward(False) set once, never True"),
        L("f2_ga_sync_only", cw, micro_batches=2, accumulation="sync_only",
          note="gradient accumulation: set_requires_gradient_sync(is_last) only"),
        L("f2_leak_cache", cw, block="caching", steps=4, twin="f2_block_cw",
          note="every block keeps its outputs (with their graph) in a list"),
        # ---- FSDP2, other families
        L("f2_mlp_cw", cw, family="mlp", note="residual MLP, checkpoint_wrapper, per block"),
        L("f2_mlp_cw_rab_false", w_block(ac="wrapper", rab=False), family="mlp", twin="f2_mlp_cw",
          note="residual MLP, set_reshard_after_backward(False)"),
        L("f2_mlp_noac", w_block(), family="mlp", note="residual MLP, no checkpointing"),
        L("f2_mlp_build", w_block(ac="wrapper"), family="mlp", init="build", twin="f2_mlp_cw",
          note="residual MLP built on the device, then sharded"),
        L("f2_encoder_tied", cw, family="encoder",
          note="encoder with tied embeddings (root unit holds the shared weight)"),
        L("f2_encoder_tied_aac", w_aac, family="encoder", init="build", twin="f2_encoder_tied",
          note="tied encoder, apply_activation_checkpointing, built then sharded"),
        # ---- FSDP1
        L("f1_block_aac", w_fsdp1(), note="FSDP1 FULL_SHARD per block, "
          "apply_activation_checkpointing"),
        L("f1_shard_grad_op_mp", w_fsdp1(strategy="SHARD_GRAD_OP", mp=True),
          note="FSDP1 SHARD_GRAD_OP, bf16 params / fp32 reduce"),
        L("f1_outer_reentrant", w_fsdp1_outer(True), twin="f1_outer_nonreentrant",
          note="HF-style reentrant checkpoint around each FSDP1 unit (double all-gather)"),
        L("f1_outer_nonreentrant", w_fsdp1_outer(False),
          note="non-reentrant checkpoint around each FSDP1 unit"),
        L("f1_root_only", w_fsdp1(blocks=False, aac=False), note="FSDP1 root unit only"),
        L("f1_build_then_shard", w_fsdp1(), init="build", twin="f1_block_aac",
          note="FSDP1 over a materialized model"),
        L("f1_mlp", w_fsdp1(), family="mlp", note="FSDP1 residual MLP per block"),
        L("f1_no_sync", w_fsdp1(), micro_batches=2, accumulation="no_sync",
          note="FSDP1 gradient accumulation inside model.no_sync()"),
        # ---- no FSDP
        L("ddp_gpt_cw", w_ddp(), init="local", note="DDP, checkpoint_wrapper"),
        L("ddp_mlp_ga", w_ddp(ac=False), family="mlp", init="local", micro_batches=2,
          accumulation="no_sync", note="DDP residual MLP, no_sync accumulation"),
        L("plain_gpt", w_none(), init="local", note="no distribution at all"),
        L("plain_encoder_cw", w_none(ac=True), family="encoder", init="local",
          note="no distribution, tied encoder, checkpoint_wrapper"),
        # ---- 4 ranks
        L("hsdp_block_cw", w_hsdp(), world=4, note="HSDP on a 2x2 mesh, checkpoint_wrapper"),
        L("hsdp_rab_false", w_hsdp(rab=False), world=4, twin="hsdp_block_cw",
          note="HSDP 2x2, set_reshard_after_backward(False)"),
        L("f2_deep_meta_w4", cw, family="mlp", world=4, layers=16, optimizer="sgd",
          note="16-block residual MLP, checkpoint_wrapper, SGD, meta init, 4 ranks"),
        L("f2_deep_build_w4", cw, family="mlp", world=4, layers=16, optimizer="sgd",
          init="build", twin="f2_deep_meta_w4",
          note="the same built on the device then sharded: the start-up peak is the run's"),
    ]
    return out


LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in _layouts()}


# ---------------------------------------------------------------------------- truth


class Probe:
    """FSDP's own state, read during the run (``--check``)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.in_backward = False
        self.gathers: dict[str, int] = {}
        self.used: dict[str, int] = {}
        self.pending_at_finalize = 0
        self.fsdp = "none"
        self._undo: list[Callable] = []
        self._fsdp2_groups = []
        self._fsdp1_handles = []
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for name, m in model.named_modules():
            if isinstance(m, FSDPModule):
                self.fsdp = "fsdp2"
                for g in m._get_fsdp_state()._fsdp_param_groups:
                    self._fsdp2_groups.append((name or "(root)", m is model, g))
            elif isinstance(m, FSDP) and m._handle is not None:
                self.fsdp = "fsdp1"
                self._fsdp1_handles.append((name or "(root)", m is model, m._handle))
        self._patch()

    # -- counting all-gathers (patched on the classes for the duration of one layout)
    def _patch(self) -> None:
        probe = self
        if self.fsdp == "fsdp2":
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

            names = {id(g): n for n, _, g in self._fsdp2_groups}
            orig_unshard, orig_wait = FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard
            orig_final = FSDPParamGroup.finalize_backward

            def unshard(self, *a, **k):
                before = self._all_gather_result
                out = orig_unshard(self, *a, **k)
                if probe.in_backward and before is None and self._all_gather_result is not None:
                    n = names.get(id(self), "?")
                    probe.gathers[n] = probe.gathers.get(n, 0) + 1
                return out

            def wait_for_unshard(self, *a, **k):
                if probe.in_backward and self._all_gather_result is not None:
                    n = names.get(id(self), "?")
                    probe.used[n] = probe.used.get(n, 0) + 1
                return orig_wait(self, *a, **k)

            def finalize_backward(self, *a, **k):
                if self._all_gather_result is not None:
                    probe.pending_at_finalize += 1
                return orig_final(self, *a, **k)

            FSDPParamGroup.unshard = unshard
            FSDPParamGroup.wait_for_unshard = wait_for_unshard
            FSDPParamGroup.finalize_backward = finalize_backward

            def undo():
                FSDPParamGroup.unshard = orig_unshard
                FSDPParamGroup.wait_for_unshard = orig_wait
                FSDPParamGroup.finalize_backward = orig_final
            self._undo.append(undo)
        elif self.fsdp == "fsdp1":
            from torch.distributed.fsdp._flat_param import FlatParamHandle

            names = {id(h): n for n, _, h in self._fsdp1_handles}
            orig = FlatParamHandle._all_gather_flat_param

            def all_gather(self, *a, **k):
                if probe.in_backward:
                    n = names.get(id(self), "?")
                    probe.gathers[n] = probe.gathers.get(n, 0) + 1
                    probe.used[n] = probe.used.get(n, 0) + 1  # FSDP1 uses what it gathers
                return orig(self, *a, **k)

            FlatParamHandle._all_gather_flat_param = all_gather
            self._undo.append(lambda: setattr(FlatParamHandle, "_all_gather_flat_param", orig))

    def close(self) -> None:
        for u in self._undo:
            u()
        self._undo.clear()

    # -- bytes of FSDP state alive now
    def unsharded(self) -> dict[str, int]:
        root = other = grads = 0
        seen: set[int] = set()
        for _, is_root, g in self._fsdp2_groups:
            for p in g.fsdp_params:
                for t in p.all_gather_outputs:
                    s = t.untyped_storage()
                    if s.data_ptr() in seen or not s.size():
                        continue
                    seen.add(s.data_ptr())
                    if is_root:
                        root += s.size()
                    else:
                        other += s.size()
                for gr in (getattr(p, "unsharded_accumulated_grad", None),
                           getattr(getattr(p, "_unsharded_param", None), "grad", None)):
                    if gr is not None:
                        grads += gr.untyped_storage().size()
        for _, is_root, h in self._fsdp1_handles:
            fp = h.flat_param
            for attr in ("_full_param_padded", "_full_prec_full_param_padded"):
                t = getattr(fp, attr, None)
                if t is None or not t.untyped_storage().size():
                    continue
                n = t.untyped_storage().size()
                if not h.uses_sharded_strategy:
                    continue
                if is_root:
                    root += n
                else:
                    other += n
            if fp.grad is not None and h.uses_sharded_strategy and \
                    fp.grad.numel() == fp._unpadded_unsharded_size.numel():
                grads += fp.grad.untyped_storage().size()
        return {"root": root, "nonroot": other, "grads": grads}

    def take_backward(self) -> dict:
        out = {"gathers": dict(self.gathers), "used": dict(self.used),
               "pending_at_finalize": self.pending_at_finalize}
        self.gathers.clear()
        self.used.clear()
        self.pending_at_finalize = 0
        return out


def _tensor_bytes(obj) -> int:
    seen: set[int] = set()
    total = 0
    for t in obj:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.size()
    return total


# ---------------------------------------------------------------------------- run


def _build(lay: Layout, device: torch.device) -> nn.Module:
    if lay.family == "mlp":
        return ResMLP(lay.dim, lay.layers)
    if lay.family == "encoder":
        model = TiedEncoder(VOCAB, lay.dim, lay.layers, HEADS)
    else:
        model = Transformer(VOCAB, lay.dim, lay.layers, HEADS)
    if lay.block != "plain":
        for i in range(len(model.layers)):
            blk = CachingBlock(lay.dim, HEADS) if lay.block == "caching" else \
                CkptBlock(lay.dim, HEADS, lay.block)
            model.layers[i] = blk
    return model


def _reset_parameters(model: nn.Module) -> None:
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def _batch(lay: Layout, gen: torch.Generator, device: torch.device):
    if lay.family == "mlp":
        x = torch.randn(BATCH * SEQ, lay.dim, generator=gen).to(device)
        y = torch.randint(0, 64, (BATCH * SEQ,), generator=gen).to(device)
        return x, y
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:].reshape(-1)


def run_layout(lay: Layout, ctx: Ctx, check: bool) -> dict:
    """Build, wrap and train one layout (the caller records around it). Returns the truth."""
    truth: dict = {"layout": lay.name, "rank": ctx.rank, "world": ctx.world,
                   "config": {k: v for k, v in lay.__dict__.items() if k != "wrap"},
                   "forwards": [], "backwards": [], "steps": []}
    torch.manual_seed(0)
    if lay.init == "build":
        with torch.device(ctx.device):
            model = _build(lay, ctx.device)
        truth["full_model_bytes"] = _tensor_bytes(model.parameters())
        model = lay.wrap(ctx, model)
    elif lay.init == "local":
        with torch.device(ctx.device):
            model = _build(lay, ctx.device)
        model = lay.wrap(ctx, model)
    else:
        with torch.device("meta"):
            model = _build(lay, ctx.device)
        wrapped = lay.wrap(ctx, model)
        if wrapped is model:
            model.to_empty(device=ctx.device)
            _reset_parameters(model)
        model = wrapped
    probe = Probe(model) if check else None
    truth["fsdp"] = probe.fsdp if probe else None
    if lay.optimizer == "sgd":
        optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1000 + ctx.rank)
    caches = [m.seen for m in model.modules() if isinstance(m, CachingBlock)]
    try:
        if lay.accumulation == "wrong":
            model.set_reshard_after_backward(False)  # "saves communication", never undone
        for step in range(lay.steps):
            optim.zero_grad()
            for mb in range(lay.micro_batches):
                last = mb == lay.micro_batches - 1
                if lay.accumulation in ("right", "wrong", "sync_only"):
                    model.set_requires_gradient_sync(last)
                if lay.accumulation == "right":
                    model.set_reshard_after_backward(last)
                x, y = _batch(lay, gen, ctx.device)
                sync_off = lay.accumulation == "no_sync" and not last
                with (model.no_sync() if sync_off else _nullcontext()):
                    out = model(x)
                    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y)
                    if probe:
                        truth["forwards"].append({"step": step, "micro_batch": mb,
                                                  **probe.unsharded()})
                        probe.in_backward = True
                    loss.backward()
                if probe:
                    probe.in_backward = False
                    truth["backwards"].append({"step": step, "micro_batch": mb, "last": last,
                                               **probe.unsharded(), **probe.take_backward()})
                del out, loss
            optim.step()
            if probe:
                truth["steps"].append({"step": step, "cache_bytes": _tensor_bytes(
                    t for c in caches for t in c), **probe.unsharded()})
    finally:
        if probe:
            probe.close()
    return truth


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, names: list[str], out: str, check: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    _run_all(names, Path(out), check)


def _run_all(names: list[str], out: Path, check: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from snapforensics.record.inprocess import recording

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cpu")
    try:
        mesh = init_device_mesh("cpu", (world,))
        mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) \
            if world == 4 else None
        ctx = Ctx(rank, world, device, mesh, mesh2d)
        for name in names:
            lay = LAYOUTS[name]
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            gc.collect()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                with recording(folder / f"rank{rank}.pickle", command=["scenarios", name]):
                    truth = run_layout(lay, ctx, check)
                    gc.collect()
            except Exception as e:  # one broken layout must not stop the matrix
                truth = {"layout": name, "rank": rank, "error": f"{type(e).__name__}: {e}"}
                print(f"[scenarios] {name} failed on rank {rank}: {truth['error']}", flush=True)
            truth["seconds"] = round(time.perf_counter() - t0, 2)
            truth["cpu_seconds"] = round(time.process_time() - c0, 2)
            if check:
                (folder / f"truth.rank{rank}.json").write_text(json.dumps(truth, indent=1))
            if rank == 0:
                print(f"[scenarios] {name}: {truth['seconds']} s ({truth['cpu_seconds']} s CPU)",
                      flush=True)
            del truth
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m snapforensics.examples.scenarios",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder for <layout>/rank{R}.pickle and truth")
    p.add_argument("--world", type=int, choices=(2, 4), default=2,
                   help="run the layouts made for this many ranks (default 2)")
    p.add_argument("--only", default="", help="comma-separated layout names")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="write truth.rank{R}.json from FSDP's state (default on)")
    p.add_argument("--list", action="store_true", help="print the layouts and exit")
    args = p.parse_args(argv)
    if args.list:
        for lay in LAYOUTS.values():
            print(f"{lay.name:28s} world {lay.world}  {lay.note}")
        return 0
    if args.out is None:
        p.error("--out is required")
    names = [n for n in args.only.split(",") if n] or \
        [n for n, lay in LAYOUTS.items() if lay.world == args.world]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s): {', '.join(unknown)}")
    worlds = {LAYOUTS[n].world for n in names}
    if len(worlds) != 1:
        p.error("--only mixes layouts made for different world sizes")
    world = worlds.pop()
    args.out.mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        if int(os.environ["WORLD_SIZE"]) != world:
            p.error(f"these layouts need {world} ranks")
        _run_all(names, args.out, args.check)
        return 0
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    mp.spawn(_worker, args=(world, names, str(args.out), args.check), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
