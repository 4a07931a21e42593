"""GShard's einsum mixture of experts, as DeepSpeed's MOELayer ran it before 0.19 and fairscale
still does, expert parallel over every rank (gloo), for the tests of a capacity padding no
routed-rows tensor shows: the gating (`top1gating` / `top2gating`, their names) makes the
[tokens, experts, capacity] combine weights and dispatch mask, `einsum("sec,sm->ecm")` the
padded [experts, capacity, dim] buffer an autograd `_AllToAll` (`all_to_all_single`) exchanges,
the experts run on it, the exchange back, and `einsum("sec,ecm->sm")` the layer's output.

    snapforensics record --nproc-per-node 2 --device cpu tests/einsum_moe.py \
        -- --capacity-factor 1.5 --k 2

Capacity `ceil(cf * k * tokens / experts)` (DeepSpeed's `_capacity`, top-2 with cf x 2).
`--truth DIR` writes DIR/truth.rank{R}.json from the running layers (each call's tokens,
capacity, the bytes of its padded buffer), never from a snapshot.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from snapforensics.examples.common import write_truth


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(grad)


def _positions(mask: torch.Tensor, start: torch.Tensor, capacity: int):
    loc = torch.cumsum(mask, 0) - 1 + start
    mask = mask * (loc < capacity)
    return mask, (loc * mask).sum(1)


def top1gating(logits: torch.Tensor, cf: float):
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    capacity = math.ceil(cf * tokens / experts)
    mask, loc = _positions(F.one_hot(gates.argmax(1), experts), 0, capacity)
    gate = (gates * mask).sum(1)
    combine = torch.einsum("se,sc->sec", gate[:, None] * mask,
                           F.one_hot(loc, capacity).float())
    return combine, combine.bool(), capacity


def top2gating(logits: torch.Tensor, cf: float):
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    capacity = math.ceil(2 * cf * tokens / experts)
    first = F.one_hot(gates.argmax(1), experts)
    second = F.one_hot(logits.masked_fill(first.bool(), float("-inf")).argmax(1), experts)
    mask1, loc1 = _positions(first, 0, capacity)
    mask2, loc2 = _positions(second, first.sum(0, keepdim=True), capacity)
    g1, g2 = (gates * mask1).sum(1), (gates * mask2).sum(1)
    norm = (g1 + g2).clamp(min=1e-9)
    combine = torch.einsum("se,sc->sec", (g1 / norm)[:, None] * mask1,
                           F.one_hot(loc1, capacity).float()) + \
        torch.einsum("se,sc->sec", (g2 / norm)[:, None] * mask2,
                     F.one_hot(loc2, capacity).float())
    return combine, combine.bool(), capacity


class Experts(nn.Module):
    def __init__(self, n: int, dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, dim, 2 * dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n, 2 * dim, dim) * (2 * dim) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.gelu(torch.bmm(x, self.w1)), self.w2)


class MOELayer(nn.Module):
    def __init__(self, a: argparse.Namespace, world: int):
        super().__init__()
        self.gate = nn.Linear(a.dim, a.experts, bias=False)
        self.experts = Experts(a.experts // world, a.dim)
        self.E, self.world, self.cf = a.experts, world, a.capacity_factor
        self.gating = top1gating if a.k == 1 else top2gating
        self.calls: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dim = x.shape, x.shape[-1]
        x = x.reshape(-1, dim)
        combine, dispatch, capacity = self.gating(self.gate(x), self.cf)
        sent = torch.einsum("sec,sm->ecm", dispatch.type_as(x), x)
        got = _AllToAll.apply(sent)
        local = self.E // self.world
        h = got.reshape(self.world, local, capacity, dim).transpose(0, 1) \
            .reshape(local, -1, dim)
        h = self.experts(h)
        h = h.reshape(local, self.world, capacity, dim).transpose(0, 1) \
            .reshape(self.E, capacity, dim)
        out = torch.einsum("sec,ecm->sm", combine.type_as(x), _AllToAll.apply(h))
        self.calls.append({"tokens": x.shape[0], "capacity": capacity, "experts": self.E,
                           "buffer_bytes": sent.nbytes, "token_bytes": x.nbytes})
        return out.reshape(shape)


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
    p.add_argument("--k", type=int, choices=(1, 2), default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--truth", type=Path)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(a.layers)
                            for m in (Dense(a.dim), MOELayer(a, world))])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    layers = [m for m in model if isinstance(m, MOELayer)]
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        for m in layers:
            m.calls.clear()
        x = torch.randn(a.tokens // 128, 128, a.dim, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    write_truth(a.truth, rank, {"capacity_factor": a.capacity_factor, "k": a.k,
                                "calls": [c for m in layers for c in m.calls]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
