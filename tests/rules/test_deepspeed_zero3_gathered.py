"""deepspeed.gathered_parameters on real 2-rank DeepSpeed ZeRO-3 runs on the CPU (deepspeed
0.19.8's own code, its CPU accelerator, gloo; snapforensics/examples/deepspeed_zero.py) recorded
by the project's recorder: DeepSpeed's default stage3_param_persistence_threshold (1e5 elements:
every Linear(256, 256) of the MLP is persistent) and the same run with the threshold at 0 (none
is). The truth is read from the running engine: each parameter's `ds_persist` and full size; the
persistence anomaly's predicted peak is checked against the threshold-0 twin's recorded peak."""

from __future__ import annotations

import json

import pytest

import snapforensics as sf
from snapforensics.analysis.rules.deepspeed_zero3_gathered import RULE

pytest.importorskip("deepspeed", reason="deepspeed is not installed (make setup installs it)")
slow = pytest.mark.slow
MODULE = "snapforensics.examples.deepspeed_zero"
MODULE_BYTES = (256 * 256 + 256) * 4  # one Linear(256, 256)'s fp32 weight and bias


def _run(*args: str):
    from recordings import recorded_module

    folder = recorded_module(MODULE, ("--stage", "3", *args))
    return [(folder / f"rank{r}.pickle", json.loads((folder / f"truth.rank{r}.json")
                                                    .read_text())) for r in (0, 1)]


def _finding(path):
    return next((f for f in sf.diagnose(path).diagnosis.findings if f.rule == RULE.id), None)


@slow
def test_persistent_and_fetched_parameters_follow_the_engine():
    for path, truth in _run():  # default threshold: every parameter persistent
        assert truth["persistent"] and len(truth["persistent"]) == 8
        f = _finding(path)
        assert f is not None and f.verdict == "anomalous"  # persistence holds 4 modules
        assert "stage3_param_persistence_threshold\"] = 0" in f.fix
        assert f.evidence["persistent_bytes_at_peak"] == sum(truth["persistent"])
        assert f.evidence["fetched_bytes_at_peak"] == 0
    for path, truth in _run("--persistence", "0"):  # none persistent: fetched per module
        assert truth["persistent"] == []
        f = _finding(path)
        assert f is not None and f.evidence["persistent_bytes_at_peak"] == 0
        fetched = f.evidence["fetched_bytes_at_peak"]
        assert fetched > 0 and fetched % MODULE_BYTES == 0, fetched  # whole modules' params
        assert "stage3_prefetch_bucket_size" in f.cause


def _peak(path) -> int:
    from snapforensics.analysis.context import analyse
    from snapforensics.snapshot import load

    s = load(path)
    return analyse(s, s.active_traces[0]).peak_bytes


# (args, the engine's persistent parameters): every Linear under DeepSpeed's default 1e5
# elements; with the reduction bucket at the model's size (`--bucket`, so the 2 GB default does
# not hide the parameters); a held-out 6 x 128 model; 3 x 384, whose weights (147,456 elements)
# are over the threshold, only the biases persistent
PERSISTENCE = ((), ("--bucket", "263168"), ("--layers", "6", "--dim", "128"),
               ("--layers", "3", "--dim", "384"))


@slow
@pytest.mark.parametrize("args", PERSISTENCE, ids=("default", "bucket", "held_out", "biases"))
def test_persistence_anomaly_predicts_the_threshold_0_twin(args):
    """Anomalous exactly when the engine kept most of the model persistent (`ds_persist`: all
    of it, or only the biases: 0.3%), with the predicted peak of the threshold-0 twin within 5%
    on the run's worst rank (what capacity planning needs; the ranks of a twin can differ by
    when their reduction bucket is alive: none is under-predicted by more than that), and the
    twin gets no anomaly."""
    base, twin = _run(*args), _run(*args, "--persistence", "0")
    preds, peaks, slacks = [], [], []
    for (path, truth), (tpath, ttruth) in zip(base, twin):
        assert ttruth["persistent"] == []
        tf = _finding(tpath)
        assert tf is None or tf.verdict == "expected"
        f = _finding(path)
        if sum(truth["persistent"]) < truth["params"] * 4 / 2:  # biases only
            assert f is None or f.verdict == "expected", f
            continue
        assert f is not None and f.verdict == "anomalous", f
        preds.append(f.predicted_peak_bytes)
        peaks.append(_peak(tpath))
        print(f"{args} rank {truth.get('rank', '?')}: predicted {f.predicted_peak_bytes:,} B, "
              f"twin {peaks[-1]:,} B")
        # never promises more than the twin, by more than 5% or the twin's one reduction
        # bucket: gloo reduces it on its own thread, so whether it is alive at a peak varies
        # between recordings (a fresh clone's recording predicted 8.7% below the twin, half a
        # bucket; the recordings here were within 5%)
        from recordings import bucket_slack

        slack = bucket_slack(ttruth, peaks[-1])
        slacks.append(slack)
        assert f.predicted_peak_bytes >= peaks[-1] - max(0.05 * peaks[-1], slack)
    if preds:
        err = max(preds) - max(peaks)
        assert abs(err) <= max(0.05 * max(peaks), max(slacks)), (preds, peaks)
