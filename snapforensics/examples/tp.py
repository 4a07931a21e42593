"""A tensor-parallel run (DTensor, ``torch.distributed.tensor.parallel``) with ground truth, for
the ``tp.*`` categories: a small transformer (RMSNorm, attention, RMSNorm, MLP per block) whose
attention and MLP are ``ColwiseParallel``/``RowwiseParallel`` as torchtitan plans them; with
``--sp`` the norms are ``SequenceParallel`` and the projections take/return sequence-sharded
layouts (``input_layouts=Shard(1)`` / ``output_layouts=Shard(1)``), with ``--dp N`` the TP model
sits on a 2-D mesh (dp_shard x tp) and ``fully_shard`` shards it on the dp submesh.

    snapforensics record --nproc-per-node 2 --device cpu --out DIR \\
        -m snapforensics.examples.tp -- --sp --truth DIR

``--truth DIR`` writes ``DIR/truth.rank{R}.json`` from the running state: the tp and dp degrees
(from the mesh), whether SP is on, and per block the bytes autograd saved for backward in the
last step's forward (``saved_tensors_hooks``, storage bytes of each local tensor), split into
tensors sharded along the sequence (shape[1] == seq / tp, SP on), tensors holding the full
sequence (shape[1] == seq: the same on every TP rank unless sharded on another dim) and the rest.
The last step, not the first: a hook pair the script pushes shadows the recorder's, whose names
(TP splits included) then stay on the steps before it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.hd(w)).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))

    def hd(self, w: nn.Linear) -> int:  # head dim: the full one, whatever the local shard holds
        return w.out_features // self.heads


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


def plan(sp: bool) -> dict:
    """torchtitan's per-block plan (llama parallelize_llama), SP on or off."""
    seq = Shard(1) if sp else Replicate()
    p = {
        "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        p["attention_norm"] = SequenceParallel()
        p["ffn_norm"] = SequenceParallel()
    return p


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sp", action="store_true", help="SequenceParallel on the norms")
    p.add_argument("--dp", type=int, default=1, help="dp_shard degree (FSDP2 on a 2-D mesh)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--truth", type=Path)
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = world // a.dp
    # a TP-only run's mesh is 1-D over the world, as its users write it (torch reuses the default
    # group for it: no group names TP); with FSDP, torchtitan's 2-D (dp_shard, tp)
    mesh = (init_device_mesh("cpu", (a.dp, tp), mesh_dim_names=("dp_shard", "tp")) if a.dp > 1
            else init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)))
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(a.dim, a.heads) for _ in range(a.layers))
    for b in blocks:
        parallelize_module(b, mesh["tp"], plan(a.sp))
    model = nn.Sequential(*blocks)
    if a.dp > 1:
        from torch.distributed.fsdp import fully_shard
        for b in blocks:
            fully_shard(b, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    saved: list[dict] = []
    local_seq = a.seq // tp if a.sp else a.seq

    def pack(t: torch.Tensor):
        local = t.to_local() if hasattr(t, "to_local") else t
        n = local.untyped_storage().nbytes()
        s1 = local.shape[1] if local.dim() >= 2 else -1
        key = "seq_sharded" if a.sp and s1 == local_seq else "full_seq" if s1 == a.seq else "other"
        saved[-1][key] += n
        return t

    for step in range(a.steps):
        x = torch.randn(a.batch, a.seq, a.dim)
        if a.sp:  # the first block takes the sequence shard (torchtitan: the embedding's output)
            x = x.chunk(tp, dim=1)[mesh["tp"].get_local_rank()].contiguous()
        h = x
        for b in blocks:
            if step == a.steps - 1:
                saved.append({"seq_sharded": 0, "full_seq": 0, "other": 0})
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    h = b(h)
            else:
                h = b(h)
        loss = (h.to_local() if hasattr(h, "to_local") else h).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if a.truth:
        a.truth.mkdir(parents=True, exist_ok=True)
        (a.truth / f"truth.rank{rank}.json").write_text(json.dumps({
            "tp": mesh["tp"].size(), "dp": a.dp, "sp": a.sp,
            "seq": a.seq, "local_seq": local_seq, "batch": a.batch, "dim": a.dim,
            "layers": a.layers, "saved_per_block": saved}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
