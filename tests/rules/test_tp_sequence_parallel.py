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


def _finding(path):
    import snapforensics as sf
    from snapforensics.analysis.rules.tp_sequence_parallel import RULE

    report = sf.diagnose(path)
    return next((f for f in report.diagnosis.findings if f.rule == RULE.id), None), report


# the layout the replay was built on (the example's defaults), a held-out one, and FSDP2 + TP on
# a 2-D mesh (dp_shard 2 x tp 2 on 4 ranks: the TP degree is its mesh group's, not the world
# size; an MLP weight's unsharded TP shard there is as large as one activation): the layout the
# reduce-scatter's transients were fitted on (SMALL) and one they were not
HELD_OUT = ("--layers", "3", "--dim", "96", "--seq", "96", "--batch", "3")
PAIRS = (((), 2), (HELD_OUT, 2), ((*SMALL, "--dp", "2"), 4), ((*HELD_OUT, "--dp", "2"), 4))


@slow
@pytest.mark.parametrize(("args", "nproc"), PAIRS,
                         ids=("tuned", "held_out", "fsdp_tp_2d", "fsdp_tp_2d_held_out"))
def test_sequence_parallel_off_predicts_the_sp_twins_peak(args, nproc):
    from recordings import recorded_module

    off = recorded_module(MODULE, args, nproc)
    on = recorded_module(MODULE, (*args, "--sp"), nproc)
    for r in range(nproc):
        t_off = json.loads((off / f"truth.rank{r}.json").read_text())
        t_on = json.loads((on / f"truth.rank{r}.json").read_text())
        assert not t_off["sp"] and t_on["sp"]
        assert t_off["tp"] * t_off["dp"] == nproc
        # the truth: without SP every saved tensor holds the full sequence, with SP some are
        # sequence shards
        assert sum(b["seq_sharded"] for b in t_off["saved_per_block"]) == 0
        assert sum(b["seq_sharded"] for b in t_on["saved_per_block"]) > 0
        f, rep = _finding(off / f"rank{r}.pickle")
        assert f is not None and f.verdict == "anomalous"
        twin = sf_peak(on / f"rank{r}.pickle")
        assert twin < sf_peak(off / f"rank{r}.pickle")  # SP lowers this run's peak
        assert f.evidence["tp_degree"] == t_off["tp"]  # from the mesh, not the world size
        print(f"rank {r}: predicted {f.predicted_peak_bytes:,} B, SP twin {twin:,} B "
              f"({(f.predicted_peak_bytes - twin) / twin:+.1%})")
        assert abs(f.predicted_peak_bytes - twin) / twin < 0.05, (f.predicted_peak_bytes, twin)
        assert "SequenceParallel()" in f.fix and "enable_sequence_parallel" in f.fix
        # the SP twin gets no finding
        assert _finding(on / f"rank{r}.pickle")[0] is None


def sf_peak(path) -> int:
    snap = load(path)
    return analyse(snap, snap.active_traces[0]).peak_bytes


@slow
def test_layernorm_and_gathered_head_predict_the_sp_twins_peak():
    """tests/gpt_tp.py (LayerNorm, SDPA, a ColwiseParallel head whose logits are gathered): with
    SP the column-wise projections and the head read their input all-gathered back to the full
    sequence and keep that copy for backward, so the norms' full outputs they read do not
    shrink. A LayerNorm makes its mean and rstd after its output (the norm's output is not the
    last block its module makes) and the head is no attention/MLP parent of a RowwiseParallel:
    read as shrinking, the forecast fell 7.0% under the twin."""
    from pathlib import Path

    from recordings import recorded_script

    script = Path(__file__).parent.parent / "gpt_tp.py"
    off, on = recorded_script(script, ()), recorded_script(script, ("--sp",))
    for r in range(2):
        f, _ = _finding(off / f"rank{r}.pickle")
        twin = sf_peak(on / f"rank{r}.pickle")
        assert f is not None and f.verdict == "anomalous"
        assert twin < sf_peak(off / f"rank{r}.pickle")
        print(f"rank {r}: predicted {f.predicted_peak_bytes:,} B, SP twin {twin:,} B "
              f"({(f.predicted_peak_bytes - twin) / twin:+.1%})")
        assert abs(f.predicted_peak_bytes - twin) / twin < 0.05, (f.predicted_peak_bytes, twin)
        assert _finding(on / f"rank{r}.pickle")[0] is None
