"""The accelerators' real Python wrappers, with only their C bindings stubbed.

CUDA: torch's own ``torch.cuda`` / ``torch.cuda.memory`` (the installed torch, 2.13) run as they
are; ``cuda_allocator(monkeypatch)`` replaces the ``torch._C._cuda_*`` bindings they call (and the
ctypes NVML count) with a ``StubAllocator``.

Ascend: ``torch_npu_memory(version, monkeypatch)`` takes ``torch_npu/npu/memory.py`` (and the pure
Python ``_memory_viz.py``, ``utils/_error_code.py`` it imports), and the one function
``mem_get_info`` (read with ``ast`` from ``npu/__init__.py`` in 2.14, ``npu/utils.py`` in 2.1),
from the PUBLISHED wheel of that torch_npu release, fetched at set-up time with ``pip download
--no-deps`` into a cache folder (``SNAPFORENSICS_WHEEL_CACHE``, default
``~/.cache/snapforensics-tests/wheels``): nothing of torch_npu is in this repository. The package
``__init__``s around it (``torch_npu``, ``torch_npu.npu``: the lazy-init queue, ``set_device``,
``device_count``, ``current_device``) are shells written after torch_npu's ``npu/__init__.py``
(``_lazy_call``/``_lazy_init``) and ``npu/utils.py`` (``set_device``, ``current_device``), because
the real ones load the C extension; ``torch_npu._C`` is the stub.
Skips (pytest.skip with the reason) when the wheel cannot be fetched.

What the stubs do is written from the C++ (Ascend/pytorch master 9e73e708a and v2.1.0 82f7ccc5b;
pytorch 2.13 sources):

- torch ``torch/csrc/cuda/memory_snapshot.cpp`` ``_record_memory_history``: max_entries kept only
  for ``enabled == "all"`` (else 1); then ``CUDACachingAllocator::recordHistory(enabled.has_value()
  ...)``, whose ``DeviceCachingAllocator::recordHistory`` (c10/cuda/CUDACachingAllocator.cpp) sets
  ``record_history = enabled``, ``alloc_buffer.setMaxEntries(n)`` and
  ``if (!enabled || clearHistory) alloc_buffer.clear()``: DISABLING CLEARS the history.
- torch_npu ``torch_npu/csrc/npu/memory_snapshot.cpp`` lines 37-73 (v2.1: same function):
  ``recordHistory(enabled.has_value(), recorder, max_entries, when)``, and
  ``torch_npu/csrc/core/npu/NPUCachingAllocator.cpp`` ``recordHistory`` (lines 1038-1051; v2.1
  lines 1219-1230) ends with ``alloc_trace->clear()`` unconditionally: EVERY CALL CLEARS.
- snapshots: torch's ``_cuda_memorySnapshot(None)`` entries carry ``time_us``, epoch
  microseconds (memory_snapshot.cpp ``_memory_snapshot_pickled``: ``tsc_to_us(
  te.time_.approx_t_) / 1000``, the ``ApproximateClockToUnixTimeConverter`` of c10's
  ``getTime()``, the system clock), the clock the recorder's names use; torch_npu's
  ``THNPModule_memorySnapshot`` (Module.cpp lines 1274-1460) writes only ``action``,
  ``addr``/``device_free``, ``size``, ``stream``, ``pool_id`` (no time, no annotations) and
  prepends the workspace allocator's segments and trace. It is ``METH_O`` (called with ``None``)
  on master, ``METH_NOARGS`` on v2.1 (Module.cpp v2.1 line 1961).
- OOM: both allocators call each observer, after unlocking, as ``(device, alloc_size,
  allowed_memory_maximum or device_total, device_free)`` (NPUCachingAllocator.cpp ~line 1354,
  v2.1 line 1431; CUDACachingAllocator.cpp ``malloc``), and the binding
  (``THNPModule_attachOutOfMemoryObserver``, Module.cpp 1477-1490; torch/csrc/cuda/Module.cpp
  ``_cuda_attach_out_of_memory_observer``) throws ``py::error_already_set`` when the Python
  observer raises: the observer's exception REPLACES the OOM.
- device memory: torch's ``torch/csrc/cuda/shared/cudart.cpp`` binds ``cudaMemGetInfo(device)``
  (under a ``CUDAGuard`` on that device) returning ``(free, total)`` of the whole device, what
  every process and the driver hold; ``memory_reserved``/``memory_allocated`` read the
  allocator's ``reserved_bytes.all.current``/``allocated_bytes.all.current`` stats
  (c10/cuda/CUDACachingAllocator.cpp: a freed block stays reserved in its cached segment).
  The stub's device holds ``context`` bytes outside the allocator (set per test) plus what the
  allocator reserved. torch_npu's ``mem_get_info`` (same Python in both releases) returns
  ``(prop.free_memory, prop.total_memory)`` of ``torch_npu._C._npu_getDeviceMemories(device_id)``:
  ``torch_npu/csrc/npu/Module.cpp`` ``GetDeviceMemories`` (master lines 293-301, v2.1 lines
  178-187) takes an ``NPUGuard(deviceid)`` and calls ``aclrtGetMemInfo(ACL_HBM_MEM, &free,
  &total)`` (the device's HBM, free and total, like cudaMemGetInfo), stores them in the ONE
  global ``NPUDeviceMem memory`` and returns a pointer to it
  (``BindGetDeviceMemories``, ``py::return_value_policy::reference``: every call returns that
  same object, overwritten); ``RegisterNPUDeviceMemories`` binds it as ``_NPUDeviceMemories``
  with ``def_readonly`` ``total_memory``/``free_memory``.
"""

from __future__ import annotations

import ast
import builtins
import os
import subprocess
import sys
import sysconfig
import time
import types
import zipfile
from pathlib import Path

import pytest

NPU_RELEASES = {  # version -> (python version, platform) of a published x86_64 wheel
    "2.14.0": ("3.11", "manylinux_2_28_x86_64"),  # current release
    "2.1.0.post17": ("3.10", "manylinux2014_x86_64"),
}
_NPU_FILES = ("torch_npu/npu/memory.py", "torch_npu/npu/_memory_viz.py",
              "torch_npu/utils/_error_code.py")
_NPU_MEM_GET_INFO = {  # version -> the wheel's file defining ``mem_get_info`` (only it is used)
    "2.14.0": "torch_npu/npu/__init__.py",
    "2.1.0.post17": "torch_npu/npu/utils.py",
}


def _npu_files(version: str) -> tuple[str, ...]:
    return (*_NPU_FILES, _NPU_MEM_GET_INFO[version])


class NPUDeviceMemories:
    """``torch_npu._C._NPUDeviceMemories``: ``py::class_<NPUDeviceMem>`` with ``def_readonly``
    ``total_memory``/``free_memory`` (Module.cpp ``RegisterNPUDeviceMemories``)."""

    __slots__ = ("_free", "_total")

    def __init__(self) -> None:
        self._free = self._total = 0  # NPUDeviceMem's ``size_t ... = 0``

    @property
    def free_memory(self) -> int:
        return self._free

    @property
    def total_memory(self) -> int:
        return self._total


def real_function(path: Path, name: str, namespace: dict):
    """The top-level ``def name`` of the file at ``path``, alone, executed in ``namespace`` (its
    file name and line numbers kept). Every global it reads must be in ``namespace``."""
    tree = ast.parse(path.read_text(), str(path))
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    a = node.args
    local = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x}
    local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store)}
    read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)}
    missing = read - local - set(namespace) - set(vars(builtins))
    assert not missing, f"{path}:{node.lineno} {name} reads {sorted(missing)}"
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


class StubAllocator:
    """One device's caching allocator, as far as the history, the snapshot, the stats and the
    OOM observers go (see the module docstring for the C++ each part follows)."""

    def __init__(self, *, npu: bool = False, clears_on_every_call: bool = False,
                 devices: int = 2) -> None:
        self.npu = npu
        self.clears_on_every_call = clears_on_every_call
        self.devices = devices
        self.record_history = False
        self.max_entries = 1
        self.trace: list[dict] = []
        self.observers: list = []
        self.allocated = 0  # stats "allocation.all.allocated": never reset by history calls
        self.current_device = 0
        self.history_devices: list[int] = []  # the current device at each history call
        self.initialized = False
        self.init_env: str | None = "<not initialized>"
        self.count_calls_before_init = 0
        self.next_addr = 0x7F0000000000
        self.clock = 0.0  # the last time_us written (the system clock, never backwards)
        self.live = 0  # allocated_bytes.all.current
        self.reserved = 0  # reserved_bytes.all.current: cached segments are kept
        self.context = 0  # device bytes outside the allocator (CUDA context, NCCL, ...)
        self.total = 80 << 30

    # --- history
    def record_memory_history(self, enabled, context, stacks, max_entries,
                              clear_history=False, *rest) -> None:
        if enabled is not None and enabled not in ("state", "all"):
            raise RuntimeError("expected state to be 'state', 'all', or None")
        if stacks not in ("python", "all"):
            raise RuntimeError("expected stacks to be 'python', or 'all'")
        self.history_devices.append(self.current_device)
        self.record_history = enabled is not None
        self.max_entries = max(1, max_entries if enabled == "all" else 1)
        if self.clears_on_every_call or not self.record_history or clear_history:
            self.trace.clear()

    def record_memory_history_legacy(self, enabled, record_context=True,
                                     trace_alloc_max_entries=1, *rest) -> None:
        self.record_history = bool(enabled)
        self.max_entries = max(1, trace_alloc_max_entries)
        if not enabled or (len(rest) > 2 and rest[2]):
            self.trace.clear()

    def _append(self, entry: dict) -> None:
        if not self.record_history:
            return
        if not self.npu:
            self.clock = max(self.clock + 1.0, time.time_ns() / 1000.0)
            entry["time_us"] = self.clock
        entry.setdefault("frames", [{"filename": "train.py", "line": 7, "name": "step"}])
        self.trace.append(entry)
        del self.trace[:-self.max_entries]

    # --- what the script does on the device
    def alloc(self, size: int) -> int:
        self.allocated += 1
        self.live += size
        self.reserved = max(self.reserved, self.live)
        self.next_addr += 1 << 20
        self._append({"action": "alloc", "addr": self.next_addr, "size": size, "stream": 0})
        return self.next_addr

    def tensor(self, t) -> None:
        """The allocation of ``t``'s storage, as the caching allocator's ``malloc`` records it
        when a device tensor is made (the block's address is the storage's data pointer)."""
        st = t.untyped_storage()
        self.allocated += 1
        self.live += st.nbytes()
        self.reserved = max(self.reserved, self.live)
        self._append({"action": "alloc", "addr": st.data_ptr(), "size": st.nbytes(),
                      "stream": 0})

    def free(self, addr: int, size: int) -> None:
        self.live -= size
        for action in ("free_requested", "free_completed"):
            self._append({"action": action, "addr": addr, "size": size, "stream": 0})

    def oom(self, size: int, *, total: int = 80 << 30, free: int = 1 << 20):
        self._append({"action": "oom", "device_free": free, "size": size, "stream": 0})
        for obs in list(self.observers):
            obs(self.current_device, size, total, free)  # an exception here replaces the OOM
        import torch

        raise torch.OutOfMemoryError(f"tried to allocate {size} bytes")

    # --- bindings
    def snapshot(self, *args) -> dict:
        traces = [[] for _ in range(self.devices)]
        traces[self.current_device] = [dict(e) for e in self.trace]
        return {"segments": [], "device_traces": traces}

    def memory_stats(self, device=None) -> dict:
        return {"allocation.all.allocated": self.allocated,
                "allocated_bytes.all.current": self.live,
                "reserved_bytes.all.current": self.reserved}

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return self.total - self.reserved - self.context, self.total

    def init(self) -> None:
        self.initialized = True
        self.init_env = os.environ.get("CUDA_VISIBLE_DEVICES")

    def device_count(self) -> int:
        if not self.initialized:
            self.count_calls_before_init += 1  # cudaGetDeviceCount runs cuInit
        return self.devices

    def set_device(self, d: int) -> None:
        self.current_device = int(d)


def cuda_allocator(monkeypatch, devices: int = 2) -> StubAllocator:
    """torch 2.13's real ``torch.cuda`` on this CPU build, over a stub allocator."""
    import torch
    import torch.cuda.memory  # noqa: F401

    a = StubAllocator(devices=devices)
    c = torch._C
    for name, fn in {
        "_cuda_record_memory_history": a.record_memory_history,
        "_cuda_record_memory_history_legacy": a.record_memory_history_legacy,
        "_cuda_memorySnapshot": a.snapshot,
        "_cuda_attach_out_of_memory_observer": a.observers.append,
        "_cuda_memoryStats": a.memory_stats,
        "_cuda_init": a.init,
        "_cuda_getDeviceCount": a.device_count,
        "_cuda_getDevice": lambda: a.current_device,
        "_cuda_setDevice": a.set_device,
        "_has_cuda": True,
    }.items():
        monkeypatch.setattr(c, name, fn, raising=False)
    # state the real module has on a CUDA build: libcudart loaded, nothing initialized yet
    monkeypatch.setattr(torch.cuda, "_cudart", types.SimpleNamespace(
        cudaMemGetInfo=a.mem_get_info), raising=False)
    monkeypatch.setattr(torch.cuda, "_initialized", False)
    monkeypatch.setattr(torch.cuda, "_queued_calls", [])
    # NVML's nvmlDeviceGetCount_v2 through ctypes: the device count without cuInit
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: devices)
    return a


def _wheel_cache() -> Path:
    return Path(os.environ.get("SNAPFORENSICS_WHEEL_CACHE")
                or Path.home() / ".cache" / "snapforensics-tests" / "wheels")


def npu_sources(version: str) -> Path:
    """The folder holding the published wheel's ``torch_npu/...`` Python files (fetched once)."""
    dest = _wheel_cache() / f"torch_npu-{version}"
    if all((dest / f).is_file() for f in _npu_files(version)):
        return dest
    py, platform = NPU_RELEASES[version]
    wheels = _wheel_cache() / "downloads"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"torch_npu-{version}-*.whl"))
    if not found:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", f"torch_npu=={version}", "--no-deps",
                 "--only-binary=:all:", "--python-version", py, "--platform", platform,
                 "-d", str(wheels), "-q"], capture_output=True, text=True, timeout=600,
                check=False)
        except (OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"cannot download torch_npu=={version}: {e}")
        found = sorted(wheels.glob(f"torch_npu-{version}-*.whl"))
        if proc.returncode or not found:
            last = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
            pytest.skip(f"cannot download torch_npu=={version}: {last}")
    with zipfile.ZipFile(found[0]) as z:
        for f in _npu_files(version):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            (dest / f).write_bytes(z.read(f))
    return dest


def npu_requires(version: str) -> list[str]:
    """The published wheel's ``Requires-Dist`` lines."""
    npu_sources(version)
    wheel = sorted((_wheel_cache() / "downloads").glob(f"torch_npu-{version}-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [ln.split(":", 1)[1].strip() for ln in text.splitlines()
            if ln.startswith("Requires-Dist:")]


def torch_npu_memory(version: str, monkeypatch, *, devices: int = 2):
    """Import the published ``torch_npu.npu.memory`` of ``version`` over a stub ``torch_npu._C``.
    Returns ``(memory module, StubAllocator)``."""
    import torch
    from torch._utils import _dummy_type

    root = npu_sources(version) / "torch_npu"
    a = StubAllocator(npu=True, clears_on_every_call=True, devices=devices)
    v21 = version.startswith("2.1.")

    def memory_snapshot(*args):
        if v21 and args:  # METH_NOARGS on v2.1
            raise TypeError("_npu_memorySnapshot() takes no arguments (1 given)")
        if not v21 and len(args) != 1:  # METH_O on master
            raise TypeError(f"_npu_memorySnapshot() takes exactly one argument ({len(args)} given)")
        return a.snapshot()

    def record_history(enabled, context, stacks, max_entries):  # the pybind signature
        a.record_memory_history(enabled, context, stacks, max_entries)

    the_memory = NPUDeviceMemories()  # Module.cpp's one global ``NPUDeviceMem memory``

    def get_device_memories(deviceid):  # pybind ``(int deviceid)``: GetDeviceMemories
        if not isinstance(deviceid, int):
            raise TypeError("_npu_getDeviceMemories(): incompatible function arguments")
        # aclrtGetMemInfo(ACL_HBM_MEM) under NPUGuard(deviceid): the whole device's HBM
        the_memory._free, the_memory._total = a.mem_get_info(deviceid)
        return the_memory  # py::return_value_policy::reference: the same object every call

    C = types.ModuleType("torch_npu._C")
    C.__dict__.update(
        _NPUDeviceMemories=NPUDeviceMemories, _npu_getDeviceMemories=get_device_memories,
        _npu_record_memory_history=record_history, _npu_memorySnapshot=memory_snapshot,
        _npu_attach_out_of_memory_observer=a.observers.append, _npu_init=a.init,
        _npu_setDevice=a.set_device, _npu_getDevice=lambda: a.current_device,
        _npu_getDeviceCount=a.device_count, _npu_memoryStats=a.memory_stats)

    pkg = types.ModuleType("torch_npu")
    pkg.__path__ = [str(root)]
    pkg.__file__ = str(root / "__init__.py")  # not loaded: _memory_viz reads its folder
    pkg._C = C
    utils_pkg = types.ModuleType("torch_npu.utils")
    utils_pkg.__path__ = [str(root / "utils")]
    utils_utils = types.ModuleType("torch_npu.utils.utils")
    utils_utils._is_interactive_command_line = lambda: False

    npu = types.ModuleType("torch_npu.npu")  # shell of npu/__init__.py + npu/utils.py
    npu.__path__ = [str(root / "npu")]
    state = {"initialized": False, "queued": []}

    def is_initialized():
        return state["initialized"]

    def _lazy_call(cb):
        if state["initialized"]:
            cb()
        else:
            state["queued"].append(cb)

    def _lazy_init():
        if state["initialized"] or state.get("initializing"):
            return
        C._npu_init()
        state["initializing"] = True
        try:
            for cb in state["queued"]:
                cb()
        finally:
            state.pop("initializing")
        state["initialized"] = True

    def _get_device_index(device, optional=False):
        return a.current_device if device is None else int(device)

    def set_device(device):
        _lazy_init()  # THNPModule_setDevice_wrap: npu_lazy_init() then ExchangeDevice
        C._npu_setDevice(_get_device_index(device))

    def device_count():
        return C._npu_getDeviceCount()

    def current_device():
        _lazy_init()
        return C._npu_getDevice()

    def is_available():
        return C._npu_getDeviceCount() > 0

    npu.__dict__.update(is_initialized=is_initialized, _lazy_call=_lazy_call,
                        is_available=is_available,
                        _lazy_init=_lazy_init, _get_device_index=_get_device_index,
                        set_device=set_device, device_count=device_count, init=_lazy_init,
                        current_device=current_device)
    npu_utils = types.ModuleType("torch_npu.npu.utils")
    npu_utils._dummy_type = _dummy_type
    pkg.npu = npu
    for name, mod in (("torch_npu", pkg), ("torch_npu._C", C), ("torch_npu.utils", utils_pkg),
                      ("torch_npu.utils.utils", utils_utils), ("torch_npu.npu", npu),
                      ("torch_npu.npu.utils", npu_utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch_npu")
    warnings.filterwarnings("ignore", "invalid escape sequence", DeprecationWarning)
    for name in ("torch_npu.npu.memory", "torch_npu.npu._memory_viz",
                 "torch_npu.utils._error_code"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import importlib

    memory = importlib.import_module("torch_npu.npu.memory")
    assert memory.__file__.startswith(str(root)), memory.__file__
    npu.memory = memory
    npu.memory_stats = memory.memory_stats
    # the wheel's own mem_get_info, in a namespace giving what its module would
    err = importlib.import_module("torch_npu.utils._error_code")
    src = _NPU_MEM_GET_INFO[version]
    npu.mem_get_info = real_function(root.parent / src, "mem_get_info", {
        "__name__": "torch_npu.npu" if src.endswith("__init__.py") else "torch_npu.npu.utils",
        "torch_npu": pkg, "_get_device_index": _get_device_index, "device_count": device_count,
        "pta_error": err.pta_error, "ErrCode": err.ErrCode})
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return memory, a


def site_torch_version() -> str:
    import torch

    return f"torch {torch.__version__} ({sysconfig.get_paths()['purelib']})"
