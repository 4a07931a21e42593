"""Memory held by private pools: CUDA graphs' pools and user-made `MemPool`s, across the peak.

A CUDA graph's capture allocates from a private pool: captured without `pool=`, its own
(`(n, 0)`); with `pool=torch.cuda.graph_pool_handle()` (what `make_graphed_callables` does for
all its graphs) one shared by the captures that name it (`(0, n)`, like a `torch.cuda.MemPool`,
where NCCL user buffers and custom allocators live). The caching allocator never hands a
private pool's segments to the regular pool, and `empty_cache()` keeps them while a graph (or the
`MemPool`) holds the pool: a replay writes into the addresses its capture used, freed blocks
included, so the whole pool stays reserved until the graph is destroyed (`del graph` /
`graph.reset()`): c10 `CUDACachingAllocator`'s `releasePool` (the graph's end) drops the pool's
use count, a pool at 0 becomes freeable (`graph_pools_freeable`), and only then does
`release_cached_blocks` (`empty_cache()`, or a failed allocation's retry) return its segments.

What that costs is a mechanism, not a threshold: graphs captured each into its own pool keep one
pool each although graphs that replay one after another can share one (their intermediates
never live at the same time): sharing needs at least the largest of them, so the sum minus the
largest is the most sharing can return. Verdict anomalous when two or more graphs' own pools
were reserved across the peak and that bound is at least two large segments (2 x 20 MiB,
`kLargeBuffer`: below that, one pool's segment rounding, which sharing does not remove); info
otherwise (one graph, shared pools, user `MemPool`s: reserved by design, said so that it is not
read as the regular pool's waste). Judged on the segments at dump (`segments_only`).
"""

from __future__ import annotations

from snapforensics.analysis.allocator import LARGE_SEGMENT
from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Verdict

MIN_SAVING = 2 * LARGE_SEGMENT

SHARE = """\
import torch

# graphs that replay one after another: capture them into ONE private pool (what
# torch.cuda.make_graphed_callables does); capture in the order they replay
pool = torch.cuda.graph_pool_handle()
g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
with torch.cuda.graph(g1, pool=pool):
    out1 = step1(static_in)
with torch.cuda.graph(g2, pool=pool):
    out2 = step2(out1)
"""
FREE = """\
# a graph no longer replayed gives its pool back once nothing holds it:
g1.reset()  # or: del g1 (and its static inputs/outputs)
torch.cuda.empty_cache()
"""


def fix_for(d: DeviceAnalysis, evidence: dict) -> str:
    return (SHARE + "\n" if evidence.get("graph_pools", 0) >= 2 else "import torch\n\n") + FREE


def reserved_peak(evidence: dict) -> int | None:
    return evidence.get("reserved_peak_bytes")


def check(d: DeviceAnalysis) -> list[Finding]:
    if not d.snapshot.kind.caching_allocator:
        return []
    pools = [p for p in d.allocator.pools if p.pool_id != (0, 0)]
    if not pools:
        return []
    held = [p for p in pools if p.across_peak]
    graphs = [p for p in held if p.graph]
    saving = sum(p.across_peak for p in graphs) - max((p.across_peak for p in graphs),
                                                      default=0)
    total = sum(p.reserved for p in pools)
    across = sum(p.across_peak for p in pools)
    res = d.allocator.reserved
    res_peak = int(res.max()) if res is not None and len(res) else int(
        sum(s.total_size for s in d.allocator.segments))
    anomalous = len(graphs) >= 2 and saving >= MIN_SAVING
    rows = [{"pool_id": list(p.pool_id), "owner": p.owner, "segments": p.segments,
             "reserved_bytes": p.reserved, "allocated_bytes": p.allocated,
             "reserved_across_peak_bytes": p.across_peak} for p in pools]
    listed = "; ".join(f"{p.owner}: {human(p.reserved)} in {p.segments} segment(s), "
                       f"{human(p.allocated)} allocated" for p in pools[:6])
    cause = (f"{len(pools)} private memory pool(s) hold {human(total)} of this device's "
             f"reserved memory ({human(across)} of it already reserved at the peak): {listed}. "
             "The regular pool cannot allocate from them, and empty_cache() does not release "
             "them while the graph or MemPool that owns them lives.")
    if anomalous:
        cause += (f" {len(graphs)} CUDA graphs were each captured into their own pool; "
                  f"graphs that replay one after another can share one, which returns up to "
                  f"{human(saving)} (all but the largest pool).")
    return [Finding(
        rule=RULE.id, verdict=Verdict.ANOMALOUS if anomalous else Verdict.INFO,
        title="CUDA graphs' own pools held across the peak" if anomalous else
        "Memory reserved by private pools (CUDA graphs, MemPool)",
        cause=cause, bytes=across, blocks=0, device=d.device,
        fix=fix_for(d, {"graph_pools": len(graphs)}),
        saving_bytes=saving if anomalous else None,
        evidence={"pools": rows, "graph_pools": len(graphs), "private_reserved_bytes": total,
                  "private_reserved_across_peak_bytes": across,
                  "shared_pool_saving_bytes": saving, "reserved_peak_bytes": res_peak})]


RULE = Rule(
    id="allocator.private_pool", check=check, family=Family.LIFECYCLE,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=fix_for,
    segments_only=True, reserved_peak=reserved_peak)
