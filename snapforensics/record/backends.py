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
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:
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
            raise SnapError("--device cuda: torch.cuda.is_available() is False on this machine "
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


def history_call(fn: Callable, *, stacks: str, max_entries: int,
                 annotations: bool = True) -> tuple[tuple, dict]:
    """The (args, kwargs) to start allocator history with ``fn`` = ``_record_memory_history``.

    Keeps only the keywords ``fn`` accepts (older torch lacks ``global_record_annotations``,
    torch_npu lacks it too); falls back to the legacy boolean form when ``fn`` only knows
    ``trace_alloc_max_entries`` (torch < 2.1).
    """
    wanted = {"context": "all", "stacks": stacks, "max_entries": max_entries}
    if annotations:
        wanted["global_record_annotations"] = True
        wanted["compile_context"] = True  # torch.compile regions per entry (torch 2.8+)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the documented core set
        return ("all",), {k: v for k, v in wanted.items() if k != "global_record_annotations"}
    names = set(params)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "trace_alloc_max_entries" in names and "max_entries" not in names:
        kwargs = {"trace_alloc_max_entries": max_entries, "trace_alloc_record_context": True}
        if "record_context_cpp" in names:
            kwargs["record_context_cpp"] = stacks == "all"
        return (True,), kwargs
    if var_kw and names <= {"enabled", "args", "kwargs"}:
        return ("all",), wanted
    return ("all",), {k: v for k, v in wanted.items() if k in names}


class CudaBackend:
    name = "cuda"

    def __init__(self, stacks: str, max_entries: int):
        self.stacks = stacks
        self.max_entries = max_entries
        self._taken: dict | None = None

    def _memory(self):
        import torch.cuda.memory

        return torch.cuda.memory

    def start(self) -> None:
        mem = self._memory()
        args, kwargs = history_call(mem._record_memory_history, stacks=self.stacks,
                                    max_entries=self.max_entries)
        mem._record_memory_history(*args, **kwargs)

    def stop(self) -> None:
        """Stop recording now: the history so far is taken for ``snapshot()``."""
        if self._taken is None:
            mem = self._memory()
            self._taken = _as_dict(mem._snapshot())
            try:
                mem._record_memory_history(None)
            except Exception:
                pass

    def snapshot(self) -> dict:
        self.stop()
        snap, self._taken = self._taken, None
        return snap

    def _oom_attach(self):
        import torch

        return getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)

    def attach_oom(self, callback: Callable[[dict], None]) -> bool:
        attach = self._oom_attach()
        if attach is None:
            return False

        def observer(device, alloc, device_alloc, device_free):
            callback({"device": device, "requested": alloc, "device_allocated": device_alloc,
                      "device_free": device_free, "snapshot": _as_dict(self._memory()._snapshot())})

        attach(observer)
        return True


class NpuBackend(CudaBackend):
    """torch_npu mirrors the CUDA API under ``torch_npu.npu.memory``. Written to that contract;
    not exercised here (no Ascend runtime)."""

    name = "npu"

    def _memory(self):
        import torch_npu.npu.memory  # type: ignore[import-not-found]

        return torch_npu.npu.memory

    def _oom_attach(self):
        try:
            import torch_npu  # type: ignore[import-not-found]
        except Exception:
            return None
        return getattr(getattr(torch_npu, "_C", None), "_npu_attach_out_of_memory_observer", None)


class CpuBackend:
    """The CPU allocator, through ``torch.profiler`` (memory events with Python stacks)."""

    name = "cpu"

    def __init__(self, stacks: str, max_entries: int):
        self.stacks = stacks  # no C++ frames on this path: recorded in provenance only
        self.max_entries = max_entries
        self._prof = None
        self._stopped = None  # the profiler after stop(), converted by snapshot()
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

        _warm_imports()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             with_stack=True, record_shapes=False)
        with _profiler_log_filtered():
            self._prof.__enter__()

    def stop(self) -> None:
        """Stop recording now (the conversion waits for ``snapshot()``)."""
        import time

        prof, self._prof = self._prof, None
        if prof is None:
            return
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
        snap = profile_to_snapshot(prof, self.max_entries)
        self.timings["convert_s"] = round(time.perf_counter() - t1, 3)
        return snap

    def attach_oom(self, callback: Callable[[dict], None]) -> bool:
        return False


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


BACKENDS = {"cuda": CudaBackend, "npu": NpuBackend, "cpu": CpuBackend}


def make_backend(name: str, stacks: str, max_entries: int):
    return BACKENDS[name](stacks, max_entries)


def _as_dict(snap: Any) -> dict:
    """``_snapshot()`` returns a dict; a bare segment list (very old torch) is wrapped."""
    if isinstance(snap, dict):
        return snap
    return {"segments": list(snap), "device_traces": []}
