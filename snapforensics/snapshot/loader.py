"""The one loader: reads any snapshot file safely and owns every format quirk.

- Refuses every pickle global (no code from the file ever runs) while keeping the C unpickler.
  While unpickling, the address space the process may grow by is capped (Linux), so a tiny
  hostile pickle cannot make the C unpickler allocate tens of GB (e.g. a huge memo index).
- Accepts torch 2.0 (block `history`) to current, torch_npu files (stale bytes after the pickle
  STOP, workspace entries), gzip'd files, a bare segment list (`torch.cuda.memory_snapshot()`),
  missing `frames` / `time_us`, several devices.
- Validates every field it keeps: a wrong type or an impossible size is a one-line SnapError,
  never a silently wrong number and never another exception.

Speed (the loader must scale to 1 GB files): the unpickler and the normalization run with the
GC paused (millions of containers, no cycles); the trace is converted column by column
(`map(dict.get, ...)` + one numpy conversion per column, types checked with
`set(map(type, column))`, rows located only when a check fails); frames are validated once per
distinct frame dict (the pickle memoizes identical frames, so they are the same objects) and a
stack is recognised by comparing its list with `==` to the validated lists sharing its length
and sampled frame identities, which list equality settles with pointer compares.
`benchmarks/bench_load.py` measures it against bare `pickle.load`.
"""

from __future__ import annotations

import gc
import gzip
import math
import os
import pickle
import re
import stat
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import repeat
from pathlib import Path
from typing import Any, Literal

import numpy as np

from snapforensics.errors import SnapError
from snapforensics.snapshot.model import (
    NO_STACK,
    A,
    Annotation,
    Backend,
    Block,
    Format,
    Frame,
    Segment,
    Snapshot,
    Trace,
)

MAX_BYTES = 1 << 50  # 1 PiB: no single allocation or segment is larger; bigger means corrupt
MAX_TOTAL = 1 << 62  # sums of sizes must stay far from int64 overflow
MAX_DEVICE = 1 << 16
BLOCK_STATES = {"active_allocated", "active_pending_free", "active_awaiting_free", "inactive"}
_STATE_OK = {"active_allocated", "active_pending_free", "inactive"}
OTHER = A["other"]
_INT = {int}
_NUM_OR_NONE = {int, float, type(None)}
_STR_OR_NONE = {str, type(None)}
_LISTS = (list, tuple)


def _short(v: Any) -> str:
    """A safe, bounded description of a value from the file (never recurses into it)."""
    if isinstance(v, str):
        s = v if len(v) <= 60 else v[:57] + "..."
        return repr(s).encode("ascii", "backslashreplace").decode()
    if type(v) in (int, float, bool) or v is None:
        s = repr(v)
        return s if len(s) <= 40 else s[:37] + "..."
    return f"a {type(v).__name__}"


def _ident(v: Any) -> str:
    """A module or attribute name from the file, shown bare when it looks like one."""
    if isinstance(v, str) and re.fullmatch(r"[A-Za-z_][\w.]{0,79}", v):
        return v
    return _short(v)


def _tname(v: Any) -> str:
    return type(v).__name__


# ---------------------------------------------------------------------------------------------
# Reading the file


class _RefuseGlobals(pickle.Unpickler):
    """Snapshots hold only builtins; any global reference means the file is not one of ours."""

    def find_class(self, module: str, name: str) -> Any:
        raise SnapError(
            f"refused: the pickle references the global {_ident(module)}.{_ident(name)}; "
            "memory snapshots contain only plain data, so this file is either not a memory "
            "snapshot or unsafe to open (nothing from it was executed)")

    def persistent_load(self, pid: Any) -> Any:
        raise SnapError("refused: the pickle uses persistent ids; not a memory snapshot")


def _vm_size() -> int | None:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextmanager
def _memory_guard(budget: int) -> Iterator[int | None]:
    """Cap how much address space the process may add while the C unpickler runs (Linux).

    Yields the cap in bytes (None when no cap applies). `SNAPFORENSICS_LOAD_MEMORY` overrides the
    budget in bytes; 0 disables the guard.
    """
    env = os.environ.get("SNAPFORENSICS_LOAD_MEMORY")
    if env is not None:
        try:
            budget = int(env)
        except ValueError:
            pass
    try:
        import resource
    except ImportError:  # not POSIX
        yield None
        return
    vm = _vm_size()
    if budget <= 0 or vm is None:
        yield None
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + budget
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield None  # already tighter than ours
        return
    try:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ValueError, OSError):
        yield None
        return
    try:
        yield budget
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Unpickling and normalizing create millions of containers and no cycles: skip the GC."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_GLOBAL_FIRST = re.compile(rb"^[ci]([A-Za-z_][\w.]*)\n([A-Za-z_][\w.]*)\n")


def _not_pickle_message(p: Path, head: bytes) -> str:
    if head.startswith(b"PK"):
        return (f"{p}: a zip archive (torch.save output?), not a memory snapshot; write one with "
                "torch.cuda.memory._dump_snapshot(path)")
    stripped = head.lstrip()
    if stripped[:1] in (b"{", b"[") or head.startswith(b"\xef\xbb\xbf"):
        return (f"{p}: looks like JSON/text, not a memory snapshot (the pickle that "
                "torch.cuda.memory._dump_snapshot writes)")
    return (f"{p}: not a pickle file (a memory snapshot is the pickle that "
            "torch.cuda.memory._dump_snapshot writes)")


def _open(p: Path) -> tuple[Any, int]:
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise SnapError(f"{p}: no such file") from None
    except PermissionError:
        raise SnapError(f"{p}: permission denied (cannot look up the file; check the "
                        "directory permissions)") from None
    except (OSError, ValueError) as e:
        raise SnapError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise SnapError(f"{p}: is a directory, expected a snapshot file (e.g. {p}/rank0.pickle)")
    if not stat.S_ISREG(st.st_mode):
        raise SnapError(f"{p}: not a regular file (a pipe or device?); pass a snapshot file")
    try:
        f = open(p, "rb")
    except PermissionError:
        raise SnapError(_permission_message(p, st.st_mode)) from None
    except OSError as e:
        raise SnapError(f"{p}: cannot read: {e.strerror or e}") from None
    return f, st.st_size


def _permission_message(p: Path, mode: int) -> str:
    perm = stat.S_IMODE(mode)
    if perm & 0o444 == 0:
        return (f"{p}: permission denied (file mode {perm:04o}, nobody may read it; "
                "torch_npu's _dump_snapshot creates snapshots with mode 0200): "
                f"run `chmod u+r {p}` (or `sudo chmod 644 {p}`) and retry")
    return (f"{p}: permission denied (file mode {perm:04o}, owned by uid {os.stat(p).st_uid}): "
            f"make it readable, e.g. `chmod a+r {p}`, or run as its owner")


def read_raw_info(path: str | os.PathLike) -> tuple[Any, list[str], dict]:
    """Unpickle `path` safely. Returns the raw object, loader warnings and facts about the file."""
    p = Path(path)
    f, size = _open(p)
    info: dict[str, Any] = {"file_bytes": size, "gzip": False, "stale_bytes": 0}
    warnings: list[str] = []
    with f:
        try:
            head = f.read(256)
            f.seek(0)
        except OSError as e:
            raise SnapError(f"{p}: cannot read: {e.strerror or e}") from None
        if not head:
            raise SnapError(f"{p}: empty file, not a snapshot")
        stream: Any = f
        estimate = size
        if head[:2] == b"\x1f\x8b":
            info["gzip"] = True
            stream = gzip.GzipFile(fileobj=f, mode="rb")
            try:
                head = stream.peek(256)[:256]
            except (OSError, EOFError, zlib.error) as e:
                raise SnapError(f"{p}: corrupt gzip file ({_tname(e)}: {e})") from None
            if not head:
                raise SnapError(f"{p}: empty gzip file, not a snapshot")
            estimate = size * 30
        if head[:1] != b"\x80" and head[:1] not in (b"(", b"]", b"}"):
            m = _GLOBAL_FIRST.match(head)
            if m:  # a protocol 0/1 pickle that opens with a global (GLOBAL or INST opcode)
                ref = f"{_ident(m.group(1).decode('ascii'))}.{_ident(m.group(2).decode('ascii'))}"
                raise SnapError(f"{p}: refused: the pickle references the global {ref}; "
                                "memory snapshots contain only plain data, so this file is "
                                "either not a memory snapshot or unsafe to open (nothing from "
                                "it was executed)")
            raise SnapError(_not_pickle_message(p, head))
        budget = max(4 << 30, 16 * estimate)
        try:
            with _gc_paused(), _memory_guard(budget):
                obj = _RefuseGlobals(stream).load()
        except SnapError as e:
            raise SnapError(f"{p}: {e}") from None
        except RecursionError:
            raise SnapError(f"{p}: pickle nested too deeply, not a memory snapshot") from None
        except MemoryError:
            raise SnapError(
                f"{p}: the pickle asks for more memory than a snapshot of {size} bytes can need "
                "(corrupt or hostile file); if it is genuine, raise the cap with "
                "SNAPFORENSICS_LOAD_MEMORY=<bytes> (0 = no cap)") from None
        except (zlib.error, gzip.BadGzipFile) as e:
            raise SnapError(f"{p}: corrupt gzip file ({_tname(e)}: {e})") from None
        except EOFError as e:
            kind = "gzip stream" if info["gzip"] else "pickle"
            raise SnapError(f"{p}: truncated {kind} ({e or 'ran out of input'}); the dump was "
                            "probably interrupted or the copy is incomplete") from None
        except Exception as e:  # corrupt opcodes, bad memo refs, unhashable keys: all bad input
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            raise SnapError(f"{p}: truncated or corrupt pickle ({_tname(e)}: {msg})") from None
        try:
            if info["gzip"]:
                stale = 0
                while True:
                    chunk = stream.read(1 << 20)
                    if not chunk:
                        break
                    stale += len(chunk)
            else:
                stale = size - f.tell()
        except (OSError, EOFError, zlib.error):
            stale = 0
            warnings.append("the gzip stream is damaged after the pickle end; ignored")
    if stale > 0:
        info["stale_bytes"] = stale
        warnings.append(f"{stale} stale bytes after the pickle end (torch_npu rewrites snapshot "
                        "files without truncating them); ignored")
    return obj, warnings, info


def read_raw(path: str | os.PathLike) -> tuple[Any, list[str]]:
    """Unpickle `path` safely. Returns the raw object and loader warnings."""
    obj, warnings, _ = read_raw_info(path)
    return obj, warnings


def load(path: str | os.PathLike) -> Snapshot:
    raw, warnings, info = read_raw_info(path)
    with _gc_paused():
        try:
            return normalize(raw, source=str(path), warnings=warnings, file_info=info)
        except SnapError as e:
            raise SnapError(f"{path}: {e}", e.exit_code) from None


# ---------------------------------------------------------------------------------------------
# Normalization


def _clean_str(s: str) -> str:
    """Lone surrogates (possible in a pickle) break every UTF-8 writer downstream."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "replace").decode("utf-8")


class _Interner:
    """Frames by identity then value; stacks by (length, sampled frame identities) then `==`,
    then by value (tuples of frame ids); strings, streams and pools by value."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.frame_ids: dict[Frame, int] = {}
        self.by_obj: dict[int, int] = {}  # id(frame dict) -> frame id
        self.buckets: dict[tuple[int, ...], list] = {}  # quick key -> [(frames list, stack id)]
        self.by_ids: dict[tuple[int, ...], int] = {}  # frame-dict ids -> stack id (overflow)
        self.keep_alive: list[Any] = []  # id() keys are only valid while the objects live
        self.stacks: list[tuple[int, ...]] = []
        self.stack_ids: dict[tuple[int, ...], int] = {}
        self.strings: list[str] = []
        self.string_ids: dict[str, int] = {}
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
            raise SnapError(f"{where}: a frame is {_tname(f)}, expected a dict")
        filename = f.get("filename", "")
        name = f.get("name", "")
        line = f.get("line", 0)
        if type(filename) is not str or type(name) is not str:
            raise SnapError(f"{where}: frame filename/name must be strings, got "
                            f"{_tname(filename)}/{_tname(name)}")
        if line is None:
            line = 0
        if type(line) is not int:
            raise SnapError(f"{where}: frame line must be an int, got {_tname(line)}")
        if not -(1 << 31) <= line < (1 << 31):
            raise SnapError(f"{where}: frame line {_short(line)} is out of range")
        frame = Frame(_clean_str(filename), line, _clean_str(name))
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
        if type(frames) not in _LISTS:
            raise SnapError(f"{_at(where, row)}: frames must be a list, got {_tname(frames)}")
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
                fid = self.frame(f, _at(where, row))
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

    # -- strings (user_metadata / compile_context)
    def string(self, s: str) -> int:
        if s in ("", "N/A"):
            return -1
        sid = self.string_ids.get(s)
        if sid is None:
            sid = len(self.strings)
            self.strings.append(_clean_str(s))
            self.string_ids[s] = sid
        return sid

    def string_column(self, col: list, where_dev: str, field: str) -> np.ndarray:
        _check_types(col, _STR_OR_NONE, where_dev, field, "a string")
        uniq = dict.fromkeys(col)
        uniq.pop(None, None)
        m: dict[Any, int] = {None: -1}
        for s in uniq:
            m[s] = self.string(s)
        if len(m) == 1 or all(v < 0 for v in m.values()):
            return np.full(len(col), -1, np.int32)
        return np.array(list(map(m.__getitem__, col)), np.int32)

    # -- streams
    def stream(self, s: Any, where: str) -> int:
        if s is None:
            s = 0
        if type(s) is not int:
            raise SnapError(f"{where}: stream must be an int, got {_tname(s)}")
        if not -(1 << 63) <= s < (1 << 64):
            raise SnapError(f"{where}: stream {_short(s)} is out of range")
        sid = self.stream_ids.get(s)
        if sid is None:
            sid = len(self.streams)
            self.streams.append(s)
            self.stream_ids[s] = sid
        return sid

    def stream_column(self, col: list, where_dev: str) -> np.ndarray:
        _check_types(col, {int, type(None)}, where_dev, "stream", "an int")
        m = {}
        for s in dict.fromkeys(col):
            if s is not None and not -(1 << 63) <= s < (1 << 64):
                raise SnapError(f"{where_dev}[{col.index(s)}]: stream {_short(s)} is out of range")
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
        elif type(v) in _LISTS and len(v) <= 4 and all(type(x) is int for x in v):
            key = tuple(v)
        else:
            raise SnapError(f"{where}: pool id must be an int or a pair of ints, got {_short(v)}")
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


_BUCKET = 16


def _at(where: str, row: int | None) -> str:
    return where if row is None else f"{where}[{row}]"


def _check_types(col: list, allowed: set, where_dev: str, field: str, expected: str) -> None:
    found = set(map(type, col))
    if found <= allowed:
        return
    for i, v in enumerate(col):
        if type(v) not in allowed:
            raise SnapError(f"{where_dev}[{i}]: {field} must be {expected}, got {_tname(v)}")


def _int(v: Any, where: str, field: str, *, lo: int = 0, hi: int = (1 << 64) - 1) -> int:
    if type(v) is not int:
        raise SnapError(f"{where}: {field} must be an int, got {_tname(v)}")
    if v < lo or v > hi:
        raise SnapError(f"{where}: {field} {_short(v)} is out of range")
    return v


def _time(v: Any, where: str) -> float:
    if v is None:
        return math.nan
    if type(v) not in (int, float):
        raise SnapError(f"{where}: time_us must be a number, got {_tname(v)}")
    try:
        return float(v)
    except OverflowError:
        raise SnapError(f"{where}: time_us {_short(v)} is out of range") from None


def _column(entries: list, key: str, default: Any = None) -> list:
    return list(map(dict.get, entries, repeat(key), repeat(default)))


def _uint64_column(col: list, where_dev: str, field: str) -> np.ndarray:
    _check_types(col, _INT, where_dev, field, "an int")
    try:
        return np.array(col, np.uint64)
    except (OverflowError, ValueError):
        for i, v in enumerate(col):
            if not 0 <= v < (1 << 64):
                raise SnapError(f"{where_dev}[{i}]: {field} {_short(v)} is out of range") from None
        raise SnapError(f"{where_dev}: {field} is out of range") from None


def _size_column(col: list, where_dev: str, field: str) -> np.ndarray:
    _check_types(col, _INT, where_dev, field, "an int")
    try:
        arr = np.array(col, np.int64)
    except (OverflowError, ValueError):
        arr = None
    if arr is None or (len(arr) and (int(arr.min()) < 0 or int(arr.max()) > MAX_BYTES)):
        for i, v in enumerate(col):
            if not 0 <= v <= MAX_BYTES:
                raise SnapError(f"{where_dev}[{i}]: {field} {_short(v)} is out of range "
                                "(negative or beyond any device)")
        raise SnapError(f"{where_dev}: {field} is out of range")
    if len(arr) and float(arr.sum(dtype=np.float64)) > MAX_TOTAL:
        raise SnapError(f"{where_dev}: {field}s add up to more than any device could hold")
    return arr


def _time_column(col: list, where_dev: str) -> np.ndarray:
    _check_types(col, _NUM_OR_NONE, where_dev, "time_us", "a number")
    try:
        return np.array(col, np.float64)
    except (OverflowError, ValueError, TypeError):
        for i, v in enumerate(col):
            _time(v, f"{where_dev}[{i}]")
        raise SnapError(f"{where_dev}: time_us is out of range") from None


def _trace(entries: Any, device: int, it: _Interner, inline_ann: list[Annotation],
           keys_seen: set) -> Trace:
    where_dev = f"device_traces[{device}]"
    if type(entries) not in _LISTS:
        raise SnapError(f"{where_dev} must be a list, got {_tname(entries)}")
    n = len(entries)
    if n == 0:
        return Trace.empty(device)
    if set(map(type, entries)) != {dict}:
        i = next(i for i, e in enumerate(entries) if type(e) is not dict)
        raise SnapError(f"{where_dev}[{i}] is {_tname(entries[i])}, expected a dict")
    # Which optional fields this file has: first and last entries suffice.
    for e in entries[:500] if n <= 1000 else entries[:500] + entries[-500:]:
        keys_seen.update(e)

    acts = _column(entries, "action")
    _check_types(acts, {str}, where_dev, "action", "a string")
    action = np.array(list(map(A.get, acts, repeat(OTHER))), np.int8)
    addr_col = _column(entries, "addr", 0)
    if None in addr_col:  # oom entries carry device_free instead of an address
        addr_col = [0 if a is None else a for a in addr_col]
    addr = _uint64_column(addr_col, where_dev, "addr")
    size = _size_column(_column(entries, "size", 0), where_dev, "size")
    stream = it.stream_column(_column(entries, "stream", 0), where_dev)
    time_us = _time_column(_column(entries, "time_us"), where_dev)
    stack = it.stack_column(_column(entries, "frames"), where_dev)

    # Optional fields: torch writes each on every entry of a file or on none, so a field absent
    # from the first and last 500 entries is absent (and unused if a middle entry had it).
    meta = np.full(n, -1, np.int32)
    if "user_metadata" in keys_seen:
        meta = it.string_column(_column(entries, "user_metadata"), where_dev, "user_metadata")
    if "compile_context" in keys_seen:
        cc = it.string_column(_column(entries, "compile_context"), where_dev, "compile_context")
        meta = np.where(meta >= 0, meta, cc).astype(np.int32)
    pool = np.full(n, -1, np.int32)
    if "pool_id" in keys_seen:
        pool_col = _column(entries, "pool_id")
        if pool_col.count(None) != n:
            pool = np.array([it.pool(v, f"{where_dev}[{i}]") for i, v in enumerate(pool_col)],
                            np.int32)

    device_free: dict[int, int] = {}
    for i in np.flatnonzero(action == A["oom"]).tolist():
        df = entries[i].get("device_free")
        if df is not None:
            device_free[i] = _int(df, f"{where_dev}[{i}]", "device_free", hi=MAX_BYTES)

    inline_rows = np.flatnonzero((action == A["user_defined"]) | (action == A["annotate"]))
    for i in inline_rows.tolist():
        # 2.4-era inline annotations: frames [{name: START|END, filename: <name>}]
        stack[i] = NO_STACK
        name, stage = _inline_annotation(entries[i], f"{where_dev}[{i}]")
        inline_ann.append(Annotation(device, stage, name, float(time_us[i]), i))
    return Trace(device, action, addr, size, stream, time_us, stack, meta, device_free, pool)


def _inline_annotation(e: dict, where: str) -> tuple[str, str]:
    frames = e.get("frames")
    f = frames[0] if type(frames) in _LISTS and frames and type(frames[0]) is dict else {}
    stage = e.get("stage")
    if stage is None:
        stage = f.get("name")
    name = e.get("name")
    if name is None:
        name = f.get("filename")
    if stage is not None and type(stage) is not str:
        raise SnapError(f"{where}: annotation stage must be a string, got {_tname(stage)}")
    if name is not None and type(name) is not str:
        raise SnapError(f"{where}: annotation name must be a string, got {_tname(name)}")
    stage = (stage or "START").upper()
    return _clean_str(name or "annotation"), ("END" if stage == "END" else "START")


def _legacy_history(b: dict, bw: str) -> tuple[Any, int | None]:
    """torch 2.0 blocks: `history` newest first, [{addr, real_size, frames}]."""
    hist = b.get("history")
    if hist is None:
        return None, None
    if type(hist) not in _LISTS:
        raise SnapError(f"{bw}: history must be a list, got {_tname(hist)}")
    if not hist:
        return None, None
    h = hist[0]
    if type(h) is not dict:
        raise SnapError(f"{bw}.history[0] is {_tname(h)}, expected a dict")
    real = h.get("real_size")
    if real is not None:
        real = _int(real, f"{bw}.history[0]", "real_size", hi=MAX_BYTES)
    return h.get("frames"), real


def _segments(raw: Any, it: _Interner, fmt: dict) -> list[Segment]:
    if type(raw) not in _LISTS:
        raise SnapError(f"segments must be a list, got {_tname(raw)}")
    out = []
    stack = it.stack
    legacy = 0
    for si, s in enumerate(raw):
        where = f"segments[{si}]"
        if type(s) is not dict:
            raise SnapError(f"{where} is {_tname(s)}, expected a dict")
        seg_addr = _int(s.get("address", 0), where, "address")
        blocks_raw = s.get("blocks", [])
        if blocks_raw is None:
            blocks_raw = []
        if type(blocks_raw) not in _LISTS:
            raise SnapError(f"{where}: blocks must be a list, got {_tname(blocks_raw)}")
        blocks = []
        offset = seg_addr
        bwhere = f"{where}.blocks"
        for bi, b in enumerate(blocks_raw):
            if type(b) is not dict:
                raise SnapError(f"{where}.blocks[{bi}] is {_tname(b)}, expected a dict")
            get = b.get
            bsize = get("size", 0)
            frames = get("frames")
            requested = get("requested_size")
            state = get("state")
            address = get("address")
            if "history" in b:
                legacy += 1
                hframes, real = _legacy_history(b, f"{where}.blocks[{bi}]")
                if frames is None:
                    frames = hframes
                if requested is None and state != "inactive":
                    requested = real
                if state is None:
                    state = "active_allocated" if hframes is not None or real is not None \
                        else "inactive"
            if type(state) is not str or state not in _STATE_OK:  # None, wrong type, old name
                if state is None:
                    state = "inactive"
                elif type(state) is not str or state not in BLOCK_STATES:
                    raise SnapError(f"{where}.blocks[{bi}]: unknown block state {_short(state)}")
                elif state == "active_awaiting_free":
                    state = "active_pending_free"
            if requested is None:
                requested = bsize if state != "inactive" else 0
            if address is None:
                address = offset
            if not (type(bsize) is int and 0 <= bsize <= MAX_BYTES and type(requested) is int
                    and 0 <= requested <= MAX_BYTES and type(address) is int
                    and 0 <= address < (1 << 64)):
                bw = f"{where}.blocks[{bi}]"
                _int(bsize, bw, "size", hi=MAX_BYTES)
                _int(requested, bw, "requested_size", hi=MAX_BYTES)
                _int(address, bw, "address")
            offset = address + bsize
            blocks.append(Block(address, bsize, requested, state,
                                NO_STACK if frames is None else stack(frames, bwhere, bi)))
        block_sum = sum(b.size for b in blocks)
        allocated = sum(b.size for b in blocks if b.state != "inactive")
        total = s.get("total_size")
        total = block_sum if total is None else _int(total, where, "total_size", hi=MAX_BYTES)
        if blocks and block_sum != total:
            fmt["segments_not_tiled"] = fmt.get("segments_not_tiled", 0) + 1
        seg_type = s.get("segment_type", "")
        if seg_type is None:
            seg_type = ""
        if type(seg_type) is not str:
            raise SnapError(f"{where}: segment_type must be a string, got {_tname(seg_type)}")
        expandable = s.get("is_expandable", False)
        if expandable is None:
            expandable = False
        if type(expandable) not in (bool, int):
            raise SnapError(f"{where}: is_expandable must be a bool, got {_tname(expandable)}")
        pool = s.get("segment_pool_id", (0, 0))
        it.pool(pool, where)  # validates; the default pool maps to -1
        pool_t = (pool,) if type(pool) is int else ((0, 0) if pool is None else tuple(pool))
        out.append(Segment(
            device=_int(s.get("device", 0), where, "device", hi=MAX_DEVICE),
            address=seg_addr,
            total_size=total,
            allocated_size=_int(_dflt(s, "allocated_size", allocated), where, "allocated_size",
                                hi=MAX_BYTES),
            active_size=_int(_dflt(s, "active_size", allocated), where, "active_size",
                             hi=MAX_BYTES),
            requested_size=_int(_dflt(s, "requested_size", allocated), where, "requested_size",
                                hi=MAX_BYTES),
            stream=it.stream(s.get("stream", 0), where),
            segment_type=_clean_str(seg_type),
            pool_id=pool_t,
            is_expandable=bool(expandable),
            stack=stack(s.get("frames"), where),
            blocks=blocks,
        ))
    if sum(float(s.total_size) for s in out) > MAX_TOTAL:
        raise SnapError("segments add up to more memory than any device could hold")
    if legacy:
        fmt["legacy_block_history"] = True
    return out


def _dflt(d: dict, key: str, default: Any) -> Any:
    v = d.get(key)
    return default if v is None else v


def _place_annotations(raw: Any, traces: list[Trace]) -> list[Annotation]:
    """External annotations carry only a time: place each before the first later trace row."""
    if raw is None:
        return []
    if type(raw) not in _LISTS:
        raise SnapError(f"external_annotations must be a list, got {_tname(raw)}")
    by_dev = {t.device: t for t in traces}
    sorted_ok = {t.device: len(t) > 0 and not np.isnan(t.time_us).any()
                 and not (np.diff(t.time_us) < 0).any() for t in traces}
    out = []
    for i, a in enumerate(raw):
        where = f"external_annotations[{i}]"
        if type(a) is not dict:
            raise SnapError(f"{where} is {_tname(a)}, expected a dict")
        stage = a.get("stage", "START")
        if type(stage) is not str:
            raise SnapError(f"{where}: stage must be a string, got {_tname(stage)}")
        stage = stage.upper()
        name = a.get("name", "")
        if type(name) is not str:
            raise SnapError(f"{where}: name must be a string, got {_tname(name)}")
        dev = a.get("device", 0)
        dev = dev if type(dev) is int else 0
        t = _time(a.get("time_us"), where)
        trace = by_dev[dev] if dev in by_dev else (traces[0] if traces else None)
        if trace is None or math.isnan(t):
            continue
        # START sits before rows of the same time, END after them.
        side: Literal["left", "right"] = "left" if stage == "START" else "right"
        row = int(np.searchsorted(trace.time_us, t, side=side)) if sorted_ok[trace.device] \
            else len(trace)
        out.append(Annotation(trace.device, "END" if stage == "END" else "START",
                              _clean_str(name), t, row))
    return out


RANK_PATTERNS = (
    re.compile(r"(?:^|[^a-z])rank[_-]?(\d{1,6})(?!\d)", re.I),  # rank3.pickle, snapshot_rank_3
    re.compile(r"^(\d{6})_step_\d+(?:\D|$)"),  # torchtitan: 000003_step_10.pickle
    re.compile(r"^snapshot_\d{9,}_(\d{1,5})\.(?:pickle|pkl)\b"),  # MindSpeed-MM
)
_RANK_DIR = re.compile(r"^rank[_-]?(\d{1,6})$", re.I)


def rank_from_name(path: str) -> int | None:
    """The rank a file name shows, by the conventions seen in the wild; None when it shows none.

    Only these shapes count, so other digits (steps, timestamps, sizes) are never taken for a
    rank: `rank{R}` anywhere in the name (`rank3.pickle`, `snapshot_rank_3_step_2.pickle`),
    torchtitan `{rank:06d}_step_{N}.pickle`, MindSpeed-MM `snapshot_{time}_{rank}.pickle`, or,
    when the name shows none, a parent directory named exactly `rank{R}`.
    """
    parts = [x for x in re.split(r"[\\/]", str(path)) if x]
    if not parts:
        return None
    name = parts[-1]
    for pat in RANK_PATTERNS:
        m = pat.search(name)
        if m:
            return int(m.group(1))
    if len(parts) > 1:
        m = _RANK_DIR.match(parts[-2])
        if m:
            return int(m.group(1))
    return None


def _is_npu_frame(f: Frame) -> bool:
    fn, name = f.filename, f.name
    return ("torch_npu" in fn or "/npu/" in fn or "\\npu\\" in fn
            or "c10_npu::" in name or "NPUCachingAllocator" in name or "torch_npu" in name
            or "aclrtMalloc" in name)


_WIN_PATH = re.compile(r"^[A-Za-z]:[\\/]")


def _detect_format(raw: dict, traces: list[Trace], segments: list[Segment], it: _Interner,
                   provenance: dict, keys: set, fmt: dict) -> dict:
    rows = sum(len(t) for t in traces)
    has_time = rows > 0 and all(not np.isnan(t.time_us).all() for t in traces if len(t))
    fmt["has_time"] = has_time
    fmt["entries"] = rows
    workspace = sum(int((t.action == A["workspace_snapshot"]).sum()) for t in traces)
    npu_frame = next((f for f in it.frames if _is_npu_frame(f)), None)
    used_streams = set(it.streams)
    if isinstance(provenance.get("backend"), str) and provenance["backend"]:
        backend, why = provenance["backend"], "recorded by snapforensics"
    elif any(s.segment_type == "cpu" for s in segments):
        backend, why = "cpu", "cpu pseudo segments"
    elif workspace:
        backend, why = "npu", "workspace_snapshot entries (torch_npu only)"
    elif npu_frame is not None:
        backend, why = "npu", f"torch_npu frames ({npu_frame.filename or npu_frame.name})"
    elif not has_time and used_streams and 0 not in used_streams:
        # CUDA's default stream is handle 0 and every CUDA file since 2.2 has time_us; torch_npu
        # logs no time and its default stream is a pointer.
        backend, why = "npu", "no time_us and no default (0) stream: torch_npu stream pointers"
    else:
        backend, why = "cuda", "default"
    fmt["backend"] = backend
    fmt["backend_evidence"] = why
    actions = {a for t in traces for a in np.unique(t.action).tolist()}
    if "pool_id" in keys or A["annotate"] in actions:
        era = "torch main (pool_id / annotate)"
    elif "user_metadata" in keys:
        era = "torch>=2.10"
    elif "compile_context" in keys:
        era = "torch>=2.8"
    elif "external_annotations" in raw:
        era = "torch>=2.5"
    elif A["user_defined"] in actions:
        era = "torch>=2.4"
    elif "allocator_settings" in raw:
        era = "torch>=2.3"
    elif has_time:
        era = "torch>=2.2"
    elif fmt.get("legacy_block_history"):
        era = "torch 2.0 (block history)"
    elif backend == "npu":
        era = "torch_npu (no time_us)"
    elif rows:
        era = "torch 2.1 (no time_us)"
    else:
        era = "unknown (no history)"
    if isinstance(provenance.get("torch_version"), str):
        era = f"torch {provenance['torch_version']}"
    fmt["era"] = era
    fmt["trace_keys"] = sorted(k for k in keys if isinstance(k, str))
    fmt["expandable_segments"] = any(s.is_expandable for s in segments) or any(
        bool((t.action == A["segment_map"]).any()) for t in traces)
    fmt["cpp_frames"] = any(f.filename in ("", "??") or "::" in f.name for f in it.frames)
    fmt["windows_paths"] = any(_WIN_PATH.match(f.filename) for f in it.frames)
    if workspace:
        fmt["workspace_entries"] = workspace
    if it.pools:
        fmt["pools"] = [list(p) for p in it.pools]
    return fmt


_PLAIN = (str, int, float, bool, type(None))


def _plain(v: Any, depth: int = 0) -> Any:
    """A bounded copy of JSON-like metadata; raises ValueError for anything else."""
    t = type(v)
    if t in _PLAIN:
        if t is int and not -(1 << 63) <= v < (1 << 64):
            raise ValueError("int out of range")
        return _clean_str(v) if t is str else v
    if depth >= 6:
        raise ValueError("nested too deeply")
    if t is dict:
        if len(v) > 10_000:
            raise ValueError("too large")
        return {_clean_str(k): _plain(x, depth + 1) for k, x in v.items() if type(k) is str}
    if t in _LISTS:
        if len(v) > 10_000:
            raise ValueError("too large")
        return [_plain(x, depth + 1) for x in v]
    raise ValueError(f"{t.__name__} is not plain data")


def _metadata(raw: dict, key: str, warnings: list[str]) -> dict:
    v = raw.get(key)
    if v is None:
        return {}
    if type(v) is not dict:
        warnings.append(f"'{key}' is {_tname(v)}, expected a dict; ignored")
        return {}
    try:
        return _plain(v)
    except ValueError as e:
        warnings.append(f"'{key}' is not plain data ({e}); ignored")
        return {}


def normalize(raw: Any, source: str = "<memory>", warnings: list[str] | None = None,
              file_info: dict | None = None) -> Snapshot:
    warnings = list(warnings or [])
    it = _Interner()
    it.keep_alive.append(raw)
    fmt: dict[str, Any] = {}
    bare = False
    if type(raw) in _LISTS:
        raw = {"segments": list(raw), "device_traces": []}
        bare = True
        warnings.append("bare segment list (torch.cuda.memory_snapshot()): no allocation history")
    if type(raw) is not dict:
        raise SnapError(f"not a memory snapshot: the pickle holds a {_tname(raw)}, "
                        "expected a dict with 'segments' and 'device_traces'")
    if "segments" not in raw and "device_traces" not in raw:
        shown = ", ".join(_short(k) for k in list(raw)[:6])
        raise SnapError(f"not a memory snapshot: no 'segments' or 'device_traces' key "
                        f"(keys: {shown or 'none'})")
    segments = _segments(raw.get("segments") or [], it, fmt)
    dt = raw.get("device_traces")
    if dt is None:
        dt = []
    if type(dt) not in _LISTS:
        raise SnapError(f"device_traces must be a list, got {_tname(dt)}")
    if len(dt) > MAX_DEVICE:
        raise SnapError(f"device_traces has {len(dt)} lists, more than any machine has devices")
    inline: list[Annotation] = []
    keys: set = set()
    traces = [_trace(entries, d, it, inline, keys) for d, entries in enumerate(dt)]
    if float(sum(float(t.size.sum(dtype=np.float64)) for t in traces)) > MAX_TOTAL:
        raise SnapError("trace sizes add up to more memory than any device could hold")
    for t in traces:
        if len(t) > 1 and not np.isnan(t.time_us).any() and (np.diff(t.time_us) < 0).any():
            if not (t.action == A["workspace_snapshot"]).any():
                warnings.append(f"device {t.device}: trace times go backwards; kept file order")
    annotations = sorted(_place_annotations(raw.get("external_annotations"), traces) + inline,
                         key=lambda a: (a.device, a.row))
    provenance = _metadata(raw, "snapforensics", warnings)
    settings = _metadata(raw, "allocator_settings", warnings)
    _detect_format(raw, traces, segments, it, provenance, keys, fmt)
    fmt["bare_segment_list"] = bare
    if file_info:
        fmt["gzip"] = bool(file_info.get("gzip"))
        if file_info.get("stale_bytes"):
            fmt["stale_bytes"] = int(file_info["stale_bytes"])
    if fmt.get("segments_not_tiled"):
        warnings.append(f"{fmt['segments_not_tiled']} segments whose blocks do not add up to "
                        "their total_size (synthetic or edited file); segment totals are taken "
                        "from total_size")
    rank = provenance.get("rank")
    if type(rank) is not int or not 0 <= rank < (1 << 31):
        rank = rank_from_name(source)
    return Snapshot(
        source=source,
        frames=it.frames,
        stacks=it.stacks,
        strings=it.strings,
        streams=it.streams,
        traces=traces,
        segments=segments,
        annotations=annotations,
        allocator_settings=settings,
        provenance=provenance,
        format=fmt,
        rank=rank,
        warnings=warnings,
        pools=it.pools,
        kind=_kind(fmt, provenance),
    )


def _kind(fmt: dict, provenance: dict) -> Format:
    backend = fmt.get("backend")
    backend = Backend(backend) if backend in set(Backend) else Backend.UNKNOWN
    cpu = backend == Backend.CPU or bool(provenance.get("cpu_recorded"))
    return Format(backend=backend, caching_allocator=not cpu,
                  expandable_segments=bool(fmt.get("expandable_segments")), cpu_recorded=cpu)
