"""activations.checkpoint_finer_than_unit: checkpoint regions finer than the FSDP unit, on a real
recording (`ac_submodules`: `checkpoint_wrapper` on each block's attention and MLP under
`fully_shard(block)`), its predicted peak checked against the fixed twin (`fixed`: one
`checkpoint_wrapper` per block) recorded at the same batch; and the layouts with one region per
unit, or regions coarser than the unit (`nested`), get no finding."""

from __future__ import annotations

import pytest
from findings import found, near, one
from recordings import S_AC

from snapforensics.analysis.rules.activations_checkpoint_granularity import RULE

slow = pytest.mark.slow
AC = list(S_AC)  # 8 blocks of width 256, 8 x 256 tokens: activations set the peak


@slow
def test_sub_module_checkpoints_inside_each_unit_are_found_and_replayed(diagnosed):
    d = diagnosed("ac_submodules", extra=AC)
    f = one(d, RULE.id)
    ev = f.evidence
    # the 8 blocks, each recomputing its attention and its MLP separately
    assert ev["recompute_runs_per_unit"] == {f"layers.{i}": 2 for i in range(8)}, ev
    assert ev["units_per_iteration"] == {"0": 8, "1": 8, "2": 8}
    assert "every iteration" in f.cause
    # one checkpoint per block, measured: the predicted peak is the twin's (10%, as every rule)
    twin = diagnosed("fixed", extra=AC).peaks["overall_bytes"]
    assert near(f.predicted_peak_bytes, twin), (f.predicted_peak_bytes, twin)
    assert f.predicted_peak_bytes == d.peaks["overall_bytes"] - f.saving_bytes
    # the verdict follows the measured effect: the twin's peak is lower by more than the noise
    assert f.verdict == ("anomalous" if twin < 0.98 * d.peaks["overall_bytes"] else "info")
    assert "checkpoint_wrapper(layer)" in f.fix
    compile(f.fix, "<fix>", "exec")


@slow
def test_one_region_per_unit_or_coarser_is_not_flagged(diagnosed):
    for variant in ("fixed", "nested", "fsdp1", "buggy"):
        assert not found(diagnosed(variant), RULE.id), variant


@slow
def test_nothing_at_stake_where_finer_regions_do_not_set_the_peak(diagnosed):
    """At the example's default shapes (batch 2) parameters, gradients and optimizer state set
    the peak: the twin measures within re-recording noise (2%) of the finer layout, and the
    rule gives no finding, or an `info` one (measured: 205,605,372 B finer, 204,288,572 B twin,
    replay 207,178,812 B: no finding)."""
    d = diagnosed("ac_submodules")
    twin = diagnosed("fixed").peaks["overall_bytes"]
    assert abs(d.peaks["overall_bytes"] - twin) < 0.02 * twin
    assert all(f.verdict == "info" for f in found(d, RULE.id))


@slow
@pytest.mark.parametrize("annotations", [True, False])
def test_cuda_shaped_recording(recording, diagnosed, annotations):
    """The same run as CUDA would record it (edits.cuda_shaped: no op/module/record_function
    frames, stacks cut at the autograd engine): with FSDP2's ranges as annotations the units are
    placed and the finding is the same; without them no unit has a backward to count regions
    in, so no finding (not a wrong one)."""
    from edits import cuda_shaped

    from snapforensics.analysis import diagnose
    from snapforensics.snapshot import normalize, read_raw

    raw, _ = read_raw(recording("ac_submodules", extra=AC))
    d = diagnose(normalize(cuda_shaped(raw, annotations=annotations), source="ac_submodules"))
    fs = found(d, RULE.id)
    if not annotations:
        assert not fs
        return
    assert len(fs) == 1 and fs[0].verdict == "anomalous"
    twin = diagnosed("fixed", extra=AC).peaks["overall_bytes"]
    assert near(fs[0].predicted_peak_bytes, twin)
