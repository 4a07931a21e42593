"""Allocator fragmentation: the allocator reserved far more than the program ever had allocated.

The caching allocator keeps freed blocks for reuse; a block split from a segment can only serve
requests that fit in the hole it left, on the same stream and pool. When the holes do not fit
the next requests, the allocator reserves new segments although enough bytes are free in total:
reserved memory (what nvidia-smi / npu-smi shows, and what runs out) climbs above the peak of
allocated memory.

Measured: reserved bytes after every row (reconstructed backwards from the dump's segments and
the `segment_*` rows, see `Allocator.reserved`) against the live bytes. The waste is the
peak of reserved minus the peak of allocated: memory the job held but never needed at once.
Significant when it is at least 20% of the allocated peak and more than two of the allocator's
20 MiB large segments (below that it is the allocator's own rounding). CPU-recorded snapshots have
no caching allocator and never get this finding.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.allocator import LARGE_SEGMENT
from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Verdict
from snapforensics.snapshot.model import SEGMENT_ALLOC, SEGMENT_MAP

MIN_RATIO = 0.20  # waste / allocated peak
MIN_SEGMENTS = 2  # waste must exceed this many large segments


def _dump_facts(d: DeviceAnalysis) -> dict:
    segs = d.allocator.segments
    split_free = [b.size for s in segs if any(b.state != "inactive" for b in s.blocks)
                  for b in s.blocks if b.state == "inactive"]
    empty = [s.total_size for s in segs if all(b.state == "inactive" for b in s.blocks)]
    free = [b.size for s in segs for b in s.blocks if b.state == "inactive"]
    totals = d.snapshot.segment_totals(d.device)
    return {
        "segments": totals["count"],
        "reserved_bytes": totals["reserved_bytes"],
        "allocated_bytes": totals["allocated_bytes"],
        "inactive_split_blocks": len(split_free),
        "inactive_split_bytes": int(sum(split_free)),
        "empty_segments_bytes": int(sum(empty)),
        "largest_free_block_bytes": int(max(free, default=0)),
    }


def fix_for(d: DeviceAnalysis, evidence: dict) -> str:
    """Turn expandable segments on, for this file's backend, keeping the other settings."""
    return d.allocator.expandable_fix


def reserved_peak(evidence: dict) -> int | None:
    """The reserved peak the saving is a share of: over the trace, else at dump."""
    return evidence.get("reserved_peak_bytes") or \
        (evidence.get("at_dump") or {}).get("reserved_bytes")


def _check_dump(d: DeviceAnalysis) -> list[Finding]:
    """No history: only the dump's segments. Holes inside partly used segments are
    fragmentation; wholly free segments are just the cache, not counted."""
    dump = _dump_facts(d)
    waste, alloc = dump["inactive_split_bytes"], dump["allocated_bytes"]
    if alloc <= 0 or waste < MIN_RATIO * alloc or waste <= MIN_SEGMENTS * LARGE_SEGMENT:
        return []
    already = d.allocator.expandable
    evidence = {"at_dump": dump, "expandable_segments": already}
    cause = (f"At dump {human(waste)} ({waste / alloc:.0%} of the {human(alloc)} allocated) is "
             f"free space in {dump['inactive_split_blocks']} holes inside segments that still "
             f"hold live blocks (largest free block {human(dump['largest_free_block_bytes'])}); "
             f"{human(dump['reserved_bytes'])} reserved in {dump['segments']} segments. The "
             "file has no allocation history, so this is the state at dump, not at the peak.")
    return [Finding(
        rule=RULE.id, verdict=Verdict.INFO if already else Verdict.ANOMALOUS,
        title="Allocator fragmentation at dump: free holes inside used segments",
        cause=cause, bytes=waste, blocks=dump["inactive_split_blocks"], device=d.device,
        fix=None if already else fix_for(d, evidence),
        saving_bytes=None if already else waste, evidence=evidence)]


def check(d: DeviceAnalysis) -> list[Finding]:
    if not d.snapshot.kind.caching_allocator:
        return []
    if not d.lt.rows:
        return _check_dump(d)
    reserved = d.allocator.reserved
    if reserved is None:
        return []
    live = d.lt.live
    peak = int(live.max())
    res_row = int(np.argmax(reserved))
    res_peak = int(reserved[res_row])
    waste = res_peak - peak
    if peak <= 0 or waste < MIN_RATIO * peak or waste <= MIN_SEGMENTS * LARGE_SEGMENT:
        return []
    at_peak = int(reserved[d.peak_row])
    # segment growth while the cache already held at least the request in free bytes
    grew = np.flatnonzero(np.isin(d.trace.action, [SEGMENT_ALLOC, SEGMENT_MAP]))
    grew = grew[grew > 0]
    want = d.allocator.next_alloc_size(grew)
    cached_free = reserved[grew - 1] - live[grew - 1]
    while_free = grew[(want > 0) & (cached_free >= want)]
    dump = _dump_facts(d)
    var, conf = d.allocator.conf
    already = d.allocator.expandable
    evidence = {
        "allocated_peak_bytes": peak,
        "allocated_peak_row": d.peak_row,
        "reserved_at_allocated_peak_bytes": at_peak,
        "reserved_peak_bytes": res_peak,
        "reserved_peak_row": res_row,
        "reserved_peak_phase": d.phase_name(res_row),
        "waste_ratio": round(waste / peak, 3),
        "segment_growths": int(len(grew)),
        "segment_growths_while_enough_was_free": int(len(while_free)),
        "segment_bytes_grown_while_enough_was_free": int(d.trace.size[while_free].sum()),
        "at_dump": dump,
        "allocator_conf": {var: conf},
        "expandable_segments": already,
        "estimate": "reserved after each row = reserved at dump minus the segment_alloc/map "
                    "and plus the segment_free/unmap rows after it; allocated = live bytes",
    }
    cause = (
        f"The allocator reserved up to {human(res_peak)} (row {res_row}, "
        f"{d.phase_name(res_row)}) while allocated memory never exceeded {human(peak)}: "
        f"{human(waste)} ({waste / peak:.0%} of the allocated peak) was held as cached free "
        f"space that did not fit the requests that came next. At the allocated peak "
        f"{human(at_peak - int(live[d.peak_row]))} of the reserved memory was free. "
        f"{len(while_free)} of {len(grew)} segment growths happened while the cache already "
        f"held at least the requested bytes, in holes too small or on another stream/pool; "
        f"at dump {dump['inactive_split_blocks']} free blocks "
        f"({human(dump['inactive_split_bytes'])}) sit inside partly used segments, the largest "
        f"free block is {human(dump['largest_free_block_bytes'])}.")
    if already:
        return [Finding(
            rule=RULE.id, verdict=Verdict.INFO,
            title="Reserved memory well above allocated, even with expandable segments",
            cause=cause + " Expandable segments are already on, so the remaining gap is "
                          "memory cached per stream or in private pools (CUDA graphs), or "
                          "pages mapped around long-lived blocks; torch.cuda.empty_cache() "
                          "between phases returns it, at the cost of re-mapping.",
            bytes=waste, blocks=dump["inactive_split_blocks"], device=d.device,
            evidence=evidence)]
    return [Finding(
        rule=RULE.id, verdict=Verdict.ANOMALOUS,
        title="Allocator fragmentation: reserved far above allocated",
        cause=cause + " Expandable segments let the allocator grow one mapping per stream "
                      "instead of stranding fixed-size segments, so reserved tracks allocated: "
                      f"up to {human(waste)} less reserved memory (reserved peak "
                      f"{human(res_peak)} toward {human(peak)}); the allocated peak "
                      f"({human(peak)}) does not change.",
        bytes=waste, blocks=dump["inactive_split_blocks"], device=d.device,
        fix=fix_for(d, evidence),
        saving_bytes=waste,
        evidence=evidence | {"saving_is": "reserved bytes (upper bound: the waste above the "
                                          "allocated peak); the allocated peak is unchanged"},
    )]


RULE = Rule(
    id="allocator.fragmentation", check=check, family=Family.LIFECYCLE,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=fix_for,
    segments_only=True, reserved_peak=reserved_peak)
