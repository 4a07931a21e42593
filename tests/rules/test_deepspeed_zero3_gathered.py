"""deepspeed.gathered_parameters on real 2-rank DeepSpeed ZeRO-3 runs on the CPU (deepspeed
0.19.8's own code, its CPU accelerator, gloo; snapforensics/examples/deepspeed_zero.py) recorded
by the project's recorder: DeepSpeed's default stage3_param_persistence_threshold (1e5 elements:
every Linear(256, 256) of the MLP is persistent) and the same run with the threshold at 0 (none
is). The truth is read from the running engine: each parameter's `ds_persist` and full size."""

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
        assert f is not None and f.verdict == "expected" and f.fix is None
        assert f.evidence["persistent_bytes_at_peak"] == sum(truth["persistent"])
        assert f.evidence["fetched_bytes_at_peak"] == 0
    for path, truth in _run("--persistence", "0"):  # none persistent: fetched per module
        assert truth["persistent"] == []
        f = _finding(path)
        assert f is not None and f.evidence["persistent_bytes_at_peak"] == 0
        fetched = f.evidence["fetched_bytes_at_peak"]
        assert fetched > 0 and fetched % MODULE_BYTES == 0, fetched  # whole modules' params
        assert "stage3_prefetch_bucket_size" in f.cause
