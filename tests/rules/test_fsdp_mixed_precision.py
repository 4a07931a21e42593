"""fsdp.mixed_precision_extras: reduce in fp32 with bf16 params, on a real recording."""

from __future__ import annotations

import pytest
from findings import finding, fired

from snapforensics.analysis.rules.fsdp_mixed_precision import RULE

slow = pytest.mark.slow


@slow
def test_mixed_precision_reduce_in_fp32_is_expected_with_its_cost(diagnosed):
    d = diagnosed("mixed_precision")
    f = finding(d, RULE.id)
    assert f.verdict == "expected"
    assert abs(f.evidence["reduce_to_param_dtype_ratio"] - 2.0) < 0.1
    assert {"reduce_in_higher_precision", "low_precision_shard_copies"} <= set(
        f.evidence["parts"])
    assert f.bytes > 0
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert "reduce_dtype=torch.bfloat16" in f.fix
    assert not fired(d, "anomalous")
