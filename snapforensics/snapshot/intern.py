"""Interning: every frame, stack, stream and pool once in a table, referenced by small ids.

Frames are recognised by the identity of their dict (the pickle memoizes identical frames, so
they are the same objects) then by value (file, line, name: nothing else in the dict is ever
compared); stacks (tuples of frame ids, innermost first) by the identity of their frames list,
then by the identities of its frames, then by frame ids; streams and pools by value. Lists are
never compared with `==`: that would compare frames' extra keys, whatever they hold.

A frame's name and file are cut to MAX_NAME characters here, where they are interned, so no
later stage (the classifier's regexes, the renderers) ever sees a longer one: a Python frame
name is an identifier, a C++ one a demangled symbol, a few hundred characters for deep
templates; 4,096 keeps every real one whole.
"""

from __future__ import annotations

import ctypes
import operator
from itertools import chain
from typing import Any

import numpy as np

from snapforensics.errors import SnapError
from snapforensics.snapshot.budget import Budget
from snapforensics.snapshot.columns import (
    LISTS,
    at,
    check_types,
    clean_str,
    short,
    tname,
)
from snapforensics.snapshot.model import NO_STACK, Frame

_BUCKET = 16
MAX_NAME = 4096
# Distinct memory pools a file may name: a process has the default pool plus one per CUDA-graph
# pool or MemPool (tens); a file naming more is refused.
MAX_POOLS = 4096
_FRAMES_TYPES = {list, tuple, type(None)}
_CHUNK_FRAMES = 1 << 20  # frames hashed per numpy pass: 8 MiB per temporary array
_K = tuple(np.uint64(k) for k in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15))


def _addresses(objs: np.ndarray) -> np.ndarray:
    """The address (CPython's `id()`) of each object of an object array, read from the array's
    pointer buffer: no int is made per object."""
    if not len(objs):
        return np.zeros(0, np.uint64)
    ptr = ctypes.cast(objs.ctypes.data, ctypes.POINTER(ctypes.c_uint64))
    return np.ctypeslib.as_array(ptr, shape=(len(objs),)).copy()


def _hash_lists(lists: Any, lens: np.ndarray) -> np.ndarray:
    """A 64-bit hash per non-empty list of its length and of the identity of each element, in
    order (splitmix64-style mixing of each element's address with its position, summed per list).

    The addresses come from `_addresses`, not `id()` per element, which allocates an int each
    time (~4x slower)."""
    total = int(lens.sum())
    v = _addresses(np.fromiter(chain.from_iterable(lists), object, total))
    starts = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    pos = np.arange(total, dtype=np.uint64)
    pos -= np.repeat(starts, lens).astype(np.uint64)
    with np.errstate(over="ignore"):
        v += pos * _K[2]
        v ^= v >> np.uint64(30)
        v *= _K[0]
        v ^= v >> np.uint64(27)
        v *= _K[1]
        v ^= v >> np.uint64(31)
        return np.add.reduceat(v, starts) ^ (lens.astype(np.uint64) * _K[2])


class Interner:
    """Frames by identity then value; stacks by (length, sampled frame identities) then `==`,
    then by value (tuples of frame ids); streams and pools by value."""

    def __init__(self, budget: Budget | None = None) -> None:
        self.budget = budget or Budget(None)
        self.by_list: dict[int, int] = {}  # id(frames list) -> stack id (segments share lists)
        self.frames: list[Frame] = []
        self.frame_ids: dict[Frame, int] = {}
        self.by_obj: dict[int, int] = {}  # id(frame dict) -> frame id
        self.buckets: dict[tuple[int, ...], list] = {}  # quick key -> [(frames list, stack id)]
        self.by_ids: dict[tuple, int] = {}  # (list type, frame-dict ids) -> stack id (overflow)
        self.keep_alive: list[Any] = []  # id() keys are only valid while the objects live
        self.stacks: list[tuple[int, ...]] = []
        self.stack_ids: dict[tuple[int, ...], int] = {}
        self.streams: list[int] = []
        self.stream_ids: dict[int, int] = {}
        self.pools: list[tuple[int, ...]] = []
        self.pool_ids: dict[str, int] = {}  # repr(pool id) -> index

    # -- frames and stacks
    def frame(self, f: Any, where: str) -> int:
        fid = self.by_obj.get(id(f))
        if fid is not None:
            return fid
        if type(f) is not dict:
            raise SnapError(f"{where}: a frame is {tname(f)}, expected a dict")
        filename = f.get("filename", "")
        name = f.get("name", "")
        line = f.get("line", 0)
        if type(filename) is not str or type(name) is not str:
            raise SnapError(f"{where}: frame filename/name must be strings, got "
                            f"{tname(filename)}/{tname(name)}")
        if line is None:
            line = 0
        if type(line) is not int:
            raise SnapError(f"{where}: frame line must be an int, got {tname(line)}")
        if not -(1 << 31) <= line < (1 << 31):
            raise SnapError(f"{where}: frame line {short(line)} is out of range")
        frame = Frame(_cap(filename), line, _cap(name))
        fid = _index(self.frames, self.frame_ids, frame)
        self.by_obj[id(f)] = fid
        self.keep_alive.append(f)
        return fid

    def stack(self, frames: Any, where: str, row: int | None = None) -> int:
        """Stack id of a frames list. `where` (+ `row`) only name the place in error messages.

        Fast path: lists are bucketed by (length, identities of 4 sampled frames) and compared
        with `==` to the (already validated) lists in the bucket; list equality short-cuts on
        identity per element, so a repeated stack costs a few C pointer compares per frame.
        """
        if frames is None:
            return NO_STACK
        sid = self.by_list.get(id(frames))
        if sid is not None:
            return sid
        sid = self._stack(frames, where, row)
        self.by_list[id(frames)] = sid
        self.keep_alive.append(frames)
        return sid

    def _stack(self, frames: Any, where: str, row: int | None) -> int:
        if type(frames) not in LISTS:
            raise SnapError(f"{at(where, row)}: frames must be a list, got {tname(frames)}")
        n = len(frames)
        if n == 0:
            return NO_STACK
        qk = (n, id(frames[0]), id(frames[n >> 1]), id(frames[-1]), id(frames[n >> 2]))
        bucket = self.buckets.get(qk)
        if bucket is not None and len(bucket) >= _BUCKET:
            # Many stacks share the sampled frames: exact identity key instead.
            key = (type(frames), *map(id, frames))
            sid = self.by_ids.get(key)
            if sid is None:
                sid = self.by_ids[key] = self._intern_stack(frames, where, row)
                self.keep_alive.append(frames)
            return sid
        if bucket is not None:
            for j, (cand, sid) in enumerate(bucket):
                if _same(cand, frames):
                    if j:  # move to front: the next entry likely repeats this stack
                        bucket[0], bucket[j] = bucket[j], bucket[0]
                    return sid
            # the work of comparing with every list of the bucket, counted like frames (at
            # most _BUCKET - 1 lists: a full bucket's lists are found by identity key)
            self.budget.add(n * len(bucket), "frames compared")
        sid = self._intern_stack(frames, where, row)
        if bucket is None:
            self.buckets[qk] = [(frames, sid)]
        else:
            bucket.append((frames, sid))
            if len(bucket) >= _BUCKET:
                for cand, s in bucket:
                    self.by_ids.setdefault((type(cand), *map(id, cand)), s)
        return sid

    def _intern_stack(self, frames: list | tuple, where: str, row: int | None) -> int:
        self.budget.add(len(frames), "frames in distinct stacks")
        get = self.by_obj.get
        fids = []
        for f in frames:
            fid = get(id(f))
            if fid is None:
                fid = self.frame(f, at(where, row))
            fids.append(fid)
        key = tuple(fids)
        sid = _index(self.stacks, self.stack_ids, key)
        return sid

    def stack_column(self, col: list, where_dev: str) -> np.ndarray:
        """Stack id of every entry's frames list, in bulk: no Python code runs per entry.

        1. Distinct lists by identity (`np.unique` of their addresses): torch shares one list
           between an alloc and its free, and files may share lists between many entries.
        2. Distinct contents: a hash of each list's frame identities (`_distinct_stacks`), the
           lists of a hash compared with `==` to the first one.
        3. Only the first list of each content, and the rare lists that differ from it, go
           through `stack()`, in order of first appearance: ids are those a row-by-row walk
           would give.
        """
        n = len(col)
        types = set(map(type, col))
        if not types <= _FRAMES_TYPES:
            i = next(i for i, fl in enumerate(col) if type(fl) not in _FRAMES_TYPES)
            raise SnapError(f"{where_dev}[{i}]: frames must be a list, got {tname(col[i])}")
        if type(None) in types:  # no frames: same as an empty list
            col = [() if fl is None else fl for fl in col]
        objs = np.fromiter(col, object, n)  # the lists themselves, no int per row
        _, first, inv = np.unique(_addresses(objs), return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first = first[order]
        lists = objs[first]
        del objs
        return self._distinct_stacks(lists, first, where_dev)[rank[inv.reshape(-1)]]

    def _distinct_stacks(self, lists: np.ndarray, rows: np.ndarray, where_dev: str) -> np.ndarray:
        """Stack ids of distinct list objects (in order of first appearance, at `rows`).

        Lists are grouped by a hash of their length and the identities of their frames, computed
        with numpy over the flattened frame ids (a chunk of lists at a time, so the temporary
        arrays stay small next to the unpickled file); the first list of each group is its
        representative, and the others are compared to it with `==` (C pointer compares:
        frames are memoized objects). A list unequal to its representative (a hash collision)
        is interned on its own, exactly.
        """
        m = len(lists)
        out = np.full(m, NO_STACK, np.int32)
        lens = np.fromiter(map(len, lists), np.int64, m)
        idx = np.flatnonzero(lens)
        if not len(idx):
            return out
        e = lists[idx]
        key = np.empty(len(e), np.uint64)
        ln = lens[idx]
        ends = np.cumsum(ln)
        lo = 0
        while lo < len(e):  # chunks of about _CHUNK_FRAMES frames
            hi = int(np.searchsorted(ends, ends[lo] - ln[lo] + _CHUNK_FRAMES, "right"))
            hi = max(hi, lo + 1)
            key[lo:hi] = _hash_lists(e[lo:hi], ln[lo:hi])
            lo = hi
        _, g_first, g_inv = np.unique(key, return_index=True, return_inverse=True)
        rep = g_first[g_inv.reshape(-1)]
        other = np.flatnonzero(rep != np.arange(len(e)))
        if len(other):
            same = np.fromiter(map(_same, e[other], e[rep[other]]), bool, len(other))
            rep[other[~same]] = other[~same]
        # Representatives are interned one by one, in order of first appearance, so stack and
        # frame ids are those a row-by-row walk would give.
        own = np.flatnonzero(rep == np.arange(len(e)))
        sid = np.empty(len(e), np.int32)
        stack = self.stack
        sid[own] = [stack(e[j], where_dev, r)
                    for j, r in zip(own.tolist(), rows[idx[own]].tolist())]
        out[idx] = sid[rep]
        return out

    def check_strings(self, extra: int = 0) -> None:
        """Bytes of frame names and files the analysis reads, stack by stack (+ `extra`)."""
        if not self.budget.limited:
            return
        per_frame = np.fromiter((len(f.name) + len(f.filename) for f in self.frames), np.int64,
                                len(self.frames))
        fids = np.fromiter(chain.from_iterable(self.stacks), np.int64,
                           sum(map(len, self.stacks)))
        self.budget.strings(int(per_frame[fids].sum()) + extra)

    # -- streams
    def stream(self, s: Any, where: str) -> int:
        if s is None:
            s = 0
        if type(s) is not int:
            raise SnapError(f"{where}: stream must be an int, got {tname(s)}")
        if not -(1 << 63) <= s < (1 << 64):
            raise SnapError(f"{where}: stream {short(s)} is out of range")
        sid = _index(self.streams, self.stream_ids, s)
        return sid

    def stream_column(self, col: list, where_dev: str) -> np.ndarray:
        check_types(col, {int, type(None)}, where_dev, "stream", "an int")
        # range first: past 2^64 a file can pick any number of ints with one hash (multiples of
        # 2^61-1); within it at most 14 share one, so the table below stays linear
        ints = [s for s in col if s is not None] if None in col else col
        if ints and (min(ints) < -(1 << 63) or max(ints) >= (1 << 64)):
            s = next(s for s in ints if not -(1 << 63) <= s < (1 << 64))
            raise SnapError(f"{where_dev}[{col.index(s)}]: stream {short(s)} is out of range")
        m = {}
        for s in dict.fromkeys(col):
            m[s] = self.stream(s, where_dev)
        if len(m) == 1:
            return np.full(len(col), next(iter(m.values())), np.int32)
        return np.array(list(map(m.__getitem__, col)), np.int32)

    # -- memory pools
    def pool(self, v: Any, where: str) -> int:
        if v is None:
            return -1
        if type(v) is int:
            key: tuple[int, ...] = (v,)
        elif type(v) in LISTS and len(v) <= 4 and all(type(x) is int for x in v):
            key = tuple(v)
        else:
            raise SnapError(f"{where}: pool id must be an int or a pair of ints, got {short(v)}")
        if any(not -(1 << 63) <= x < (1 << 64) for x in key):
            raise SnapError(f"{where}: pool id is out of range")
        if not any(key):
            return -1  # (0, 0): the default pool
        text = repr(key)  # the table is keyed by text: a tuple's hash is the file's to choose
        if len(self.pool_ids) >= MAX_POOLS and text not in self.pool_ids:
            raise SnapError(f"{where}: more than {MAX_POOLS} distinct memory pools (a process has "
                            "one per CUDA graph pool or MemPool: tens); not a memory snapshot")
        i = self.pool_ids.get(text)
        if i is None:
            i = self.pool_ids[text] = len(self.pools)
            self.pools.append(key)
        return i


def distinct_pools(pools: list) -> list:
    """The distinct values of a trace's pool_id column, found by sorting, never by hashing: a
    file chooses its ints' and tuples' hashes (ints that differ by multiples of 2^61-1, tuples
    solved lane by lane), so a table of them can cost the square of the rows. Irregular columns
    (mixed types or lengths, values beyond int64) come back whole, each row then checked."""
    kinds = set(map(type, pools))
    if kinds == {int}:
        flat = True
    elif len(kinds) == 1 and kinds <= {tuple, list} and len(set(map(len, pools))) == 1 \
            and set(map(type, chain.from_iterable(pools))) == {int}:
        flat = False
    else:
        return pools
    try:
        arr = np.array(pools, np.int64)
    except OverflowError:
        return pools
    if not flat:
        arr = arr.reshape(len(pools), -1)
    values, first = np.unique(arr, axis=0, return_index=True)
    values = values[np.argsort(first)].tolist()  # in order of first appearance
    return values if flat else [tuple(r) for r in values]


def _same(a: Any, b: Any) -> bool:
    """The same frame objects in the same order, in the same kind of sequence (`_native.c`'s
    `same_frames`): pointer compares, never a frame's `==`."""
    return type(a) is type(b) and len(a) == len(b) and all(map(operator.is_, a, b))


def _cap(s: str) -> str:
    """A name or file from the file, at most MAX_NAME characters, valid UTF-8."""
    if len(s) > MAX_NAME:
        s = f"{s[:MAX_NAME]}...[{len(s) - MAX_NAME:,} more characters]"
    return clean_str(s)


def _index(table: list, ids: dict, key: Any) -> int:
    """`key`'s index in `table`, appended the first time it is seen."""
    i = ids.get(key)
    if i is None:
        i = ids[key] = len(table)
        table.append(key)
    return i
