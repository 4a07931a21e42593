"""The vertical slice, proven on real FSDP2 + checkpoint runs recorded by our own recorder.

Each variant of the bundled example is recorded once per session on CPU (gloo, 2 ranks) and
diagnosed; the assertions are about what the analyzer finds in those real traces.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from snapforensics.analysis import diagnose
from snapforensics.analysis.vocab import Category
from snapforensics.snapshot import load

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

from recordings import record_variant  # noqa: E402

RESHARD = "fsdp.unsharded_params_not_resharded"
REDUCE = "fsdp.reduce_scatter_accumulation"


@pytest.fixture(scope="session")
def diagnosed(tmp_path_factory):
    cache = {}

    def get(variant: str):
        if variant not in cache:
            paths = record_variant(variant, tmp_path_factory.mktemp(variant))
            rank0 = [p for p in paths if p.name == "rank0.pickle"][0]
            cache[variant] = (rank0, diagnose(load(rank0)))
        return cache[variant]

    return get


def rules(d, verdict=None):
    return {f.rule for f in d.findings if verdict is None or f.verdict == verdict}


def test_buggy_run_names_the_seed_bug(diagnosed):
    _, d = diagnosed("buggy")
    assert RESHARD in rules(d, "anomalous")
    f = next(f for f in d.findings if f.rule == RESHARD)
    assert f.bytes > 0 and f.blocks > 0
    assert "set_reshard_after_backward(True)" in f.fix
    # Evidence names the FSDP units and a stack through the unshard path.
    mods = [m["module"] for m in f.evidence["modules"]]
    assert any(m != "(unknown module)" for m in mods), mods
    assert f.evidence["stacks"] and f.evidence["stacks"][0]["stack"]
    assert set(f.evidence["by_path"]) <= {"forward", "backward_pre_hook", "recompute",
                                           "prefetch", "explicit"}
    assert {"recompute", "backward_pre_hook"} & set(f.evidence["by_path"])
    # Backward peaks well above forward: the symptom of the bug report.
    assert d.peaks["backward_bytes"] > 1.2 * d.peaks["forward_bytes"]


def test_expected_gradient_growth_is_not_an_anomaly(diagnosed):
    for variant in ("buggy", "fixed"):
        _, d = diagnosed(variant)
        assert REDUCE in rules(d, "expected"), variant


def test_fixed_run_has_no_anomaly(diagnosed):
    _, d = diagnosed("fixed")
    assert not d.anomalies, [f.rule for f in d.anomalies]
    assert d.peaks["backward_bytes"] < 1.2 * d.peaks["forward_bytes"] or \
        d.peaks["overall_bytes"] < diagnosed("buggy")[1].peaks["overall_bytes"]


def test_predicted_peak_matches_the_fixed_run(diagnosed):
    _, bug = diagnosed("buggy")
    _, fix = diagnosed("fixed")
    f = next(f for f in bug.findings if f.rule == RESHARD)
    measured = fix.peaks["overall_bytes"]
    assert f.predicted_peak_bytes < bug.peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10, (
        f.predicted_peak_bytes, measured, bug.peaks["overall_bytes"])


@pytest.mark.parametrize("variant", ["nested", "noac"])
def test_healthy_layouts_get_no_reshard_anomaly(diagnosed, variant):
    _, d = diagnosed(variant)
    assert RESHARD not in rules(d), [f.rule for f in d.findings]


def test_classification_totals(diagnosed):
    _, d = diagnosed("fixed")
    dev = d.primary
    totals = dev.categories_total
    for cat in (Category.ALL_GATHER, Category.UNSHARDED_PARAM, Category.REDUCE_SCATTER,
                Category.SHARDED_GRAD, Category.OPTIMIZER_STATE):
        assert totals.get(cat, {}).get("bytes", 0) > 0, (cat, totals)
    # What the bytes must be, from FSDP's arithmetic: AdamW keeps two states per local shard, so
    # the optimizer state alive at the peak is twice the sharded parameters (`parameter`: the
    # meta-device model materialized after sharding); the sharded grads reduce-scattered in one
    # backward are one shard set, 1/world_size of the unsharded parameters gathered per unit.
    at_peak = dev.categories_at_peak
    shards = at_peak["parameter"]
    assert abs(at_peak[Category.OPTIMIZER_STATE] - 2 * shards) <= 0.05 * shards, at_peak
    grads = next(f for f in d.findings if f.rule == "fsdp.reduce_scatter_accumulation").bytes
    assert abs(grads - shards) <= 0.05 * shards, (grads, shards)
    assert dev.iterations and len(dev.iterations) == 3
    for it in dev.iterations:
        assert it["forward_peak_bytes"] > 0 and it["backward_peak_bytes"] > 0


def test_cli_json_contract_and_fail_on(diagnosed, tmp_path):
    snap, _ = diagnosed("buggy")
    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(snap),
                        "--format", "json", "-o", str(out), "--fail-on", "anomalous"],
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"].startswith("snapforensics.diagnosis/")
    assert set(doc["peaks"]) >= {"forward_bytes", "backward_bytes", "overall_bytes"}
    anomalies = [f for f in doc["findings"] if f["verdict"] == "anomalous"]
    assert anomalies and all(f["fix"] and f["predicted_peak_bytes"] for f in anomalies)
    assert all({"rule", "verdict", "bytes", "blocks"} <= set(f) for f in doc["findings"])
    fixed, _ = diagnosed("fixed")
    r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(fixed),
                        "--fail-on", "anomalous", "--format", "markdown"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "fsdp.reduce_scatter_accumulation" in r.stdout
