"""The CUDA and Ascend recording paths, run through torch's and torch_npu's REAL Python wrappers
(torch 2.13's ``torch.cuda``/``torch.cuda.memory``; ``torch_npu/npu/memory.py`` of the published
torch_npu 2.14.0 and 2.1.0.post17 wheels) with only the C bindings stubbed as the C++ behaves
(``device_stubs``). The script runs in this process under ``run_recorded``, as a rank would.
"""

from __future__ import annotations

import builtins
import textwrap

import pytest
from device_stubs import NPU_RELEASES, cuda_allocator, torch_npu_memory
from recordings import load_strict

torch = pytest.importorskip("torch")

from snapforensics.record import _bootstrap  # noqa: E402
from snapforensics.record.backends import CudaBackend, history_call  # noqa: E402

NPU_VERSIONS = list(NPU_RELEASES)


@pytest.fixture(autouse=True)
def _clean_rank_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_LOCALID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)


def _run(tmp_path, source: str, device: str, stacks: str = "python"):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(source))
    out = tmp_path / "out"
    status = _bootstrap.run_recorded({"out": str(out), "device": device, "stacks": stacks},
                                     str(script), [])
    return status, out


def _entries(path, device=None):
    snap = load_strict(path)
    traces = snap["device_traces"]
    return snap, [e for t in traces for e in t]


# ------------------------------------------------------------------------ Ascend (item 1, 6)


@pytest.mark.parametrize("version", NPU_VERSIONS)
def test_history_call_binds_the_published_torch_npu_wrapper(version, monkeypatch):
    """torch_npu's ``_record_memory_history(enabled="all", *args, **kwargs)`` hands everything to
    ``_record_memory_history_impl``: ``global_record_annotations`` there is a TypeError."""
    memory, a = torch_npu_memory(version, monkeypatch)
    args, kwargs = history_call(memory._record_memory_history, stacks="python", max_entries=7)
    assert "global_record_annotations" not in kwargs
    memory._record_memory_history(*args, **kwargs)
    assert a.record_history and a.max_entries == 7


@pytest.mark.parametrize("version", NPU_VERSIONS)
def test_npu_rank_records_on_its_own_npu_and_the_file_says_what_npu_lacks(version, monkeypatch,
                                                                        tmp_path):
    memory, a = torch_npu_memory(version, monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    status, out = _run(tmp_path, """
        import builtins, torch_npu
        torch_npu.npu.init()                  # the script's first NPU use
        x = builtins._sf_dev.alloc(1 << 20)
        builtins._sf_dev.free(x, 1 << 20)
        builtins._sf_dev.alloc(2 << 20)
    """, "npu")
    assert status["exit_code"] == 0 and status["error"] is None, status
    assert a.history_devices[0] == 1  # history started with NPU 1 current, not NPU 0
    snap, entries = _entries(out / "rank1.pickle")
    assert [e["action"] for e in entries] == ["alloc", "free_requested", "free_completed",
                                              "alloc"]
    assert not any("time_us" in e for e in entries)  # torch_npu's snapshot has no time
    assert snap["snapforensics"]["backend"] == "npu"


# ----------------------------------------------------- the script's own history calls (item 2)

BLOG = """
    import builtins, {mod}
    mem = {mem}
    {init}
    mem._record_memory_history(max_entries=100000)   # PyTorch's memory blog
    for _ in range(3):
        builtins._sf_dev.alloc(1 << 20)
    mem._dump_snapshot if hasattr(mem, "_dump_snapshot") else None
    mem._record_memory_history(enabled=None)
    builtins._sf_dev.alloc(4 << 20)
"""


def _check_history_calls_kept(status, out, capsys):
    assert status["exit_code"] == 0, status
    _, entries = _entries(out / "rank0.pickle")
    assert [e["size"] for e in entries if e["action"] == "alloc"] == [1 << 20] * 3 + [4 << 20]
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "the script called" in ln]
    assert len(lines) == 1, err
    assert "_record_memory_history(enabled='all', max_entries=100000) at s.py:5" in lines[0]
    prov = load_strict(out / "rank0.pickle")["snapforensics"]
    assert len(prov["script_history_calls"]) == 2
    assert "enabled=None" in prov["script_history_calls"][1]


def test_script_history_calls_keep_the_cuda_recording(monkeypatch, tmp_path, capsys):
    a = cuda_allocator(monkeypatch)
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    status, out = _run(tmp_path, BLOG.format(mod="torch", mem="torch.cuda.memory",
                                             init="torch.cuda.init()"), "cuda")
    _check_history_calls_kept(status, out, capsys)


@pytest.mark.parametrize("version", NPU_VERSIONS)
def test_script_history_calls_keep_the_npu_recording(version, monkeypatch, tmp_path, capsys):
    memory, a = torch_npu_memory(version, monkeypatch)
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    status, out = _run(tmp_path, BLOG.format(mod="torch_npu", mem="torch_npu.npu.memory",
                                             init="torch_npu.npu.init()"), "npu")
    _check_history_calls_kept(status, out, capsys)


def test_an_empty_recording_of_a_script_that_allocated_is_not_silent(monkeypatch, tmp_path):
    """History cleared where the recorder cannot see it (a C++ extension calling the
    allocator's recordHistory): the 0-entry file comes with a warning."""
    a = cuda_allocator(monkeypatch)
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    status, out = _run(tmp_path, """
        import builtins, torch
        torch.cuda.init()
        builtins._sf_dev.alloc(1 << 20)
        builtins._sf_dev.record_memory_history(None, None, "python", 1)  # C++ side, unseen
    """, "cuda")
    assert status["entries"] == 0
    assert any("0 entries although the script allocated 1 block" in w
               for w in status["warnings"]), status


# --------------------------------------------------------------------------------- OOM (item 3)

OOM_SCRIPT = """
    import builtins, sys, torch
    torch.cuda.init()
    keep = builtins._sf_dev.alloc(3 << 30)
    for size in (64 << 30, 32 << 30, 16 << 30):      # a batch-size finder
        try:
            builtins._sf_dev.oom(size)
        except torch.OutOfMemoryError:
            pass
    sys.exit(7)
"""


def test_oom_one_lazy_snapshot_for_the_first_oom_with_honest_fields(monkeypatch, tmp_path):
    a = cuda_allocator(monkeypatch)
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    calls = []
    real = a.snapshot
    monkeypatch.setattr(torch._C, "_cuda_memorySnapshot",
                        lambda *x: calls.append(1) or real(*x))
    status, out = _run(tmp_path, OOM_SCRIPT, "cuda")
    assert status["exit_code"] == 7 and status["error"] is None, status
    assert len(calls) == 2  # the first OOM and the final dump, not one per OOM
    snap, entries = _entries(out / "rank0.oom.pickle")
    assert [e["size"] for e in entries if e["action"] == "oom"] == [64 << 30]
    assert snap["snapforensics"]["oom"] == {
        "device": 0, "requested_bytes": 64 << 30,
        "device_total_or_allowed_max_bytes": 80 << 30, "device_free_bytes": 1 << 20}


def test_a_failing_oom_snapshot_leaves_the_oom_as_the_error(monkeypatch, tmp_path, capsys):
    a = cuda_allocator(monkeypatch)
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)

    def no_memory_left(*x):
        raise MemoryError("host memory exhausted while building the snapshot")

    a.snapshot = no_memory_left  # type: ignore[method-assign]
    monkeypatch.setattr(torch._C, "_cuda_memorySnapshot", no_memory_left)
    status, out = _run(tmp_path, OOM_SCRIPT, "cuda")
    assert status["exit_code"] == 7  # the script caught torch.OutOfMemoryError each time
    assert not (out / "rank0.oom.pickle").exists()
    assert "OOM snapshot failed: MemoryError" in capsys.readouterr().err


# ----------------------------------------------- no CUDA initialization before the script (5)


def test_cuda_is_not_initialized_before_the_script_and_its_visible_devices_count(monkeypatch,
                                                                                 tmp_path):
    a = cuda_allocator(monkeypatch, devices=4)
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    status, out = _run(tmp_path, """
        import builtins, os, torch
        os.environ["CUDA_VISIBLE_DEVICES"] = "2"    # the script picks its GPU
        torch.cuda.init()
        builtins._sf_dev.alloc(1 << 20)
    """, "auto")
    assert a.count_calls_before_init == 0  # no cudaGetDeviceCount (cuInit) before the script
    assert a.init_env == "2"  # CUDA initialized after the script chose its device
    snap, entries = _entries(out / "rank0.pickle")
    assert snap["snapforensics"]["backend"] == "cuda" and len(entries) == 1


def test_a_script_that_never_uses_cuda_says_so(monkeypatch, tmp_path):
    a = cuda_allocator(monkeypatch)
    status, out = _run(tmp_path, "x = 1\n", "cuda")
    assert not a.initialized and status["entries"] == 0
    assert any("never used CUDA" in w for w in status["warnings"]), status


def test_stacks_all_asks_for_fast_symbolization(monkeypatch):
    monkeypatch.delenv("TORCH_SYMBOLIZE_MODE", raising=False)
    CudaBackend("all", 10)
    import os

    assert os.environ["TORCH_SYMBOLIZE_MODE"] == "fast"
    monkeypatch.setenv("TORCH_SYMBOLIZE_MODE", "dladdr")  # the user's choice stays
    CudaBackend("all", 10)
    assert os.environ["TORCH_SYMBOLIZE_MODE"] == "dladdr"


def test_history_call_binds_torch_213s_real_wrapper():
    args, kwargs = history_call(torch.cuda.memory._record_memory_history, stacks="python",
                                max_entries=7)
    assert kwargs["global_record_annotations"] is True
    import inspect

    inspect.signature(torch.cuda.memory._record_memory_history_impl).bind(*args, **kwargs)


# ---------------------------------------------------------------------------- install (item 11)


@pytest.mark.parametrize("version", NPU_VERSIONS)
def test_record_extra_is_a_range_that_admits_each_torch_npu_releases_torch(version):
    """``[record]`` never replaces an installed torch, and ``[record,npu]`` resolves: the torch
    each published torch_npu requires lies inside the range. The Makefile pins torch for CI."""
    import re

    from device_stubs import npu_requires
    from packaging.requirements import Requirement
    from recordings import REPO

    text = (REPO / "pyproject.toml").read_text()
    record = re.search(r"^record = \[(.*)\]$", text, re.M).group(1)
    (req,) = [Requirement(r.strip().strip('"')) for r in record.split(",")]
    assert req.name == "torch" and not any(s.operator in ("==", "===") for s in req.specifier)
    (npu_torch,) = [Requirement(r) for r in npu_requires(version)
                    if Requirement(r).name == "torch"]
    pinned = next(iter(npu_torch.specifier)).version.rstrip(".*")
    assert req.specifier.contains(pinned, prereleases=True), (req, npu_torch)
    assert req.specifier.contains(torch.__version__.split("+")[0])
    assert re.search(r"^TORCH := torch==\d+\.\d+\.\d+$", (REPO / "Makefile").read_text(), re.M)


# ------------------------------------------------- memory the allocator cannot see (issue 29 #5)


STEPS_SCRIPT = """
    import builtins, torch
    {init}
    class Opt(torch.optim.Optimizer):        # torch's step wrapper runs the hooks
        def step(self, closure=None):
            pass
    opt = Opt([torch.nn.Parameter(torch.zeros(4))], {{}})
    for i in range(3):
        x = builtins._sf_dev.alloc(64 << 20)
        builtins._sf_dev.context += 100 << 20    # NCCL/HCCL grows a buffer each step
        opt.step()
        builtins._sf_dev.free(x, 64 << 20)
"""


def _check_device_memory(status, out):
    assert status["exit_code"] == 0, status
    dm = load_strict(out / "rank0.pickle")["snapforensics"]["device_memory"]
    assert dm["error"] is None
    steps = [s["step"] for s in dm["samples"]]
    assert steps == ["start", 1, 2, 3, "end"]
    gaps = [s["used_bytes"] - s["reserved_bytes"] for s in dm["samples"]]
    assert gaps == [600 << 20, 700 << 20, 800 << 20, 900 << 20, 900 << 20]
    assert all(s["reserved_bytes"] == 64 << 20 for s in dm["samples"][1:])
    assert dm["samples"][1]["allocated_bytes"] == 64 << 20  # sampled inside the step
    assert all(s["total_bytes"] == 80 << 30 for s in dm["samples"])


def test_cuda_device_memory_sampled_at_each_step_beside_the_reserved_bytes(monkeypatch, tmp_path):
    """torch's real `mem_get_info` / `memory_reserved` over the stubbed cudart and stats: one
    sample at the start, one after each optimizer step (torch's global post hook), one at the
    end; the gap used - reserved is what the device holds outside the allocator."""
    import torch._dynamo  # noqa: F401  (the optimizer imports it: before the CUDA stubs)

    a = cuda_allocator(monkeypatch)
    a.context = 600 << 20
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    status, out = _run(tmp_path, STEPS_SCRIPT.format(init="torch.cuda.init()"), "cuda")
    _check_device_memory(status, out)


@pytest.mark.parametrize("version", NPU_VERSIONS)
def test_npu_device_memory_sampled_at_each_step_beside_the_reserved_bytes(version, monkeypatch,
                                                                          tmp_path):
    """The NPU twin: the published wheel's own ``mem_get_info`` (``npu/__init__.py`` in 2.14,
    ``npu/utils.py`` in 2.1) over the stubbed ``_npu_getDeviceMemories`` (aclrtGetMemInfo), and
    its ``memory.py`` ``memory_reserved``/``memory_allocated`` over the stubbed stats."""
    import sys

    import torch._dynamo  # noqa: F401  (the optimizer imports it: before the NPU stubs)

    memory, a = torch_npu_memory(version, monkeypatch)
    npu = sys.modules["torch_npu.npu"]
    where = {"2.14.0": "torch_npu/npu/__init__.py", "2.1.0.post17": "torch_npu/npu/utils.py"}
    assert npu.mem_get_info.__code__.co_filename.endswith(where[version])
    calls = []
    C = sys.modules["torch_npu._C"]
    real = C._npu_getDeviceMemories
    monkeypatch.setattr(C, "_npu_getDeviceMemories", lambda d: calls.append(d) or real(d))
    a.context = 600 << 20
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    status, out = _run(tmp_path, STEPS_SCRIPT.format(
        init="import torch_npu; torch_npu.npu.init()"), "npu")
    _check_device_memory(status, out)
    assert calls == [0] * 5  # one aclrtGetMemInfo per sample, on the current NPU


# ------------------------------------------------------- tensor names on CUDA / NPU (issue 29 #1)

NAMES_SCRIPT = """
    import builtins, json, sys, torch
    {init}
    dev = builtins._sf_dev
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for p in model.parameters():
        dev.tensor(p)                     # the parameters' blocks (made on the device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    truth = []
    for step in range(2):
        model(torch.randn(3, 8)).sum().backward()
        if step == 0:
            for p in model.parameters():
                dev.tensor(p.grad)        # the gradients' blocks, made by the first backward
        opt.step()
    truth = [[n, p.untyped_storage().data_ptr(), list(p.shape)]
             for n, p in model.named_parameters()]
    json.dump(truth, open(sys.argv[1], "w"))
"""


def _names_of(path):
    import snapforensics as sf

    blocks = sf.diagnose(path).blocks
    return {int(r.address): (r.tensor, r.tensor_kind, r.module) for r in blocks.itertuples()}


def _check_names(status, out, truth_path):
    import json

    assert status["exit_code"] == 0 and status["error"] is None, status
    snap = load_strict(out / "rank0.pickle")
    key = snap["snapforensics_tensors"]
    assert not key["errors"] and key["observations_made"] > 0, key
    named = _names_of(out / "rank0.pickle")
    truth = json.loads(truth_path.read_text())
    assert len(truth) == 4
    for name, ptr, _shape in truth:  # each parameter's block carries its named_parameters() name
        assert named[ptr] == (name, "parameter", name.rpartition(".")[0]), (name, named.get(ptr))
    grads = [v for v in named.values() if v[1] == "gradient"]
    assert sorted(g[0] for g in grads) == sorted(n + ".grad" for n, _, _ in truth)


def test_cuda_recording_names_parameters_and_gradients(monkeypatch, tmp_path):
    """torch's real CUDA path: the names start with the backend (before the script's first
    CUDA use), are attached to the CUDA snapshot at the stop, and join to its blocks on the
    trace's epoch clock."""
    import torch._dynamo  # noqa: F401  (the optimizer imports it: before the CUDA stubs)

    a = cuda_allocator(monkeypatch)
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(NAMES_SCRIPT.format(init="torch.cuda.init()")))
    status = _bootstrap.run_recorded({"out": str(tmp_path / "out"), "device": "cuda",
                                      "stacks": "python"}, str(script), [str(tmp_path / "t")])
    _check_names(status, tmp_path / "out", tmp_path / "t")


@pytest.mark.parametrize("version", NPU_VERSIONS)
def test_npu_recording_names_parameters_and_gradients(version, monkeypatch, tmp_path):
    """torch_npu's snapshot entries carry no time (Module.cpp ``THNPModule_memorySnapshot``):
    the names still join, by the address where one block only ever lived there."""
    import torch._dynamo  # noqa: F401

    memory, a = torch_npu_memory(version, monkeypatch)
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(NAMES_SCRIPT.format(
        init="import torch_npu; torch_npu.npu.init()")))
    status = _bootstrap.run_recorded({"out": str(tmp_path / "out"), "device": "npu",
                                      "stacks": "python"}, str(script), [str(tmp_path / "t")])
    snap = load_strict(tmp_path / "out" / "rank0.pickle")
    assert not any("time_us" in e for t in snap["device_traces"] for e in t)
    _check_names(status, tmp_path / "out", tmp_path / "t")


def test_steps_window_on_cuda_starts_and_stops_inside_step_hooks(monkeypatch, tmp_path):
    """``--steps 1:3`` on CUDA: recording starts in step 0's post hook and stops in step 2's.
    The device memory samples ride on the recorder's one step hook (registered before the
    script): registering one at the start inside torch's iteration over its post hooks was
    the script's "OrderedDict mutated during iteration"."""
    import torch._dynamo  # noqa: F401

    a = cuda_allocator(monkeypatch)
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import builtins, torch
        torch.cuda.init()
        class Opt(torch.optim.Optimizer):
            def step(self, closure=None):
                pass
        opt = Opt([torch.nn.Parameter(torch.zeros(4))], {})
        for i in range(4):
            x = builtins._sf_dev.alloc((i + 1) << 20)
            opt.step()
            builtins._sf_dev.free(x, (i + 1) << 20)
    """))
    out = tmp_path / "out"
    status = _bootstrap.run_recorded({"out": str(out), "device": "cuda", "stacks": "python",
                                      "steps": [1, 3]}, str(script), [])
    assert status["exit_code"] == 0 and status["error"] is None, status
    snap, entries = _entries(out / "rank0.pickle")
    assert [e["size"] for e in entries if e["action"] == "alloc"] == [2 << 20, 3 << 20]
    dm = snap["snapforensics"]["device_memory"]
    assert [s["step"] for s in dm["samples"]] == ["start", 2, 3, "end"]
    assert dm["error"] is None
