"""DeepSpeed's own pipeline parallelism (`deepspeed.pipe.PipelineModule`, its PipelineEngine's
1F1B `TrainSchedule`, deepspeed 0.19.8) on its CPU accelerator with gloo: 8 residual MLP blocks
over 2 stages, 8 micro-batches a step, for the tests of a pipeline no torch schedule runs.

    snapforensics record --nproc-per-node 2 --device cpu tests/ds_pipe.py

On 4 ranks the 2 stages are each data parallel over 2 (DeepSpeed's grid: its groups unnamed).
`--stages S` splits the 8 blocks over S stages, `--microbatches M` cuts the step's 32 rows into
M micro-batches (the global batch kept, as the pipeline forecast keeps it); `--zero 1` runs it
under ZeRO stage 1 (the optimizer's states partitioned over each stage's data-parallel ranks).

`--truth DIR` writes DIR/truth.rank{R}.json from the running engine, never from a snapshot: its
stage, and the storages of the buffers it receives into (`pipe_recv_buf`, `grad_layer`) and of
every received activation it keeps for a backward (`pipe_buffers['inputs']`), each seen as the
step runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn as nn

from snapforensics.examples.common import write_truth
from snapforensics.examples.deepspeed_zero import _storage


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8, help="the global batch kept (32 rows)")
    p.add_argument("--zero", type=int, default=0,
                   help="ZeRO stage (0 or 1: the pipeline engine takes no higher)")
    p.add_argument("--truth", type=Path)
    a = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(Block, a.dim) for _ in range(8)],
                           num_stages=a.stages,
                           loss_fn=lambda out, y: ((out - y) ** 2).mean(),
                           partition_method="uniform")
    dp = torch.distributed.get_world_size() // a.stages  # the ranks beyond the stages: DP
    rows = 32 // a.microbatches
    cfg = {"train_batch_size": 32 * dp, "train_micro_batch_size_per_gpu": rows,
           "gradient_accumulation_steps": a.microbatches, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    if a.zero:  # the optimizer's states and the fp32 step partitioned over each stage's DP ranks
        cfg["zero_optimization"] = {"stage": a.zero}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           model_parameters=list(model.parameters()))
    received: list[dict] = []

    def seen() -> None:  # the engine's receive buffers and kept inputs now
        bufs = [engine.pipe_recv_buf, getattr(engine, "grad_layer", None)]
        if not engine.is_first_stage():  # the first stage's inputs are loaded, not received
            bufs += engine.pipe_buffers["inputs"]
        for t in bufs:
            for x in (t if isinstance(t, (list, tuple)) else [t]):
                st = _storage(x) if isinstance(x, torch.Tensor) else None
                if st and st not in received:
                    received.append(st)

    def watched(func):
        def run(self, *args, **kwargs):
            out = func(self, *args, **kwargs)
            seen()
            return out
        return run

    # DeepSpeed binds each instruction's function from the class's `_INSTRUCTION_MAP`
    engine._INSTRUCTION_MAP = {
        k: watched(v) if v.__name__ in ("_exec_recv_activations", "_exec_recv_grads") else v
        for k, v in type(engine)._INSTRUCTION_MAP.items()}
    g = torch.Generator().manual_seed(1)

    def data():
        while True:
            yield (torch.randn(rows, 64, a.dim, generator=g),
                   torch.randn(rows, 64, a.dim, generator=g))

    batches = data()
    for _ in range(2):
        engine.train_batch(data_iter=batches)
    write_truth(a.truth, engine.global_rank, {"stage": engine.stage_id,
                                              "stages": engine.num_stages,
                                              "received": received})


if __name__ == "__main__":
    main()
