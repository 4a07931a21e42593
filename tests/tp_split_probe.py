"""What the recorder says tensor parallelism splits, against the running state (tests/
test_identity.py::test_recorder_names_what_tp_splits).

One process, torch's fake process group (``FakeStore``: a 4-rank world without peers), the
example's transformer block (snapforensics/examples/tp.py) run twice on the same input: plain,
and under ``parallelize_module`` with a plan. Every tensor autograd saves in the TP run goes
through the recorder's own pack hook (``TensorNames._pack``, with its module stack and TP region
live) and is paired with the plain run's save at the same position: the truth is the ratio of
their storage bytes (4: TP splits it 4 ways; 1: TP replicates it). Prints one JSON list of
``[ratio, recorder's split, owner module, local shape]``.

    python tests/tp_split_probe.py {plain|sp|gathered|head}

``head``: the block and a column-wise output projection in one model, whose local logits the
script gathers itself after the model returns (``full_tensor``) and takes a softmax of: what is
saved there is whole, the region ends with the module that called the projection.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

TP = 4


def main(variant: str) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from snapforensics.examples import tp as ex
    from snapforensics.record.identity import TensorNames

    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    plan = ex.plan(variant == "sp")
    if variant == "gathered":  # w1's output all-gathered: nothing between w1 and w2 is split
        plan["feed_forward.w1"] = ColwiseParallel(output_layouts=Replicate())
        plan["feed_forward.w2"] = RowwiseParallel(input_layouts=Replicate())
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = ex.Block(64, 4), torch.nn.Linear(64, 256, bias=False)

        def forward(self, x):
            return self.head(self.block(x))

    torch.manual_seed(0)
    if variant == "head":
        plain, model = Model(), Model()
        parallelize_module(model.block, mesh, plan)
        parallelize_module(model.head, mesh, ColwiseParallel())

        def block(x):
            y = model(x)
            return DTensor.from_local(y, mesh, [Shard(-1)]).full_tensor().softmax(-1)

        def plain_run(x):
            return plain(x).softmax(-1)
    else:
        plain_run, block = ex.Block(64, 4), ex.Block(64, 4)
        parallelize_module(block, mesh, plan)
        model = block
    x = torch.randn(2, 16, 64)

    def saves(module, inp, pack_through=None) -> list:
        out = []

        def pack(t):
            local = t.to_local() if hasattr(t, "to_local") else t
            out.append((local.untyped_storage().data_ptr(), local.untyped_storage().nbytes(),
                        list(local.shape)))
            return pack_through(t) if pack_through else t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(inp)
        return out

    truth = saves(plain_run, x)
    names = TensorNames(model)
    names.start()
    try:
        inp = x.chunk(TP, dim=1)[0].contiguous() if variant == "sp" else x
        if variant == "sp":
            inp = DTensor.from_local(inp, mesh, [Shard(1)]).to_local()
        got = saves(block, inp, names._pack)
    finally:
        names.stop()
    split = {}
    for ptr, _, _, _, i in names.obs:
        split[ptr] = names.table[i][6]
    owner = {ptr: names.table[i][2] for ptr, _, _, _, i in names.obs}
    rows = [[t[1] // g[1] if g[1] else 0, split.get(g[0], -1), owner.get(g[0]), g[2]]
            for t, g in zip(truth, got)]
    print(json.dumps({"saves": [len(truth), len(got)], "rows": rows}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
