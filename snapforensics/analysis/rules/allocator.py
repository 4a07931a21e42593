"""Shared facts about the caching allocator and the iterations, for the allocator / lifecycle rules.

Not a rule itself (no RULE): the helpers the rules `allocator_*`, `leak_iteration_growth`,
`activations_checkpointing` and `oom_report` share. Everything works on the arrays of one
`DeviceAnalysis` (and the dump's segment list), never on the raw trace.

Reserved bytes over time: the file has the segments alive at dump (their `total_size` is what
the allocator held from the driver then) and logs `segment_alloc` / `segment_map` (reserved grows)
and `segment_free` / `segment_unmap` (it shrinks). Walking those rows *backwards from the dump*
gives the reserved bytes after every row, exact for every row the ring buffer still holds even
when its start was lost (the dump is the anchor, not the first row).
"""

from __future__ import annotations

import re

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis, is_noise
from snapforensics.snapshot.model import (
    ALLOC,
    NO_STACK,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
)

# The CUDA / NPU caching allocator's large-pool granularity: a request between 1 and 10 MiB gets
# a 20 MiB segment (kLargeBuffer). Gaps between reserved and allocated below a couple of these
# are the allocator's rounding, not something a setting can remove.
LARGE_SEGMENT = 20 << 20


def caching_allocator(d: DeviceAnalysis) -> bool:
    """False for CPU-recorded snapshots: no caching allocator, no segments, no streams."""
    return d.snapshot.kind.caching_allocator


def device_segments(d: DeviceAnalysis) -> list:
    return [s for s in d.snapshot.segments if s.device == d.device]


def reserved_series(d: DeviceAnalysis) -> np.ndarray | None:
    """Reserved bytes right after each row, reconstructed backwards from the dump's segments.

    None when the dump's segments cannot be the anchor of this trace (no segments for the
    device and no segment rows, or reserved would fall below the live bytes: a synthetic or
    mismatched file).
    """
    segs = device_segments(d)
    n = len(d.trace)
    act = d.trace.action
    up = (act == SEGMENT_ALLOC) | (act == SEGMENT_MAP)
    down = (act == SEGMENT_FREE) | (act == SEGMENT_UNMAP)
    # no segments at dump is a valid anchor (0 reserved, e.g. after empty_cache) only when the
    # trace shows segments coming and going; otherwise the file just has no segment list
    if not n or (not segs and not (up.any() or down.any())):
        return None
    size = d.trace.size.astype(np.int64)
    delta = np.zeros(n, np.int64)
    delta[up] = size[up]
    delta[down] = -size[down]
    later = np.cumsum(delta[::-1])[::-1] - delta  # sum of delta over rows after r
    reserved = int(sum(s.total_size for s in segs)) - later
    live = d.lt.live
    if len(live) and (reserved - live).min() < -0.01 * max(int(live.max()), 1):
        return None
    return reserved


def alloc_conf(d: DeviceAnalysis) -> tuple[str, str]:
    """(env var, its current value) of the allocator config for this file's backend."""
    var = d.snapshot.kind.alloc_conf_var
    settings = d.snapshot.allocator_settings or {}
    cur = settings.get(var)
    if not isinstance(cur, str):
        cur = next((v for k, v in settings.items()
                    if k.endswith("_ALLOC_CONF") and isinstance(v, str)), "")
    return var, cur


def expandable_on(d: DeviceAnalysis) -> bool:
    settings = d.snapshot.allocator_settings or {}
    _, conf = alloc_conf(d)
    return bool(settings.get("expandable_segments")) or bool(
        d.snapshot.kind.expandable_segments) or bool(
        re.search(r"expandable_segments\s*:\s*true", conf, re.I))


def expandable_fix(d: DeviceAnalysis) -> str:
    """The shell line that turns expandable segments on, keeping the settings already there."""
    var, cur = alloc_conf(d)
    kept = [p for p in (x.strip() for x in cur.split(",")) if p and
            not p.lower().startswith("expandable_segments")]
    value = ",".join(kept + ["expandable_segments:True"])
    return (f"export {var}={value}   # before the process starts (torchrun inherits it)\n"
            f"# or first thing in the script, before torch touches the device:\n"
            f"#   os.environ[\"{var}\"] = \"{value}\"")


def next_alloc_size(d: DeviceAnalysis, rows: np.ndarray) -> np.ndarray:
    """Size of the first alloc at or after each row (0 when none): what a segment grew for."""
    allocs = np.flatnonzero(d.trace.action == ALLOC)
    if not len(allocs):
        return np.zeros(len(rows), np.int64)
    k = np.searchsorted(allocs, rows)
    ok = k < len(allocs)
    out = np.zeros(len(rows), np.int64)
    out[ok] = d.trace.size[allocs[k[ok]]]
    return out


# ---------------------------------------------------------------------------- stacks

_INSTANCE = re.compile(r"^(.*?)_(\d+)$")


def user_frame(d: DeviceAnalysis, stack_id: int) -> str | None:
    """The innermost frame of the user's own code (not torch, not an op or module marker)."""
    for f in d.snapshot.stack_frames(stack_id):
        fn = f.filename.replace("\\", "/")
        if is_noise(f) or fn.startswith("<") or "/torch/" in fn or fn.startswith("torch/") \
                or "site-packages/" in fn or "/runpy" in fn or f.name == "<module>":
            continue
        return str(f)
    return None


def generic_keys(d: DeviceAnalysis, stacks: np.ndarray) -> np.ndarray:
    """A key per stack that is the same for every repetition of a layer.

    Code stacks are already identical across layers; recordings that carry `<nn.Module>` frames
    (`Linear_24`, `FSDPBlock_3`) name the instance, so the numeric suffix is dropped.
    """
    uniq, inv = np.unique(stacks, return_inverse=True)
    keys: dict[tuple, int] = {}
    ids = []
    for s in uniq.tolist():
        if s == NO_STACK:
            key: tuple = ("<no stack>",)
        else:
            key = tuple((f.filename, _INSTANCE.sub(r"\1", f.name) if f.filename == "<nn.Module>"
                         else f.name, f.line) for f in d.snapshot.stack_frames(s))
        ids.append(keys.setdefault(key, len(keys)))
    return np.array(ids, np.int64)[inv] if len(ids) else np.zeros(0, np.int64)


def repeated_module(d: DeviceAnalysis, stacks: np.ndarray, repeats: int) -> str | None:
    """The outermost `<nn.Module>` class with exactly `repeats` instances among these stacks."""
    inst: dict[str, set[str]] = {}
    depth: dict[str, int] = {}
    for s in np.unique(stacks).tolist():
        frames = d.snapshot.stack_frames(s)
        for pos, f in enumerate(frames):
            if f.filename != "<nn.Module>":
                continue
            m = _INSTANCE.match(f.name)
            if not m:
                continue
            inst.setdefault(m.group(1), set()).add(m.group(2))
            depth[m.group(1)] = max(depth.get(m.group(1), 0), pos)
    cands = [c for c, v in inst.items() if len(v) == repeats]
    if not cands:
        return None
    name = max(cands, key=lambda c: depth[c])
    # FSDP2 swaps the class of a sharded module for a dynamic `FSDP<Class>`
    return name[4:] if name.startswith("FSDP") and len(name) > 4 else name
