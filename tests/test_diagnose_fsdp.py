"""The vertical slice, proven on real FSDP2 + checkpoint runs recorded by our own recorder.

Each variant of the bundled example is recorded once per session on CPU (gloo, 2 ranks) and
diagnosed; the assertions are about what the analyzer finds in those real traces. Each rule's
own findings are tested in tests/rules/.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from snapforensics.analysis.rules import fsdp_reduce_scatter
from snapforensics.analysis.vocab import Category

pytestmark = pytest.mark.slow  # the fixtures record with torch (skipped without it)


def test_fixed_run_has_no_anomaly(diagnosed):
    d = diagnosed("fixed")
    assert not d.anomalies, [f.rule for f in d.anomalies]
    assert d.peaks["backward_bytes"] < 1.2 * d.peaks["forward_bytes"] or \
        d.peaks["overall_bytes"] < diagnosed("buggy").peaks["overall_bytes"]


def test_classification_totals(diagnosed):
    d = diagnosed("fixed")
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
    grads = next(f for f in d.findings if f.rule == fsdp_reduce_scatter.RULE.id).bytes
    assert abs(grads - shards) <= 0.05 * shards, (grads, shards)
    assert dev.iterations and len(dev.iterations) == 3
    for it in dev.iterations:
        assert it["forward_peak_bytes"] > 0 and it["backward_peak_bytes"] > 0


def test_cli_json_contract_and_fail_on(recording, tmp_path):
    snap = recording("buggy")
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
    fixed = recording("fixed")
    r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(fixed),
                        "--fail-on", "anomalous", "--format", "markdown"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert fsdp_reduce_scatter.RULE.id in r.stdout
