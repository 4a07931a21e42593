"""The recorder's tensor names (`snapforensics_tensors`, written by `record/identity.py`).

A top-level key beside `segments` and `device_traces` (torch's `_memory_viz` reads only those):

    {"format": "snapforensics.tensors/2", "clock": "epoch_us", "kinds": [...],
     "identities": [[tensor, kind, module, shape, dtype, device, tp], ...],
     "ptr": [...], "offset": [...], "nbytes": [...], "time_us": [...], "identity": [...],
     "observations_made": N, "errors": [...], ...}

Each observation says: at `time_us` (the trace's clock), the storage whose data pointer is
`ptr` held identity `identity` (`offset` bytes in, `nbytes` long). `tensor` and `module` may be
None (a saved activation has no name; a root parameter no module). `tp` is how many ways tensor
parallelism splits the tensor (its DTensor placement on the mesh's `tp` dimension, or a saved
activation between a column-wise module's output and the row-wise module that takes it), 1 for
one TP replicates, 0 unknown; format /1 (6 items) has none (read as 0). Validated here: anything
irregular drops the whole key with one warning (the names are an extra, never the file's
failure). The join to blocks is `analysis/identity.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from snapforensics.snapshot.columns import (
    LISTS,
    MAX_BYTES,
    MAX_DEVICE,
    BadExtra,
    clean_str,
    read_extra,
    short,
    tname,
)

KEY = "snapforensics_tensors"
FORMAT = "snapforensics.tensors/2"
FORMATS = {"snapforensics.tensors/1": 6, FORMAT: 7}  # -> items per identity
# the most ways TP splits a tensor (real TP degrees stay within a node or two: 8-64); bounds a
# forecast's scale factor tp0 / tp so a 2^50-byte block times it stays an exact int64
MAX_TP = 1 << 12
KINDS = ("parameter", "gradient", "optimizer_state", "unsharded_parameter", "unsharded_gradient",
         "all_gather_buffer", "saved_for_backward")
MAX_OBSERVATIONS = 4_000_000
MAX_IDENTITIES = 1_000_000
MAX_NAME = 4096
MAX_DIMS = 64
_COLUMNS = ("ptr", "offset", "nbytes", "time_us", "identity")


@dataclass(frozen=True)
class Identity:
    tensor: str | None
    kind: str  # one of KINDS
    module: str | None
    shape: tuple[int, ...]
    dtype: str
    device: int
    tp: int = 0  # ways tensor parallelism splits it (1: replicated, 0: unknown)


@dataclass
class TensorTable:
    identities: list[Identity]
    ptr: np.ndarray  # uint64: the storage's data pointer (a block's address)
    offset: np.ndarray  # int64: the tensor's bytes into it
    nbytes: np.ndarray  # int64
    time_us: np.ndarray  # float64, the trace's clock
    identity: np.ndarray  # int32 into identities
    notes: dict[str, Any] = field(default_factory=dict)  # observations_made, errors, ...

    def __len__(self) -> int:
        return len(self.ptr)


_Bad = BadExtra


def _str(v: Any, none: bool = True) -> str | None:
    if v is None and none:
        return None
    if type(v) is not str:
        raise _Bad(f"a name is {tname(v)}")
    if len(v) > MAX_NAME:
        raise _Bad("a name is too long")
    return clean_str(v)


def _identity(e: Any, items: int) -> Identity:
    if type(e) not in LISTS or len(e) != items:
        raise _Bad(f"an identity is not a {items}-item list")
    tensor, kind, module, shape, dtype, device = e[:6]
    tp = e[6] if items > 6 else 0
    if type(tp) is not int or not 0 <= tp <= MAX_TP:
        raise _Bad("a TP split is not a count")
    if kind not in KINDS:
        raise _Bad(f"unknown kind {str(kind)[:40]!r}")
    if type(shape) not in LISTS or len(shape) > MAX_DIMS or any(
            type(s) is not int or not 0 <= s < (1 << 62) for s in shape):
        raise _Bad("a shape is not a list of sizes")
    if type(device) is not int or not 0 <= device < MAX_DEVICE:
        raise _Bad("a device is not an index")
    return Identity(_str(tensor), str(kind), _str(module), tuple(shape), _str(dtype, False) or "",
                    device, tp)


def _column(v: Any, name: str, dtype: Any, lo: float, hi: float) -> np.ndarray:
    if type(v) not in LISTS:
        raise _Bad(f"'{name}' is {tname(v)}, expected a list")
    allowed = {float, int} if dtype is np.float64 else {int}
    if not set(map(type, v)) <= allowed:
        raise _Bad(f"'{name}' holds something else than numbers")
    try:
        a = np.array(v, dtype)
    except (OverflowError, ValueError):
        raise _Bad(f"'{name}' is out of range") from None
    if len(a) and (not np.isfinite(a.astype(np.float64)).all() or a.min() < lo or a.max() > hi):
        raise _Bad(f"'{name}' is out of range")
    return a


def read(raw: dict, warnings: list[str]) -> TensorTable | None:
    """The table in `raw[KEY]`, None when absent or dropped (with a warning)."""
    return read_extra(raw, KEY, "the recorder's tensor names", _read, warnings)


def _read(v: Any) -> TensorTable | None:
    if type(v) is not dict:
        raise _Bad(f"is {tname(v)}, expected a dict")
    fmt = v.get("format")
    items = FORMATS.get(fmt) if type(fmt) is str else None
    if items is None:
        raise _Bad(f"has format {short(v.get('format'))}, expected {FORMAT!r}")
    ids = v.get("identities", [])
    if type(ids) not in LISTS or len(ids) > MAX_IDENTITIES:
        raise _Bad("has no list of identities")
    ptr = v.get("ptr", [])
    n = len(ptr) if type(ptr) in LISTS else 0  # a non-list is refused by its column below
    if n > MAX_OBSERVATIONS:
        raise _Bad(f"has {n} observations, more than {MAX_OBSERVATIONS}")
    identities = [_identity(e, items) for e in ids]
    cols = {
        "ptr": _column(v.get("ptr", []), "ptr", np.uint64, 0, (1 << 64) - 1),
        "offset": _column(v.get("offset", []), "offset", np.int64, 0, MAX_BYTES),
        "nbytes": _column(v.get("nbytes", []), "nbytes", np.int64, 0, MAX_BYTES),
        "time_us": _column(v.get("time_us", []), "time_us", np.float64, 0, float(1 << 53)),
        "identity": _column(v.get("identity", []), "identity", np.int64, 0,
                            max(len(identities) - 1, 0)),
    }
    if any(len(c) != n for c in cols.values()):
        raise _Bad("has columns of different lengths")
    if n and not identities:
        raise _Bad("has observations but no identities")
    notes: dict[str, Any] = {}
    for k in ("observations_made", "identities_dropped"):
        if type(v.get(k)) is int and v[k] >= 0:
            notes[k] = v[k]
    if type(v.get("step_hooks_s")) in (int, float):
        notes["step_hooks_s"] = float(v["step_hooks_s"])
    errs: Any = v.get("errors")
    if type(errs) in LISTS:
        notes["errors"] = [clean_str(e[:300]) for e in errs[:5] if type(e) is str]
    return TensorTable(identities, cols["ptr"], cols["offset"], cols["nbytes"], cols["time_us"],
                       cols["identity"].astype(np.int32), notes)
