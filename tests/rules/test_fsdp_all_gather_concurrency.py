"""fsdp.too_many_concurrent_all_gathers: prefetch lists reaching three units ahead, on a real
recording (`no_rate_limit`), its predicted peak and saving checked against `fixed`."""

from __future__ import annotations

import pytest
from findings import FSDP_CONFIGURATION, finding, fired, near

from snapforensics.analysis.rules.fsdp_all_gather_concurrency import RULE

slow = pytest.mark.slow


@slow
def test_prefetching_three_units_ahead_is_too_many_all_gathers(diagnosed):
    d = diagnosed("no_rate_limit")
    f = finding(d, RULE.id)
    assert f.verdict == "anomalous"
    assert f.evidence["max_in_flight"] == 4
    assert f.evidence["excess_bytes"] >= 2 * 12 * 2**20
    assert "set_modules_to_forward_prefetch" in f.fix
    # Rate-limited to two in flight: about `fixed` (same layout, default prefetch).
    measured = diagnosed("fixed").peaks["overall_bytes"]
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert near(f.predicted_peak_bytes, measured), (f.predicted_peak_bytes, measured)
    # The saving itself, not only the peak (a no-change prediction is within 10% of the peak):
    # measured 207.3 -> 194.8 MiB; predicted 16.3 MiB (the replay frees units at the rows the
    # trace shows, a little earlier than a rate-limited run would).
    saving = d.peaks["overall_bytes"] - measured
    assert near(f.saving_bytes, saving, 0.35), (f.saving_bytes, saving)
    assert not fired(d) & (FSDP_CONFIGURATION - {RULE.id})
