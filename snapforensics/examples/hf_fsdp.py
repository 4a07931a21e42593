"""A tiny Hugging Face Llama trained under FSDP through the frameworks users train with.

    python -m snapforensics record --nproc-per-node 2 --device cpu --out DIR \\
        -m snapforensics.examples.hf_fsdp -- --layout raw_rab_false

The model is `LlamaForCausalLM` built from a config (4 decoder layers, hidden 256, vocab 512),
batch 2 x 32 tokens, 2 optimizer steps, CPU + gloo. Layouts (``LAYOUTS``):

- ``raw_rab_false``: the user's own `fully_shard` on each `LlamaDecoderLayer` and the root,
  HF's `gradient_checkpointing_enable`, `set_reshard_after_backward(False)` (the seed bug);
  ``raw_fixed``: the same with True (FSDP's default).
- ``accel_fsdp1_sgo``: accelerate's `FullyShardedDataParallelPlugin(fsdp_version=1,
  sharding_strategy="SHARD_GRAD_OP")` wrapping `LlamaDecoderLayer` (transformer_based_wrap);
  ``accel_fsdp1_full``: the plugin's fix, `FULL_SHARD`.
- ``accel_fsdp2_ac``: accelerate's FSDP2 plugin with `activation_checkpointing=True`;
  ``accel_fsdp2_gc``: the same plugin, HF's `gradient_checkpointing_enable` instead.
- ``accel_fsdp2_ac_size``: the FSDP2 plugin with `activation_checkpointing=True` and
  `auto_wrap_policy="size_based_wrap", min_num_params=100_000`: accelerate 1.15 shards and
  checkpoint-wraps every module above that size, bottom-up (each layer's attention and MLP, the
  layer around them, the embedding, the head): checkpoints nested inside each layer's unit.

- ``trainer_sgo``: the HF `Trainer` with `fsdp="shard_grad_op auto_wrap"`,
  `fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}` and
  `activation_checkpointing=True` (transformers 5.23's name; `gradient_checkpointing` is its
  deprecated alias), `use_cpu=True`, 2 steps of batch 2: Trainer turns shard_grad_op into the
  FSDP2 plugin's `reshard_after_forward=False`.
- ``fabric_sgo``: Lightning Fabric (`accelerator="cpu"`, 2 devices) with lightning 2.6's
  `FSDPStrategy` (FSDP1: its FSDP2 path is `ModelParallelStrategy`, the user's own
  `fully_shard`), `sharding_strategy="SHARD_GRAD_OP"`, `auto_wrap_policy={LlamaDecoderLayer}`.
  Set by hand (`_fabric`): a subclass of `FSDPStrategy` (Fabric's connector refuses the exact
  type off GPU) whose `setup_module` gives FSDP1 `device_id=cpu` (Lightning passes None).

- ``titan_never``: torchtitan 0.3's own `ActivationCheckpointing.apply` and
  `apply_fsdp_to_decoder` (`_titan`), configured from torchtitan's config dataclasses at their
  defaults (`SelectiveAC.Config()`, `TrainingConfig()`: bf16 params, fp32 reduce) except
  `ParallelismConfig(fsdp_reshard_after_forward="never")`. Set by hand: torchtitan's Llama
  cannot be imported on CPU (its decoder imports `triton`), so the tiny HF Llama's modules are
  put in a module with the attribute names `apply_fsdp_to_decoder` reads (`tok_embeddings`,
  `layers` a ModuleDict, `norm`, `lm_head`, `enable_weight_tying`); and the mesh is
  `init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))` (torchtitan's `ParallelDims`
  builds it on `device_type`, "cuda" without an accelerator, and its size-1 axes on the
  "fake" backend); each FSDP unit's `set_force_sum_reduction_for_comms(True)` (torchtitan's
  gradient_divide_factor=1.0 makes FSDP reduce with PREMUL_SUM, which gloo refuses).

Set by hand because accelerate refuses FSDP without an accelerator (on CPU its state is
MULTI_CPU and `prepare` does not wrap): `acc.state.distributed_type = DistributedType.FSDP` and
`acc.state.fsdp_plugin`; from there on `prepare` runs accelerate's own wrapping (FSDP1 with the
plugin's auto-wrap policy, FSDP2 `fsdp2_prepare_model` / `fsdp2_apply_ac`) on the gloo group the
recorder's launcher set up. A layout the framework still refuses exits 3 with its message.

Writes ``truth.rank{R}.json`` beside the snapshot (``--truth DIR``): after every forward and
backward the bytes of unsharded parameters FSDP holds (FSDP2 `FSDPParam.all_gather_outputs`,
FSDP1 `_full_param_padded`), read from FSDP's state, not from the trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

# The frameworks are imported at the top, as training scripts do: the recorder imports a
# script's leading imports before its CPU profiler starts (record/_bootstrap._import_prefix).
# Imported inside the run, their imports were traced call by call: a Trainer run was
# OOM-killed (exit 137) on both ranks on this 24 GB machine. Lightning stays lazy (fabric_sgo).
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

LAYOUTS = ("raw_rab_false", "raw_fixed", "accel_fsdp1_sgo", "accel_fsdp1_full",
           "accel_fsdp2_ac", "accel_fsdp2_gc", "accel_fsdp2_ac_size", "trainer_sgo",
           "fabric_sgo", "titan_never")
LAYERS, HIDDEN, VOCAB, BATCH, SEQ = 4, 256, 512, 2, 32


def tiny_config():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                       num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=SEQ * 2, tie_word_embeddings=False)


def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config())


def unsharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of unsharded parameter storage FSDP holds now, from FSDP's own state."""
    total = 0
    seen: set[int] = set()
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if state is not None:  # FSDP2
            # one state per fully_shard call: fully_shard([norm, lm_head]) (accelerate 1.15's
            # tail unit) gives both modules the same state, counted once
            pg = state()._fsdp_param_group
            if pg is not None and id(pg) not in seen:
                seen.add(id(pg))
                for p in pg.fsdp_params:
                    for t in getattr(p, "all_gather_outputs", []) or []:
                        total += t.untyped_storage().size()
        handle = getattr(m, "_handle", None)
        if handle is not None and getattr(m, "_fsdp_wrapped_module", None) is not None:
            fp = getattr(handle.flat_param, "_full_param_padded", None)
            if fp is not None:
                total += fp.untyped_storage().size()
    return total


def _raw(layout: str, fix: str | None):
    from torch.distributed.fsdp import fully_shard

    model = tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if layout == "raw_rab_false":
        for m in model.modules():
            if hasattr(m, "set_reshard_after_backward"):
                m.set_reshard_after_backward(False, recurse=False)
    if fix:  # the analyzer's printed fix, run as printed on this model
        exec(fix, {"model": model})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, lambda loss: loss.backward()


def _accelerate(layout: str, fix: str | None):

    version = 1 if "fsdp1" in layout else 2
    kw: dict = {"fsdp_version": version, "auto_wrap_policy": "transformer_based_wrap",
                "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]}
    if version == 1:
        # sharding_strategy, not reshard_after_forward: accelerate 1.15 fills sharding_strategy
        # with FULL_SHARD when unset and FSDP1's prepare_model takes `sharding_strategy or
        # reshard_after_forward`, so reshard_after_forward="SHARD_GRAD_OP" is ignored (measured:
        # every layer resharded after forward)
        kw["sharding_strategy"] = "SHARD_GRAD_OP" if layout.endswith("sgo") else "FULL_SHARD"
    else:
        kw["reshard_after_forward"] = True
        kw["activation_checkpointing"] = layout.endswith(("_ac", "_ac_size"))
        if layout.endswith("_size"):
            kw = {**kw, "auto_wrap_policy": "size_based_wrap", "min_num_params": 100_000}
            del kw["transformer_cls_names_to_wrap"]
    plugin = FullyShardedDataParallelPlugin(**kw)
    if fix:  # the analyzer's printed fix: its accelerate part builds a new `plugin`
        ns: dict = {}
        exec(fix.split("\n# Raw torch")[0], ns)
        plugin = ns.get("plugin", plugin)
    acc = Accelerator(fsdp_plugin=plugin)
    # Set by hand: accelerate 1.15 enables FSDP only on an accelerator (state.py takes the
    # plugin only for MULTI_GPU/NPU/XPU/...; on CPU it is MULTI_CPU and `prepare` would not
    # wrap). Everything after this is accelerate's own wrapping code (prepare_model: FSDP1
    # with the plugin's auto-wrap policy, or fsdp2_prepare_model / fsdp2_apply_ac).

    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    model = tiny_model()
    if layout.endswith("_gc"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # accelerate 1.15 wants model and optimizer together (FSDP2 swaps the optimizer's
    # parameters for the sharded ones; apart it refuses)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    return model, opt, acc.backward


def _fabric(layout: str, fix: str | None):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """Set by hand: lightning 2.6.6 refuses FSDPStrategy off GPU in the connector
        (fabric/connector.py: `type(self._strategy_flag) is FSDPStrategy` and accelerator not
        cuda/gpu -> ValueError "FSDP is only available on GPU"); the check compares the exact
        type, so this subclass passes. And Lightning wraps with `device_id=root_device.index`,
        None on CPU, where torch's FSDP1 raises "FSDP needs a non-CPU accelerator device"
        (fsdp/_init_utils.py `_get_device_from_device_id`); here `torch.device("cpu")` is given
        instead for the duration of Lightning's own `setup_module` (its auto-wrap included)."""

        def setup_module(self, module):  # type: ignore[no-untyped-def]
            import torch.distributed.fsdp as fsdp

            orig = fsdp.FullyShardedDataParallel

            class OnCPU(orig):  # type: ignore[misc,valid-type]
                def __init__(self, *a, device_id=None, **kw):  # type: ignore[no-untyped-def]
                    super().__init__(*a, device_id=device_id or torch.device("cpu"), **kw)

            fsdp.FullyShardedDataParallel = OnCPU  # type: ignore[misc]
            try:
                return super().setup_module(module)
            finally:
                fsdp.FullyShardedDataParallel = orig  # type: ignore[misc]

    ns: dict = {"LlamaDecoderLayer": LlamaDecoderLayer, "FSDPStrategy": CPUFSDPStrategy}
    code = ('strategy = FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", '
            'auto_wrap_policy={LlamaDecoderLayer})')
    if fix:  # the printed fix builds `strategy`, its FSDPStrategy bound to the subclass
        code = "\n".join(line for line in fix.split("\n# Raw torch")[0].splitlines()
                          if not line.startswith("from lightning"))
    exec(code, ns)
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ns["strategy"])
    fabric.launch()
    model = fabric.setup_module(tiny_model())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, opt, fabric.backward


def _trainer(layout: str, fix: str | None, steps: int) -> list[dict]:
    """Train with the HF Trainer; returns the truth (FSDP's state after each forward, read in
    `compute_loss`, and after each backward, read when `training_step` returns)."""

    fsdp: object = "shard_grad_op auto_wrap"
    fsdp_config: dict = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    if fix:  # the analyzer's printed fix: its Trainer part builds `args`; we train with its
        ns: dict = {}  # fsdp / fsdp_config and keep everything else
        exec(fix.split("\n# Raw torch")[0], ns)
        fsdp, fsdp_config = ns["args"].fsdp, dict(ns["args"].fsdp_config)
    args = TrainingArguments(
        tempfile.mkdtemp(prefix="hf_fsdp-trainer-"),  # save_strategy="no": stays empty
        fsdp=fsdp, fsdp_config=fsdp_config, activation_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, use_cpu=True,
        per_device_train_batch_size=BATCH, max_steps=steps, learning_rate=1e-3,
        report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
        disable_tqdm=True)
    truth: list[dict] = []

    class TruthTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            # Set by hand: as for accelerate above (the Trainer builds the FSDP plugin from
            # fsdp/fsdp_config in `args.fsdp_plugin_args`; accelerate drops it on CPU). From
            # here on the Trainer's own `_prepare_for_training` wraps through accelerate.
            state = self.accelerator.state
            if getattr(state, "fsdp_plugin", None) is None:
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True

        def compute_loss(self, model, inputs, *a, **kw):  # type: ignore[override]
            out = super().compute_loss(model, inputs, *a, **kw)
            truth.append({"after_forward": unsharded_bytes(model)})
            return out

        def training_step(self, model, *a, **kw):  # type: ignore[override]
            loss = super().training_step(model, *a, **kw)
            truth[-1]["after_backward"] = unsharded_bytes(model)
            return loss

    gen = torch.Generator().manual_seed(dist.get_rank())
    data = [{"input_ids": ids, "labels": ids} for ids in
            torch.randint(0, VOCAB, (BATCH * steps * dist.get_world_size(), SEQ), generator=gen)]
    trainer = TruthTrainer(model=tiny_model(), args=args, train_dataset=data)
    trainer.train()
    return truth


class TitanDecoder(torch.nn.Module):
    """The tiny HF Llama's modules under the names torchtitan 0.3's `apply_fsdp_to_decoder`
    and `ActivationCheckpointing.apply` read (models/common/decoder.py `Decoder`: `layers` a
    ModuleDict keyed "0".."3", `tok_embeddings`, `norm`, `lm_head`, `enable_weight_tying`).
    Built by hand: torchtitan's own Llama imports triton and cannot load on CPU."""

    enable_weight_tying = False

    def __init__(self) -> None:
        super().__init__()
        hf = tiny_model()
        self.tok_embeddings = hf.model.embed_tokens
        self.rotary_emb = hf.model.rotary_emb
        self.layers = torch.nn.ModuleDict({str(i): m for i, m in enumerate(hf.model.layers)})
        self.norm = hf.model.norm
        self.lm_head = hf.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):  # type: ignore[no-untyped-def]
        h = self.tok_embeddings(input_ids)
        pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
        rope = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers.values():  # causal: HF's sdpa with no mask
            h = layer(h, position_embeddings=rope, position_ids=pos)
        logits = self.lm_head(self.norm(h)).float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return argparse.Namespace(loss=loss)


def _titan(layout: str, fix: str | None):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import TORCH_DTYPE_MAP, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    # torchtitan's Trainer.Config fields, at torchtitan's defaults but for the reshard policy
    config = argparse.Namespace(
        training=TrainingConfig(), activation_checkpoint=SelectiveAC.Config(),
        parallelism=ParallelismConfig(fsdp_reshard_after_forward="never"))
    if fix:  # the analyzer's printed fix: its torchtitan part edits `config`
        exec(fix.split("\n# Raw torch")[0], {"config": config})
    model = TitanDecoder()
    # torchtitan's parallelize_llama, as it runs on the partial_dtensor path without TP/CP/PP
    if config.activation_checkpoint is not None:
        config.activation_checkpoint.build().apply(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(
        model, mesh, param_dtype=TORCH_DTYPE_MAP[config.training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[config.training.mixed_precision_reduce], pp_enabled=False,
        cpu_offload=config.training.enable_cpu_offload,
        reshard_after_forward_policy=config.parallelism.fsdp_reshard_after_forward)
    # Set by hand: apply_fsdp_to_decoder sets gradient_divide_factor=1.0 (torchtitan scales
    # the loss itself), which FSDP reduces with ReduceOp.PREMUL_SUM, refused by gloo; FSDP's
    # own switch to a plain SUM (what torchtitan's enable_fsdp_symm_mem sets) instead
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, lambda loss: loss.backward()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m snapforensics.examples.hf_fsdp")
    p.add_argument("--layout", choices=LAYOUTS, required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--truth", default=None, help="folder for truth.rank{R}.json")
    p.add_argument("--fix-file", default=None,
                   help="Python run on the wrapped model as `model` (raw layouts), or defining "
                        "a new accelerate `plugin` (accelerate layouts): a printed fix")
    a = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    fix = Path(a.fix_file).read_text() if a.fix_file else None
    if a.layout.startswith("trainer"):
        try:
            truth = _trainer(a.layout, fix, a.steps)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            return _refused(a.layout, e)
        return _write_truth(a.layout, a.truth, rank, truth)
    try:
        build = {"raw": _raw, "accel": _accelerate, "fabric": _fabric,
                 "titan": _titan}[a.layout.split("_")[0]]
        model, opt, backward = build(a.layout, fix)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return _refused(a.layout, e)
    gen = torch.Generator().manual_seed(rank)
    truth = []
    for _ in range(a.steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        out = model(input_ids=ids, labels=ids)
        after_fw = unsharded_bytes(model)
        backward(out.loss)
        truth.append({"after_forward": after_fw, "after_backward": unsharded_bytes(model)})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _write_truth(a.layout, a.truth, rank, truth)


def _refused(layout: str, e: Exception) -> int:
    # one line: torch's messages can carry a module's repr (fully_shard's refusal of a
    # ModuleList prints the whole list)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"{layout}: the framework refused: {first}", file=sys.stderr)
    return 3


def _write_truth(layout: str, folder: str | None, rank: int, truth: list[dict]) -> int:
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"truth.rank{rank}.json").write_text(json.dumps(
            {"layout": layout, "steps": truth, "fsdp_version": os.environ.get(
                "FSDP_VERSION", "")}))
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
