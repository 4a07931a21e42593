"""leak.iteration_growth: memory at the same point of every iteration keeps growing, on a real
recording (`leak`: the loop keeps loss/logits/softmax with their graphs) and on a real leak in the
corpus (torch_npu memory_leaks_demo.py)."""

from __future__ import annotations

import pytest
from corpus import corpus_file
from findings import one

from snapforensics.analysis import diagnose
from snapforensics.analysis.rules.leak_iteration_growth import RULE
from snapforensics.snapshot import load

NPU_LEAK = "MemSnapDump_snapshot_expandable.pkl"  # torch_npu memory_leaks_demo.py


@pytest.mark.slow
def test_leak_variant_is_an_iteration_growth_leak(diagnosed):
    d = diagnosed("leak")
    f = one(d, RULE.id)
    assert f.verdict == "anomalous"
    ev = f.evidence
    # per step the loop keeps logits and the softmax its statistic's graph saved:
    # two batch x seq x vocab fp32 tensors = 2 x 512 KiB, plus two scalars
    assert 1 << 20 <= ev["growth_per_iteration_bytes"] < (1 << 20) + 4096, ev
    starts = ev["live_at_iteration_start_bytes"]
    assert len(starts) == 3 and starts[0] < starts[1] < starts[2]
    assert f.bytes >= 2 << 20 and f.blocks >= 4  # two steps' worth retained by step 3
    stacks = [line for s in ev["stacks"] for line in s["stack"]]
    assert any("fsdp_ckpt.py" in line for line in stacks), stacks
    assert any("fsdp_ckpt.py" in u for u in ev["user_code"])
    assert ".item()" in f.fix and ".detach()" in f.fix
    # freeing each step's retained blocks gives the healthy configuration's peak
    healthy = diagnosed("fixed").peaks["overall_bytes"]
    assert f.saving_bytes > 0
    assert abs(f.predicted_peak_bytes - healthy) / healthy < 0.01, (f.predicted_peak_bytes,
                                                                    healthy)


def test_real_leak_in_the_corpus():
    d = diagnose(load(corpus_file(NPU_LEAK)))
    f = one(d, RULE.id)
    assert f.evidence["growth_per_iteration_bytes"] == 40 << 20
    assert any("memory_leaks_demo.py" in u for u in f.evidence["user_code"])
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
