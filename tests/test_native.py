"""The C trace reader and pairing walk (snapshot/_native.c) against the Python paths.

Both read the same files into the same Snapshot; the C reader declines (returns None) every
trace it does not fully understand, and the Python path then reads it and names the bad row,
so a hostile or odd file gets the same result or the same error through either.
"""

from __future__ import annotations

import copy
import pickle
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from corpus import corpus_files

from snapforensics.analysis import lifetimes
from snapforensics.errors import SnapError
from snapforensics.snapshot import load
from snapforensics.snapshot.columns import MAX_BYTES
from snapforensics.snapshot.model import ALLOC, FREE_COMPLETED, FREE_REQUESTED, A
from snapforensics.snapshot.native import native
from snapforensics.snapshot.normalization import normalize
from snapforensics.snapshot.unpickle import read_raw

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

FILES = sorted(FIXTURES.glob("*.pickle*")) + corpus_files()
FIELDS = ("action", "addr", "size", "stream", "time_us", "stack")


def _same(a, b) -> None:
    assert a.frames == b.frames
    assert a.stacks == b.stacks
    assert a.streams == b.streams
    assert a.segments == b.segments
    assert a.annotations == b.annotations
    assert a.format == b.format
    assert a.warnings == b.warnings
    assert len(a.traces) == len(b.traces)
    for ta, tb in zip(a.traces, b.traces):
        for f in FIELDS:
            x, y = getattr(ta, f), getattr(tb, f)
            assert x.dtype == y.dtype, f
            assert np.array_equal(x, y, equal_nan=True), f
        assert ta.device_free == tb.device_free


def _both(read, monkeypatch):
    """`read()` through the C reader, then through the Python path: (result or error, ...)."""
    out = []
    for pure in (False, True):
        if pure:
            monkeypatch.setenv("SNAPFORENSICS_PURE_PYTHON", "1")
        else:
            monkeypatch.delenv("SNAPFORENSICS_PURE_PYTHON", raising=False)
        try:
            out.append(read())
        except SnapError as e:
            out.append(str(e))
    return out


needs_native = pytest.mark.skipif(native() is None, reason="the C reader is not built here")


def test_the_c_reader_is_built_where_a_c_compiler_is():
    """pip builds it when a compiler and Python's headers are there (setup.py marks it optional,
    so a machine without them installs and reads files through the Python path)."""
    headers = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers:
        pytest.skip("no C compiler or no Python headers: the Python path reads every file")
    assert native() is not None


@needs_native
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_both_paths_read_every_real_file_into_the_same_snapshot(path, monkeypatch):
    a, b = _both(lambda: load(path), monkeypatch)
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
    else:
        _same(a, b)


def _raw():
    raw, _ = read_raw(FIXTURES / "fsdp2_ckpt_buggy_rank0.pickle.gz")
    return raw


def _entries(raw):
    return max(raw["device_traces"], key=len)


# One entry of a real recording edited: (field, value, whether the C reader reads it itself)
EDITS = [
    ("addr", None, True),  # oom entries: read as 0
    ("stream", None, True),
    ("time_us", None, True),
    ("time_us", 12, True),
    ("frames", None, True),
    ("frames", (), True),
    ("addr", -1, False),
    ("addr", 1 << 64, False),
    ("addr", True, False),
    ("size", MAX_BYTES + 1, False),
    ("size", 1.5, False),
    ("stream", "s", False),
    ("stream", 1 << 63, False),  # valid, rare: the Python path interns it
    ("time_us", "t", False),
    ("time_us", 10 ** 400, False),
    ("time_us", float("inf"), False),
    ("frames", {"a": 1}, False),
    ("frames", "abc", False),
    ("action", 3, False),
    ("action", None, False),
]


@needs_native
@pytest.mark.parametrize("field,value,reads", EDITS, ids=lambda v: repr(v)[:20])
def test_an_odd_value_reads_the_same_or_fails_the_same_through_both_paths(
        field, value, reads, monkeypatch):
    raw = _raw()
    entries = _entries(raw)
    row = len(entries) // 2
    entries[row] = dict(entries[row], **{field: value})
    got = native().trace_columns(entries, A, A["other"], MAX_BYTES)
    assert (got is not None) == reads
    a, b = _both(lambda: normalize(copy.copy(raw)), monkeypatch)
    if isinstance(a, str) or isinstance(b, str):
        assert a == b and f"[{row}]" in a  # the Python path names the row
    else:
        _same(a, b)


@needs_native
@pytest.mark.parametrize("entry", [("a", "tuple"), 7, None, ["list"]])
def test_an_entry_that_is_not_a_dict_is_named_through_both_paths(entry, monkeypatch):
    raw = _raw()
    entries = _entries(raw)
    entries[5] = entry
    assert native().trace_columns(entries, A, A["other"], MAX_BYTES) is None
    a, b = _both(lambda: normalize(raw), monkeypatch)
    assert a == b and "[5] is" in a and "expected a dict" in a


@needs_native
def test_a_missing_key_reads_as_torch_defaults_and_an_unknown_action_as_other(monkeypatch):
    raw = _raw()
    entries = _entries(raw)
    for k in ("addr", "size", "stream", "time_us", "frames"):
        entries[10 + len(k)] = {x: v for x, v in entries[10 + len(k)].items() if x != k}
    entries[3] = dict(entries[3], action="a_future_action")
    a, b = _both(lambda: normalize(raw), monkeypatch)
    _same(a, b)
    assert a.traces[-1].action[3] == A["other"]


@needs_native
def test_lists_are_grouped_by_the_identity_of_their_frames_not_by_the_list_object():
    raw = _raw()
    entries = _entries(raw)
    fr = [e["frames"] for e in entries if e.get("frames")]
    same_content = list(fr[0])  # another list object holding the same frame objects
    copied_frames = [dict(f) for f in fr[0]]  # equal frames, other objects
    rows = [dict(entries[0], frames=x) for x in (fr[0], same_content, copied_frames, fr[0])]
    got = native().trace_columns(rows, A, A["other"], MAX_BYTES)
    group = np.frombuffer(got[5], np.int32).tolist()
    first = np.frombuffer(got[6], np.int64).tolist()
    assert group == [0, 0, 1, 0] and first == [0, 2]
    # and the interner then gives the copied frames the same stack as the originals
    snap = normalize({"segments": [], "device_traces": [rows]})
    assert len(set(snap.traces[0].stack.tolist())) == 1


@needs_native
def test_one_long_list_shared_by_many_rows_is_one_group():
    """A small file can point 100,000 rows at one 10,000-frame list (a memo reference each):
    every row gets the list's one group. (That the list is read once, through the by-object
    table, and not hashed per row is a cost this test cannot see; it only checks the result.)"""
    frames = [{"filename": f"f{i}.py", "line": i, "name": "g"} for i in range(10_000)]
    rows = [{"action": "alloc", "addr": 512 * i, "size": 512, "stream": 0, "time_us": i,
             "frames": frames} for i in range(100_000)]
    blob = pickle.dumps({"segments": [], "device_traces": [rows]})
    rows = pickle.loads(blob)["device_traces"][0]  # noqa: S301 (our own bytes)
    got = native().trace_columns(rows, A, A["other"], MAX_BYTES)
    assert set(np.frombuffer(got[5], np.int32).tolist()) == {0}
    assert np.frombuffer(got[6], np.int64).tolist() == [0]


def _events(trace):
    """lifetimes.compute's input to the pairing: alloc/free events sorted by (address, row)."""
    action = trace.action
    rows = np.flatnonzero(np.isin(action, (ALLOC, FREE_REQUESTED, FREE_COMPLETED)))
    order = np.argsort(trace.addr[rows], kind="stable")
    row = rows[order]
    return (row, trace.addr[row], action[row], len(trace),
            bool((action == FREE_REQUESTED).any()))


def _same_pairing(*args) -> None:
    a, b = lifetimes._pair_numpy(*args), lifetimes._pair_native(*args)
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y)
        else:
            assert x == y


@needs_native
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_the_c_pairing_walk_equals_the_numpy_one_on_every_real_trace(path):
    try:
        snap = load(path)
    except SnapError:
        pytest.skip("not a readable snapshot")
    for trace in snap.traces:
        _same_pairing(*_events(trace))


@needs_native
def test_the_c_pairing_walk_equals_the_numpy_one_on_random_traces():
    """Short traces over a few addresses hit every order of alloc / request / completion:
    reuse without a free, orphan requests and completions, double completions, pending frees."""
    rng = np.random.default_rng(7)
    for _ in range(2000):
        m = int(rng.integers(0, 40))
        n = m + int(rng.integers(0, 4))
        act = rng.choice([ALLOC, FREE_REQUESTED, FREE_COMPLETED], m).astype(np.int8)
        addr = rng.integers(0, int(rng.integers(1, 5)), m).astype(np.uint64)
        rows = np.sort(rng.choice(n, m, replace=False)).astype(np.int64)
        order = np.argsort(addr, kind="stable")
        for logs_requests in (False, True):
            _same_pairing(rows[order], addr[order], act[order], n, logs_requests)


@needs_native
def test_a_tuple_and_a_list_of_the_same_frames_cost_the_budget_the_same_through_both_paths(
        monkeypatch):
    """Each distinct frames sequence is interned (and counted against the expansion budget)
    once per path alike: a file at the budget's edge loads, or fails, through both."""
    frames = [{"filename": f"f{i}.py", "line": i, "name": "g"} for i in range(1000)]
    rows = [{"action": "alloc", "addr": 0, "size": 1, "frames": frames},
            {"action": "alloc", "addr": 512, "size": 1, "frames": tuple(frames)}]
    # 1,027: the device (DEVICE_UNITS, charged before any trace is read), 2 rows and 1 trace
    monkeypatch.setenv("SNAPFORENSICS_EXPANSION", str((2027 + 1500) / 2 ** 20))
    a, b = _both(lambda: normalize({"segments": [], "device_traces": [rows]},
                                   file_info={"pickle_bytes": 0}), monkeypatch)
    # the tuple is compared with the list (same sampled frames) before it is interned: that
    # work counts too (issue 21), so the budget ends at the stacks, alike through both paths
    assert isinstance(a, str) and a == b and "frames in distinct stacks" in a
