"""A mixture of experts whose token dispatch is written inline in the layer's `forward` (no
dispatch or combine function: the GShard / Switch code people write by hand), expert parallel over
every rank (gloo), the exchanges through torch's functional `all_to_all_single_autograd`, for the
tests of an MoE no dispatcher function names.

    snapforensics record --nproc-per-node 2 --device cpu tests/inline_moe.py \
        -- --capacity-factor 1.5

Drop-and-pad at `capacity = ceil(cf * tokens * k / experts)`. Two ways of writing it:
- `--order zeros-first`: the zero-filled [experts * capacity, dim] send buffer, then the routed
  rows (`repeat_interleave`) and the kept ones put into it out of place (`index_put`); the
  combine puts the kept rows back into zero-filled routed rows, weights and sums them.
- `--order gather-first`: the routed rows gathered first (`x[token]`, route by route), then the
  zero-filled buffer filled in place (`index_copy_`); the combine assigns into the routed rows
  in place.
- `--order gather-kept`: only the rows the capacity keeps gathered (`x[kept // k]`, a size that
  moves with the routing), then put into the zero-filled buffer as gather-first does.
`--combine index-add` adds the kept rows, weighted, straight into their tokens (no block of the
routed rows on the way back). `--names plain` names the layer `RoutedFFN` and its experts
`FFNBank` (no MoE word in a class: only this file's name says MoE), `hf` names them
`SparseMoeBlock` / `ExpertMLP`. `--fsdp` shards the dense blocks with FSDP2 (the experts
ignored: each rank owns its own).

`--truth DIR` writes DIR/truth.rank{R}.json from the running layers (each call's capacity, tokens
routed and kept, the bytes of its padded buffer and of its routed rows), never from a snapshot.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

from snapforensics.examples.common import write_truth


class Bank(nn.Module):
    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n, hidden, dim) * hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, rows, dim)
        return torch.bmm(F.gelu(torch.bmm(x, self.w1)), self.w2)


class Routed(nn.Module):
    def __init__(self, a: argparse.Namespace, bank: type, group):
        super().__init__()
        self.gate = nn.Linear(a.dim, a.experts, bias=False)
        self.E, self.k, self.cf, self.order, self.combine, self.group = (
            a.experts, a.k, a.capacity_factor, a.order, a.combine, group)
        self.world = dist.get_world_size(group)
        self.local = a.experts // self.world
        self.experts = bank(self.local, a.dim, 2 * a.dim)
        self.calls: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, D = x.shape
        w, idx = self.gate(x).softmax(-1).topk(self.k, -1)
        C = math.ceil(self.cf * N * self.k / self.E)
        expert = idx.reshape(-1)  # route r = token r // k's choice r % k
        onehot = F.one_hot(expert, self.E)
        pos = (onehot.cumsum(0) - 1).gather(1, expert[:, None]).squeeze(1)
        keep = pos < C
        slot = (expert * C + pos)[keep]
        kept = torch.nonzero(keep).squeeze(1)
        if self.order == "zeros-first":
            buf = x.new_zeros(self.E * C, D)
            routed = x.repeat_interleave(self.k, 0)
            buf = buf.index_put((slot,), routed[keep])
        elif self.order == "gather-first":
            routed = x[torch.arange(N * self.k) // self.k]
            buf = routed.new_zeros(self.E * C, D)
            buf.index_copy_(0, slot, routed[kept])
        else:  # gather-kept: only the rows the capacity kept (a block that moves with routing)
            routed = x[kept // self.k]
            buf = routed.new_zeros(self.E * C, D)
            buf.index_copy_(0, slot, routed)
        splits = [self.local * C] * self.world
        recv = all_to_all_single_autograd(buf, splits, splits, self.group)
        h = recv.view(self.world, self.local, C, D).transpose(0, 1).reshape(self.local, -1, D)
        h = self.experts(h)
        h = h.view(self.local, self.world, C, D).transpose(0, 1).reshape(self.E * C, D)
        back = all_to_all_single_autograd(h, splits, splits, self.group)
        if self.combine == "index-add":  # the kept rows added straight into their tokens
            out = back.new_zeros(N, D).index_add(
                0, kept // self.k, back[slot] * w.reshape(-1)[kept, None])
        elif self.order == "zeros-first":
            rows = back.new_zeros(N * self.k, D).index_put((kept,), back[slot])
        else:
            rows = back.new_zeros(N * self.k, D)
            rows[kept] = back[slot]
        counts = torch.bincount(expert, minlength=self.E)
        self.calls.append({
            "capacity": C, "experts": self.E, "k": self.k, "tokens": N,
            "routed": counts.tolist(), "kept": counts.clamp(max=C).tolist(),
            "buffer_bytes": buf.nbytes, "routed_bytes": routed.nbytes})
        if self.combine != "index-add":
            out = (rows.view(N, self.k, D) * w[..., None]).sum(1)
        return out.view(shape)


class Dense(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), \
            nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--capacity-factor", type=float, default=1.5)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--order", choices=("zeros-first", "gather-first", "gather-kept"),
                   default="zeros-first")
    p.add_argument("--combine", choices=("rows", "index-add"), default="rows")
    p.add_argument("--names", choices=("hf", "plain"), default="hf")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--truth", type=Path)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layer, bank = ("SparseMoeBlock", "ExpertMLP") if a.names == "hf" else ("RoutedFFN", "FFNBank")
    Layer, Experts = type(layer, (Routed,), {}), type(bank, (Bank,), {})
    torch.manual_seed(0)
    group = dist.group.WORLD
    model = nn.Sequential(*[m for _ in range(a.layers)
                            for m in (Dense(a.dim), Layer(a, Experts, group))])
    torch.manual_seed(1 + rank)  # each rank its own experts
    for m in model.modules():
        if isinstance(m, Bank):
            for prm in m.parameters():
                prm.data.normal_(0, prm.shape[1] ** -0.5)
    if a.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in model:
            if isinstance(m, Dense):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh, ignored_params={
            prm for m in model.modules() if isinstance(m, Bank) for prm in m.parameters()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    layers = [m for m in model if isinstance(m, Routed)]
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        for m in layers:
            m.calls.clear()
        x = torch.randn(a.tokens // 128, 128, a.dim, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    write_truth(a.truth, rank, {"capacity_factor": a.capacity_factor,
                                "calls": [c for m in layers for c in m.calls]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
