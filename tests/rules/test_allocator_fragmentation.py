"""allocator.fragmentation on the real corpus (a CPU run has no caching allocator):
NiuHuangxiaozi_fwd_bwd_200_mixed (reserved 23% above the allocated peak), its expandable-segments
and CPU guards on EDITED copies of it, and segments-only files judged at dump."""

from __future__ import annotations

from types import SimpleNamespace

from corpus import corpus_file
from edits import edited_corpus_file
from findings import found, one

from snapforensics.analysis import diagnose
from snapforensics.analysis.allocator import Allocator
from snapforensics.analysis.rules import allocator_record_stream
from snapforensics.analysis.rules.allocator_fragmentation import RULE
from snapforensics.snapshot import load
from snapforensics.snapshot.model import Backend, Format

FWD_BWD = "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"  # CUDA, 3 iterations, fragmentation
OOM_FILE = "ConstructorSun_memory_snapshot.pickle"  # 3 GPUs, expandable segments, one OOM


def test_fragmentation_on_a_real_cuda_file():
    d = diagnose(load(corpus_file(FWD_BWD)))
    f = one(d, RULE.id)
    assert f.verdict == "anomalous"
    ev = f.evidence
    peak = d.peaks["overall_bytes"]
    assert ev["allocated_peak_bytes"] == peak
    assert ev["reserved_peak_bytes"] - peak == f.bytes >= 0.2 * peak
    assert ev["reserved_at_allocated_peak_bytes"] >= peak
    assert ev["at_dump"]["inactive_split_blocks"] > 0 and ev["at_dump"]["largest_free_block_bytes"]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in f.fix
    assert f.saving_bytes == f.bytes


def test_fragmentation_with_expandable_segments_does_not_suggest_them_again():
    """Edited copy: the same trace, but the file says expandable segments were on."""
    def edit(raw):
        raw["allocator_settings"].update(expandable_segments=True,
                                         PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    d = edited_corpus_file(FWD_BWD, edit)
    f = one(d, RULE.id)
    assert f.verdict == "info" and not f.fix
    assert f.evidence["expandable_segments"] is True


def test_fragmentation_never_on_cpu_snapshots():
    """Edited copy whose segments are CPU pseudo segments: the loader calls it a CPU file."""
    def edit(raw):
        for s in raw["segments"]:
            s["segment_type"] = "cpu"
    d = edited_corpus_file(FWD_BWD, edit)
    assert d.format["backend"] == "cpu"
    assert not found(d, RULE.id) and not found(d, allocator_record_stream.RULE.id)


def test_no_fragmentation_where_expandable_segments_keep_reserved_at_allocated():
    d = diagnose(load(corpus_file(OOM_FILE)))  # reserved within 1.5% of allocated everywhere
    assert not found(d, RULE.id)


def test_expandable_fix_names_the_backend_variable_and_keeps_other_settings():
    def fake(backend, settings):
        return SimpleNamespace(snapshot=SimpleNamespace(kind=Format(backend=Backend(backend)),
                                                        allocator_settings=settings))
    assert Allocator(fake("npu", {})).conf.var == "PYTORCH_NPU_ALLOC_CONF"
    npu = Allocator(fake("npu", {})).expandable_fix
    assert "PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" in npu
    cuda = fake("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    fix = Allocator(cuda).expandable_fix
    assert "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128,expandable_segments:True" in fix


def test_fragmentation_on_a_segments_only_file():
    """No history at all: judged from the dump's segments (real corpus files)."""
    from snapforensics.analysis import diagnose
    from snapforensics.snapshot import load

    holes = diagnose(load(corpus_file("Felixburton7_dump_snapshot_a.pickle")))
    f = next(f for f in holes.findings if f.rule == RULE.id)
    assert f.evidence["at_dump"]["inactive_split_bytes"] == f.bytes > 0
    assert "expandable_segments:True" in f.fix
    # Maphsge4_10k reserves 10x what it allocates, but in wholly free segments: cache, not holes
    cache = diagnose(load(corpus_file("Maphsge4_snapshot_10k.pickle")))
    assert not [f for f in cache.findings if f.rule == RULE.id]
