"""The streaming reader (`_stream.c`): a snapshot read in one pass over the pickle's opcodes,
each device trace written straight into columns, never as per-entry dicts and lists.

It returns what `unpickle.read_raw_info` returns (the raw object, warnings, facts about the
file) with each device trace as a `StreamTrace` instead of a list of entry dicts; or None when
it declines the file (an opcode or a structure it does not implement, any irregular value,
a truncated or corrupt stream): the caller then reads the file with the checked Python path,
which gives the same Snapshot or the exact one-line error. `SNAPFORENSICS_STREAM=0` (or
`SNAPFORENSICS_PURE_PYTHON=1`) turns it off; where no C compiler was found it is not built.
"""

from __future__ import annotations

import gzip
import os
import zlib
from types import ModuleType
from typing import Any

import numpy as np

from snapforensics.snapshot.budget import Budget
from snapforensics.snapshot.columns import MAX_BYTES
from snapforensics.snapshot.model import A
from snapforensics.snapshot.unpickle import file_kind, pickle_bound, tname

_stream: ModuleType | None
try:
    from snapforensics.snapshot import _stream
except ImportError:  # built without a C compiler (types in _stream.pyi)
    _stream = None

OTHER = A["other"]
_NO_LIMIT = (1 << 63) - 1
last_decline = ""  # why the last file was declined (tests and benchmarks read it)


class StreamTrace:
    """One device trace as the streaming reader wrote it: the columns `_native.trace_columns`
    returns, the first rows' and last rows' keys, and the few per-row values normalization
    reads for special rows (oom's device_free, inline annotations' stage and name)."""

    __slots__ = ("n", "action", "addr", "size", "stream", "time_us", "group", "reps", "first",
                 "keys", "extras")

    def __init__(self, t: tuple) -> None:
        (self.n, a, ad, sz, st, tm, grp, self.reps, self.first, self.keys, self.extras) = t
        self.action = np.frombuffer(a, np.int8)
        self.addr = np.frombuffer(ad, np.uint64)
        self.size = np.frombuffer(sz, np.int64)
        self.stream = np.frombuffer(st, np.int64)
        self.time_us = np.frombuffer(tm, np.float64)
        self.group = np.frombuffer(grp, np.int32)

    def __len__(self) -> int:
        return int(self.n)

    def entry(self, i: int) -> dict:
        """The fields of row `i` normalization reads for special rows (oom, annotations)."""
        e: dict[str, Any] = {}
        g = int(self.group[i])
        if g >= 0:
            e["frames"] = self.reps[g]
        for k, rows in self.extras.items():
            if i in rows:
                e[k] = rows[i]
        return e


def reader() -> ModuleType | None:
    if os.environ.get("SNAPFORENSICS_PURE_PYTHON") or \
            os.environ.get("SNAPFORENSICS_STREAM", "").strip() == "0":
        return None
    return _stream


def read_info(path: str | os.PathLike, f: Any) -> tuple[Any, list[str], dict] | None:
    """`f` (opened by `open_file`) read as a stream; None when declined (then `f` is left at
    its start, open, for the Python path). On success `f` is closed."""
    global last_decline
    mod = reader()
    if mod is None:
        return None
    size, gzipped = file_kind(f, path)
    info: dict[str, Any] = {"file_bytes": size, "gzip": gzipped, "stale_bytes": 0}
    cap = max_in = pickle_bound(size, info["gzip"])
    src: Any = gzip.GzipFile(fileobj=f, mode="rb") if info["gzip"] else f
    rows = Budget(max_in).max_units if Budget(max_in).limited else _NO_LIMIT
    try:  # under the caller's memory guard (normalization.load)
        root, consumed, traces = mod.read(src, A, OTHER, MAX_BYTES, rows, max_in)
    except MemoryError:
        root, consumed, traces = None, "out of memory", 0
    if root is None:
        last_decline = str(consumed)
        f.seek(0)
        return None
    if traces:  # the list the reader made, of one tuple per device trace
        dt = root["device_traces"]
        dt[:] = [StreamTrace(t) for t in dt]
    warnings: list[str] = []
    damaged = ""
    if info["gzip"]:
        # Everything the stream holds after STOP, as `unpickle._gunzip` counts it.
        n = src.tell()
        try:
            while n <= cap and (chunk := src.read1(min(1 << 20, cap + 1 - n))):
                n += len(chunk)
        except (OSError, EOFError, zlib.error) as e:
            damaged = f"{tname(e)}: {str(e)[:200]}"
        cut = n > cap
        info["pickle_bytes"] = min(n, cap)
        stale = info["pickle_bytes"] - consumed
        if damaged:
            warnings.append("the gzip stream is damaged after the pickle end; ignored")
    else:
        cut = False
        info["pickle_bytes"] = size
        stale = size - consumed
    f.close()
    if stale > 0:
        info["stale_bytes"] = stale
        warnings.append(f"{'at least ' if cut else ''}{stale} stale bytes after the pickle end "
                        "(torch_npu rewrites snapshot files without truncating them); ignored")
    last_decline = ""
    return root, warnings, info
