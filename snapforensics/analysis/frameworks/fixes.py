"""A fix in the user's own framework, with the raw-torch form beside it.

Rules state their fix in raw torch (`fully_shard`, `set_reshard_after_backward`). Most users
configure FSDP through a framework (`analysis/frameworks/detect.py` recognizes which); this layer
puts, above the rule's fix, the same change in that framework's terms (accelerate's
`FullyShardedDataParallelPlugin` / `GradientAccumulationPlugin` fields, the HF Trainer's
`fsdp` / `fsdp_config`, Lightning's strategy arguments, torchtitan's config fields) and names the
user's layer class and module path as the run shows them. Where the framework has no switch for
the change, it says so and gives the call to make after the framework has wrapped the model.

API names are those of the versions this was checked against (read from their source):
transformers 5.23.0, accelerate 1.15.0, lightning 2.6.6, torchtitan 0.3.0, megatron-core 0.16.1.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.frameworks.detect import Framework

_RAB = "fsdp.unsharded_params_not_resharded"
_RAF = "fsdp.reshard_after_forward_disabled"
_SYNC = "fsdp.gradient_sync_disabled"
_INIT = "fsdp.full_model_materialized_at_init"
_AC = "activations.no_checkpointing"
_AC_FINE = "activations.checkpoint_finer_than_unit"
_DOUBLE = "fsdp.double_all_gather_in_backward"
_RATE = "fsdp.too_many_concurrent_all_gathers"
_DDP_VIEW = "ddp.gradient_as_bucket_view"


def localize(findings: list[Finding], fw: Framework) -> None:
    """Rewrite each finding's fix: the run's framework and layer, the framework's form (when
    the rule has one for it), then the rule's raw-torch fix."""
    if fw.owner == "torch" and not fw.hf_model and not fw.layer.cls and not fw.layer.container:
        return  # nothing to add to the rules' raw-torch fixes
    for f in findings:
        if not f.fix:
            continue
        form = _FORMS.get(f.rule, {}).get(fw.owner)
        if form is None and fw.hf_model:
            form = _FORMS.get(f.rule, {}).get("transformers")
        parts = [_header(fw)]
        if form is not None:
            parts += [f"# In {_TERMS[fw.owner] if fw.owner in _TERMS else 'your model'}:",
                      form(fw, f).rstrip(), "", "# Raw torch (the same change):"]
            _predict_as_printed(f, fw)
        raw = _RAW.get(f.rule)
        parts.append(raw(fw, f) if raw and fw.layer.container else _raw(f.fix, fw))
        f.fix = "\n".join(parts)
        f.evidence["framework"] = fw.owner


def _predict_as_printed(f: Finding, fw: Framework) -> None:
    """The predicted peak of the framework's form as printed, where it differs from the rule's
    raw-torch one: accelerate's FSDP1 plugin (which the form builds) gathers each layer for
    backward with no prefetch (accelerate 1.15 utils/dataclasses.py: `backward_prefetch`
    defaults to NO_PREFETCH, read as None), so when the trace could not show the prefetch the
    peak without it is the one the printed fix gives."""
    ev = f.evidence
    if f.rule == _RAF and fw.owner == "accelerate" and fw.fsdp == "FSDP1" and \
            ev.get("backward_prefetch") == "unknown" and f.predicted_peak_bytes is not None:
        no_pf = ev["predicted_peaks_without_backward_prefetch"]["overall_bytes"]
        ev["predicted_peaks_with_backward_prefetch"] = ev["predicted_peaks"]
        ev["predicted_peaks"] = ev["predicted_peaks_without_backward_prefetch"]
        f.saving_bytes = max(f.predicted_peak_bytes + (f.saving_bytes or 0) - no_pf, 0)
        f.predicted_peak_bytes = no_pf


_TERMS = {"megatron": "Megatron-LM's arguments (Megatron-Core's TransformerConfig)",
          "accelerate": "accelerate", "hf_trainer": "the HF Trainer",
          "lightning": "Lightning (Trainer)", "fabric": "Lightning Fabric",
          "torchtitan": "torchtitan's config", "torch": "your model (transformers)"}


def _header(fw: Framework) -> str:
    lay = fw.layer
    cls = lay.cls or "(the layer class is not in this file)"
    where = f", FSDP units {lay.path}" if lay.path else ""
    return f"# Run: {fw.label}; repeated layer {cls}{where}"


def _cls(fw: Framework) -> str:
    """The layer class for code: the run's, else its type read off the model."""
    if fw.layer.cls:
        return fw.layer.cls
    return f"type(model.{_container(fw)}[0])"


def _container(fw: Framework) -> str:
    return fw.layer.container or "layers"


def _raw(fix: str, fw: Framework) -> str:
    """The rule's raw-torch fix on this run's block container and class."""
    if fw.layer.container:
        fix = fix.replace("model.layers", f"model.{fw.layer.container}")
    if fw.layer.cls:
        fix = fix.replace("TransformerBlock", fw.layer.cls)
    return fix


def _raw_rab(fw: Framework, f: Finding) -> str:
    return f"""\
# after fully_shard(layer) on each {_cls(fw)} and fully_shard(model):
for layer in model.{_container(fw)}:
    layer.set_reshard_after_backward(True)
model.set_reshard_after_backward(True)  # the root unit
# with gradient accumulation, keep False only on non-final micro-batches:
#   model.set_reshard_after_backward(is_last_microbatch)"""


# raw-torch forms that name the layer (used when the run names the units' container)
_RAW: dict[str, Form] = {_RAB: _raw_rab}


# -- per rule, per framework: the change in the framework's own terms --------------------------

def _rab_accelerate(fw: Framework, f: Finding) -> str:
    return f"""\
# accelerate has no plugin field for reshard-after-backward (nor does the HF Trainer): after
# model = accelerator.prepare(model), on every {_cls(fw)} unit and on the root:
for layer in model.{_container(fw)}:
    layer.set_reshard_after_backward(True)
model.set_reshard_after_backward(True)
# gradient accumulation: let accelerate skip the sync instead of keeping parameters, i.e.
#   Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=N))"""


def _rab_lightning(fw: Framework, f: Finding) -> str:
    return f"""\
# in configure_model / the parallelize_fn given to ModelParallelStrategy, after fully_shard:
for layer in model.{_container(fw)}:  # {_cls(fw)}
    layer.set_reshard_after_backward(True)"""


def _rab_titan(fw: Framework, f: Finding) -> str:
    return """\
# torchtitan's apply_fsdp leaves reshard_after_backward at FSDP's default (True): a model or
# training-loop change that turns it off must be removed; no config field controls it."""


# What does nothing under FSDP2, from the sources: transformers 5.23 training_args.py
# `_process_fsdp_args` reads the five FSDP1 keys only when version != 2 (2859-2883) and never
# reads "sharding_strategy"; accelerate 1.15 utils/dataclasses.py `__post_init__` resets
# backward_prefetch, use_orig_params, sync_module_states to None (1903, 1940, 1946), refuses
# forward_prefetch (1955) and a sharding_strategy without reshard_after_forward (1855, 1877);
# limit_all_gathers is read only by FSDP1's prepare (accelerator.py 1957).
_FSDP2_TRAINER_NOOPS = ("# FSDP2 ignores fsdp_config keys sharding_strategy, backward_prefetch, "
                        "forward_prefetch, use_orig_params, sync_module_states, limit_all_gathers")
_FSDP2_PLUGIN_NOOPS = ("# FSDP2 drops backward_prefetch, use_orig_params, sync_module_states, "
                       "limit_all_gathers; refuses forward_prefetch, sharding_strategy alone")


def _raf_accelerate(fw: Framework, f: Finding) -> str:
    if fw.fsdp == "FSDP1":
        return f"""\
from accelerate import FullyShardedDataParallelPlugin
plugin = FullyShardedDataParallelPlugin(
    fsdp_version=1, sharding_strategy="FULL_SHARD",  # was SHARD_GRAD_OP
    auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["{_cls(fw)}"])
# accelerate config file: fsdp_config: {{fsdp_sharding_strategy: FULL_SHARD}}
# under FSDP1 set sharding_strategy: accelerate 1.15 fills it with FULL_SHARD when unset and
# prepares with `sharding_strategy or reshard_after_forward`, so reshard_after_forward is
# ignored there (it is FSDP2's field). backward_prefetch stays at the plugin's default,
# NO_PREFETCH (each layer gathered at its own pre-backward); backward_prefetch="BACKWARD_PRE"
# overlaps the next layer's gather with this one's backward, for one more layer in memory"""
    return f"""\
from accelerate import FullyShardedDataParallelPlugin
plugin = FullyShardedDataParallelPlugin(
    fsdp_version=2, reshard_after_forward=True,
    auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["{_cls(fw)}"])
# accelerate config file: fsdp_config: {{fsdp_version: 2, fsdp_reshard_after_forward: true}}
{_FSDP2_PLUGIN_NOOPS}"""


def _raf_trainer(fw: Framework, f: Finding) -> str:
    if fw.fsdp == "FSDP1":
        return f"""\
from transformers import TrainingArguments
args = TrainingArguments(
    "out", fsdp=True,
    fsdp_config={{"version": 1, "reshard_after_forward": "full_shard",  # was shard_grad_op
                 "transformer_layer_cls_to_wrap": ["{_cls(fw)}"]}})"""
    return f"""\
from transformers import TrainingArguments
args = TrainingArguments(
    "out", fsdp=True,
    fsdp_config={{"version": 2, "reshard_after_forward": True,
                 "transformer_layer_cls_to_wrap": ["{_cls(fw)}"]}})
{_FSDP2_TRAINER_NOOPS}"""


def _raf_lightning(fw: Framework, f: Finding) -> str:
    if fw.fsdp == "FSDP1":
        return f"""\
from lightning.pytorch.strategies import FSDPStrategy  # Fabric: lightning.fabric.strategies
strategy = FSDPStrategy(sharding_strategy="FULL_SHARD",  # was SHARD_GRAD_OP
                        auto_wrap_policy={{{_cls(fw)}}})"""
    return f"""\
# ModelParallelStrategy: in configure_model / the parallelize_fn, per {_cls(fw)}:
for layer in model.{_container(fw)}:
    fully_shard(layer, reshard_after_forward=True)"""


def _raf_titan(fw: Framework, f: Finding) -> str:
    # torchtitan 0.3.0 config/configs.py ParallelismConfig.fsdp_reshard_after_forward:
    # Literal["default", "always", "never"]; distributed/fsdp.py apply_fsdp_to_decoder reshards
    # the embeddings and every block under "default" (without pipeline parallelism) and the
    # [norm, output] unit only under "always": "default" is what the rule's replay predicts
    return """\
# torchtitan 0.3 config (a config_registry function's Trainer.Config, or on the command line
# --parallelism.fsdp_reshard_after_forward default)
config.parallelism.fsdp_reshard_after_forward = "default"  # was "never"
# "default" reshards the embeddings and every block after forward and keeps [norm, output]
# (its backward runs first); under pipeline parallelism "default" keeps all: set "always"."""


def _sync_accelerate(fw: Framework, f: Finding) -> str:
    return """\
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(
    num_steps=4, sync_each_batch=True))  # num_steps: your accumulation steps"""


def _sync_trainer(fw: Framework, f: Finding) -> str:
    return """\
from transformers import TrainingArguments
args = TrainingArguments(
    "out", gradient_accumulation_steps=4,
    accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}})"""


def _sync_fabric(fw: Framework, f: Finding) -> str:
    return """\
# Fabric: sync every micro-batch (do not skip the reduce-scatter):
with fabric.no_backward_sync(model, enabled=False):
    fabric.backward(loss)"""


def _init_hf(fw: Framework, f: Finding) -> str:
    dev = re.search(r'to_empty\(device="([\w:]+)"\)', f.fix or "")
    return """\
# A Hugging Face model: HF's own initialisation after sharding (not reset_parameters, which
# leaves RoPE's inv_freq and norm weights unset and initializes Linear with torch's std)
import torch
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config)
for layer in model.model.layers:  # LAYER
    fully_shard(layer)
fully_shard(model)
model.to_empty(device="DEVICE")
model.init_weights()  # HF's _init_weights on every module, buffers included
# pretrained weights: load a checkpoint instead (from_pretrained on rank 0 with
# accelerate's cpu_ram_efficient_loading=True, or set_model_state_dict on the sharded model)\
""".replace("DEVICE", dev.group(1) if dev else "cuda").replace("LAYER", _cls(fw))


def _init_accelerate(fw: Framework, f: Finding) -> str:
    return """\
from accelerate import FullyShardedDataParallelPlugin
plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True)
# with from_pretrained: rank 0 loads, the others build on meta, FSDP broadcasts the shards
# accelerate config file: fsdp_config: {fsdp_cpu_ram_efficient_loading: true}"""


def _init_trainer(fw: Framework, f: Finding) -> str:
    return """\
from transformers import TrainingArguments
args = TrainingArguments("out", fsdp=True, fsdp_config={"cpu_ram_efficient_loading": True})"""


def _init_lightning(fw: Framework, f: Finding) -> str:
    return f"""\
# build the model in LightningModule.configure_model (Trainer: created on the meta device
# under FSDP), or with Fabric:
with fabric.init_module(empty_init=True):
    model = build_model()  # then fabric.setup(model); {_cls(fw)} layers materialized per unit"""


def _ac_accelerate(fw: Framework, f: Finding) -> str:
    return f"""\
from accelerate import FullyShardedDataParallelPlugin
# accelerate 1.15 checkpoints exactly the modules its auto-wrap policy picks (fsdp2_apply_ac,
# bottom-up): with transformer_based_wrap each {_cls(fw)} whole; with size_based_wrap every
# module above min_num_params, sub-modules included (finer than the FSDP unit)
plugin = FullyShardedDataParallelPlugin(
    activation_checkpointing=True,
    auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["{_cls(fw)}"])
# or the model's own switch, not both: model.gradient_checkpointing_enable(
#     gradient_checkpointing_kwargs={{"use_reentrant": False}})"""


def _ac_trainer(fw: Framework, f: Finding) -> str:
    return """\
from transformers import TrainingArguments
args = TrainingArguments("out", gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": False})"""


def _ac_lightning(fw: Framework, f: Finding) -> str:
    return f"""\
from lightning.pytorch.strategies import FSDPStrategy  # Fabric: lightning.fabric.strategies
strategy = FSDPStrategy(auto_wrap_policy={{{_cls(fw)}}},
                        activation_checkpointing_policy={{{_cls(fw)}}})"""


def _ac_titan(fw: Framework, f: Finding) -> str:
    return """\
# torchtitan 0.3 config: checkpoint every block (apply_ac wraps model.layers.N whole)
from torchtitan.distributed.activation_checkpoint import FullAC
config.activation_checkpoint = FullAC.Config()"""


def _ac_megatron(fw: Framework, f: Finding) -> str:
    # megatron-core 0.16.1 TransformerConfig: recompute_granularity / recompute_method /
    # recompute_num_layers; "full" + "uniform" + 1 checkpoints each TransformerLayer whole (its
    # input kept, CheckpointFunction in tensor_parallel/random.py), the per-layer checkpointing
    # the prediction replays ("selective" recomputes only the attention core: less saving)
    return """\
# Megatron-LM: --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
# Megatron-Core (or NeMo's config):
config = TransformerConfig(..., recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1)"""


def _ac_hf(fw: Framework, f: Finding) -> str:
    return """\
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})"""


def _double_hf(fw: Framework, f: Finding) -> str:
    return """\
# HF's checkpointing is reentrant unless told otherwise; FSDP1 then gathers twice
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
# HF Trainer: TrainingArguments(gradient_checkpointing_kwargs={"use_reentrant": False})"""


def _rate_accelerate(fw: Framework, f: Finding) -> str:
    return """\
from accelerate import FullyShardedDataParallelPlugin
plugin = FullyShardedDataParallelPlugin(limit_all_gathers=True)"""


def _rate_trainer(fw: Framework, f: Finding) -> str:
    return """\
from transformers import TrainingArguments
# FSDP1 only: under fsdp_config["version"] = 2 (the default) the Trainer drops this key
args = TrainingArguments("out", fsdp=True, fsdp_config={"version": 1, "limit_all_gathers": True})"""


def _rate_lightning(fw: Framework, f: Finding) -> str:
    return """\
from lightning.pytorch.strategies import FSDPStrategy  # Fabric: lightning.fabric.strategies
strategy = FSDPStrategy(limit_all_gathers=True)"""


Form = Callable[[Framework, Finding], str]
def _ac_fine_accelerate(fw: Framework, f: Finding) -> str:
    return f"""\
from accelerate import FullyShardedDataParallelPlugin
# one checkpoint per unit: the plugin's activation_checkpointing wraps every module its
# auto-wrap policy matches (accelerate 1.15 fsdp2_apply_ac); match the layer class only
plugin = FullyShardedDataParallelPlugin(
    fsdp_version=2, activation_checkpointing=True,
    auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["{_cls(fw)}"])
# and do not also call model.gradient_checkpointing_enable()"""


def _ac_fine_hf(fw: Framework, f: Finding) -> str:
    return """\
# one checkpoint per layer: HF's own switch alone (it checkpoints each decoder layer), with no
# checkpoint_wrapper / FSDP activation checkpointing on top of it or on its sub-modules
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})"""


def _ddp_view_accelerate(fw: Framework, f: Finding) -> str:
    return """\
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

accelerator = Accelerator(kwargs_handlers=[
    DistributedDataParallelKwargs(gradient_as_bucket_view=True)])"""


def _ddp_view_trainer(fw: Framework, f: Finding) -> str:
    return """\
# TrainingArguments has no field for it: the Trainer's _wrap_model sets accelerate's
# ddp_handler from ddp_find_unused_parameters / ddp_bucket_cap_mb / ddp_broadcast_buffers
# only, then accelerator.prepare wraps the model; add the switch in between
from transformers import Trainer


class BucketViewTrainer(Trainer):
    def _wrap_model(self, model, *args, **kwargs):
        model = super()._wrap_model(model, *args, **kwargs)
        if self.accelerator.ddp_handler is not None:
            self.accelerator.ddp_handler.gradient_as_bucket_view = True
        return model"""


def _ddp_view_lightning(fw: Framework, f: Finding) -> str:
    return """\
from lightning.pytorch.strategies import DDPStrategy  # Fabric: lightning.fabric.strategies

# its keywords go to DistributedDataParallel
strategy = DDPStrategy(gradient_as_bucket_view=True)"""


def _ddp_view_titan(fw: Framework, f: Finding) -> str:
    return """\
# torchtitan has no config key for it: in apply_ddp (parallelize.py),
replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100, gradient_as_bucket_view=True)"""


_FORMS: dict[str, dict[str, Form]] = {
    _RAB: {"accelerate": _rab_accelerate, "hf_trainer": _rab_accelerate,
           "lightning": _rab_lightning, "fabric": _rab_lightning, "torchtitan": _rab_titan},
    _RAF: {"accelerate": _raf_accelerate, "hf_trainer": _raf_trainer,
           "lightning": _raf_lightning, "fabric": _raf_lightning, "torchtitan": _raf_titan},
    _SYNC: {"accelerate": _sync_accelerate, "hf_trainer": _sync_trainer,
            "fabric": _sync_fabric},
    _INIT: {"transformers": _init_hf, "accelerate": _init_accelerate,
            "hf_trainer": _init_trainer, "lightning": _init_lightning, "fabric": _init_lightning},
    _AC: {"transformers": _ac_hf, "accelerate": _ac_accelerate, "hf_trainer": _ac_trainer,
          "lightning": _ac_lightning, "fabric": _ac_lightning, "torchtitan": _ac_titan,
          "megatron": _ac_megatron},
    _DOUBLE: {"transformers": _double_hf},
    _AC_FINE: {"transformers": _ac_fine_hf, "accelerate": _ac_fine_accelerate,
               "hf_trainer": _ac_fine_accelerate},
    _RATE: {"accelerate": _rate_accelerate, "hf_trainer": _rate_trainer,
            "lightning": _rate_lightning, "fabric": _rate_lightning},
    _DDP_VIEW: {"accelerate": _ddp_view_accelerate, "hf_trainer": _ddp_view_trainer,
                "lightning": _ddp_view_lightning, "fabric": _ddp_view_lightning,
                "torchtitan": _ddp_view_titan},
}
