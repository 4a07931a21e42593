"""Issue 21's attacks (a stranger's snapshot, round 3), each a command line run in a subprocess
(used by tests/test_hostile.py, tests/test_fuzz.py and benchmarks/bench_hostile.py).

An attack is `setup(dir) -> Attack`: the argv after `python`, extra environment, and a cleanup
(servers). Files are assembled with tests/hostile.py's opcode helpers from nothing but the
repository, so this runs on a clean clone. Every attack must end in exit 0 or 2 (one stderr line
on exit 2), in bounded time and memory.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hostile import (
    APPENDS,
    EMPTY_DICT,
    EMPTY_LIST,
    FIXTURE,
    MARK,
    MEMOIZE,
    NONE,
    SETITEMS,
    entry,
    f,
    frame,
    get,
    i,
    pkl,
    s,
    snapshot_dict,
    trace_of,
)

CLI = ["-m", "snapforensics"]


@dataclass
class Attack:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cleanup: Callable[[], None] = lambda: None
    file: Path | None = None  # the attacking file, for its size


def _gz(d: Path, name: str, data: bytes) -> Path:
    p = d / name
    p.write_bytes(gzip.compress(data, 6))
    return p


def _plain(d: Path, name: str, data: bytes) -> Path:
    p = d / name
    p.write_bytes(data)
    return p


def _cache_env(d: Path) -> dict[str, str]:
    c = d / "cache"
    c.mkdir(exist_ok=True)
    return {"SNAPFORENSICS_CACHE_DIR": str(c)}


# ----------------------------------------------------------------------------- 1: long strings

def long_frame_name_file(d: Path, chars: int = 20_000_000, refs: int = 100) -> Path:
    """One `chars`-character frame name referenced `refs` times (memo references) by one stack
    of a one-row trace: a ~20 KB gzip inside the string budget."""
    fr = frame(name="a" * chars, filename="x.py") + MEMOIZE  # memo 0
    frames = EMPTY_LIST + MARK + fr + get(0) * (refs - 1) + APPENDS
    return _gz(d, "long_name.pickle.gz", pkl(snapshot_dict(EMPTY_LIST, trace_of(
        [entry(frames=frames)]))))


def long_frame_name(d: Path) -> Attack:
    p = long_frame_name_file(d)
    return Attack([*CLI, "diagnose", str(p), "--format", "json", "--no-cache"], file=p)


# ----------------------------------------------------------------------------- 2: equality bombs

def equality_bomb_file(d: Path, lists: int = 2000, items: int = 1_000_000) -> Path:
    """`lists` frames lists of 8 frames, identical at the positions the interner samples
    (0, 2, 4, 7) and each holding its own copy of one frame at position 1. That frame carries an
    extra key: the first list's copy holds one `items`-item list, every other copy another list
    equal to it, so `==` between a list and the first one walks `items` items (the identity
    short cut never applies)."""
    big = EMPTY_LIST + MARK + NONE * items + APPENDS  # memo 0 and 1: two equal lists
    shared = frame("g", "s.py", 2) + MEMOIZE  # memo 2

    def frames(extra: int) -> bytes:
        odd = EMPTY_DICT + MARK + s("filename") + s("b.py") + s("line") + i(1) + s("name") + \
            s("h") + s("extra") + get(extra) + SETITEMS
        return EMPTY_LIST + MARK + get(2) + odd + get(2) * 6 + APPENDS
    es = [entry(addr=(k + 1) << 20, frames=frames(0 if k == 0 else 1)) for k in range(lists)]
    body = snapshot_dict(EMPTY_LIST, trace_of(es))
    # the lists and the shared frame are built first (memoized), then popped off the stack
    return _gz(d, "eqbomb.pickle.gz", pkl(big + MEMOIZE + b"0" + big + MEMOIZE + b"0" + shared
                                          + b"0" + body))


def equality_bomb(d: Path) -> Attack:
    p = equality_bomb_file(d)
    return Attack([*CLI, "diagnose", str(p), "--format", "json", "--no-cache"], file=p)


def equality_bomb_python(d: Path) -> Attack:
    a = equality_bomb(d)
    a.env = {"SNAPFORENSICS_PURE_PYTHON": "1"}
    return a


# ----------------------------------------------------------------------------- 3: special files

def _fifo(d: Path, name: str = "rank1.pickle") -> Path:
    p = d / name
    if not p.exists():
        os.mkfifo(p)
    return p


def fifo_cached(d: Path) -> Attack:
    """A FIFO named rank1.pickle, cache on: the cache key read it before the loader's check."""
    p = _fifo(d)
    return Attack([*CLI, "diagnose", str(p), "--format", "json"], _cache_env(d))


def dev_zero_symlink(d: Path) -> Attack:
    p = d / "zero.pickle"
    if not p.is_symlink():
        p.symlink_to("/dev/zero")
    return Attack([*CLI, "diagnose", str(p), "--format", "json"], _cache_env(d))


def glob_fifo(d: Path) -> Attack:
    run = d / "run"
    run.mkdir(exist_ok=True)
    good = run / "rank0.pickle.gz"
    if not good.exists():
        good.write_bytes(FIXTURE.read_bytes())
    _fifo(run)
    return Attack([*CLI, "diagnose", str(run / "rank*.pickle*"), "--format", "json", "-j", "2"],
                  _cache_env(d))


def _api(call: str) -> list[str]:
    """A Python line through the API: its SnapError is one stderr line and exit 2, as the CLI
    does; any other exception is a traceback and exit 1 (a bug)."""
    return ["-c", "import sys\nimport snapforensics as sf\nfrom snapforensics.errors import "
                  f"SnapError\ntry:\n    {call}\nexcept SnapError as e:\n"
                  "    sys.exit(print(e, file=sys.stderr) or 2)"]


def api_compare_fifo(d: Path) -> Attack:
    p = _fifo(d)
    return Attack(_api(f"sf.compare({str(FIXTURE)!r}, {str(p)!r})"), _cache_env(d))


def api_load_bytes(d: Path) -> Attack:
    return Attack(_api(f"sf.load(open({str(FIXTURE)!r}, 'rb').read())"))


# ----------------------------------------------------------------------------- 4: extreme numbers

def extreme_times_file(d: Path) -> Path:
    es = [entry(time=f(-1e308)), entry("free_requested", time=f(1e308)),
          entry("free_completed", time=f(1e308))]
    return _plain(d, "times.pickle", pkl(snapshot_dict(EMPTY_LIST, trace_of(es))))


def extreme_times_html(d: Path) -> Attack:
    return Attack([*CLI, "diagnose", str(extreme_times_file(d)), "-o", str(d / "t.html"),
                   "--no-cache"])


def extreme_times_md(d: Path) -> Attack:
    return Attack([*CLI, "diagnose", str(extreme_times_file(d)), "-o", str(d / "t.md"),
                   "--no-cache"])


# ----------------------------------------------------------------------------- 5: many devices

def many_devices_file(d: Path, devices: int = 1000) -> Path:
    trace = EMPTY_LIST + MEMOIZE + MARK + entry() + entry("free_completed") + APPENDS  # memo 0
    traces = EMPTY_LIST + MARK + trace + get(0) * (devices - 1) + APPENDS
    return _plain(d, "devices.pickle", pkl(snapshot_dict(EMPTY_LIST, traces)))


def many_devices_md(d: Path) -> Attack:
    p = many_devices_file(d)
    return Attack([*CLI, "diagnose", str(p), "-o", str(d / "r.md"), "--no-cache"], file=p)


# ----------------------------------------------------------------------------- 6: cache entries

def _seed_cache(d: Path, src: Path) -> Path:
    """Diagnose `src` once with the cache in `d`/cache, so that its entries exist."""
    import subprocess
    import sys

    tree = os.environ.get("ATTACK_TREE", str(Path.cwd()))  # the code under test seeds it
    env = dict(os.environ, PYTHONPATH=tree, **_cache_env(d))
    subprocess.run([sys.executable, *CLI, "diagnose", str(src), "--format", "json"], env=env,
                   capture_output=True, timeout=300, check=False, cwd=tree)
    return d / "cache"


def _doc_entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.name.endswith(".json"))


def _copy_fixture(d: Path) -> Path:
    p = d / "rank0.pickle.gz"
    if not p.exists():
        p.write_bytes(FIXTURE.read_bytes())
    return p


def _tamper(d: Path, how: str) -> Attack:
    src = _copy_fixture(d)
    cache = _seed_cache(d, src)
    docs = _doc_entries(cache)
    assert docs, "the cache was not seeded"
    for doc in docs:
        text = doc.read_text()
        doc.unlink()
        if how == "fifo":
            os.mkfifo(doc)
        elif how == "zero":
            doc.symlink_to("/dev/zero")
        elif how == "types":  # a well-formed document of this version, one field retyped
            data = json.loads(text)
            data["devices"][0]["peaks"] = [1, 2]
            doc.write_text(json.dumps(data))
    return Attack([*CLI, "diagnose", str(src), "--format", "json"], _cache_env(d))


def cache_doc_fifo(d: Path) -> Attack:
    return _tamper(d, "fifo")


def cache_doc_dev_zero(d: Path) -> Attack:
    return _tamper(d, "zero")


def cache_doc_wrong_types(d: Path) -> Attack:
    return _tamper(d, "types")


def stale_same_size_mtime(d: Path) -> Attack:
    """A file rewritten in place keeping its size and mtime, changed outside the chunks the
    sampled key reads (one block's size: 512 B -> 1 GiB): the gate (--fail-on) must see the new
    content. The script diagnoses the original (cached), rewrites it, diagnoses again, and exits
    3 when the second report still shows the old peak."""
    a = d / "stale.pickle"
    big = 1 << 30

    def snap(size: int) -> bytes:
        # a 3 MiB string before the trace puts the entry past the sampled head
        return pkl(EMPTY_DICT + MARK + s("pad") + s("p" * (3 << 20)) + s("segments")
                   + EMPTY_LIST + s("device_traces") + trace_of([entry(size=size)]) + SETITEMS)
    old, new = snap(512), snap(big)
    assert len(old) == len(new)
    a.write_bytes(old + bytes(8 << 20))  # stale bytes after the pickle: an 11 MiB file
    st = a.stat()
    script = (
        "import json, os, subprocess, sys\n"
        f"p = {str(a)!r}\n"
        "cmd = [sys.executable, '-m', 'snapforensics', 'diagnose', p, '--format', 'json',"
        " '--fail-on', 'anomalous']\n"
        "subprocess.run(cmd, capture_output=True)\n"
        f"new = open(p, 'rb').read().replace({old[-200:]!r}, {new[-200:]!r})\n"
        "open(p, 'r+b').write(new)\n"
        f"os.utime(p, ns=({st.st_atime_ns}, {st.st_mtime_ns}))\n"
        "r = subprocess.run(cmd, capture_output=True)\n"
        "sys.stderr.write(r.stderr.decode())\n"
        "if r.returncode not in (0, 1):\n"
        "    sys.exit(r.returncode)\n"
        "peak = json.loads(r.stdout)['peaks']['overall_bytes']\n"
        f"sys.exit(0 if peak == {big} else 3)\n")
    return Attack(["-c", script], _cache_env(d), file=a)


# ----------------------------------------------------------------------------- 7: --scheduler

def _server(answer: bytes | None) -> tuple[int, Callable[[], None]]:
    """A local TCP server: answers every connection with `answer` (then keeps it open), or
    accepts and never answers (None)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            conns.append(c)
            if answer is not None:
                try:
                    c.sendall(answer)
                except OSError:
                    pass
    threading.Thread(target=serve, daemon=True).start()

    def close() -> None:
        stop.set()
        for c in conns:
            c.close()
        srv.close()
    return srv.getsockname()[1], close


_HTTP = (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 24\r\n\r\n"
         b"<html>dashboard</html>\r\n")


def scheduler_http(d: Path) -> Attack:
    port, close = _server(_HTTP)
    src = _copy_fixture(d)
    return Attack([*CLI, "diagnose", str(src), str(src), "--scheduler", f"tcp://127.0.0.1:{port}",
                   "--format", "json"], cleanup=close)


def scheduler_silent(d: Path) -> Attack:
    port, close = _server(None)
    src = _copy_fixture(d)
    return Attack([*CLI, "diagnose", str(src), str(src), "--scheduler", f"tcp://127.0.0.1:{port}",
                   "--format", "json"], cleanup=close)


# ----------------------------------------------------------------------------- 8: options

def _forecast(*opts: str) -> Callable[[Path], Attack]:
    def setup(d: Path) -> Attack:
        return Attack([*CLI, "forecast", str(FIXTURE), *opts, "--format", "json"])
    setup.__name__ = "forecast" + "_".join(o.strip("-").replace("-", "_")[:12] for o in opts)
    return setup


def micro_batch_huge(d: Path) -> Attack:
    return _forecast("--micro-batch-scale", "1e12,1e14,inf")(d)


def world_size_huge(d: Path) -> Attack:
    return _forecast("--world-size", str(10 ** 26))(d)


def world_size_400_digits(d: Path) -> Attack:
    return _forecast("--world-size", "1" + "0" * 400)(d)


def capacity_huge(d: Path) -> Attack:
    return _forecast("--capacity", "1e400GiB")(d)


def many_categories(d: Path) -> Attack:
    cats = [x for k in range(130) for x in ("--category", f"c{k}=f{k}")]
    return Attack([*CLI, "diagnose", str(FIXTURE), "--format", "json", "--no-cache", *cats])


def env_expansion_inf(d: Path) -> Attack:
    return Attack([*CLI, "diagnose", str(FIXTURE), "--format", "json", "--no-cache"],
                  {"SNAPFORENSICS_EXPANSION": "inf"})


def env_expansion_nan(d: Path) -> Attack:
    """nan must not turn the budget off: the shared-traces file stays refused (or nan is)."""
    from hostile import shared_traces
    return Attack([*CLI, "diagnose", str(shared_traces(d)), "--format", "json", "--no-cache"],
                  {"SNAPFORENSICS_EXPANSION": "nan"})


def env_progress_abc(d: Path) -> Attack:
    src = _copy_fixture(d)
    return Attack([*CLI, "diagnose", str(src), str(src), "--format", "json", "--no-cache"],
                  {"SNAPFORENSICS_PROGRESS_AFTER": "abc"})


ATTACKS: dict[str, Callable[[Path], Attack]] = {a.__name__: a for a in (
    long_frame_name, equality_bomb, equality_bomb_python, fifo_cached, dev_zero_symlink,
    glob_fifo, api_compare_fifo, api_load_bytes, extreme_times_html, extreme_times_md,
    many_devices_md, cache_doc_fifo, cache_doc_dev_zero, cache_doc_wrong_types,
    stale_same_size_mtime, scheduler_http, scheduler_silent, micro_batch_huge, world_size_huge,
    world_size_400_digits, capacity_huge, many_categories, env_expansion_inf, env_expansion_nan,
    env_progress_abc)}
