"""Every real snapshot of the corpus loads and gets a diagnosis whose figures are cross-checked.

Independent second computations:
- segment totals against plain sums over the raw `segments` and against torch's own reader
  (`torch.cuda._memory_viz.memory()` flamegraph lines and `segsum()` totals);
- the peak of the live-bytes timeline against a plain-Python replay of the raw trace written
  here (torch's Python reader has no timeline: its "Active Memory Timeline" is JavaScript);
- for complete traces, the bytes live after the last entry against torch's reader: the
  `active_allocated` requested bytes its `memory()` flamegraph reports.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from corpus import CORPUS, corpus_file, corpus_files

from snapforensics.analysis import diagnose
from snapforensics.analysis.lifetimes import compute
from snapforensics.snapshot import load

FILES = corpus_files()
if not FILES:
    pytest.skip(f"snapshot corpus not found at {CORPUS}", allow_module_level=True)

_cache: dict[str, tuple] = {}


def loaded(path: Path):
    """(raw via plain pickle, snapshot, diagnosis), once per file. The corpus is trusted data, so
    the test reads it with plain pickle as the independent source of truth."""
    if path.name not in _cache:
        raw = pickle.loads(path.read_bytes())
        if isinstance(raw, list):
            raw = {"segments": raw, "device_traces": []}
        snap = load(path)
        _cache[path.name] = (raw, snap, diagnose(snap))
    return _cache[path.name]


def manifest() -> dict[str, str]:
    rows = {}
    for line in (CORPUS / "MANIFEST.tsv").read_text().splitlines()[1:]:
        cols = line.split("\t")
        if len(cols) >= 6:
            rows[cols[1]] = cols[5]
    return rows


# -- an independent replay (plain Python, dicts, no numpy) ----------------------------------


def replay(entries: list[dict], segments: list[dict], device: int) -> tuple[int, int, int, int]:
    """Live bytes per entry, the definition lifetimes.py documents, computed from raw dicts.

    alloc opens a block; the first free_requested (or a free_completed with no request) closes
    it. A free with no alloc, and a block alive at dump with no alloc, were alive before the
    first entry. Returns (peak, live after last entry, orphan frees, unseen live blocks).
    Unseen blocks count with their `requested_size`, as torch's viewer counts them; a pending-free
    block whose free request is in the trace is not unseen.
    """
    open_: dict[int, int] = {}
    awaiting: set[int] = set()
    delta = 0  # live bytes relative to the start
    series = []
    before = 0  # bytes alive before the first entry
    orphans = 0
    logs_requests = any(e["action"] == "free_requested" for e in entries)
    for e in entries:
        act, addr, size = e["action"], e.get("addr", 0), e.get("size", 0)
        if act == "alloc":
            if addr in open_:  # the earlier block's free was lost: it ends here
                delta -= open_.pop(addr)
            open_[addr] = size
            delta += size
        elif act in ("free_requested", "free_completed"):
            if addr in open_:
                delta -= open_.pop(addr)
                if act == "free_requested":
                    awaiting.add(addr)
            elif act == "free_completed" and addr in awaiting:
                awaiting.discard(addr)
            elif act == "free_completed" and logs_requests:
                pass  # requested before the first entry: not live in the trace
            else:
                orphans += 1
                before += size
                delta -= size
                if act == "free_requested":
                    awaiting.add(addr)
        series.append(delta)
    unseen = [b for s in segments if s["device"] == device for b in s["blocks"]
              if b["state"] != "inactive" and b["address"] not in open_
              and not (b["state"] != "active_allocated" and b["address"] in awaiting)]
    before += sum(b.get("requested_size") or b["size"] for b in unseen)
    # the moment before the first entry counts too (a trace that opens with frees)
    return before + max(0, max(series)), before + series[-1], orphans, len(unseen)


def torch_flamegraph_totals(segments: list[dict]) -> dict[tuple[str, bool], int]:
    """Bytes per (block state, is-gap line) from torch's own `_memory_viz.memory()` output."""
    mv = pytest.importorskip("torch.cuda._memory_viz")
    text = mv.memory({"segments": segments}, format_flamegraph=lambda lines: lines)
    totals: dict[tuple[str, bool], int] = {}
    for line in text.splitlines():
        if not line:
            continue
        head, _, size = line.rpartition(" ")
        parts = head.split(";", 2)  # stream_X;state;frames...
        key = (parts[1], len(parts) > 2 and parts[2] == "<gaps>")
        totals[key] = totals.get(key, 0) + int(size)
    return totals


# -- every file ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_loads_and_diagnoses(path):
    raw, snap, diag = loaded(path)
    raw_devices = {s["device"] for s in raw["segments"]} | {
        i for i, t in enumerate(raw.get("device_traces") or []) if t}
    assert sorted(raw_devices) == snap.devices
    assert sorted(d.device for d in diag.devices) == snap.devices
    assert [len(t) for t in snap.traces] == [len(t) for t in raw.get("device_traces") or []]
    assert snap.format["backend"] in ("cuda", "npu")
    assert snap.format["era"]
    assert all(isinstance(w, str) and "\n" not in w for w in diag.warnings)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_segment_totals_match_raw_sums(path):
    raw, snap, diag = loaded(path)
    for dev in diag.devices:
        segs = [s for s in raw["segments"] if s["device"] == dev.device]
        assert dev.segments["count"] == len(segs)
        assert dev.segments["reserved_bytes"] == sum(s["total_size"] for s in segs)
        assert dev.segments["allocated_bytes"] == sum(
            b["size"] for s in segs for b in s["blocks"] if b["state"] != "inactive")
        assert dev.segments["active_blocks"] == sum(
            1 for s in segs for b in s["blocks"] if b["state"] != "inactive")


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_segment_totals_match_torch_reader(path):
    mv = pytest.importorskip("torch.cuda._memory_viz")
    raw, snap, diag = loaded(path)
    for dev in diag.devices:
        segs = [s for s in raw["segments"] if s["device"] == dev.device]
        totals = torch_flamegraph_totals(segs)
        in_use = sum(v for (state, _gap), v in totals.items() if state != "inactive")
        assert dev.segments["allocated_bytes"] == in_use
        try:
            summary = mv.segsum({"segments": segs})
        except AssertionError:
            # torch's segsum refuses segments whose blocks do not tile them; we warn instead.
            assert any("do not add up to their total_size" in w for w in snap.warnings)
            continue
        assert sum(totals.values()) == dev.segments["reserved_bytes"]
        assert f"segments: {len(segs)}\n" in summary
        assert f"total_reserved: {mv.Bytes(dev.segments['reserved_bytes'])}\n" in summary


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_peak_matches_independent_replay(path):
    raw, snap, diag = loaded(path)
    for dev in diag.devices:
        entries = (raw.get("device_traces") or [])[dev.device] \
            if dev.device < len(raw.get("device_traces") or []) else []
        if not entries:
            assert dev.peak_row == -1 and dev.history["rows"] == 0
            continue
        peak, end, orphans, unseen = replay(entries, raw["segments"], dev.device)
        assert dev.peaks["overall_bytes"] == peak
        assert dev.history["orphan_frees"] == orphans
        assert dev.history["unseen_live_blocks"] == unseen
        assert dev.history["truncated"] == bool(orphans or unseen)
        trace = next(t for t in snap.traces if t.device == dev.device)
        assert int(compute(snap, trace).live[-1]) == end


def test_complete_traces_end_where_torch_reader_says():
    """With nothing missing from the history, what the replay holds after the last entry is what
    torch's reader reports as requested bytes of active_allocated blocks at dump time."""
    pytest.importorskip("torch.cuda._memory_viz")
    checked = []
    for path in FILES:
        raw, snap, diag = loaded(path)
        for dev in diag.devices:
            if not dev.history["rows"] or dev.history["truncated"]:
                continue
            segs = [s for s in raw["segments"] if s["device"] == dev.device]
            totals = torch_flamegraph_totals(segs)
            trace = next(t for t in snap.traces if t.device == dev.device)
            assert int(compute(snap, trace).live[-1]) == \
                totals.get(("active_allocated", False), 0), (path.name, dev.device)
            checked.append((path.name, dev.device))
    names = {n for n, _ in checked}
    assert {"NiuHuangxiaozi_fwd_bwd_200_mixed.pickle", "NiuHuangxiaozi_forward_200.pickle",
            "ConstructorSun_memory_snapshot.pickle", "silmont2000_mem_snapshot.pickle",
            "MemSnapDump_snapshot_1768383987920985470.pkl"} <= names
    assert len(checked) >= 8


# -- format detection ------------------------------------------------------------------------


def test_backend_detection_follows_manifest():
    notes = manifest()
    assert notes, "MANIFEST.tsv lists the corpus"
    for name, note in notes.items():
        if not (CORPUS / name).is_file():
            continue
        _, snap, _ = loaded(CORPUS / name)
        expected = "npu" if "torch_npu" in note or name.startswith("MemSnapDump_") else "cuda"
        assert snap.format["backend"] == expected, (name, snap.format["backend_evidence"])


@pytest.mark.parametrize("name, era", [
    ("Maphsge4_snapshot_1.2M.pickle", "torch 2.1 (no time_us)"),
    ("Maphsge4_snapshot_2.4M.pickle", "torch 2.1 (no time_us)"),
    ("JasperSolt_snapshot.pickle", "torch>=2.2"),
    ("NiuHuangxiaozi_forward_200.pickle", "torch>=2.5"),
    ("ConstructorSun_memory_snapshot.pickle", "torch>=2.8"),
    ("MAGMA27_memory_snapshot.pickle", "torch>=2.10"),
    ("bcrafton_memory_snapshot.pickle", "torch>=2.10"),
    ("MemSnapDump_snapshot_expandable.pkl", "torch_npu (no time_us)"),
    ("Muduard_dump_snapshot_114k.pickle", "unknown (no history)"),
])
def test_era(name, era):
    _, snap, _ = loaded(corpus_file(name))
    assert snap.format["era"] == era
    assert snap.format["has_time"] == era.startswith("torch>=")


def test_npu_without_torch_npu_frames_is_npu():
    """The file that used to be taken for CUDA: no torch_npu frame, no time, stream pointers."""
    _, snap, _ = loaded(corpus_file("MemSnapDump_snapshot_expandable.pkl"))
    assert not any("torch_npu" in f.filename for f in snap.frames)
    assert snap.backend == "npu"
    assert "stream" in snap.format["backend_evidence"]


def test_cuda_side_streams_are_not_npu():
    """torch 2.1 CUDA file: no time_us, non-default stream handles, but stream 0 is used."""
    _, snap, _ = loaded(corpus_file("Maphsge4_snapshot_2.4M.pickle"))
    assert len(snap.streams) > 1 and 0 in snap.streams
    assert snap.backend == "cuda"


def test_several_devices_in_one_file():
    raw, snap, diag = loaded(corpus_file("ConstructorSun_memory_snapshot.pickle"))
    assert snap.devices == [0, 1, 2]
    assert [len(t) for t in snap.traces] == [6445, 596, 882, 0]
    peaks = {d.device: d.peaks["overall_bytes"] for d in diag.devices}
    assert len(set(peaks.values())) == 3 and all(peaks.values())
    assert diag.primary.device == max(peaks, key=peaks.get)
    _, snap2, diag2 = loaded(corpus_file("albi2_dump_snapshot.pickle"))
    assert snap2.devices == [0, 1] and not any(len(t) for t in snap2.traces)
    assert [d.device for d in diag2.devices] == [0, 1]


def test_expandable_segments():
    for name in ("ConstructorSun_memory_snapshot.pickle", "MemSnapDump_snapshot_expandable.pkl"):
        raw, snap, _ = loaded(corpus_file(name))
        assert snap.format["expandable_segments"]
        assert any(s.is_expandable for s in snap.segments)
        from snapforensics.snapshot.model import SEGMENT_MAP
        maps = sum(int((t.action == SEGMENT_MAP).sum()) for t in snap.traces)
        assert maps == sum(1 for t in raw["device_traces"] for e in t
                           if e["action"] == "segment_map") > 0


def test_oom_entry_keeps_device_free():
    raw, snap, _ = loaded(corpus_file("ConstructorSun_memory_snapshot.pickle"))
    ooms = [(d, i, e) for d, t in enumerate(raw["device_traces"]) for i, e in enumerate(t)
            if e["action"] == "oom"]
    assert ooms
    for d, i, e in ooms:
        assert snap.traces[d].device_free[i] == e["device_free"]
        assert int(snap.traces[d].size[i]) == e["size"]


def test_windows_paths_and_cpp_frames():
    _, win, _ = loaded(corpus_file("MAGMA27_memory_snapshot.pickle"))
    assert win.format["windows_paths"] and not win.format["cpp_frames"]
    assert any(f.filename.startswith("D:\\") for f in win.frames)
    _, cpp, diag = loaded(corpus_file("Maphsge4_snapshot_1.2M.pickle"))
    assert cpp.format["cpp_frames"] and not cpp.format["windows_paths"]
    assert any(f.filename == "??" and f.line == 0 and "::" in f.name for f in cpp.frames)
    # C++ noise frames are interned once: far fewer distinct frames than frame references.
    assert len(cpp.frames) < 2000


def test_segments_only_and_empty_files():
    for name in ("Charran78_dump_snapshot.pickle", "ZijianDu_memory.pickle",
                 "Muduard_memory_snapshot.pkl", "SunnySood80_dump_snapshot.pickle"):
        raw, snap, diag = loaded(corpus_file(name))
        assert not any(len(t) for t in snap.traces)
        assert any("no allocation history" in w for w in diag.warnings)
        for dev in diag.devices:
            assert dev.peaks["overall_bytes"] == dev.segments["allocated_bytes"]
    _, bare, _ = loaded(corpus_file("Muduard_memory_snapshot.pkl"))
    assert bare.format["bare_segment_list"] and bare.devices == [1]
    _, empty, diag = loaded(corpus_file("SunnySood80_dump_snapshot.pickle"))
    assert empty.devices == [] and diag.devices == [] and len(empty.traces) == 4


def test_synthetic_untiled_segments_warn():
    _, snap, _ = loaded(corpus_file("mosaic_output.pickle"))
    assert snap.format["segments_not_tiled"] == 5
    assert any("do not add up to their total_size" in w for w in snap.warnings)
    assert snap.segments[0].pool_id == (0, 0)  # a list in this file, a tuple in the model
