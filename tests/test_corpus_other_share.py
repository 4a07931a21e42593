"""The share of peak bytes in `other` on every real corpus file with frames (issue 28): at most
5%, or a listed exception whose remaining `other` is unknowable from its frames.

An exception is justified here, not just asserted: each of its `other` blocks alive at the peak
has frames only from the user's own script and plain tensor libraries (torch's own functions,
einops), with no module call, autograd, optimizer, framework or distributed frame that a
category could key on; its measured share is pinned (within half a point) so a change in
classification updates this list. The figures are those benchmarks/bench_other_share.py prints.
"""

from __future__ import annotations

import numpy as np
import pytest
from corpus import CORPUS, corpus_files

from snapforensics.analysis.context import analyse
from snapforensics.analysis.vocab import CAT_CODE, Category
from snapforensics.snapshot import load

FILES = corpus_files()
if not FILES:
    pytest.skip(f"snapshot corpus not found at {CORPUS}", allow_module_level=True)

GOAL = 0.05
# (file, device): measured share of the peak in `other`, and why it is unknowable
EXCEPTIONS = {
    # generate_counterfactuals (counterfactuals.py:102), called from <module>: no model call
    ("JasperSolt_snapshot.pickle", 0): 0.145,
    # memory_leaks_demo.py's train_one_step (line 11/12: 120 MiB) called from train/main: the
    # demo's leaked tensors; the stack shows no module, backward or optimizer frame
    ("MemSnapDump_snapshot_expandable.pkl", 0): 0.212,
    ("MemSnapDump_snapshot_with_empty_cache.pkl", 0): 0.212,
    ("MemSnapDump_snapshot_with_multi_devices.pkl", 0): 0.212,  # synthetic merge of the above
    # (silmont2000_mem_snapshot: 17.1% until a block made before any forward and freed by a
    # backward was taken for the activation it is; 0.5% now, test below)
    # SYNTHETIC (mosaic's generate_snapshot.py): fake frames bar/foo/baz in /path/to/*.py
    ("mosaic_output.pickle", 0): 1.0,
}
# what a category keys on, none of which an exception's `other` stack may show
_MARKERS = ("site-packages/torch/nn/", "torch/autograd", "torch/optim/", "torch/distributed/",
            "torch/_tensor.py", "<nn.Module>", "transformers/", "accelerate/", "lightning",
            "deepspeed/", "megatron/", "diffusers/", "torchtitan/", "apex/")
_LIBRARIES = ("torch/functional.py", "einops/")


def _at_peak(path):
    snap = load(path)
    for t in snap.active_traces:
        d = analyse(snap, t)
        if not len(d.lt) or not any(i.has_frames for i in d.infos):
            continue
        alive = np.flatnonzero(d.lt.alive_at(d.peak_row))
        other = alive[d.category[alive] == CAT_CODE[Category.OTHER]]
        peak = int(np.asarray(d.lt.size[alive]).sum())
        yield t.device, d, peak, other


CASES = [(p, dev, d, peak, other) for p in FILES for dev, d, peak, other in _at_peak(p)]


@pytest.mark.parametrize("path,dev,d,peak,other", CASES,
                         ids=[f"{c[0].name}-{c[1]}" for c in CASES])
def test_other_share_at_peak(path, dev, d, peak, other):
    share = int(np.asarray(d.lt.size[other]).sum()) / peak if peak else 0.0
    known = EXCEPTIONS.get((path.name, dev))
    if known is None:
        assert share <= GOAL, (path.name, dev, share)
        return
    assert abs(share - known) <= 0.005, (path.name, dev, share, known)
    for b in other.tolist():
        frames = d.stack_text(int(d.lt.stack[b]), 64)
        text = " ".join(frames)
        assert not any(m in text for m in _MARKERS), (path.name, text)
        # every frame is the user's own code or a plain tensor library it called
        assert all(not ("site-packages/" in f or "dist-packages/" in f) or
                   any(lib in f for lib in _LIBRARIES) for f in frames), (path.name, text)


def test_every_exception_is_measured():
    measured = {(c[0].name, c[1]) for c in CASES}
    present = {k for k in EXCEPTIONS if (CORPUS / k[0]).is_file()}
    assert present <= measured


def test_a_block_a_backward_frees_is_an_activation_without_a_module_call():
    """silmont2000's attention is plain functions (no nn.Module: no forward phase to mark it).
    Of the 512 MiB blocks the script makes, those the autograd engine frees (by the file's own
    free rows' C++ frames: `torch::autograd::Engine`) are what a forward saved for the backward,
    activations; those the script itself frees stay `other` (they were all `other`: 17.1% of
    the peak)."""
    path = next((p for p in FILES if p.name == "silmont2000_mem_snapshot.pickle"), None)
    if path is None:
        pytest.skip("silmont2000_mem_snapshot.pickle not in the corpus")
    snap = load(path)
    (t,) = snap.active_traces
    d = analyse(snap, t)
    def engine(row: int) -> bool:
        return any("torch::autograd::Engine" in f.name for f in
                   snap.stack_frames(int(t.stack[row])))

    big = np.flatnonzero((d.lt.size == 512 << 20) & (d.lt.free_row < d.lt.rows))
    # made by the script (not by a backward), freed by the engine or by the script
    by_engine = {int(b): engine(d.lt.free_row[b]) for b in big.tolist()
                 if not engine(d.lt.alloc_row[b])}
    assert any(by_engine.values()) and not all(by_engine.values()), by_engine
    for b, engine in by_engine.items():
        want = Category.ACTIVATION if engine else Category.OTHER
        assert d.category_names[d.category[b]] == want, (b, engine)
