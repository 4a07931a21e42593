"""The seed bug must be found in CUDA-shaped traces too, where backward ops have no Python frames.

On CUDA the autograd engine runs backward on a device thread: an allocation made by a backward
op has no Python frames at all, and one made inside a hook (FSDP pre/post-backward, the
checkpoint unpack hook) only has the hook's own frames, not `loss.backward()`'s. Profiler op,
module and record_function frames do not exist either; the ranges come as
`external_annotations`. We make such a trace from a real recording of ours: every stack is cut at
the autograd engine boundary and stripped of non-Python frames (this is an edited recording).
"""

from __future__ import annotations

import pytest
from recordings import recorded  # noqa: E402

from snapforensics.analysis import diagnose
from snapforensics.snapshot import normalize, read_raw

RESHARD = "fsdp.unsharded_params_not_resharded"
ENGINE = {"_engine_run_backward", "run_backward"}
PSEUDO = ("<op>", "<record_function>", "<nn.Module>", "<snapforensics>")


def cuda_shaped(raw: dict, annotations: bool = True) -> dict:
    cache: dict[int, list] = {}

    def cut(frames):
        if not frames:
            return frames
        key = id(frames)
        if key not in cache:
            names = [f["name"] for f in frames]
            in_bw = any(n in ENGINE for n in names) or any(
                n.startswith("autograd::engine::evaluate_function") for n in names)
            out = []
            for f in frames:  # innermost first; stop at the engine boundary
                if in_bw and (f["name"].startswith("autograd::engine::") or f["name"] in ENGINE):
                    break
                if f["filename"] not in PSEUDO:
                    out.append(f)
            cache[key] = out
        return cache[key]

    for trace in raw["device_traces"]:
        for e in trace:
            if "frames" in e:
                e["frames"] = cut(e["frames"])
    for seg in raw["segments"]:
        seg["frames"] = cut(seg.get("frames"))
        for b in seg["blocks"]:
            b["frames"] = cut(b.get("frames"))
    if not annotations:
        raw.pop("external_annotations", None)
    raw.pop("snapforensics", None)  # look like a foreign file: no provenance
    return raw


@pytest.fixture(scope="module")
def rank0(tmp_path_factory):
    pytest.importorskip("torch")
    return {v: recorded(v, tmp_path_factory)[0] for v in ("buggy", "fixed")}


@pytest.mark.slow
@pytest.mark.parametrize("annotations", [True, False])
def test_seed_bug_found_without_backward_frames(rank0, annotations):
    raw, _ = read_raw(rank0["buggy"])
    shaped = cuda_shaped(raw, annotations)
    frameless = sum(1 for e in shaped["device_traces"][0]
                    if e["action"] == "alloc" and not e.get("frames"))
    assert frameless > 100  # the edit really removed backward frames
    bug = diagnose(normalize(shaped, source="cuda-shaped-buggy.pickle"))
    fixed = diagnose(normalize(cuda_shaped(read_raw(rank0["fixed"])[0], annotations),
                               source="cuda-shaped-fixed.pickle"))
    assert RESHARD in {f.rule for f in bug.anomalies}
    assert not fixed.anomalies, [f.rule for f in fixed.anomalies]
    f = next(f for f in bug.findings if f.rule == RESHARD)
    measured = fixed.peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10
    # backward is still seen as backward, and iterations are still found
    assert bug.peaks["backward_bytes"] > bug.peaks["forward_bytes"]
    assert len(bug.primary.iterations) == 3
