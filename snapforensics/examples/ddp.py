"""A data-parallel run (plain ``torch.nn.parallel.DistributedDataParallel``, gloo) with ground
truth, for the DDP categories and rules: a stack of MLP blocks, a few Adam steps.

    snapforensics record --nproc-per-node 2 --device cpu --out DIR \\
        -m snapforensics.examples.ddp -- --bucket-view 0 --bucket-cap-mb 1 --truth DIR

``--bucket-view {0,1}`` is ``gradient_as_bucket_view``; ``--bucket-cap-mb`` DDP's bucket cap;
``--static-graph`` and ``--find-unused`` the two DDP flags of those names.

``--truth DIR`` writes ``DIR/truth.rank{R}.json`` from the running state, not from any snapshot,
read after the last backward (the reducer has rebuilt its buckets by then, in the order the
gradients came):

- ``buckets``: the reducer's buckets as its logger reports them (``_get_ddp_logging_data()``,
  which allocates nothing): ``rebuilt_bucket_sizes`` once the reducer rebuilt them after the
  first step (the layout of every later step), else ``bucket_sizes``; their count and bytes;
- ``grad_bytes``: the bytes of every parameter's ``.grad``;
- per parameter, whether its ``.grad`` lies inside a bucket's flat buffer (the buffer is the
  grad's ``_base``, found by its ``data_ptr`` range): ``grads_in_bucket`` / ``grads_separate``,
  and ``separate_grad_bytes`` (what a second copy of the gradients costs);
- ``rebuilt``: the reducer rebuilt its buckets after the first step (DDP's logging data).

The peak is not measured here: a CPU process has no allocator counter to read (the recording is
the measurement; its twin run is the other one).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from snapforensics.examples.common import parser, write_truth


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class Model(nn.Module):
    def __init__(self, dim: int, layers: int, unused: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        # a head the forward never calls: what `find_unused_parameters` is for
        self.unused = nn.Linear(dim, dim) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _truth(ddp: DistributedDataParallel, a: argparse.Namespace, rank: int, world: int) -> dict:
    """What the reducer holds, read from the running module right after a backward."""
    params = [p for p in ddp.parameters() if p.requires_grad]
    with_grad = [p for p in params if p.grad is not None]
    bases: dict[int, int] = {}  # flat buffer data_ptr -> bytes, from the grads that are views
    in_bucket = []
    for p in with_grad:
        g = p.grad
        base = g._base
        inside = base is not None and base.dim() == 1 and \
            base.data_ptr() <= g.data_ptr() < base.data_ptr() + base.nbytes and \
            g.data_ptr() + g.nbytes <= base.data_ptr() + base.nbytes
        if inside:
            bases[base.data_ptr()] = base.nbytes
        in_bucket.append(bool(inside))
    return {
        "world": world, "rank": rank, "bucket_view": a.bucket_view,
        "bucket_cap_mb": a.bucket_cap_mb, "static_graph": a.static_graph,
        "find_unused": a.find_unused, "params": len(params), "grads": len(with_grad),
        "param_bytes": sum(p.nbytes for p in params),
        "grad_bytes": sum(p.grad.nbytes for p in with_grad),
        "grads_in_bucket": sum(in_bucket), "grads_separate": len(in_bucket) - sum(in_bucket),
        "separate_grad_bytes": sum(p.grad.nbytes for p, v in zip(with_grad, in_bucket) if not v),
        "bucket_buffers_seen_from_grads": sorted(bases.values()),
    }


def main(argv: list[str] | None = None) -> None:
    p = parser(layers=4, dim=256, batch=8, seq=16, steps=3)
    p.add_argument("--bucket-view", type=int, choices=(0, 1), default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--find-unused", action="store_true")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model(a.dim, a.layers, a.find_unused)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=bool(a.bucket_view),
                                  bucket_cap_mb=a.bucket_cap_mb, static_graph=a.static_graph,
                                  find_unused_parameters=a.find_unused)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    truth: dict = {}
    for step in range(a.steps):
        x = torch.randn(a.batch, a.seq, a.dim)
        loss = (ddp(x) ** 2).mean()
        loss.backward()
        if step == a.steps - 1:
            truth = _truth(ddp, a, rank, world)
        opt.step()
        opt.zero_grad()
    if a.truth:
        log = ddp._get_ddp_logging_data()
        truth["rebuilt"] = bool(log.get("has_rebuilt_buckets", 0))
        # the logger's sizes are each bucket's bytes (Reducer: sum of its parameters' nbytes)
        for key, text in (("initial_buckets", log.get("bucket_sizes", "")),
                          ("buckets", log.get("rebuilt_bucket_sizes", "") if truth["rebuilt"]
                           else log.get("bucket_sizes", ""))):
            truth[key] = [int(s) for s in str(text).split(",") if s.strip()]
        truth["bucket_count"] = len(truth["buckets"])
        truth["bucket_bytes"] = sum(truth["buckets"])
        write_truth(a.truth, rank, truth)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
