"""Allocator and lifecycle rules (issue 3), each proven where its cause really occurs.

What the CPU recorder can reproduce is proven on real recordings of the bundled example (2 ranks,
gloo, shared with the other test modules through `recordings.recorded`):
- `leak`  -> leak.iteration_growth (the loop keeps loss/logits/softmax with their graphs);
- `noac`  -> activations.no_checkpointing, its saving checked against the same layout
             recorded WITH checkpointing at the same batch (`fixed --batch 8`);
- `fixed` -> none of these rules.
What a CPU run cannot have (no caching allocator, no streams, no OOM) is proven on the real
corpus (skipped cleanly when absent):
- allocator.fragmentation: NiuHuangxiaozi_fwd_bwd_200_mixed (real file, reserved 23% above the
  allocated peak); its expandable-segments and CPU guards on EDITED copies of it;
- allocator.record_stream_delay: an EDITED copy of the same real file, its free_completed rows
  moved later (as record_stream does) and its last frees left pending at dump; the unedited
  file (no delay anywhere in the corpus) must stay silent;
- oom.report: ConstructorSun (real OOM entry, device 1);
- leak.iteration_growth also on a real leak: MemSnapDump_snapshot_expandable (torch_npu,
  memory_leaks_demo.py);
and over the whole corpus: no fsdp.* finding on runs without FSDP, a diagnosis for every file.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from conftest import corpus_file, corpus_files

from snapforensics.analysis import diagnose
from snapforensics.analysis.allocator import Allocator
from snapforensics.snapshot import load, normalize, read_raw
from snapforensics.snapshot.model import Backend, Format

FRAG = "allocator.fragmentation"
RSTREAM = "allocator.record_stream_delay"
LEAK = "leak.iteration_growth"
NOAC = "activations.no_checkpointing"
OOM = "oom.report"
MINE = {FRAG, RSTREAM, LEAK, NOAC, OOM}

FWD_BWD = "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"  # CUDA, 3 iterations, fragmentation
OOM_FILE = "ConstructorSun_memory_snapshot.pickle"  # 3 GPUs, expandable segments, one OOM
NPU_LEAK = "MemSnapDump_snapshot_expandable.pkl"  # torch_npu memory_leaks_demo.py


def found(d, rule):
    return [f for f in d.findings if f.rule == rule]


def one(d, rule):
    fs = found(d, rule)
    assert len(fs) == 1, ([f.rule for f in d.findings], rule)
    return fs[0]


# ---------------------------------------------------------------------------- recordings


@pytest.fixture(scope="session")
def rec(tmp_path_factory):
    pytest.importorskip("torch")
    from recordings import recorded

    cache = {}

    def get(variant: str, **kw):
        key = (variant, tuple(kw.get("extra", ())))
        if key not in cache:
            paths = recorded(variant, tmp_path_factory, **kw)
            cache[key] = diagnose(load(paths[0]))
        return cache[key]

    return get


@pytest.mark.slow
def test_leak_variant_is_an_iteration_growth_leak(rec):
    d = rec("leak")
    f = one(d, LEAK)
    assert f.verdict == "anomalous"
    ev = f.evidence
    # per step the loop keeps logits and the softmax its statistic's graph saved:
    # two batch x seq x vocab fp32 tensors = 2 x 512 KiB, plus two scalars
    assert 1 << 20 <= ev["growth_per_iteration_bytes"] < (1 << 20) + 4096, ev
    starts = ev["live_at_iteration_start_bytes"]
    assert len(starts) == 3 and starts[0] < starts[1] < starts[2]
    assert f.bytes >= 2 << 20 and f.blocks >= 4  # two steps' worth retained by step 3
    stacks = [line for s in ev["stacks"] for line in s["stack"]]
    assert any("fsdp_ckpt.py" in line for line in stacks), stacks
    assert any("fsdp_ckpt.py" in u for u in ev["user_code"])
    assert ".item()" in f.fix and ".detach()" in f.fix
    # freeing each step's retained blocks gives the healthy configuration's peak
    healthy = rec("fixed").peaks["overall_bytes"]
    assert f.saving_bytes > 0
    assert abs(f.predicted_peak_bytes - healthy) / healthy < 0.01, (f.predicted_peak_bytes,
                                                                    healthy)


@pytest.mark.slow
def test_noac_variant_suggests_checkpointing_with_its_saving(rec):
    d = rec("noac")
    f = one(d, NOAC)
    assert f.verdict == "info"  # a memory/compute trade, not a bug (see the rule's docstring)
    ev = f.evidence
    assert ev["layers"] == 6 and ev["layer_class"] == "Block"  # the example's 6 blocks
    assert ev["activation_share"] >= 0.3
    assert f.saving_bytes > 0.05 * d.peaks["overall_bytes"]
    assert "apply_activation_checkpointing" in f.fix and "isinstance(m, Block)" in f.fix
    assert f.predicted_peak_bytes == d.peaks["overall_bytes"] - f.saving_bytes


@pytest.mark.slow
def test_checkpointing_saving_matches_the_checkpointed_run(rec):
    """`fixed` is `noac` plus checkpoint_wrapper per block: same batch, measured peak."""
    f = one(rec("noac"), NOAC)
    measured = rec("fixed", extra=["--batch", "8"]).peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10, (f.predicted_peak_bytes,
                                                                      measured)


@pytest.mark.slow
def test_healthy_and_other_variants_stay_quiet(rec):
    fixed = rec("fixed")
    assert not [f.rule for f in fixed.findings if f.rule in MINE]
    assert not found(rec("noac"), LEAK)  # no growth without the leak
    assert not found(rec("leak"), NOAC)  # checkpointed: recompute present
    for d in (fixed, rec("noac"), rec("leak")):  # CPU-recorded: no allocator findings
        assert not found(d, FRAG) and not found(d, RSTREAM) and not found(d, OOM)


# ---------------------------------------------------------------------------- fragmentation


def test_fragmentation_on_a_real_cuda_file():
    d = diagnose(load(corpus_file(FWD_BWD)))
    f = one(d, FRAG)
    assert f.verdict == "anomalous"
    ev = f.evidence
    peak = d.peaks["overall_bytes"]
    assert ev["allocated_peak_bytes"] == peak
    assert ev["reserved_peak_bytes"] - peak == f.bytes >= 0.2 * peak
    assert ev["reserved_at_allocated_peak_bytes"] >= peak
    assert ev["at_dump"]["inactive_split_blocks"] > 0 and ev["at_dump"]["largest_free_block_bytes"]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in f.fix
    assert f.saving_bytes == f.bytes


def _edited(name: str, edit) -> object:
    raw, _ = read_raw(corpus_file(name))
    raw = copy.deepcopy(raw)
    edit(raw)
    return diagnose(normalize(raw, source=f"edited-{name}"))


def test_fragmentation_with_expandable_segments_does_not_suggest_them_again():
    """Edited copy: the same trace, but the file says expandable segments were on."""
    def edit(raw):
        raw["allocator_settings"].update(expandable_segments=True,
                                         PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    d = _edited(FWD_BWD, edit)
    f = one(d, FRAG)
    assert f.verdict == "info" and not f.fix
    assert f.evidence["expandable_segments"] is True


def test_fragmentation_never_on_cpu_snapshots():
    """Edited copy whose segments are CPU pseudo segments: the loader calls it a CPU file."""
    def edit(raw):
        for s in raw["segments"]:
            s["segment_type"] = "cpu"
    d = _edited(FWD_BWD, edit)
    assert d.format["backend"] == "cpu"
    assert not found(d, FRAG) and not found(d, RSTREAM)


def test_no_fragmentation_where_expandable_segments_keep_reserved_at_allocated():
    d = diagnose(load(corpus_file(OOM_FILE)))  # reserved within 1.5% of allocated everywhere
    assert not found(d, FRAG)


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


# ---------------------------------------------------------------------------- record_stream


def _delay_completions(raw, min_size=1 << 20, delay=200, pending=3):
    """What record_stream does to a trace: a block's free_completed comes later than its
    free_requested (never after the next alloc at that address: the memory is not reusable
    before), and the last such frees are still pending at dump (`active_pending_free`)."""
    tr = raw["device_traces"][0]
    n = len(tr)
    next_alloc, seen = [n] * n, {}
    for k in range(n - 1, -1, -1):
        next_alloc[k] = seen.get(tr[k].get("addr"), n)
        if tr[k]["action"] == "alloc":
            seen[tr[k]["addr"]] = k
    reqs = [k for k, e in enumerate(tr[:-1]) if e["action"] == "free_requested"
            and e["size"] >= min_size and tr[k + 1]["action"] == "free_completed"
            and tr[k + 1]["addr"] == e["addr"]]
    inactive = {b["address"]: b for s in raw["segments"] for b in s["blocks"]
                if b["state"] == "inactive"}
    last = [k for k in reqs if next_alloc[k] == n and tr[k]["addr"] in inactive]
    pend = set(sorted(last, key=lambda k: -tr[k]["size"])[:pending])
    drop, moved = set(), {}
    for k in reqs:
        drop.add(k + 1)
        if k not in pend:
            moved.setdefault(min(k + 1 + delay, next_alloc[k]), []).append(dict(tr[k + 1]))
    out = []
    for k, e in enumerate(tr):
        for c in moved.get(k, []):
            c["time_us"] = e.get("time_us", c.get("time_us"))
            out.append(c)
        if k not in drop:
            out.append(e)
    out += moved.get(n, [])
    raw["device_traces"][0] = out
    for k in pend:
        inactive[tr[k]["addr"]]["state"] = "active_pending_free"
    return len(reqs) - len(pend), len(pend)


def test_record_stream_delays_on_an_edited_real_file():
    counts = {}

    def edit(raw):
        counts["delayed"], counts["pending"] = _delay_completions(raw)
    d = _edited(FWD_BWD, edit)
    assert counts["delayed"] > 100 and counts["pending"] == 3
    f = one(d, RSTREAM)
    assert f.verdict == "anomalous"
    ev = f.evidence
    assert ev["delayed_blocks"] > 100
    assert ev["pending_at_dump_blocks"] == 3 and ev["pending_at_dump_bytes"] > 0
    assert ev["gap_rows"]["max"] > 1 and ev["gap_ms"]["max"] > 0
    assert ev["peak_bytes_counting_completion"] > ev["peak_bytes_counting_request"]
    assert f.saving_bytes == ev["peak_bytes_counting_completion"] - d.peaks["overall_bytes"] > 0
    assert "TORCH_NCCL_AVOID_RECORD_STREAMS=1" in f.fix and "record_stream" in f.fix
    assert ev["stacks"] and ev["stacks"][0]["stack"]


def test_no_record_stream_delay_where_frees_complete_at_once():
    d = diagnose(load(corpus_file(FWD_BWD)))
    assert not found(d, RSTREAM)


# ---------------------------------------------------------------------------- OOM


def test_oom_report_on_a_real_oom():
    d = diagnose(load(corpus_file(OOM_FILE)))
    f = one(d, OOM)
    assert f.verdict == "anomalous" and f.device == 1
    ev = f.evidence
    assert ev["requested_bytes"] == 5308694528 and ev["device_free_bytes"] == 95682560
    assert ev["short_by_bytes"] == (ev["requested_bytes"] - ev["device_free_bytes"]
                                    - ev["reserved_unallocated_bytes"]) > 0
    assert ev["allocated_bytes"] == f.bytes and f.blocks > 0
    assert ev["reserved_bytes"] >= ev["allocated_bytes"]
    assert sum(ev["alive_by_category"].values()) == ev["allocated_bytes"]
    assert next(iter(ev["alive_by_category"])) == "activation"
    assert ev["stacks"] and "models.py" in (ev["request_user_code"] or "")
    assert f.fix and "checkpoint" in f.fix


# ---------------------------------------------------------------------------- the corpus


def test_real_leak_in_the_corpus():
    d = diagnose(load(corpus_file(NPU_LEAK)))
    f = one(d, LEAK)
    assert f.evidence["growth_per_iteration_bytes"] == 40 << 20
    assert any("memory_leaks_demo.py" in u for u in f.evidence["user_code"])
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]


def _has_fsdp_frames(snap) -> bool:
    return any("/fsdp/" in f.filename.replace("\\", "/") or f.name == "fully_shard"
               for f in snap.frames)


def test_corpus_without_fsdp_gets_a_diagnosis_and_no_fsdp_findings(corpus_dir):
    files = corpus_files()
    assert files
    no_fsdp = 0
    for path in files:
        snap = load(path)
        d = diagnose(snap)
        if not _has_fsdp_frames(snap):
            no_fsdp += 1
            assert not [f.rule for f in d.findings if f.rule.startswith("fsdp.")], path.name
        for dev in d.devices:  # what was alive at the peak, by category and stack
            if dev.history["allocations"] and dev.peaks["overall_bytes"] > 0:
                assert dev.categories_at_peak, (path.name, dev.device)
                assert dev.top_stacks_at_peak, (path.name, dev.device)
        for f in d.findings:
            if f.rule in MINE:
                assert f.bytes > 0 and f.evidence, (path.name, f.rule)
                assert f.verdict != "anomalous" or f.fix, (path.name, f.rule)
    assert no_fsdp >= len(files) // 2


def test_fragmentation_on_a_segments_only_file():
    """No history at all: judged from the dump's segments (real corpus files)."""
    from snapforensics.analysis import diagnose
    from snapforensics.snapshot import load

    holes = diagnose(load(corpus_file("Felixburton7_dump_snapshot_a.pickle")))
    f = next(f for f in holes.findings if f.rule == "allocator.fragmentation")
    assert f.evidence["at_dump"]["inactive_split_bytes"] == f.bytes > 0
    assert "expandable_segments:True" in f.fix
    # Maphsge4_10k reserves 10x what it allocates, but in wholly free segments: cache, not holes
    cache = diagnose(load(corpus_file("Maphsge4_snapshot_10k.pickle")))
    assert not [f for f in cache.findings if f.rule == "allocator.fragmentation"]
