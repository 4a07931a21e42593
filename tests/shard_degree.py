"""FSDP whose shard degree is not the world size, run by torch's own code: 4 residual MLP blocks,
each and the root wrapped, gloo, AdamW, two steps. `--mode`:

- `replicate` (default): `torch.distributed._composable.replicate_with_fsdp.replicate` (FSDP2's
  machinery over a replicate-only mesh, the data parallelism torchtitan applies for DDP);
  `--ac` puts each block under checkpoint_wrapper;
- `no_shard`: FSDP1's `ShardingStrategy.NO_SHARD` (each block wrapped);
- `reshard2` / `reshard_true`: `fully_shard(block, reshard_after_forward=2 / True)` (on 4 ranks:
  resharded to 2 ranks after forward, or to all).

    snapforensics record --nproc-per-node 2 --device cpu tests/shard_degree.py [--ac]

`--truth DIR` writes DIR/truth.rank{R}.json from the running modules, never from a snapshot: per
step and block, the storages (address, bytes) each unit holds after its forward (replicate: each
parameter's unsharded copy, the buffer FSDP2's `wait_for_unshard` fills at shard size 1;
reshard: each parameter's post-forward shard, `_sharded_post_forward_param_data`), and whether
the wrapped blocks accept `set_reshard_after_forward(True)`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from snapforensics.examples.common import write_truth


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _wrap(model: nn.Sequential, mode: str) -> nn.Module:
    if mode == "no_shard":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            model, sharding_strategy=ShardingStrategy.NO_SHARD, use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    if mode == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for b in model:
            replicate(b)
        return replicate(model)
    from torch.distributed.fsdp import fully_shard

    for b in model:
        fully_shard(b, reshard_after_forward=2 if mode == "reshard2" else True)
    return fully_shard(model)


def _held(module: nn.Module, mode: str) -> list[dict]:
    """What the unit holds after its forward, read from FSDP's own params."""
    out = []
    for fp in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
        t = fp.all_gather_outputs[0] if mode == "replicate" else \
            getattr(fp, "_sharded_post_forward_param_data", None)
        if t is not None:
            s = t.untyped_storage()
            out.append({"addr": s.data_ptr(), "bytes": s.nbytes()})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("replicate", "no_shard", "reshard2", "reshard_true"),
                   default="replicate")
    p.add_argument("--ac", action="store_true")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--truth", type=Path)
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if a.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )
    blocks = [Block(a.dim) for _ in range(4)]
    model = nn.Sequential(*(checkpoint_wrapper(b) if a.ac else b for b in blocks))
    wrapped = _wrap(model, a.mode)
    held: list[list[list[dict]]] = []  # per step, per block

    def seen(i: int):
        def hook(module, args, output):  # after FSDP's post-forward (registered before this)
            if not held[-1][i]:  # a checkpointed block's recompute runs its forward again
                held[-1][i] = _held(module, a.mode)
        return hook

    if a.mode != "no_shard":
        for i, b in enumerate(model):
            b.register_forward_hook(seen(i))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    for _ in range(2):
        held.append([[] for _ in model])
        wrapped(torch.randn(8, 64, a.dim)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    settable = None
    if a.mode != "no_shard":
        try:
            model[0].set_reshard_after_forward(True)
            settable = True
        except AssertionError:
            settable = False
    write_truth(a.truth, dist.get_rank(), {"held": held, "reshard_settable": settable})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
