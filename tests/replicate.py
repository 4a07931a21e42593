"""torch's replicate() over FSDP2's machinery (`torch.distributed._composable.replicate_with_fsdp`,
the data parallelism torchtitan applies for DDP): 4 residual MLP blocks, each and the root
replicated, on 2 ranks with gloo, optionally under checkpoint_wrapper; AdamW. With
`--fsdp1-no-shard`, FSDP1's `ShardingStrategy.NO_SHARD` (each block wrapped) instead: the other
FSDP that shards nothing.

    snapforensics record --nproc-per-node 2 --device cpu tests/replicate.py [--ac]

`--truth DIR` writes DIR/truth.rank{R}.json from the running modules, never from a snapshot: per
step and block, the storage (address, bytes) of each parameter's unsharded copy as its forward
ran (the buffer FSDP2's `wait_for_unshard` fills at shard size 1), and whether replicate's
modules accept `set_reshard_after_forward(True)`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from snapforensics.examples.common import write_truth


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ac", action="store_true")
    p.add_argument("--fsdp1-no-shard", action="store_true")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--truth", type=Path)
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    blocks = [Block(a.dim) for _ in range(4)]
    model = nn.Sequential(*(checkpoint_wrapper(b) if a.ac else b for b in blocks))
    if a.fsdp1_no_shard:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model, sharding_strategy=ShardingStrategy.NO_SHARD, use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
        train(model, a.dim, lambda: None)
        dist.destroy_process_group()
        return
    for b in model:
        replicate(b)
    replicate(model)
    copies: list[list[list[dict]]] = []  # per step, per block: its parameters' copies

    def seen(i: int):
        def hook(module, args, output):  # after the block's forward: its copies are alive
            if len(copies[-1][i]):
                return  # a checkpointed block's recompute runs its forward again
            for fp in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
                s = fp.all_gather_outputs[0].untyped_storage()
                copies[-1][i].append({"addr": s.data_ptr(), "bytes": s.nbytes()})
        return hook

    for i, b in enumerate(model):
        b.register_forward_hook(seen(i))
    train(model, a.dim, lambda: copies.append([[] for _ in model]))
    try:
        model[0].set_reshard_after_forward(True)
        settable = True
    except AssertionError:
        settable = False
    write_truth(a.truth, dist.get_rank(), {"copies": copies, "reshard_settable": settable})
    dist.destroy_process_group()


def train(model: nn.Module, dim: int, each_step) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        each_step()
        model(torch.randn(8, 64, dim)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
