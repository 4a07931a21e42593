"""A Switch-style mixture of experts as people write it by hand (top-1, drop-and-pad, expert
parallel over every rank, gloo): the exchange is a hand-written autograd Function (`_AllToAll`,
the fairscale / DeepSpeed pattern) over c10d's `all_to_all_single` into an output it allocates,
defined in the same file as the layer, and this file's name says nothing of MoE (only the
layer's class does), for the tests of an MoE that neither a dispatcher function nor its file
names. `--exchange nn` exchanges through torch's autograd-aware
`torch.distributed.nn.functional.all_to_all_single` into an output the layer's own `forward`
allocates (`torch.empty_like`): no frame of the output's stack says exchange.

    snapforensics record --nproc-per-node 2 --device cpu tests/switch_a2a.py \
        -- --capacity-factor 1.25

`--truth DIR` writes DIR/truth.rank{R}.json from the running layers (each call's capacity,
tokens routed and kept per expert, the bytes of its padded buffer), never from a snapshot.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

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


class Experts(nn.Module):
    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n, hidden, dim) * hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, rows, dim)
        return torch.bmm(F.relu(torch.bmm(x, self.w1)), self.w2)


class SwitchMoE(nn.Module):
    def __init__(self, dim: int, experts: int, cf: float, exchange: str):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.E, self.cf, self.exchange = experts, cf, exchange
        self.world = dist.get_world_size()
        self.experts = Experts(experts // self.world, dim, 4 * dim)
        self.calls: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, D = x.shape
        w, e = self.router(x).softmax(-1).max(-1)
        C = math.ceil(self.cf * N / self.E)
        pos = (F.one_hot(e, self.E).cumsum(0) - 1).gather(1, e[:, None]).squeeze(1)
        keep = pos < C
        send = x.new_zeros(self.E, C, D)
        send[e[keep], pos[keep]] = x[keep]
        if self.exchange == "nn":  # the output allocated here, in the layer's own forward
            recv = all_to_all_single(torch.empty_like(send.view(self.E * C, D)),
                                     send.view(self.E * C, D))
        else:
            recv = _AllToAll.apply(send.view(self.E * C, D))
        L = self.E // self.world
        h = recv.view(self.world, L, C, D).transpose(0, 1).reshape(L, self.world * C, D)
        h = self.experts(h)
        h = h.view(L, self.world, C, D).transpose(0, 1).reshape(self.E * C, D)
        if self.exchange == "nn":
            back = all_to_all_single(torch.empty_like(h), h).view(self.E, C, D)
        else:
            back = _AllToAll.apply(h).view(self.E, C, D)
        out = x.new_zeros(N, D)
        out[keep] = back[e[keep], pos[keep]] * w[keep, None]
        counts = torch.bincount(e, minlength=self.E)
        self.calls.append({"capacity": C, "experts": self.E, "k": 1, "tokens": N,
                           "routed": counts.tolist(), "kept": counts.clamp(max=C).tolist(),
                           "buffer_bytes": send.nbytes})
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, dim: int, experts: int, cf: float, exchange: str):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), nn.Linear(dim, dim)
        self.ln2, self.moe = nn.LayerNorm(dim), SwitchMoE(dim, experts, cf, exchange)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--exchange", choices=("function", "nn"), default="function")
    p.add_argument("--truth", type=Path)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(a.dim, a.experts, a.capacity_factor, a.exchange)
                            for _ in range(a.layers)])
    opt = torch.optim.Adam(model.parameters())
    layers = [m for m in model.modules() if isinstance(m, SwitchMoE)]
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        for m in layers:
            m.calls.clear()
        x = torch.randn(a.tokens // 256, 256, a.dim, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    write_truth(a.truth, rank, {"capacity_factor": a.capacity_factor,
                                "calls": [c for m in layers for c in m.calls]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
