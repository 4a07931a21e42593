"""Snapshot files in, one normalized interned model out."""

from snapforensics.snapshot.loader import (
    load,
    normalize,
    rank_from_name,
    read_raw,
    read_raw_info,
)
from snapforensics.snapshot.model import Frame, Snapshot, Trace

__all__ = ["load", "normalize", "read_raw", "read_raw_info", "rank_from_name", "Frame",
           "Snapshot", "Trace"]
