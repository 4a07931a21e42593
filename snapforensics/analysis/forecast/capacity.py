"""The forecast's capacity: a device size as the user writes it (`parse_size`), and what fits
in it (the smallest world size, the cheapest single change).
"""

from __future__ import annotations

import re
from dataclasses import replace

from snapforensics.analysis.forecast.documents import FULL, FULL_SHARD, Scenario
from snapforensics.analysis.forecast.replay import Forecaster

# World sizes tried for --capacity: powers of two (FSDP meshes are), up to 2**16 ranks.
_FIT_WORLDS = [2 ** i for i in range(17)]


def capacity_fit(fx: Forecaster, capacity: int, scen: list[Scenario], fixable: list[str]) -> dict:
    """Smallest world size that fits with the first scenario's settings, and, when the recorded
    configuration does not fit, the cheapest single change that fits at the recorded world
    size (a configuration that fits needs no change)."""
    base = fx.baseline()
    ref = scen[0] if scen else base
    peak = fx.d.peak_bytes
    out: dict = {"capacity_bytes": capacity, "recorded_fits": peak <= capacity,
                 "recorded_peak_bytes": peak}
    for w in _FIT_WORLDS:
        p = fx.predict(replace(ref, world_size=w))
        if p.refused or p.predicted_peak_bytes is None:
            out["smallest_world_size"] = None
            out["reason"] = p.refused
            break
        if p.predicted_peak_bytes <= capacity:
            out["smallest_world_size"] = w
            out["peak_bytes_there"] = p.predicted_peak_bytes
            break
    else:
        out["smallest_world_size"] = None
        out["reason"] = "does not fit at any world size up to 65536 (what does not shard " \
                        "exceeds the capacity)"
    # cheapest change at the recorded world size, in order of what it costs: resharding after
    # forward (one more all-gather per unit in backward), checkpointing (about one more
    # forward), half the micro-batch (twice the steps, or gradient accumulation)
    out["cheapest_change"] = None
    if out["recorded_fits"]:
        return out
    # fixing an anomaly costs nothing: tried first
    changes = [(replace(base, fix=r), {"fix": r}) for r in fixable] + [
        (replace(base, strategy=FULL_SHARD), {"strategy": FULL_SHARD}),
        (replace(base, checkpointing=FULL), {"checkpointing": FULL}),
        (replace(base, micro_batch_scale=0.5), {"micro_batch_scale": 0.5})]
    for sc, change in changes:
        if sc == base:
            continue
        p = fx.predict(sc)
        if p.predicted_peak_bytes is not None and p.predicted_peak_bytes <= capacity:
            out["cheapest_change"] = {"change": change, "peak_bytes": p.predicted_peak_bytes,
                                      "error_band": p.error_band}
            break
    return out


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '512MiB', '8e10B' -> bytes. The unit is required: a bare '80' is
    refused (80 bytes is never what a device has; 80 GiB is not guessed either)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?b?|b)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text[:40]!r} (e.g. 80GiB, 512MiB, 8e10B)")
    if not m.group(2):
        raise ValueError(f"{text.strip()[:40]!r} has no unit: write e.g. {text.strip()[:20]}GiB "
                         f"(2^30 bytes), {text.strip()[:20]}GB (10^9 bytes) or "
                         f"{text.strip()[:20]}B (bytes)")
    n = float(m.group(1))
    unit = m.group(2).rstrip("b")
    mult = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20,
            "gi": 2 ** 30, "ti": 2 ** 40}[unit]
    return int(n * mult)
