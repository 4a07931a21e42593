"""A small FSDP2 run that writes its own truth about tensor identity (tests/test_identity.py).

Run by ``snapforensics record --nproc-per-node 2 --device cpu tests/identity_probe.py --truth
DIR``. Each rank writes ``DIR/truth.rank{R}.json``: what torch itself says, read without the
recorder's identity data:

- ``params`` / ``grads`` / ``states``: for every ``model.named_parameters()`` name, the local
  shard's storage address, shape and dtype (at each optimizer step: parameters and gradients
  before it, ``optimizer.state`` after it), with the time (epoch us) it was read;
- ``unsharded``: each ``nn.Linear``'s weight as its forward pre hook sees it (FSDP2's unsharded
  parameter, gathered), per forward;
- ``saved``: after each forward, every tensor the autograd graph saved (``_saved_*`` of each
  node reached from the loss), its storage address, shape, dtype and the modules whose forward
  made the node that saved it (innermost first: each module's forward post hook walks the graph
  from its output back to its inputs' nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.wo(torch.tanh(self.wq(h)))
        return x + self.w2(torch.relu(self.w1(x)))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _storage(t):
    t = getattr(t, "_local_tensor", t)
    return {"ptr": t.untyped_storage().data_ptr(), "shape": list(t.shape),
            "dtype": str(t.dtype).replace("torch.", ""), "t_us": time.time_ns() / 1000.0}


def _saved_in(out, stop) -> list:
    """(node, attr) of the saved tensors on the graph from ``out`` back to the nodes in
    ``stop`` (the inputs' grad_fns)."""
    found, seen = [], set()
    work = [out.grad_fn] if getattr(out, "grad_fn", None) is not None else []
    while work:
        node = work.pop()
        if node is None or node in stop or node in seen:
            continue
        seen.add(node)
        found.append(node)
        work.extend(n for n, _ in node.next_functions)
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", required=True)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model(256, 64, 2)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    truth: dict = {"params": [], "grads": [], "states": [], "unsharded": [], "saved": []}
    owners: dict = {}  # node -> [module names], innermost first (post hooks run inner first)
    names = {m: n for n, m in model.named_modules()}

    def pre(module, inputs):
        module._probe_stop = {getattr(i, "grad_fn", None) for i in inputs
                              if isinstance(i, torch.Tensor)} - {None}
        if isinstance(module, nn.Linear):
            truth["unsharded"].append({"name": names[module] + ".weight",
                                       **_storage(module.weight)})

    def post(module, inputs, out):
        for node in _saved_in(out, module._probe_stop):
            owners.setdefault(node, []).append(names[module])

    for m in model.modules():
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    for step in range(args.steps):
        opt.zero_grad()
        tokens = torch.randint(0, 256, (4, 32))
        loss = model(tokens).float().logsumexp(-1).mean()
        seen = set()
        for node, mods in owners.items():
            for attr in dir(node):
                if not attr.startswith("_saved_"):
                    continue
                v = getattr(node, attr)
                for t in v if isinstance(v, (tuple, list)) else [v]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                        key = (t.untyped_storage().data_ptr(), node.name(), attr)
                        if key not in seen:
                            seen.add(key)
                            truth["saved"].append({"modules": mods, "node": node.name(),
                                                   "attr": attr, "step": step, **_storage(t)})
        owners.clear()
        loss.backward()
        for name, p in model.named_parameters():
            truth["params"].append({"name": name, "step": step, **_storage(p)})
            if p.grad is not None:
                truth["grads"].append({"name": name + ".grad", "step": step, **_storage(p.grad)})
        opt.step()
        for name, p in model.named_parameters():
            for k, v in opt.state[p].items():
                if isinstance(v, torch.Tensor):
                    truth["states"].append({"name": f"{name}.{k}", "step": step, **_storage(v)})
    with open(os.path.join(args.truth, f"truth.rank{rank}.json"), "w") as f:
        json.dump(truth, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
