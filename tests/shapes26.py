"""Issue 26's ten shapes of hostile snapshot, assembled opcode by opcode (tests/hostile.py's
assembler): each builder writes one file under `d` and returns its path. Sizes are the smallest
that show the defect on the code before the fix (a crash, a wrong answer, a quadratic time or a
memory peak far beyond the file) while staying a few seconds once fixed.
"""

from __future__ import annotations

import gzip
import struct
from collections.abc import Callable
from pathlib import Path

from hostile import (
    APPEND,
    APPENDS,
    EMPTY_DICT,
    EMPTY_LIST,
    EMPTY_TUPLE,
    MARK,
    MEMOIZE,
    PROTO,
    SETITEMS,
    STOP,
    TUPLE1,
    f,
    get,
    i,
    pkl,
    s,
)

TUPLE2 = b"\x86"
BINPUT4 = b"r"  # LONG_BINPUT
FRAME = b"\x95"


def _write(d: Path, name: str, data: bytes) -> Path:
    p = d / name
    p.write_bytes(data)
    return p


def _frame(name: str, line: int = 1) -> bytes:
    return (EMPTY_DICT + MARK + s("filename") + s("m.py") + s("line") + i(line) + s("name")
            + s(name) + SETITEMS)


KEYS = ("action", "addr", "size", "stream", "time_us", "frames")


def _entry_memo(frames: bytes, first_memo: int | None, at: int, addr: int, t: float,
                extra: bytes = b"") -> bytes:
    """An entry whose keys are memoized as the pickler writes them: the first entry (at memo
    index `first_memo`) writes each key and MEMOIZEs it, the rest BINGET it."""
    def k(j: int) -> bytes:
        return s(KEYS[j]) + MEMOIZE if first_memo is not None else get(at + j)
    return (EMPTY_DICT + MARK + k(0) + s("alloc") + k(1) + i(addr) + k(2) + i(512) + k(3)
            + i(0) + k(4) + f(t) + extra + k(5) + frames + SETITEMS)


def _entry(frames: bytes, size: int = 512, addr: int = 1 << 20, extra: bytes = b"",
           action: str = "alloc", t: float = 1.0) -> bytes:
    return (EMPTY_DICT + MARK + s("action") + s(action) + s("addr") + i(addr) + s("size")
            + i(size) + s("stream") + i(0) + s("time_us") + f(t) + extra + s("frames") + frames
            + SETITEMS)


class Memo:
    """MEMOIZE numbering, so builders can refer back to what they wrote."""

    def __init__(self) -> None:
        self.n = 0

    def put(self) -> tuple[bytes, int]:
        self.n += 1
        return MEMOIZE, self.n - 1


def _root(m: Memo, before: bytes, traces: bytes) -> bytes:
    """{**before, 'segments': [], 'device_traces': traces}: `before` are (key, value) bytes."""
    mem, _ = m.put()  # the root dict
    return (EMPTY_DICT + mem + MARK + before + s("segments") + EMPTY_LIST + s("device_traces")
            + traces + SETITEMS)


def deep_pool(d: Path) -> Path:
    """1: an entry's pool_id a tuple nested 300,000 deep (hashed after the load)."""
    pool = EMPTY_TUPLE + TUPLE1 * 300_000
    e = _entry(EMPTY_LIST, extra=s("pool_id") + pool)
    return _write(d, "deep_pool.pickle", pkl(_root(Memo(), b"", EMPTY_LIST + EMPTY_LIST + MARK
                                                   + e + APPENDS + APPEND)))


def shared_frames(d: Path, frames: int = 40_000, rows: int = 40_000) -> Path:
    """2: one long frames list, made outside any entry, shared through the memo by every row."""
    m = Memo()
    m.put()  # root
    fl = EMPTY_LIST + MEMOIZE + MARK + b"".join(_frame(f"f{k}", k) for k in range(frames)) + APPENDS
    idx = 1  # memo: 0 root, 1 the shared list, 2-7 the entry keys
    body = (EMPTY_DICT + MEMOIZE + MARK + s("shared") + fl + s("segments") + EMPTY_LIST
            + s("device_traces") + EMPTY_LIST + EMPTY_LIST + MARK
            + b"".join(_entry_memo(get(idx), 2 if k == 0 else None, 2, (k + 1) << 12, float(k))
                       for k in range(rows))
            + APPENDS + APPEND + SETITEMS)
    return _write(d, "shared_frames.pickle", pkl(body))


def frames_grown_after_use(d: Path) -> Path:
    """3: entry A uses list L (made outside the trace); entry B's own list has L's contents;
    entry C appends a frame to L: pickle gives A the grown list, B the old contents."""
    # memo: 0 root, 1 L, 2 frame f1 (inside L)
    L = EMPTY_LIST + MEMOIZE + _frame("f1") + MEMOIZE + APPEND
    a = _entry(get(1), size=64 << 20, addr=1 << 30)
    b = _entry(EMPTY_LIST + get(2) + APPEND, size=32 << 20, addr=2 << 30, t=2.0)
    c = _entry(EMPTY_LIST, size=512, addr=3 << 30, t=3.0,
               extra=s("note") + get(1) + _frame("f2", 2) + APPEND)
    body = (EMPTY_DICT + MEMOIZE + MARK + s("shared") + L + s("segments") + EMPTY_LIST
            + s("device_traces") + EMPTY_LIST + EMPTY_LIST + MARK + a + b + c + APPENDS
            + APPEND + SETITEMS)
    return _write(d, "frames_grown.pickle", pkl(body))


def frames_twice(d: Path) -> Path:
    """4: an entry dict with its frames key set twice (pickle keeps the second); the first,
    discarded, names a torch_npu frame (the reader before issue 26 kept its stack: a different
    document)."""
    e = (_entry(EMPTY_LIST + _frame("c10_npu::NPUCachingAllocator::malloc") + APPEND,
                size=64 << 20)
         + s("frames") + EMPTY_LIST + _frame("second") + APPEND + b"s")
    e2 = _entry(EMPTY_LIST + _frame("other") + APPEND, addr=2 << 20, t=2.0)
    return _write(d, "frames_twice.pickle", pkl(_root(Memo(), b"", EMPTY_LIST + EMPTY_LIST
                                                      + MARK + e + e2 + APPENDS + APPEND)))


def _small_doc(m: Memo) -> bytes:
    return _root(m, b"", EMPTY_LIST + EMPTY_LIST + MARK + _entry(EMPTY_LIST) + APPENDS + APPEND)


def memoize_after_mark(d: Path) -> Path:
    """5a: MEMOIZE right after a trace list's MARK (pickle: unexpected MARK found)."""
    body = _root(Memo(), b"", EMPTY_LIST + EMPTY_LIST + MARK + MEMOIZE + _entry(EMPTY_LIST)
                 + APPENDS + APPEND)
    return _write(d, "memoize_after_mark.pickle", PROTO + body + STOP)


def mark_before_stop(d: Path) -> Path:
    """5b: MARK right before STOP."""
    return _write(d, "mark_before_stop.pickle", PROTO + _small_doc(Memo()) + MARK + STOP)


def two_marks_appends(d: Path) -> Path:
    """5c: two MARKs then APPENDS on a trace list (pickle: unexpected MARK found)."""
    body = _root(Memo(), b"", EMPTY_LIST + EMPTY_LIST + MARK + MARK + _entry(EMPTY_LIST)
                 + APPENDS + APPENDS + APPEND)
    return _write(d, "two_marks_appends.pickle", PROTO + body + STOP)


def frame_straddle(d: Path) -> Path:
    """6: a FRAME whose end falls inside an opcode's argument, gzipped. CPython's C unpickler
    refuses it from a buffer (the gzip path's BytesIO) and reads it from a file, so a plain
    file reads and a gzipped one does not, in every path alike."""
    body = _small_doc(Memo()) + STOP
    cut = 7  # inside the first SHORT_BINUNICODE ('segments'... after '}', MEMOIZE, MARK)
    return _write(d, "frame_straddle.pickle.gz",
                  gzip.compress(PROTO + FRAME + struct.pack("<Q", cut) + body))


def colliding_int_keys(d: Path, n: int = 150_000) -> Path:
    """7: a dict whose integer keys all hash to 0 (multiples of 2^61-1)."""
    p61 = (1 << 61) - 1
    keys = b"".join(i(k * p61) + b"N" for k in range(1, n + 1))
    before = s("allocator_settings") + EMPTY_DICT + MARK + keys + SETITEMS
    return _write(d, "colliding_keys.pickle", pkl(_root(Memo(), before, EMPTY_LIST)))


_M64 = (1 << 64) - 1
_X1, _X2, _X5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def _lane_after(acc: int, lane: int) -> int:
    """CPython's tuple hash (xxHash, 64-bit): one item's lane folded into the accumulator."""
    acc = (acc + lane * _X2) & _M64
    return (((acc << 31) | (acc >> 33)) & _M64) * _X1 & _M64


def colliding_pairs(n: int, target: int = 12345) -> list[tuple[int, int]]:
    """`n` pairs (a, b) of ints whose tuple hashes are all `target`: for each a, the second lane
    that lands on it solved backwards (rotation and odd multiplication invert), kept when it is
    an int's own hash."""
    p61 = (1 << 61) - 1
    inv1, inv2 = pow(_X1, -1, 1 << 64), pow(_X2, -1, 1 << 64)
    final = (target - (2 ^ (_X5 ^ 3527539))) & _M64
    before = final * inv1 & _M64
    before = ((before >> 31) | (before << 33)) & _M64
    out, a = [], 0
    while len(out) < n:
        a += 1
        lane = (before - _lane_after(_X5, a)) * inv2 & _M64
        b = lane - (1 << 64) if lane >> 63 else lane
        if -p61 < b < p61 and b != -1:
            out.append((a, b))
    return out


def colliding_pool_ids(d: Path, n: int = 130_000) -> Path:
    """7b: entries whose pool_id pairs all hash alike (what normalization deduplicated in a dict),
    every value a valid pool id (two ints)."""
    rows = b"".join(_entry(EMPTY_LIST, addr=(k + 1) << 12,
                           extra=s("pool_id") + i(a) + i(b) + TUPLE2)
                    for k, (a, b) in enumerate(colliding_pairs(n)))
    return _write(d, "colliding_pool_ids.pickle", pkl(_root(Memo(), b"", EMPTY_LIST + EMPTY_LIST
                                                            + MARK + rows + APPENDS + APPEND)))


def many_traces(d: Path, n: int = 65_536) -> Path:
    """8: 65,536 one-entry traces in ~0.6 MB (the entry's key and value through the memo)."""
    # memo: 0 root, 1 'action', 2 'alloc' (written in the first entry)
    first = EMPTY_DICT + MARK + s("action") + MEMOIZE + s("alloc") + MEMOIZE + SETITEMS
    e = EMPTY_DICT + MARK + b"h\x01h\x02" + SETITEMS
    traces = EMPTY_LIST + MARK + EMPTY_LIST + first + APPEND + (EMPTY_LIST + e + APPEND) * (n - 1) \
        + APPENDS
    return _write(d, "many_traces.pickle", pkl(_root(Memo(), b"", traces)))


def huge_memo_put(d: Path) -> Path:
    """9a: '}' then a memo PUT at index 2^27 (a 1 GiB memo in pickle.load)."""
    return _write(d, "huge_memo_put.pickle", PROTO + EMPTY_DICT + BINPUT4
                  + struct.pack("<I", 1 << 27) + STOP)


def gzip_lists(d: Path, mib: int = 16) -> Path:
    """9b: a small gzip of many MiB of EMPTY_LIST."""
    return _write(d, "gzip_lists.pickle.gz",
                  gzip.compress(PROTO + EMPTY_LIST * (mib << 20) + STOP, 9))


def keys_after_500(d: Path, n: int = 700) -> Path:
    """10: a trace of 700 entries whose rows past the 500th carry a key the first ones lack
    (compile_context: it names the torch era)."""
    rows = [_entry_memo(EMPTY_LIST, 1 if k == 0 else None, 1, (k + 1) << 12, float(k),
                        extra=((s("compile_context") + MEMOIZE if k == 600 else get(7)) + s("")
                               if k >= 600 else b""))
            for k in range(n)]
    return _write(d, "keys_after_500.pickle", pkl(_root(Memo(), b"", EMPTY_LIST + EMPTY_LIST
                                                        + MARK + b"".join(rows) + APPENDS
                                                        + APPEND)))


SHAPES: list[tuple[str, Callable[[Path], Path]]] = [
    ("deep_pool", deep_pool), ("shared_frames", shared_frames),
    ("frames_grown_after_use", frames_grown_after_use), ("frames_twice", frames_twice),
    ("memoize_after_mark", memoize_after_mark), ("mark_before_stop", mark_before_stop),
    ("two_marks_appends", two_marks_appends), ("frame_straddle", frame_straddle),
    ("colliding_int_keys", colliding_int_keys), ("colliding_pool_ids", colliding_pool_ids),
    ("many_traces", many_traces),
    ("huge_memo_put", huge_memo_put), ("gzip_lists", gzip_lists),
    ("keys_after_500", keys_after_500),
]
