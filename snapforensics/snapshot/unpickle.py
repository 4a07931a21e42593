"""Reading a snapshot file safely: the bytes in, the raw unpickled object out.

- Refuses every pickle global (no code from the file ever runs) while keeping the C unpickler.
- While unpickling, the address space the process may grow by is capped (Linux), so a tiny
  hostile pickle cannot make the C unpickler allocate tens of GB (e.g. a huge memo index).
- gzip'd files; stale bytes after the pickle STOP (torch_npu rewrites files without truncating).
- One SnapError line for every way the file can be unreadable, never a traceback.
"""

from __future__ import annotations

import gc
import gzip
import io
import mmap
import os
import pickle
import re
import stat
import sys
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from snapforensics.errors import SnapError
from snapforensics.settings import number
from snapforensics.snapshot import keys
from snapforensics.snapshot.columns import short, tname


def _ident(v: Any) -> str:
    """A module or attribute name from the file, shown bare when it looks like one."""
    if isinstance(v, str) and re.fullmatch(r"[A-Za-z_][\w.]{0,79}", v):
        return v
    return short(v)


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


def address_limit(budget: int) -> int | None:
    """The address space the process may reach during a read that may add `budget` bytes: its
    size now + `budget` (`SNAPFORENSICS_LOAD_MEMORY` overrides the budget in bytes; 0 disables
    the guard); None where no cap applies (not Linux, disabled). Computed once per read, so
    every phase of the read (the stream reader, the unpickler, normalization) shares it."""
    if os.environ.get("SNAPFORENSICS_LOAD_MEMORY", "").strip():
        budget = int(number("SNAPFORENSICS_LOAD_MEMORY"))
    vm = _vm_size()
    if budget <= 0 or vm is None:
        return None
    return vm + budget


@contextmanager
def memory_guard(limit: int | None) -> Iterator[None]:
    """Cap the process's address space at `limit` (`address_limit`) while the block runs, unless
    a cap at least as tight is already set. Never around a thread's start (its stack counts):
    `on_stack` enters it on the new thread."""
    try:
        import resource
    except ImportError:  # not POSIX
        yield
        return
    if limit is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield  # already tighter than ours
        return
    try:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextmanager
def gc_paused() -> Iterator[None]:
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


def open_file(path: str | os.PathLike) -> Any:
    """`path` opened for reading, once, as a regular file; every reader of a snapshot (the
    cache key, the loader, the workers) gets this file object, so none can block or read a
    device: the path is looked up without opening it (a symlink to `/dev/zero`, a FIFO, a
    socket are refused before any open), then opened with O_NONBLOCK (a FIFO swapped in between
    opens at once instead of waiting for a writer) and checked again on the descriptor itself.
    One SnapError line for every way it fails."""
    if not isinstance(path, (str, os.PathLike)):
        raise SnapError(f"expected a path to a snapshot file, got {tname(path)}")
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise SnapError(f"{p}: no such file") from None
    except PermissionError:
        raise SnapError(f"{p}: permission denied (cannot look up the file; check the "
                        "directory permissions)") from None
    except (OSError, ValueError) as e:
        raise SnapError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    _regular(p, st.st_mode)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(p, flags)
    except PermissionError:
        raise SnapError(_permission_message(p, st.st_mode)) from None
    except (OSError, ValueError) as e:
        raise SnapError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        st = os.fstat(fd)
        _regular(p, st.st_mode)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def file_kind(f: Any, path: str | os.PathLike) -> tuple[int, bool]:
    """(size in bytes, gzipped) of `f` (opened by `open_file`), left at its start; closed on
    failure."""
    try:
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        head = f.read(2)
        f.seek(0)
    except (OSError, ValueError) as e:
        f.close()
        raise SnapError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    return size, head == b"\x1f\x8b"


def _regular(p: Path, mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise SnapError(f"{p}: is a directory, expected a snapshot file (e.g. {p}/rank0.pickle)")
    if not stat.S_ISREG(mode):
        raise SnapError(f"{p}: not a regular file (a pipe, socket or device?); pass a snapshot "
                        "file")


def _permission_message(p: Path, mode: int) -> str:
    perm = stat.S_IMODE(mode)
    if perm & 0o444 == 0:
        return (f"{p}: permission denied (file mode {perm:04o}, nobody may read it; "
                "torch_npu's _dump_snapshot creates snapshots with mode 0200): "
                f"run `chmod u+r {p}` (or `sudo chmod 644 {p}`) and retry")
    return (f"{p}: permission denied (file mode {perm:04o}, owned by uid {os.stat(p).st_uid}): "
            f"make it readable, e.g. `chmod a+r {p}`, or run as its owner")


# Opcodes that build a tuple (or hash its items into a frozenset). Nesting tuples makes hash()
# recurse in C with no depth check (a deep tuple used as a dict key overflows the C stack and
# kills the process). A stream holds at most as many of these opcodes as it has bytes of these
# values, so that count bounds the nesting depth before anything is unpickled.
_TUPLE_OPS = b"t\x85\x86\x87\x91"
_NOT_TUPLE_OPS = bytes(c for c in range(256) if c not in _TUPLE_OPS)
_STACK_PER_LEVEL = 128  # bytes of C stack one tuple level costs in hash() (measured: ~64)
_MAX_STACK = 8 << 30  # a nesting bound above this is refused, not reserved
GZIP_RATIO = 64  # a snapshot pickle compresses ~9x; more than this much is not one
# The load-memory guard: address space the read may add, per byte of pickle plus a fixed
# allowance. pickle.load of the corpus and fixtures peaks at 6-13x the pickle's bytes in RSS
# (benchmarks/bench_hostile.py prints it); 32x leaves room for address space beyond RSS, and
# the allowance covers the interpreter's arenas and buffers on tiny files. A 9-byte file that
# PUTs memo index 2^28 (a 2 GiB memo) is refused in milliseconds instead of filling 4 GiB.
LOAD_PER_BYTE = 32
LOAD_ALLOWANCE = 256 << 20


def load_budget(pickle_bytes: int) -> int:
    return LOAD_PER_BYTE * pickle_bytes + LOAD_ALLOWANCE


def pickle_bound(size: int, gzipped: bool) -> int:
    """The most pickle bytes a file of `size` bytes is read for (a gzip inflates to at most
    GZIP_RATIO x its size, or 64 MiB)."""
    return max(64 << 20, GZIP_RATIO * size) if gzipped else size


def memory_message(p: Any, size: int) -> str:
    return (f"{p}: the pickle asks for more memory than a snapshot of {size} bytes can need "
            "(corrupt or hostile file); if it is genuine, raise the cap with "
            "SNAPFORENSICS_LOAD_MEMORY=<bytes> (0 = no cap)")


def _count_tuple_ops(data: bytes) -> int:
    return len(data.translate(None, _NOT_TUPLE_OPS))


def _plain_bytes(f: Any, p: Path) -> int:
    """Tuple-opcode bytes of an uncompressed file (read once in chunks; stays in page cache)."""
    n = 0
    try:
        while chunk := f.read(16 << 20):
            n += _count_tuple_ops(chunk)
        f.seek(0)
    except OSError as e:
        raise SnapError(f"{p}: cannot read: {e.strerror or e}") from None
    return n


def _mapped(f: Any, p: Path) -> Any:
    """An uncompressed file's bytes, mapped read-only (the pages the unpickler reads next)."""
    try:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise SnapError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}") from None


def _gunzip(f: Any, size: int, p: Path) -> tuple[bytes, bool, str]:
    """The decompressed stream, at most GZIP_RATIO x the file (or 64 MiB), whether it was cut
    there, and the error that ended it early ("" if none). Trailing bytes after the pickle (a
    gzip padded with GBs of zeros) are never all inflated."""
    cap = pickle_bound(size, True)
    stream = gzip.GzipFile(fileobj=f, mode="rb")
    parts: list[bytes] = []
    n, err = 0, ""
    try:
        while n <= cap and (chunk := stream.read1(min(1 << 20, cap + 1 - n))):
            parts.append(chunk)
            n += len(chunk)
    except (OSError, EOFError, zlib.error) as e:
        err = f"{tname(e)}: {str(e)[:200]}"
    data = b"".join(parts)
    return data[:cap], n > cap, err


def _load(stream: Any, data: Any, bound: int, limit: int | None) -> Any:
    """Unpickle with the globals refused, under the memory guard, on a thread whose C stack
    holds any tuple nesting the stream can describe (`bound` levels), after `keys.check` of the
    pickle's bytes (`data`: bytes or an mmap) found no dict the unpickler could be made to hash
    in quadratic time."""

    def load() -> Any:
        with gc_paused():
            keys.check(data)
            return _RefuseGlobals(stream).load()

    return on_stack(load, bound, limit)


def on_stack(fn: Any, bound: int, limit: int | None = None) -> Any:
    """`fn()` on a thread whose C stack holds `bound` levels of tuple nesting: unpickling, and
    everything that hashes or walks the unpickled objects afterwards (normalization hashes pool
    ids and keys: a 300,000-deep tuple there overflowed the main thread's stack); under the
    memory guard's `limit`, entered on that thread once it has started."""
    need = (16 << 20) + bound * _STACK_PER_LEVEL
    if need > _MAX_STACK:
        raise SnapError(f"the pickle may nest tuples {bound} deep; a memory snapshot nests them "
                        "2 deep (not a memory snapshot, or hostile)")
    result: list[Any] = []

    def run() -> None:
        try:
            with memory_guard(limit):
                result.append(fn())
        except BaseException as e:  # noqa: BLE001 handed to the caller's thread
            result.append(e)
            result.append(None)

    old = threading.stack_size()
    hook = sys.excepthook
    # A failed BYTEARRAY8 makes CPython print "deallocated bytearray object has exported
    # buffers" through sys.excepthook: the load's own error is the one line the user gets.
    sys.excepthook = lambda *a: None
    try:
        threading.stack_size(need)
        t = threading.Thread(target=run, name="unpickle", daemon=True)
        t.start()
        threading.stack_size(old)
        t.join()
    except (RuntimeError, ValueError, MemoryError):
        raise SnapError(f"cannot reserve {need >> 20} MiB of stack to unpickle this file safely "
                        "(the pickle may nest tuples that deep)") from None
    finally:
        threading.stack_size(old)
        sys.excepthook = hook
    if len(result) == 2:
        raise result[0]
    return result[0]


def read_raw_info(path: str | os.PathLike, file: Any = None,
                  limit: int | None | bool = True) -> tuple[Any, list[str], dict]:
    """Unpickle `path` safely. Returns the raw object, loader warnings and facts about the file.
    `file`: `path` already opened by `open_file` (read from its start; closed here). `limit`:
    the enclosing read's `address_limit` (True: this file's own)."""
    f = open_file(path) if file is None else file
    p = Path(path)
    try:
        f.seek(0)
        size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError) as e:
        f.close()
        raise SnapError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    info: dict[str, Any] = {"file_bytes": size, "gzip": False, "stale_bytes": 0}
    warnings: list[str] = []
    cut, damaged = False, ""
    with f:
        try:
            head = f.read(256)
            f.seek(0)
        except OSError as e:
            raise SnapError(f"{p}: cannot read: {e.strerror or e}") from None
        if not head:
            raise SnapError(f"{p}: empty file, not a snapshot")
        stream: Any = f
        if head[:2] == b"\x1f\x8b":
            info["gzip"] = True
            data, cut, damaged = _gunzip(f, size, p)
            if not data and damaged:
                kind = "truncated" if damaged.startswith("EOFError") else "corrupt"
                raise SnapError(f"{p}: {kind} gzip file ({damaged})")
            if not data:
                raise SnapError(f"{p}: empty gzip file, not a snapshot")
            head = data[:256]
            stream = io.BytesIO(data)
            bound = _count_tuple_ops(data)
            info["pickle_bytes"] = len(data)
        if head[:1] != b"\x80" and head[:1] not in (b"(", b"]", b"}"):
            m = _GLOBAL_FIRST.match(head)
            if m:  # a protocol 0/1 pickle that opens with a global (GLOBAL or INST opcode)
                ref = f"{_ident(m.group(1).decode('ascii'))}.{_ident(m.group(2).decode('ascii'))}"
                raise SnapError(f"{p}: refused: the pickle references the global {ref}; "
                                "memory snapshots contain only plain data, so this file is "
                                "either not a memory snapshot or unsafe to open (nothing from "
                                "it was executed)")
            raise SnapError(_not_pickle_message(p, head))
        if not info["gzip"]:
            bound = _plain_bytes(f, p)
            info["pickle_bytes"] = size
        if limit is True:
            limit = address_limit(load_budget(info["pickle_bytes"]))
        info["tuple_bound"] = bound
        try:
            obj = _load(stream, data if info["gzip"] else _mapped(f, p), bound, limit)
        except SnapError as e:
            raise SnapError(f"{p}: {e}") from None
        except RecursionError:
            raise SnapError(f"{p}: pickle nested too deeply, not a memory snapshot") from None
        except MemoryError:
            raise SnapError(memory_message(p, size)) from None
        except EOFError as e:
            if damaged and not damaged.startswith("EOFError"):
                raise SnapError(f"{p}: corrupt gzip file ({damaged})") from None
            if cut:
                raise SnapError(
                    f"{p}: the gzip stream inflates to more than {GZIP_RATIO}x its size before "
                    "the pickle ends; a memory snapshot compresses about 9x (corrupt or hostile "
                    "file)") from None
            kind = "gzip stream" if info["gzip"] else "pickle"
            why = damaged.partition(": ")[2] if damaged else (e or "ran out of input")
            raise SnapError(f"{p}: truncated {kind} ({why}); the dump was "
                            "probably interrupted or the copy is incomplete") from None
        except Exception as e:  # noqa: BLE001 corrupt opcodes, bad memo refs, unhashable keys: all bad input
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            raise SnapError(f"{p}: truncated or corrupt pickle ({tname(e)}: {msg})") from None
        try:
            stale = (len(data) - stream.tell()) if info["gzip"] else size - f.tell()
        except OSError:
            stale = 0
        if damaged:
            warnings.append("the gzip stream is damaged after the pickle end; ignored")
    if stale > 0:
        info["stale_bytes"] = stale
        warnings.append(f"{'at least ' if cut else ''}{stale} stale bytes after the pickle end "
                        "(torch_npu rewrites snapshot files without truncating them); ignored")
    return obj, warnings, info


def read_raw(path: str | os.PathLike) -> tuple[Any, list[str]]:
    """Unpickle `path` safely. Returns the raw object and loader warnings."""
    obj, warnings, _ = read_raw_info(path)
    return obj, warnings


__all__ = ["open_file", "read_raw", "read_raw_info", "gc_paused", "on_stack", "memory_guard",
           "address_limit"]

