"""The file's metadata (the recorder's `snapforensics` block, `allocator_settings`): a bounded
copy of plain JSON-like data, or dropped with a warning."""

from __future__ import annotations

from typing import Any

from snapforensics.snapshot.columns import (
    LISTS,
    clean_str,
    tname,
)

_PLAIN = (str, int, float, bool, type(None))
_METADATA_ITEMS = 100_000  # provenance and allocator settings hold tens of items


def _plain(v: Any, left: list[int], skip: set[int], depth: int = 0) -> Any:
    """A bounded copy of JSON-like metadata (at most `left[0]` items in all, however shared);
    raises ValueError for anything else, and for the objects in `skip` (by id)."""
    if id(v) in skip:
        raise ValueError("refers back to the snapshot's own root or device traces")
    t = type(v)
    left[0] -= 1
    if left[0] < 0:
        raise ValueError("too large")
    if t in _PLAIN:
        if t is int and not -(1 << 63) <= v < (1 << 64):
            raise ValueError("int out of range")
        return clean_str(v) if t is str else v
    if depth >= 6:
        raise ValueError("nested too deeply")
    if t in LISTS or t is dict:
        if len(v) > 10_000:
            raise ValueError("too large")
        if t is dict:
            return {clean_str(k): _plain(x, left, skip, depth + 1) for k, x in v.items()
                    if type(k) is str}
        return [_plain(x, left, skip, depth + 1) for x in v]
    raise ValueError(f"{t.__name__} is not plain data")


def metadata(raw: dict, key: str, warnings: list[str]) -> dict:
    v = raw.get(key)
    if v is None:
        return {}
    if type(v) is not dict:
        warnings.append(f"'{key}' is {tname(v)}, expected a dict; ignored")
        return {}
    # The root and the device traces, reached through the memo, are what the two readers hold
    # differently (the streaming reader's traces are columns): metadata never copies them.
    dt = raw.get("device_traces")
    skip = {id(raw), id(dt), *(map(id, dt) if dt is not None and type(dt) in LISTS else ())}
    try:
        return _plain(v, [_METADATA_ITEMS], skip)
    except ValueError as e:
        warnings.append(f"'{key}' is not plain data ({e}); ignored")
        return {}

