"""Hostile snapshot files, assembled opcode by opcode (used by test_hostile.py and
benchmarks/bench_hostile.py). Each builder writes one file and returns its path; the seeds are
the repository's fixtures, never ../shared.

Attack classes (issue 8): deep nesting that makes CPython recurse in C, huge length fields,
memo sharing that makes a tiny file describe a huge graph, huge integers, odd objects
(bytearray) and infinite times in fields, control and non-ASCII characters in every string,
gzip trailing bytes.
"""

from __future__ import annotations

import gzip
import pickle
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"

# ---------------------------------------------------------------------------------------------
# A tiny assembler: the opcodes of pickle protocol 4/5 we need, as bytes.

PROTO, STOP, MARK = b"\x80\x04", b".", b"("
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE = b"}", b"]", b")"
TUPLE1, FROZENSET, SETITEM, SETITEMS = b"\x85", b"\x91", b"s", b"u"
APPEND, APPENDS, MEMOIZE, NONE = b"a", b"e", b"\x94", b"N"


def s(text: str) -> bytes:
    """SHORT_BINUNICODE / BINUNICODE."""
    b = text.encode("utf-8", "surrogatepass")
    return (b"\x8c" + bytes([len(b)]) if len(b) < 256 else b"X" + struct.pack("<I", len(b))) + b


def i(v: int) -> bytes:
    """BININT / LONG1 / LONG4 (any size)."""
    if -(1 << 31) <= v < (1 << 31):
        return b"J" + struct.pack("<i", v)
    n = (v.bit_length() + 8) // 8
    head = b"\x8a" + bytes([n]) if n < 256 else b"\x8b" + struct.pack("<I", n)
    return head + v.to_bytes(n, "little", signed=True)


def f(v: float) -> bytes:
    return b"G" + struct.pack(">d", v)


def get(idx: int) -> bytes:
    return b"j" + struct.pack("<I", idx)  # LONG_BINGET


def pkl(body: bytes) -> bytes:
    return PROTO + body + STOP


def snapshot_dict(segments: bytes, traces: bytes) -> bytes:
    """{'segments': <segments>, 'device_traces': <traces>} (each already assembled)."""
    return EMPTY_DICT + MARK + s("segments") + segments + s("device_traces") + traces + SETITEMS


def entry(action: str = "alloc", addr: int = 1 << 20, size: int = 512, frames: bytes = b"]",
          time: bytes | None = None) -> bytes:
    return (EMPTY_DICT + MARK + s("action") + s(action) + s("addr") + i(addr) + s("size")
            + i(size) + s("stream") + i(0) + s("time_us") + (time or f(1.0)) + s("frames")
            + frames + SETITEMS)


def frame(name: str = "f", filename: str = "a.py", line: int = 1) -> bytes:
    return (EMPTY_DICT + MARK + s("filename") + s(filename) + s("line") + i(line) + s("name")
            + s(name) + SETITEMS)


def trace_of(entries: list[bytes]) -> bytes:
    return EMPTY_LIST + EMPTY_LIST + MARK + b"".join(entries) + APPENDS + APPEND


# ---------------------------------------------------------------------------------------------
# The cases. Each: (name, builder(dir) -> path). Sizes keep every case under a second of
# unpickling on a laptop, and make the unbounded versions of the pipeline blow up.


def _write(d: Path, name: str, data: bytes) -> Path:
    p = d / name
    p.write_bytes(data)
    return p


def deep_tuple_key(d: Path) -> Path:
    """A 1e6-deep tuple as a dict key: hash() recursed in C and the process died (SIGSEGV)."""
    return _write(d, "deep_tuple_key.pickle",
                  pkl(EMPTY_DICT + EMPTY_TUPLE + TUPLE1 * 1_000_000 + i(1) + SETITEM))


def deep_frozenset(d: Path) -> Path:
    """A 1e6-deep tuple inside a frozenset (hashed while the set is built)."""
    return _write(d, "deep_frozenset.pickle",
                  pkl(MARK + EMPTY_TUPLE + TUPLE1 * 1_000_000 + FROZENSET))


def deep_dicts(d: Path) -> Path:
    """Dicts nested 1e6 deep under 'segments' (freeing them must not recurse either)."""
    n = 1_000_000
    nested = EMPTY_DICT + (s("k") + EMPTY_DICT) * n + SETITEM * n
    return _write(d, "deep_dicts.pickle", pkl(snapshot_dict(EMPTY_LIST, EMPTY_LIST)[:-1]
                                             + s("x") + nested + SETITEMS))


def deep_lists_frames(d: Path) -> Path:
    """A frames list whose only frame is a list nested 1e5 deep."""
    n = 100_000
    nested = EMPTY_LIST + EMPTY_LIST * n + APPEND * n
    return _write(d, "deep_lists_frames.pickle",
                  pkl(snapshot_dict(EMPTY_LIST, trace_of([entry(frames=b"]" + nested + APPEND)]))))


def huge_length_unicode(d: Path) -> Path:
    """BINUNICODE8 claiming 2**62 bytes (the file is 30 bytes)."""
    return _write(d, "huge_length_unicode.pickle",
                  pkl(b"\x8d" + struct.pack("<Q", 1 << 62) + b"abc"))


def huge_length_bytearray(d: Path) -> Path:
    """BYTEARRAY8 claiming 2**40 bytes."""
    return _write(d, "huge_length_bytearray.pickle",
                  b"\x80\x05" + b"\x96" + struct.pack("<Q", 1 << 40) + b"abc" + STOP)


def huge_memo_index(d: Path) -> Path:
    """LONG_BINPUT at index 2**32-1 (the C unpickler grows its memo to that size)."""
    return _write(d, "huge_memo_index.pickle",
                  pkl(NONE + b"r" + struct.pack("<I", (1 << 32) - 1)))


def bytearray_in_field(d: Path) -> Path:
    """A bytearray (protocol 5 BYTEARRAY8) where a frame name belongs."""
    fr = (EMPTY_DICT + MARK + s("filename") + s("a.py") + s("line") + i(1) + s("name")
          + b"\x96" + struct.pack("<Q", 3) + b"abc" + SETITEMS)
    body = snapshot_dict(EMPTY_LIST, trace_of([entry(frames=EMPTY_LIST + fr + APPEND)]))
    return _write(d, "bytearray_in_field.pickle", b"\x80\x05" + body + STOP)


def infinite_time(d: Path) -> Path:
    """time_us = +inf on one entry, -inf on another."""
    es = [entry(time=f(float("inf"))), entry("free_requested", time=f(float("-inf")))]
    return _write(d, "infinite_time.pickle", pkl(snapshot_dict(EMPTY_LIST, trace_of(es))))


def huge_int_size(d: Path) -> Path:
    """A 5,000-digit size (repr of it raises past CPython's 4300-digit limit)."""
    return _write(d, "huge_int_size.pickle",
                  pkl(snapshot_dict(EMPTY_LIST, trace_of([entry(size=10 ** 5000)]))))


def huge_int_text(d: Path) -> Path:
    """Protocol 0 LONG with 5,000 digits (int() of the text raises ValueError)."""
    return _write(d, "huge_int_text.pickle", b"\x80\x02L" + b"9" * 5000 + b"L\n.")


def shared_blocks(d: Path) -> Path:
    """One 1e4-block list shared by 1e4 segments: 1e8 blocks from a ~100 kB file."""
    block = (EMPTY_DICT + MARK + s("size") + i(512) + s("state") + s("active_allocated")
             + SETITEMS + MEMOIZE)
    blocks = EMPTY_LIST + MEMOIZE + MARK + block + get(1) * 9_999 + APPENDS  # memo 0: the list
    seg = (EMPTY_DICT + MARK + s("address") + i(0) + s("total_size") + i(512 * 10_000)
           + s("blocks") + get(0) + SETITEMS + MEMOIZE)  # memo 2: the segment
    # memo 0 = blocks list, memo 1 = block, memo 2 = segment
    segs = EMPTY_LIST + MARK + blocks + b"0" + seg + get(2) * 9_999 + APPENDS
    return _write(d, "shared_blocks.pickle", pkl(snapshot_dict(segs, EMPTY_LIST)))


def shared_traces(d: Path) -> Path:
    """One 1e5-entry trace shared by 10,000 devices: 1e9 rows from a ~600 kB file."""
    e = entry() + MEMOIZE  # memo 1
    trace = EMPTY_LIST + MEMOIZE + MARK + e + get(1) * 99_999 + APPENDS  # memo 0
    traces = EMPTY_LIST + MARK + trace + get(0) * 9_999 + APPENDS
    return _write(d, "shared_traces.pickle", pkl(snapshot_dict(EMPTY_LIST, traces)))


def shared_long_stack(d: Path) -> Path:
    """One 1e6-frame list shared by 1e5 entries (compared with == per row: 90 s before)."""
    fr = frame() + MEMOIZE  # memo 1
    frames = EMPTY_LIST + MEMOIZE + MARK + fr + get(1) * 999_999 + APPENDS  # memo 0
    e0 = entry(frames=frames)
    es = [entry(addr=(k + 2) << 20, frames=get(0)) for k in range(100_000)]
    return _write(d, "shared_long_stack.pickle",
                  pkl(snapshot_dict(EMPTY_LIST, trace_of([e0, *es]))))


def joined_names(d: Path) -> Path:
    """1e6 references to one frame with a 10 kB name: 10 GB of names joined per stack."""
    fr = frame(name="r" * 10_000, filename="<record_function>", line=0) + MEMOIZE
    frames = EMPTY_LIST + MARK + fr + get(0) * 999_999 + APPENDS
    return _write(d, "joined_names.pickle",
                  pkl(snapshot_dict(EMPTY_LIST, trace_of([entry(frames=frames)]))))


def many_devices(d: Path) -> Path:
    """16,384 devices, each with one segment (per-device filtering of all segments: n^2)."""
    segs = b"".join(EMPTY_DICT + MARK + s("device") + i(k) + s("address") + i(1 << 30)
                    + s("total_size") + i(1 << 20) + s("blocks") + EMPTY_LIST + SETITEMS
                    for k in range(16_384))
    traces = EMPTY_LIST + MARK + EMPTY_LIST * 16_384 + APPENDS
    return _write(d, "many_devices.pickle",
                  pkl(snapshot_dict(EMPTY_LIST + MARK + segs + APPENDS, traces)))


def gzip_trailing_zeros(d: Path) -> Path:
    """A real (fixture) snapshot gzip'd, then 1 GiB of zeros in the same gzip stream."""
    raw = gzip.decompress(FIXTURE.read_bytes())
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    parts = [c.compress(raw)]
    zeros = bytes(16 << 20)
    parts += [c.compress(zeros) for _ in range(64)]
    parts.append(c.flush())
    return _write(d, "gzip_trailing_zeros.pickle.gz", b"".join(parts))


_NASTY = "\x1b[2J\x1b]0;pwned\x07\x1b]8;;http://x\x07link\x1b]8;;\x07\x1b]52;c;Y2xpcA==\x07" \
    "\u202e|`[/]```\n# h\r\x00\x7f\ud800名"


def control_chars(d: Path) -> Path:
    """The fixture with control, bidi, markup and non-ASCII characters in every string field."""
    raw = pickle.loads(gzip.decompress(FIXTURE.read_bytes()))
    seen: dict[int, object] = {}

    def taint(o: object) -> object:
        if id(o) in seen:
            return seen[id(o)]
        if type(o) is dict:
            out: dict = {}
            seen[id(o)] = out
            for k, v in o.items():
                keep = k in ("action", "state", "stage", "segment_type", "backend")
                out[k] = v if keep else taint(v)
            return out
        if type(o) is list:
            lst: list = []
            seen[id(o)] = lst
            lst.extend(taint(x) for x in o)
            return lst
        if type(o) is str:
            return o + _NASTY
        return o
    return _write(d, "control_chars.pickle", pickle.dumps(taint(raw), protocol=4))


CASES: dict[str, Callable[[Path], Path]] = {b.__name__: b for b in (
    deep_tuple_key, deep_frozenset, deep_dicts, deep_lists_frames, huge_length_unicode,
    huge_length_bytearray, huge_memo_index, bytearray_in_field, infinite_time, huge_int_size,
    huge_int_text, shared_blocks, shared_traces, shared_long_stack, joined_names,
    many_devices, gzip_trailing_zeros, control_chars)}
