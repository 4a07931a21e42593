"""Recording backends: CUDA and NPU allocator history, or the CPU allocator through the profiler.

Each backend is a small object with ``start()`` and ``snapshot() -> dict`` (which also stops
recording), plus ``attach_oom(callback)`` where the device offers an out-of-memory observer.
Everything imports torch lazily: this module is imported by the bootstrap only.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from snapforensics.errors import EXIT_RECORD_FAILED, SnapError

DEVICES = ("auto", "cuda", "npu", "cpu")
STACKS = ("python", "all")


def _npu_available() -> bool:
    """torch_npu imports and reports a device. Any failure means no."""
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception:
        return False
    try:
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception:
        return False


def _cuda_available() -> bool:
    """Whether this machine has a CUDA device, WITHOUT initializing CUDA in this process.

    ``torch.cuda.is_available()`` calls ``cudaGetDeviceCount``, which runs ``cuInit``: the
    driver then reads ``CUDA_VISIBLE_DEVICES`` once (a script setting it later is ignored) and
    processes forked afterwards cannot use CUDA. So: NVML (``nvmlDeviceGetCount``, what
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` uses), else the question is asked in a child process.
    """
    import torch

    try:
        if not torch.backends.cuda.is_built():
            return False
        if torch.cuda.is_initialized():
            return torch.cuda.device_count() > 0
        count = torch.cuda._device_count_nvml()  # -1 when NVML is missing
    except Exception:
        count = -1
    if count >= 0:
        return count > 0
    import subprocess

    try:
        probe = subprocess.run([sys.executable, "-c",
                                "import torch; print(torch.cuda.device_count())"],
                               capture_output=True, text=True, timeout=120, check=False)
        return int(probe.stdout.strip() or 0) > 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return False


def select_backend(device: str, *, cuda_available: Callable[[], bool] = _cuda_available,
                   npu_available: Callable[[], bool] = _npu_available) -> str:
    """``auto`` -> cuda if available, else npu if torch_npu has a device, else cpu.

    An explicit ``cuda``/``npu`` that is not available is a user error (SnapError).
    """
    if device not in DEVICES:
        raise SnapError(f"unknown --device {device!r} (choose from {', '.join(DEVICES)})",
                        exit_code=EXIT_RECORD_FAILED)
    if device == "cpu":
        return "cpu"
    if device == "cuda":
        if not cuda_available():
            raise SnapError("--device cuda: no CUDA device on this machine "
                            "(use --device cpu to record the CPU allocator)",
                            exit_code=EXIT_RECORD_FAILED)
        return "cuda"
    if device == "npu":
        if not npu_available():
            raise SnapError("--device npu: torch_npu is not importable or has no device "
                            "(use --device cpu to record the CPU allocator)",
                            exit_code=EXIT_RECORD_FAILED)
        return "npu"
    if cuda_available():
        return "cuda"
    if npu_available():
        return "npu"
    return "cpu"


_CORE = ("context", "stacks", "max_entries")  # accepted by every 2.x wrapper, torch and torch_npu


def _accepted(fn: Callable) -> tuple[set[str] | None, bool]:
    """The keyword names ``fn`` really binds, and whether it is the legacy boolean form.

    ``fn(enabled="all", *args, **kwargs)`` (torch_npu 2.x; torch before it set ``__signature__``)
    hands everything to ``_record_memory_history_impl`` of its own module, which raises on a
    keyword it lacks: that function's parameters are the ones that count. None when unknown.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None, False
    names = set(params)
    if names - {"enabled"} <= {"args", "kwargs"}:
        impl = getattr(fn, "__globals__", {}).get("_record_memory_history_impl")
        if impl is None:
            return None, False
        try:
            names = set(inspect.signature(impl).parameters)
        except (TypeError, ValueError):
            return None, False
    return names, "trace_alloc_max_entries" in names and "max_entries" not in names


def history_call(fn: Callable, *, stacks: str, max_entries: int,
                 annotations: bool = True) -> tuple[tuple, dict]:
    """The (args, kwargs) to start allocator history with ``fn`` = ``_record_memory_history``.

    Only keywords the real implementation accepts (``global_record_annotations`` exists from
    torch 2.8 and in no torch_npu); the legacy boolean form for torch < 2.1.
    """
    wanted = {"context": "all", "stacks": stacks, "max_entries": max_entries}
    if annotations:
        wanted["global_record_annotations"] = True
        wanted["compile_context"] = True  # torch.compile regions per entry (torch 2.8+)
    names, legacy = _accepted(fn)
    if names is None:
        return ("all",), {k: wanted[k] for k in _CORE}
    if legacy:
        kwargs: dict[str, Any] = {"trace_alloc_max_entries": max_entries,
                                  "trace_alloc_record_context": True}
        if "record_context_cpp" in names:
            kwargs["record_context_cpp"] = stacks == "all"
        return (True,), kwargs
    return ("all",), {k: v for k, v in wanted.items() if k in names}


class _ScriptHistoryCalls:
    """The script's own ``_record_memory_history`` calls, kept off the recording.

    Both torch's and torch_npu's C++ clear the trace buffer on such a call (torch: disabling,
    or ``clear_history``; torch_npu: every call), so a script doing what PyTorch's memory blog
    shows (enable with ``max_entries=100000``, later ``enabled=None``) would empty the recording.
    The C bindings (``torch._C._cuda_record_memory_history[_legacy]``,
    ``torch_npu._C._npu_record_memory_history``) are wrapped: the recorder's own calls pass,
    the script's are not forwarded (the recording keeps every entry, and the script's own
    ``_snapshot()``/``_dump_snapshot()`` still get it), each is listed in the provenance and the
    first is named on stderr in one line.
    """

    def __init__(self, module: Any, names: tuple[str, ...]) -> None:
        self.module = module
        self.originals: dict[str, Callable] = {}
        self.calls: list[str] = []
        self.own = 0
        for name in names:
            orig = getattr(module, name, None)
            if orig is not None:
                self.originals[name] = orig
                setattr(module, name, self._wrap(name, orig))

    def _wrap(self, name: str, orig: Callable) -> Callable:
        def binding(*args: Any, **kwargs: Any) -> Any:
            if self.own:
                return orig(*args, **kwargs)
            what = f"_record_memory_history(enabled={args[0] if args else None!r}"
            if args and args[0] and len(args) > 3 and "legacy" not in name:
                what += f", max_entries={args[3]!r}"
            what += f") at {_caller()}"
            self.calls.append(what)
            if len(self.calls) == 1:
                print(f"snapforensics record: the script called {what}; not applied while "
                      "recording (the recording keeps every entry)", file=sys.stderr, flush=True)
            return None

        binding.__wrapped__ = orig  # type: ignore[attr-defined]
        return binding

    @contextlib.contextmanager
    def passing(self):
        self.own += 1
        try:
            yield
        finally:
            self.own -= 1

    def remove(self) -> None:
        for name, orig in self.originals.items():
            setattr(self.module, name, orig)
        self.originals = {}


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch, torch_npu and this package."""
    skip = (os.sep + "torch" + os.sep, os.sep + "torch_npu" + os.sep,
            os.sep + "snapforensics" + os.sep + "record" + os.sep)
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if not any(s in fn for s in skip):
            return f"{os.path.basename(fn)}:{f.f_lineno}"
        f = f.f_back
    return "?"


class DeviceMemory:
    """What the device itself says is in use, beside what the caching allocator reserved, at
    the start, after every optimizer step and at the stop: the gap is memory PyTorch's
    allocator cannot see (the CUDA/CANN context, NCCL/HCCL communicators' buffers,
    cuBLAS/cuDNN workspaces, other processes on the device). ``mem_get_info`` is
    ``cudaMemGetInfo`` (torch/csrc/cuda/shared/cudart.cpp: free and total of the whole device,
    every process), ``memory_reserved`` the allocator's ``reserved_bytes.all.current``. At most
    MAX samples (a long run keeps its first ones and the last); a failing call is said once.

    The step boundaries come from the recorder's own optimizer post hook (``_StepWindow``,
    registered before the script runs, calling ``step_ended``): a hook registered here, at the
    start, would be added to torch's hook dict while torch iterates over it when ``--steps A:B``
    starts recording in step A-1's post hook ("OrderedDict mutated during iteration", the
    script's error), and removed from it the same way at step B-1."""

    MAX = 4096

    def __init__(self, backend: CudaBackend) -> None:
        self.backend = backend
        self.samples: list[dict] = []
        self.error: str | None = None
        self.on = False

    def start(self) -> None:
        self.on = True
        self.sample("start")

    def step_ended(self, step: int) -> None:
        if self.on:
            self.sample(step)

    def sample(self, step: int | str) -> None:
        if self.error is not None and not self.samples:
            return
        try:
            dev, mem = self.backend._device(), self.backend._memory()
            free, total = dev.mem_get_info()
            row = {"step": step, "used_bytes": int(total) - int(free), "total_bytes": int(total),
                   "reserved_bytes": int(mem.memory_reserved()),
                   "allocated_bytes": int(mem.memory_allocated())}
        except Exception as e:  # never the script's error
            self.error = self.error or f"{type(e).__name__}: {e}"
            return
        if len(self.samples) >= self.MAX:
            self.samples[-1] = row
        else:
            self.samples.append(row)

    def stop(self) -> dict:
        if self.on:
            self.sample("end")
            self.on = False
        return {"samples": self.samples, "error": self.error}


class CudaBackend:
    """The CUDA caching allocator's history (``torch.cuda.memory``).

    Nothing touches CUDA before the script does: when CUDA is not initialized yet, the start
    is queued with ``torch.cuda._lazy_call`` and runs inside the script's first CUDA
    initialization (after its own ``CUDA_VISIBLE_DEVICES``, in the process that uses it).
    """

    name = "cuda"
    _bindings = ("_cuda_record_memory_history", "_cuda_record_memory_history_legacy")

    def __init__(self, stacks: str, max_entries: int, local_rank: int | None = None):
        self.stacks = stacks
        self.max_entries = max_entries
        self.local_rank = local_rank
        self._taken: dict | None = None
        self._guard: _ScriptHistoryCalls | None = None
        self.started = False  # history is on (the script initialized the device)
        self.start_error: str | None = None
        self._oom_fired = False
        self.device_memory = DeviceMemory(self)
        self.names: Any = None  # tensor identity (identity.py), from start() to stop()
        if stacks == "all":  # C++ frames: torch's in-process symbolizer, not one addr2line each
            os.environ.setdefault("TORCH_SYMBOLIZE_MODE", "fast")

    def _memory(self):
        import torch.cuda.memory

        return torch.cuda.memory

    def _device(self):
        import torch

        return torch.cuda

    def _c(self):
        import torch

        return torch._C

    def start(self) -> None:
        if self._guard is None:
            self._guard = _ScriptHistoryCalls(self._c(), self._bindings)
        self.names = _start_names()
        dev = self._device()
        if dev.is_initialized():
            self._start_now()
        else:
            dev._lazy_call(self._start_now)

    def _start_now(self) -> None:
        """Runs inside the device's lazy initialization: never raises (an error here would
        become the script's error)."""
        try:
            dev = self._device()
            if self.local_rank is not None and self.local_rank < dev.device_count():
                dev.set_device(self.local_rank)  # each rank on its own device
            mem = self._memory()
            args, kwargs = history_call(mem._record_memory_history, stacks=self.stacks,
                                        max_entries=self.max_entries)
            assert self._guard is not None
            with self._guard.passing():
                mem._record_memory_history(*args, **kwargs)
            self.started = True
            self.device_memory.start()
        except Exception as e:  # reported with the snapshot; the script goes on
            self.start_error = f"{type(e).__name__}: {e}"
            print(f"snapforensics record: cannot start {self.name} recording: "
                  f"{self.start_error}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Stop recording now: the history so far is taken for ``snapshot()``."""
        if self._taken is not None:
            return
        names, self.names = self.names, None
        _stop_names(names)
        if not self.started:
            self._taken = {"segments": [], "device_traces": []}
        else:
            samples = self.device_memory.stop()
            mem = self._memory()
            self._taken = _as_dict(mem._snapshot())
            try:
                assert self._guard is not None
                with self._guard.passing():
                    mem._record_memory_history(None)
            except Exception:
                pass
            self._taken.setdefault("snapforensics", {})["device_memory"] = samples
            _attach_names(self._taken, names)
        if self._guard is not None:
            self._taken.setdefault("snapforensics", {})["script_history_calls"] = list(
                self._guard.calls)
            self._guard.remove()

    def snapshot(self) -> dict:
        self.stop()
        snap, self._taken = self._taken, None
        assert snap is not None
        return snap

    def step_ended(self, step: int) -> None:
        """An optimizer step ended (the recorder's post hook; ``step`` counts from the
        script's start)."""
        self.device_memory.step_ended(step)

    def allocations(self) -> int | None:
        """How many blocks the allocator handed out in this process (its own counter, which no
        history call resets), None when unknown or the device was never used."""
        if not self.started:
            return None
        try:
            return int(self._device().memory_stats().get("allocation.all.allocated", 0))
        except Exception:
            return None

    def _oom_attach(self):
        return getattr(self._c(), "_cuda_attach_out_of_memory_observer", None)

    def attach_oom(self, callback: Callable[[dict], None]) -> bool:
        """``callback(info)`` at the first OOM only, ``info["snapshot"]`` taken right then.

        The C++ calls the observer inside the failing allocation, with the allocator unlocked,
        as ``(device, alloc_size, allowed_memory_maximum or device_total, device_free)`` and
        turns an exception raised by it into the allocation's error: so the observer returns at
        once after the first OOM (a batch-size finder catching OOMs pays nothing) and swallows
        everything, so that the OOM stays the error.
        """
        attach = self._oom_attach()
        if attach is None:
            return False

        def observer(device, alloc_size, device_limit, device_free):
            if self._oom_fired:
                return
            self._oom_fired = True
            try:
                info = {"device": device, "requested_bytes": alloc_size,
                        "device_total_or_allowed_max_bytes": device_limit,
                        "device_free_bytes": device_free,
                        "snapshot": _attach_names(_as_dict(self._memory()._snapshot()),
                                                  self.names)}
                callback(info)
            except BaseException as e:  # never replace the OOM with our own error
                try:
                    print(f"snapforensics record: OOM snapshot failed: {type(e).__name__}: {e}",
                          file=sys.stderr, flush=True)
                except BaseException:
                    pass

        attach(observer)
        return True


class NpuBackend(CudaBackend):
    """torch_npu's caching allocator, through ``torch_npu.npu.memory`` (the same API as CUDA's
    but for its signatures, read by ``history_call``). Each rank sets its own NPU
    (``LOCAL_RANK``) before the history call initializes the device."""

    name = "npu"
    _bindings = ("_npu_record_memory_history",)

    def _memory(self):
        import torch_npu.npu.memory  # type: ignore[import-not-found]

        return torch_npu.npu.memory

    def _device(self):
        import torch_npu.npu  # type: ignore[import-not-found]

        return torch_npu.npu

    def _c(self):
        import torch_npu  # type: ignore[import-not-found]

        return torch_npu._C

    def _oom_attach(self):
        return getattr(self._c(), "_npu_attach_out_of_memory_observer", None)


class CpuBackend:
    """The CPU allocator, through ``torch.profiler`` (memory events with Python stacks)."""

    name = "cpu"

    def __init__(self, stacks: str, max_entries: int):
        self.stacks = stacks  # no C++ frames on this path: recorded in provenance only
        self.max_entries = max_entries
        self._prof = None
        self._untraced: Any = None  # imports run untraced while recording (_untraced.py)
        self._stopped = None  # the profiler after stop(), converted by snapshot()
        self.names: Any = None  # tensor identity (identity.py), from start() to stop()
        self._names_done: Any = None
        self.timings: dict[str, float] = {}
        # The profiler records allocator events only on threads it traces: a tensor freed on a
        # gloo worker thread has no free event (profile_all_threads=True drops every memory event
        # in torch 2.13). The allocator's process-wide accounting sees it, and every recorded
        # event carries that total: cpu.py recovers the lost frees from it, and the bytes of
        # blocks allocated before recording started (--steps). On from here to the dump.
        self._accounting = _cpu_allocator_accounting(True)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        from snapforensics.record import cpu  # noqa: F401  (import now, sys.path may change)
        from snapforensics.record._untraced import UntracedImports

        _warm_imports()
        self._untraced = UntracedImports()
        self._untraced.prepare()
        self.names = _start_names()  # its hooks are set before the profiler traces
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             with_stack=True, record_shapes=False)
        with _profiler_log_filtered():
            self._prof.__enter__()
        self._untraced.install()

    def stop(self) -> None:
        """Stop recording now (the conversion waits for ``snapshot()``)."""
        import time

        prof, self._prof = self._prof, None
        if prof is None:
            return
        self._names_done, self.names = self.names, None
        _stop_names(self._names_done)
        if self._untraced is not None:
            self._untraced.remove()
            self.timings["imports_untraced"] = self._untraced.imports
        t0 = time.perf_counter()
        with _profiler_log_filtered():
            prof.__exit__(None, None, None)
        self.timings["profiler_stop_s"] = round(time.perf_counter() - t0, 3)
        self._stopped = prof

    def snapshot(self) -> dict:
        import time

        from snapforensics.record.cpu import profile_to_snapshot

        self.stop()
        _cpu_allocator_accounting(self._accounting)
        prof, self._stopped = self._stopped, None
        if prof is None:
            raise RuntimeError("CPU recording was not started")
        t1 = time.perf_counter()
        names, self._names_done = self._names_done, None
        # a storage the tensor names saw alive at some moment was not freed before it
        seen = [(ptr, round(t_us * 1000)) for ptr, _, _, t_us, _ in names.obs] \
            if names is not None else None
        snap = profile_to_snapshot(prof, self.max_entries, seen)
        self.timings["convert_s"] = round(time.perf_counter() - t1, 3)
        return _attach_names(snap, names)

    def attach_oom(self, callback: Callable[[dict], None]) -> bool:
        return False

    def step_ended(self, step: int) -> None:
        pass  # no device beside the allocator to sample

    def allocations(self) -> int | None:
        return None


# Kineto writes these on fd 2 at every profiler start/stop (USDT:/STAGE: lines, not
# controlled by KINETO_LOG_LEVEL): noise for someone recording a training script.
_PROFILER_NOISE = re.compile(rb"^(USDT|STAGE):\S* \S+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def _profiler_log_filtered():
    """fd 2 goes to a temp file while the profiler starts or stops; what is not kineto's
    start/stop log is written back to stderr (another thread's output is delayed, not lost)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True)
                    if not _PROFILER_NOISE.match(line)]
            if kept:
                os.write(2, b"".join(kept))


def _cpu_allocator_accounting(on: bool) -> bool:
    """Set c10's ``caffe2_report_cpu_memory_usage`` flag (the CPU allocator then keeps its byte
    count on every thread, not only on threads the profiler traces); returns the previous value.
    The flag is an exported global of libc10 with no Python binding. False when it is missing."""
    import ctypes

    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):
        return False
    previous = bool(flag.value)
    flag.value = bool(on)
    return previous


# Importing these under the profiler's Python tracer costs seconds and records nothing useful
# (import-time allocations are tiny), so they are imported before profiling starts.
_WARM = ("torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
         "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "torch.utils.checkpoint",
         "torch.optim", "torch.nn.parallel")


def _warm_imports() -> None:
    import importlib

    import torch

    if not (hasattr(torch, "distributed") and torch.distributed.is_available()):
        names = [n for n in _WARM if not n.startswith("torch.distributed")]
    else:
        names = list(_WARM)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            pass


def _start_names() -> Any:
    """The tensor-identity tracker (identity.py), started; None when off or it cannot start."""
    from snapforensics.record import identity

    if not identity.enabled():
        return None
    names = identity.TensorNames()
    try:
        names.start()
    except Exception as e:  # never the script's error: the recording goes on unnamed
        print(f"snapforensics record: tensor names are off: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        _stop_names(names)
        return None
    return names


def _stop_names(names: Any) -> None:
    if names is not None:
        try:
            names.stop()
        except Exception:
            pass


def _attach_names(snap: dict, names: Any) -> dict:
    """The recorder's extras at the dump: tensor names, and Inductor's generated code mapped
    to the model's source (identity.attach)."""
    from snapforensics.record import identity

    return identity.attach(snap, names)


BACKENDS = {"cuda": CudaBackend, "npu": NpuBackend, "cpu": CpuBackend}


def make_backend(name: str, stacks: str, max_entries: int, local_rank: int | None = None):
    """``local_rank``: the device this rank uses (CUDA/NPU), None to leave it to the script."""
    if name == "cpu":
        return CpuBackend(stacks, max_entries)
    return BACKENDS[name](stacks, max_entries, local_rank)


def _as_dict(snap: Any) -> dict:
    """``_snapshot()`` returns a dict; a bare segment list (very old torch) is wrapped."""
    if isinstance(snap, dict):
        return snap
    return {"segments": list(snap), "device_traces": []}
