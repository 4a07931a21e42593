"""What `pickle.load` must never be given: a dict keyed by anything but a str, or a set.

CPython's unpickler inserts every SETITEM(S)/DICT key and every ADDITEMS/FROZENSET member into
a hash table as it reads them, with no way to stop it. Integers that differ by multiples of
2^61-1, tuples of integers solved lane by lane, and floats built the same way all have the same
hash, so a 2 MB file of such keys costs minutes there (issue 26, shape 7). String hashes are
keyed per process (SipHash) and cannot be aimed at. Every real snapshot (the 30 files of the
corpus, every torch and torch_npu writer) keys its dicts by str and holds no set, so a file
that does is refused before the unpickler sees it, in every read path: the streaming reader
declines such a dict (the Python path then gives this error) and the Python path scans first.

The scan follows the opcodes with a stack of type tags (no objects), the memo included, in
linear time; it stops quietly at anything it does not follow (a truncated stream, an unknown
opcode, a stack underflow), leaving the unpickler to name that error. A memo index beyond the
file's size (no pickler writes one; CPython's unpickler would grow its memo to it) is refused
too, so the tags' memo stays proportional to the file. `_keys.c` is the same scan in C (~60x
faster; `scan` below is its specification and the path without the extension).
"""

from __future__ import annotations

import struct
from typing import Any

from snapforensics.errors import SnapError
from snapforensics.snapshot.native import native

try:
    from snapforensics.snapshot import _keys
except ImportError:  # built without a C compiler (types in _keys.pyi)
    _keys = None  # type: ignore[assignment]

STR, OTHER, DICT, MARK = 0, 1, 2, 3

# argument bytes of the fixed-size opcodes; the tag each pushes (None: pushes nothing)
_FIXED = {
    0x80: (1, None),  # PROTO
    0x95: (8, None),  # FRAME
    ord("J"): (4, OTHER), ord("K"): (1, OTHER), ord("M"): (2, OTHER),  # BININT*
    ord("G"): (8, OTHER),  # BINFLOAT
    0x82: (1, OTHER), 0x83: (2, OTHER), 0x84: (4, OTHER),  # EXT1/2/4
    ord("N"): (0, OTHER), 0x88: (0, OTHER), 0x89: (0, OTHER),  # NONE, NEWTRUE, NEWFALSE
    ord("]"): (0, OTHER), ord(")"): (0, OTHER), ord("}"): (0, DICT),
}
# length-prefixed: (bytes of the length, signed, tag)
_SIZED = {
    0x8C: (1, False, STR), ord("X"): (4, False, STR), 0x8D: (8, False, STR),  # *BINUNICODE*
    ord("U"): (1, False, STR), ord("T"): (4, True, STR),  # SHORT_BINSTRING, BINSTRING
    ord("C"): (1, False, OTHER), ord("B"): (4, False, OTHER), 0x8E: (8, False, OTHER),  # bytes
    0x96: (8, False, OTHER),  # BYTEARRAY8
    0x8A: (1, False, OTHER), 0x8B: (4, True, OTHER),  # LONG1, LONG4
}
# newline-terminated arguments (protocol 0): the tag pushed
_LINE = {ord("I"): OTHER, ord("L"): OTHER, ord("F"): OTHER, ord("S"): STR, ord("V"): STR}
_LEN = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}
_SIGNED = {4: "<i"}
FOUND, KEY, SET, MEMO = 0, 1, 2, 3
_REFUSED = {
    KEY: "a dict keyed by something other than a str (every memory snapshot keys its dicts by "
         "str): not a memory snapshot, or hostile (hash-colliding keys); nothing was unpickled",
    SET: "a set in the pickle (no memory snapshot holds one): not a memory snapshot, or hostile "
         "(hash-colliding members); nothing was unpickled",
    MEMO: "a memo index beyond the pickle's size, or not a plain number (no pickler writes "
          "one): corrupt or hostile; nothing was unpickled",
}


def check(data: Any) -> None:
    """Raise SnapError if the pickle in `data` (bytes, mmap) builds a dict with a key that is
    not a str or a set, or writes a memo index beyond its size; return quietly otherwise (or
    where the scan cannot follow)."""
    rc = _keys.scan(data) if _keys is not None and native() is not None else scan(data)
    if rc:
        raise SnapError(_REFUSED[rc])


def scan(data: Any) -> int:
    """0, or what `check` refuses: KEY, SET or MEMO (`_keys.c` returns the same)."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    pos, n = 0, len(data)
    unpack = struct.unpack_from
    fixed, sized, line = _FIXED, _SIZED, _LINE
    while pos < n:
        op = data[pos]
        pos += 1
        f = fixed.get(op)
        if f is not None:
            pos += f[0]
            if f[1] is not None:
                stack.append(f[1])
            continue
        if op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
            w = 1 if op == 0x68 else 4
            if pos + w > n:
                return FOUND
            tag = memo.get(unpack(_LEN[w], data, pos)[0])
            if tag is None:
                return FOUND
            stack.append(tag)
            pos += w
        elif op == 0x94:  # MEMOIZE
            if not stack or (marks and marks[-1] == len(stack)):
                return FOUND
            if len(memo) > n:
                return MEMO
            memo[len(memo)] = stack[-1]
        elif op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
            w = 1 if op == 0x71 else 4
            if pos + w > n or not stack or (marks and marks[-1] == len(stack)):
                return FOUND
            idx = unpack(_LEN[w], data, pos)[0]
            if idx > n:
                return MEMO
            memo[idx] = stack[-1]
            pos += w
        elif op == 0x28:  # MARK
            marks.append(len(stack))
        elif op == 0x75 or op == 0x64:  # SETITEMS, DICT
            if not marks:
                return FOUND
            m = marks.pop()
            if any(t != STR for t in stack[m::2]):
                return KEY
            del stack[m:]
            if op == 0x64:
                stack.append(DICT)
        elif op == 0x73:  # SETITEM
            if len(stack) < 3:
                return FOUND
            if stack[-2] != STR:
                return KEY
            del stack[-2:]
        elif op == 0x61:  # APPEND
            if len(stack) < 2:
                return FOUND
            stack.pop()
        elif op in (0x65, 0x74, 0x6C, 0x31):  # APPENDS, TUPLE, LIST, POP_MARK
            if not marks:
                return FOUND
            del stack[marks.pop():]
            if op in (0x74, 0x6C):
                stack.append(OTHER)
        elif op in (0x85, 0x86, 0x87):  # TUPLE1-3
            k = op - 0x84
            if len(stack) < k:
                return FOUND
            del stack[len(stack) - k:]
            stack.append(OTHER)
        elif op == 0x30:  # POP
            if marks and marks[-1] == len(stack):
                marks.pop()
            elif stack:
                stack.pop()
            else:
                return FOUND
        elif op == 0x32:  # DUP
            if not stack:
                return FOUND
            stack.append(stack[-1])
        elif op in (0x8F, 0x90, 0x91):  # EMPTY_SET, ADDITEMS, FROZENSET
            return SET
        elif op in sized:
            w, signed, tag = sized[op]
            if pos + w > n:
                return FOUND
            size = unpack(_SIGNED[w] if signed else _LEN[w], data, pos)[0]
            if size < 0:
                return FOUND
            pos += w + size
            stack.append(tag)
        elif op in line:
            end = data.find(b"\n", pos)
            if end < 0:
                return FOUND
            pos = end + 1
            stack.append(line[op])
        elif op == 0x67:  # GET (protocol 0)
            end = data.find(b"\n", pos)
            if end < 0:
                return FOUND
            text = bytes(data[pos:end])
            if not text.isdigit():  # what int() and C's strtoull read alike, nothing else
                return MEMO
            tag = memo.get(int(text))
            if tag is None:
                return FOUND
            stack.append(tag)
            pos = end + 1
        elif op == 0x70:  # PUT (protocol 0)
            end = data.find(b"\n", pos)
            if end < 0:
                return FOUND
            text = bytes(data[pos:end])
            if not text.isdigit():
                return MEMO
            if not stack or (marks and marks[-1] == len(stack)):
                return FOUND
            idx = int(text)
            if idx > n:
                return MEMO
            memo[idx] = stack[-1]
            pos = end + 1
        else:  # STOP, or what refuses itself (globals, reduce, persistent ids, buffers)
            return FOUND
    return FOUND
