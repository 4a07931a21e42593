"""Snapshot files in, one normalized interned model out.

unpickle.py reads the file safely, normalization.py validates it into the model (model.py) with
intern.py's tables and format.py's verdict on what kind of file it is.
"""

from snapforensics.snapshot.format import rank_from_name
from snapforensics.snapshot.model import Frame, Snapshot, Trace
from snapforensics.snapshot.normalization import load, normalize
from snapforensics.snapshot.unpickle import read_raw, read_raw_info

__all__ = [
           "Frame",
           "Snapshot",
           "Trace",
           "load",
           "normalize",
           "rank_from_name",
           "read_raw",
           "read_raw_info",
]
