"""The on-disk cache: a re-run on an unchanged snapshot skips unpickling and interning.

    from snapforensics.snapshot import cache
    snap = cache.load(path)              # the interned model, from the cache when it is there

This module holds the key, the settings, eviction and the entry files; the entry format is
`npz.py` (the model as numpy arrays, validated like a file on every read), and the cache of
diagnosis documents lives a layer above (`snapforensics/doccache.py`): the loader's package
never imports the analysis.

Every entry is read through the loader's `open_file` (a regular file, opened once, never a
FIFO or a device), up to the cache's size bound; an entry that fails any check is ignored,
deleted and rewritten from the snapshot.

Key: the file's size, mtime (ns) and a content hash, plus a tag of the loader's source code (a new
loader never reads an old entry). Two hashes:

- `sampled` (the default on a workstation): the whole file up to 4 MiB; beyond that, the first
  and last MiB plus 16 64-KiB chunks spread over the file (3 MiB whatever the size). On a 55 MB
  file, blake2b over the whole file took 0.84 s where reading and validating the entry took
  0.12 s, and it grows with the file. A rewrite that keeps the size, the mtime to the
  nanosecond and those 3 MiB is not something a training job does by accident.
- `full`: every byte. The default when `CI=true`, and for the CI gate (`--fail-on`): there the
  inputs may come from someone who would rewrite a file that way.

`SNAPFORENSICS_CACHE_HASH=sampled|full` picks one. The key is computed on the open file the
loader then reads, so what is hashed is what is loaded.

Where: `$SNAPFORENSICS_CACHE_DIR`, else `$XDG_CACHE_HOME/snapforensics`, else
`~/.cache/snapforensics`. Bounded: after each write the least recently used entries (a hit
touches its files) are evicted until the total is under `$SNAPFORENSICS_CACHE_SIZE` (bytes, or
with a K/M/G/T suffix; default 2G; 0 disables the cache). `SNAPFORENSICS_NO_CACHE=1` or
`--no-cache` skip it. Failing to write the cache (read-only home, full disk) is never an error;
a malformed setting is (exit 2, one line).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from snapforensics import __version__
from snapforensics.errors import SnapError
from snapforensics.snapshot import budget, npz
from snapforensics.snapshot import normalization as loader
from snapforensics.snapshot.model import Snapshot
from snapforensics.snapshot.npz import BadEntry
from snapforensics.snapshot.unpickle import open_file

DEFAULT_LIMIT = 2 << 30
FULL_HASH_MAX = 4 << 20
_SAMPLE, _CHUNK, _CHUNKS = 1 << 20, 64 << 10, 16
_NAME = re.compile(r"^[0-9a-f]{32}(\.npz|\.[0-9a-f]{16}\.json)$")
HASHES = ("sampled", "full")


# ---------------------------------------------------------------------------------- settings

def enabled() -> bool:
    return not os.environ.get("SNAPFORENSICS_NO_CACHE") and limit() > 0


def limit() -> int:
    v = os.environ.get("SNAPFORENSICS_CACHE_SIZE", "").strip().upper()
    if not v:
        return DEFAULT_LIMIT
    m = re.fullmatch(r"(\d{1,15})\s*([KMGT]?)I?B?", v)
    if not m:
        raise SnapError(f"SNAPFORENSICS_CACHE_SIZE={v[:40]!r}: expected bytes with an optional "
                        "K/M/G/T suffix (e.g. 2G; 0 disables the cache)")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2) or " "))


def full_hash(gate: bool = False) -> bool:
    """Whether keys hash every byte: `SNAPFORENSICS_CACHE_HASH`, else under CI (`CI=true`) or
    for the gate."""
    v = os.environ.get("SNAPFORENSICS_CACHE_HASH", "").strip().lower()
    if v:
        if v not in HASHES:
            raise SnapError(f"SNAPFORENSICS_CACHE_HASH={v[:40]!r}: expected sampled or full")
        return v == "full"
    return gate or os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def directory() -> Path:
    if os.environ.get("SNAPFORENSICS_CACHE_DIR"):
        return Path(os.environ["SNAPFORENSICS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "snapforensics"


def _source_tag(*packages: str) -> str:
    """A hash of the code that produces an entry: changing it invalidates the entry."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(f"{npz.SCHEMA} {__version__}".encode(), digest_size=8)
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


_TAGS: dict[tuple[str, ...], str] = {}


def tag(*packages: str) -> str:
    if packages not in _TAGS:
        _TAGS[packages] = _source_tag(*packages)
    return _TAGS[packages]


def key(f: IO[bytes], full: bool | None = None) -> str | None:
    """The entry name for an open snapshot file (`unpickle.open_file`) as it is now; None when it
    cannot be read (the loader says why). `full`: hash every byte (default: `full_hash()`)."""
    full = full_hash() if full is None else full
    try:
        st = os.fstat(f.fileno())
        h = hashlib.blake2b(digest_size=16)
        # the expansion budget is part of the key: a file accepted under a larger factor must
        # still be refused under a smaller one
        h.update(f"{tag('snapshot')} {st.st_size} {st.st_mtime_ns} {budget.factor()} "
                 f"{'full' if full else ''}".encode())
        f.seek(0)
        if full or st.st_size <= FULL_HASH_MAX:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        else:
            h.update(f.read(_SAMPLE))
            step = st.st_size // (_CHUNKS + 1)
            for i in range(1, _CHUNKS + 1):
                f.seek(i * step)
                h.update(f.read(_CHUNK))
            f.seek(st.st_size - _SAMPLE)
            h.update(f.read(_SAMPLE))
        f.seek(0)
    except (OSError, ValueError):
        return None
    return h.hexdigest()


# ---------------------------------------------------------------------------------- public

def load(path: str | os.PathLike, cache: bool = True, full: bool | None = None,
         file: IO[bytes] | None = None, k: str | None = None) -> Snapshot:
    """The interned model of `path`: from the cache when an entry for the file as it is now
    exists and validates, else from the loader (and then stored). The file is opened once
    (`file`: already opened by `open_file`, with its key `k` when computed; consumed)."""
    f = open_file(path) if file is None else file
    try:
        if k is None and cache and enabled():
            k = key(f, full)
        if k is not None:
            snap = read(f"{k}.npz", lambda e: npz.read(e, str(path)))
            if snap is not None:
                return snap
        snap = loader.load(path, f)
    finally:
        f.close()
    if k is not None:
        write(f"{k}.npz", lambda out: npz.save(snap, out))
    return snap


def evict(bound: int | None = None) -> None:
    """Delete least recently used entries until the cache holds at most `bound` bytes."""
    bound = limit() if bound is None else bound
    try:
        files = [(e.stat().st_mtime_ns, e.stat().st_size, e.path)
                 for e in os.scandir(directory()) if _NAME.match(e.name) and e.is_file()]
    except OSError:
        return
    total = sum(s for _, s, _ in files)
    for _, size, p in sorted(files):
        if total <= bound:
            break
        _remove(Path(p))
        total -= size


# ---------------------------------------------------------------------------------- entries

def read(name: str, parse: Callable[[IO[bytes]], Any], most: int | None = None) -> Any:
    """`parse` of the entry `name`, opened as strictly as a snapshot (a regular file, never a
    FIFO or device, no larger than `most` bytes or the cache's bound); None when it is missing,
    and when it is anything but what `parse` accepts (BadEntry or SnapError), after deleting
    it."""
    entry = directory() / name
    if not os.path.lexists(entry):
        return None
    try:
        with open_file(entry) as f:
            if os.fstat(f.fileno()).st_size > min(limit(), most or limit()):
                raise BadEntry("larger than such an entry can be")
            got = parse(f)
    except (BadEntry, SnapError):
        _remove(entry)  # tampered, truncated or from another version: rebuilt by the caller
        return None
    _touch(entry)
    return got


def write(name: str, save: Callable[[IO[bytes]], None]) -> None:
    """Write the entry `name` to a temp file in the cache dir and rename: readers (other ranks'
    processes) never see half an entry. Any OS error leaves no file and is ignored (a cache is
    optional)."""
    dest = directory() / name
    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            save(f)
        if os.path.getsize(tmp) > limit():
            raise OSError("entry larger than the whole cache")
        os.replace(tmp, dest)
        tmp = None
        evict()
    except OSError:
        pass
    finally:
        if tmp is not None:
            _remove(Path(tmp))


def _touch(p: Path) -> None:
    try:
        os.utime(p)
    except OSError:
        pass


def _remove(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


def read_entry(entry: Path, source: str) -> Snapshot:
    """The model in the entry file `entry`, validated; BadEntry for anything else."""
    try:
        with open_file(entry) as f:
            return npz.read(f, source)
    except SnapError as e:
        raise BadEntry(str(e)) from None


__all__ = ["load", "evict", "key", "directory", "enabled", "limit", "full_hash", "read",
           "write", "tag", "BadEntry", "read_entry"]
