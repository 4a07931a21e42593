"""oom.report on a real OOM (ConstructorSun: 3 GPUs, expandable segments, one OOM on device 1)."""

from __future__ import annotations

from corpus import corpus_file
from findings import one

from snapforensics.analysis import diagnose
from snapforensics.analysis.rules.oom_report import RULE
from snapforensics.snapshot import load

OOM_FILE = "ConstructorSun_memory_snapshot.pickle"  # 3 GPUs, expandable segments, one OOM


def test_oom_report_on_a_real_oom():
    d = diagnose(load(corpus_file(OOM_FILE)))
    f = one(d, RULE.id)
    assert f.verdict == "anomalous" and f.device == 1
    ev = f.evidence
    assert ev["requested_bytes"] == 5308694528 and ev["device_free_bytes"] == 95682560
    assert ev["short_by_bytes"] == (ev["requested_bytes"] - ev["device_free_bytes"]
                                    - ev["reserved_unallocated_bytes"]) > 0
    assert ev["allocated_bytes"] == f.bytes and f.blocks > 0
    assert ev["reserved_bytes"] >= ev["allocated_bytes"]
    assert sum(ev["alive_by_category"].values()) == ev["allocated_bytes"]
    assert next(iter(ev["alive_by_category"])) == "activation"
    assert ev["stacks"] and "models.py" in (ev["request_user_code"] or "")
    assert f.fix and "checkpoint" in f.fix
