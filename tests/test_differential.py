"""Issue 26, "one grammar": the three read paths agree on opcode-level mutants of real pickles
(tests/differential.py): all refuse with one line and the same exit code, or all give the same
Snapshot. A failure names the seed, the mutant's index and its mutations, and what each path said.

    SNAPFORENSICS_DIFF_SEED=7 SNAPFORENSICS_DIFF_COUNT=20000 python -m pytest \
        tests/test_differential.py -k ci

Sized on the 2-core dev machine: ~15 ms a mutant with the corpus present (2,000 in ~30 s); from
the fixtures alone (no corpus) a mutant costs ~40 ms, so that run is 600.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os

import pytest
from differential import run, sources

SEED = int(os.environ.get("SNAPFORENSICS_DIFF_SEED", "26"))
_CORPUS = any(not s.name.endswith(".gz") for s in sources())
COUNT = int(os.environ.get("SNAPFORENSICS_DIFF_COUNT", "2000" if _CORPUS else "600"))


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("SNAPFORENSICS_NO_CACHE", "1")
    monkeypatch.delenv("SNAPFORENSICS_LOAD_MEMORY", raising=False)


def _check(seed: int, count: int) -> None:
    # In a forked child: the loader caps the process's address space while it reads, and in a
    # pytest-xdist worker that cap also starves execnet's threads (a mutant that reaches it
    # took the worker down); the child has only the reading thread.
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        failures, tally = pool.submit(run, seed, count).result()
    print(f"seed {seed}: {count} mutants: {tally}")
    # the population exercises both outcomes, and the stream reader itself (not only its
    # declines): otherwise agreement would be vacuous
    assert tally.get("refused", 0) and tally.get("ok, streamed", 0), tally
    assert not failures, f"{len(failures)} of {count} mutants disagree:\n" + "\n".join(
        failures[:20])


def test_ci_population_agrees():
    _check(SEED, COUNT)


@pytest.mark.full
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_full_population_agrees(seed):
    _check(1000 + seed, 10 * COUNT)


def test_the_comparison_sees_a_difference(tmp_path):
    """The check can fail: one row's size changed in one path's Snapshot is a disagreement."""
    import gzip

    from differential import FIXTURES, compare, disagreement, read

    data = gzip.decompress(FIXTURES[0].read_bytes())
    results = compare(data, FIXTURES[0].name)
    assert disagreement(results) == "", results.keys()
    p = tmp_path / "x.pickle"
    p.write_bytes(data)
    from snapforensics.snapshot import load
    snap = load(p)
    t = snap.active_traces[0]
    t.size[0] += 1
    snap.source = "<file>"
    from differential import canonical
    results["pure"] = ("ok", canonical(snap))
    assert read(p, "stream")[0] == "ok"
    assert disagreement(results) == "the paths give different Snapshots"


@pytest.mark.parametrize("key", ["snapforensics", "allocator_settings"])
@pytest.mark.parametrize("ref", [0, 4, 5])  # the root, the device_traces list, a trace
def test_metadata_that_refers_back_to_the_root_or_the_traces(key, ref):
    """Found by cfuzz/ (a mutant whose allocator_settings reached the root dict through the
    memo): the streaming reader's root holds its traces as columns, so a metadata copy walked
    into them warned differently from the Python paths. Metadata never copies those objects."""
    from differential import compare, disagreement
    from hostile import (
        APPEND,
        APPENDS,
        EMPTY_DICT,
        EMPTY_LIST,
        MARK,
        MEMOIZE,
        SETITEMS,
        get,
        pkl,
        s,
    )
    from shapes26 import _entry, _frame

    # memo: 0 root, 1 'segments', 2 its list, 3 'device_traces', 4 its list, 5 the trace
    body = (EMPTY_DICT + MEMOIZE + MARK + s("segments") + MEMOIZE + EMPTY_LIST + MEMOIZE
            + s("device_traces") + MEMOIZE + EMPTY_LIST + MEMOIZE + EMPTY_LIST + MEMOIZE + MARK
            + _entry(EMPTY_LIST + _frame("f") + APPEND) + APPENDS + APPEND
            + s(key) + EMPTY_DICT + MARK + s("inner") + get(ref) + SETITEMS + SETITEMS)
    results = compare(pkl(body))
    assert disagreement(results) == "", results
