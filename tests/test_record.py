"""The recorder: real recordings of the bundled FSDP2 + checkpoint example (CPU, gloo, 2 ranks),
exit codes, atomic output, the CPU profile converter, and the backend/launcher plumbing.

Real runs: fixed and buggy (2 ranks, ~10 s each, shared with other test modules through
`recordings`), plus a few one-rank runs of tiny scripts (~3 s each).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from recordings import (
    REPO,
    load_strict,
    record_variant,
    recorded,
    replay_peak,
    run_cli,
    unrecorded_bytes,
)

from snapforensics.errors import EXIT_RECORD_FAILED, SnapError

PROVENANCE_KEYS = {"recorder", "torch_version", "backend", "cpu_recorded", "rank", "world_size",
                   "local_rank", "command", "stacks", "max_entries", "script_exit_code",
                   "hostname", "pid", "started_at"}


def _frame_names(entry) -> list[str]:
    return [f["name"] for f in entry.get("frames", [])]


def _only_snapshots(out: Path) -> None:
    """Atomic output: nothing but rank*.pickle is left (no temp, no status files)."""
    names = sorted(p.name for p in out.iterdir())
    assert names and all(n.startswith("rank") and n.endswith(".pickle") for n in names), names


# ----------------------------------------------------------------------------- real FSDP runs


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    pytest.importorskip("torch")
    # through the CLI (`snapforensics record`): what these tests check is the recorder's output
    return record_variant("fixed", None)


@pytest.fixture(scope="module")
def buggy(tmp_path_factory):
    pytest.importorskip("torch")
    return recorded("buggy", tmp_path_factory)


@pytest.mark.slow
def test_fixed_two_ranks_snapshots_are_plain_and_complete(fixed):
    assert [p.name for p in fixed] == ["rank0.pickle", "rank1.pickle"]
    _only_snapshots(fixed[0].parent)
    for rank, path in enumerate(fixed):
        assert (path.stat().st_mode & 0o777) == 0o644
        snap = load_strict(path)  # no pickle global anywhere
        prov = snap["snapforensics"]
        assert PROVENANCE_KEYS <= set(prov)
        assert prov["backend"] == "cpu" and prov["cpu_recorded"] is True
        assert (prov["rank"], prov["world_size"], prov["local_rank"]) == (rank, 2, rank)
        assert prov["command"][:2] == ["-m", "snapforensics.examples.fsdp_ckpt"]
        assert "--variant" in prov["command"] and "fixed" in prov["command"]
        assert prov["script_exit_code"] == 0 and prov["stacks"] == "python"
        assert prov["recorder"].startswith("snapforensics ")
        trace = snap["device_traces"][0]
        assert len(trace) > 1000
        assert {e["action"] for e in trace} == {"alloc", "free_requested", "free_completed"}
        times = [e["time_us"] for e in trace]
        assert times == sorted(times) and isinstance(times[0], float)
        assert all(e["frames"] for e in trace if e["action"] == "alloc")
        for e in trace[:50]:
            for f in e["frames"]:
                assert set(f) == {"filename", "line", "name"}
                assert isinstance(f["line"], int)
        for seg in snap["segments"]:
            assert seg["segment_type"] == "cpu" and seg["blocks"][0]["state"] == "active_allocated"
        addrs = [s["address"] for s in snap["segments"]]
        assert addrs == sorted(addrs)


@pytest.mark.slow
def test_fixed_run_carries_fsdp_frames_and_annotations(fixed):
    snap = load_strict(fixed[0])
    names = set()
    for e in snap["device_traces"][0]:
        names.update(_frame_names(e))
    # all-gather, copy-out, reduce-scatter, recompute, optimizer, the ops and module frames
    for expected in ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce",
                     "alloc_storage", "recompute_fn", "unpack_hook", "_pre_forward",
                     "pre_backward", "post_backward", "c10d::_allgather_base_",
                     "c10d::_reduce_scatter_base_", "aten::empty", "_init_group"):
        assert expected in names, expected
    assert any(n.startswith("FSDPCheckpointWrapper_") for n in names)
    # no recorder frames above the script
    assert not any("_bootstrap" in f["filename"] or f["filename"] == "<frozen runpy>"
                   for e in snap["device_traces"][0] for f in e["frames"])
    ann = snap["external_annotations"]
    ann_names = {a["name"] for a in ann}
    assert any(n.startswith("FSDP::pre_forward (layers.") for n in ann_names)
    assert {"FSDP::root_pre_forward", "FSDP::root_post_backward_callback"} <= ann_names
    assert any(n.startswith("FSDP::post_backward_reduce") for n in ann_names)
    assert any(n.startswith("Optimizer.step#AdamW") for n in ann_names)
    assert {a["stage"] for a in ann} == {"START", "END"}
    assert sum(a["stage"] == "START" for a in ann) == sum(a["stage"] == "END" for a in ann)
    assert [a["time_us"] for a in ann] == sorted(a["time_us"] for a in ann)
    # interned: equal frames are one object, so the pickle memoizes them
    by_key = {}
    for e in snap["device_traces"][0][:2000]:
        for f in e["frames"]:
            k = (f["filename"], f["line"], f["name"])
            assert by_key.setdefault(k, f) is f
    assert fixed[0].stat().st_size < 200 * len(snap["device_traces"][0])


@pytest.mark.slow
def test_buggy_peak_is_clearly_above_fixed(fixed, buggy):
    f, b = load_strict(fixed[0]), load_strict(buggy[0])
    pf, pb = replay_peak(f), replay_peak(b)
    assert pb > 1.2 * pf, (pb, pf)
    # The difference is unsharded parameters (copy-out storage) kept through backward.
    live, at_peak, cur = {}, None, 0
    for e in b["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur == pb:
                at_peak = dict(live)
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
            cur -= e["size"]
    unsharded = sum(e["size"] for e in at_peak.values()
                    if "foreach_all_gather_copy_out" in _frame_names(e))
    assert unsharded > 0.5 * (pb - pf)


# ----------------------------------------------------------------------------- exit codes


EXIT7 = """
import sys
import torch
keep = [torch.ones(1000 * (i + 1)) for i in range(30)]
del keep[::2]
sys.exit(7)
"""

RAISES = """
import torch
x = torch.zeros(4096)
def inner():
    raise ValueError("boom from the script")
inner()
"""


@pytest.fixture
def scripts(tmp_path):
    pytest.importorskip("torch")
    d = tmp_path / "scripts"
    d.mkdir()
    (d / "exit7.py").write_text(textwrap.dedent(EXIT7))
    (d / "raises.py").write_text(textwrap.dedent(RAISES))
    return d


def test_script_exit_code_is_kept_and_snapshot_written(scripts, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(["record", "--device", "cpu", "--max-entries", "40", "--out", str(out),
                    str(scripts / "exit7.py"), "--some", "arg"], cwd=tmp_path)
    assert proc.returncode == 7, proc.stderr
    _only_snapshots(out)
    snap = load_strict(out / "rank0.pickle")
    prov = snap["snapforensics"]
    assert prov["script_exit_code"] == 7 and prov["max_entries"] == 40
    assert prov["command"] == [str(scripts / "exit7.py"), "--some", "arg"]
    assert (prov["rank"], prov["world_size"]) == (0, 1)
    trace = snap["device_traces"][0]
    assert len(trace) == 40  # ring buffer: only the last N entries
    # the newest ones: the script's `del keep[::2]`, then its globals released after it exited
    assert sum(any(f["filename"].endswith("exit7.py") for f in e["frames"]) for e in trace) >= 5
    assert all(e["action"] != "alloc" for e in trace[-20:])


def test_script_exception_exits_1_with_a_clean_traceback(scripts, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(["record", "--device", "cpu", "--out", str(out), str(scripts / "raises.py")],
                   cwd=tmp_path)
    assert proc.returncode == 1
    assert "ValueError: boom from the script" in proc.stderr
    assert "raises.py" in proc.stderr and "_bootstrap.py" not in proc.stderr
    _only_snapshots(out)
    snap = load_strict(out / "rank0.pickle")
    assert snap["snapforensics"]["script_exit_code"] == 1
    frames = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert "<module>" in frames and "aten::zeros" in frames
    # the report says the run failed: its trace ends there
    diag = run_cli(["diagnose", str(out / "rank0.pickle")], cwd=tmp_path)
    assert diag.returncode == 0 and "script exited with code 1" in diag.stdout, diag.stdout


def test_inside_torchrun_records_in_process(scripts, tmp_path):
    """With LOCAL_RANK + WORLD_SIZE set (as torchrun does) this process itself is recorded."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "snapforensics", "record", "-q", "--device",
                             "cpu", "--out", str(out), str(scripts / "exit7.py")],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 7, err
    _only_snapshots(out)
    prov = load_strict(out / "rank0.pickle")["snapforensics"]
    assert prov["pid"] == proc.pid  # the CLI process itself ran the script
    assert prov["script_exit_code"] == 7 and prov["world_size"] == 1


def test_user_errors_are_one_line_exit_3(tmp_path):
    proc = run_cli(["record", "--out", str(tmp_path / "o"), str(tmp_path / "nope.py")],
                   cwd=tmp_path)
    assert proc.returncode == EXIT_RECORD_FAILED
    assert "script not found" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(["record", "--device", "tpu", "x.py"], cwd=tmp_path)  # a usage error
    assert proc.returncode == 2 and "tpu" in proc.stderr
    proc = run_cli(["record", "-m", "no_such_module_here_xyz"], cwd=tmp_path)
    assert proc.returncode == EXIT_RECORD_FAILED and "no_such_module_here_xyz" in proc.stderr


def test_cuda_requested_without_cuda_is_a_user_error(scripts, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out"
    proc = run_cli(["record", "--device", "cuda", "--out", str(out), str(scripts / "exit7.py")],
                   cwd=tmp_path)
    assert proc.returncode == EXIT_RECORD_FAILED
    assert "--device cuda: no CUDA device on this machine" in proc.stderr
    assert not list(out.glob("*.pickle")) and not list(out.glob(".*"))


# ----------------------------------------------------------------------------- converter


def test_profile_to_snapshot_frames_annotations_and_ring_buffer():
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    from snapforensics.record.cpu import profile_to_snapshot

    def allocate_some():
        keep = []
        with torch.profiler.record_function("user::range"):
            for i in range(20):
                keep.append(torch.empty(1024 * (i + 1)))
        del keep[::2]
        return keep

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True,
                 record_shapes=False) as prof:
        kept = allocate_some()
    full = profile_to_snapshot(prof, 1_000_000)
    short = profile_to_snapshot(prof, 7)
    trace = full["device_traces"][0]
    assert len(trace) >= 40 and len(short["device_traces"][0]) == 7
    strip = [(e["action"], e["addr"], e["size"], e["time_us"]) for e in trace[-7:]]
    assert strip == [(e["action"], e["addr"], e["size"], e["time_us"])
                     for e in short["device_traces"][0]]
    ours = [e for e in trace if e["action"] == "alloc" and "user::range" in _frame_names(e)]
    assert len(ours) == 20
    frames = ours[0]["frames"]
    assert frames[0] == {"filename": "<op>", "line": 0, "name": "aten::empty"}
    rf = next(f for f in frames if f["name"] == "user::range")
    assert rf["filename"] == "<record_function>"
    py = next(f for f in frames if f["name"] == "allocate_some")
    assert py["filename"].endswith("test_record.py") and py["line"] > 0
    assert ours[1]["frames"] is ours[0]["frames"]  # stacks interned too
    freed = [e for e in trace if e["action"] == "free_completed" and e["size"] == 1024 * 4]
    assert freed and _frame_names(freed[0])[0] != "user::range"
    req = [e for e in trace if e["action"] == "free_requested"]
    assert len(req) == len([e for e in trace if e["action"] == "free_completed"])
    live = {s["address"] for s in full["segments"]}
    assert {t.data_ptr() for t in kept} <= live
    ann = [a for a in full["external_annotations"] if a["name"] == "user::range"]
    assert [a["stage"] for a in ann] == ["START", "END"] and ann[0]["time_us"] < ann[1]["time_us"]
    pickle.loads(pickle.dumps(full, protocol=4))


def test_an_undecodable_profiler_name_is_replaced_and_counted_not_fatal():
    """pybind raises UnicodeDecodeError reading an event name that is not UTF-8 (seen on a
    Lightning run): the recording keeps every allocation, the name is replaced and counted."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    from snapforensics.record.cpu import UNDECODABLE_NAME, _event_types, events_to_snapshot

    def allocate_some():
        return [torch.empty(1024 * (i + 1)) for i in range(5)]

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as p:
        kept = allocate_some()
    roots = p.profiler.kineto_results.experimental_event_tree()

    class NotUtf8:  # the real event; reading its name fails as pybind's str conversion does
        def __init__(self, ev):
            self._ev = ev

        def __getattr__(self, k):
            return getattr(self._ev, k)

        @property
        def name(self):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    def wrap(ev):
        if "allocate_some" in ev.name:
            return NotUtf8(ev)
        ev_children = [wrap(c) for c in ev.children]
        if any(isinstance(c, NotUtf8) for c in ev_children):
            class Parent(NotUtf8):
                name = property(lambda self: self._ev.name)
                children = ev_children
            return Parent(ev)
        return ev

    snap = events_to_snapshot([wrap(r) for r in roots], 1_000_000, *_event_types())
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    ours = [e for e in allocs if UNDECODABLE_NAME in _frame_names(e)]
    assert len(ours) == 5 and snap["snapforensics"]["cpu_undecodable_names"] == 1
    assert len(kept) == 5


def test_frees_on_an_untraced_thread_are_recovered_from_the_allocator_total():
    """Real profile: a tensor whose last reference dies on a thread the profiler does not trace."""
    torch = pytest.importorskip("torch")
    import threading

    from torch.profiler import ProfilerActivity, profile

    from snapforensics.record.backends import _cpu_allocator_accounting
    from snapforensics.record.cpu import (
        INFERRED_FREE_FRAME,
        UNRECORDED_FRAME,
        profile_to_snapshot,
    )

    box = []
    previous = _cpu_allocator_accounting(True)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True,
                     record_shapes=False) as prof:
            a = torch.empty(1000)
            box.append(torch.empty(2000))
            t = threading.Thread(target=box.clear)  # the free happens on that thread
            t.start()
            t.join()
            b = torch.empty(3000)
            del a, b
    finally:
        _cpu_allocator_accounting(previous)
    snap = profile_to_snapshot(prof)
    trace = [(e["action"], e["size"]) for e in snap["device_traces"][0]]
    # the 8000-byte block is freed where the allocator's total dropped: before the 12000 alloc
    assert trace.index(("free_completed", 8000)) < trace.index(("alloc", 12000))
    lost = [e for e in snap["device_traces"][0] if e["action"] == "free_completed"
            and e["size"] == 8000]
    assert lost[0]["frames"][0]["name"] == INFERRED_FREE_FRAME[2]
    assert snap["snapforensics"]["cpu_inferred_frees"] == 1
    # nothing of the profile wrongly left alive (earlier tests' tensors, counted by the allocator
    # in this process before this profile, are one "allocated before recording" block)
    assert [s["frames"][0]["name"] for s in snap["segments"]] in (
        [], [UNRECORDED_FRAME[2]])
    assert replay_peak(snap) - unrecorded_bytes(snap) == 4000 + 12000  # not 4000 + 8000 + 12000


def _one_stack():
    """A recorder frame table and one interned stack, for hand-made allocator events."""
    from snapforensics.record.cpu import _Frames

    frames = _Frames(None)
    return frames, frames.stack([frames.intern("x.py", 1, "f")])


def test_lost_free_without_accounting_falls_back_to_the_address_reuse():
    """No allocator totals: a block whose address is handed out again was freed before that."""
    from snapforensics.record.cpu import _Alloc, _build_trace, _recover_lost_frees

    frames, f = _one_stack()
    allocs = [_Alloc(100, 0, 0xA, 50, f, 1, [], None), _Alloc(200, 1, 0xB, 10, f, 1, [], None),
              _Alloc(900, 2, 0xA, 70, f, 1, [], None),   # reuse of 0xA: its free was lost
              _Alloc(950, 3, 0xC, 30, f, 1, [], None)]   # never freed, never reused: alive
    events, n = _recover_lost_frees(allocs, frames)
    trace, live = _build_trace(events)
    acts = [(e["action"], e["addr"], e["size"]) for e in trace]
    assert n == 1
    assert acts.index(("free_completed", 0xA, 50)) == acts.index(("alloc", 0xA, 70)) - 1
    assert set(live) == {0xA, 0xB, 0xC}


def test_a_free_left_to_a_collective_worker_is_placed_where_its_collective_ended():
    """The drop shows in the allocator's total only when the worker thread got the CPU back;
    the free is placed at the end of the collective it finished, the same in every recording."""
    from snapforensics.record.cpu import WAKE_UP_NS, _Alloc, _build_trace, _recover_lost_frees

    frames, f = _one_stack()
    allocs = [_Alloc(100, 0, 0xA, 50, f, 1, [], 50),   # e.g. gloo's reduce-scatter input clone
              _Alloc(400, 1, 0xB, 10, f, 1, [], 60),   # the worker still holds 0xA
              _Alloc(500, 2, 0xC, 20, f, 1, [], 30)]   # 60 + 20 - 30: 0xA's 50 bytes went
    # a drop seen long after any collective ended is a thread holding the block, not a late
    # wake-up: it stays where the allocator's total shows it
    late = [allocs[0], _Alloc(WAKE_UP_NS + 400, 1, 0xB, 10, f, 1, [], 60),
            _Alloc(WAKE_UP_NS + 500, 2, 0xC, 20, f, 1, [], 30)]
    # worker ranges (start, end, thread): the collective started after 0xA was made ends at 300;
    # one that ended before 0xA was made, or after the drop was seen, did not hold it
    for trace, ranges, before in ((allocs, [(200, 300, 2)], 0xB), (allocs, [], 0xC),
                                  (allocs, [(10, 50, 2)], 0xC), (allocs, [(420, 450, 2)], 0xC),
                                  (allocs, [(200, 600, 2)], 0xC), (late, [(200, 300, 2)], 0xC)):
        events, n = _recover_lost_frees(trace, frames, ranges)
        acts = [(e["action"], e["addr"]) for e in _build_trace(events)[0]]
        assert n == 1
        assert acts.index(("free_completed", 0xA)) == acts.index(("alloc", before)) - 1, ranges


def test_a_worker_preempted_past_the_next_collective_does_not_move_the_free():
    """Issue 22. The sequence of a recording of f2_block_noac on a loaded machine (times in us,
    rank 0): gloo's reduce-scatter clone (787,456 B) made at 1,119 by the program, its
    allreduce run by worker A until 11,962; the program goes on and all-gathers the next unit
    (worker B, 14,800 to 15,730; the program's buffer for it made at 14,194), while A, preempted,
    drops the clone only after that: the allocator's total shows it at the next event, 17,457.
    The free belongs where the reduce-scatter ended, before the all-gather's buffer, as in the
    recordings where A drops it at once; placed at the end of the last collective before the
    drop (the all-gather's), the clone was alive with that buffer and the replayed peak of the
    same run moved by the clone's 787,456 B (5.7%) from one recording to the next."""
    from snapforensics.record.cpu import _Alloc, _build_trace, _recover_lost_frees

    frames, f = _one_stack()
    clone, buf, ag, nxt = 787_456, 787_456, 787_456, 262_144
    base = 10_000_000
    us = 1000
    allocs = [_Alloc(1_119 * us, 0, 0xC1, clone, f, 1, [], base + clone),
              _Alloc(14_194 * us, 1, 0xB0, buf, f, 1, [], base + clone + buf),
              _Alloc(14_861 * us, 2, 0xA6, ag, f, 3, [], base + clone + buf + ag),  # worker B
              _Alloc(15_716 * us, 3, 0xA6, -ag, f, 3, [], base + clone + buf),
              _Alloc(17_457 * us, 4, 0xD0, nxt, f, 1, [], base + buf + nxt)]  # clone gone
    ranges = [(11_850 * us, 11_962 * us, 2), (14_800 * us, 15_730 * us, 3)]
    events, n = _recover_lost_frees(allocs, frames, ranges)
    trace = _build_trace(events)[0]
    acts = [(e["action"], e["addr"]) for e in trace]
    assert n == 1
    assert acts.index(("free_completed", 0xC1)) < acts.index(("alloc", 0xB0))
    free = next(e for e in trace if e["action"] == "free_completed" and e["addr"] == 0xC1)
    assert free["time_us"] == 11_962
    live = peak = 0
    for e in trace:
        live += e["size"] if e["action"] == "alloc" else \
            -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, live)
    assert peak == buf + ag  # the all-gather's two buffers, without the clone


def test_a_block_the_tensor_names_saw_alive_later_is_not_taken_for_a_drop():
    """DeepSpeed ZeRO-2's shape (a rank-1 recording of examples/deepspeed_zero.py once read
    so): the fp32 partition (made first, alive to the end) and the flat gradient bucket
    all-reduced in backward (gloo's worker drops it) are the same size and neither address is
    handed out again. Oldest first freed the partition in the trace and kept the bucket alive;
    the tensor names saw the partition at the optimizer step after the drop."""
    from snapforensics.record.cpu import _Alloc, _build_trace, _recover_lost_frees

    frames, f = _one_stack()
    part = 1_774_080
    allocs = [_Alloc(100, 0, 0xA, part, f, 1, [], part),          # the fp32 partition
              _Alloc(500, 1, 0xB, part, f, 1, [], 2 * part),      # the flat bucket
              _Alloc(900, 2, 0xC, 8, f, 1, [], part + 8)]         # the bucket's drop before it
    for seen, freed in ((None, 0xA), ([(0xA, 950)], 0xB)):  # the step observed the partition
        events, n = _recover_lost_frees(allocs, frames, None, seen)
        trace, _ = _build_trace(events)
        assert n == 1
        assert [e["addr"] for e in trace if e["action"] == "free_completed"] == [freed]


def _gloo_reduce_scatter_then_all_gather():
    """Real gloo events: reduce-scatter then all-gather, three times, on a one-rank gloo group in
    this process, profiled as the recorder profiles (allocator accounting on). The converter's
    input: (allocations in time order, record_function ranges, the program's thread)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from snapforensics.record import cpu
    from snapforensics.record.backends import _cpu_allocator_accounting

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not initialized by another test")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    previous = _cpu_allocator_accounting(True)
    try:
        x, out, gathered = torch.ones(4096), torch.empty(4096), torch.empty(4096)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True,
                     record_shapes=False) as prof:
            for _ in range(3):
                dist.reduce_scatter_tensor(out, x)
                dist.all_gather_into_tensor(gathered, out)
    finally:
        _cpu_allocator_accounting(previous)
        dist.destroy_process_group()
    event_type, scope = cpu._event_types()
    frames = cpu._Frames(scope.USER_SCOPE)
    allocs, ranges = cpu._walk(prof.profiler.kineto_results.experimental_event_tree(),
                               event_type, frames)
    allocs.sort(key=lambda a: (a.time_ns, a.seq))
    return allocs, ranges, cpu._main_thread(allocs), frames


def test_a_reduce_scatter_clone_dropped_after_the_next_all_gather_is_freed_with_its_collective():
    """Issue 22 on real gloo events. gloo's reduce-scatter clones its input on the program's
    thread, then queues an allreduce of the clone (ProcessGroupGloo.cpp,
    reduce_scatter_tensor_coalesced); a worker runs it (a `gloo:all_reduce` range on its own
    thread) and drops its reference in runLoop after the range ended, outside the profiler's
    view. Here the first clone's drop is moved past the next all-gather, as a worker preempted
    on a loaded machine does: its free event (or its drop, if the worker already held the last
    reference) is taken out and the allocator's running totals keep the clone until the event
    after the all-gather. The free must still be placed at the end of the clone's own allreduce,
    before the all-gather's buffers."""
    from snapforensics.record.cpu import _build_trace, _recover_lost_frees, _worker_ranges

    allocs, ranges, main, frames = _gloo_reduce_scatter_then_all_gather()
    clones = [i for i, a in enumerate(allocs) if a.size > 0 and any(
        f["name"] == "c10d::_reduce_scatter_base_" for f in a.frames)]
    assert len(clones) == 3 and all(allocs[i].tid == main for i in clones)
    clone = allocs[clones[0]]
    # made before its collective was queued: the next two ranges on worker threads are the
    # clone's allreduce, then the all-gather
    worker = sorted(r for r in ranges if r[4] != main and r[0] > clone.time_ns)
    assert [r[3] for r in worker[:2]] == ["gloo:all_reduce", "gloo:all_gather"], worker
    reduce_end, gather_end = worker[0][1], worker[1][1]
    after = [a for a in allocs if a.ptr == clone.ptr and a.time_ns > clone.time_ns]
    own_free = after[0] if after and after[0].size < 0 else None  # None: the worker freed it
    late = [a for a in allocs if a is not own_free]
    # the drop shows at the first event after the all-gather ended: the running totals are
    # those of the same events with the clone freed just before that event
    seen = next(i for i, a in enumerate(late) if a.time_ns > gather_end)
    total = allocs[0].total - allocs[0].size
    for i, a in enumerate(late):
        total += a.size - (clone.size if i == seen else 0)
        a.total = total
    events, n = _recover_lost_frees(late, frames, _worker_ranges(ranges, main))
    trace = _build_trace(events)[0]
    free = next(e for e in trace if e["addr"] == clone.ptr and e["action"] == "free_completed")
    assert free["frames"][0]["name"] == "free_on_untraced_thread"
    assert abs(free["time_us"] - reduce_end / 1000) <= 1  # at the allreduce's end (to the us)
    gather_buffers = [k for k, e in enumerate(trace) if e["action"] == "alloc"
                      and "gloo:all_gather" in _frame_names(e)]
    assert trace.index(free) < gather_buffers[0]


def test_allocator_total_races_between_threads_do_not_invent_frees():
    """Two threads' events stamped in the opposite order of the allocator's: no lost free."""
    from snapforensics.record.cpu import _Alloc, _recover_lost_frees

    frames, f = _one_stack()
    allocs = [_Alloc(100, 0, 0xD, 30, f, 1, [], 30),   # alive at the end
              _Alloc(150, 1, 0xA, 30, f, 1, [], 60),
              _Alloc(200, 2, 0xB, 30, f, 2, [], 120),  # reached the allocator after 0xC
              _Alloc(201, 3, 0xC, 30, f, 1, [], 90),
              _Alloc(300, 4, 0xA, -30, f, 1, [], 90)]
    _, n = _recover_lost_frees(allocs, frames)
    assert n == 0  # read in time order, 0xC's total looks like 0xD and 0xB were freed



def test_a_drop_of_two_blocks_frees_the_two_that_were_freed():
    """Seen in an MoE run under FSDP2 (examples/moe.py --fsdp): gloo's worker dropped two
    768 KiB blocks between two events; the oldest blocks that fit were three 512 KiB parameters
    made before the step (no free anywhere, alive at the end). The blocks whose address is handed
    out again (certainly freed) are the ones taken, and the parameters stay alive."""
    from snapforensics.record.cpu import _Alloc, _build_trace, _recover_lost_frees

    frames, f = _one_stack()
    P, A = 512 << 10, 768 << 10
    allocs = [_Alloc(10 + k, k, 0x100 + k, P, f, 1, [], P * (k + 1)) for k in range(3)]
    base = 3 * P
    allocs += [_Alloc(20, 3, 0xA, A, f, 1, [], base + A),       # lost: its free unseen
               _Alloc(21, 4, 0xB, A, f, 1, [], base + 2 * A),   # lost
               _Alloc(30, 5, 0xC, 8, f, 1, [], base + 8),       # both dropped before this
               _Alloc(40, 6, 0xA, A, f, 1, [], base + 8 + A),   # their addresses reused
               _Alloc(41, 7, 0xB, A, f, 1, [], base + 8 + 2 * A)]
    events, n = _recover_lost_frees(allocs, frames)
    assert n == 2
    trace, live = _build_trace(events)
    assert {0x100, 0x101, 0x102} <= set(live)  # the parameters alive at the end
    freed = [e for e in trace if e["action"] == "free_completed" and e["addr"] in (0xA, 0xB)]
    c = next(i for i, e in enumerate(trace) if e["addr"] == 0xC)
    assert len(freed) == 2 and all(trace.index(e) < c for e in freed)  # where the drop was



def test_a_small_block_made_first_does_not_take_part_in_every_drop():
    """Seen in a TP run (examples/tp.py): the device mesh's 8-byte block, made first and alive
    to the end, fitted every drop taken oldest-first, so a drop of two 72 KiB parameter shards
    found no match and both stayed alive in the trace (the peak 4% high in one recording of
    ten). The fewest blocks that add up are taken: the two shards."""
    from snapforensics.record.cpu import _Alloc, _build_trace, _recover_lost_frees

    frames, f = _one_stack()
    S = 72 << 10
    allocs = [_Alloc(1, 0, 0x8, 8, f, 1, [], 8),               # the mesh's: alive at the end
              _Alloc(2, 1, 0xA, S, f, 1, [], 8 + S),            # lost
              _Alloc(3, 2, 0xB, S, f, 1, [], 8 + 2 * S),        # lost
              _Alloc(4, 3, 0xC, 16, f, 1, [], 8 + 16)]          # both dropped before this
    events, n = _recover_lost_frees(allocs, frames)
    trace, live = _build_trace(events)
    assert n == 2 and set(live) == {0x8, 0xC}



# ----------------------------------------------------------------------------- plumbing


def test_write_pickle_is_atomic(tmp_path, monkeypatch):
    from snapforensics.record import _write

    target = tmp_path / "rank0.pickle"
    _write.write_pickle(target, {"a": 1})
    assert (target.stat().st_mode & 0o777) == 0o644

    def broken(obj, f, protocol=None):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(_write.pickle, "dump", broken)
    with pytest.raises(OSError):
        _write.write_pickle(target, {"a": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.pickle"]
    assert pickle.loads(target.read_bytes()) == {"a": 1}


def test_backend_selection():
    from snapforensics.record.backends import select_backend

    yes, no = (lambda: True), (lambda: False)
    assert select_backend("auto", cuda_available=yes, npu_available=yes) == "cuda"
    assert select_backend("auto", cuda_available=no, npu_available=yes) == "npu"
    assert select_backend("auto", cuda_available=no, npu_available=no) == "cpu"
    assert select_backend("cpu", cuda_available=yes, npu_available=yes) == "cpu"
    assert select_backend("npu", cuda_available=yes, npu_available=yes) == "npu"
    for dev, kw in (("cuda", dict(cuda_available=no, npu_available=yes)),
                    ("npu", dict(cuda_available=yes, npu_available=no)),
                    ("tpu", dict(cuda_available=yes, npu_available=yes))):
        with pytest.raises(SnapError) as e:
            select_backend(dev, **kw)
        assert e.value.exit_code == EXIT_RECORD_FAILED


def test_cli_parsing(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import snapforensics.record as rec
    from snapforensics.commands.record import record_command

    seen = {}

    def fake_record(target, script_args, **kw):
        seen.update(target=target, args=list(script_args), **kw)
        return rec.RecordResult(exit_code=5, out_dir=tmp_path, snapshots=[])

    monkeypatch.setattr(rec, "record", fake_record)
    runner = CliRunner()
    r = runner.invoke(record_command, ["--out", str(tmp_path), "--nproc-per-node", "2", "-m",
                                       "pkg.mod", "--", "--variant", "buggy", "--out", "x"])
    assert r.exit_code == 5, r.output
    assert seen["target"] == "pkg.mod" and seen["module"] is True
    assert seen["args"] == ["--variant", "buggy", "--out", "x"]
    assert seen["nproc_per_node"] == 2 and seen["out"] == tmp_path
    r = runner.invoke(record_command, ["--max-entries", "9", "train.py", "-h", "--lr", "1"])
    assert r.exit_code == 5
    assert (seen["target"], seen["args"], seen["module"]) == \
        ("train.py", ["-h", "--lr", "1"], False)
    assert seen["max_entries"] == 9 and seen["device"] == "auto" and seen["stacks"] == "python"


def test_no_torch_import_at_import_time():
    code = ("import sys; import snapforensics.commands.record, snapforensics.record, "
            "snapforensics.record.cpu, snapforensics.record.backends, "
            "snapforensics.record._bootstrap;"
            " assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_missing_torch_is_a_user_error(monkeypatch, tmp_path):
    import snapforensics.record as rec

    real = rec.importlib.util.find_spec
    monkeypatch.setattr(rec.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    with pytest.raises(SnapError) as e:
        rec.record(str(script), [])
    assert e.value.exit_code == EXIT_RECORD_FAILED and "torch is not importable" in str(e.value)


def test_in_torchrun_detection(monkeypatch):
    from snapforensics.record import in_torchrun

    assert in_torchrun({"TORCHELASTIC_RUN_ID": "abc"})
    assert in_torchrun({"LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert not in_torchrun({"LOCAL_RANK": "0"})
    assert not in_torchrun({})


def test_exit_code_is_the_first_failing_ranks_own(tmp_path):
    """_result: the code of the rank that failed first (the others were stopped after it)."""
    from snapforensics.record import _result

    statuses = [{"rank": 0, "exit_code": 143, "snapshot": str(tmp_path / "rank0.pickle")},
                {"rank": 1, "exit_code": 4, "snapshot": str(tmp_path / "rank1.pickle")}]
    res = _result(statuses, tmp_path, expected=[0, 1], codes=[143, 4], quiet=True, first_failed=1)
    assert res.exit_code == 4
    assert [p.name for p in res.snapshots] == ["rank0.pickle", "rank1.pickle"]
    res = _result(statuses[:1], tmp_path, expected=[0, 1], codes=[143, -9], quiet=True,
                  first_failed=1)
    assert res.exit_code == 137  # killed by SIGKILL before it could write its status
    with pytest.raises(SnapError) as e:  # no snapshot and no failure: a recorder error, one line
        _result([{"rank": 0, "exit_code": 0, "error": "rank 0: writing the snapshot failed: X"}],
                tmp_path, expected=[0], codes=[0], quiet=True)
    assert e.value.exit_code == EXIT_RECORD_FAILED and str(e.value).endswith("failed: X")
    with pytest.raises(SnapError):  # recording could not start: the recorder's own error
        _result([{"rank": 0, "exit_code": 3, "snapshot": None, "error": "no cuda"}], tmp_path,
                expected=[0], codes=[3], quiet=True)


BEHAVE = """
import os, pathlib, signal, sys, time
import torch
keep = [torch.empty(1000 * (i + 1)) for i in range(10)]
what, out = sys.argv[1], pathlib.Path(sys.argv[2])
print("env", os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_RANK"),
      os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT", "0")) > 0)
print("the script's own stderr", file=sys.stderr)
sys.stdout.flush()
sys.stderr.flush()
if what == "os_exit":
    os._exit(9)
if what == "block_dump":  # the snapshot's name is taken by a folder: writing it fails
    (out / "rank0.pickle" / "x").mkdir(parents=True)
if what == "killed_mid_dump":  # what a SIGKILL while pickling leaves: a temp file
    (out / ".snapforensics-tmp-rank0.pickle.abc.tmp").write_bytes(b"partial")
    os.kill(os.getpid(), signal.SIGKILL)
if what == "loop":
    (out.parent / "started").write_text("yes")
    while True:
        keep.append(torch.ones(1000))
        keep = keep[-20:]
        time.sleep(0.005)
"""


@pytest.fixture()
def behave(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "behave.py"
    script.write_text(textwrap.dedent(BEHAVE))
    return script


def _record(script, what, out, *opts, after=()):
    return run_cli(["record", "--device", "cpu", *opts, "--out", str(out), str(script), what,
                    str(out), *after], cwd=out.parent)


def test_os_exit_code_is_kept_with_a_hint_and_nothing_left(behave, tmp_path):
    out = tmp_path / "out"
    proc = _record(behave, "os_exit", out, after=["--nproc-per-node", "2"])
    assert proc.returncode == 9, proc.stderr  # the script's own code, not "no snapshot" (3)
    assert "env 0 1 0 127.0.0.1 True" in proc.stdout  # torchrun's environment, one process
    lines = proc.stderr.splitlines()
    assert any("put --nproc-per-node before it" in line for line in lines)
    assert any("exited with code 9" in line and "0 snapshot(s)" in line for line in lines)
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # made by record, nothing written: no status, lock, temp or folder


def test_a_rank_killed_mid_dump_leaves_no_temp_file(behave, tmp_path):
    out = tmp_path / "out"
    proc = _record(behave, "killed_mid_dump", out, "-q")
    assert proc.returncode == 128 + 9, proc.stderr
    assert not out.exists()  # made by record, nothing written: removed


def test_a_snapshot_write_failure_is_one_line(behave, tmp_path):
    out = tmp_path / "out"
    proc = _record(behave, "block_dump", out, "-q")
    assert proc.returncode == EXIT_RECORD_FAILED
    lines = [line for line in proc.stderr.splitlines() if line != "the script's own stderr"]
    assert len(lines) == 1 and "writing the snapshot failed" in lines[0], proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["rank0.pickle"]  # the script's folder


def test_out_is_refused_when_used_unless_force_and_quiet_is_quiet(behave, tmp_path):
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    (out / "rank0.pickle").write_bytes(b"an earlier run")
    proc = _record(behave, "exit", out)
    assert proc.returncode == 2 and "--force" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    with open(out / ".snapforensics-record.lock", "w") as held:  # another record is running
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = _record(behave, "exit", out, "--force")
    assert proc.returncode == 2 and "another snapforensics record" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    proc = _record(behave, "exit", out, "--force", "-q")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["the script's own stderr"]  # no profiler or torch noise
    assert proc.stdout.splitlines() == ["env 0 1 0 127.0.0.1 True"]
    _only_snapshots(out)
    assert load_strict(out / "rank0.pickle")["snapforensics"]["script_exit_code"] == 0


def test_launchers_given_as_the_script_get_a_suggestion(tmp_path):
    proc = run_cli(["record", "--", "python", "train.py", "--lr", "1"], cwd=tmp_path)
    assert proc.returncode == EXIT_RECORD_FAILED and len(proc.stderr.splitlines()) == 1
    assert "try: snapforensics record train.py --lr 1" in proc.stderr
    proc = run_cli(["record", "torchrun", "--standalone", "--nproc-per-node", "2", "train.py"],
                   cwd=tmp_path)
    assert "try: snapforensics record --nproc-per-node 2 train.py" in proc.stderr


def test_sigterm_to_the_recorder_stops_the_whole_group_which_still_dumps(behave, tmp_path):
    """The ranks run in their own process group; the recorder forwards the signal to it."""
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "snapforensics", "record", "-q", "--device",
                             "cpu", "--out", str(out), str(behave), "loop", str(out)],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    marker = tmp_path / "started"
    try:
        deadline = time.time() + 300
        while not marker.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "the script never started"
        group = os.getpgid(int(subprocess.run(["pgrep", "-P", str(proc.pid)], check=False,
                                              capture_output=True, text=True).stdout.split()[0]))
        assert group != os.getpgid(proc.pid)  # its own group, away from the terminal's
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)  # nobody of the training group survives
    _only_snapshots(out)
    snap = load_strict(out / "rank0.pickle")
    assert snap["snapforensics"]["script_exit_code"] == 143
    assert any(f["filename"].endswith("behave.py") for e in snap["device_traces"][0]
               for f in e["frames"])


STEPS = """
import torch
model = torch.nn.Linear(256, 256)   # 256 KiB of weights, allocated before any step
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    marker = torch.empty(1000 + step)  # one distinctive size per step
    model(torch.ones(8, 256)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_steps_window_records_only_those_optimizer_steps(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "steps.py"
    script.write_text(textwrap.dedent(STEPS))
    out = tmp_path / "out"
    proc = run_cli(["record", "-q", "--device", "cpu", "--steps", "2:4", "--out", str(out),
                    str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    snap = load_strict(out / "rank0.pickle")
    sizes = {e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"}
    assert {4 * 1002, 4 * 1003} <= sizes  # steps 2 and 3
    assert not sizes & {4 * 1000, 4 * 1001, 4 * 1004}  # not 0, 1 or 4
    before = [s for s in snap["segments"]
              if s["frames"][0]["name"] == "allocated_before_recording"]
    assert len(before) == 1 and before[0]["total_size"] >= 256 * 256 * 4  # the weights
    proc = run_cli(["record", "--steps", "3:1", str(script)], cwd=tmp_path)
    assert proc.returncode == 2 and "selects no step" in proc.stderr


SPREAD_ARGS = ("--layers", "2", "--dim", "128", "--steps", "2")  # the smallest useful run


@pytest.mark.slow
def test_repeated_recordings_of_one_run_give_the_same_peak(tmp_path):
    """Issue 7: frees made on gloo threads are not lost, so the rank-0 peak is stable (0.5%).
    Three recordings here (about a minute); benchmarks/bench_record.py --spread 10 does ten."""
    pytest.importorskip("torch")
    peaks = []
    for i in range(3):
        paths = record_variant("fixed", tmp_path / f"r{i}", extra=SPREAD_ARGS[:-2], steps=2,
                               fresh=True)
        peaks.append(replay_peak(load_strict(paths[0])))
    assert (max(peaks) - min(peaks)) / min(peaks) <= 0.005, peaks


TWO_RANKS = """
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")  # from the environment record gives each rank
keep = torch.ones(1000 * (dist.get_rank() + 1))
if dist.get_rank() == 1:
    sys.exit(5)
dist.barrier()  # rank 0 waits for the rank that is gone
"""


def test_a_failed_rank_stops_the_others_and_its_code_is_the_recorders(tmp_path):
    """Ranks launched by record itself (no torchrun): rank 1 exits 5, rank 0 is stopped, still
    dumps, and record exits 5 (the first failure), not the stopped rank's 143 nor torchrun's 1."""
    pytest.importorskip("torch")
    script = tmp_path / "two.py"
    script.write_text(textwrap.dedent(TWO_RANKS))
    out = tmp_path / "out"
    proc = run_cli(["record", "--device", "cpu", "--nproc-per-node", "2", "--out", str(out),
                    str(script)], cwd=tmp_path)
    assert proc.returncode == 5, proc.stderr
    assert "exited with code 5 on rank 1; 2 snapshot(s)" in proc.stderr
    _only_snapshots(out)
    ranks = [load_strict(out / f"rank{r}.pickle")["snapforensics"] for r in (0, 1)]
    assert [p["world_size"] for p in ranks] == [2, 2] and ranks[1]["script_exit_code"] == 5
    assert ranks[0]["script_exit_code"] != 0


def test_ranks_stop_when_the_recorder_is_killed(behave, tmp_path):
    """SIGKILL cannot be forwarded: each rank asked the kernel for SIGTERM when its launcher
    dies, so no training process is orphaned (it still writes its snapshot)."""
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "snapforensics", "record", "-q", "--device",
                             "cpu", "--out", str(out), str(behave), "loop", str(out)],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    marker = tmp_path / "started"
    deadline = time.time() + 300
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert marker.exists(), "the script never started"
    rank = int(subprocess.run(["pgrep", "-P", str(proc.pid)], check=False, capture_output=True,
                              text=True).stdout.split()[0])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 300
    while time.time() < deadline and _running(rank):
        time.sleep(0.1)
    alive = _running(rank)
    if alive:
        os.kill(rank, signal.SIGKILL)
    assert not alive, "the rank kept running after its recorder was killed"
    assert (out / "rank0.pickle").is_file()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


STUCK = """
import sys, time, torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
keep = torch.ones(1000 * (rank + 1))
if rank == 2:
    time.sleep(2)
    raise RuntimeError("rank 2 fails")
buf = torch.empty(4)
dist.recv(buf, src=1 - rank)  # ranks 0 and 1 wait for each other: a hang, as NCCL's would be
"""


def test_survivors_blocked_in_a_native_wait_still_write_their_snapshots(tmp_path):
    """Rank 2 raises; ranks 0 and 1 sit in gloo receives (GIL released, the Python SIGTERM
    handler never runs): their watcher threads dump on the recorder's SIGTERM."""
    pytest.importorskip("torch")
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(STUCK))
    out = tmp_path / "out"
    proc = run_cli(["record", "--device", "cpu", "--nproc-per-node", "3", "--out", str(out),
                    str(script)], cwd=tmp_path, timeout=200)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("is blocked in native code") == 2, proc.stderr
    _only_snapshots(out)
    for r in (0, 1):
        prov = load_strict(out / f"rank{r}.pickle")["snapforensics"]
        assert prov["script_exit_code"] == 143 and prov["rank"] == r


SPAWNS = """
import torch.multiprocessing as mp

def work(i):
    print("child", i)

if __name__ == "__main__":
    mp.spawn(work, nprocs=2)
"""


def test_mp_spawn_is_refused_with_how_to_launch(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "spawns.py"
    script.write_text(textwrap.dedent(SPAWNS))
    proc = run_cli(["record", "-q", "--device", "cpu", "--out", str(tmp_path / "out"),
                    str(script)], cwd=tmp_path)
    assert proc.returncode == EXIT_RECORD_FAILED, proc.stderr
    assert "child" not in proc.stdout
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "torch.multiprocessing.spawn" in err[0], proc.stderr
    assert "snapforensics record --nproc-per-node 2" in err[0]


def test_slurm_variables_give_the_rank(behave, tmp_path):
    """``srun`` without torchrun's variables: SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS."""
    from snapforensics.record import in_torchrun
    from snapforensics.record._bootstrap import rank_env

    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77"}
    assert rank_env(slurm) == (5, 8, 1, True)
    assert rank_env({**slurm, "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}) == (2, 4, 0,
                                                                                        True)
    assert in_torchrun(slurm) and not in_torchrun({"SLURM_JOB_ID": "77"})
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(slurm, PYTHONPATH=str(REPO))
    proc = run_cli(["record", "--device", "cpu", "--out", str(out), str(behave), "plain",
                    str(out)], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    prov = load_strict(out / "rank5.pickle")["snapforensics"]
    assert (prov["rank"], prov["world_size"], prov["local_rank"]) == (5, 8, 1)


def test_cpu_recording_imports_the_scripts_leading_imports_before_profiling(tmp_path,
                                                                          monkeypatch):
    """The script's first statements, when they are imports, run before the profiler starts
    (under its Python tracer a big library's import cost GBs); the rest stays recorded."""
    pytest.importorskip("torch")
    from snapforensics.record import _bootstrap

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "early_mod.py").write_text("import sys\nSEEN = sys.argv[1:]\n")
    (tmp_path / "late_mod.py").write_text("X = 1\n")
    script = tmp_path / "s.py"
    script.write_text('"""doc"""\nfrom __future__ import annotations\nimport json\n'
                      "from early_mod import SEEN\nimport torch\nkeep = torch.ones(100)\n"
                      "import late_mod\nassert SEEN == ['--flag'], SEEN\n")
    monkeypatch.delitem(sys.modules, "early_mod", raising=False)
    monkeypatch.delitem(sys.modules, "late_mod", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    status = _bootstrap.run_recorded({"out": str(tmp_path / "out"), "device": "cpu"},
                                     str(script), ["--flag"])
    assert status["exit_code"] == 0, status
    prov = load_strict(tmp_path / "out" / "rank0.pickle")["snapforensics"]
    assert prov["imported_before_recording"] == ["json", "early_mod", "torch"]


def test_cpu_recording_runs_imports_inside_the_script_untraced(tmp_path, monkeypatch):
    """An import inside a function (issue 29, item 0) is not traced by the profiler's Python
    tracer: the imported module's own calls are in no stack, the script's frames after the
    import still are, and the import is counted in the backend's timings."""
    pytest.importorskip("torch")
    from snapforensics.record import _bootstrap

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "heavy_mod.py").write_text(
        "import torch\ndef busy_import_time_work():\n    return torch.ones(333)\n"
        "KEPT = busy_import_time_work()\n")
    script = tmp_path / "s.py"
    script.write_text("import torch\ndef main():\n    import heavy_mod\n"
                      "    return torch.ones(777) + heavy_mod.KEPT.sum()\nkeep = main()\n")
    monkeypatch.delitem(sys.modules, "heavy_mod", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    status = _bootstrap.run_recorded({"out": str(tmp_path / "out"), "device": "cpu"},
                                     str(script), [])
    assert status["exit_code"] == 0, status
    assert status["timings"]["imports_untraced"] >= 1
    snap = load_strict(tmp_path / "out" / "rank0.pickle")
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    names = [{f["name"] for f in e["frames"]} for e in allocs]
    assert not any("busy_import_time_work" in n for n in names)
    sizes = {e["size"]: {f["name"] for f in e["frames"]} for e in allocs}
    assert 333 * 4 in sizes  # the import's allocation is kept, without its Python frames
    assert "main" in sizes[777 * 4]
