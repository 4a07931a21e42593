"""What made a block: its category, the FSDP path that made it, and the phase its stack shows.

Classification keys on function and file names (FSDP2 at `torch/distributed/fsdp/_fully_shard/`
since 2.6 and `torch/distributed/_composable/fsdp/` in 2.4-2.5, FSDP1 `_runtime_utils.py` /
`_flat_param.py`), on record_function range names (`FSDP::all_gather (layers.3)`), whether they
come as frames (CPU recordings) or as `external_annotations` open around the row (CUDA). It
runs once per distinct (stack, open ranges) pair, never per row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from snapforensics.analysis.fsdp.ranges import parse as parse_range
from snapforensics.analysis.stacks import is_native
from snapforensics.analysis.vocab import Category, Phase
from snapforensics.snapshot.model import Frame

# Unshard paths.
PATHS = ("forward", "backward_pre_hook", "recompute", "prefetch", "explicit")

# FSDP1 (`_runtime_utils.py`, `_flat_param.py`): the padded unsharded flat parameter is the
# all-gather output itself (`_alloc_padded_unsharded_flat_param`), so it is an unsharded param;
# with mixed precision `_use_low_precision_shard` makes the `_mp_shard` (all-gather input).
_ALL_GATHER_FUNCS = {"foreach_all_gather", "all_gather_copy_in", "all_gather_copy_in_cuda",
                     "all_gather_copy_in_npu", "_all_gather_flat_param",
                     "_use_low_precision_shard"}
_UNSHARDED_FUNCS = {"foreach_all_gather_copy_out", "init_all_gather_outputs",
                    "alloc_all_gather_outputs", "alloc_storage", "init_unsharded_param",
                    "_alloc_padded_unsharded_flat_param", "_use_unsharded_flat_param",
                    "init_flat_param_attributes", "to_sharded_post_forward"}
_REDUCE_FUNCS = {"foreach_reduce", "foreach_reduce_scatter_copy_in", "_reduce_grad",
                 "_reduce_grad_no_shard"}
# c10d's operators (the CPU recorder's `<op>` frames) are FSDP's only under FSDP's code or ranges:
# Megatron's TP, an `all_gather_object` or the user's own collective make the same ones.
_C10D_GATHER = {"c10d::_allgather_base_", "c10d::allgather_", "c10d::all_gather_into_tensor"}
def _worker_collective(names) -> Category | None:
    """The FSDP buffer a collective backend's worker row serves, by its collective's range
    (`gloo:all_gather`, `nccl:reduce_scatter`): None for another collective."""
    for n in names:
        if n.startswith(("gloo:", "nccl:", "hccl:")):
            op = n.split(":", 1)[1].replace("allgather", "all_gather")
            if "all_gather" in op:
                return Category.ALL_GATHER
            if "reduce_scatter" in op:
                return Category.REDUCE_SCATTER
    return None


_C10D_SCATTER = {"c10d::_reduce_scatter_base_", "c10d::reduce_scatter_",
                 "c10d::reduce_scatter_tensor_coalesced_"}
# FSDP1's post-backward hook casts the unsharded grad to reduce_dtype before `_reduce_grad`.
_FSDP1_REDUCE_HOOKS = {"_post_backward_hook"}
# FSDP2 accumulating unsharded grads across micro-batches; FSDP1 inside `no_sync()` (its
# post-backward hook then skips the reduce and points each parameter's grad into the unsharded flat
# grad), which is not a reduce-scatter although it runs in the hook.
_UNSHARDED_GRAD_FUNCS = {"accumulate_unsharded_grad_if_needed", "to_accumulated_grad_if_needed",
                         "_use_unsharded_grad_views"}
_SHARDED_INIT_FUNCS = {"_init_sharded_param", "reset_sharded_param", "fully_shard",
                       "_init_flat_param_and_metadata", "_init_param_handle_from_module"}
# Init work that holds full (unsharded) parameters: FSDP1 materializing a meta module or moving
# it to the device before flattening/sharding, FSDP2 moving a module's states to the mesh device.
_FULL_INIT_FUNCS = {"_materialize_meta_module", "_materialize_with_param_init_fn",
                    "_move_module_to_device", "_move_states_to_device", "flatten_tensors",
                    "flatten_tensors_into_flat_param"}
_SHARD_FUNCS = {"_get_shard", "shard", "_init_sharded_param", "reset_sharded_param"}
_RECOMPUTE_FUNCS = {"unpack_hook", "recompute_fn", "_run_fn_with_dynamo_disabled",
                    "unpack_hook_with_error_cb", "_checkpoint_hook"}
_PREFETCH_FUNCS = {"_prefetch_unshard", "_backward_prefetch", "_prefetch_handle",
                   "_forward_prefetch"}
_PRE_BACKWARD_FUNCS = {"_pre_backward", "pre_backward", "_pre_backward_hook"}
_PRE_FORWARD_FUNCS = {"_pre_forward", "pre_forward", "_pre_forward_unshard", "_root_pre_forward"}
_BACKWARD_FUNCS = {"_engine_run_backward", "run_backward", "post_backward", "_post_backward_hook",
                   "_root_post_backward_final_callback", "_post_backward_final_callback",
                   "finalize_backward", "backward_hook"}
# (and loading a checkpoint into the model: Hugging Face's `from_pretrained`, whose safetensors
# file a CPU recording sees mapped as one block held to the end, and torch's `load_state_dict`;
# an optimizer's `load_state_dict` is the optimizer's: its frames are in torch/optim/)
_INIT_FUNCS = {"reset_parameters", "_apply", "to_empty", "__init__", "_materialize_module",
               "_sync_module_params_and_buffers", "materialize_meta_module", "from_pretrained",
               "load_state_dict"}

# The autograd engine's C++ frames (`stacks="all"`): the row was made while the engine evaluated a
# node (`Engine::evaluate_function` under `Engine::thread_main`, on a device's autograd thread or
# on the thread that called `backward()`). An allocation there is backward: `backward()` returns
# only when its graph task is done. A free there need not be: the engine thread drops a node's
# inputs after marking the task done, while the main thread already runs the next forward
# (bcrafton_memory_snapshot: AccumulateGrad and evaluate_function frees inside forward).
_AUTOGRAD_ENGINE = re.compile(r"torch::autograd::(?:python::Python)?Engine::")

# DDP (`torch/nn/parallel/distributed.py`): the Reducer allocates its flat gradient buckets in
# C++ (`Reducer::initialize_buckets`, `at::empty` per bucket), called from Python by
# `_ddp_init_helper` (`dist.Reducer(...)` at construction; `replicate()` reaches it through
# `DistributedDataParallel.__init__`) and again by `_pre_forward` (`reducer._rebuild_buckets()`,
# once, in the second step's forward, in the order the gradients came). The stack's innermost
# Python frame is one of those two: whatever else they allocate goes through a Python call of
# its own (`_sync_buffers`, `_to_kwargs`, `Join.notify_join_context`).
_DDP_FILE = "nn/parallel/distributed.py"
_DDP_BUCKET_FUNCS = {"_ddp_init_helper", "_pre_forward"}
# DDP's construction-time check that every rank has the same parameter shapes all-gathers
# them (`torch/distributed/utils.py`): not an FSDP all-gather.
_DDP_INIT_COLLECTIVES = {"_verify_param_shape_across_processes"}

# Mixture of experts (expert parallelism): a token dispatcher's functions, by the words their
# names are made of, under an MoE module's frame (this recorder's `<nn.Module>` frames name the
# class) or a file of an MoE implementation (one whose name says so, or the file that holds the
# MoE module's own `forward`: a script's `SwitchMoE` and the `_AllToAll` beside it):
# torchtitan's `AllToAllTokenDispatcher.dispatch` / `_dispatch_token_exchange` / `_permute` and
# `combine` / `_combine_token_exchange` / `_unpermute` (`torchtitan/models/common/
# token_dispatcher.py`; `ExpertParallel._token_dispatch` / `_token_combine` in
# `torchtitan/distributed/expert_parallel.py` before), Megatron's
# `MoEAlltoAllTokenDispatcher.dispatch_preprocess` / `token_dispatch` / `token_combine` /
# `combine_postprocess` (`megatron/core/transformer/moe/token_dispatcher.py`, `permute` /
# `unpermute` in `moe/moe_utils.py`), DeepSpeed's `_sparse_encode` / `_sparse_decode`
# (`deepspeed/moe/sharded_moe.py`, 0.19). The innermost named function decides; an all-to-all
# under an MoE frame and no named function is an exchange: `all_to_all_single` in
# `distributed_c10d.py`, `_functional_collectives.py`'s `all_to_all_single[_autograd]` (which
# allocate their outputs), or the `forward` of an MoE file's own autograd Function (the frame
# `Function.apply` calls: DeepSpeed's `_AllToAll`, which allocates its output before the
# collective; fairscale's is the same code, read, not run). An exchange is a dispatch buffer
# here; `context._split_moe_exchanges` makes the one after the experts' work the combine's (both
# are called from the same `MOELayer.forward`).
_MOE_FILE = re.compile(r"(?:^|[/_])moe(?:[/_.]|$)|expert|token_dispatch", re.IGNORECASE)
_MOE_MODULE = re.compile(r"moe|expert", re.IGNORECASE)
_MOE_DISPATCH_WORDS = {"dispatch", "permute", "permutation", "encode"}
_MOE_COMBINE_WORDS = {"combine", "unpermute", "unpermutation", "decode"}
_ALL_TO_ALL_FUNCS = {"all_to_all_single", "all_to_all", "all_to_all_single_autograd"}
_MODULE_CALL = "torch/nn/modules/module.py"  # `_call_impl` / `inner`: a module's call, not forward
_EMPTY_OPS = {"aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided"}


def moe_layer_frame(frames: list[Frame]) -> Frame | None:
    """The frame that puts a stack (innermost first) under an MoE layer: the recorder's
    innermost `<nn.Module>` frame of an MoE-named module (one per instance), else the innermost
    frame in an MoE implementation's file; None when there is none."""
    return next((f for f in frames if f.filename == "<nn.Module>" and
                 _MOE_MODULE.search(f.name)), None) or \
        next((f for f in frames if _MOE_FILE.search(f.filename)), None)


def _forward_of(frames: list[Frame], module: Frame) -> int | None:
    """The index of a recorder's `<nn.Module>` frame's own `forward` in `frames` (the first
    Python frame inside it past `Module.__call__`'s), None for any other frame."""
    if module.filename != "<nn.Module>":
        return None
    i = next(i for i, f in enumerate(frames) if f is module)
    return next((j for j in range(i - 1, -1, -1) if not frames[j].filename.startswith("<") and
                 not frames[j].filename.replace("\\", "/").endswith(_MODULE_CALL)), None)


def _moe_category(frames: list[Frame]) -> tuple[Category, bool] | None:
    """(moe.dispatch_buffer / moe.combine_buffer, whether only an exchange says so) for a stack
    under an MoE layer, else None. An MoE implementation's file is one whose name says so or the
    file of the MoE module's own `forward` (a script's `SwitchMoE` and the all-to-all Function
    written beside it: the file's name need not say MoE). An uninitialized buffer (`empty`,
    `empty_like`, `new_empty`: an op frame of a CPU recording or of `stacks="all"`) the outermost
    MoE module's own `forward` makes is an exchange's output: the layer allocates what an
    all-to-all then fills (`torch.distributed.nn.functional.all_to_all_single(out, x)`); a
    buffer the layer fills itself starts zeroed (its padding must hold zeros)."""
    layer = moe_layer_frame(frames)
    if layer is None:
        return None
    own = _forward_of(frames, layer)
    own_file = frames[own].filename if own is not None else None
    outer = next((f for f in reversed(frames) if f.filename == "<nn.Module>" and
                  _MOE_MODULE.search(f.name)), None)
    top = _forward_of(frames, outer) if outer is not None else None
    inner = next((j for j, f in enumerate(frames) if not f.filename.startswith("<")), None)
    a2a = top is not None and top == inner and top > 0 and frames[top - 1].name in _EMPTY_OPS
    py = [f for f in frames if not f.filename.startswith("<")]  # innermost first
    for i, f in enumerate(py):
        fn = f.filename.replace("\\", "/")
        if f.name in _ALL_TO_ALL_FUNCS and fn.endswith(
                ("distributed/distributed_c10d.py", "distributed/_functional_collectives.py")):
            a2a = True
            continue
        if not (f.filename == own_file or _MOE_FILE.search(fn)):
            continue
        if f.name == "forward" and i + 1 < len(py) and py[i + 1].name == "apply" and \
                py[i + 1].filename.replace("\\", "/").endswith("torch/autograd/function.py"):
            a2a = True  # an MoE file's autograd Function (`_AllToAll`)
            continue
        words = set(f.name.lower().strip("_").split("_"))
        if words & _MOE_COMBINE_WORDS:
            return Category.MOE_COMBINE, False
        if words & _MOE_DISPATCH_WORDS:
            return Category.MOE_DISPATCH, False
    return (Category.MOE_DISPATCH, True) if a2a else None


# Tensor parallelism (DTensor): a redistribution's output is made by one of the placements'
# collective methods in `torch/distributed/tensor/placement_types.py` (the innermost DTensor
# frame; under it only `funcol`/c10d calls): `Shard._to_replicate_tensor` all-gathers,
# `Partial._reduce_shard_tensor` reduce-scatters, `Partial._reduce_value` all-reduces. They run
# under the parallel styles' hooks (`style.py`), `DTensor.redistribute`/`full_tensor` and its
# backward (`_redistribute.py`), or a DTensor op (`_dispatch.py`). The same methods under
# `parallelize_module`/`distribute_tensor` shard parameters at init (`parameter`), and FSDP2's
# own collectives never go through them (their frames are FSDP's: checked first for safety).
_TP_FILE = "distributed/tensor/placement_types.py"
_TP_FUNCS = {"_to_replicate_tensor": Category.TP_ALL_GATHER,
             "_reduce_shard_tensor": Category.TP_REDUCE_SCATTER,
             "_reduce_value": Category.TP_ALL_REDUCE}
_TP_INIT_FUNCS = {"parallelize_module", "distribute_tensor", "distribute_module"}


def _tp_category(frames: list[Frame], nameset: set[str]) -> Category | None:
    """The TP collective that made the row, if its innermost DTensor frame is one (not init)."""
    if nameset & _TP_INIT_FUNCS:
        return None
    for f in frames:  # innermost first
        fn = f.filename.replace("\\", "/")
        if "distributed/tensor/" in fn:
            return _TP_FUNCS.get(f.name) if fn.endswith(_TP_FILE) else None
        if _is_fsdp_file(f):
            return None
    return None


# Megatron-Core (`megatron/core/`, read from megatron-core 0.16.1), by its innermost frame:
# - `distributed/param_and_grad_buffer.py`: `_ParamAndGradBuffer.__init__` allocates the DDP
#   wrapper's contiguous `grad_data` (and `param_data` under the distributed optimizer), every
#   parameter and `main_grad` a view into them, alive for the whole run; its other functions
#   (`start_param_sync` / `start_grad_sync` / `finish_*`) are the buckets' all-gather and
#   reduce-scatter / all-reduce, whose temporaries are `megatron.bucket_comm`.
# - `optimizer/distrib_optimizer.py` `_build_model_and_main_param_groups`: the distributed
#   optimizer's fp32 main-parameter shards of bf16/fp16 parameters (`clone().float()`);
#   `optimizer/optimizer.py` `__init__`: the non-distributed mixed-precision optimizer's
#   (`Float16OptimizerWithFloat16Params`) fp32 copies, with a few bytes of its flags.
# - `tensor_parallel/mappings.py`: the TP/SP collectives (`_gather_along_*_dim` all-gather,
#   `_reduce_scatter_along_*_dim` reduce-scatter, `_reduce` all-reduce), the same meaning as
#   DTensor's; `tensor_parallel/layers.py`'s linear (`LinearWithGradAccumulationAndAsync
#   Communication`) all-gathers its sequence-parallel input into the global memory buffer
#   (`utils.py` `get_tensor`) or, in backward, straight through a c10d all-gather, and
#   reduce-scatters its input grad.
# - `pipeline_parallel/p2p_communication.py`: the buffers a stage receives into
#   (`create_tensor_recv_prev` / `_next` under `_communicate`): `pp.p2p_buffer`.
# - `tensor_parallel/random.py`: its activation checkpointing (`CheckpointFunction.backward`,
#   `CheckpointWithoutOutput._recompute`) recomputes there (the phase, below).
# Checked before FSDP's names: Megatron's collectives are c10d's too (`c10d::_allgather_base_`).
_MEGATRON = "megatron/"
_MEGATRON_TP = {"_gather_along_first_dim": Category.TP_ALL_GATHER,
                "_gather_along_last_dim": Category.TP_ALL_GATHER,
                "_reduce_scatter_along_first_dim": Category.TP_REDUCE_SCATTER,
                "_reduce_scatter_along_last_dim": Category.TP_REDUCE_SCATTER,
                "_reduce": Category.TP_ALL_REDUCE}
# Megatron-LM before megatron/core (2022-23): `megatron/mpu/`, `megatron/model/distributed.py`
# (`MemoryBuffer`), `megatron/optimizer/`, `megatron/p2p_communication.py`; core 0.4 had
# `distributed/grad_buffer.py`. Paths below are read with `megatron/` and `core/` taken off.
_MEGATRON_BUFFERS = ("distributed/param_and_grad_buffer.py", "distributed/grad_buffer.py",
                     "model/distributed.py")
_MEGATRON_MAPPINGS = ("tensor_parallel/mappings.py", "mpu/mappings.py")
MEGATRON_LAYERS = ("tensor_parallel/layers.py", "mpu/layers.py")
_MEGATRON_P2P = ("pipeline_parallel/p2p_communication.py", "p2p_communication.py")
_MEGATRON_CKPT = ("tensor_parallel/random.py", "mpu/random.py")
# DeepSpeed's activation checkpointing (Megatron-DeepSpeed, GPT-NeoX): the reentrant
# `CheckpointFunction.backward` and the non-reentrant `checkpoint_unpack` hook recompute there
_DEEPSPEED_CKPT = "deepspeed/runtime/activation_checkpointing/checkpointing.py"


def megatron_rel(filename: str) -> str | None:
    """`filename` inside Megatron (`megatron/` and `core/` taken off), None outside it."""
    fn = filename.replace("\\", "/")
    if _MEGATRON not in fn:
        return None
    rel = fn.rsplit(_MEGATRON, 1)[1]
    return rel[len("core/"):] if rel.startswith("core/") else rel


def _megatron_category(frames: list[Frame], nameset: set[str]) -> Category | None:
    """The Megatron buffer or TP/PP collective that made the row, by its innermost Megatron
    frame (with the one after it for the global memory buffer)."""
    mframes = [(f.name, rel) for f in frames if (rel := megatron_rel(f.filename)) is not None]
    if not mframes:
        return None
    name, rel = mframes[0]
    if rel in _MEGATRON_BUFFERS:
        return Category.MEGATRON_BUFFER if name == "__init__" else Category.MEGATRON_BUCKET_COMM
    if rel == "optimizer/distrib_optimizer.py" and name == "_build_model_and_main_param_groups" \
            or rel == "optimizer/optimizer.py" and name == "__init__":
        return Category.MEGATRON_MAIN_PARAM
    if rel in _MEGATRON_P2P:
        return Category.PP_P2P
    if rel in _MEGATRON_MAPPINGS:
        return _MEGATRON_TP.get(name)
    if rel == "utils.py" and name == "get_tensor" and len(mframes) > 1 and \
            mframes[1][1] in MEGATRON_LAYERS:
        return Category.TP_ALL_GATHER
    if rel in MEGATRON_LAYERS and name in ("forward", "backward"):
        if nameset & _C10D_GATHER:
            return Category.TP_ALL_GATHER
        if nameset & _C10D_SCATTER:
            return Category.TP_REDUCE_SCATTER
    return None


# DeepSpeed ZeRO (`deepspeed/runtime/zero/`, read from deepspeed 0.19.8): the gradient reduction
# bucket, `reduce_bucket_size` elements whatever the model's size (default 5e8), made where it is
# the innermost Python frame: ZeRO-1/2's `setup_buckets` (`stage_1_and_2.py`, each backward; two
# under `overlap_comm`; in earlier releases `backward`, and `reduce_gradients` under pipeline
# parallelism, read from their source) and ZeRO-3's `_setup_for_real_optimizer` (`stage3.py`,
# once, alive for the run).
_DEEPSPEED_BUCKET = {"stage_1_and_2.py": {"setup_buckets", "backward", "reduce_gradients"},
                     "stage3.py": {"_setup_for_real_optimizer"}}


# ZeRO-3's parameter all-gathers (`partition_parameters.py`, deepspeed 0.19.8): the flat output
# buffer each gathered parameter's `.data` becomes a view of, made under the coordinator's
# `fetch_sub_module` (a module's forward or backward), `_post_step` (persistent parameters) or
# the optimizer's set-up, and the parameter a handle's `wait` concatenates from the gathered
# partitions (`AllGatherCoalescedHandle.wait`: `torch.cat(partitions)`). Any of these frames on
# the stack names the buffer: every one of them only gathers parameters.
_DEEPSPEED_GATHER = {"wait", "_all_gather_dtype", "_all_gather_sequential", "_all_gather_coalesced",
                     "all_gather_coalesced", "_all_gather", "_allgather_param",
                     "_allgather_params_coalesced", "_allgather_params_sequential",
                     "_dist_allgather_fn", "all_gather"}


def _deepspeed_category(frames: list[Frame]) -> Category | None:
    if any(g.name in _DEEPSPEED_GATHER and g.filename.replace("\\", "/").endswith(
            "deepspeed/runtime/zero/partition_parameters.py") for g in frames):
        return Category.DEEPSPEED_GATHERED_PARAM
    f = next((f for f in frames if not f.filename.startswith("<")), None)
    if f is None or any(g.name == "aten::zeros" for g in frames if g.filename == "<op>"):
        # ZeRO-3 makes its flat gradient partitions there too, with torch.zeros (told apart
        # where the stack has operator frames, the CPU recorder's; on CUDA both read as the
        # bucket, and the rule only shrinks blocks larger than the model's gradients)
        return None
    fn = f.filename.replace("\\", "/")
    if "deepspeed/runtime/zero/" not in fn:
        return None
    names = _DEEPSPEED_BUCKET.get(fn.rsplit("/", 1)[1], set())
    return Category.DEEPSPEED_REDUCE_BUCKET if f.name in names else None


# torch.distributed.pipelining: a stage makes the buffers it receives into from the metadata
# its neighbour sent (`_make_tensor_from_meta` in `pipelining/_utils.py`, under the stage's
# `_setup_forward_recv_info` / `_create_grad_recv_info`, per micro-batch chunk). DeepSpeed's
# PipelineEngine (`deepspeed/runtime/pipe/engine.py`): the receive buffers it sizes from the
# metadata (`_recv_tensor_meta` -> `_allocate_buffer(s)` / `_allocate_zeros`, the gradient
# buffers `_allocate_or_extend_buffers`) and the copy of each received activation a stage keeps
# for its micro-batch's backward (`_exec_recv_activations`, into `pipe_buffers['inputs']`). The
# innermost frame of the pipeline's file decides.
_DS_PIPE = "deepspeed/runtime/pipe/engine.py"
_DS_PIPE_BUFFERS = {"_recv_tensor_meta", "_allocate_buffer", "_allocate_buffers",
                    "_allocate_zeros", "_allocate_or_extend_buffers", "_exec_recv_activations",
                    "_exec_recv_grads"}


def _pp_category(frames: list[Frame]) -> Category | None:
    for f in frames:
        fn = f.filename.replace("\\", "/")
        if "distributed/pipelining/" in fn:
            return Category.PP_P2P if f.name == "_make_tensor_from_meta" else None
        if fn.endswith(_DS_PIPE):
            return Category.PP_P2P if f.name in _DS_PIPE_BUFFERS else None
    return None


# Ranges FSDP2 names `KIND (fqn)`; the root unit's have no fqn.
_PER_UNIT_RANGES = {"pre_forward", "post_forward", "pre_backward", "all_gather",
                    "all_gather_copy_out", "post_backward_accumulate", "post_backward_reshard",
                    "post_backward_reduce", "post_backward_rs_wait"}
# FSDP1 record_function ranges (no FQN), as the FSDP2 kind they correspond to.
_FSDP1_RANGES = {
    "FullyShardedDataParallel._root_pre_forward": "root_pre_forward",
    "FullyShardedDataParallel._pre_forward": "pre_forward",
    "FullyShardedDataParallel._pre_forward_prefetch": "forward_prefetch",
    "FullyShardedDataParallel._post_forward": "post_forward",
    "FullyShardedDataParallel._pre_backward_hook": "pre_backward",
    "FullyShardedDataParallel._pre_backward_prefetch": "backward_prefetch",
    "FullyShardedDataParallel._post_backward_prefetch": "backward_prefetch",
    "FullyShardedDataParallel._post_backward_hook": "post_backward_hook",
    "FullyShardedDataParallel._post_backward_hook_reshard_only": "post_backward_reshard",
}


@dataclass(frozen=True)
class StackInfo:
    category: Category
    path: str | None  # how FSDP unsharded it (PATHS), for all-gather / unsharded-param blocks
    phase: Phase  # phase hint from the stack alone, UNKNOWN if none
    module: str | None  # FSDP module FQN, when a range or frame names it
    has_frames: bool  # has a Python frame (a `stacks="all"` stack may have only C++ ones)
    autograd: bool = False  # made inside the autograd engine (C++ frames, `stacks="all"` only)
    exchange: bool = False  # an MoE all-to-all's output under no dispatch- or combine-named call
    backend: bool = False  # made on a collective backend's own thread (gloo's copy of a gather)


def _is_fsdp_file(f: Frame) -> bool:
    fn = f.filename.replace("\\", "/")
    return "/fsdp/" in fn or "_composable/fsdp" in fn


def classify(frames: list[Frame], ranges: tuple[str, ...] = ()) -> StackInfo:
    """Classify one stack (innermost first) with the record_function ranges open around it.

    Only Python (and CPU pseudo) frames decide, so a `stacks="all"` stack classifies as its
    `stacks="python"` twin; its C++ frames add one fact, that the autograd engine made it
    (`autograd`), which a python-only stack can only show by having no frames."""
    native = [f for f in frames if is_native(f)]
    if native:
        frames = [f for f in frames if not is_native(f)]
    autograd = any(_AUTOGRAD_ENGINE.search(f.name) for f in native)
    names = [f.name for f in frames]
    nameset = set(names)
    files = [f.filename.replace("\\", "/") for f in frames]
    rf = [f.name for f in frames if f.filename == "<record_function>"] + list(reversed(ranges))
    rfkinds: dict[str, str] = {}
    module = None
    # FSDP1 ranges name no unit and, unlike FSDP2's, are kept out of the phase: a
    # `_pre_forward` range is also open around a reentrant recompute, and frameless rows (a
    # collective's worker thread) would read it as forward. They only help category and path.
    fsdp1kinds = {_FSDP1_RANGES[r] for r in rf if r in _FSDP1_RANGES}
    for r in rf:  # innermost first
        if r in _FSDP1_RANGES:
            continue
        m = parse_range(r)
        if m:
            rfkinds.setdefault(m.kind, r)
            if module is None:
                module = m.fqn or ("(root)" if m.kind in _PER_UNIT_RANGES else None)
    rftext = " ".join(rf)

    # Reentrant checkpoint: the recompute runs inside CheckpointFunction.backward (on CUDA the
    # autograd thread's stack starts there: no `CheckpointFunctionBackward` op frame).
    in_recompute = bool(nameset & _RECOMPUTE_FUNCS) or (
        "backward" in nameset and "CheckpointFunction" in " ".join(names)) or any(
        n == "backward" and p.endswith("utils/checkpoint.py") or
        n in ("backward", "_recompute") and megatron_rel(p) in _MEGATRON_CKPT or
        n in ("backward", "checkpoint_unpack") and p.endswith(_DEEPSPEED_CKPT)
        for n, p in zip(names, files))
    # torch.compile's backward: AOTAutograd's `CompiledFunction.backward` runs the compiled
    # backward graph, whose frames map back to the user's `forward` source lines.
    in_backward = in_recompute or bool(nameset & _BACKWARD_FUNCS) or any(
        n == "backward" and (p.endswith("torch/_tensor.py") or p.endswith("autograd/__init__.py"))
        or n in ("backward", "_backward_impl") and "_functorch/_aot_autograd/" in p
        for n, p in zip(names, files)) or "pre_backward" in rfkinds or any(
        k.startswith("post_backward") for k in rfkinds) or "root_post_backward_callback" in rfkinds
    in_optim = any(p.startswith("torch/optim/") or "/torch/optim/" in p or
                   (megatron_rel(p) or "").startswith("optimizer/") for p in files) or \
        "Optimizer." in rftext
    in_forward = any(n in ("_call_impl", "_wrapped_call_impl") for n in names) or \
        "pre_forward" in rfkinds or "forward" in nameset
    in_init = bool(nameset & _INIT_FUNCS) or bool(nameset & _SHARDED_INIT_FUNCS) or \
        bool(nameset & _FULL_INIT_FUNCS)

    # A collective backend's worker thread (a row whose only frames are `gloo:all_gather` and
    # ops) or a free the recorder inferred for such a thread (`<snapforensics>`): the ranges open
    # on the main thread do not say which phase it serves (a pre-forward range is open inside a
    # recompute too), so its phase is left to the rows around it.
    worker_row = bool(frames) and all(f.filename.startswith("<") for f in frames) and (
        any(n.startswith(("gloo:", "nccl:", "hccl:")) for n in names) or
        any(f.filename == "<snapforensics>" for f in frames))
    if worker_row:
        phase = Phase.UNKNOWN
    elif in_recompute:
        phase = Phase.RECOMPUTE
    elif in_backward:
        phase = Phase.BACKWARD
    elif in_optim:
        phase = Phase.OPTIMIZER
    elif in_forward:
        phase = Phase.FORWARD
    elif in_init:
        phase = Phase.INIT
    else:
        phase = Phase.UNKNOWN

    path, exchange = None, False
    fsdp_here = bool(rfkinds or fsdp1kinds) or any(_is_fsdp_file(f) for f in frames)
    parallel = _megatron_category(frames, nameset) or _tp_category(frames, nameset) or \
        _pp_category(frames) or _deepspeed_category(frames)
    inner = next((f for f in frames if not f.filename.startswith("<")), None)
    if inner is not None and inner.name in _DDP_BUCKET_FUNCS and \
            inner.filename.replace("\\", "/").endswith(_DDP_FILE):
        category = Category.DDP_BUCKET
    elif parallel is not None:
        category = parallel
    elif nameset & _DDP_INIT_COLLECTIVES and not any(_is_fsdp_file(f) for f in frames):
        category = Category.PARAMETER
    elif worker_row and fsdp_here and (kind := _worker_collective(names)) is not None:
        # the backend's own buffer (gloo copies a gather's output through one on its thread):
        # the collective's, whichever FSDP range the main thread has open (a copy-out's too)
        category = kind
    elif nameset & _UNSHARDED_FUNCS or "all_gather_copy_out" in rfkinds:
        category = Category.UNSHARDED_PARAM
    elif nameset & _ALL_GATHER_FUNCS or "all_gather" in rfkinds or \
            nameset & _C10D_GATHER and fsdp_here:
        category = Category.ALL_GATHER
    elif nameset & _UNSHARDED_GRAD_FUNCS or "post_backward_accumulate" in rfkinds:
        category = Category.UNSHARDED_GRAD
    elif nameset & _REDUCE_FUNCS or "post_backward_reduce" in rfkinds or \
            nameset & _C10D_SCATTER and fsdp_here or \
            "post_backward_hook" in fsdp1kinds or any(
                f.name in _FSDP1_REDUCE_HOOKS and _is_fsdp_file(f) for f in frames):
        category = Category.REDUCE_SCATTER
    elif nameset & _FULL_INIT_FUNCS and not nameset & _SHARD_FUNCS:
        category = Category.PARAMETER
    elif nameset & _SHARDED_INIT_FUNCS and any(_is_fsdp_file(f) for f in frames):
        category = Category.SHARDED_PARAM
    elif phase != Phase.OPTIMIZER and (moe := _moe_category(frames)) is not None:
        category, exchange = moe
    elif phase == Phase.OPTIMIZER:
        category = Category.OPTIMIZER_STATE
    elif phase == Phase.RECOMPUTE:
        category = Category.RECOMPUTE_ACTIVATION
    elif phase == Phase.BACKWARD:
        category = Category.GRADIENT
    elif phase == Phase.FORWARD:
        category = Category.ACTIVATION
    elif phase == Phase.INIT:
        category = Category.PARAMETER
    else:
        category = Category.OTHER
    if category in (Category.UNSHARDED_PARAM, Category.ALL_GATHER):
        path = _unshard_path(frames, ranges, in_recompute)
    return StackInfo(category, path, phase, module, bool(frames), autograd, exchange, worker_row)


def _unshard_path(frames: list[Frame], ranges: tuple[str, ...], in_recompute: bool) -> str:
    """The FSDP hook that asked for this unshard: the innermost prefetch / pre-backward /
    pre-forward entry of the stack (then of the open ranges). A pre-forward inside a recompute is
    the recompute path; a pre-backward hook fired inside a reentrant checkpoint's backward is
    still the pre-backward path."""
    for kind in _entry_kinds(frames, ranges):
        if kind == "prefetch":
            return "prefetch"
        if kind == "pre_backward":
            return "backward_pre_hook"
        if kind == "pre_forward":
            return "recompute" if in_recompute else "forward"
    return "recompute" if in_recompute else "explicit"


def _entry_kinds(frames: list[Frame], ranges: tuple[str, ...]):
    for f in frames:  # innermost first
        name = f.name
        if f.filename == "<record_function>":
            m = parse_range(name)
            name = _FSDP1_RANGES.get(name) or (m.kind if m else name)
            if name in ("forward_prefetch", "backward_prefetch"):
                yield "prefetch"
            elif name in ("pre_backward", "pre_forward", "root_pre_forward"):
                yield "pre_forward" if name == "root_pre_forward" else name
            continue
        if name in _PREFETCH_FUNCS:
            yield "prefetch"
        elif name in _PRE_BACKWARD_FUNCS:
            yield "pre_backward"
        elif name in _PRE_FORWARD_FUNCS:
            yield "pre_forward"
    for r in reversed(ranges):  # innermost open range first
        m = parse_range(r)
        kind = _FSDP1_RANGES.get(r) or (m.kind if m else None)
        if kind in ("forward_prefetch", "backward_prefetch"):
            yield "prefetch"
        elif kind == "pre_backward":
            yield "pre_backward"
        elif kind in ("pre_forward", "root_pre_forward"):
            yield "pre_forward"


# user categories: the category column is int8 (127 codes) and the built-in ones take ~15
MAX_USER_CATEGORIES = 100


def user_categories(spec) -> dict[str, re.Pattern]:
    """User categories from `{name: regex}` or `["NAME=REGEX", ...]` (`--category`), compiled.

    Raises SnapError (exit 2) on a malformed item or a regex that does not compile."""
    from snapforensics.errors import SnapError

    if not spec:
        return {}
    items = list(spec.items() if hasattr(spec, "items") else (
        tuple(s.split("=", 1)) if "=" in s else (s, None) for s in spec))
    if len(items) > MAX_USER_CATEGORIES:
        raise SnapError(f"{len(items)} categories: at most {MAX_USER_CATEGORIES} (a block's "
                        "category is one byte, shared with the built-in ones)")
    out: dict[str, re.Pattern] = {}
    for name, regex in items:
        name = str(name).strip()
        if not name or regex is None or len(name) > 64 or not name.isprintable():
            raise SnapError(f"category {name[:64]!r}: expected NAME=REGEX with a printable name "
                            "of at most 64 characters")
        try:
            out[name] = regex if isinstance(regex, re.Pattern) else re.compile(str(regex))
        except re.error as e:
            raise SnapError(f"category {name!r}: invalid regular expression: {e}") from None
    return out
