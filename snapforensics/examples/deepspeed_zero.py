"""A small MLP trained a few steps under DeepSpeed ZeRO (stage 2 or 3) on the CPU (DeepSpeed's
own CPU accelerator, ``DS_ACCELERATOR=cpu``, gloo), for ground truth on DeepSpeed's gradient
reduction bucket: ``reduce_bucket_size`` elements (DeepSpeed's default 5e8: 2 GB of fp32) made
whatever the model's size (ZeRO-1/2 ``setup_buckets``, ZeRO-3 ``_setup_for_real_optimizer``).
``--bucket N`` sets ``zero_optimization.reduce_bucket_size``.

The truth (``--truth DIR``, per rank): the bucket buffers' storages (address and bytes) read
from the running optimizer's ``ipg_buckets`` (after each ``setup_buckets`` under ZeRO-1/2, each
storage once), the configured bucket size, the model's parameter count and the stage; under
ZeRO-3 also the storages of the parameters DeepSpeed all-gathered (``gathered``: each
available parameter's storage and the time, read as DeepSpeed's coordinator returns from
``fetch_sub_module``, forward and backward, and after each optimizer step, which re-gathers the
persistent ones). Needs
``deepspeed`` (the Makefile installs it for the tests).
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn

from snapforensics.examples.common import parser, write_truth


def _storage(t: torch.Tensor) -> dict:
    s = t.untyped_storage()
    return {"addr": s.data_ptr(), "bytes": s.nbytes()}


def main(argv: list[str] | None = None) -> None:
    p = parser(layers=4, dim=256, batch=4, seq=1, steps=2)
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--bucket", type=int, help="reduce_bucket_size (elements)")
    p.add_argument("--persistence", type=int,
                   help="ZeRO-3 stage3_param_persistence_threshold (elements; DeepSpeed's "
                        "default 1e5 keeps every parameter below it gathered)")
    a = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a.dim, a.dim) for _ in range(a.layers)])
    zero: dict = {"stage": a.stage}
    if a.bucket:
        zero["reduce_bucket_size"] = a.bucket
    if a.persistence is not None:
        zero["stage3_param_persistence_threshold"] = a.persistence
    cfg = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": zero}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=cfg, dist_init_required=True)
    buckets: list[dict] = []

    def seen() -> None:  # the buffers now in the optimizer's buckets, each storage once
        for bucket in getattr(opt, "ipg_buckets", {}).values():
            bufs = bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer]
            for st in (_storage(b) for b in bufs if isinstance(b, torch.Tensor)):
                if st not in buckets:
                    buckets.append(st)

    if hasattr(opt, "setup_buckets"):  # ZeRO-1/2 makes its buffers in the first backward
        made = opt.setup_buckets

        def setup_buckets(*args, **kwargs):
            out = made(*args, **kwargs)
            seen()
            return out
        opt.setup_buckets = setup_buckets
    seen()
    gathered: list[dict] = []

    def available(*_) -> None:  # ZeRO-3: the parameters' gathered storages, and when seen
        now = time.time() * 1e6  # the recorder's clock: epoch microseconds
        for q in model.parameters():
            if q.data.numel() and getattr(q, "ds_status", None) is not None and \
                    q.ds_status.name == "AVAILABLE":
                gathered.append({**_storage(q.data), "time_us": now})

    if a.stage == 3:
        from deepspeed.runtime.zero.partitioned_param_coordinator import (
            PartitionedParameterCoordinator as Coordinator,
        )

        fetch = Coordinator.fetch_sub_module

        def fetch_sub_module(self, *args, **kwargs):
            out = fetch(self, *args, **kwargs)
            available()
            return out

        Coordinator.fetch_sub_module = fetch_sub_module
    for _ in range(a.steps):
        loss = engine(torch.randn(a.batch, a.dim)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if a.stage == 3:
            available()
    write_truth(a.truth, dist.get_rank(), {
        "stage": a.stage, "reduce_bucket_size": int(opt.reduce_bucket_size),
        "params": sum(int(getattr(q, "ds_numel", q.numel())) for q in model.parameters()),
        "buckets": buckets, "gathered": gathered, "world": dist.get_world_size(),
        # ZeRO-3's persistent parameters (ds_persist: under the threshold, kept gathered), their
        # full bytes
        "persistent": [int(q.ds_numel) * q.element_size() for q in model.parameters()
                       if getattr(q, "ds_persist", False)]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
