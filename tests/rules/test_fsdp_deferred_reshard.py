"""fsdp.reshard_deferred_to_last_micro_batch: gradient accumulation done the documented way
(`set_reshard_after_backward(is_last)`), on real matrix recordings whose truth file says what FSDP
kept unsharded after each micro-batch's backward."""

from __future__ import annotations

import json

import pytest
from findings import finding, fired

from snapforensics.analysis import diagnose
from snapforensics.analysis.rules.fsdp_deferred_reshard import RULE
from snapforensics.snapshot import load

pytestmark = pytest.mark.slow


def _truth(folder):
    return json.loads((folder / "truth.rank0.json").read_text())


def test_kept_between_micro_batches_is_expected(matrix):
    t = _truth(matrix / "f2_ga_right")
    kept = [b["root"] + b["nonroot"] for b in t["backwards"] if not b["last"]]
    after_last = [b["root"] + b["nonroot"] for b in t["backwards"] if b["last"]]
    assert all(kept) and not any(after_last)  # what FSDP itself held: kept, then resharded
    d = diagnose(load(matrix / "f2_ga_right" / "rank0.pickle"))
    f = finding(d, RULE.id)
    assert f.verdict == "expected"
    # the non-root units' parameters (the root's are gathered in forward and kept by design)
    nonroot = max(b["nonroot"] for b in t["backwards"] if not b["last"])
    assert abs(f.bytes - nonroot) <= 0.1 * nonroot, (f.bytes, nonroot)
    assert "all-gathers" in f.cause and f.evidence["all_gather_bytes_saved_per_step"] > 0
    assert "fsdp.unsharded_params_not_resharded" not in fired(d)
    compile(f.fix, "<fix>", "exec")


def test_no_deferral_without_micro_batches(matrix):
    for name in ("f2_block_cw", "f2_block_cw_rab_false", "f2_ga_sync_only"):
        d = diagnose(load(matrix / name / "rank0.pickle"))
        assert RULE.id not in fired(d), name
