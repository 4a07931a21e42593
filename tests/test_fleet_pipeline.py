"""The fleet statement (issue 28 item 5) on real 2-stage `torch.distributed.pipelining` runs
recorded by snapforensics/examples/pipeline.py: which stage peaks highest and why. Under 1F1B the
first stage holds the most micro-batches (the running stages' own counts, truth.rank{R}.json),
which is the schedule, not an imbalance; under GPipe the schedule itself is the defect."""

from __future__ import annotations

import json

import pytest

from snapforensics import parallel
from snapforensics.analysis.fleet import fleet
from snapforensics.analysis.mesh import mesh
from snapforensics.report import fleet as report

MODULE = "snapforensics.examples.pipeline"
# small: 4 micro-batches, 6 thin layers, short sequences (the pipeline rule's held-out layout)
ARGS = ("--microbatches", "4", "--layers", "6", "--dim", "128", "--seq", "128")


def _fleet(schedule: str):
    from recordings import recorded_module

    folder = recorded_module(MODULE, ("--schedule", schedule, *ARGS))
    truth = {r: json.loads((folder / f"truth.rank{r}.json").read_text()) for r in (0, 1)}
    docs = parallel.run([folder / f"rank{r}.pickle" for r in (0, 1)], jobs=1, progress=False)
    return fleet(docs), truth


@pytest.mark.slow
def test_1f1b_first_stage_holding_most_is_expected():
    f, truth = _fleet("1f1b")
    st = f.statement
    # the stage the running schedule had the most micro-batches in flight on
    most = max(truth, key=lambda r: max(truth[r]["held_per_step"]))
    assert max(truth[most]["held_per_step"]) > min(max(t["held_per_step"]) for t in
                                                   truth.values())
    assert st["stage"] == truth[most]["stage"] == 0 and st["stages"] == 2
    assert st["schedule"] == "1f1b" and st["verdict"] == "expected"
    assert st["category"] == "activation" and st["category_extra_bytes"] > 0
    assert st["peak_bytes"] == max(r["peaks"]["overall_bytes"] for r in f.ranks)
    assert f.spread["flagged"]  # the spread is large, and the statement says why
    text = report.statement(f)
    assert text.startswith("expected: pipeline stage 0 of 2") and "not an imbalance" in text
    assert "expected: pipeline stages" in report.headline(f)
    assert "IMBALANCED" not in report.headline(f)
    assert json.loads(json.dumps(f.to_dict()))["statement"]["verdict"] == "expected"


@pytest.mark.slow
def test_gpipe_stage_is_the_schedule_defect():
    f, truth = _fleet("gpipe")
    st = f.statement
    assert {t["stage"] for t in truth.values()} == {0, 1}
    assert st["schedule"] == "gpipe" and st["verdict"] == "anomalous"
    assert st["stage"] in (0, 1) and "pipeline.all_forward_before_backward" in st["why"]
    assert any(r["rule"] == "pipeline.all_forward_before_backward" for r in f.anomalies)


@pytest.mark.slow
def test_without_stages_the_statement_names_the_rank_only():
    """DDP ranks (examples/ddp.py) are no pipeline stages: the highest-peak rank is named, its
    stage and schedule are not made up."""
    from recordings import recorded_module

    folder = recorded_module("snapforensics.examples.ddp", ("--bucket-view", "0", "--layers",
                                                             "4", "--dim", "256"))
    docs = parallel.run([folder / f"rank{r}.pickle" for r in (0, 1)], jobs=1, progress=False)
    f = fleet(docs)
    st = f.statement
    assert all(d["framework"]["pipeline"] is None for d in docs)
    assert st["stage"] is None and st["schedule"] is None
    assert st["peak_bytes"] == max(r["peaks"]["overall_bytes"] for r in f.ranks)
    assert st["verdict"] == ("anomalous" if f.spread["flagged"] else "info")
    assert "no pipeline: the recorder saw no pipeline stage or group" in report.statement(f)
    assert "do not say" not in report.statement(f)
    # the same files without the recorder's note (torch's own dumps): nothing says there is no
    # pipeline
    bare = fleet([{**d, "provenance": {}} for d in docs])
    assert bare.statement["verdict"] == st["verdict"]
    assert "do not say its pipeline stage" in report.statement(bare)


@pytest.mark.slow
def test_stages_made_with_unnamed_groups_are_not_taken_for_the_world():
    """2 stages x DDP over 2 ranks, groups made by `dist.new_group` without names
    (tests/pipeline_ddp.py): no group names the pipeline's dimension, and the unnamed groups
    split the world, so it is not the pipeline's (before: every rank was its own stage, "stage
    1 of 4" on a rank of stage 0, and 1F1B's "min(M, 4 - s)"). The recorder writes the stages
    each rank's PipelineStage objects ran (`pipeline_stages`): the stage said is the running
    stage's (truth from `PipelineStage`)."""
    from pathlib import Path

    from recordings import recorded_script

    folder = recorded_script(Path(__file__).parent / "pipeline_ddp.py", nproc=4, truth=True)
    truth = {r: json.loads((folder / f"truth.rank{r}.json").read_text()) for r in range(4)}
    assert {t["stages"] for t in truth.values()} == {2} and truth[1]["stage"] == 0
    docs = parallel.run([folder / f"rank{r}.pickle" for r in range(4)], jobs=1, progress=False)
    for r, doc in enumerate(docs):
        p = doc["framework"]["pipeline"]
        assert p["schedule"] == "1f1b"
        assert (p["stage"], p["stages"]) == (truth[r]["stage"], truth[r]["stages"]), (r, p)
        assert doc["provenance"]["pipeline_stages"] == {"indices": [truth[r]["stage"]],
                                                        "num_stages": 2}
    f = fleet(docs)
    st = f.statement
    assert st["stages"] == 2 and "of 4" not in report.statement(f), st
    # without the recorder's stages the unnamed groups leave the stage unknown, not guessed
    for doc in docs:
        prov = {k: v for k, v in doc["provenance"].items() if k != "pipeline_stages"}
        m = mesh(prov, ("pp", "dp_shard"))
        assert (m.index("pp"), m.degree("pp")) == (None, None)
    # what the recorder found alive before its first entry (bytes an import or the process
    # group made) is counted in the peak: said as such, not as a peak that may be understated
    hist = [dev["history"] for doc in docs for dev in doc["devices"]]
    assert all(h["orphan_frees"] == 0 for h in hist)
    said = [w for w in f.warnings if "history" in w]
    assert len(said) == sum(h["truncated"] for h in hist), said
    assert all("counted in its peak" in w and "higher" not in w for w in said), said
