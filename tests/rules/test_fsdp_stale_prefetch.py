"""fsdp.stale_prefetch_all_gather: all-gathers issued during backward by a recompute's forward
prefetch and never used, on a real recording (`prefetch_in_recompute`), its predicted peak
checked against the same layout without prefetch lists (`nested`)."""

from __future__ import annotations

import pytest
from findings import finding, fired, near

from snapforensics.analysis.rules import (
    fsdp_all_gather_concurrency,
    fsdp_double_all_gather,
    fsdp_reshard,
)
from snapforensics.analysis.rules.fsdp_stale_prefetch import RULE

slow = pytest.mark.slow


@slow
def test_forward_prefetch_in_recompute_leaves_stale_all_gathers(diagnosed):
    d = diagnosed("prefetch_in_recompute")
    f = finding(d, RULE.id)
    assert f.verdict == "anomalous"
    # one attention all-gather buffer per layer but the first, from the recompute's prefetch
    assert f.blocks >= 4 and f.bytes >= 4 * 4 * 2**20
    assert "prefetch" in f.evidence["by_path"]
    assert all(".attn" in m["module"] for m in f.evidence["modules"]), f.evidence["modules"]
    assert "_prefetch_unshard" in " ".join(f.evidence["stacks"][0]["stack"])
    # Without the buffers: the same layout without prefetch lists (`nested`).
    measured = diagnosed("nested").peaks["overall_bytes"]
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert near(f.predicted_peak_bytes, measured), (f.predicted_peak_bytes, measured)
    # Its prefetch lists reach two units ahead: three units in flight in forward, but rate
    # limiting them would not lower the peak (the stale buffers set it): info, not anomalous.
    c = finding(d, fsdp_all_gather_concurrency.RULE.id)
    assert c.evidence["max_in_flight_by_phase"]["forward"] == 3
    assert c.verdict == "info" and c.saving_bytes < 0.05 * d.peaks["overall_bytes"], c.saving_bytes
    assert fsdp_reshard.RULE.id not in fired(d) and fsdp_double_all_gather.RULE.id not in fired(d)
