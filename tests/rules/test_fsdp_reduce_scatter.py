"""fsdp.reduce_scatter_accumulation: sharded gradients growing through backward are what sharded
gradients cost (`expected`), on real recordings of the bundled example."""

from __future__ import annotations

import pytest
from findings import fired

from snapforensics.analysis.rules.fsdp_reduce_scatter import RULE

slow = pytest.mark.slow


@slow
def test_expected_gradient_growth_is_not_an_anomaly(diagnosed):
    for variant in ("buggy", "fixed"):
        d = diagnosed(variant)
        assert RULE.id in fired(d, "expected"), variant
