"""A small FSDP2 + activation-checkpointing training run, in several layouts.

Run it under torchrun or the recorder::

    snapforensics record --nproc-per-node 2 -m snapforensics.examples.fsdp_ckpt --variant buggy
    torchrun --nproc-per-node 2 -m snapforensics.examples.fsdp_ckpt --variant fixed

or alone (``python -m snapforensics.examples.fsdp_ckpt``: a world of one, gloo, free port).

It is an ordinary training loop (zero_grad, forward, backward, step) with no phase
annotations of its own: what a recording shows comes from torch and FSDP only. CPU tensors
and gloo when no CUDA device is visible, cuda and nccl otherwise. Seeded.

Model (defaults): embedding (vocab 1024) -> 6 blocks [RMSNorm, attention (qkv, proj), RMSNorm,
MLP 512 -> 2048 -> 512], no biases -> RMSNorm -> head; batch 2 x 64 tokens; AdamW (default
for-loop implementation). About 3.1 M parameters (12.6 MB fp32) per block. Few parameter tensors
on purpose: on CPU the recorder's profiler cost grows with the Python calls DTensor makes per
parameter in the optimizer (foreach/fused AdamW over DTensors cost 3-9x more there).

Variants (``VARIANTS``; every one but ``full_init`` builds the model on the meta device, shards
it, then ``to_empty`` + ``reset_parameters``; the FSDP1 ones let FSDP materialize the meta
modules unit by unit):

- ``buggy``: ``checkpoint_wrapper(block)``, ``fully_shard(block)``,
  ``block.set_reshard_after_backward(False)``: parameters unsharded in backward and in the
  recompute are never resharded (the seed bug).
- ``fixed``: the same layout with ``set_reshard_after_backward(True)``.
- ``nested``: ``fully_shard`` on each block's ``attn`` and ``mlp`` inside
  ``checkpoint_wrapper(block)``; defaults, no prefetch lists.
- ``ac_submodules``: ``checkpoint_wrapper`` on each block's ``attn`` and ``mlp`` (two
  checkpoint regions inside one unit), ``fully_shard(block)``; ``fixed`` is its twin.
- ``noac``: ``fully_shard`` per block, no checkpointing (activations dominate; batch 8 by default).
- ``reshard_after_forward_false``: ``fixed`` with
  ``fully_shard(block, reshard_after_forward=False)``.
- ``prefetch_in_recompute``: ``nested`` plus ``set_modules_to_forward_prefetch`` from each inner
  unit to the next two (attn_i -> mlp_i, attn_i+1; mlp_i -> attn_i+1, mlp_i+1): the recompute
  re-gathers the next block's attention, which nothing frees until the end of backward.
- ``no_grad_sync``: ``fixed`` with 2 micro-batches per step, gradient sync off on the first.
- ``full_init``: ``fixed``, but the full model is materialized (fp32, on the device) before
  sharding.
- ``mixed_precision``: ``fixed`` with ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``.
- ``leak``: ``fixed``; the loop keeps every step's loss, logits and a confidence statistic with
  their autograd graphs in a list (logits and the softmax the statistic's graph saves: two
  batch x seq x vocab fp32 tensors, 1 MiB a step by default).
- ``no_rate_limit``: ``fixed`` with forward prefetch of 3 blocks ahead and backward prefetch of
  3 blocks behind.
- ``fsdp1``: FSDP1 (``FullyShardedDataParallel``) instead of ``fully_shard``: one unit per
  block (``ModuleWrapPolicy({Block})``) and the root, ``FULL_SHARD``, ``use_orig_params=True``,
  meta-device init materialized by FSDP (``reset_parameters``), then
  ``apply_activation_checkpointing`` (non-reentrant) on each block inside its unit.
- ``fsdp1_shard_grad_op``: ``fsdp1`` with ``ShardingStrategy.SHARD_GRAD_OP`` (parameters stay
  unsharded from forward to backward) and ``MixedPrecision(param_dtype=bfloat16,
  reduce_dtype=float32)`` (a low-precision ``_mp_shard`` per unshard, fp32 gradient reduction).
- ``fsdp1_shard_grad_op_fp32``: ``fsdp1`` with ``SHARD_GRAD_OP`` and no mixed precision: the same
  run as ``fsdp1`` but for the sharding strategy (the forecast's strategy check compares them).
- ``fsdp1_no_prefetch``: ``fsdp1`` with ``backward_prefetch=None`` (each unit gathered at its
  own pre-backward: accelerate's FSDP1 plugin default, NO_PREFETCH).
- ``fsdp1_reentrant``: FSDP1 ``FULL_SHARD`` per block with HF-style gradient checkpointing: a
  *reentrant* ``checkpoint`` around each FSDP-wrapped block. The recompute re-runs the unit's
  pre-forward (all-gather) and post-forward (reshard), then its pre-backward hook all-gathers it
  again: two all-gathers per layer per backward (pytorch #105635), reproducible on torch 2.13.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# ---------------------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one op a line: Inductor's buffers name the line that made them (test_compile)
        h = self.fc1(x)
        h = F.gelu(h)
        return self.fc2(h)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.RMSNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


# ---------------------------------------------------------------------------- layouts


@dataclass
class Plan:
    """What a variant changes besides the sharding layout."""

    full_init: bool = False  # build the full model on the device before sharding
    micro_batches: int = 1
    # set_requires_gradient_sync(False) on non-final micro-batches
    grad_sync_off_first: bool = False
    keep_graphs: bool = False  # the leak
    batch: int | None = None  # default batch size for this variant (when --batch is not given)
    model: nn.Module | None = None  # the module to train when the variant wraps the model (FSDP1)
    materialized: bool = False  # the variant already materialized the meta-device model


def _blocks(model: Transformer) -> list[nn.Module]:
    return list(model.layers)


def _per_block(model: Transformer, mesh, *, ac: bool = True, reshard_after_backward: bool = True,
               mp: MixedPrecisionPolicy | None = None, **shard_kw) -> list[nn.Module]:
    """checkpoint_wrapper(block) (if ac) then fully_shard(block); the root last."""
    kw = {"mesh": mesh, **shard_kw}
    if mp is not None:
        kw["mp_policy"] = mp
    units = []
    for i, block in enumerate(_blocks(model)):
        if ac:
            block = checkpoint_wrapper(block)
        fully_shard(block, **kw)
        block.set_reshard_after_backward(reshard_after_backward)
        model.layers[i] = block
        units.append(block)
    root_kw = {"mesh": mesh}
    if mp is not None:
        root_kw["mp_policy"] = mp
    fully_shard(model, **root_kw)
    return units


def _nested(model: Transformer, mesh) -> list[nn.Module]:
    """fully_shard(attn), fully_shard(mlp) inside checkpoint_wrapper(block); the root last."""
    units = []
    for i, block in enumerate(_blocks(model)):
        fully_shard(block.attn, mesh=mesh)
        fully_shard(block.mlp, mesh=mesh)
        units += [block.attn, block.mlp]
        model.layers[i] = checkpoint_wrapper(block)
    fully_shard(model, mesh=mesh)
    return units


def v_buggy(model, mesh):
    _per_block(model, mesh, reshard_after_backward=False)
    return Plan()


def v_fixed(model, mesh):
    _per_block(model, mesh, reshard_after_backward=True)
    return Plan()


def v_nested(model, mesh):
    _nested(model, mesh)
    return Plan()


def v_ac_submodules(model, mesh):
    """checkpoint_wrapper(block.attn), checkpoint_wrapper(block.mlp), fully_shard(block): two
    checkpoint regions inside each FSDP unit (accelerate's FSDP2 `activation_checkpointing`
    with a policy matching the sub-modules does this)."""
    for block in _blocks(model):
        block.attn = checkpoint_wrapper(block.attn)
        block.mlp = checkpoint_wrapper(block.mlp)
    _per_block(model, mesh, ac=False)
    return Plan()


def v_noac(model, mesh):
    _per_block(model, mesh, ac=False)
    return Plan(batch=8)  # without checkpointing, 4x the tokens: activations dominate the peak


def v_reshard_after_forward_false(model, mesh):
    _per_block(model, mesh, reshard_after_forward=False)
    return Plan()


def v_prefetch_in_recompute(model, mesh):
    # each inner unit prefetches the next two
    # (attn_i -> mlp_i, attn_i+1; mlp_i -> attn_i+1, mlp_i+1).
    # In backward the recompute of block i runs attn_i's full pre-forward (it is IDLE then), whose
    # prefetch all-gathers attn_i+1 again, already done with its backward: one buffer per layer
    # that only finalize_backward releases.
    units = _nested(model, mesh)
    for k, unit in enumerate(units[:-1]):
        unit.set_modules_to_forward_prefetch(units[k + 1:k + 3])
    return Plan()


def v_no_grad_sync(model, mesh):
    _per_block(model, mesh)
    return Plan(micro_batches=2, grad_sync_off_first=True)


def v_full_init(model, mesh):
    _per_block(model, mesh)
    return Plan(full_init=True)


def v_mixed_precision(model, mesh):
    _per_block(model, mesh, mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32))
    return Plan()


def v_leak(model, mesh):
    _per_block(model, mesh)
    return Plan(keep_graphs=True)


def v_no_rate_limit(model, mesh):
    units = _per_block(model, mesh)
    depth = 3
    for i, unit in enumerate(units):
        ahead = units[i + 1:i + 1 + depth]
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        behind = units[max(0, i - depth):i][::-1]
        if behind:
            unit.set_modules_to_backward_prefetch(behind)
    return Plan()


def _fsdp1(model: Transformer, mesh, strategy: str, mp: bool = False, ac: bool = True,
           prefetch: bool = True) -> Plan:
    """FSDP1: FullyShardedDataParallel per block and the root, then checkpoint each block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:  # FSDP1 refuses CPU unless device_id names it
        device = torch.device(mesh.device_type)
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                   sharding_strategy=ShardingStrategy[strategy], use_orig_params=True,
                   device_id=device, mixed_precision=policy,
                   backward_prefetch=BackwardPrefetch.BACKWARD_PRE if prefetch else None)
    if ac:
        apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block))
    return Plan(model=wrapped, materialized=True)


class _ReentrantCheckpoint(nn.Module):
    """HF-style gradient checkpointing: reentrant checkpoint around the (FSDP-wrapped) block."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=True)


def v_fsdp1_reentrant(model, mesh):
    for i, block in enumerate(_blocks(model)):
        model.layers[i] = _ReentrantCheckpoint(block)
    return _fsdp1(model, mesh, "FULL_SHARD", ac=False)


def v_fsdp1(model, mesh):
    return _fsdp1(model, mesh, "FULL_SHARD")


def v_fsdp1_no_prefetch(model, mesh):
    return _fsdp1(model, mesh, "FULL_SHARD", prefetch=False)


def v_fsdp1_shard_grad_op(model, mesh):
    return _fsdp1(model, mesh, "SHARD_GRAD_OP", mp=True)


def v_fsdp1_shard_grad_op_fp32(model, mesh):
    return _fsdp1(model, mesh, "SHARD_GRAD_OP")


VARIANTS: dict[str, Callable[[Transformer, object], Plan]] = {
    "buggy": v_buggy,
    "fixed": v_fixed,
    "nested": v_nested,
    "noac": v_noac,
    "ac_submodules": v_ac_submodules,
    "reshard_after_forward_false": v_reshard_after_forward_false,
    "prefetch_in_recompute": v_prefetch_in_recompute,
    "no_grad_sync": v_no_grad_sync,
    "full_init": v_full_init,
    "mixed_precision": v_mixed_precision,
    "leak": v_leak,
    "no_rate_limit": v_no_rate_limit,
    "fsdp1": v_fsdp1,
    "fsdp1_no_prefetch": v_fsdp1_no_prefetch,
    "fsdp1_shard_grad_op": v_fsdp1_shard_grad_op,
    "fsdp1_shard_grad_op_fp32": v_fsdp1_shard_grad_op_fp32,
    "fsdp1_reentrant": v_fsdp1_reentrant,
}


# ---------------------------------------------------------------------------- run


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_dist() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world)
    return rank, world, device


def _reset_parameters(model: nn.Module) -> None:
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m snapforensics.examples.fsdp_ckpt",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="fixed", choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per micro-batch (default 2; noac: 8)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", default="none", choices=("none", "aot_eager", "inductor"),
                   help="torch.compile each block's mlp with this backend (inductor on CPU needs "
                        "a C++ compiler); the FSDP hooks and checkpoint regions stay eager")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = _init_dist()
    try:
        train(args, rank, world, device)
    finally:
        dist.destroy_process_group()
    return 0


def compile_blocks(model: Transformer, backend: str) -> None:
    """`torch.compile` each block's mlp in place (`nn.Module.compile`: the module object stays,
    so the layouts wrap and shard it as in eager). Allocations its graphs make run under the
    profiler range "Torch-Compiled Region: F/C" that the recorder writes as `compile_context`."""
    if backend == "none":
        return
    torch._dynamo.reset()  # a fresh cache per run: runs sharing a process stay under the
    # recompile limit (each block's module is a new guard)
    for block in _blocks(model):
        block.mlp.compile(backend=backend)


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    """One run of `args` in the process group already initialized (several runs may share it:
    tests record the variants one after another in one job)."""
    torch.manual_seed(args.seed)
    mesh = init_device_mesh(device.type, (world,))
    apply = VARIANTS[args.variant]
    compiled = getattr(args, "compile", "none")
    if args.variant == "full_init":
        with torch.device(device):
            model = Transformer(args.vocab, args.dim, args.layers, args.heads)
        compile_blocks(model, compiled)
        plan = apply(model, mesh)
    else:
        with torch.device("meta"):
            model = Transformer(args.vocab, args.dim, args.layers, args.heads)
        compile_blocks(model, compiled)
        plan = apply(model, mesh)
        if not plan.materialized:
            model.to_empty(device=device)
            _reset_parameters(model)
    if plan.model is not None:
        model = plan.model
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1000 + rank)
    batch = args.batch or plan.batch or 2
    kept = []  # only the leak variant fills it
    for step in range(args.steps):
        started, started_cpu = time.perf_counter(), time.process_time()
        optim.zero_grad()
        for mb in range(plan.micro_batches):
            last = mb == plan.micro_batches - 1
            if plan.grad_sync_off_first:
                model.set_requires_gradient_sync(last)
            tokens = torch.randint(0, args.vocab, (batch, args.seq + 1), generator=gen)
            tokens = tokens.to(device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            if plan.keep_graphs:  # "for logging": never detached, never freed
                confidence = logits.softmax(-1).amax(-1).mean()
                kept.append((loss, logits, confidence))
        optim.step()
        if rank == 0:  # step times: what benchmarks/bench_record.py compares
            print(f"[fsdp_ckpt:{args.variant}] step {step} loss {loss.item():.4f} "
                  f"({time.perf_counter() - started:.3f} s, "
                  f"cpu {time.process_time() - started_cpu:.3f} s)", flush=True)
    if rank == 0:
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"[fsdp_ckpt:{args.variant}] peak RSS {rss_mb:.1f} MB", flush=True)


if __name__ == "__main__":
    sys.exit(main())
