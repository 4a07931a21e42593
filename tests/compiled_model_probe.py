"""`torch.compile(model)` (not `model.compile()`) under the recorder's names
(tests/test_identity.py::test_torch_compile_of_the_model_runs_under_the_names): Dynamo inlines
global module hooks into the graph it traces, and the names' bookkeeping made it fail with
"... is already tracked for mutation" before the hooks stood aside while Dynamo traces. Prints
the parameter names the run recorded, one JSON list.

    python tests/compiled_model_probe.py {eager|aot_eager}
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn as nn

from snapforensics.record.identity import TensorNames


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def main(backend: str) -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = TensorNames(model, opt)
    names.start()
    try:
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):
            compiled(torch.randn(2, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        names.stop()
    print(json.dumps(sorted({e[0] for e in names.table if e[1] == "parameter"})))


if __name__ == "__main__":
    main(sys.argv[1])
