"""A Llama-like decoder under torchtitan's whole tensor-parallel plan, for the TP forecast's and
the SequenceParallel rule's tests: a model unlike the bundled TP example's blocks
(`snapforensics/examples/tp.py`), with what real TP runs put around them: token embeddings
(`RowwiseParallel`, vocabulary-sharded), a final norm, an untied head over the vocabulary
(`ColwiseParallel`) and the loss under `loss_parallel()` (the logits stay sharded over the
vocabulary, `use_local_output=False`), AdamW. torchtitan's names and plan
(`parallelize_llama`); 6 layers of dim 96, 8 heads (TP up to 8), SwiGLU, rotary attention,
vocabulary 3000.

    snapforensics record --nproc-per-node 2 --device cpu tests/lm_tp.py --sp

`--sp`: SequenceParallel on the norms (the projections take and return sequence shards);
`--no-loss-parallel`: the head's output gathered (`Replicate`) and the plain cross-entropy;
`--dp N`: FSDP2 over a (dp_shard, tp) mesh. At one TP rank the model is not parallelized.
"""

from __future__ import annotations

import argparse

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
    loss_parallel,
    parallelize_module,
)


def rotary(x):
    t, dh = x.shape[-2:]
    angle = torch.outer(torch.arange(t).float(),
                        1.0 / 10000 ** (torch.arange(0, dh, 2).float() / dh))
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.hd = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: the local ones (ColwiseParallel splits the heads over the TP ranks)
        q, k, v = (w(x).view(b, t, -1, self.hd).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(dim), FeedForward(dim, 3 * dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab, dim, heads, layers):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        h = self.tok_embeddings(x)
        for b in self.layers.values():
            h = b(h)
        return self.output(self.norm(h))


def parallelize(model, mesh, sp, lp):
    seq = Shard(1) if sp else Replicate()
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq,
                                     output_layouts=Shard(-1) if lp else Replicate(),
                                     use_local_output=not lp)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    for b in model.layers.values():
        p = {"attention": gather, "attention.wq": ColwiseParallel(),
             "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
             "attention.wo": RowwiseParallel(output_layouts=seq),
             "feed_forward": gather, "feed_forward.w1": ColwiseParallel(),
             "feed_forward.w3": ColwiseParallel(),
             "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sp:
            p["attention_norm"] = SequenceParallel()
            p["ffn_norm"] = SequenceParallel()
        parallelize_module(b, mesh, p)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sp", action="store_true")
    p.add_argument("--no-loss-parallel", action="store_true")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=96)
    p.add_argument("--vocab", type=int, default=3000)
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    dist.init_process_group("gloo")
    tp = dist.get_world_size() // a.dp
    mesh = init_device_mesh("cpu", (a.dp, tp), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    model = Llama(a.vocab, a.dim, a.heads, a.layers)
    lp = not a.no_loss_parallel
    if tp > 1:
        parallelize(model, mesh["tp"], a.sp, lp)
    if a.dp > 1:
        from torch.distributed.fsdp import fully_shard
        for b in model.layers.values():
            fully_shard(b, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(a.steps):
        x, y = (torch.randint(0, a.vocab, (a.batch, a.seq), generator=g) for _ in range(2))
        out = model(x)
        if tp > 1 and lp:
            with loss_parallel():
                loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
                loss.backward()
        else:
            F.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
