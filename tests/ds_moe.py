"""DeepSpeed's own mixture of experts (`deepspeed.moe.layer.MoE`, deepspeed 0.19.8's
`sharded_moe.MOELayer`: `TopKGate` with a capacity factor, `_sparse_encode` into an
[experts, capacity, dim] buffer, `_AllToAll` to the experts' ranks, `Experts`, `_AllToAll` back,
`_sparse_decode`) between dense blocks, expert parallel over every rank, on DeepSpeed's CPU
accelerator with gloo and a plain torch optimizer, for the tests of an MoE no script of ours
dispatches.

    snapforensics record --nproc-per-node 2 --device cpu tests/ds_moe.py -- --capacity-factor 1.5

`--ep N` makes the experts parallel over N ranks (DeepSpeed's expert and expert-data-parallel
groups, unnamed), the world by default. `--truth DIR` writes DIR/truth.rank{R}.json from the
running layers (each MoE call's capacity, as its gate returned it, and the bytes of its
[experts, capacity, dim] buffer) and DeepSpeed's groups (this rank's expert-parallel and
expert-data-parallel ranks), never from a snapshot.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from snapforensics.examples.common import write_truth


class Dense(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--capacity-factor", type=float, default=1.5)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ep", type=int, default=0, help="expert-parallel ranks (0: the world)")
    p.add_argument("--truth", type=Path)
    a = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.moe.layer import MoE

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    blocks, moes = nn.ModuleList(), []
    for _ in range(a.layers):
        moe = MoE(a.dim, Dense(a.dim), num_experts=a.experts, ep_size=a.ep or world, k=a.k,
                  capacity_factor=a.capacity_factor, eval_capacity_factor=a.capacity_factor,
                  min_capacity=0, drop_tokens=True)
        moe.set_deepspeed_parallelism()
        blocks.extend([Dense(a.dim), moe])
        moes.append(moe)
    calls: list[dict] = []

    def seen(layer, inputs, out) -> None:  # the gate's capacity for this call
        c = int(out[1])
        calls.append({"capacity": c, "experts": a.experts, "k": a.k, "tokens": a.tokens,
                      "buffer_bytes": a.experts * c * a.dim * 4})

    for m in moes:
        m.deepspeed_moe.gate.register_forward_hook(seen)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(2):
        calls.clear()
        x = torch.randn(a.tokens, a.dim, generator=g)
        aux = 0.0
        for b in blocks:
            if isinstance(b, MoE):
                x, l_aux, _ = b(x)
                aux = aux + l_aux
            else:
                x = b(x)
        (x.square().mean() + 0.01 * aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    from deepspeed.utils import groups

    ep = a.ep or world  # this rank's expert-parallel and expert-data-parallel groups, as built
    name = f"ep_size_{ep}"
    write_truth(a.truth, rank, {
        "capacity_factor": a.capacity_factor, "calls": calls, "world": world,
        "ep_ranks": dist.get_process_group_ranks(groups._get_expert_parallel_group(name)),
        "ep_dp_ranks": dist.get_process_group_ranks(
            groups._get_expert_data_parallel_group(name))})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
