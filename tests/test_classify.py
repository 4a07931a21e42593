"""Classification of stacks by their frame names (FSDP1, FSDP2, checkpointing), no recording."""

from __future__ import annotations

from snapforensics.analysis.classify import classify
from snapforensics.analysis.vocab import Category, Phase
from snapforensics.snapshot import Frame


def _f(name, file="torch/distributed/fsdp/_runtime_utils.py"):
    return Frame(file, 1, name)


def test_classify_fsdp1_names():
    flat = [_f("_alloc_storage", "torch/distributed/utils.py"),
            _f("_alloc_padded_unsharded_flat_param", "torch/distributed/fsdp/_flat_param.py"),
            _f("unshard", "torch/distributed/fsdp/_flat_param.py"), _f("_unshard")]
    fwd = classify(flat + [_f("_pre_forward_unshard"), _f("_pre_forward"),
                           _f("forward", "m.py")])
    assert (fwd.category, fwd.path, fwd.phase) == \
        (Category.UNSHARDED_PARAM, "forward", Phase.FORWARD)
    pre = classify(flat + [_f("_pre_backward_hook"), _f("_engine_run_backward", "a.py")])
    assert (pre.category, pre.path, pre.phase) == \
        (Category.UNSHARDED_PARAM, "backward_pre_hook", Phase.BACKWARD)
    pf = classify(flat + [_f("_prefetch_handle"), _f("_pre_backward_hook"),
                          _f("_engine_run_backward", "a.py")])
    assert pf.path == "prefetch"
    # the reentrant recompute: FSDP's pre-forward inside CheckpointFunction.backward
    rc = classify(flat + [_f("_pre_forward_unshard"), _f("_pre_forward"), _f("forward", "m.py"),
                          _f("backward", "torch/utils/checkpoint.py")])
    assert (rc.path, rc.phase) == ("recompute", Phase.RECOMPUTE)
    mp = classify([_f("_alloc_storage", "torch/distributed/utils.py"),
                   _f("_use_low_precision_shard", "torch/distributed/fsdp/_flat_param.py"),
                   _f("pre_unshard", "torch/distributed/fsdp/_flat_param.py"), _f("_unshard"),
                   _f("_pre_forward_unshard"), _f("_pre_forward")])
    assert mp.category == Category.ALL_GATHER
    cast = classify([Frame("<op>", 0, "aten::to"), _f("_post_backward_hook"),
                     _f("_engine_run_backward", "a.py")])
    assert (cast.category, cast.phase) == (Category.REDUCE_SCATTER, Phase.BACKWARD)
    rs = classify([_f("_get_reduce_scatter_tensors"), _f("_reduce_grad"),
                   _f("_post_backward_hook")])
    assert rs.category == Category.REDUCE_SCATTER
    init = [_f("__init__", "torch/distributed/fsdp/fully_sharded_data_parallel.py")]
    full = classify([_f("empty_like", "x.py"),
                     _f("_materialize_meta_module", "torch/distributed/fsdp/_init_utils.py"),
                     _f("_init_param_handle_from_module", "torch/distributed/fsdp/_init_utils.py")
                     ] + init)
    assert (full.category, full.phase) == (Category.PARAMETER, Phase.INIT)
    shard = classify([_f("_get_shard", "torch/distributed/fsdp/_flat_param.py"),
                      _f("shard", "torch/distributed/fsdp/_flat_param.py"),
                      _f("_init_param_handle_from_module", "torch/distributed/fsdp/_init_utils.py")
                      ] + init)
    assert shard.category == Category.SHARDED_PARAM
    # FSDP1's record_function ranges alone (CUDA, no Python frames): category and path, no phase
    ranged = classify([], ("FullyShardedDataParallel.forward",
                           "FullyShardedDataParallel._pre_forward"))
    assert ranged.phase == Phase.UNKNOWN  # also open around a reentrant recompute


def _other_at_peak(name: str):
    """(share of the peak's bytes in `other`, blocks alive at the peak) of a corpus file's
    first traced device."""
    import numpy as np

    from snapforensics.analysis.context import analyse
    from snapforensics.analysis.vocab import CAT_CODE
    from snapforensics.snapshot import load
    from tests.corpus import corpus_file

    snap = load(corpus_file(name))
    d = analyse(snap, snap.active_traces[0])
    alive = np.flatnonzero(d.lt.alive_at(d.peak_row))
    other = alive[d.category[alive] == CAT_CODE[Category.OTHER]]
    return int(d.lt.size[other].sum()) / int(d.lt.size[alive].sum()), d, alive


def test_user_code_outside_modules_is_what_its_phase_makes():
    # MAGMA27 (CS336 A2, Windows): the loss, `cross_entropy` -> `log_softmax` in the user's
    # nn_utils.py, runs after `model(x)` returned, so no module-call frame names it; its
    # 938 MiB at the peak (7.1%) was `other`. Born in a forward row, it is an activation.
    import numpy as np

    from snapforensics.analysis.vocab import CAT_CODE

    share, d, alive = _other_at_peak("MAGMA27_memory_snapshot.pickle")
    assert share < 0.05
    loss = [b for b in alive.tolist()
            if any(f.name == "log_softmax" for f in d.snapshot.stack_frames(int(d.lt.stack[b])))]
    assert sum(int(d.lt.size[b]) for b in loss) > 900 * 2**20
    assert set(d.category[loss].tolist()) == {CAT_CODE[Category.ACTIVATION]}
    assert set(d.phase[loss].tolist()) == {Phase.FORWARD}
    # Every block born in a forward / backward / recompute row is named.
    born_in_step = np.isin(d.phase, (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE))
    assert not (born_in_step & (d.category == CAT_CODE[Category.OTHER])).any()


def test_classify_ddp_reducer_buckets():
    """DDP's Reducer buckets by their innermost Python frame (`_ddp_init_helper` at
    construction, `_pre_forward` when it rebuilds them), with the C++ op on top (CPU) or not
    (CUDA `stacks="python"`); what else `_pre_forward` reaches goes through a call of its own;
    DDP's construction-time shape all-gather is no FSDP buffer."""
    ddp = "torch/nn/parallel/distributed.py"
    init = classify([Frame("<op>", 0, "aten::empty"), _f("_ddp_init_helper", ddp),
                     _f("__init__", ddp), _f("main", "train.py")])
    assert (init.category, init.phase) == (Category.DDP_BUCKET, Phase.INIT)
    rebuilt = classify([_f("_pre_forward", ddp), Frame("<record_function>", 0,
                                                       "DistributedDataParallel.forward"),
                        _f("forward", ddp), _f("_call_impl", "torch/nn/modules/module.py")])
    assert (rebuilt.category, rebuilt.phase) == (Category.DDP_BUCKET, Phase.FORWARD)
    buffers = classify([Frame("<op>", 0, "aten::empty"), _f("_sync_buffers", ddp),
                        _f("_pre_forward", ddp), _f("forward", ddp),
                        _f("_call_impl", "torch/nn/modules/module.py")])
    assert buffers.category == Category.ACTIVATION
    shapes = classify([Frame("<op>", 0, "aten::empty"), Frame("<op>", 0, "c10d::allgather_"),
                       _f("_verify_param_shape_across_processes", "torch/distributed/utils.py"),
                       _f("__init__", ddp)])
    assert shapes.category == Category.PARAMETER


def test_classify_moe_token_dispatchers():
    """MoE dispatch / combine buffers by the token dispatchers' own function names (torchtitan's
    `AllToAllTokenDispatcher` in `torchtitan/models/common/token_dispatcher.py` and its older
    `ExpertParallel` hooks, Megatron-LM's `MoEAlltoAllTokenDispatcher`), the functional
    all-to-all's output under an MoE layer with no named function; a `dispatch` outside an MoE
    file or module is nothing of the kind."""
    mod = _f("_call_impl", "torch/nn/modules/module.py")
    tt = "torchtitan/models/common/token_dispatcher.py"
    fc = "torch/distributed/_functional_collectives.py"
    a2a = _f("all_to_all_single_autograd", fc)

    def cat(*frames):
        return classify([Frame("<op>", 0, "aten::empty"), *frames, mod]).category

    assert cat(a2a, _f("_dispatch_token_exchange", tt), _f("dispatch", tt),
               _f("forward", "torchtitan/models/common/moe.py")) == Category.MOE_DISPATCH
    assert cat(_f("_permute", tt), _f("dispatch", tt)) == Category.MOE_DISPATCH
    assert cat(a2a, _f("_combine_token_exchange", tt), _f("combine", tt)) == Category.MOE_COMBINE
    assert cat(_f("_unpermute", tt), _f("combine", tt)) == Category.MOE_COMBINE
    old = "torchtitan/distributed/expert_parallel.py"
    assert cat(a2a, _f("_token_dispatch", old), _f("forward", "m.py")) == Category.MOE_DISPATCH
    assert cat(a2a, _f("_token_combine", old), _f("forward", "m.py")) == Category.MOE_COMBINE
    mg = "megatron/core/transformer/moe/token_dispatcher.py"
    mp = "megatron/core/tensor_parallel/mappings.py"
    c10d = "torch/distributed/distributed_c10d.py"
    assert cat(_f("forward", mp), _f("token_dispatch", mg)) == Category.MOE_DISPATCH
    assert cat(_f("permute", "megatron/core/transformer/moe/moe_utils.py"),
               _f("dispatch_preprocess", mg)) == Category.MOE_DISPATCH
    assert cat(_f("forward", mp), _f("token_combine", mg)) == Category.MOE_COMBINE
    assert cat(_f("combine_postprocess", mg)) == Category.MOE_COMBINE
    # an all-to-all under an MoE module frame (this recorder's `<nn.Module>` frames)
    assert cat(_f("all_to_all_single", c10d), _f("exchange", "model.py"),
               Frame("<nn.Module>", 0, "MoELayer_0")) == Category.MOE_DISPATCH
    # no MoE anywhere: a forward's `dispatch` is an activation
    assert cat(_f("dispatch", "mylib/router.py"), _f("forward", "m.py")) == Category.ACTIVATION
    # DeepSpeed 0.19's MOELayer as a CUDA snapshot shows it (Python frames only): the encode and
    # decode by their words, the all-to-all by the autograd Function's forward that
    # `Function.apply` calls (an exchange: context._split_moe_exchanges picks its kind)
    ds = "deepspeed/moe/sharded_moe.py"
    apply = _f("apply", "torch/autograd/function.py")
    assert cat(_f("_sparse_encode", ds), _f("forward", ds)) == Category.MOE_DISPATCH
    assert cat(_f("_sparse_decode", ds), _f("forward", ds)) == Category.MOE_COMBINE
    x = classify([_f("forward", ds), apply, _f("forward", ds), mod])
    assert (x.category, x.exchange) == (Category.MOE_DISPATCH, True)
    assert not classify([_f("_sparse_encode", ds), _f("forward", ds), mod]).exchange
    # an autograd Function outside any MoE file is no exchange
    assert cat(_f("forward", "mylib/fn.py"), apply, _f("forward", "m.py")) == Category.ACTIVATION


def test_deepspeed_activation_checkpointing_recomputes():
    """DeepSpeed's checkpointing (deepspeed.checkpointing.checkpoint, Megatron-DeepSpeed's and
    GPT-NeoX's): what its reentrant CheckpointFunction.backward and its non-reentrant unpack hook
    make is the recompute's, from the Python frames alone (a CUDA stack has no op frame)."""
    ck = "deepspeed/runtime/activation_checkpointing/checkpointing.py"
    layer = [_f("forward", "model.py"), _f("_call_impl", "torch/nn/modules/module.py")]
    engine = _f("_engine_run_backward", "torch/autograd/graph.py")
    for hook in ("backward", "checkpoint_unpack"):
        info = classify([*layer, _f(hook, ck), engine])
        assert (info.phase, info.category) == (Phase.RECOMPUTE, Category.RECOMPUTE_ACTIVATION)
    # its forward is the forward's
    fwd = classify([*layer, _f("forward", ck), _f("apply", "torch/autograd/function.py")])
    assert fwd.phase != Phase.RECOMPUTE


def test_a_backend_threads_gather_copy_is_the_collectives_buffer():
    """gloo copies a gather's output through a buffer of its own, made on its worker thread (a
    row of `aten::empty` under `gloo:all_gather` alone, as a CPU recording of FSDP2 carries it)
    while the main thread has FSDP's copy-out range open: the collective's buffer, not the
    unsharded parameter the copy-out makes (which it outlives or not by the thread's timing)."""
    row = [Frame("<op>", 0, "aten::empty"), Frame("<record_function>", 0, "gloo:all_gather")]
    for ranges in (("FSDP::all_gather_copy_out (layers.1)",), ("FSDP::all_gather (layers.1)",)):
        got = classify(row, ranges)
        assert (got.category, got.backend) == (Category.ALL_GATHER, True), ranges
    rs = classify([Frame("<op>", 0, "aten::empty"),
                   Frame("<record_function>", 0, "gloo:reduce_scatter")],
                  ("FSDP::post_backward_reduce (layers.1)",))
    assert rs.category == Category.REDUCE_SCATTER and rs.backend
    # FSDP's own copy-out, on the main thread, is the unsharded parameter
    own = classify([_f("alloc_storage", "torch/distributed/fsdp/_fully_shard/_fsdp_param.py")],
                   ("FSDP::all_gather_copy_out (layers.1)",))
    assert own.category == Category.UNSHARDED_PARAM and not own.backend
