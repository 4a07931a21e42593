"""The tensor-parallel categories (`tp.all_gather`, `tp.reduce_scatter`, `tp.all_reduce`), on real
2-rank DTensor runs (gloo) recorded by the project's recorder (snapforensics/examples/tp.py:
ColwiseParallel/RowwiseParallel on attention and MLP, SequenceParallel on the norms with --sp,
and FSDP2 on a 2-D dp x tp mesh with --dp 2 on 4 ranks). The truth is read from the running
mesh and model (tp/dp degree, SP, the shapes the blocks hold); the expected collectives follow
from the plan: without SP each RowwiseParallel output (attention.wo, feed_forward.w2) is an
all-reduce of the full (batch, seq, dim) activation; with SP it is a reduce-scatter and each
PrepareModuleInput all-gathers the sequence back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from snapforensics.analysis.context import analyse
from snapforensics.analysis.vocab import CAT_CODE, Category, Phase
from snapforensics.snapshot import load

slow = pytest.mark.slow
MODULE = "snapforensics.examples.tp"
SMALL = ("--layers", "2", "--dim", "64", "--seq", "64", "--batch", "2", "--steps", "2")


def _run(args: tuple[str, ...], nproc: int = 2):
    from recordings import recorded_module

    folder = recorded_module(MODULE, (*SMALL, *args), nproc)
    for r in range(nproc):
        truth = json.loads((folder / f"truth.rank{r}.json").read_text())
        snap = load(folder / f"rank{r}.pickle")
        yield analyse(snap, snap.active_traces[0]), truth


def _blocks(d, cat: Category, phase: Phase | None = None) -> np.ndarray:
    m = d.category == CAT_CODE[cat]
    if phase is not None:
        m &= d.phase == phase
    return d.lt.size[m]


@slow
@pytest.mark.parametrize("sp", (False, True), ids=("tp", "tp_sp"))
def test_tp_collectives_are_named_from_dtensor_frames(sp):
    for d, truth in _run(("--sp",) if sp else ()):
        assert truth["tp"] == 2 and truth["dp"] == 1 and truth["sp"] is sp
        full = truth["batch"] * truth["seq"] * truth["dim"] * 4  # one float32 activation
        per_run = 2 * truth["layers"] * 2  # two RowwiseParallel outputs per block, two steps
        ar = _blocks(d, Category.TP_ALL_REDUCE, Phase.FORWARD)
        ag = _blocks(d, Category.TP_ALL_GATHER, Phase.FORWARD)
        rs = _blocks(d, Category.TP_REDUCE_SCATTER, Phase.FORWARD)
        if not sp:
            assert sorted(ar.tolist()) == [full] * per_run
            assert len(ag) == len(rs) == 0
        else:
            assert len(ar) == 0
            # the gathered sequence (full) and its shard (full / tp), per PrepareModuleInput
            assert set(ag.tolist()) <= {full, full // truth["tp"]}
            assert int((ag == full).sum()) >= per_run
            assert set(rs.tolist()) <= {full, full // truth["tp"]} and len(rs) >= per_run
            # and backward's redistributions (the reverse collectives)
            assert len(_blocks(d, Category.TP_ALL_GATHER, Phase.BACKWARD)) > 0
        # no DTensor collective is an FSDP buffer (a reduce-scatter was, before `tp.*`)
        assert not (d.category == CAT_CODE[Category.REDUCE_SCATTER]).any()
        # no TP block is `other`: every block whose stack holds a placement collective is tp.*
        for b in np.flatnonzero(d.category == CAT_CODE[Category.OTHER]):
            frames = d.snapshot.stack_frames(int(d.lt.stack[b])) if d.lt.stack[b] >= 0 else []
            assert not any(f.filename.endswith("distributed/tensor/placement_types.py")
                           for f in frames)


@slow
def test_fsdp2_on_a_2d_mesh_keeps_fsdp_and_tp_apart():
    for d, truth in _run(("--sp", "--dp", "2"), nproc=4):
        assert truth["tp"] == 2 and truth["dp"] == 2
        assert len(_blocks(d, Category.TP_ALL_GATHER, Phase.FORWARD)) > 0
        assert len(_blocks(d, Category.TP_REDUCE_SCATTER, Phase.FORWARD)) > 0
        assert len(_blocks(d, Category.ALL_GATHER)) + len(_blocks(d, Category.UNSHARDED_PARAM)) > 0
        assert len(_blocks(d, Category.REDUCE_SCATTER)) > 0
