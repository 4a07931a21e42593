"""A pipeline-parallel run (``torch.distributed.pipelining``) with ground truth, for the pipeline
rules: one stage per rank, a stack of MLP blocks split evenly, GPipe or 1F1B over M micro-batches
(or two stages per rank, ScheduleInterleaved1F1B or ScheduleLoopedBFS);
with ``--dp N`` each stage is fully_shard-ed over N ranks (FSDP2 + PP on a (pp, dp_shard) mesh);
with ``--tp N`` each block's MLP is ColwiseParallel / RowwiseParallel over N ranks (TP inside the
stages, on a (pp, dp_shard, tp) mesh, as torchtitan composes them). A stage keeps the model's
layer names (``layers.5.up.weight``): torchtitan splits a model by deleting the layers another
stage runs, so its names stay the whole model's.

    snapforensics record --nproc-per-node 2 --device cpu --out DIR \\
        -m snapforensics.examples.pipeline -- --schedule gpipe --microbatches 8 --truth DIR

``--truth DIR`` writes ``DIR/truth.rank{R}.json`` from the running stage, not from any snapshot:
the schedule, the stage index and count, the micro-batches, and per step the most micro-batches
whose forward had run and whose backward had not (what the stage holds activations for), counted
by wrapping the stage's own ``forward_one_chunk``/``backward_one_chunk``.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from snapforensics.examples.common import parser, write_truth

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             # two stages per rank (a looped layout)
             "interleaved": ScheduleInterleaved1F1B, "looped_bfs": ScheduleLoopedBFS}
LOOPED = ("interleaved", "looped_bfs")


class Chunk(nn.Module):
    """The layers one stage runs, under the whole model's names (``layers.<i>``)."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): b for i, b in blocks.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers.values():
            x = b(x)
        return x


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def _count_in_flight(stage: PipelineStage, held: list[int]) -> None:
    """Wrap the stage's chunk methods: held[-1] is the most micro-batches in flight this step."""
    # the class's methods, looked up at each call: what wraps them later (the recorder's marks)
    # stays in the call
    cls = type(stage)
    state = {"now": 0}

    def forward_one_chunk(*a, **k):
        out = cls.forward_one_chunk(stage, *a, **k)
        state["now"] += 1
        held[-1] = max(held[-1], state["now"])
        return out

    def backward_one_chunk(*a, **k):
        out = cls.backward_one_chunk(stage, *a, **k)
        state["now"] -= 1
        return out

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def main(argv: list[str] | None = None) -> None:
    p = parser(layers=4, dim=256, batch=32, seq=64, steps=2)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--dp", type=int, default=1,
                   help="dp_shard degree: each stage fully_shard-ed over it (FSDP2 + PP on a "
                        "2-D mesh, as torchtitan composes them)")
    p.add_argument("--tp", type=int, default=1,
                   help="tp degree: each block's MLP column-/row-wise parallel over it")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    stages, group = world // (a.dp * a.tp), None
    rank = index = dist.get_rank()  # the stage index when there is no dp dimension
    if a.dp > 1 or a.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dims = [("pp", stages)] + [(n, k) for n, k in (("dp_shard", a.dp), ("tp", a.tp)) if k > 1]
        mesh = init_device_mesh("cpu", tuple(k for _, k in dims),
                                mesh_dim_names=tuple(n for n, _ in dims))
        index, group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    torch.manual_seed(0)
    blocks = [Block(a.dim) for _ in range(a.layers)]
    v = 2 if a.schedule in LOOPED else 1  # stages per rank: index, index + stages, ...
    per = a.layers // (stages * v)
    chunks = [Chunk({j: blocks[j] for j in range(i * per, (i + 1) * per)})
              for i in range(index, stages * v, stages)]
    del blocks  # every rank drew the same weights; a stage holds only its own layers
    if a.tp > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for chunk in chunks:
            for b in chunk.layers.values():
                parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(),
                                                   "down": RowwiseParallel()})
    if a.dp > 1:
        from torch.distributed.fsdp import fully_shard

        for chunk in chunks:
            for b in chunk.layers.values():
                fully_shard(b, mesh=mesh["dp_shard"])
            fully_shard(chunk, mesh=mesh["dp_shard"])
    # what parallelize_module and fully_shard replaced (each layer's whole weights) is left in
    # reference cycles: collected here, not wherever the collector next runs (that moves with
    # the interpreter's allocation count, not the program: with another threshold the whole
    # weights died inside the first step, and a fresh clone's forecast from that recording
    # moved by one activation)
    gc.collect()
    pipe = [PipelineStage(c, i, stages * v, torch.device("cpu"), group=group)
            for c, i in zip(chunks, range(index, stages * v, stages))]
    held: list[int] = []
    for st in pipe:
        _count_in_flight(st, held)
    loss = lambda out, tgt: ((out - tgt) ** 2).mean()  # noqa: E731
    schedule = SCHEDULES[a.schedule](pipe if v > 1 else pipe[0], n_microbatches=a.microbatches,
                                     loss_fn=loss)
    module = nn.ModuleList(chunks)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    for _ in range(a.steps):
        held.append(0)
        x, y = torch.randn(a.batch, a.seq, a.dim), torch.randn(a.batch, a.seq, a.dim)
        if index == 0:
            schedule.step(x)
        elif index == stages - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    write_truth(a.truth, rank, {"schedule": a.schedule, "stage": index, "stages": stages,
                                "dp": a.dp, "tp": a.tp, "microbatches": a.microbatches,
                                "held_per_step": held})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
