"""deepspeed.reduce_bucket_oversized and `deepspeed.reduce_bucket`, on real 2-rank DeepSpeed
ZeRO-2 and ZeRO-3 runs on the CPU (deepspeed 0.19.8's own code, its CPU accelerator, gloo;
snapforensics/examples/deepspeed_zero.py) recorded by the project's recorder: DeepSpeed's default
reduce_bucket_size (5e8 elements, 2 GB of fp32) on a 263,168-parameter MLP and, held out, a
443,520-parameter one, and each one's twin with the bucket set to the parameter count. The truth
is read from the running optimizer (its ipg_buckets' storages, its reduce_bucket_size) and the
model (its parameter count)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import snapforensics as sf
from snapforensics.analysis.context import analyse
from snapforensics.analysis.rules.deepspeed_reduce_bucket import RULE
from snapforensics.analysis.vocab import CAT_CODE, Category
from snapforensics.snapshot import load

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make setup installs it)")
slow = pytest.mark.slow
MODULE = "snapforensics.examples.deepspeed_zero"


def _run(stage: int, dims: tuple[str, ...], bucket: int | None = None):
    from recordings import recorded_module

    args = ("--stage", str(stage), *dims) + (("--bucket", str(bucket)) if bucket else ())
    folder = recorded_module(MODULE, args)
    return [(folder / f"rank{r}.pickle", json.loads((folder / f"truth.rank{r}.json")
                                                    .read_text())) for r in (0, 1)]


def _finding(path):
    return next((f for f in sf.diagnose(path).diagnosis.findings if f.rule == RULE.id), None)


# (stage, model flags, the model's parameter count: layers x (dim^2 + dim)); the last layout
# is one the rule was not built on
LAYOUTS = ((2, (), 4 * (256 * 256 + 256)), (3, (), 4 * (256 * 256 + 256)),
           (2, ("--layers", "3", "--dim", "384"), 3 * (384 * 384 + 384)))


@slow
@pytest.mark.parametrize("stage,dims,params", LAYOUTS, ids=("zero2", "zero3", "zero2_held_out"))
def test_the_bucket_is_named_and_its_twin_predicted(stage, dims, params):
    for (path, truth), (twin_path, twin) in zip(_run(stage, dims), _run(stage, dims, params)):
        assert truth["reduce_bucket_size"] == 500_000_000 and truth["buckets"]
        assert twin["reduce_bucket_size"] == twin["params"] == truth["params"] == params
        snap = load(path)
        d = analyse(snap, snap.active_traces[0])
        bucket = d.category == CAT_CODE[Category.DEEPSPEED_REDUCE_BUCKET]
        for s in truth["buckets"]:  # every buffer the running optimizer holds is the bucket
            at = np.flatnonzero((d.lt.addr == s["addr"]) & (d.lt.size == s["bytes"]))
            assert len(at) and bucket[at].all(), s
        # and nothing else is: every bucket block has a buffer's size
        assert set(d.lt.size[bucket].tolist()) == {s["bytes"] for s in truth["buckets"]}
        f = _finding(path)
        assert f is not None and f.verdict == "anomalous"
        assert f.evidence["params_assumed"] == truth["params"]
        assert f'"reduce_bucket_size": {truth["params"]}' in f.fix
        tsnap = load(twin_path)
        peak = analyse(tsnap, tsnap.active_traces[0]).peak_bytes
        assert peak < d.peak_bytes / 100
        # within 5%, or one reduction bucket of the twin: gloo reduces a bucket on its own
        # thread, so whether the twin's bucket is alive at its peak varies between recordings
        # (a fresh clone's ZeRO-3 twin peaked one bucket, 1,052,672 B, below the prediction;
        # the recordings here and another clone's were within 1%)
        from recordings import bucket_slack

        slack = max(0.05 * peak, bucket_slack(twin, peak))
        assert abs(f.predicted_peak_bytes - peak) <= slack, (f.predicted_peak_bytes, peak)
        assert _finding(twin_path) is None  # a bucket the gradients fill: nothing to say


@slow
def test_zero3_gathered_parameters_are_named():
    """`deepspeed.gathered_param`: what ZeRO-3's parameter all-gathers fill. Truth from the
    running coordinator: every storage DeepSpeed made available (as `fetch_sub_module` returns,
    forward and backward, and after each step) is, at that moment, a block of this category;
    every block of it holds one module's parameters (a weight, a bias, or both coalesced: sizes
    from the model's shapes); ZeRO-2, which never gathers parameters, has none."""
    dim = 256
    sizes = {dim * dim * 4, dim * 4, (dim * dim + dim) * 4}  # fp32 weight, bias, both
    for path, truth in _run(3, ()):
        snap = load(path)
        d = analyse(snap, snap.active_traces[0])
        gathered = d.category == CAT_CODE[Category.DEEPSPEED_GATHERED_PARAM]
        assert truth["gathered"]
        untraced = 0
        for st in truth["gathered"]:
            row = int(np.searchsorted(d.trace.time_us, st["time_us"], "right")) - 1
            at = np.flatnonzero((d.lt.addr == st["addr"]) & (d.lt.alloc_row <= row)
                                & (d.lt.free_row > row))
            if not len(at):
                # a storage the coordinator held at an address whose traced block was freed
                # before (seen once in 200, on one of several recordings: CPU's profiler
                # memory events missed its allocation); nothing there to classify
                untraced += 1
                continue
            assert len(at) == 1 and gathered[at[0]] and d.lt.size[at[0]] >= st["bytes"], st
        assert untraced <= max(1, len(truth["gathered"]) // 100), untraced
        assert set(d.lt.size[gathered].tolist()) <= sizes
    for path, truth in _run(2, ()):
        snap = load(path)
        d = analyse(snap, snap.active_traces[0])
        assert not truth["gathered"]
        assert not (d.category == CAT_CODE[Category.DEEPSPEED_GATHERED_PARAM]).any()
