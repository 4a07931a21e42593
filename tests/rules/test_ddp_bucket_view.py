"""ddp.gradient_as_bucket_view and the DDP categories (`ddp.bucket`, `ddp.grad_copy`), on real
2-rank `DistributedDataParallel` runs (gloo) recorded by the project's recorder
(snapforensics/examples/ddp.py). The truth is read from the running module (its Reducer's
buckets as DDP's logger reports them, each `.grad` checked against the bucket buffers by
`data_ptr` range), and the predicted peak is checked against the `gradient_as_bucket_view=True`
twin's recording."""

from __future__ import annotations

import json

import numpy as np
import pytest

import snapforensics as sf
from snapforensics.analysis.context import analyse
from snapforensics.analysis.rules.ddp_bucket_view import RULE
from snapforensics.analysis.vocab import CAT_CODE, Category
from snapforensics.snapshot import load

slow = pytest.mark.slow
MODULE = "snapforensics.examples.ddp"
# the layout the replay was built on (peak in the optimizer step, 8 buckets of 1 MB), and two it
# was not tuned on: one bucket of 25 MB with static_graph and a peak in backward; and a head
# the forward never calls (find_unused_parameters: its parameters get no gradient), 0.5 MB
# buckets
LAYOUTS = (("--layers", "4", "--dim", "256"),
           ("--layers", "6", "--dim", "128", "--seq", "64", "--batch", "16",
            "--bucket-cap-mb", "25", "--static-graph"),
           ("--layers", "3", "--dim", "192", "--bucket-cap-mb", "0.5", "--find-unused"))
IDS = ("tuned", "held_out_static", "held_out_unused")


def _run(view: int, args: tuple[str, ...]):
    from recordings import recorded_module

    folder = recorded_module(MODULE, ("--bucket-view", str(view), *args))
    return [(folder / f"rank{r}.pickle",
             json.loads((folder / f"truth.rank{r}.json").read_text())) for r in (0, 1)]


def _finding(report):
    return next((f for f in report.diagnosis.findings if f.rule == RULE.id), None)


def _after_last_backward(path):
    """(DeviceAnalysis, the last iteration's last backward row)."""
    snap = load(path)
    d = analyse(snap, snap.active_traces[0])
    ends = [it.backward_end for it in d.tl.iterations if it.backward_end >= 0]
    return d, ends[-1]


@slow
@pytest.mark.parametrize("args", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("view", (0, 1))
def test_categories_name_the_reducers_buckets_and_the_gradient_copies(view, args):
    for path, truth in _run(view, args):
        assert truth["bucket_count"] >= 1
        d, row = _after_last_backward(path)
        alive = d.lt.alive_at(row)
        bucket = alive & (d.category == CAT_CODE[Category.DDP_BUCKET])
        copy = alive & (d.category == CAT_CODE[Category.DDP_GRAD_COPY])
        # the Reducer's buckets, as its logger counts them: one block each, of its bytes; with
        # find_unused_parameters also its two int32-per-parameter used maps
        # (`Reducer::initialize_local_used_map`: `local_used_map_`, `local_used_map_dev_`)
        maps = [4 * truth["params"]] * 2 if truth["find_unused"] else []
        assert sorted(d.lt.size[bucket].tolist()) == sorted(truth["buckets"] + maps)
        # one slot per parameter: the buckets hold every gradient once
        assert truth["bucket_bytes"] == truth["param_bytes"]
        # a .grad outside every bucket buffer (data_ptr ranges) is a copy; a view is no block
        assert truth["grads_separate"] == (0 if view else truth["grads"])
        assert int(d.lt.size[copy].sum()) == truth["separate_grad_bytes"]
        assert int(copy.sum()) == truth["grads_separate"]
        # DDP's construction-time all-gather of parameter shapes is no FSDP buffer
        assert not any(c.startswith("fsdp.") for c in
                       (d.category_names[i] for i in np.unique(d.category)))


@slow
@pytest.mark.parametrize("args", LAYOUTS, ids=IDS)
def test_separate_gradients_are_anomalous_and_the_replay_predicts_the_view_twin(args):
    copies, views = _run(0, args), _run(1, args)
    for (path, truth), (twin_path, twin_truth) in zip(copies, views):
        assert truth["grads_separate"] > 0 and twin_truth["grads_separate"] == 0
        rep, twin = sf.diagnose(path), sf.diagnose(twin_path)
        measured = twin.peaks["overall_bytes"]
        f = _finding(rep)
        assert f is not None
        # the verdict follows the measured twin: anomalous iff the views lower the peak
        lowers = measured < rep.peaks["overall_bytes"]
        assert (f.verdict == "anomalous") == lowers, (f.verdict, measured)
        if lowers:
            assert "gradient_as_bucket_view=True" in f.fix
            compile(f.fix, RULE.id, "exec")
            assert abs(f.predicted_peak_bytes - measured) <= 0.05 * measured, \
                (truth["rank"], f.predicted_peak_bytes, measured)
            assert f.evidence["copy_bytes_at_peak"] <= truth["separate_grad_bytes"]
        # the twin: views, nothing to say
        assert _finding(twin) is None
