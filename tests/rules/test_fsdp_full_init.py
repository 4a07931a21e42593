"""fsdp.full_model_materialized_at_init: the full model built on the device before sharding, on a
real recording (`full_init`); silent with one rank, without FSDP (EDITED copies) and on a real
single-process corpus file."""

from __future__ import annotations

import pytest
from corpus import corpus_file
from findings import FSDP_CONFIGURATION, finding, fired, near, verdict_by_effect

from snapforensics.analysis import diagnose
from snapforensics.analysis.context import analyse
from snapforensics.analysis.rules.fsdp_full_init import RULE
from snapforensics.snapshot import load, normalize, read_raw

slow = pytest.mark.slow


@slow
def test_full_model_built_on_the_device_before_sharding(recording, diagnosed):
    d = diagnosed("full_init")
    f = finding(d, RULE.id)
    # anomalous only if the start-up peak is the run's peak (measured peak above `fixed`'s, the
    # same run with meta-device init); below it, info naming where it would take over
    if verdict_by_effect(f, recording("full_init"), recording("fixed")) == "info":
        assert "ranks" in f.cause or "any world size" in f.cause
    ev = f.evidence
    assert ev["init_peak_bytes"] > 1.5 * ev["sharded_param_bytes"]
    assert f.bytes >= 0.9 * ev["full_model_bytes"]  # the whole model, at once
    assert "meta" in f.fix
    # With meta-device init the init peak is the sharded parameters, as in `fixed`.
    fixed = load(recording("fixed"))
    dx = analyse(fixed, fixed.active_traces[0])
    fixed_init = int(dx.lt.live[:dx.tl.iterations[0].start].max())
    assert near(ev["predicted_init_peak_bytes"], fixed_init), (ev, fixed_init)
    assert not fired(d) & (FSDP_CONFIGURATION - {RULE.id})


def _without_fsdp(path, world_size=None) -> dict:
    """Edit a recording into a run with no FSDP: every torch.distributed / FSDP / c10d frame and
    the range annotations removed, the recorder's world size replaced (None: unknown)."""
    raw, _ = read_raw(path)
    for tr in raw["device_traces"]:
        for e in tr:
            if "frames" in e:
                e["frames"] = [fr for fr in e["frames"] if "distributed" not in fr["filename"]
                               and "fsdp" not in fr["name"].lower() and "c10d" not in fr["name"]]
    raw.pop("external_annotations", None)
    raw.get("snapforensics", {}).pop("world_size", None)
    if world_size is not None:
        raw["snapforensics"]["world_size"] = world_size
    return raw


@slow
def test_full_init_needs_fsdp_and_a_world_size_above_one(recording):
    # A real single-rank recording of `full_init` (FSDP over one rank): nothing is sharded away.
    one = recording("full_init", nproc=1)
    d = diagnose(load(one))
    assert RULE.id not in fired(d), [(f.rule, f.cause) for f in d.findings]
    # The same full-model init with no FSDP in the trace, world size unknown or one.
    for path in (one, recording("full_init"), recording("fixed")):
        for ws in (None, 1):
            d = diagnose(normalize(_without_fsdp(path, ws), source="no-fsdp.pickle"))
            assert RULE.id not in fired(d), (path, ws, [(f.rule, f.cause) for f in d.findings])


def test_full_init_silent_on_a_real_single_process_file():
    d = diagnose(load(corpus_file("NiuHuangxiaozi_fwd_bwd_200_mixed.pickle")))
    assert RULE.id not in fired(d)
    assert not fired(d) & FSDP_CONFIGURATION
