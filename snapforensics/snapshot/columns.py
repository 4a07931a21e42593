"""Checking single values and whole columns from the file: types, ranges, short safe names.

Shared by the unpickler's messages, the interner and normalization. A wrong type or an
impossible value is a one-line SnapError naming where it is, never a silently wrong number.
"""

from __future__ import annotations

import math
from itertools import repeat
from typing import Any

import numpy as np

from snapforensics.errors import SnapError

MAX_BYTES = 1 << 50  # 1 PiB: no single allocation or segment is larger; bigger means corrupt
MAX_TOTAL = 1 << 62  # sums of sizes must stay far from int64 overflow
MAX_DEVICE = 1 << 16
# |time_us| beyond this (285 years from the epoch) is no clock's reading: such a trace is
# untimed. Below it, spans and differences of times stay finite and exact in float64.
MAX_TIME_US = float(1 << 53)
_INT = {int}
_NUM_OR_NONE = {int, float, type(None)}
LISTS = (list, tuple)


def short(v: Any) -> str:
    """A safe, bounded description of a value from the file (never recurses into it)."""
    if isinstance(v, str):
        s = v if len(v) <= 60 else v[:57] + "..."
        return repr(s).encode("ascii", "backslashreplace").decode()
    if type(v) is int and v.bit_length() > 128:  # repr of a 5,000-digit int raises
        return f"an int of {v.bit_length()} bits"
    if type(v) in (int, float, bool) or v is None:
        s = repr(v)
        return s if len(s) <= 40 else s[:37] + "..."
    return f"a {type(v).__name__}"


def tname(v: Any) -> str:
    return type(v).__name__


def clean_str(s: str) -> str:
    """Lone surrogates (possible in a pickle) break every UTF-8 writer downstream."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "replace").decode("utf-8")


def at(where: str, row: int | None) -> str:
    return where if row is None else f"{where}[{row}]"


def check_types(col: list, allowed: set, where_dev: str, field: str, expected: str) -> None:
    found = set(map(type, col))
    if found <= allowed:
        return
    for i, v in enumerate(col):
        if type(v) not in allowed:
            raise SnapError(f"{where_dev}[{i}]: {field} must be {expected}, got {tname(v)}")


def check_int(v: Any, where: str, field: str, *, lo: int = 0, hi: int = (1 << 64) - 1) -> int:
    if type(v) is not int:
        raise SnapError(f"{where}: {field} must be an int, got {tname(v)}")
    if v < lo or v > hi:
        raise SnapError(f"{where}: {field} {short(v)} is out of range")
    return v


def check_time(v: Any, where: str) -> float:
    """A time in µs; NaN when missing, inf when too large for a float (`absurd_times` says
    which are usable)."""
    if v is None:
        return math.nan
    if type(v) not in (int, float):
        raise SnapError(f"{where}: time_us must be a number, got {tname(v)}")
    try:
        return float(v)
    except OverflowError:
        return math.inf


def absurd_times(t: np.ndarray) -> bool:
    """Whether any time is infinite or beyond MAX_TIME_US (NaN: missing, not absurd)."""
    with np.errstate(invalid="ignore"):
        return bool((np.abs(t) > MAX_TIME_US).any())


def column(entries: list, key: str, default: Any = None) -> list:
    return list(map(dict.get, entries, repeat(key), repeat(default)))


def uint64_column(col: list, where_dev: str, field: str) -> np.ndarray:
    check_types(col, _INT, where_dev, field, "an int")
    try:
        return np.array(col, np.uint64)
    except (OverflowError, ValueError):
        for i, v in enumerate(col):
            if not 0 <= v < (1 << 64):
                raise SnapError(f"{where_dev}[{i}]: {field} {short(v)} is out of range") from None
        raise SnapError(f"{where_dev}: {field} is out of range") from None


def size_column(col: list, where_dev: str, field: str) -> np.ndarray:
    check_types(col, _INT, where_dev, field, "an int")
    try:
        arr = np.array(col, np.int64)
    except (OverflowError, ValueError):
        arr = None
    if arr is None or (len(arr) and (int(arr.min()) < 0 or int(arr.max()) > MAX_BYTES)):
        for i, v in enumerate(col):
            if not 0 <= v <= MAX_BYTES:
                raise SnapError(f"{where_dev}[{i}]: {field} {short(v)} is out of range "
                                "(negative or beyond any device)")
        raise SnapError(f"{where_dev}: {field} is out of range")
    check_size_total(arr, where_dev, field)
    return arr


def check_size_total(arr: np.ndarray, where_dev: str, field: str) -> None:
    if len(arr) and float(arr.sum(dtype=np.float64)) > MAX_TOTAL:
        raise SnapError(f"{where_dev}: {field}s add up to more than any device could hold")


def time_column(col: list, where_dev: str) -> np.ndarray:
    check_types(col, _NUM_OR_NONE, where_dev, "time_us", "a number")
    try:
        return np.array(col, np.float64)
    except (OverflowError, ValueError, TypeError):  # an int too large for a float
        return np.array([check_time(v, where_dev) for v in col], np.float64)


class BadExtra(ValueError):
    """An extra key of the recorder's (tensor names, the map of compiled code) is malformed."""


def read_extra(raw: dict, key: str, what: str, parse: Any, warnings: list[str]) -> Any:
    """`parse(raw[key])`, None when the key is absent or malformed: an extra is never the file's
    failure, a malformed one is dropped with one warning."""
    v = raw.get(key)
    if v is None:
        return None
    try:
        return parse(v)
    except BadExtra as e:
        warnings.append(f"'{key}' ({what}) {e}; ignored")
        return None
