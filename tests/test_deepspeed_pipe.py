"""DeepSpeed's own pipeline engine (tests/ds_pipe.py: `deepspeed.pipe.PipelineModule`, its 1F1B
TrainSchedule, deepspeed 0.19.8 on its CPU accelerator, gloo, 2 stages) recorded by the project's
recorder: the buffers the running engine received into (`pipe_recv_buf`, `grad_layer`) and the
received activations it kept for each backward (`pipe_buffers['inputs']`), read from the engine
as it ran, are `pp.p2p_buffer`; the run reads as DeepSpeed's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import snapforensics as sf
from snapforensics.analysis.context import analyse
from snapforensics.analysis.vocab import Category
from snapforensics.snapshot import load

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make setup installs it)")


@pytest.mark.slow
def test_deepspeed_pipeline_buffers_are_p2p_and_the_run_reads_as_deepspeed():
    from recordings import recorded_script

    folder = recorded_script(Path(__file__).parent / "ds_pipe.py", nproc=2, truth=True)
    for r in (0, 1):
        truth = json.loads((folder / f"truth.rank{r}.json").read_text())
        assert truth["stage"] == r and truth["received"]
        path = folder / f"rank{r}.pickle"
        snap = load(path)
        d = analyse(snap, snap.active_traces[0])
        p2p = d.mask(Category.PP_P2P)
        named = set(zip(d.lt.addr[p2p].tolist(), d.lt.size[p2p].tolist()))
        for s in truth["received"]:  # every receive buffer and kept input the engine held
            assert (s["addr"], s["bytes"]) in named, s
        other = d.lt.alive_at(d.peak_row) & d.mask(Category.OTHER)
        assert int(d.lt.size[other].sum()) <= 0.01 * d.peak_bytes
        fw = sf.diagnose(path).to_dict()["framework"]
        assert fw["owner"] == "deepspeed" and fw["layer_class"] == "Block"
    # the fleet names the worst rank, and no TP: DeepSpeed's groups (`undefined`) name no dim
    from snapforensics import parallel
    from snapforensics.analysis.fleet import fleet
    from snapforensics.report import fleet as report

    f = fleet(parallel.run([folder / f"rank{r}.pickle" for r in (0, 1)], jobs=1,
                           progress=False))
    assert f.statement["rank"] == 0 and "tp" not in f.statement, f.statement
    assert "TP rank" not in report.statement(f)


@pytest.mark.slow
def test_deepspeed_pipeline_stages_under_data_parallelism_are_the_engines():
    """2 stages x 2 data-parallel ranks: DeepSpeed names none of its groups, and they split the
    world, so only the recorder's note of each engine's `stage_id` / `num_stages`
    (`pipeline_stages`) says a rank's stage; it is the running engine's."""
    from recordings import recorded_script

    from snapforensics import parallel
    from snapforensics.analysis.fleet import fleet
    from snapforensics.report import fleet as report

    folder = recorded_script(Path(__file__).parent / "ds_pipe.py", nproc=4, truth=True)
    docs = parallel.run([folder / f"rank{r}.pickle" for r in range(4)], jobs=1, progress=False)
    for r, doc in enumerate(docs):
        truth = json.loads((folder / f"truth.rank{r}.json").read_text())
        assert truth["stages"] == 2
        assert doc["provenance"]["pipeline_stages"] == {"indices": [truth["stage"]],
                                                        "num_stages": 2}
        snap = load(folder / f"rank{r}.pickle")
        layout = analyse(snap, snap.active_traces[0]).layout
        assert (layout.index("pp"), layout.degree("pp")) == (truth["stage"], 2), r
        assert layout.degree("tp") is None  # the groups still split the world unsaid
    f = fleet(docs)
    assert f.statement["stages"] == 2 and "of 4" not in report.statement(f), f.statement
    # the worst rank's stage is its engine's; DeepSpeed's TrainSchedule is 1F1B, so the first
    # stage peaking by its activations is the schedule's design
    worst = json.loads((folder / f"truth.rank{f.statement['rank']}.json").read_text())
    assert f.statement["stage"] == worst["stage"] and f.statement["schedule"] == "1f1b"
    if worst["stage"] == 0 and f.statement["category"] == "activation":
        assert f.statement["verdict"] == "expected"
