"""Diagnose many snapshot files at once: local processes or a Dask cluster, with progress.

    docs = run(["runs/x"], jobs=4)                       # every rank of a run folder
    docs = run(["s3://bucket/job/"], scheduler="tcp://10.0.0.5:8786")

Each input is diagnosed where it is read (a worker process here, a Dask worker there) and only
the diagnosis document (`Diagnosis.to_doc()`: the JSON plus the bounded plot series, at most
~0.5 MB) comes back, never a snapshot. Every input kind (one file, a folder, a glob, a URL) takes
this one route, so every report has its plot.

Workers on one machine: `min(jobs, inputs, MemAvailable // per-worker RSS of the largest file)`,
at least 1. The RSS estimate is 8x the file's unpickled size plus 200 MiB per process: the
issue-10 measurements peak at 3.7x (1 GB file, a frames list per entry) and 7.1x (1 GB file,
16M entries with shared frame lists) of the file size, and the interpreter with numpy/pandas
takes ~150 MiB. A gzip'd file's unpickled size is its trailer's ISIZE (exact below 4 GiB).

Inputs: files, globs, run folders (their rank files in rank order), and fsspec URLs
(`s3://`, `gs://`, `file://`, ...): remote files are streamed to a local temporary file by the
worker that diagnoses them (the loader reads only local files) and are not cached.
"""

from __future__ import annotations

import glob as _glob
import os
import struct
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from pathlib import Path
from typing import Any

from snapforensics.errors import SnapError
from snapforensics.settings import number

SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")
RSS_FACTOR = 8  # x the unpickled file size; see the module docstring
RSS_BASE = 200 << 20
# a bar only for runs that last longer than this (env SNAPFORENSICS_PROGRESS_AFTER, seconds)
PROGRESS_AFTER_S = 2.0


def is_url(s: str) -> bool:
    return "://" in s and not s.startswith("file://")


def local_path(s: str) -> str:
    return s[len("file://"):] if s.startswith("file://") else s


def _rank_order(names: list[str]) -> list[str]:
    from snapforensics.snapshot import rank_from_name

    return sorted(names, key=lambda q: (rank_from_name(q) is None, rank_from_name(q) or 0, q))


def _pick_snapshots(names: list[str]) -> list[str]:
    """A run folder's snapshot files: those whose name shows a rank (all of them when none
    does); OOM-time dumps (`rank{R}.oom.pickle`) are separate moments, not ranks."""
    from snapforensics.snapshot import rank_from_name

    snaps = [n for n in names if n.lower().endswith(SUFFIXES) and ".oom." not in n.lower()]
    ranked = [n for n in snaps if rank_from_name(n) is not None]
    return _rank_order(ranked or snaps)


def expand(args: Iterable[str | os.PathLike]) -> list[str]:
    """Inputs as given, in order; a folder stands for its rank files in rank order; a glob that
    names no file as such is expanded (locally, or on its fsspec filesystem)."""
    out: list[str] = []
    for a in map(str, args):
        if is_url(a):
            out += _expand_url(a)
            continue
        a = local_path(a)
        p = Path(a)
        if p.is_dir():
            files = _pick_snapshots([str(q) for q in p.iterdir() if q.is_file()])
            if not files:
                raise SnapError(f"{p}: is a directory with no rank snapshot files "
                                "(rank*.pickle)")
            out += files
        elif not p.exists() and any(ch in a for ch in "*?["):
            hits = _glob.glob(a)
            if not hits:
                raise SnapError(f"{a}: no file matches this pattern")
            out += _rank_order(hits)
        else:
            out.append(a)
    return out


def _expand_url(url: str) -> list[str]:
    try:
        import fsspec
        fs, path = fsspec.core.url_to_fs(url)
        if any(ch in path for ch in "*?["):
            hits = [fs.unstrip_protocol(h) for h in fs.glob(path)]
            if not hits:
                raise SnapError(f"{url}: no file matches this pattern")
            return _rank_order(hits)
        if fs.isdir(path):
            files = _pick_snapshots([fs.unstrip_protocol(x) for x in fs.ls(path, detail=False)])
            if not files:
                raise SnapError(f"{url}: no rank snapshot files there")
            return files
        return [url]
    except SnapError:
        raise
    except ImportError as e:
        raise SnapError(f"{url}: reading URLs needs fsspec and its backend ({e.name}); "
                        "pip install 'snapforensics[fleet]'") from None
    except Exception as e:  # noqa: BLE001 - a storage backend's error, one line
        raise SnapError(f"{url}: cannot list: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------------- one input

def diagnose_one(src: str, cache: bool = True, variant: str = "",
                 categories: tuple[str, ...] = (), full: bool | None = None,
                 fd: int | None = None) -> dict[str, Any]:
    """Runs on a worker: one input in, its diagnosis document (or its one-line error) out.
    `categories`: user categories as `NAME=REGEX` (compiled here, in the worker); `full`: key
    the cache by every byte (`cache.full_hash`); `fd`: the input as the caller opened it
    (`_open_inputs`; a forked worker inherits it), else it is opened here."""
    from snapforensics import doccache

    try:
        if not is_url(src):
            file = os.fdopen(os.dup(fd), "rb") if fd is not None else None
            return doccache.diagnose(local_path(src), cache, variant, categories,
                                     full, file).to_doc()
        with tempfile.TemporaryDirectory(prefix="snapforensics-") as tmp:
            local = os.path.join(tmp, src.rstrip("/").rsplit("/", 1)[-1] or "snapshot")
            _fetch(src, local)
            doc = doccache.diagnose(local, False, variant, categories).to_doc()
        doc["source"] = src
        return doc
    except SnapError as e:
        return {"source": src, "error": str(e).replace(local_path(src) + ": ", "", 1)}


def _fetch(url: str, local: str) -> None:
    import shutil

    import fsspec
    try:
        with fsspec.open(url, "rb") as f, open(local, "wb") as out:
            shutil.copyfileobj(f, out, 8 << 20)
    except FileNotFoundError:
        raise SnapError(f"{url}: no such file") from None
    except Exception as e:  # noqa: BLE001 - a storage backend's error, one line
        raise SnapError(f"{url}: cannot read: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------------- sizing

def size_of(src: str) -> int:
    """The input's size in bytes (0 when unknown)."""
    try:
        if is_url(src):
            import fsspec
            fs, path = fsspec.core.url_to_fs(src)
            return int(fs.size(path) or 0)
        return os.path.getsize(local_path(src))
    except Exception:  # noqa: BLE001 - unknown size only weakens the estimate
        return 0


def unpickled_size(src: str, size: int, f: Any = None) -> int:
    """The bytes the unpickler reads: a gzip file's ISIZE trailer, else the file size (`f`:
    the input already opened by `open_file`; else it is opened here, never blocking)."""
    if is_url(src) or size < 18:
        return size
    from snapforensics.snapshot.unpickle import open_file

    try:
        g = open_file(local_path(src)) if f is None else f
        try:
            g.seek(0)
            if g.read(2) != b"\x1f\x8b":
                return size
            g.seek(-4, os.SEEK_END)
            isize = struct.unpack("<I", g.read(4))[0]
        finally:
            if f is None:
                g.close()
    except (OSError, SnapError):
        return size
    return isize if isize >= size else size * 10  # wrapped mod 4 GiB: assume 10x


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def workers_for(srcs: list[str], sizes: list[int], jobs: int,
                files: dict[int, Any] | None = None) -> int:
    files = files or {}
    per = RSS_BASE + RSS_FACTOR * max((unpickled_size(s, n, files.get(i))
                                       for i, (s, n) in enumerate(zip(srcs, sizes))), default=0)
    avail = mem_available()
    fit = max(1, avail // per) if avail else jobs
    return max(1, min(jobs, len(srcs), fit))


# ---------------------------------------------------------------------------------- running

def run(args: Iterable[str | os.PathLike], jobs: int | None = None, cache: bool = True,
        scheduler: str | None = None, progress: bool = True,
        variant: str = "", expanded: bool = False,
        categories: tuple[str, ...] = (), full: bool | None = None,
        on_doc: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Diagnose every input; documents (or {"source", "error"}) in input order. `expanded`:
    the inputs are files already (`expand`'s result), not folders or globs; `full`: key the
    cache by every byte of each file (`cache.full_hash`); `on_doc`: called with each document
    as it arrives (e.g. `fleet.WorstPlots.add`, which drops plot series no report will draw)."""
    srcs = [str(a) for a in args] if expanded else expand(args)
    if not srcs:
        raise SnapError("no input given")
    files, refused = ({}, {}) if scheduler else _open_inputs(srcs)
    try:
        sizes = [os.fstat(files[i].fileno()).st_size if i in files else size_of(s)
                 for i, s in enumerate(srcs)]
        n = 0 if scheduler else workers_for(srcs, sizes, jobs or os.cpu_count() or 1, files)
        return _run(srcs, sizes, n, files, refused, cache, scheduler, progress, variant,
                    categories, full, on_doc or (lambda doc: None))
    finally:
        for f in files.values():
            f.close()


def _open_inputs(srcs: list[str]) -> tuple[dict[int, Any], dict[int, dict]]:
    """Each local input opened once, here, before any worker exists (`open_file`: a FIFO or a
    device is refused at once); forked workers inherit the descriptors, so each reads the very
    file checked here. ({index: open file}, {index: error document}). Where descriptors
    would not be inherited (no fork) or would exceed the process's limit, workers open
    their inputs themselves, through the same function."""
    import multiprocessing as mp
    import resource

    from snapforensics.snapshot.unpickle import open_file

    local = [i for i, s in enumerate(srcs) if not is_url(s)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(local) + 256
    if need > soft and (hard == resource.RLIM_INFINITY or need <= hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            soft = need
        except (ValueError, OSError):
            pass
    if "fork" not in mp.get_all_start_methods() or need > soft:
        return {}, {}
    files, refused = {}, {}
    for i in local:
        try:
            files[i] = open_file(local_path(srcs[i]))
        except SnapError as e:
            refused[i] = {"source": srcs[i],
                          "error": str(e).replace(local_path(srcs[i]) + ": ", "", 1)}
    return files, refused


def _run(srcs: list[str], sizes: list[int], n: int, files: dict[int, Any],
         refused: dict[int, dict], cache: bool, scheduler: str | None, progress: bool,
         variant: str, categories: tuple[str, ...], full: bool | None,
         on_doc: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    def fd(i: int) -> int | None:
        return files[i].fileno() if i in files else None

    todo = [i for i in range(len(srcs)) if i not in refused]
    docs: list[Any] = [refused.get(i) for i in range(len(srcs))]
    if n == 1:  # in this thread: Ctrl-C interrupts the work itself
        with _Progress(srcs, sizes, progress, lambda: [os.getpid()]) as bar:
            for i in todo:
                docs[i] = diagnose_one(srcs[i], cache, variant, categories, full, fd(i))
                on_doc(docs[i])
                bar.advance(sizes[i])
        return docs
    if scheduler:
        ex, close = _dask_executor(scheduler)
    else:
        import multiprocessing as mp

        import snapforensics.analysis  # noqa: F401 - imported once, inherited by the forks
        import snapforensics.doccache  # noqa: F401
        # fork: workers start in milliseconds with everything imported, and never re-run the
        # caller's main module (a training script using the API). The pool forks all its
        # workers on the first submit, before any thread of ours (the progress bar) starts.
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        ex = futures.ProcessPoolExecutor(n, mp_context=mp.get_context(method))
        close = ex.shutdown  # type: ignore[assignment]
    futs: dict[futures.Future, int] = {}
    ok = False
    try:
        futs = {ex.submit(diagnose_one, srcs[i], cache, variant, tuple(categories), full,
                          fd(i)): i for i in todo}
        with _Progress(srcs, sizes, progress,
                       lambda: list(getattr(ex, "_processes", None) or ())) as bar:
            for f in futures.as_completed(futs):
                docs[futs[f]] = f.result()
                on_doc(docs[futs[f]])
                bar.advance(sizes[futs[f]])
        ok = True
        return docs
    finally:
        for f in futs:
            f.cancel()
        close(wait=ok)


def _dask_executor(address: str) -> tuple[futures.Executor, Callable]:
    """A client of the scheduler at `address`. The handshake runs under a watchdog
    (`SNAPFORENSICS_SCHEDULER_TIMEOUT` seconds, 10 by default: Dask's own timeout does not
    cover a server that accepts and never answers), and any failure of the client (an HTTP
    server answering, a frame length of exabytes, a refused connection) is one line, exit 2."""
    try:
        from distributed import Client
    except ImportError:
        raise SnapError("--scheduler needs dask.distributed: pip install "
                        "'snapforensics[fleet]'") from None
    wait = float(number("SNAPFORENSICS_SCHEDULER_TIMEOUT"))
    got: list[Any] = []

    def connect() -> None:
        try:
            got.append(Client(address, timeout=wait))
        except BaseException as e:  # noqa: BLE001 - any client error is the user's one line
            got.append(e)

    t = threading.Thread(target=connect, name="dask-handshake", daemon=True)
    t.start()
    t.join(wait + 1)
    if not got:
        raise SnapError(f"the Dask scheduler at {address[:200]} did not complete the handshake "
                        f"in {wait:g} s (is it a Dask scheduler? the dashboard port is not; "
                        "SNAPFORENSICS_SCHEDULER_TIMEOUT sets the wait)")
    if isinstance(got[0], BaseException):
        e = got[0]
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        raise SnapError(f"cannot use the Dask scheduler at {address[:200]}: "
                        f"{type(e).__name__}: {msg}") from None
    client = got[0]
    ex = client.get_executor(pure=False)

    def close(wait: bool = True) -> None:
        ex.shutdown(wait=False)
        client.close()
    return ex, close


class _Progress:
    """A rich bar on stderr (bytes read, ranks done) once a run passes PROGRESS_AFTER_S;
    nothing when stderr is not a terminal or progress is off (-q). A daemon thread redraws it,
    so it moves while the work runs in this thread. Bytes read count finished files plus, on
    Linux, how far each worker has read into its file (its open file's offset in
    /proc/PID/fdinfo), so a single big file moves the bar too."""

    def __init__(self, srcs: list[str], sizes: list[int], enabled: bool,
                 pids: Callable[[], list[int]]):
        self.on = enabled and sys.stderr.isatty()
        self.ranks, self.total = len(srcs), sum(sizes)
        self.done = self.bytes = 0
        self.after = float(number("SNAPFORENSICS_PROGRESS_AFTER"))
        self.paths = {os.path.realpath(local_path(s)) for s in srcs if not is_url(s)}
        self.pids = pids
        self.stop = threading.Event()
        self.drawer = threading.Thread(target=self._draw, name="snapforensics-progress",
                                       daemon=True)

    def __enter__(self) -> _Progress:
        if self.on:
            self.drawer.start()
        return self

    def advance(self, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        if self.drawer.is_alive():
            self.drawer.join(timeout=2)  # the bar is erased before the report is printed

    def _in_flight(self) -> int:
        total = 0
        for pid in self.pids():
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in self.paths:
                        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                            total += int(f.readline().split()[1])
                except (OSError, ValueError, IndexError):
                    continue
        return total

    def _draw(self) -> None:
        if self.stop.wait(self.after):
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        with Progress(TextColumn("diagnosing"), BarColumn(), DownloadColumn(),
                      TextColumn("{task.fields[ranks]}"), TimeElapsedColumn(),
                      TimeRemainingColumn(), console=Console(stderr=True), transient=True,
                      auto_refresh=False) as bar:
            task = bar.add_task("", total=self.total or None, ranks="")
            while True:
                done = min(self.total, self.bytes + self._in_flight())
                bar.update(task, completed=done, ranks=f"{self.done}/{self.ranks} ranks")
                bar.refresh()
                if self.stop.wait(0.25):
                    return
