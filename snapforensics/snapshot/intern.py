"""Interning: every frame, stack, stream and pool once in a table, referenced by small ids.

Frames are recognised by the identity of their dict (the pickle memoizes identical frames, so
they are the same objects) then by value; stacks (tuples of frame ids, innermost first) by
the identity and contents of their frames list; streams and pools by value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from snapforensics.errors import SnapError
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


class Interner:
    """Frames by identity then value; stacks by (length, sampled frame identities) then `==`,
    then by value (tuples of frame ids); streams and pools by value."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.frame_ids: dict[Frame, int] = {}
        self.by_obj: dict[int, int] = {}  # id(frame dict) -> frame id
        self.buckets: dict[tuple[int, ...], list] = {}  # quick key -> [(frames list, stack id)]
        self.by_ids: dict[tuple[int, ...], int] = {}  # frame-dict ids -> stack id (overflow)
        self.keep_alive: list[Any] = []  # id() keys are only valid while the objects live
        self.stacks: list[tuple[int, ...]] = []
        self.stack_ids: dict[tuple[int, ...], int] = {}
        self.streams: list[int] = []
        self.stream_ids: dict[int, int] = {}
        self.pools: list[tuple[int, ...]] = []
        self.pool_ids: dict[tuple[int, ...], int] = {}

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
        frame = Frame(clean_str(filename), line, clean_str(name))
        fid = self.frame_ids.get(frame)
        if fid is None:
            fid = len(self.frames)
            self.frames.append(frame)
            self.frame_ids[frame] = fid
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
        if type(frames) not in LISTS:
            raise SnapError(f"{at(where, row)}: frames must be a list, got {tname(frames)}")
        n = len(frames)
        if n == 0:
            return NO_STACK
        qk = (n, id(frames[0]), id(frames[n >> 1]), id(frames[-1]), id(frames[n >> 2]))
        bucket = self.buckets.get(qk)
        if bucket is not None:
            for j, (cand, sid) in enumerate(bucket):
                try:
                    same = cand == frames
                except RecursionError:  # only hostile extra keys in frames can nest
                    same = False
                if same:
                    if j:  # move to front: the next entry likely repeats this stack
                        bucket[0], bucket[j] = bucket[j], bucket[0]
                    return sid
            if len(bucket) >= _BUCKET:
                # Many stacks share the sampled frames: exact identity key instead.
                key = tuple(map(id, frames))
                sid = self.by_ids.get(key)
                if sid is None:
                    sid = self._intern_stack(frames, where, row)
                    self.by_ids[key] = sid
                    self.keep_alive.append(frames)
                return sid
        sid = self._intern_stack(frames, where, row)
        if bucket is None:
            self.buckets[qk] = [(frames, sid)]
        else:
            bucket.append((frames, sid))
        return sid

    def _intern_stack(self, frames: list | tuple, where: str, row: int | None) -> int:
        get = self.by_obj.get
        fids = []
        for f in frames:
            fid = get(id(f))
            if fid is None:
                fid = self.frame(f, at(where, row))
            fids.append(fid)
        key = tuple(fids)
        sid = self.stack_ids.get(key)
        if sid is None:
            sid = len(self.stacks)
            self.stacks.append(key)
            self.stack_ids[key] = sid
        return sid

    def stack_column(self, col: list, where_dev: str) -> np.ndarray:
        """`stack()` for every entry; the common case (a repeat of the first stack in its bucket)
        is inlined here, which halves the per-entry cost."""
        get = self.buckets.get
        stack = self.stack
        out: list[int] = []
        append = out.append
        for i, fl in enumerate(col):
            if fl is None:
                append(NO_STACK)
                continue
            if type(fl) is list:
                n = len(fl)
                if n:
                    b = get((n, id(fl[0]), id(fl[n >> 1]), id(fl[-1]), id(fl[n >> 2])))
                    if b is not None:
                        try:
                            if b[0][0] == fl:
                                append(b[0][1])
                                continue
                        except RecursionError:
                            pass
            append(stack(fl, where_dev, i))
        return np.array(out, np.int32)

    # -- streams
    def stream(self, s: Any, where: str) -> int:
        if s is None:
            s = 0
        if type(s) is not int:
            raise SnapError(f"{where}: stream must be an int, got {tname(s)}")
        if not -(1 << 63) <= s < (1 << 64):
            raise SnapError(f"{where}: stream {short(s)} is out of range")
        sid = self.stream_ids.get(s)
        if sid is None:
            sid = len(self.streams)
            self.streams.append(s)
            self.stream_ids[s] = sid
        return sid

    def stream_column(self, col: list, where_dev: str) -> np.ndarray:
        check_types(col, {int, type(None)}, where_dev, "stream", "an int")
        m = {}
        for s in dict.fromkeys(col):
            if s is not None and not -(1 << 63) <= s < (1 << 64):
                raise SnapError(f"{where_dev}[{col.index(s)}]: stream {short(s)} is out of range")
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
        pid = self.pool_ids.get(key)
        if pid is None:
            pid = len(self.pools)
            self.pools.append(key)
            self.pool_ids[key] = pid
        return pid


