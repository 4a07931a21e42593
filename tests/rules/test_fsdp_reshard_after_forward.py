"""fsdp.reshard_after_forward_disabled: units kept unsharded from forward to backward, on real
recordings (FSDP2 `reshard_after_forward=False`, FSDP1 SHARD_GRAD_OP), its predicted peak checked
against the recording with the fix (`fixed`)."""

from __future__ import annotations

import pytest
from findings import (
    FSDP_CONFIGURATION_ANOMALOUS,
    finding,
    fired,
    near,
)
from recordings import S_FSDP1

from snapforensics.analysis.rules import fsdp_mixed_precision
from snapforensics.analysis.rules.fsdp_reshard_after_forward import RULE
from snapforensics.analysis.vocab import Category

slow = pytest.mark.slow


def _path(variant):
    from recordings import recorded

    return recorded(variant, steps=2, extra=S_FSDP1)[0]


@slow
def test_reshard_after_forward_false_is_expected_with_its_cost(diagnosed):
    d = diagnosed("reshard_after_forward_false")
    f = finding(d, RULE.id)
    assert f.verdict == "expected"
    # 6 blocks of ~12 MiB kept from forward to backward; the root (FSDP keeps it by design) and
    # the last block (runs backward first) are not counted.
    mods = {m["module"] for m in f.evidence["modules"]}
    assert mods == {f"layers.{i}" for i in range(5)}, mods
    assert f.bytes >= 5 * 12 * 2**20
    assert "reshard_after_forward=True" in f.fix
    assert f.evidence["stacks"][0]["stack"]
    # Predicted: the same run with reshard_after_forward=True, i.e. `fixed`.
    measured = diagnosed("fixed").peaks["overall_bytes"]
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert f.saving_bytes > 0
    assert near(f.predicted_peak_bytes, measured), (f.predicted_peak_bytes, measured)
    assert not fired(d, "anomalous") & FSDP_CONFIGURATION_ANOMALOUS


@slow
def test_fsdp1_shard_grad_op_is_classified_and_keeps_params(diagnosed):
    d = diagnosed("fsdp1_shard_grad_op")
    totals = d.primary.categories_total
    for cat in (Category.UNSHARDED_PARAM, Category.ALL_GATHER, Category.REDUCE_SCATTER,
                Category.SHARDED_GRAD, Category.SHARDED_PARAM):
        assert totals.get(cat, {}).get("bytes", 0) > 0, (cat, totals)
    f = finding(d, RULE.id)
    assert f.verdict == "expected"
    # FSDP1 units named from the module frames (fsdp_units.name_fsdp1_units): the blocks kept,
    # the root (named by FSDP1's outermost wrapper) and the last block not counted.
    assert f.evidence["named_units"] == 5 and f.evidence["units_kept"] == 5
    assert {m["module"] for m in f.evidence["modules"]} == {f"Block_{i}" for i in range(5)}
    assert "_alloc_padded_unsharded_flat_param" in " ".join(f.evidence["stacks"][0]["stack"])
    assert "FULL_SHARD" in f.fix
    # bf16 params, fp32 reduce: the cast of the grad to fp32 and the `_mp_shard` copies
    m = finding(d, fsdp_mixed_precision.RULE.id)
    assert {"reduce_in_higher_precision", "low_precision_shard_copies"} <= set(m.evidence["parts"])
    assert m.evidence["parts"]["low_precision_shard_copies"]["blocks"] >= 7  # one per unshard
    assert not d.anomalies, [(x.rule, x.cause) for x in d.anomalies]


@slow
@pytest.mark.full  # FULL_SUITE's small FSDP1 runs (test_forecast's pairs)
def test_backward_prefetch_is_read_from_the_trace():
    """FSDP1 FULL_SHARD gathers a unit for backward on the prefetch path (`_prefetch_handle`)
    with BACKWARD_PRE (torch's default) and at its own pre-backward with `backward_prefetch=None`
    (accelerate's FSDP1 default); SHARD_GRAD_OP gathers nothing in backward: unknown."""
    from snapforensics.analysis.engine import diagnose_devices
    from snapforensics.snapshot import load

    def seen(variant):
        return diagnose_devices(load(_path(variant)))[1][0].fsdp.backward_prefetch

    assert seen("fsdp1") is True
    assert seen("fsdp1_no_prefetch") is False
    assert seen("fsdp1_shard_grad_op_fp32") is None


@slow
@pytest.mark.full
def test_fsdp1_prediction_with_and_without_backward_prefetch(diagnosed):
    """SHARD_GRAD_OP (fp32) shows no backward gather, so the finding predicts both: with FSDP's
    default prefetch (checked against `fsdp1`, FULL_SHARD + BACKWARD_PRE) and without (checked
    against `fsdp1_no_prefetch`), each within 5% of its measured twin."""
    kw = {"steps": 2, "extra": list(S_FSDP1)}
    f = finding(diagnosed("fsdp1_shard_grad_op_fp32", **kw), RULE.id)
    assert f.evidence["backward_prefetch"] == "unknown"
    with_pf = diagnosed("fsdp1", **kw).peaks["overall_bytes"]
    without = diagnosed("fsdp1_no_prefetch", **kw).peaks["overall_bytes"]
    assert without < with_pf  # one unit fewer gathered at a time
    assert near(f.predicted_peak_bytes, with_pf, 0.05), (f.predicted_peak_bytes, with_pf)
    no_pf = f.evidence["predicted_peaks_without_backward_prefetch"]["overall_bytes"]
    assert near(no_pf, without, 0.05), (no_pf, without)
    assert abs(no_pf - without) < abs(f.predicted_peak_bytes - without)
