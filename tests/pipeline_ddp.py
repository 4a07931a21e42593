"""torch.distributed.pipelining's 1F1B over 2 stages, each stage's module in
DistributedDataParallel over 2 ranks (4 ranks), the groups made with `dist.new_group` and no
description (no DeviceMesh: torch names them "undefined"), as a script without torchtitan sets
them up; 8 micro-batches, SGD. Nothing names the pipeline's dimension, so the world is not the
pipeline's: 2 stages x 2 data-parallel ranks must not read as 4 stages.

    snapforensics record --nproc-per-node 4 --device cpu tests/pipeline_ddp.py [--truth DIR]

`--truth DIR` writes DIR/truth.rank{R}.json from the running stage (`PipelineStage.stage_index`,
`num_stages`) and the DDP group's size."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel

from snapforensics.examples.common import write_truth


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--truth", type=Path)
    a = p.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = 2
    pp = world // dp
    stage, dpi = divmod(rank, dp)  # rank = stage * dp + its index among the stage's ranks
    pp_group = dp_group = None
    for i in range(dp):  # every rank makes every group, in the same order
        g = dist.new_group([s * dp + i for s in range(pp)])
        pp_group = g if i == dpi else pp_group
    for s in range(pp):
        g = dist.new_group([s * dp + i for i in range(dp)])
        dp_group = g if s == stage else dp_group
    torch.manual_seed(0)
    dim, per = 256, 4
    blocks = [Block(dim) for _ in range(per * pp)]
    model = DistributedDataParallel(nn.Sequential(*blocks[stage * per:(stage + 1) * per]),
                                    process_group=dp_group)
    del blocks
    st = PipelineStage(model, stage, pp, torch.device("cpu"), group=pp_group)
    schedule = Schedule1F1B(st, n_microbatches=8, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        x, y = torch.randn(32, 64, dim), torch.randn(32, 64, dim)
        if stage == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()
    write_truth(a.truth, rank, {"stage": st.stage_index, "stages": st.num_stages,
                                "dp": dist.get_world_size(dp_group)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
