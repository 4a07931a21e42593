"""The committed real recordings (fixtures/): the seed bug story without torch installed."""

from __future__ import annotations

from pathlib import Path

import pytest
from edits import cuda_shaped

from snapforensics.analysis import diagnose
from snapforensics.analysis.rules import fsdp_reshard
from snapforensics.snapshot import load, normalize, read_raw

RESHARD = fsdp_reshard.RULE.id

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def pair():
    return {v: diagnose(load(FIXTURES / f"fsdp2_ckpt_{v}_rank0.pickle.gz"))
            for v in ("buggy", "fixed")}


def test_fixture_story(pair):
    bug, fix = pair["buggy"], pair["fixed"]
    assert bug.rank == 0 and bug.format["backend"] == "cpu"
    assert RESHARD in {f.rule for f in bug.anomalies}
    assert not fix.anomalies, [f.rule for f in fix.anomalies]
    f = next(f for f in bug.anomalies if f.rule == RESHARD)
    measured = fix.peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10
    assert bug.peaks["backward_bytes"] > 1.2 * bug.peaks["forward_bytes"]


@pytest.mark.parametrize("annotations", [True, False])
def test_fixture_cuda_shaped(annotations):
    """The same story when backward ops have no Python frames (edited fixture)."""
    shaped = {v: diagnose(normalize(cuda_shaped(
        read_raw(FIXTURES / f"fsdp2_ckpt_{v}_rank0.pickle.gz")[0], annotations)))
        for v in ("buggy", "fixed")}
    f = next(f for f in shaped["buggy"].anomalies if f.rule == RESHARD)
    measured = shaped["fixed"].peaks["overall_bytes"]
    assert not shaped["fixed"].anomalies
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10
