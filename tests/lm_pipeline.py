"""Decoder language models trained with torch.distributed.pipelining, for the pipeline
forecast's tests: models unlike the bundled pipeline example's MLP stack (`snapforensics/
examples/pipeline.py`), with what real pipelines put on their end stages: embeddings on the
first stage; a final norm, an untied head over the vocabulary and cross-entropy on the last.
The model is split torchtitan's way (every stage builds the whole model and deletes what it
does not run, so the layers keep their names: `layers.5.attn.qkv.weight`).

- `--model gpt`: token and position embeddings, pre-norm attention (scaled_dot_product_attention)
  and GELU MLP blocks with LayerNorm, AdamW; 8 layers of dim 128, vocabulary 2048.
- `--model llama` (torchtitan's names): token embeddings, RMSNorm, rotary attention without
  biases, SwiGLU feed-forward, Adam; 12 layers of dim 96, vocabulary 3000.

    snapforensics record --nproc-per-node 2 --device cpu tests/lm_pipeline.py \\
        --model gpt --schedule 1f1b --microbatches 8

One stage per rank (`--schedule gpipe | 1f1b`), or two (`interleaved`: ScheduleInterleaved1F1B,
`looped_bfs`: ScheduleLoopedBFS; rank r running stages r and r + S). With `--dp N` each stage is
fully_shard-ed over N ranks (every block, then the stage), on a (pp, dp_shard) mesh, as
torchtitan composes FSDP with PP.
`--truth DIR` writes DIR/truth.rank{R}.json from the running stages, as the bundled example
does: the rank's pipeline index and the most micro-batches in flight on a stage of it per step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from snapforensics.examples.common import write_truth
from snapforensics.examples.pipeline import _count_in_flight

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "looped_bfs": ScheduleLoopedBFS}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim)
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


def rotary(x: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, tokens, head dim) rotated by its positions (RoPE, base 10000)."""
    t, dh = x.shape[-2:]
    angle = torch.outer(torch.arange(t).float(),
                        1.0 / 10000 ** (torch.arange(0, dh, 2).float() / dh))
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), LlamaAttention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1, self.w3 = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, 3 * dim, bias=False)
        self.w2 = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Decoder(nn.Module):
    def __init__(self, model: str, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        llama = model == "llama"
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos = None if llama else nn.Embedding(seq, dim)
        block = LlamaBlock if llama else Block
        self.layers = nn.ModuleDict({str(i): block(dim, heads) for i in range(layers)})
        self.norm = nn.RMSNorm(dim) if llama else nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
            if self.pos is not None:
                x = x + self.pos(torch.arange(x.shape[1]))
        for block in self.layers.values():
            x = block(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


SHAPES = {"gpt": {"layers": 8, "dim": 128, "seq": 128, "batch": 16, "vocab": 2048},
          "llama": {"layers": 12, "dim": 96, "seq": 96, "batch": 24, "vocab": 3000}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="gpt")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dp", type=int, default=1, help="dp_shard degree (FSDP2 inside the stages)")
    p.add_argument("--truth", type=Path)
    a = p.parse_args()
    shape = SHAPES[a.model]
    dist.init_process_group("gloo")
    ranks, rank, group = dist.get_world_size() // a.dp, dist.get_rank(), None
    if a.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ranks, a.dp), mesh_dim_names=("pp", "dp_shard"))
        rank, group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    v = 2 if a.schedule in ("interleaved", "looped_bfs") else 1
    stages = ranks * v
    per = shape["layers"] // stages
    chunks = []
    for i in range(rank, stages, ranks):
        torch.manual_seed(0)  # every stage builds the same model, then keeps its part
        m = Decoder(a.model, shape["vocab"], shape["dim"], 4, shape["layers"], shape["seq"])
        for j in list(m.layers):
            if not i * per <= int(j) < (i + 1) * per:
                del m.layers[j]
        if i != 0:
            m.tok_embeddings = m.pos = None
        if i != stages - 1:
            m.norm = m.output = None
        chunks.append(m)
    if a.dp > 1:
        from torch.distributed.fsdp import fully_shard

        for c in chunks:
            for block in c.layers.values():
                fully_shard(block, mesh=mesh["dp_shard"])
            fully_shard(c, mesh=mesh["dp_shard"])
    pipe = [PipelineStage(c, i, stages, torch.device("cpu"), group=group)
            for c, i in zip(chunks, range(rank, stages, ranks))]
    held: list[int] = []
    for st in pipe:
        _count_in_flight(st, held)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    schedule = SCHEDULES[a.schedule](pipe if v > 1 else pipe[0], n_microbatches=a.microbatches,
                                     loss_fn=loss)
    params = nn.ModuleList(chunks).parameters()
    opt = torch.optim.Adam(params, lr=1e-3) if a.model == "llama" else \
        torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(a.steps):
        held.append(0)
        x, y = (torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
                for _ in range(2))
        # the first stage takes the batch, the last the targets (an interleaved schedule's
        # last stage is on the last rank)
        schedule.step(*[x] * (rank == 0), **{"target": y} if rank == ranks - 1 else {})
        opt.step()
        opt.zero_grad(set_to_none=True)
    write_truth(a.truth, dist.get_rank(), {"schedule": a.schedule, "stage": rank,
                                           "stages": ranks, "dp": a.dp,
                                           "microbatches": a.microbatches, "held_per_step": held})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
