"""Evidence shared by rules: bytes per module, the representative stack, counterfactual peaks."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from snapforensics.analysis.classify import BACKWARD, CATEGORIES, FORWARD, RECOMPUTE
from snapforensics.analysis.context import DeviceAnalysis


def by_module(d: DeviceAnalysis, blocks: np.ndarray, limit: int = 12) -> list[dict]:
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for b in blocks.tolist():
        m = d.module_of(b) or "(unknown module)"
        acc[m][0] += int(d.lt.size[b])
        acc[m][1] += 1
    rows = [{"module": m, "bytes": v[0], "blocks": v[1]} for m, v in acc.items()]
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:limit]


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
             "category": CATEGORIES[d.category[first[i]]]} for i in order]


def peaks(d: DeviceAnalysis, live: np.ndarray) -> dict[str, int]:
    """Overall, forward and backward peaks of a live-bytes series over this trace's phases."""
    ph = d.tl.phase
    fw = ph == FORWARD
    bw = (ph == BACKWARD) | (ph == RECOMPUTE)
    return {"overall_bytes": int(live.max()) if len(live) else 0,
            "forward_bytes": int(live[fw].max()) if fw.any() else 0,
            "backward_bytes": int(live[bw].max()) if bw.any() else 0}


def replay_peaks(d: DeviceAnalysis, free_row: np.ndarray) -> dict[str, int]:
    """Peaks of the trace replayed with moved frees."""
    return peaks(d, d.lt.replay(free_row))


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
