"""Frees that wait for another stream (record_stream): memory requested free but not reusable.

`free_requested` is when the tensor died; `free_completed` is when the allocator may hand the
memory out again. They are the same moment unless the block was used on another stream
(`tensor.record_stream(s)`, as c10d does for NCCL collectives unless
`TORCH_NCCL_AVOID_RECORD_STREAMS=1`): then the allocator waits for an event on that stream and
logs `free_completed` later, at the first allocation that finds the event done. Blocks still
waiting at dump are `active_pending_free`.

The live-bytes timeline counts a block as gone at `free_requested`; the memory the allocator
can reuse is only gone at `free_completed`. Replaying the trace with the completed rows gives
the memory actually held; the difference at its peak is what the delays cost. CPU-recorded
snapshots have no streams and never get this finding.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Verdict
from snapforensics.snapshot.model import FREE_COMPLETED, Backend

MIN_HELD = 0.05  # of the peak: delayed memory held at some row
MIN_PEAK = 0.05  # of the peak: the delays raise the peak this much -> anomalous

NCCL = """\
import os

# c10d (NCCL) collectives: stash the tensors and free them after the work's wait() instead of
# record_stream (set before init_process_group; shell: export TORCH_NCCL_AVOID_RECORD_STREAMS=1)
os.environ["TORCH_NCCL_AVOID_RECORD_STREAMS"] = "1"
"""
OWN = """\
import torch

# your own side streams: keep the tensor alive until the consumer waited, then drop it,
# instead of tensor.record_stream(side_stream):
done = torch.{dev}.Event(); done.record(side_stream)
torch.{dev}.current_stream().wait_event(done)
del tensor"""


def fix_for(d: DeviceAnalysis, evidence: dict) -> str:
    if d.snapshot.kind.backend == Backend.NPU:
        # TORCH_NCCL_AVOID_RECORD_STREAMS is read by ProcessGroupNCCL only; HCCL has no
        # verified equivalent here, so only the code change is suggested.
        return OWN.format(dev="npu")
    return NCCL + OWN.format(dev="cuda")


def check(d: DeviceAnalysis) -> list[Finding]:
    lt = d.lt
    if not d.snapshot.kind.caching_allocator or not lt.rows or not len(lt):
        return []
    if not (d.trace.action == FREE_COMPLETED).any():
        return []  # this file does not log completions: nothing to compare
    freed = lt.free_row < lt.rows
    done = lt.completed_row
    delayed = freed & (done > lt.free_row + 1)
    pending = freed & (done < 0)  # requested, never completed before the dump
    pend_dump = [b for s in d.allocator.segments for b in s.blocks
                 if b.state in ("active_pending_free", "active_awaiting_free")]
    if not delayed.any() and not pending.any():
        return []
    held_free = lt.free_row.copy()
    held_free[delayed] = done[delayed]
    held_free[pending] = lt.rows
    held = lt.replay(held_free)
    extra = held - lt.live
    held_max = int(extra.max())
    peak = d.peak_bytes
    if peak <= 0 or held_max < MIN_HELD * peak:
        return []
    peak_held = int(held.max())
    cost = peak_held - peak
    idx = np.flatnonzero(delayed | pending)
    gap_rows = (done[delayed] - lt.free_row[delayed]).astype(np.int64)
    evidence: dict = {
        "delayed_blocks": int(delayed.sum()),
        "delayed_bytes": int(lt.size[delayed].sum()),
        "pending_at_dump_blocks": max(int(pending.sum()), len(pend_dump)),
        "pending_at_dump_bytes": max(int(lt.size[pending].sum()),
                                     int(sum(b.size for b in pend_dump))),
        "max_bytes_held_waiting": held_max,
        "max_held_row": int(np.argmax(extra)),
        "peak_bytes_counting_completion": peak_held,
        "peak_bytes_counting_request": peak,
    }
    if gap_rows.size:
        evidence["gap_rows"] = {"median": int(np.median(gap_rows)), "max": int(gap_rows.max())}
    t = d.trace.time_us
    if gap_rows.size and not np.isnan(t).all():
        us = t[done[delayed]] - t[lt.free_row[delayed]]
        us = us[~np.isnan(us)]
        if us.size:
            evidence["gap_ms"] = {"median": round(float(np.median(us)) / 1e3, 3),
                                  "max": round(float(us.max()) / 1e3, 3)}
    streams: dict[str, int] = {}
    born = lt.alloc_row[idx] >= 0
    for b, row in zip(idx[born].tolist(), lt.alloc_row[idx][born].tolist()):
        sid = int(d.trace.stream[row])
        name = str(d.snapshot.streams[sid]) if 0 <= sid < len(d.snapshot.streams) else "?"
        streams[name] = streams.get(name, 0) + int(lt.size[b])
    evidence["alloc_streams"] = streams
    evidence["stacks"] = top_stacks(d, idx, 3)
    anomalous = cost >= MIN_PEAK * peak
    gap = evidence.get("gap_ms") or evidence.get("gap_rows", {})
    unit = "ms" if "gap_ms" in evidence else "rows"
    cause = (
        f"{evidence['delayed_blocks']} blocks ({human(evidence['delayed_bytes'])}) stayed "
        f"unusable after their free was requested (median {gap.get('median', 0)} {unit}, "
        f"max {gap.get('max', 0)} {unit} until free_completed), and "
        f"{evidence['pending_at_dump_blocks']} were still waiting at dump: they were used on "
        f"another stream (record_stream), so the allocator waits for that stream's event. "
        f"Up to {human(held_max)} was held that way at once; counting memory as free only when "
        f"it is reusable, the peak is {human(peak_held)} instead of {human(peak)}.")
    return [Finding(
        rule=RULE.id, verdict=Verdict.ANOMALOUS if anomalous else Verdict.INFO,
        title="Frees delayed by record_stream hold memory" if anomalous else
        "Frees delayed by record_stream (off the peak)",
        cause=cause if anomalous else cause + " The delays do not coincide with the peak.",
        bytes=held_max, blocks=int(idx.size), members=idx, device=d.device,
        fix=fix_for(d, evidence), saving_bytes=max(cost, 0),
        evidence=evidence,
    )]


RULE = Rule(
    id="allocator.record_stream_delay", check=check, family=Family.LIFECYCLE,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=fix_for)
