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

from snapforensics.analysis.rules import fsdp_mixed_precision
from snapforensics.analysis.rules.fsdp_reshard_after_forward import RULE
from snapforensics.analysis.vocab import Category

slow = pytest.mark.slow


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
    # FSDP1 names no unit (naming from module frames was tried and removed, docs/rules.md):
    # the units are its flat parameters, the root is the first one and the last block is not
    # counted.
    assert f.evidence["named_units"] == 0 and f.evidence["units_kept"] == 5
    assert "_alloc_padded_unsharded_flat_param" in " ".join(f.evidence["stacks"][0]["stack"])
    assert "FULL_SHARD" in f.fix
    # bf16 params, fp32 reduce: the cast of the grad to fp32 and the `_mp_shard` copies
    m = finding(d, fsdp_mixed_precision.RULE.id)
    assert {"reduce_in_higher_precision", "low_precision_shard_copies"} <= set(m.evidence["parts"])
    assert m.evidence["parts"]["low_precision_shard_copies"]["blocks"] >= 7  # one per unshard
    assert not d.anomalies, [(x.rule, x.cause) for x in d.anomalies]
