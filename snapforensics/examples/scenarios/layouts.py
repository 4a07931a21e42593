"""The scenario matrix's layouts: each one's name, model, wrapping, initialization, world size,
training loop and the fixed layout it should match once its bug is removed (`LAYOUTS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from snapforensics.examples.scenarios.models import DIM, LAYERS
from snapforensics.examples.scenarios.wrapping import (
    w_aac,
    w_block,
    w_ddp,
    w_fsdp1,
    w_fsdp1_outer,
    w_grouped,
    w_hsdp,
    w_mixed,
    w_none,
    w_offload,
    w_prefetch,
    w_root_only,
    w_submodules,
)


@dataclass
class Layout:
    """One scenario: how the model is built, wrapped and trained."""

    name: str
    wrap: Callable  # (Ctx, model) -> model to train (may be the same object)
    family: str = "gpt"  # gpt | encoder | mlp
    block: str = "plain"  # plain | reentrant | nonreentrant | selective | caching
    init: str = "meta"  # meta | build (materialize the full model, then wrap) | local
    world: int = 2
    layers: int = LAYERS
    dim: int = DIM
    micro_batches: int = 1
    accumulation: str = "none"  # none | right | wrong | sync_only | no_sync
    optimizer: str = "adamw"  # adamw | sgd
    compile: str = "none"  # none | aot_eager | inductor: each block's mlp torch.compile-d
    steps: int = 3
    twin: str | None = None  # the fixed layout this one should match once its bug is removed
    note: str = ""


def _layouts() -> list[Layout]:
    L = Layout
    cw = w_block(ac="wrapper")
    out = [
        # ---- FSDP2, GPT-style transformer, one unit per block
        L("f2_block_cw", cw, note="checkpoint_wrapper(block), fully_shard(block), meta init"),
        L("f2_block_cw_rab_false", w_block(ac="wrapper", rab=False), twin="f2_block_cw",
          note="the seed bug: set_reshard_after_backward(False), never resharded"),
        L("f2_block_aac", w_aac, note="apply_activation_checkpointing, then fully_shard per block"),
        L("f2_block_inner_ckpt", w_block(), block="nonreentrant",
          note="torch.utils.checkpoint(use_reentrant=False) inside each unit's forward"),
        L("f2_block_inner_reentrant", w_block(), block="reentrant",
          note="torch.utils.checkpoint(use_reentrant=True) inside each unit's forward"),
        L("f2_block_selective", w_block(), block="selective",
          note="selective checkpointing (save matmuls) inside each unit"),
        L("f2_block_composable", w_block(ac="composable"),
          note="torch.distributed._composable.checkpoint(block), fully_shard(block)"),
        L("f2_block_noac", w_block(), note="no checkpointing"),
        L("f2_block_noac_rab_false", w_block(rab=False), twin="f2_block_noac",
          note="no checkpointing, set_reshard_after_backward(False)"),
        L("f2_submodules", w_submodules(), note="fully_shard(attn), fully_shard(mlp) inside "
          "checkpoint_wrapper(block)"),
        L("f2_submodules_prefetch", w_submodules(prefetch=2), twin="f2_submodules",
          note="nested units prefetching the next two: recompute re-gathers a finished unit"),
        L("f2_grouped", w_grouped, note="fully_shard([block_k, block_k+1]), checkpoint_wrapper"),
        L("f2_root_only", w_root_only(), note="fully_shard(model) only, no checkpointing"),
        L("f2_root_only_cw", w_root_only("wrapper"),
          note="fully_shard(model) only, checkpoint_wrapper per block"),
        L("f2_build_then_shard", cw, init="build", twin="f2_block_cw",
          note="model = Net() on the device, then fully_shard (no meta init)"),
        L("f2_mixed_precision", w_mixed, note="MixedPrecisionPolicy(bf16 params, fp32 reduce)"),
        L("f2_cpu_offload", w_offload, note="CPUOffloadPolicy (pin_memory=False)"),
        L("f2_prefetch", w_prefetch, note="explicit forward/backward prefetch, one block"),
        L("f2_raf_false_last2", w_block(ac="wrapper", last_raf=2),
          note="reshard_after_forward=False on the last two blocks"),
        L("f2_ga_right", cw, micro_batches=2, accumulation="right",
          note="gradient accumulation: set_requires_gradient_sync(is_last) and "
               "set_reshard_after_backward(is_last) per micro-batch"),
        L("f2_ga_wrong", cw, micro_batches=2, accumulation="wrong", twin="f2_ga_right",
          note="gradient accumulation with set_reshard_after_backward(False) set once, never True"),
        L("f2_ga_sync_only", cw, micro_batches=2, accumulation="sync_only",
          note="gradient accumulation: set_requires_gradient_sync(is_last) only"),
        # the same layouts with each block's mlp torch.compile-d (FSDP and checkpointing eager,
        # as fsdp_ckpt --compile): the compiled backward runs from the autograd engine
        L("f2_block_cw_c", cw, compile="aot_eager",
          note="f2_block_cw with each block's mlp compiled (aot_eager)"),
        L("f2_block_cw_rab_false_c", w_block(ac="wrapper", rab=False), compile="aot_eager",
          twin="f2_block_cw_c", note="the seed bug, each block's mlp compiled (aot_eager)"),
        L("f2_block_noac_c", w_block(), compile="aot_eager",
          note="no checkpointing, each block's mlp compiled (aot_eager)"),
        L("f2_block_noac_rab_false_c", w_block(rab=False), compile="aot_eager",
          twin="f2_block_noac_c",
          note="no checkpointing, set_reshard_after_backward(False), mlp compiled (aot_eager)"),
        L("f2_leak_cache", cw, block="caching", steps=4, twin="f2_block_cw",
          note="every block keeps its outputs (with their graph) in a list"),
        # ---- FSDP2, other families
        L("f2_mlp_cw", cw, family="mlp", note="residual MLP, checkpoint_wrapper, per block"),
        L("f2_mlp_cw_rab_false", w_block(ac="wrapper", rab=False), family="mlp", twin="f2_mlp_cw",
          note="residual MLP, set_reshard_after_backward(False)"),
        L("f2_mlp_noac", w_block(), family="mlp", note="residual MLP, no checkpointing"),
        L("f2_mlp_build", w_block(ac="wrapper"), family="mlp", init="build", twin="f2_mlp_cw",
          note="residual MLP built on the device, then sharded"),
        L("f2_encoder_tied", cw, family="encoder",
          note="encoder with tied embeddings (root unit holds the shared weight)"),
        L("f2_encoder_tied_aac", w_aac, family="encoder", init="build", twin="f2_encoder_tied",
          note="tied encoder, apply_activation_checkpointing, built then sharded"),
        # ---- FSDP1
        L("f1_block_aac", w_fsdp1(), note="FSDP1 FULL_SHARD per block, "
          "apply_activation_checkpointing"),
        L("f1_shard_grad_op_mp", w_fsdp1(strategy="SHARD_GRAD_OP", mp=True),
          note="FSDP1 SHARD_GRAD_OP, bf16 params / fp32 reduce"),
        L("f1_outer_reentrant", w_fsdp1_outer(True), twin="f1_outer_nonreentrant",
          note="HF-style reentrant checkpoint around each FSDP1 unit (double all-gather)"),
        L("f1_outer_nonreentrant", w_fsdp1_outer(False),
          note="non-reentrant checkpoint around each FSDP1 unit"),
        L("f1_root_only", w_fsdp1(blocks=False, aac=False), note="FSDP1 root unit only"),
        L("f1_build_then_shard", w_fsdp1(), init="build", twin="f1_block_aac",
          note="FSDP1 over a materialized model"),
        L("f1_mlp", w_fsdp1(), family="mlp", note="FSDP1 residual MLP per block"),
        L("f1_no_sync", w_fsdp1(), micro_batches=2, accumulation="no_sync",
          note="FSDP1 gradient accumulation inside model.no_sync()"),
        # ---- no FSDP
        L("ddp_gpt_cw", w_ddp(), init="local", note="DDP, checkpoint_wrapper"),
        L("ddp_mlp_ga", w_ddp(ac=False), family="mlp", init="local", micro_batches=2,
          accumulation="no_sync", note="DDP residual MLP, no_sync accumulation"),
        L("plain_gpt", w_none(), init="local", note="no distribution at all"),
        L("plain_encoder_cw", w_none(ac=True), family="encoder", init="local",
          note="no distribution, tied encoder, checkpoint_wrapper"),
        # ---- 4 ranks
        L("hsdp_block_cw", w_hsdp(), world=4, note="HSDP on a 2x2 mesh, checkpoint_wrapper"),
        L("hsdp_rab_false", w_hsdp(rab=False), world=4, twin="hsdp_block_cw",
          note="HSDP 2x2, set_reshard_after_backward(False)"),
        L("f2_deep_meta_w4", cw, family="mlp", world=4, layers=16, optimizer="sgd",
          note="16-block residual MLP, checkpoint_wrapper, SGD, meta init, 4 ranks"),
        L("f2_deep_build_w4", cw, family="mlp", world=4, layers=16, optimizer="sgd",
          init="build", twin="f2_deep_meta_w4",
          note="the same built on the device then sharded: the start-up peak is the run's"),
    ]
    return out


LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in _layouts()}
# the compiled layouts again with Inductor's C++ CPU backend (`_ci`): a minute of C++ compiling
# each on a 2-core machine, so not in the matrix `make test` records (`--only` runs them;
# tests/test_compile.py, `make test-full`)
INDUCTOR_LAYOUTS: dict[str, Layout] = {
    lay.name + "i": replace(lay, name=lay.name + "i", compile="inductor",
                            twin=lay.twin + "i" if lay.twin else None,
                            note=lay.note.replace("aot_eager", "inductor"))
    for lay in LAYOUTS.values() if lay.compile == "aot_eager"}
ALL_LAYOUTS: dict[str, Layout] = {**LAYOUTS, **INDUCTOR_LAYOUTS}
