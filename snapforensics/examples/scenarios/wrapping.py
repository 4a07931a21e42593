"""How the scenario matrix's layouts wrap a model: FSDP2 (`fully_shard` per block, per
submodule, grouped, root only; prefetch, mixed precision, CPU offload, HSDP), FSDP1, DDP or none,
with or without activation checkpointing. Each `w_*` returns or is a `(Ctx, model) -> model`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from snapforensics.examples.fsdp_ckpt import Block
from snapforensics.examples.scenarios.models import ResBlock


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
