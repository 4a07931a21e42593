"""A matrix of small training layouts, each recorded into its own snapshot, with ground truth.

    python -m snapforensics.examples.scenarios --out DIR                 # every 2-rank layout
    python -m snapforensics.examples.scenarios --out DIR --world 4       # the 2x2-mesh ones
    python -m snapforensics.examples.scenarios --out DIR --only f2_block_cw,f2_block_cw_rab_false
    python -m snapforensics.examples.scenarios --list

One torch.distributed job (gloo, CPU; ``torch.multiprocessing.spawn`` unless already under
torchrun) runs the layouts in sequence. Each layout is recorded with the project's CPU recorder
(``snapforensics.record.inprocess.recording``) from before the model is built to after its last
optimizer step, into ``DIR/<layout>/rank{R}.pickle``.

``--check`` (on by default; ``--no-check`` to skip) reads FSDP's own state during the run and
writes ``DIR/<layout>/truth.rank{R}.json``: after every forward and backward, the bytes of
unsharded parameter storage still alive (FSDP2: each ``FSDPParam``'s ``all_gather_outputs``
storages; FSDP1: each handle's ``_full_param_padded``), root and non-root separately; the bytes
of unsharded gradients; per backward, how many all-gathers each unit issued and how many of those
were consumed (``wait_for_unshard`` with a pending result), and how many were still pending when
FSDP finalized the backward (issued, never used); the full model's bytes when it was built
before sharding; the bytes a module-held cache keeps after each step. The expected verdicts of a
test come from this file and the layout's configuration, never from ``diagnose``.

Layouts vary: FSDP2 / FSDP1 / DDP / none; units per block, per submodule, grouped
(``fully_shard([a, b])``), root only; ``checkpoint_wrapper``, ``apply_activation_checkpointing``,
``torch.utils.checkpoint`` inside the block (reentrant or not), selective checkpointing,
composable ``checkpoint``, none; meta-device init or build-then-shard; mixed precision; CPU
offload; HSDP on a 2x2 mesh; gradient accumulation done right and wrong; explicit prefetch;
``reshard_after_forward=False`` on some units; a leak through a module-held cache; three model
families (GPT-style transformer, residual MLP, encoder with tied embeddings). Small models (a few
MiB), 3 optimizer steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from snapforensics.examples.fsdp_ckpt import Transformer, compile_blocks
from snapforensics.examples.scenarios.layouts import ALL_LAYOUTS, LAYOUTS, Layout
from snapforensics.examples.scenarios.models import (
    BATCH,
    HEADS,
    SEQ,
    VOCAB,
    CachingBlock,
    CkptBlock,
    ResMLP,
    TiedEncoder,
)
from snapforensics.examples.scenarios.probe import Probe, tensor_bytes
from snapforensics.examples.scenarios.wrapping import Ctx


def _build(lay: Layout, device: torch.device) -> nn.Module:
    if lay.family == "mlp":
        return ResMLP(lay.dim, lay.layers)
    if lay.family == "encoder":
        model = TiedEncoder(VOCAB, lay.dim, lay.layers, HEADS)
    else:
        model = Transformer(VOCAB, lay.dim, lay.layers, HEADS)
    if lay.block != "plain":
        for i in range(len(model.layers)):
            blk = CachingBlock(lay.dim, HEADS) if lay.block == "caching" else \
                CkptBlock(lay.dim, HEADS, lay.block)
            model.layers[i] = blk
    return model


def _reset_parameters(model: nn.Module) -> None:
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def _batch(lay: Layout, gen: torch.Generator, device: torch.device):
    if lay.family == "mlp":
        x = torch.randn(BATCH * SEQ, lay.dim, generator=gen).to(device)
        y = torch.randint(0, 64, (BATCH * SEQ,), generator=gen).to(device)
        return x, y
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:].reshape(-1)


def run_layout(lay: Layout, ctx: Ctx, check: bool) -> dict:
    """Build, wrap and train one layout (the caller records around it). Returns the truth."""
    truth: dict = {"layout": lay.name, "rank": ctx.rank, "world": ctx.world,
                   "config": {k: v for k, v in lay.__dict__.items() if k != "wrap"},
                   "forwards": [], "backwards": [], "steps": []}
    torch.manual_seed(0)
    if lay.init == "build":
        with torch.device(ctx.device):
            model = _build(lay, ctx.device)
        compile_blocks(model, lay.compile)
        truth["full_model_bytes"] = tensor_bytes(model.parameters())
        model = lay.wrap(ctx, model)
    elif lay.init == "local":
        with torch.device(ctx.device):
            model = _build(lay, ctx.device)
        compile_blocks(model, lay.compile)
        model = lay.wrap(ctx, model)
    else:
        with torch.device("meta"):
            model = _build(lay, ctx.device)
        compile_blocks(model, lay.compile)
        wrapped = lay.wrap(ctx, model)
        if wrapped is model:
            model.to_empty(device=ctx.device)
            _reset_parameters(model)
        model = wrapped
    probe = Probe(model) if check else None
    truth["fsdp"] = probe.fsdp if probe else None
    # DDP's gradients: views of its buckets, or a second copy of each (the default)
    truth["ddp_bucket_view"] = getattr(model, "gradient_as_bucket_view", None)
    if lay.optimizer == "sgd":
        optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1000 + ctx.rank)
    caches = [m.seen for m in model.modules() if isinstance(m, CachingBlock)]
    try:
        if lay.accumulation == "wrong":
            model.set_reshard_after_backward(False)  # "saves communication", never undone
        for step in range(lay.steps):
            optim.zero_grad()
            for mb in range(lay.micro_batches):
                last = mb == lay.micro_batches - 1
                if lay.accumulation in ("right", "wrong", "sync_only"):
                    model.set_requires_gradient_sync(last)
                if lay.accumulation == "right":
                    model.set_reshard_after_backward(last)
                x, y = _batch(lay, gen, ctx.device)
                sync_off = lay.accumulation == "no_sync" and not last
                with (model.no_sync() if sync_off else _nullcontext()):
                    out = model(x)
                    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y)
                    if probe:
                        truth["forwards"].append({"step": step, "micro_batch": mb,
                                                  **probe.unsharded()})
                        probe.in_backward = True
                    loss.backward()
                if probe:
                    probe.in_backward = False
                    truth["backwards"].append({"step": step, "micro_batch": mb, "last": last,
                                               **probe.unsharded(), **probe.take_backward()})
                del out, loss
            optim.step()
            if probe:
                truth["steps"].append({"step": step, "cache_bytes": tensor_bytes(
                    t for c in caches for t in c), **probe.unsharded()})
    finally:
        if probe:
            probe.close()
    return truth


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, names: list[str], out: str, check: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    _run_all(names, Path(out), check)


def _run_all(names: list[str], out: Path, check: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from snapforensics.record.inprocess import recording

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cpu")
    try:
        mesh = init_device_mesh("cpu", (world,))
        mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) \
            if world == 4 else None
        ctx = Ctx(rank, world, device, mesh, mesh2d)
        for name in names:
            lay = ALL_LAYOUTS[name]
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            gc.collect()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                with recording(folder / f"rank{rank}.pickle", command=["scenarios", name]):
                    truth = run_layout(lay, ctx, check)
                    gc.collect()
            except Exception as e:  # one broken layout must not stop the matrix
                truth = {"layout": name, "rank": rank, "error": f"{type(e).__name__}: {e}"}
                print(f"[scenarios] {name} failed on rank {rank}: {truth['error']}", flush=True)
            truth["seconds"] = round(time.perf_counter() - t0, 2)
            truth["cpu_seconds"] = round(time.process_time() - c0, 2)
            if check:
                (folder / f"truth.rank{rank}.json").write_text(json.dumps(truth, indent=1))
            if rank == 0:
                print(f"[scenarios] {name}: {truth['seconds']} s ({truth['cpu_seconds']} s CPU)",
                      flush=True)
            del truth
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m snapforensics.examples.scenarios",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder for <layout>/rank{R}.pickle and truth")
    p.add_argument("--world", type=int, choices=(2, 4), default=2,
                   help="run the layouts made for this many ranks (default 2)")
    p.add_argument("--only", default="", help="comma-separated layout names")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="write truth.rank{R}.json from FSDP's state (default on)")
    p.add_argument("--list", action="store_true", help="print the layouts and exit")
    args = p.parse_args(argv)
    if args.list:
        for lay in ALL_LAYOUTS.values():
            print(f"{lay.name:28s} world {lay.world}  {lay.note}")
        return 0
    if args.out is None:
        p.error("--out is required")
    names = [n for n in args.only.split(",") if n] or \
        [n for n, lay in LAYOUTS.items() if lay.world == args.world]
    unknown = [n for n in names if n not in ALL_LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s): {', '.join(unknown)}")
    worlds = {ALL_LAYOUTS[n].world for n in names}
    if len(worlds) != 1:
        p.error("--only mixes layouts made for different world sizes")
    world = worlds.pop()
    args.out.mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        if int(os.environ["WORLD_SIZE"]) != world:
            p.error(f"these layouts need {world} ranks")
        _run_all(names, args.out, args.check)
        return 0
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    mp.spawn(_worker, args=(world, names, str(args.out), args.check), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
