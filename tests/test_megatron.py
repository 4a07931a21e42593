"""Megatron-Core's own buffers, on real 2-rank runs of Megatron-Core's GPT (megatron-core
0.16.1's Python code, gloo on the CPU, snapforensics/examples/megatron_gpt.py) recorded by the
project's recorder: TP 2 with and without its sequence parallelism, Megatron's DDP with the
distributed optimizer (bf16 parameters, fp32 main-parameter shards), and its full activation
recompute as the checkpointing twin. The truth is read from the running DDP wrapper and
optimizer (the buffers' and main parameters' storages, address and bytes), never from what the
analyzer prints."""

from __future__ import annotations

import json

import numpy as np
import pytest

import snapforensics as sf
from snapforensics.analysis.context import analyse
from snapforensics.analysis.vocab import CAT_CODE, Category, Phase
from snapforensics.snapshot import load

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the test extra)")
slow = pytest.mark.slow
MODULE = "snapforensics.examples.megatron_gpt"
RUNS = {"tp2": (), "tp2_sp": ("--sp",), "tp2_recompute": ("--recompute",),
        "pp2": ("--tp", "1", "--pp", "2", "--layers", "4", "--micro-batches", "4"),
        # a layout the SP replay was not built on: 3 layers, hidden 96, sequence 32, batch 2
        "small": ("--layers", "3", "--dim", "96", "--seq", "32", "--batch", "2"),
        "small_sp": ("--layers", "3", "--dim", "96", "--seq", "32", "--batch", "2", "--sp")}


def _run(name: str):
    from recordings import recorded_module

    folder = recorded_module(MODULE, RUNS[name])
    out = []
    for r in (0, 1):
        snap = load(folder / f"rank{r}.pickle")
        out.append((folder / f"rank{r}.pickle", analyse(snap, snap.active_traces[0]),
                    json.loads((folder / f"truth.rank{r}.json").read_text())))
    return out


def _block_at(d, storage: dict) -> int:
    """The block the running tensor's storage is: the last one made at its address, of its
    size (the CPU recorder may place its free early: a worker's unseen drop of the same size can
    be matched to it, record/cpu.py `_match`; what made it is the question here)."""
    at = np.flatnonzero((d.lt.addr == storage["addr"]) & (d.lt.size == storage["bytes"]))
    assert len(at) >= 1, storage
    return int(at[np.argmax(d.lt.alloc_row[at])])


@slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_buffers_and_main_parameters_are_megatrons(name):
    for _, d, truth in _run(name):
        assert truth["tp"] * truth["pp"] == 2 and truth["param_buffers"] and truth["main_params"]
        for s in truth["param_buffers"] + truth["grad_buffers"]:
            assert d.category_names[d.category[_block_at(d, s)]] == Category.MEGATRON_BUFFER
        for s in truth["main_params"]:
            assert d.category_names[d.category[_block_at(d, s)]] == Category.MEGATRON_MAIN_PARAM
        # Megatron's collectives are c10d's too: none of them is taken for FSDP's
        names = {d.category_names[c] for c in np.unique(d.category).tolist()}
        assert not {n for n in names if n.startswith("fsdp.")}, names
        # and `other` holds at most 5% of the peak
        other = d.lt.alive_at(d.peak_row) & (d.category == CAT_CODE[Category.OTHER])
        assert int(d.lt.size[other].sum()) <= 0.05 * d.peak_bytes


@slow
def test_sequence_parallel_collectives_are_tensor_parallel():
    """SP on: each layer's norm runs on a sequence shard; the linear all-gathers its input
    (forward, and again in backward) and reduce-scatters the row-parallel output; off, none."""
    for _, d, truth in _run("tp2_sp"):
        assert truth["sp"]
        for cat in (Category.TP_ALL_GATHER, Category.TP_REDUCE_SCATTER):
            m = (d.category == CAT_CODE[cat]) & (d.phase == Phase.FORWARD)
            assert m.any(), cat
    for _, d, truth in _run("tp2"):
        assert not truth["sp"]
        for cat in (Category.TP_ALL_GATHER, Category.TP_REDUCE_SCATTER):
            assert not (d.category == CAT_CODE[cat]).any(), cat


@slow
def test_the_checkpointing_advice_speaks_megatron_and_predicts_its_recompute_twin():
    """No recompute: the finding's fix is Megatron's arguments, and its predicted peak is the
    peak of the same run with `recompute_granularity="full"` (per layer), within 5%; that twin's
    recompute (Megatron's CheckpointFunction.backward) is read as recompute."""
    twin = {r: d for r, (_, d, _) in enumerate(_run("tp2_recompute"))}
    for r, (path, d, _) in enumerate(_run("tp2")):
        rep = sf.diagnose(path)
        assert rep.diagnosis.framework["owner"] == "megatron"
        f = next(f for f in rep.diagnosis.findings if f.rule == "activations.no_checkpointing")
        assert "--recompute-granularity full" in f.fix and "recompute_num_layers=1" in f.fix
        peak = twin[r].peak_bytes
        assert peak < d.peak_bytes
        assert abs(f.predicted_peak_bytes - peak) / peak < 0.05, (f.predicted_peak_bytes, peak)
        rc = twin[r].category == CAT_CODE[Category.RECOMPUTE_ACTIVATION]
        assert rc.any() and (twin[r].phase[rc] == Phase.RECOMPUTE).all()


@slow
def test_what_a_pipeline_stage_receives_is_a_p2p_buffer_and_the_first_stage_is_expected():
    """Megatron's 1F1B over 2 stages, 4 micro-batches: every tensor a stage received from its
    neighbour (the running P2PCommunicator's return values) is a `pp.p2p_buffer` block, and no
    other block is; the fleet names stage 0 the worst, as the schedule designs."""
    from snapforensics import parallel
    from snapforensics.analysis.fleet import fleet

    runs = _run("pp2")
    for _, d, truth in runs:
        assert truth["pp"] == 2 and truth["received"]
        p2p = d.category == CAT_CODE[Category.PP_P2P]
        for s in truth["received"]:
            at = (d.lt.addr == s["addr"]) & (d.lt.size == s["bytes"])
            assert (at & p2p).any(), s
        assert int(p2p.sum()) == len(truth["received"])
    f = fleet(parallel.run([p for p, _, _ in runs], jobs=1, progress=False))
    st = f.statement
    assert st["stage"] == 0 and st["stages"] == 2 and st["schedule"] == "1f1b"
    assert st["verdict"] == "expected" and st["category"] == "activation"


@slow
def test_a_tp_by_pp_mesh_reads_each_ranks_stage_from_its_pipeline_group():
    """TP 2 x PP 2 on 4 ranks: Megatron orders ranks tp fastest, so a rank is not its stage.
    The stage each file's analysis reads (its PIPELINE_MODEL_PARALLEL_GROUP, which the recorder
    notes) is the one the running parallel_state gave, and the fleet names the worst rank's
    stage and TP rank: stage 0 peaking by its activations is 1F1B's design."""
    from recordings import recorded_module

    from snapforensics import parallel
    from snapforensics.analysis.fleet import fleet

    folder = recorded_module(MODULE, ("--tp", "2", "--pp", "2", "--layers", "4",
                                      "--micro-batches", "4"), 4)
    paths = [folder / f"rank{r}.pickle" for r in range(4)]
    diags = parallel.run(paths, jobs=1, progress=False)
    truths = [json.loads((folder / f"truth.rank{r}.json").read_text()) for r in range(4)]
    assert sorted(t["stage"] for t in truths) == [0, 0, 1, 1]
    for d, t in zip(diags, truths):
        assert t["tp"] == 2 and t["pp"] == 2
        assert d["framework"]["pipeline"]["stage"] == t["stage"]
        assert d["framework"]["pipeline"]["stages"] == 2
    st = fleet(diags).statement
    worst = truths[st["rank"]]
    assert st["stage"] == worst["stage"] == 0 and st["tp"] == 2 and st["tp_rank"] in (0, 1)
    assert st["verdict"] == "expected" and st["category"] == "activation"


@slow
@pytest.mark.parametrize("off,on", (("tp2", "tp2_sp"), ("small", "small_sp")),
                         ids=("tuned", "held_out"))
def test_sequence_parallel_off_predicts_the_sp_twins_peak(off, on):
    """TP 2 without --sp: the residual stream and the norms' outputs are the same on both TP
    ranks; the replay (each such block at 1/tp, plus the one shared gather buffer) predicts the
    --sp twin's recorded peak within 5%, and the fix is Megatron's argument. The twin and a
    TP-1 run (pipeline only: the same linears, no vocabulary masking) get no finding."""
    twin = [d.peak_bytes for _, d, _ in _run(on)]
    for r, (path, d, truth) in enumerate(_run(off)):
        assert truth["tp"] == 2 and not truth["sp"]
        f = next(f for f in sf.diagnose(path).diagnosis.findings
                 if f.rule == "tp.sequence_parallel_off")
        assert f.verdict == "anomalous" and "--sequence-parallel" in f.fix
        assert twin[r] < d.peak_bytes
        assert abs(f.predicted_peak_bytes - twin[r]) / twin[r] < 0.05, (f.predicted_peak_bytes,
                                                                        twin[r])
    for name in (on, "pp2"):
        for path, _, _ in _run(name):
            assert not [f for f in sf.diagnose(path).diagnosis.findings
                        if f.rule == "tp.sequence_parallel_off"], name
