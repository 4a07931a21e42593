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
    # custom_softmax (trace_peak_memory.py:7: 512 MiB) and einsum under
    # custom_scaled_dot_product_attention, called as plain functions from main (no nn.Module)
    ("silmont2000_mem_snapshot.pickle", 0): 0.171,
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
