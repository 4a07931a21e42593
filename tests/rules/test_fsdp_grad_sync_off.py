"""fsdp.gradient_sync_disabled: unsharded grads held across micro-batches, on a real recording."""

from __future__ import annotations

import pytest
from findings import finding, fired

from snapforensics.analysis.rules.fsdp_grad_sync_off import RULE

slow = pytest.mark.slow


@slow
def test_gradient_sync_off_holds_unsharded_grads_across_micro_batches(diagnosed):
    d = diagnosed("no_grad_sync")
    f = finding(d, RULE.id)
    assert f.verdict == "expected"
    # the whole model's unsharded fp32 grads (~76 MiB) held into the next micro-batch
    assert f.bytes >= 0.8 * f.evidence["gathered_param_bytes"]
    assert f.evidence["released_in_iteration"] == f.evidence["iteration"] + 1
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert f.saving_bytes > 0
    assert "set_requires_gradient_sync(True)" in f.fix
    assert not fired(d, "anomalous")
