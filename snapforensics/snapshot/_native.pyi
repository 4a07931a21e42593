# Types of the C extension built from _native.c (optional: `native.native()` is None without it).
from typing_extensions import Buffer

def trace_columns(
    entries: list[object], actions: dict[str, int], other: int, max_bytes: int, /
) -> tuple[bytearray, bytearray, bytearray, bytearray, bytearray, bytearray, bytearray] | None:
    """(action int8, addr uint64, size int64, stream int64, time_us float64, group int32,
    reps int64) columns of one device trace, or None: the checked Python path reads it."""

def pair_events(
    row: Buffer, addr: Buffer, action: Buffer, rows: int, logs_requests: bool,
    alloc: int, free_requested: int, free_completed: int, /
) -> tuple[bytearray, bytearray, bytearray, bytearray, bytearray, int]:
    """(makes int8, free int64, done int64, born int64, end int8, reused): lifetimes' walk over
    int64 rows, uint64 addresses and int8 actions sorted by (address, row)."""
