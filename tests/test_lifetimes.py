"""Edge cases of pairing allocs and frees, on traces cut from a real fixture recording."""

from __future__ import annotations

from pathlib import Path

from snapforensics.analysis import diagnose
from snapforensics.snapshot import normalize, read_raw

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"


def real_entries() -> list[dict]:
    raw, _ = read_raw(FIXTURE)
    return raw["device_traces"][0]


def diag(entries: list[dict]):
    return diagnose(normalize({"segments": [], "device_traces": [entries]}))


def test_peak_before_the_first_entry_is_counted_and_said():
    """A ring buffer that wrapped and opens with frees: it was fuller before than after."""
    entries = real_entries()
    frees = [e for e in entries if e["action"].startswith("free")][:200]
    d = diag(frees)  # only frees: every block was alive before the first entry
    total = sum(e["size"] for e in frees if e["action"] == "free_requested")
    assert d.peaks["overall_bytes"] == total > 0
    assert any("highest before the first trace entry" in w for w in d.warnings)
    assert any("truncated" in w for w in d.warnings)


def test_alloc_at_an_address_never_freed_closes_the_old_block():
    """A lost free must not keep the first block alive forever (it would look like a leak)."""
    entries = real_entries()
    allocs = [e for e in entries if e["action"] == "alloc"][:50]
    twice = allocs + [dict(e) for e in allocs]  # the same addresses handed out again, no frees
    d = diag(twice)
    once = diag(allocs)
    assert d.peaks["overall_bytes"] == once.peaks["overall_bytes"]
    assert any("reuse an address" in w for w in d.warnings)


def test_orphan_completed_free_is_not_live_when_requests_are_logged():
    """Its free request came before the first entry, so it was not live in the trace."""
    entries = real_entries()
    i = next(k for k, e in enumerate(entries) if e["action"] == "free_completed")
    cut = entries[i:]  # starts right after a request: its completion is an orphan
    assert cut[0]["action"] == "free_completed"
    with_orphan = diag(cut)
    without = diag(cut[1:])
    assert with_orphan.peaks["overall_bytes"] == without.peaks["overall_bytes"]
