"""The timeline plot's series against brute force over the full per-row arrays, on the FSDP
fixture (CPU recording, times) and corpus CUDA files (reserved bytes, no times)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from corpus import corpus_file

from snapforensics.analysis.engine import diagnose_devices
from snapforensics.analysis.timeline import POINTS, alive_by, buckets
from snapforensics.snapshot import load

REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"


@pytest.fixture(scope="module")
def buggy():
    return diagnose_devices(load(BUGGY))


def _check_series(diagnosis, analyses):
    for dev, d in zip(diagnosis.devices, analyses):
        s, live = dev.plot, d.lt.live
        edges = buckets(len(live))
        assert len(s.rows) == len(edges) - 1 <= POINTS
        # each point is its bucket's highest row: the maxima, and so the peak, are exact
        for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
            assert a <= s.rows[i] < b and s.live[i] == live[a:b].max()
        assert s.live[s.peak] == live.max()
        # the stacked layers add up to the live bytes at every point
        assert (s.by_category.sum(axis=0) == s.live).all()
        assert (s.by_category >= 0).all()
        assert np.all(np.diff(s.x) >= 0)
        assert dev.timeline == s.timeline_rows()


def test_fixture_series(buggy):
    diagnosis, analyses = buggy
    d = analyses[0]
    _check_series(diagnosis, analyses)
    s = diagnosis.devices[0].plot
    assert s.x_label == "time (s)" and s.reserved is None  # CPU recording: no allocator
    top = diagnosis.top
    assert s.predicted_rule == top.rule
    assert s.predicted.max() == top.predicted_peak_bytes < s.live.max()
    # the predicted curve keeps each bucket's max of the rule's own replay
    r = top.replay
    live = d.lt.replay(free_row=r.free_row, alloc_row=r.alloc_row, extra=list(r.extra))
    edges = buckets(len(live))
    assert (s.predicted == np.maximum.reduceat(live, edges[:-1])).all()
    assert [i for i, _ in s.iterations] == list(range(len(diagnosis.devices[0].iterations)))


def test_hover_stacks_at_the_peak(buggy):
    diagnosis, (d,) = buggy
    s = diagnosis.devices[0].plot
    alive = np.flatnonzero(d.lt.alive_at(int(s.rows[s.peak])))
    stacks, inv = np.unique(d.lt.stack[alive], return_inverse=True)
    per_stack = np.sort(np.bincount(inv, weights=d.lt.size[alive]))[::-1]
    got = s.top_bytes[s.peak]
    assert list(got) == [int(v) for v in per_stack[:len(got)]]
    assert all(s.stacks[i] for i in s.top_stacks[s.peak] if i >= 0)


def test_alive_by_matches_masks(buggy):
    _, (d,) = buggy
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(d.lt.rows, 50, replace=False))
    got = alive_by(d.lt, d.category, int(d.category.max()) + 1, rows)
    for j, r in enumerate(rows.tolist()):
        m = d.lt.alive_at(r)
        want = np.bincount(d.category[m], weights=d.lt.size[m], minlength=got.shape[0])
        assert (got[:, j] == want).all()


@pytest.mark.parametrize("name", ["MemSnapDump_snapshot_expandable.pkl",
                                  "notHanmin_memory_snapshot.pickle",
                                  "MemSnapDump_snapshot_with_multi_devices.pkl"])
def test_corpus_series(name):
    snap = load(corpus_file(name))
    diagnosis, analyses = diagnose_devices(snap)
    _check_series(diagnosis, analyses)
    for dev in diagnosis.devices:
        s = dev.plot
        if s.reserved is not None:  # the allocator never holds less than what is allocated
            assert (s.reserved >= s.live * 0.99).all()
