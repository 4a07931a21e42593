"""fsdp.unsharded_params_not_resharded (the seed bug): parameters unsharded in backward and never
resharded, proven on real recordings of the bundled example (`buggy` vs `fixed`), on edited copies
that release them only when backward ends, and on CUDA-shaped copies (no backward frames)."""

from __future__ import annotations

import pytest
from edits import cuda_shaped
from findings import FSDP_CONFIGURATION, fired

from snapforensics.analysis import diagnose
from snapforensics.analysis.context import analyse
from snapforensics.analysis.rules.fsdp_reshard import RULE
from snapforensics.snapshot import normalize, read_raw

slow = pytest.mark.slow


@slow
def test_buggy_run_names_the_seed_bug(diagnosed):
    d = diagnosed("buggy")
    assert RULE.id in fired(d, "anomalous")
    f = next(f for f in d.findings if f.rule == RULE.id)
    assert f.bytes > 0 and f.blocks > 0
    assert "set_reshard_after_backward(True)" in f.fix
    # Evidence names the FSDP units and a stack through the unshard path.
    mods = [m["module"] for m in f.evidence["modules"]]
    assert any(m != "(unknown module)" for m in mods), mods
    assert f.evidence["stacks"] and f.evidence["stacks"][0]["stack"]
    assert set(f.evidence["by_path"]) <= {"forward", "backward_pre_hook", "recompute",
                                           "prefetch", "explicit"}
    assert {"recompute", "backward_pre_hook"} & set(f.evidence["by_path"])
    # Backward peaks well above forward: the symptom of the bug report.
    assert d.peaks["backward_bytes"] > 1.2 * d.peaks["forward_bytes"]


@slow
def test_predicted_peak_matches_the_fixed_run(diagnosed):
    bug = diagnosed("buggy")
    fix = diagnosed("fixed")
    f = next(f for f in bug.findings if f.rule == RULE.id)
    measured = fix.peaks["overall_bytes"]
    assert f.predicted_peak_bytes < bug.peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10, (
        f.predicted_peak_bytes, measured, bug.peaks["overall_bytes"])


@slow
@pytest.mark.parametrize("variant", ["nested", "noac"])
def test_healthy_layouts_get_no_reshard_anomaly(diagnosed, variant):
    d = diagnosed(variant)
    assert RULE.id not in fired(d), [f.rule for f in d.findings]


@slow
def test_seed_bug_fires_only_the_seed_rule(diagnosed):
    d = diagnosed("buggy")
    assert RULE.id in fired(d, "anomalous")
    assert not fired(d) & FSDP_CONFIGURATION, [(f.rule, f.cause) for f in d.findings]


@pytest.mark.slow
@pytest.mark.parametrize("annotations", [True, False])
def test_seed_bug_found_without_backward_frames(recording, annotations):
    raw, _ = read_raw(recording("buggy"))
    shaped = cuda_shaped(raw, annotations)
    frameless = sum(1 for e in shaped["device_traces"][0]
                    if e["action"] == "alloc" and not e.get("frames"))
    assert frameless > 100  # the edit really removed backward frames
    bug = diagnose(normalize(shaped, source="cuda-shaped-buggy.pickle"))
    fixed = diagnose(normalize(cuda_shaped(read_raw(recording("fixed"))[0], annotations),
                               source="cuda-shaped-fixed.pickle"))
    assert RULE.id in {f.rule for f in bug.anomalies}
    assert not fixed.anomalies, [f.rule for f in fixed.anomalies]
    f = next(f for f in bug.findings if f.rule == RULE.id)
    measured = fixed.peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10
    # backward is still seen as backward, and iterations are still found
    assert bug.peaks["backward_bytes"] > bug.peaks["forward_bytes"]
    assert len(bug.primary.iterations) == 3


def freed_at_backward_end(path) -> tuple[dict, int]:
    """Edit a recording: every leaked unsharded-parameter free moves to the last row of its
    iteration's backward (what the root's final callback does to units nested in a checkpointed
    region that the recompute re-unsharded: nothing outlives backward, memory still climbs)."""
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
def test_released_only_at_backward_end_is_still_anomalous(recording):
    buggy, fixed = recording("buggy"), recording("fixed")
    raw, moved = freed_at_backward_end(buggy)
    assert moved > 10
    d = diagnose(normalize(raw, source="edited-buggy.pickle"))
    f = next((f for f in d.anomalies if f.rule == RULE.id), None)
    assert f is not None, [x.rule for x in d.findings]
    # It grows through backward: more than a few units' worth alive at once.
    assert len(f.evidence["modules"]) >= 4
    measured = diagnose(normalize(read_raw(fixed)[0])).peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]


def test_released_at_backward_end_without_unit_names(fixtures_dir):
    """Same edit on the committed fixture, also CUDA-shaped with no annotations: no unit names,
    so reductions are counted as runs of reduce-scatter allocations."""
    raw, moved = freed_at_backward_end(fixtures_dir / "fsdp2_ckpt_buggy_rank0.pickle.gz")
    assert moved > 10
    d = diagnose(normalize(cuda_shaped(raw, annotations=False)))
    f = next((f for f in d.anomalies if f.rule == RULE.id), None)
    assert f is not None, [x.rule for x in d.findings]
    assert {m["module"] for m in f.evidence["modules"]} == {"(unknown module)"}
    fixed = diagnose(normalize(cuda_shaped(
        read_raw(fixtures_dir / "fsdp2_ckpt_fixed_rank0.pickle.gz")[0], annotations=False)))
    assert not fixed.anomalies
    measured = fixed.peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10
