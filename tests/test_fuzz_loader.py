"""Property: whatever the file holds, `load` + `diagnose` either work or raise SnapError.

Inputs are real snapshots from the corpus, mutated: bytes flipped, inserted, deleted or the file
cut short; fields anywhere in the tree replaced by values of random types (huge, negative, NaN,
surrogates, bytes, deep nesting), keys deleted, lists extended with junk. Bounded to run in well
under a minute.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from corpus import CORPUS  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from snapforensics.analysis import diagnose  # noqa: E402
from snapforensics.errors import SnapError  # noqa: E402
from snapforensics.snapshot import load, normalize  # noqa: E402
from snapforensics.snapshot.columns import MAX_TIME_US  # noqa: E402

SOURCES = [
    "silmont2000_mem_snapshot.pickle",  # complete history, 97 entries
    "albi2_dump_snapshot.pickle",  # 2 devices, segments only, allocator settings
    "mosaic_output.pickle",  # synthetic: several streams, list pool ids, annotations
    "Felixburton7_dump_snapshot_b.pickle",  # segments only
    "MemSnapDump_snapshot_1768383987920985470.pkl",  # torch_npu
]
AVAILABLE = [n for n in SOURCES if (CORPUS / n).is_file()]
if not AVAILABLE:
    pytest.skip(f"snapshot corpus not found at {CORPUS}", allow_module_level=True)

DATA = {n: (CORPUS / n).read_bytes() for n in AVAILABLE}
TMP = Path(tempfile.mkdtemp(prefix="snapforensics-fuzz-"))
atexit.register(shutil.rmtree, TMP, ignore_errors=True)
FUZZ = settings(max_examples=int(os.environ.get("SNAPFORENSICS_FUZZ_EXAMPLES", "150")),
                deadline=None, database=None,
                # the same examples on every run unless told to explore (as tests/test_fuzz.py)
                derandomize=os.environ.get("SNAPFORENSICS_FUZZ_SEED") != "random",
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def only_snap_errors(fn) -> None:
    try:
        fn()
    except SnapError as e:
        assert str(e) and "\n" not in str(e)


def load_and_diagnose(path: Path) -> None:
    diagnose(load(path))


# -- byte level ------------------------------------------------------------------------------

mutation = st.tuples(
    st.sampled_from(["flip", "flip", "set", "insert", "delete", "cut"]),
    st.integers(min_value=0, max_value=2**32),
    st.binary(min_size=1, max_size=8),
)


@FUZZ
@given(source=st.sampled_from(AVAILABLE), edits=st.lists(mutation, min_size=1, max_size=4),
       gz=st.booleans())
def test_corrupted_bytes(source, edits, gz):
    data = bytearray(DATA[source])
    for kind, where, blob in edits:
        if len(data) < 4:
            break
        i = 2 + where % (len(data) - 2)  # keep the protocol header: exercise the unpickler
        if kind == "flip":
            data[i] ^= blob[0] or 1
        elif kind == "set":
            data[i:i + len(blob)] = blob
        elif kind == "insert":
            data[i:i] = blob
        elif kind == "delete":
            del data[i:i + len(blob)]
        else:
            del data[i:]
    if gz:
        import gzip
        data = bytearray(gzip.compress(bytes(data)))
    p = TMP / "bytes.pickle"
    p.write_bytes(bytes(data))
    only_snap_errors(lambda: load_and_diagnose(p))


# -- structure level -------------------------------------------------------------------------


def deep(n: int, leaf=None):
    v = leaf
    for _ in range(n):
        v = [v]
    return v


scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(),
    st.sampled_from([-1, 0, 1, 2**31, 2**50, 2**56, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                     -2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3),
    st.binary(max_size=10),
    st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc",
                     "segment_free", "segment_map", "segment_unmap", "oom", "snapshot",
                     "user_defined", "annotate", "workspace_snapshot", "active_allocated",
                     "active_pending_free", "inactive", "START", "END", "", "N/A"]),
)
values = st.one_of(
    scalars,
    st.recursive(scalars, lambda c: st.one_of(
        st.lists(c, max_size=4), st.tuples(c, c),
        st.dictionaries(st.sampled_from(["filename", "name", "line", "addr", "size", "action",
                                         "frames", "blocks", "state", "stream", "time_us"]),
                        c, max_size=4)), max_leaves=12),
    st.integers(1_000, 30_000).map(deep),
    st.builds(lambda n: {"filename": deep(n), "line": 1, "name": "x"},
              st.integers(1_000, 30_000)),
)


def paths_of(raw, limit: int = 4000) -> list[tuple]:
    """(container, key) pairs of the tree, breadth first, frames included."""
    out: list[tuple] = []
    todo = [raw]
    seen: set[int] = set()
    while todo and len(out) < limit:
        obj = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            out.append((obj, k))
            if isinstance(v, (dict, list)):
                todo.append(v)
    return out


edit = st.tuples(st.sampled_from(["replace", "replace", "replace", "delete", "append"]),
                 st.floats(0, 1, allow_nan=False), values)


@FUZZ
@given(source=st.sampled_from(AVAILABLE), edits=st.lists(edit, min_size=1, max_size=5),
       via_file=st.booleans())
def test_wrong_types_anywhere(source, edits, via_file):
    raw = pickle.loads(DATA[source])
    for kind, where, value in edits:
        paths = paths_of(raw)
        if not paths:
            break
        obj, key = paths[min(int(where * len(paths)), len(paths) - 1)]
        if kind == "replace":
            obj[key] = value
        elif kind == "delete" and isinstance(obj, dict):
            del obj[key]
        elif isinstance(obj.get(key) if isinstance(obj, dict) else obj[key], list):
            (obj[key]).append(value)
        else:
            obj[key] = value
    if via_file:
        try:
            blob = pickle.dumps(raw, protocol=4)
        except (RecursionError, ValueError):
            via_file = False
        else:
            p = TMP / "tree.pickle"
            p.write_bytes(blob)
            only_snap_errors(lambda: load_and_diagnose(p))
            return
    only_snap_errors(lambda: diagnose(normalize(raw, source="fuzz.pickle")))


@FUZZ
@given(source=st.sampled_from(AVAILABLE),
       value=st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.none()),
       field=st.sampled_from(["addr", "size", "stream", "time_us", "action", "device_free",
                              "user_metadata", "compile_context", "pool_id", "frames"]),
       every=st.integers(1, 7))
def test_one_field_of_many_entries(source, value, field, every):
    """The same bad value in a field of every k-th entry (the column converters' error paths)."""
    raw = pickle.loads(DATA[source])
    for t in raw.get("device_traces") or []:
        for e in t[::every]:
            e[field] = value
    try:
        snap = normalize(raw, source="fuzz.pickle")
    except SnapError:
        return
    diagnose(snap)
    # Accepted: then the model holds exactly the value that was written.
    for t in snap.active_traces:
        rows = slice(None, None, every)
        if field == "size":
            assert type(value) is int and t.size[rows].tolist() == [value] * len(t.size[rows])
        elif field == "addr":
            assert type(value) is int or value is None
            assert t.addr[rows].tolist() == [value or 0] * len(t.addr[rows])
        elif field == "time_us":
            want = math.nan if value is None else float(value)
            if abs(want) > MAX_TIME_US:  # no clock reads that: the whole trace is untimed
                assert any("treated as untimed" in w for w in snap.warnings), snap.warnings
                assert np.isnan(t.time_us).all()
                continue
            assert all(x == want or (math.isnan(x) and math.isnan(want))
                       for x in t.time_us[rows].tolist())
        elif field == "stream":
            assert {snap.streams[s] for s in t.stream[rows].tolist()} <= {value or 0}
