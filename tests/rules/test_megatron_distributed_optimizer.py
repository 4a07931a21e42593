"""megatron.distributed_optimizer_off on real Megatron-Core runs (megatron-core 0.16.1's Python
code, gloo on the CPU, snapforensics/examples/megatron_gpt.py) recorded by the project's
recorder: Megatron's non-distributed mixed-precision optimizer beside its twin with the
distributed optimizer, data-parallel 2 (the layout the rule was written on), and held out TP 2 x
DP 2 on 4 ranks with 3 layers of 96 and DP 4. The truth is read from the running optimizer (its
fp32 main parameters and Adam's states, address and bytes; whether it is distributed) and
`parallel_state` (the data-parallel degree); the prediction is checked against the twin's
measured peak, never against what the analyzer printed before."""

from __future__ import annotations

import json

import numpy as np
import pytest

import snapforensics as sf
from snapforensics.analysis.context import analyse
from snapforensics.analysis.rules.megatron_distributed_optimizer import RULE
from snapforensics.snapshot import load

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the test extra)")
slow = pytest.mark.slow
MODULE = "snapforensics.examples.megatron_gpt"
OFF = "--no-distributed-optimizer"
# name: (ranks, arguments); the first is the layout the rule was written on
PAIRS = {"dp2": (2, ("--tp", "1")),
         "tp2_dp2_held_out": (4, ("--tp", "2", "--layers", "3", "--dim", "96")),
         "dp4_held_out": (4, ("--tp", "1"))}
# 4-rank pairs (8 more ranks recorded, minutes on 2 cores): `make test-full`
FULL = {"tp2_dp2_held_out", "dp4_held_out"}


def _ranks(nproc: int, args: tuple[str, ...]):
    from recordings import recorded_module

    folder = recorded_module(MODULE, args, nproc)
    return [(folder / f"rank{r}.pickle",
             json.loads((folder / f"truth.rank{r}.json").read_text())) for r in range(nproc)]


def _finding(path):
    return next((f for f in sf.diagnose(path).diagnosis.findings if f.rule == RULE.id), None)


@slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n in FULL else n
                                  for n in sorted(PAIRS)])
def test_the_whole_optimizer_is_found_and_its_distributed_twin_predicted(name):
    nproc, args = PAIRS[name]
    for (path, truth), (twin_path, twin) in zip(_ranks(nproc, (*args, OFF)),
                                                _ranks(nproc, args)):
        assert truth["distributed_optimizer"] is False and twin["distributed_optimizer"] is True
        dp = truth["dp"]
        assert dp > 1 and dp == twin["dp"]
        whole = sum(s["bytes"] for s in truth["main_params"] + truth["optimizer_states"])
        shard = sum(s["bytes"] for s in twin["main_params"] + twin["optimizer_states"])
        assert abs(shard * dp - whole) <= 0.05 * whole  # the truth: 1/dp (padded buckets)
        snap = load(path)
        d = analyse(snap, snap.active_traces[0])
        f = _finding(path)
        assert f is not None and f.verdict == "anomalous", f
        assert f.evidence["dp"] == dp and f.evidence["dp_from"] == "its process group"
        members = set(np.asarray(f.members).tolist())
        alive = d.lt.alive_at(d.peak_row)
        for s in truth["main_params"] + truth["optimizer_states"]:
            at = np.flatnonzero((d.lt.addr == s["addr"]) & (d.lt.size == s["bytes"]) & alive)
            assert len(at) <= 1, s
            assert not len(at) or int(at[0]) in members, s  # alive at the peak: counted
        tsnap = load(twin_path)
        measured = analyse(tsnap, tsnap.active_traces[0]).peak_bytes
        err = abs(f.predicted_peak_bytes - measured) / measured
        assert err <= 0.05, (name, f.predicted_peak_bytes, measured)
        assert "use_distributed_optimizer=True" in f.fix
        assert _finding(twin_path) is None  # the distributed optimizer: nothing to say
