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
