"""Environment variables that tune the tool: each read here, parsed and range-checked, a
malformed or out-of-range value is one SnapError line (exit 2), never a traceback and never a
silently different setting (`nan` must not turn a limit off).

The CLI checks them all before any work (`cli.check_settings`), so a typo fails at once rather
than in a worker; the library reads each where it is used, through the same function.
"""

from __future__ import annotations

import math
import os

from snapforensics.errors import SnapError

# name -> (default, lowest, highest, integer, what it is)
NUMBERS: dict[str, tuple[float, float, float, bool, str]] = {
    # the expansion budget's factor (snapshot/budget.py); 0 = no limit
    "SNAPFORENSICS_EXPANSION": (1.0, 0.0, 1e6, False, "a factor >= 0 (0 = no limit)"),
    # the address space the unpickler may add, bytes (snapshot/unpickle.py); 0 = no cap
    "SNAPFORENSICS_LOAD_MEMORY": (0, 0, 1 << 60, True, "bytes >= 0 (0 = no cap)"),
    # seconds before the progress bar appears (parallel.py)
    "SNAPFORENSICS_PROGRESS_AFTER": (2.0, 0.0, 86400.0, False, "seconds, 0 to 86400"),
    # seconds to wait for the Dask scheduler's handshake (parallel.py)
    "SNAPFORENSICS_SCHEDULER_TIMEOUT": (10.0, 0.1, 3600.0, False, "seconds, 0.1 to 3600"),
}


def number(name: str) -> float:
    """The value of the numeric variable `name` (its default when unset or empty)."""
    default, lo, hi, integer, what = NUMBERS[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        v = int(text) if integer else float(text)
    except ValueError:
        v = math.nan
    if not (isinstance(v, int) or math.isfinite(v)) or not lo <= v <= hi:
        raise SnapError(f"{name}={text[:40]!r}: expected {what}")
    return v


__all__ = ["NUMBERS", "number"]
