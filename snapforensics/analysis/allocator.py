"""What one device's caching allocator did: its segments, reserved bytes over time, its config.

Facts shared by the rules `allocator_*` and `oom_report`, computed once per device on first use
(`DeviceAnalysis.allocator`) from the arrays of one `DeviceAnalysis` and the dump's segment list,
never from the raw trace.

Reserved bytes over time: the file has the segments alive at dump (their `total_size` is what
the allocator held from the driver then) and logs `segment_alloc` / `segment_map` (reserved grows)
and `segment_free` / `segment_unmap` (it shrinks). Walking those rows *backwards from the dump*
gives the reserved bytes after every row, exact for every row the ring buffer still holds even
when its start was lost (the dump is the anchor, not the first row).
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from snapforensics.snapshot.model import (
    ALLOC,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    Segment,
)

if TYPE_CHECKING:
    from snapforensics.analysis.context import DeviceAnalysis

# The CUDA / NPU caching allocator's large-pool granularity: a request between 1 and 10 MiB gets
# a 20 MiB segment (kLargeBuffer). Gaps between reserved and allocated below a couple of these
# are the allocator's rounding, not something a setting can remove.
LARGE_SEGMENT = 20 << 20


def pool_owner(pool_id: tuple) -> str:
    """Who made a memory pool, from its id alone (c10 ``MemPool``/``generate_mempool_id``: a
    pool made by torch for a CUDA graph captured without ``pool=`` is ``(n, 0)``, one a user
    made is ``(0, n)``: ``torch.cuda.graph_pool_handle()`` shared by captures, or
    ``torch.cuda.MemPool``, the kind NCCL user buffers and custom allocators such as
    ``ncclMemAlloc`` live in; ``(0, 0)`` is the regular pool)."""
    a, b = (tuple(pool_id) + (0, 0))[:2]
    if (a, b) == (0, 0):
        return "regular pool"
    if b == 0:
        return f"CUDA graph private pool #{a} (a capture without pool=)"
    if a == 0:
        return (f"user pool #{b} (torch.cuda.graph_pool_handle() shared by captures, or "
                "torch.cuda.MemPool: NCCL user buffers, a custom allocator)")
    return f"pool {a}/{b}"


class Pool(NamedTuple):
    """The segments of one memory pool at dump."""

    pool_id: tuple[int, int]
    owner: str
    segments: int
    reserved: int  # the segments' total_size
    allocated: int  # bytes in blocks handed out (active)
    across_peak: int  # reserved bytes of segments already there at the peak row
    graph: bool  # a CUDA graph's own pool ((n, 0))


class AllocConf(NamedTuple):
    var: str  # the env var of this file's backend (PYTORCH_CUDA_ALLOC_CONF, ..._NPU_...)
    value: str  # its value when the file was recorded ("" when unknown)


class Allocator:
    """The allocator facts of one device; each is computed on first use, then kept."""

    def __init__(self, d: DeviceAnalysis) -> None:
        self._d = d

    @cached_property
    def segments(self) -> list[Segment]:
        """The device's segments alive at dump."""
        return self._d.snapshot.segments_on(self._d.device)

    @cached_property
    def reserved(self) -> np.ndarray | None:
        """Reserved bytes right after each row, reconstructed backwards from the dump's segments.

        None when the dump's segments cannot be the anchor of this trace (no segments for the
        device and no segment rows, or reserved would fall below the live bytes: a synthetic or
        mismatched file).
        """
        d = self._d
        segs = self.segments
        n = len(d.trace)
        # each row's change of the reserved bytes: + a segment's size where it is made or
        # mapped, - where it is freed or unmapped, 0 elsewhere (a sign per action code). With
        # the sums below this is ~0.1 s on 6.4M rows, where masks per action and a suffix sum
        # over reversed views took 0.8 s (cProfile, in process, the 1 GB make_big file)
        sign = np.zeros(256, np.int64)
        sign[[SEGMENT_ALLOC, SEGMENT_MAP]] = 1
        sign[[SEGMENT_FREE, SEGMENT_UNMAP]] = -1
        delta = sign[d.trace.action.view(np.uint8)]
        # no segments at dump is a valid anchor (0 reserved, e.g. after empty_cache) only when
        # the trace shows segments coming and going; otherwise the file has no segment list
        if not n or (not segs and not delta.any()):
            return None
        delta *= d.trace.size  # int64, in place
        # reserved after row r: the dump's total minus the changes of the rows after r, i.e.
        # the changes up to r plus (the dump's total - all the changes): forward, in place
        after_all = int(sum(s.total_size for s in segs)) - int(delta.sum())
        reserved = np.cumsum(delta, out=delta)
        reserved += after_all
        live = d.lt.live
        if len(live):
            low = reserved - live
            if low.min() < -0.01 * max(int(live.max()), 1):
                return None
        return reserved

    @cached_property
    def pools(self) -> list[Pool]:
        """Each memory pool with segments at dump, the regular pool first, then by id.

        A private pool (a CUDA graph's, a ``MemPool``) keeps its segments for itself: the
        regular pool never allocates from them, and ``empty_cache()`` does not release them
        while a graph or ``MemPool`` holds the pool. ``across_peak``: the bytes of its segments
        reserved at the peak row (their ``segment_alloc`` row at or before it, or before the
        trace: no row for their address)."""
        d = self._d
        act = d.trace.action
        seg_rows = np.flatnonzero((act == SEGMENT_ALLOC) | (act == SEGMENT_MAP))
        first: dict[int, int] = {}
        for r in seg_rows[::-1].tolist():
            first[int(d.trace.addr[r])] = r
        peak = d.peak_row
        by: dict[tuple[int, int], list[int]] = {}
        for s in self.segments:
            key = tuple((tuple(s.pool_id) + (0, 0))[:2])
            e = by.setdefault(key, [0, 0, 0, 0])
            e[0] += 1
            e[1] += int(s.total_size)
            e[2] += int(s.allocated_size)
            if first.get(int(s.address), -1) <= peak:
                e[3] += int(s.total_size)
        return [Pool(k, pool_owner(k), e[0], e[1], e[2], e[3], k != (0, 0) and k[1] == 0)
                for k, e in sorted(by.items(), key=lambda kv: (kv[0] != (0, 0), kv[0]))]

    @cached_property
    def conf(self) -> AllocConf:
        """The allocator config env var of this file's backend, and its value then."""
        snap = self._d.snapshot
        var = snap.kind.alloc_conf_var
        settings = snap.allocator_settings or {}
        cur = settings.get(var)
        if not isinstance(cur, str):
            cur = next((v for k, v in settings.items()
                        if k.endswith("_ALLOC_CONF") and isinstance(v, str)), "")
        return AllocConf(var, cur)

    @cached_property
    def expandable(self) -> bool:
        """Expandable segments were on (the settings, the segments or the config say so)."""
        snap = self._d.snapshot
        settings = snap.allocator_settings or {}
        return bool(settings.get("expandable_segments")) or bool(
            snap.kind.expandable_segments) or bool(
            re.search(r"expandable_segments\s*:\s*true", self.conf.value, re.I))

    @cached_property
    def expandable_fix(self) -> str:
        """Python that turns expandable segments on, keeping the settings already there (the
        shell form in a comment)."""
        var, cur = self.conf
        kept = [p for p in (x.strip() for x in cur.split(",")) if p and
                not p.lower().startswith("expandable_segments")]
        value = ",".join(kept + ["expandable_segments:True"])
        return ("import os\n\n"
                "# first thing in the script, before torch touches the device\n"
                f"# (or in the shell before launching: export {var}={value})\n"
                f"os.environ[\"{var}\"] = \"{value}\"")

    def next_alloc_size(self, rows: np.ndarray) -> np.ndarray:
        """Size of the first alloc at or after each row (0 when none): what a segment grew for."""
        trace = self._d.trace
        allocs = np.flatnonzero(trace.action == ALLOC)
        if not len(allocs):
            return np.zeros(len(rows), np.int64)
        k = np.searchsorted(allocs, rows)
        ok = k < len(allocs)
        out = np.zeros(len(rows), np.int64)
        out[ok] = trace.size[allocs[k[ok]]]
        return out
