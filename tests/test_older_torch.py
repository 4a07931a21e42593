"""Recordings from torch 2.4-2.7: record_function ranges of the recording thread only.

Before `global_record_annotations` (torch 2.8) the allocator's RecordFunction callback is
thread local, so a CUDA recording keeps the ranges of the thread that started recording and
loses every range opened on the autograd engine's device thread: FSDP's pre/post-backward,
backward prefetch and final-callback ranges, and the pre-forward ranges of a recompute. It has
no `compile_context` either (torch 2.8). No torch 2.7 recording of an FSDP run exists here, so
this is a simulation, said plainly: real recordings of the bundled example (CPU recorder, gloo),
CUDA-shaped, with the ranges opened while `backward()` ran removed (`edits.
recording_thread_annotations`) and gloo's worker-thread staging buffers removed from both sides
(NCCL makes none). Phases, categories, findings, verdicts and predicted peaks must not change.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from edits import cuda_shaped, recording_thread_annotations, without_worker_blocks

from snapforensics.analysis.engine import diagnose_devices
from snapforensics.snapshot import normalize, read_raw


def _judged(raw: dict, name: str):
    diag, analyses = diagnose_devices(normalize(raw, source=name), {})
    d = analyses[0]
    findings = sorted((f.rule, str(f.verdict), f.bytes, f.predicted_peak_bytes)
                      for f in diag.findings)
    return d, findings, diag.peaks


def _both(path):
    raw, _ = read_raw(path)
    raw, workers = without_worker_blocks(raw)
    assert workers > 0  # the gloo run had them: the edit did something
    full = cuda_shaped(copy.deepcopy(raw), annotations=True)
    older, dropped = recording_thread_annotations(copy.deepcopy(raw))
    older = cuda_shaped(older, annotations=True)
    kept = {a["name"] for a in older["external_annotations"]}
    # the simulation really removed backward's ranges and kept forward's
    assert dropped > 20 and not any(n.startswith(("FSDP::pre_backward", "FSDP::post_backward"))
                                    for n in kept)
    assert any(n.startswith("FSDP::pre_forward (") for n in kept)
    return _judged(full, "full.pickle"), _judged(older, "torch27.pickle")


def _assert_same(a, b):
    (da, fa, pa), (db, fb, pb) = a, b
    assert np.array_equal(da.tl.phase, db.tl.phase)
    assert np.array_equal(da.category, db.category), int((da.category != db.category).sum())
    assert np.array_equal(da.path, db.path)
    assert fa == fb
    assert pa == pb


@pytest.mark.parametrize("variant", ["buggy", "fixed"])
def test_committed_recordings_judged_alike_without_backward_ranges(fixtures_dir, variant):
    full, older = _both(fixtures_dir / f"fsdp2_ckpt_{variant}_rank0.pickle.gz")
    _assert_same(full, older)
    rules = {(f[0], f[1]) for f in older[1]}
    assert (("fsdp.unsharded_params_not_resharded", "anomalous") in rules) == \
        (variant == "buggy")


@pytest.mark.slow
def test_concurrent_all_gathers_found_without_backward_ranges(recording):
    """Prefetching three units ahead: backward's gathers have no unit names, so each is matched
    to its own copy-out by size and order (all three matched the first one)."""
    full, older = _both(recording("no_rate_limit"))
    _assert_same(full, older)
    assert ("fsdp.too_many_concurrent_all_gathers", "anomalous") in {
        (f[0], f[1]) for f in older[1]}


@pytest.mark.parametrize("version, backend, says", [
    ("2.7.1+cu126", "cuda", "recording thread only (torch < 2.8"),
    ("2.8.0+cu128", "cuda", "every thread (global_record_annotations)"),
    ("2.13.0", "npu", "recording thread only (torch < 2.8, torch_npu)"),
    ("2.4.1", "cuda", None),  # with ranges in the file: recording thread only
])
def test_provenance_states_which_ranges_a_version_records(fixtures_dir, version, backend, says):
    from snapforensics.analysis import diagnose
    from snapforensics.report.common import provenance_line

    raw, _ = read_raw(fixtures_dir / "fsdp2_ckpt_buggy_rank0.pickle.gz")
    raw["snapforensics"].update(torch_version=version, backend=backend, cpu_recorded=False)
    d = diagnose(normalize(raw, source="rank0.pickle"))
    ranges = d.format["ranges"]
    assert ranges.startswith(says or "recording thread only ("), ranges
    assert ("record_function ranges: " in provenance_line(d)) == ranges.startswith("recording")
    raw.pop("external_annotations")
    d = diagnose(normalize(raw, source="rank0.pickle"))
    if version.startswith("2.4"):
        assert d.format["ranges"] == "none (torch < 2.5 records none)"


def test_provenance_of_cpu_and_foreign_files(fixtures_dir):
    from corpus import corpus_file

    from snapforensics.snapshot import load

    raw, _ = read_raw(fixtures_dir / "fsdp2_ckpt_fixed_rank0.pickle.gz")
    assert normalize(raw).format["ranges"] == "every thread (profiler)"
    # torch ~2.6 dumps with and without ranges, recorded by the user's own script
    assert load(corpus_file("kkaitlyn_ctx128_fullstep.pickle")).format["ranges"].startswith(
        "recording thread only, unless recorded with global_record_annotations=True")
    assert load(corpus_file("notHanmin_memory_snapshot_forward.pickle")).format["ranges"] == "none"


def test_recorder_asks_for_compile_context_where_torch_has_it():
    """torch 2.8+ takes `compile_context` (pytorch#152707) and `global_record_annotations`
    (#154932); 2.4-2.7 take neither. Only the keywords the signature has are passed."""
    import sys

    from snapforensics.record.backends import history_call

    def torch_2_7(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                  device=None, clear_history=False):
        pass

    def torch_2_13(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                   device=None, clear_history=False, compile_context=False,
                   global_record_annotations=False, skip_actions=None):
        pass

    _, new = history_call(torch_2_13, stacks="python", max_entries=5)
    assert new["compile_context"] is True and new["global_record_annotations"] is True
    _, old = history_call(torch_2_7, stacks="python", max_entries=5)
    assert "compile_context" not in old and "global_record_annotations" not in old
    torch = pytest.importorskip("torch")
    import inspect

    args, kw = history_call(torch.cuda.memory._record_memory_history, stacks="python",
                            max_entries=7)
    assert kw.get("compile_context") is True
    inspect.signature(torch.cuda.memory._record_memory_history).bind(*args, **kw)
