"""The scenario matrix's models: the bundled example's transformer with blocks that checkpoint
themselves or leak through a module-held cache, an encoder with tied embeddings, a residual MLP.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from snapforensics.examples.fsdp_ckpt import Block, Transformer

VOCAB, DIM, HEADS, LAYERS, BATCH, SEQ = 512, 128, 4, 4, 2, 64


class CkptBlock(Block):
    """A block that checkpoints its own body with ``torch.utils.checkpoint`` (inside the unit)."""

    def __init__(self, dim: int, heads: int, mode: str = "nonreentrant"):
        super().__init__(dim, heads)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        body = super().forward
        if self.mode == "reentrant":
            return checkpoint(body, x, use_reentrant=True)
        if self.mode == "selective":
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            save = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
            ctx = functools.partial(create_selective_checkpoint_contexts, save)
            return checkpoint(body, x, use_reentrant=False, context_fn=ctx)
        return checkpoint(body, x, use_reentrant=False)


class CachingBlock(Block):
    """A block that keeps every output it made "for later inspection": a leak through a module."""

    def __init__(self, dim: int, heads: int):
        super().__init__(dim, heads)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        self.seen.append(y)  # holds the output and, through it, its autograd graph
        return y


class TiedEncoder(Transformer):
    """Embedding -> blocks -> norm -> head whose weight *is* the embedding's."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__(vocab, dim, layers, heads)
        self.head.weight = self.embed.weight


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResMLP(nn.Module):
    """A residual MLP classifier (no attention, no embedding)."""

    def __init__(self, dim: int, layers: int, classes: int = 64):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(ResBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))
