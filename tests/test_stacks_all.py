"""`stacks="all"` dumps (torch's default) get the same phases, categories and verdicts as the
`stacks="python"` dumps of the same run.

Two ways to have both recordings of one run: the corpus's real CUDA `stacks="all"` dumps with
their python twin (`python_only`: the Python frames torch gathers for both settings), and the
committed real FSDP recordings made CUDA-shaped both ways (`cuda_shaped` / `cuda_all_shaped`:
our CPU recorder cannot make C++ frames, so they are added in the shapes the corpus dumps show).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from corpus import corpus_file, corpus_files
from edits import cuda_all_shaped, cuda_shaped, python_only

from snapforensics.analysis.context import analyse
from snapforensics.analysis.engine import diagnose_devices
from snapforensics.analysis.vocab import CAT_CODE, Category, Phase
from snapforensics.snapshot import normalize, read_raw


def _has_cpp(raw) -> bool:
    if not isinstance(raw, dict):
        return False
    return any("::" in f.get("name", "") for t in raw.get("device_traces", ())
               for e in t[:2000] for f in e.get("frames") or ())


def _judged(raw: dict, name: str):
    """(row phases, block categories, findings, peaks) of every device."""
    diag, analyses = diagnose_devices(normalize(raw, source=name), {})
    devices = [(d.device, d.tl.phase.copy(), d.category.copy(), len(d.tl.iterations))
               for d in analyses]
    findings = sorted((f.rule, str(f.verdict), f.bytes, f.predicted_peak_bytes)
                      for f in diag.findings)
    return devices, findings, diag.peaks


def _assert_same(a, b):
    (da, fa, pa), (db, fb, pb) = a, b
    assert len(da) == len(db)
    for (dev, ph_a, cat_a, it_a), (_, ph_b, cat_b, it_b) in zip(da, db):
        assert np.array_equal(ph_a, ph_b), (dev, int((ph_a != ph_b).sum()))
        assert np.array_equal(cat_a, cat_b), (dev, int((cat_a != cat_b).sum()))
        assert it_a == it_b
    assert fa == fb
    assert pa == pb


STACKS_ALL = [p for p in corpus_files() if p.suffix in (".pickle", ".pkl")
              and _has_cpp(read_raw(p)[0])]


@pytest.mark.parametrize("path", STACKS_ALL, ids=lambda p: p.name)
def test_corpus_stacks_all_judged_like_its_python_twin(path):
    raw, _ = read_raw(path)
    _assert_same(_judged(copy.deepcopy(raw), path.name),
                 _judged(python_only(raw), "python-" + path.name))


def test_corpus_has_stacks_all_dumps():
    corpus_file("notHanmin_memory_snapshot.pickle")
    assert len(STACKS_ALL) >= 8, [p.name for p in STACKS_ALL]


def test_backward_of_a_stacks_all_dump_is_gradients():
    """notHanmin (CS336 full step, torch 2.5-2.7, stacks="all"): every backward allocation is
    made by an autograd node on the engine's thread (C++ frames only)."""
    raw, _ = read_raw(corpus_file("notHanmin_memory_snapshot.pickle"))
    snap = normalize(raw)
    d = analyse(snap, snap.traces[0])
    bw = np.isin(d.phase, [Phase.BACKWARD, Phase.RECOMPUTE])
    grad = int(d.lt.size[bw & (d.category == CAT_CODE[Category.GRADIENT])].sum())
    other = int(d.lt.size[bw & (d.category == CAT_CODE[Category.OTHER])].sum())
    assert grad > 25 * 2**30 and other == 0, (grad, other)
    assert len(d.tl.iterations) == 1 and d.tl.iterations[0].backward_start > 0


def test_compiled_backward_is_backward():
    """bcrafton (torch.compile): the compiled backward's frames map to the user's `forward`
    lines; AOTAutograd's `CompiledFunction.backward` under them makes it backward (it read as a
    second forward: two iterations in a one-step file)."""
    raw, _ = read_raw(corpus_file("bcrafton_memory_snapshot.pickle"))
    for shaped in (copy.deepcopy(raw), python_only(raw)):
        snap = normalize(shaped)
        d = analyse(snap, snap.traces[0])
        rows = [r for r in range(len(d.trace)) if d.trace.stack[r] >= 0 and any(
            f.name == "_backward_impl" for f in snap.stack_frames(int(d.trace.stack[r])))]
        assert len(rows) > 500
        assert (d.tl.phase[rows] == Phase.BACKWARD).all()
        assert len(d.tl.iterations) == 1


@pytest.mark.parametrize("annotations", [True, False])
def test_fsdp_run_judged_alike_with_both_stack_settings(fixtures_dir, annotations):
    """The committed buggy/fixed FSDP2 + checkpoint recordings, CUDA-shaped with python stacks
    and with all stacks: same phases, categories, findings, verdicts and predicted peaks, and
    the seed bug still found in the buggy run only."""
    for variant in ("buggy", "fixed"):
        raw, _ = read_raw(fixtures_dir / f"fsdp2_ckpt_{variant}_rank0.pickle.gz")
        py = _judged(cuda_shaped(copy.deepcopy(raw), annotations), f"py-{variant}.pickle")
        full = cuda_all_shaped(copy.deepcopy(raw), annotations)
        cpp = sum(1 for e in full["device_traces"][0]
                  if any("autograd::Engine::" in f["name"] for f in e.get("frames") or ()))
        assert cpp > 100  # the edit really put backward rows on the engine's thread
        _assert_same(_judged(full, f"all-{variant}.pickle"), py)
        rules = {(f[0], f[1]) for f in py[1]}
        assert (("fsdp.unsharded_params_not_resharded", "anomalous") in rules) == \
            (variant == "buggy"), rules
