"""Evidence shared by rules: bytes per module, the representative stack, counterfactual peaks."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from snapforensics.analysis.classify import PATHS
from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Replay
from snapforensics.analysis.vocab import Phase


def by_module(d: DeviceAnalysis, blocks: np.ndarray, limit: int = 12) -> list[dict]:
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for b in blocks.tolist():
        m = d.module_of(b) or "(unknown module)"
        acc[m][0] += int(d.lt.size[b])
        acc[m][1] += 1
    order = sorted(acc.items(), key=lambda mv: -mv[1][0])[:limit]
    return [{"module": m, "bytes": v[0], "blocks": v[1]} for m, v in order]


def top_stacks(d: DeviceAnalysis, blocks: np.ndarray, limit: int = 3) -> list[dict]:
    """Stacks that allocated the most bytes among `blocks`, largest first."""
    if not len(blocks):
        return []
    stacks = d.lt.stack[blocks]
    sizes = d.lt.size[blocks]
    uniq, inv = np.unique(stacks, return_inverse=True)
    tot = np.bincount(inv, weights=sizes)
    cnt = np.bincount(inv)
    order = np.argsort(-tot)[:limit]
    first = np.zeros(len(uniq), np.int64)
    first[inv[::-1]] = blocks[::-1]  # some block of each stack
    return [{"bytes": int(tot[i]), "blocks": int(cnt[i]), "stack": d.stack_text(int(uniq[i])),
             "category": d.category_names[d.category[first[i]]]} for i in order]


def per_iteration(d: DeviceAnalysis, blocks: np.ndarray) -> dict[int, int]:
    """Bytes of `blocks` by the iteration that allocated them."""
    its, inv = np.unique(d.iteration[blocks], return_inverse=True)
    if not len(blocks):
        return {}
    sums = np.bincount(inv, weights=d.lt.size[blocks])
    return {int(i): int(v) for i, v in zip(its, sums)}


def max_alive(d: DeviceAnalysis, blocks: np.ndarray) -> int:
    """Most bytes of `blocks` alive at once."""
    if not len(blocks):
        return 0
    rows = np.concatenate([d.lt.alloc_row[blocks], d.lt.free_row[blocks]])
    delta = np.concatenate([d.lt.size[blocks], -d.lt.size[blocks]])
    order = np.lexsort((delta, rows))  # frees before allocs on the same row
    return int(np.cumsum(delta[order]).max())


def by_path(d: DeviceAnalysis, blocks: np.ndarray) -> dict[str, int]:
    """Bytes of `blocks` by the FSDP path that unsharded them."""
    out: dict[str, int] = {}
    for b in blocks.tolist():
        p = PATHS[d.path[b]] if d.path[b] >= 0 else "unknown"
        out[p] = out.get(p, 0) + int(d.lt.size[b])
    return out


def peaks(d: DeviceAnalysis, live: np.ndarray) -> dict[str, int]:
    """Overall, forward and backward peaks of a live-bytes series over this trace's phases."""
    ph = d.tl.phase
    fw = ph == Phase.FORWARD
    bw = (ph == Phase.BACKWARD) | (ph == Phase.RECOMPUTE)
    return {"overall_bytes": int(live.max()) if len(live) else 0,
            "forward_bytes": int(live[fw].max()) if fw.any() else 0,
            "backward_bytes": int(live[bw].max()) if bw.any() else 0}


# A finding is `anomalous` only if removing it lowers this run's peak: by at least this share.
# Smaller differences are within what re-recording the same run moves the peak by (allocation
# order around collectives on CPU, block rounding on a caching allocator), so no fix could be
# seen to lower it.
MIN_PEAK_SAVING = 0.02


def lowers_peak(d: DeviceAnalysis, saving: int | None) -> bool:
    """Does a counterfactual that saves `saving` bytes of this device's peak lower the peak?"""
    return saving is not None and saving >= MIN_PEAK_SAVING * d.peak_bytes


def counterfactual(d: DeviceAnalysis, free_row: np.ndarray | None = None,
                   alloc_row: np.ndarray | None = None, extra: tuple = ()
                   ) -> tuple[dict[str, int], Replay]:
    """Peaks of the trace replayed with a fix's moved rows, and that replay (a finding keeps
    it, so the forecast can apply the fix before its own scenario)."""
    r = Replay(free_row, alloc_row, tuple(extra))
    return peaks(d, d.lt.replay(free_row=free_row, alloc_row=alloc_row, extra=list(extra))), r


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def seen_in(d: DeviceAnalysis, iterations, worst: int) -> str:
    """Where a state was seen, for a cause: "in every iteration (0-2), most in 2" or "in
    iterations 1, 2 of 0-3, most in 2": a state repeated in every iteration is a property of
    the configuration, one seen in some only depends on what those iterations did."""
    seen = sorted({int(i) for i in iterations})
    n = len(d.tl.iterations)
    every = f"0-{n - 1}" if n > 1 else "0"
    if n <= 1:
        return f"in iteration {worst}, the only one in the trace"
    most = f", most in {worst}" if len(seen) > 1 else ""
    if seen == list(range(n)):
        return f"in every iteration ({every}){most}"
    return f"in iteration{'s' if len(seen) > 1 else ''} {_list(seen)} of {every}{most}"


def _list(ix: list[int]) -> str:
    if len(ix) > 2 and ix == list(range(ix[0], ix[-1] + 1)):
        return f"{ix[0]}-{ix[-1]}"
    return ", ".join(map(str, ix))
