"""The seed bug's other shape: parameters unsharded in backward released only when backward ends.

When units nested in a checkpointed region are re-unsharded by the recompute and the root's
final callback reshards them at the very end of backward, nothing outlives backward, yet memory
still climbs layer by layer through it. We make that trace by editing our own buggy recording:
every leaked unsharded-parameter free is moved to the last row of its iteration's backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from recordings import recorded  # noqa: E402
from test_cuda_like import cuda_shaped  # noqa: E402

from snapforensics.analysis import diagnose
from snapforensics.analysis.context import analyse
from snapforensics.analysis.rules import fsdp_reshard
from snapforensics.snapshot import normalize, read_raw

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def freed_at_backward_end(path) -> tuple[dict, int]:
    raw, _ = read_raw(path)
    snap = normalize(raw)
    d = analyse(snap, snap.traces[0])
    leaked = d.fsdp.leaked
    trace = raw["device_traces"][0]
    moves = {}  # row of a free entry -> row it moves before
    for b in leaked.tolist():
        it = d.tl.iteration_of(int(d.lt.alloc_row[b]))
        free = int(d.lt.free_row[b])
        assert free > it.backward_end  # the recording leaks past backward
        for r in range(free, min(free + 2, len(trace))):  # free_requested, free_completed
            if trace[r]["action"].startswith("free") and trace[r]["addr"] == int(d.lt.addr[b]):
                moves[r] = it.backward_end
    out = []
    by_target: dict[int, list] = {}
    for r, target in moves.items():
        moved = dict(trace[r])
        # it now happens at the target, in the target's context (time and stack)
        for key in ("time_us", "frames"):
            if key in trace[target]:
                moved[key] = trace[target][key]
        by_target.setdefault(target, []).append(moved)
    for r, e in enumerate(trace):
        out.extend(by_target.get(r, []))
        if r not in moves:
            out.append(e)
    raw["device_traces"][0] = out
    return raw, len(moves)


@pytest.mark.slow
def test_released_only_at_backward_end_is_still_anomalous(tmp_path_factory):
    pytest.importorskip("torch")
    buggy, fixed = (recorded(v, tmp_path_factory)[0] for v in ("buggy", "fixed"))
    raw, moved = freed_at_backward_end(buggy)
    assert moved > 10
    d = diagnose(normalize(raw, source="edited-buggy.pickle"))
    f = next((f for f in d.anomalies if f.rule == fsdp_reshard.RULE), None)
    assert f is not None, [x.rule for x in d.findings]
    # It grows through backward: more than a few units' worth alive at once.
    assert len(f.evidence["modules"]) >= 4
    measured = diagnose(normalize(read_raw(fixed)[0])).peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]


def test_released_at_backward_end_without_unit_names():
    """Same edit on the committed fixture, also CUDA-shaped with no annotations: no unit names,
    so reductions are counted as runs of reduce-scatter allocations."""
    raw, moved = freed_at_backward_end(FIXTURES / "fsdp2_ckpt_buggy_rank0.pickle.gz")
    assert moved > 10
    d = diagnose(normalize(cuda_shaped(raw, annotations=False)))
    f = next((f for f in d.anomalies if f.rule == fsdp_reshard.RULE), None)
    assert f is not None, [x.rule for x in d.findings]
    assert {m["module"] for m in f.evidence["modules"]} == {"(unknown module)"}
    fixed = diagnose(normalize(cuda_shaped(
        read_raw(FIXTURES / "fsdp2_ckpt_fixed_rank0.pickle.gz")[0], annotations=False)))
    assert not fixed.anomalies
    measured = fixed.peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10
