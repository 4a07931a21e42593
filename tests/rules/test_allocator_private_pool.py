"""allocator.private_pool on EDITED copies of a real CUDA file: no corpus file has a private
pool (every `segment_pool_id` in ../shared/corpus is (0, 0), checked below), so four of its
40 MiB segments are put in pools the way torch writes them (c10 `MemPool` ids: `(n, 0)` a
graph's own pool, `(0, n)` `graph_pool_handle()` / `MemPool`). The unedited file stays silent."""

from __future__ import annotations

import pickle

import pytest
from corpus import corpus_file
from edits import edited_corpus_file
from findings import found, one

import snapforensics as sf
from snapforensics.analysis import diagnose
from snapforensics.analysis.rules import allocator_private_pool
from snapforensics.analysis.rules.allocator_private_pool import RULE
from snapforensics.explore import queries
from snapforensics.snapshot import load

FWD_BWD = "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"  # CUDA, 88 segments, four of 40 MiB
MIB = 1 << 20


def _pools(ids):
    """Give the four largest segments the pool ids `ids` (one each, in address order)."""
    def edit(raw):
        big = sorted(raw["segments"], key=lambda s: (-s["total_size"], s["address"]))[:4]
        for seg, pid in zip(sorted(big, key=lambda s: s["address"]), ids):
            seg["segment_pool_id"] = pid
        edit.sizes = [s["total_size"] for s in big]
    return edit


def test_graphs_each_in_their_own_pool_are_anomalous_with_the_sharing_bound():
    edit = _pools([(1, 0), (1, 0), (2, 0), (2, 0)])
    d = edited_corpus_file(FWD_BWD, edit)
    assert edit.sizes == [40 * MIB] * 4
    f = one(d, RULE.id)
    assert f.verdict == "anomalous"
    ev = f.evidence
    by = {tuple(p["pool_id"]): p for p in ev["pools"]}
    assert set(by) == {(1, 0), (2, 0)}
    assert all(p["reserved_bytes"] == 80 * MIB and p["segments"] == 2 for p in by.values())
    assert "CUDA graph private pool #1" in by[(1, 0)]["owner"]
    # one shared pool keeps the larger of the two graphs' pools held at the peak, returns the
    # other (one of pool 2's segments was reserved only after the peak: 40 MiB of it then)
    across = sorted(p["reserved_across_peak_bytes"] for p in by.values())
    assert across == [40 * MIB, 80 * MIB]
    assert ev["graph_pools"] == 2
    assert f.saving_bytes == across[0] >= allocator_private_pool.MIN_SAVING
    assert "graph_pool_handle()" in f.fix and "pool=pool" in f.fix and "reset()" in f.fix
    compile(f.fix, RULE.id, "exec")


def test_one_shared_pool_or_a_mempool_is_info():
    d = edited_corpus_file(FWD_BWD, _pools([(0, 1)] * 4))  # graph_pool_handle() / MemPool
    f = one(d, RULE.id)
    assert f.verdict == "info" and f.saving_bytes is None
    (p,) = f.evidence["pools"]
    assert p["pool_id"] == [0, 1] and "MemPool" in p["owner"] and p["reserved_bytes"] == 160 * MIB
    assert "graph_pool_handle()" not in f.fix  # nothing to share: free the graph
    d = edited_corpus_file(FWD_BWD, _pools([(1, 0), (1, 0), (1, 0), (1, 0)]))  # one graph
    assert one(d, RULE.id).verdict == "info"


def test_explorer_shows_private_pools_apart_from_the_regular_pool(tmp_path):
    raw = pickle.loads(corpus_file(FWD_BWD).read_bytes())
    _pools([(1, 0), (1, 0), (0, 3), (0, 3)])(raw)
    p = tmp_path / "pools.pickle"
    p.write_bytes(pickle.dumps(raw, protocol=4))
    rep = sf.diagnose(p)
    for ans in (queries.segments(rep, 0), queries.segments(rep, 0, row=10 ** 9)):
        pools = {tuple(x["pool"]): x for x in ans["pools"]}
        assert list(pools) == [(0, 0), (0, 3), (1, 0)]  # the regular pool first
        assert pools[(1, 0)]["reserved_bytes"] == pools[(0, 3)]["reserved_bytes"] == 80 * MIB
        assert sum(x["reserved_bytes"] for x in pools.values()) == sum(
            s["total_size"] for s in ans["segments"])
        per = {}
        for s in ans["segments"]:
            per[tuple(s["pool"])] = per.get(tuple(s["pool"]), 0) + s["total_size"]
        assert per[(1, 0)] == per[(0, 3)] == 80 * MIB


def test_no_corpus_file_has_a_private_pool_and_none_gets_the_finding():
    from corpus import CORPUS

    if not CORPUS.is_dir():
        pytest.skip("../shared/corpus is absent")
    d = diagnose(load(corpus_file(FWD_BWD)))
    assert not found(d, RULE.id)
    for f in sorted(CORPUS.glob("*.p*")):
        raw = pickle.loads(f.read_bytes())
        segs = raw.get("segments", []) if isinstance(raw, dict) else raw
        assert all(tuple(s.get("segment_pool_id", (0, 0))) == (0, 0) for s in segs), f.name
