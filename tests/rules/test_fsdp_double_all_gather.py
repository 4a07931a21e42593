"""fsdp.double_all_gather_in_backward: a unit all-gathered twice in one backward, on a real
recording (FSDP1 + reentrant checkpointing) and on an EDITED `fixed` recording where the recompute
re-gathers each named FSDP2 unit (what torch did before pytorch PR 164009)."""

from __future__ import annotations

import pytest
from findings import finding, fired, verdict_by_effect

from snapforensics.analysis import diagnose
from snapforensics.analysis.context import analyse
from snapforensics.analysis.rules import (
    fsdp_all_gather_concurrency,
    fsdp_reshard,
    fsdp_reshard_after_forward,
    fsdp_stale_prefetch,
)
from snapforensics.analysis.rules.fsdp_double_all_gather import RULE
from snapforensics.analysis.vocab import CAT_CODE, Category, Phase
from snapforensics.snapshot import normalize, read_raw

slow = pytest.mark.slow


@slow
def test_fsdp1_reentrant_checkpoint_gathers_every_layer_twice(diagnosed, recording):
    """A real recording on torch 2.13: FSDP1 + HF-style reentrant checkpointing (#105635)."""
    d = diagnosed("fsdp1_reentrant")
    f = finding(d, RULE.id)
    # anomalous only if gathering once lowers the peak: measured against `fsdp1` (the same
    # FSDP1 units, non-reentrant checkpointing inside them: one gather per layer)
    verdict_by_effect(f, recording("fsdp1_reentrant"), recording("fsdp1"))
    assert f.evidence["units_gathered_twice"] == 6
    assert f.bytes >= 6 * 12 * 2**20
    paths = " ".join(f.evidence["by_path"])
    assert "first: recompute" in paths and "second: backward_pre_hook" in paths
    assert "use_reentrant" in f.fix or "NO_REENTRANT" in f.fix
    # FULL_SHARD keeps only the root unsharded after forward: not reshard_after_forward=False.
    assert not fired(d) & {fsdp_reshard_after_forward.RULE.id, fsdp_stale_prefetch.RULE.id,
                           fsdp_reshard.RULE.id}


def _with_recompute_regather(path) -> dict:
    """Edit a `fixed` recording: before each unit's backward unshard, the recompute unshards the
    unit (a copy of its forward all-gather outputs, recompute frames) and reshards it at once:
    what torch before pytorch PR 164009 did with units nested in a checkpointed region."""
    raw, _ = read_raw(path)
    snap = normalize(raw)
    d = analyse(snap, snap.traces[0])
    trace = raw["device_traces"][0]
    unsh = [b for b in range(len(d.lt))
            if d.lt.alloc_row[b] >= 0 and d.category[b] == CAT_CODE[Category.UNSHARDED_PARAM]]
    fw: dict[tuple, list[int]] = {}
    bw_first: dict[tuple, int] = {}
    for b in unsh:
        key = (int(d.iteration[b]), d.module_of(b))
        if key[1] in (None, "(root)") or key[0] < 0:
            continue
        if d.phase[b] == Phase.FORWARD:
            fw.setdefault(key, []).append(b)
        elif d.phase[b] in (Phase.BACKWARD, Phase.RECOMPUTE):
            bw_first[key] = min(bw_first.get(key, 1 << 62), int(d.lt.alloc_row[b]))
    recompute = [{"filename": "torch/utils/checkpoint.py", "line": 0, "name": "recompute_fn"},
                 {"filename": "torch/utils/checkpoint.py", "line": 0, "name": "unpack_hook"}]
    inserts: dict[int, list] = {}
    addr = 1 << 46
    for key, row in bw_first.items():
        entries, frees = [], []
        for b in fw.get(key, []):
            src = trace[int(d.lt.alloc_row[b])]
            frames = list(src["frames"]) + recompute
            e = dict(src, addr=addr, frames=frames, time_us=trace[row]["time_us"])
            entries.append(e)
            frees += [dict(e, action="free_requested"), dict(e, action="free_completed")]
            addr += int(src["size"]) + 4096
        inserts[row] = entries + frees
    out = []
    for r, e in enumerate(trace):
        out.extend(inserts.get(r, []))
        out.append(e)
    raw["device_traces"][0] = out
    return raw


@slow
def test_double_all_gather_per_named_unit_on_an_edited_recording(recording):
    path = recording("fixed")
    d = diagnose(normalize(_with_recompute_regather(path), source="edited-fixed.pickle"))
    f = finding(d, RULE.id)
    assert f.evidence["units_gathered_twice"] == 6
    assert {m["module"] for m in f.evidence["modules"]} == {f"layers.{i}" for i in range(6)}
    assert "first: recompute" in " ".join(f.evidence["by_path"])
    assert not fired(d) & {fsdp_reshard.RULE.id, fsdp_stale_prefetch.RULE.id,
                           fsdp_all_gather_concurrency.RULE.id, fsdp_reshard_after_forward.RULE.id}
