"""Imports run untraced while the CPU profiler's Python tracer is on (issue 29, item 0).

The profiler's tracer (``with_stack=True``) is a C-level profile function set on each thread
with ``PyEval_SetProfile``; it records every Python call, and the profiler's stop turns each one
into an event object. A script importing a large library inside a function (``transformers``;
also its lazy modules on first attribute access) made millions of such calls that allocate
nothing: 6-7 GB per rank and a 902 s stop. So, while recording, ``importlib._bootstrap.
_find_and_load`` (what both the ``import`` statement and ``importlib.import_module`` call for a
module not yet in ``sys.modules``) is wrapped: on a thread where the tracer is set, the tracer is
taken off for the outermost import and put back when it returns, so the tracer sees one call
(the wrapper) per import and the cost no longer depends on what the script imports. Allocations
made by an import keep their ops but lose the Python frames inside the import.

The profile function's address is not exported by torch: it is read from the thread state,
whose field offsets are found at install time by setting a known function and object with
``PyEval_SetProfile`` and looking for them (no per-version struct layout). Where that fails,
nothing is wrapped and imports stay traced, as before; ``SNAPFORENSICS_TRACE_IMPORTS=1`` does
the same on purpose (benchmarks/bench_record_rss.py measures both in one run).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

_WORDS = 64  # the profile fields sit in the thread state's first words on CPython 3.9-3.13
_PROFILE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_void_p)


@_PROFILE_FN
def _probe(obj, frame, what, arg):  # pragma: no cover - set for an instant, never called
    return 0


def _api():
    api = ctypes.pythonapi
    api.PyThreadState_Get.restype = ctypes.c_void_p
    api.PyEval_SetProfile.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    api.PyEval_SetProfile.restype = None
    return api


def _find_offset() -> int | None:
    """The index of ``c_profilefunc`` among the thread state's words, None when not found (or
    a profiler is already set: nothing is changed then)."""
    if sys.getprofile() is not None:
        return None
    api = _api()
    marker = object()
    fn = ctypes.cast(_probe, ctypes.c_void_p).value
    api.PyEval_SetProfile(fn, id(marker))
    try:
        words = (ctypes.c_void_p * _WORDS).from_address(api.PyThreadState_Get())
        at = [i for i, w in enumerate(words) if w == fn]
        seen = sys.getprofile() is marker
    finally:
        api.PyEval_SetProfile(None, None)
    return at[0] if len(at) == 1 and seen else None


class UntracedImports:
    """``install()`` after the profiler started, ``remove()`` before it stops."""

    def __init__(self) -> None:
        self.offset: int | None = None
        self.original: Any = None
        self.imports = 0  # outermost imports run untraced (reported in the timings)

    def prepare(self) -> None:
        """Before the profiler starts (its tracer must not be set yet)."""
        if (threading.current_thread() is threading.main_thread()
                and os.environ.get("SNAPFORENSICS_TRACE_IMPORTS") != "1"):
            try:
                self.offset = _find_offset()
            except (AttributeError, OSError, ValueError):
                self.offset = None

    def install(self) -> None:
        if self.offset is None or self.original is not None:
            return
        import importlib._bootstrap as bootstrap

        api, offset, original = _api(), self.offset, bootstrap._find_and_load

        def _find_and_load(name, import_):
            obj = sys.getprofile()
            if obj is None:  # not traced here, or an outer import already took it off
                return original(name, import_)
            fn = (ctypes.c_void_p * _WORDS).from_address(api.PyThreadState_Get())[offset]
            api.PyEval_SetProfile(None, None)
            self.imports += 1
            try:
                return original(name, import_)
            finally:
                api.PyEval_SetProfile(fn, id(obj))

        self.original = original
        bootstrap._find_and_load = _find_and_load  # type: ignore[assignment]

    def remove(self) -> None:
        if self.original is None:
            return
        import importlib._bootstrap as bootstrap

        bootstrap._find_and_load = self.original  # type: ignore[assignment]
        self.original = None
