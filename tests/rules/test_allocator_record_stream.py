"""allocator.record_stream_delay on an EDITED copy of a real CUDA file (its free_completed rows
moved later, as record_stream does, and its last frees left pending at dump); the unedited file
(no delay anywhere in the corpus) stays silent."""

from __future__ import annotations

from corpus import corpus_file
from edits import edited_corpus_file
from findings import found, one

from snapforensics.analysis import diagnose
from snapforensics.analysis.rules.allocator_record_stream import RULE
from snapforensics.snapshot import load

FWD_BWD = "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"  # CUDA, 3 iterations, fragmentation


def _delay_completions(raw, min_size=1 << 20, delay=200, pending=3):
    """What record_stream does to a trace: a block's free_completed comes later than its
    free_requested (never after the next alloc at that address: the memory is not reusable
    before), and the last such frees are still pending at dump (`active_pending_free`)."""
    tr = raw["device_traces"][0]
    n = len(tr)
    next_alloc, seen = [n] * n, {}
    for k in range(n - 1, -1, -1):
        next_alloc[k] = seen.get(tr[k].get("addr"), n)
        if tr[k]["action"] == "alloc":
            seen[tr[k]["addr"]] = k
    reqs = [k for k, e in enumerate(tr[:-1]) if e["action"] == "free_requested"
            and e["size"] >= min_size and tr[k + 1]["action"] == "free_completed"
            and tr[k + 1]["addr"] == e["addr"]]
    inactive = {b["address"]: b for s in raw["segments"] for b in s["blocks"]
                if b["state"] == "inactive"}
    last = [k for k in reqs if next_alloc[k] == n and tr[k]["addr"] in inactive]
    pend = set(sorted(last, key=lambda k: -tr[k]["size"])[:pending])
    drop, moved = set(), {}
    for k in reqs:
        drop.add(k + 1)
        if k not in pend:
            moved.setdefault(min(k + 1 + delay, next_alloc[k]), []).append(dict(tr[k + 1]))
    out = []
    for k, e in enumerate(tr):
        for c in moved.get(k, []):
            c["time_us"] = e.get("time_us", c.get("time_us"))
            out.append(c)
        if k not in drop:
            out.append(e)
    out += moved.get(n, [])
    raw["device_traces"][0] = out
    for k in pend:
        inactive[tr[k]["addr"]]["state"] = "active_pending_free"
    return len(reqs) - len(pend), len(pend)


def test_record_stream_delays_on_an_edited_real_file():
    counts = {}

    def edit(raw):
        counts["delayed"], counts["pending"] = _delay_completions(raw)
    d = edited_corpus_file(FWD_BWD, edit)
    assert counts["delayed"] > 100 and counts["pending"] == 3
    f = one(d, RULE.id)
    assert f.verdict == "anomalous"
    ev = f.evidence
    assert ev["delayed_blocks"] > 100
    assert ev["pending_at_dump_blocks"] == 3 and ev["pending_at_dump_bytes"] > 0
    assert ev["gap_rows"]["max"] > 1 and ev["gap_ms"]["max"] > 0
    assert ev["peak_bytes_counting_completion"] > ev["peak_bytes_counting_request"]
    assert f.saving_bytes == ev["peak_bytes_counting_completion"] - d.peaks["overall_bytes"] > 0
    assert "TORCH_NCCL_AVOID_RECORD_STREAMS=1" in f.fix and "record_stream" in f.fix
    assert ev["stacks"] and ev["stacks"][0]["stack"]


def test_no_record_stream_delay_where_frees_complete_at_once():
    d = diagnose(load(corpus_file(FWD_BWD)))
    assert not found(d, RULE.id)
