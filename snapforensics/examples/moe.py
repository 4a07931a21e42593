"""An expert-parallel mixture-of-experts run (gloo) with ground truth, for the MoE categories and
rules: dense blocks alternating with MoE layers (a top-k router, E experts split evenly over the
ranks), tokens sent to the experts' ranks by ``torch.distributed.all_to_all_single`` and brought
back by a second one, a few SGD steps.

    snapforensics record --nproc-per-node 2 --device cpu --out DIR \\
        -m snapforensics.examples.moe -- --capacity-factor 1.5 --truth DIR

The dispatch is drop-and-pad (Switch / GShard, Megatron's ``--moe-expert-capacity-factor`` with
``--moe-pad-expert-input-to-capacity``): each expert takes at most
``capacity = ceil(cf * tokens * k / experts)`` tokens (the rest are dropped) and its slot in the
all-to-all buffer is padded to ``capacity`` rows, so the exchanged buffers (and the experts'
activations computed on them) have ``experts * capacity`` rows whatever the routing.
``--capacity-factor 0`` is the dropless, padding-free variant (ragged splits: torchtitan's
all-to-all token dispatcher). ``--fsdp`` shards the non-expert parameters with FSDP2
(``fully_shard`` per dense block and on the root, the experts' parameters ignored: each rank owns
its own experts).

``--truth DIR`` writes ``DIR/truth.rank{R}.json`` from the running state (the last step's MoE
layer calls), not from any snapshot: the capacity factor and capacity, the tokens routed to each
expert (before the capacity drops them) and kept, and per call the bytes of the dispatch buffers
(the permuted tokens, the padded send buffer, the received buffer), of the combine buffers (the
experts' output received back, the tokens picked out of it) and of their padding (rows no token
filled, in the send and received buffers of both exchanges). The peak is not measured here: a
CPU process has no allocator counter (the recording is the measurement; the twin is another run).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from snapforensics.examples.common import parser, write_truth


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with its transpose as the backward (Megatron's `_AllToAll`)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        out = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), in_splits, out_splits)
        return out, None, None


class Dense(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class Experts(nn.Module):
    """This rank's experts, as one grouped matmul per projection (torchtitan's GroupedExperts)."""

    def __init__(self, local: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(local, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(local, hidden, dim) * hidden ** -0.5)

    def forward(self, x: torch.Tensor, e: int | None = None) -> torch.Tensor:
        """(local, tokens, dim) through every local expert, or (1, tokens, dim) through `e`."""
        w1, w2 = (self.w1, self.w2) if e is None else (self.w1[e:e + 1], self.w2[e:e + 1])
        return torch.bmm(torch.nn.functional.gelu(torch.bmm(x, w1)), w2)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, k: int, cf: float, world: int):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts // world, dim, hidden)
        self.E, self.k, self.cf, self.world = experts, k, cf, world
        self.calls: list[dict] = []  # what each call held, for the truth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = torch.topk(self.router(x).softmax(-1), self.k, dim=-1)
        recv, state = self.dispatch(x, idx)
        local = self.E // self.world
        if self.cf:  # (world, local, C, D) -> (local, world * C, D)
            h = recv.view(self.world, local, -1, x.shape[1]).transpose(0, 1)
            h = self.experts(h.reshape(local, -1, x.shape[1]))
            out = h.view(local, self.world, -1, x.shape[1]).transpose(0, 1).reshape(recv.shape)
        else:  # ragged: one matmul per local expert on its received rows
            out = torch.cat([self.experts(r[None], e)[0]
                             for e, r in enumerate(self._split_by_expert(recv, state))])
            out = self._unsplit(out, state)
        return self.combine(out, weights, state).reshape(shape)

    def _capacity(self, tokens: int) -> int:
        return math.ceil(self.cf * tokens * self.k / self.E)

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor):
        """Permute the tokens by expert, pad each expert's rows to its capacity (dropping what
        is over it), exchange them with the experts' ranks."""
        T, D = x.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert = flat[order]
        counts = torch.bincount(flat, minlength=self.E)
        permuted = x[order // self.k]  # (T*k, D): the routed tokens, expert by expert
        start = torch.cumsum(counts, 0) - counts
        pos = torch.arange(len(flat)) - start[expert]
        call = {"routed": counts.tolist(), "rows_per_token": self.k, "dim": D,
                "itemsize": x.element_size(), "permuted_bytes": permuted.nbytes}
        if self.cf:
            C = self._capacity(T)
            keep = pos < C
            slot = expert[keep] * C + pos[keep]
            send = x.new_zeros((self.E * C, D)).index_copy(0, slot, permuted[keep])
            rows = [len(send) // self.world] * self.world
            recv = _AllToAll.apply(send, rows, rows)
            kept = torch.clamp(counts, max=C)
            call.update(capacity=C, kept=kept.tolist(), send_bytes=send.nbytes,
                        recv_bytes=recv.nbytes,
                        pad_rows=int(self.E * C - kept.sum()), pad_bytes_per_buffer=int(
                            (self.E * C - kept.sum()) * D * x.element_size()))
            state = (order, slot, keep, None)
        else:  # dropless: ragged splits, the counts exchanged first
            per_rank = counts.view(self.world, -1)
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts)
            in_splits = per_rank.sum(1).tolist()
            out_splits = got.view(self.world, -1).sum(1).tolist()
            recv = _AllToAll.apply(permuted, out_splits, in_splits)
            call.update(capacity=None, kept=counts.tolist(), send_bytes=permuted.nbytes,
                        recv_bytes=recv.nbytes, pad_rows=0, pad_bytes_per_buffer=0)
            state = (order, None, None, (got.view(self.world, -1), in_splits, out_splits))
        self.calls.append(call)
        return recv, state

    def _split_by_expert(self, recv, state):
        got = state[3][0]  # (world, local): rows from each source rank for each local expert
        chunks = recv.split(got.reshape(-1).tolist())
        local = got.shape[1]
        return [torch.cat([chunks[s * local + e] for s in range(self.world)])
                for e in range(local)]

    def _unsplit(self, out, state):
        got = state[3][0]
        local = got.shape[1]
        per_e = out.split(got.sum(0).tolist())
        parts = [p.split(got[:, e].tolist()) for e, p in enumerate(per_e)]
        return torch.cat([parts[e][s] for s in range(self.world) for e in range(local)])

    def combine(self, out: torch.Tensor, weights: torch.Tensor, state) -> torch.Tensor:
        """Send the experts' outputs back, pick each token's rows out, weight and sum them."""
        order, slot, keep, ragged = state
        T = weights.shape[0]
        if ragged is None:
            back = _AllToAll.apply(out, [len(out) // self.world] * self.world,
                                   [len(out) // self.world] * self.world)
            rows = out.new_zeros((len(order), out.shape[1])).index_copy(
                0, torch.nonzero(keep).squeeze(1), back[slot])
        else:
            _, in_splits, out_splits = ragged
            rows = back = _AllToAll.apply(out, in_splits, out_splits)
        self.calls[-1].update(combine_back_bytes=back.nbytes, combine_rows_bytes=rows.nbytes)
        w = weights.reshape(-1)[order][:, None]
        return out.new_zeros((T, out.shape[1])).index_add(0, order // self.k, rows * w)


class Model(nn.Module):
    def __init__(self, a: argparse.Namespace, world: int):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(a.layers):
            self.layers.append(Dense(a.dim))
            self.layers.append(MoE(a.dim, a.hidden, a.experts, a.top_k, a.capacity_factor, world))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def main(argv: list[str] | None = None) -> None:
    p = parser(layers=2, dim=128, batch=8, seq=64, steps=2)
    p.add_argument("--capacity-factor", type=float, default=1.5,
                   help="0: dropless (ragged all-to-all, no padding)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--fsdp", action="store_true")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.experts % world:
        raise SystemExit(f"--experts {a.experts} does not split over {world} ranks")
    torch.manual_seed(0)
    model = Model(a, world)
    torch.manual_seed(1 + rank)  # each rank its own experts
    for m in model.modules():
        if isinstance(m, Experts):
            for prm in m.parameters():
                prm.data.normal_(0, prm.shape[1] ** -0.5)
    if a.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        experts = {prm for m in model.modules() if isinstance(m, Experts)
                   for prm in m.parameters()}
        for layer in model.layers:
            if isinstance(layer, Dense):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh, ignored_params=experts)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for _ in range(a.steps):
        for m in moes:
            m.calls.clear()
        x = torch.randn(a.batch, a.seq, a.dim)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    write_truth(a.truth, rank, {
        "rank": rank, "world": world, "capacity_factor": a.capacity_factor,
        "experts": a.experts, "top_k": a.top_k, "tokens": a.batch * a.seq, "fsdp": a.fsdp,
        "calls": [c for m in moes for c in m.calls]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
