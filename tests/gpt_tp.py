"""A GPT-2-like decoder under tensor parallelism alone (2 ranks, a 1-D mesh), for the
SequenceParallel rule: unlike the bundled TP example and tests/lm_tp.py its norms are
`nn.LayerNorm` (whose kernel makes the output before its mean and rstd, so the norm's output
is not the last block its module makes), its attention runs `scaled_dot_product_attention`, and
its untied head is `ColwiseParallel` with the logits gathered (`Replicate`) for a plain
cross-entropy: with SP the final norm's output reaches the head sequence-sharded and is
all-gathered for it, as torchtitan's plan does for its `output`.

    snapforensics record --nproc-per-node 2 --device cpu tests/gpt_tp.py -- --sp
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
    parallelize_module,
)

D, HEADS, LAYERS, VOCAB, SEQ, BATCH = 256, 4, 3, 512, 128, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape

        def heads(z):  # the local heads after the column-wise split
            return z.view(b, t, -1, D // HEADS).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                           is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(D), Attention()
        self.ln2, self.mlp = nn.LayerNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.h:
            x = b(x)
        return self.head(self.ln_f(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sp", action="store_true", help="SequenceParallel on the norms")
    a = p.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = GPT()
    seq = Shard(1) if a.sp else Replicate()
    for b in model.h:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=seq),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=seq)}
        if a.sp:
            gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn": gather,
                         "mlp": gather})
        parallelize_module(b, mesh, plan)
    top = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if a.sp:
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        idx = torch.randint(0, VOCAB, (BATCH, SEQ))
        target = torch.randint(0, VOCAB, (BATCH, SEQ))
        loss = F.cross_entropy(model(idx).reshape(-1, VOCAB), target.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
