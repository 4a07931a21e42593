"""What a stack says beyond its category: noise frames, the user's own frame, layer repeats.

Used by the stack text of every finding (`is_noise`) and by rules that group blocks by the code
that made them (a layer's repetitions share a key).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from snapforensics.snapshot.model import NO_STACK, Frame

if TYPE_CHECKING:
    from snapforensics.analysis.context import DeviceAnalysis

# Frames that say nothing about what made a block (allocator / interpreter / wrappers).
_NOISE = re.compile(
    r"(^torch::|^c10::|^at::|^_Py|^Py[A-Z]|^_start$|^__libc|^std::|CapturedTraceback|"
    r"^<unknown>$|^\?\?$|^_call_impl$|^_wrapped_call_impl$|^inner$|^_fn$|^wrapper$|"
    r"^decorate_context$)")
_NOISE_FILES = ("torch/nn/modules/module.py", "torch/_dynamo/eval_frame.py", "torch/_compile.py",
                # the recorder's tensor names wrap FSDP2's wait_for_unshard / post_backward
                "snapforensics/record/identity.py")


# A native (C/C++) frame's file, as torch's symbolizer writes it for `stacks="all"`: a source or
# object file, `??` or '' when it has no debug info (`thread48.o`, `RegisterCUDA.cpp`, CPython's
# `Objects/call.c:240`, `libc.so.6`). Python frames name a `.py` file or a `<frozen ...>`-style
# pseudo file; a demangled C++ name (`torch::autograd::Engine::evaluate_function(...)`) is native
# whatever its file (STL headers have no extension).
_NATIVE_FILE = re.compile(r"(\.(c|cc|cpp|cxx|c\+\+|h|hh|hpp|hxx|inl|cu|cuh|o|s)|\.so(\.\d+)*)$",
                          re.IGNORECASE)


def is_native(f: Frame) -> bool:
    """A C/C++ frame (torch's `stacks="all"` interleaves them with the Python frames). Pseudo
    frames (`<op>`, `<record_function>` of CPU recordings) are not: they name what ran."""
    return not f.filename.startswith("<") and (
        "::" in f.name or f.filename in ("", "??") or bool(_NATIVE_FILE.search(f.filename)))


def python_frames(frames: list[Frame]) -> list[Frame]:
    """The frames a `stacks="python"` recording of the same allocation has: torch gathers the
    Python frames the same way for both settings and only adds the native ones for "all"
    (`torch/csrc/profiler/combined_traceback.cpp`), so dropping them gives the python twin."""
    return [f for f in frames if not is_native(f)]


_NATIVE = (".c", ".cc", ".cpp", ".cxx", ".h", ".hpp", ".cu", ".so")


def is_noise(f: Frame) -> bool:
    fn = f.filename.replace("\\", "/")
    return bool(_NOISE.search(f.name)) or fn in ("", "??") or fn.endswith(_NOISE_FILES) or \
        fn.endswith(_NATIVE)


_INSTANCE = re.compile(r"^(.*?)_(\d+)$")


def user_frame(d: DeviceAnalysis, stack_id: int) -> str | None:
    """The innermost frame of the user's own code (not torch, not an op or module marker, not
    the Python module Inductor generated for a compiled graph)."""
    for f in d.snapshot.stack_frames(stack_id):
        fn = f.filename.replace("\\", "/")
        if is_noise(f) or is_native(f) or fn.startswith("<") or "/torch/" in fn \
                or "torchinductor" in fn \
                or fn.startswith("torch/") or "site-packages/" in fn or "/runpy" in fn \
                or f.name == "<module>":
            continue
        return str(f)
    return None


def python_stacks(d: DeviceAnalysis, stacks: np.ndarray) -> np.ndarray:
    """Stack ids made comparable across `stacks="all"` and `"python"`: stacks whose Python frames
    are the same get one id (the first of them), NO_STACK when there is none."""
    uniq, inv = np.unique(stacks, return_inverse=True)
    canon: dict[tuple, int] = {}
    ids = []
    for s in uniq.tolist():
        key = tuple(python_frames(d.snapshot.stack_frames(s))) if s != NO_STACK else ()
        ids.append(canon.setdefault(key, s) if key else NO_STACK)
    return np.array(ids, np.int32)[inv] if len(ids) else np.zeros(0, np.int32)


def generic_keys(d: DeviceAnalysis, stacks: np.ndarray) -> np.ndarray:
    """A key per stack that is the same for every repetition of a layer.

    Code stacks are already identical across layers; recordings that carry `<nn.Module>` frames
    (`Linear_24`, `FSDPBlock_3`) name the instance, so the numeric suffix is dropped.
    """
    uniq, inv = np.unique(stacks, return_inverse=True)
    keys: dict[tuple, int] = {}
    ids = []
    for s in uniq.tolist():
        frames = python_frames(d.snapshot.stack_frames(s)) if s != NO_STACK else []
        key: tuple = tuple((f.filename, _INSTANCE.sub(r"\1", f.name) if f.filename == "<nn.Module>"
                            else f.name, f.line) for f in frames) or ("<no stack>",)
        ids.append(keys.setdefault(key, len(keys)))
    return np.array(ids, np.int64)[inv] if len(ids) else np.zeros(0, np.int64)


def repeated_module(d: DeviceAnalysis, stacks: np.ndarray, repeats: int) -> str | None:
    """The outermost `<nn.Module>` class with exactly `repeats` instances among these stacks."""
    inst: dict[str, set[str]] = {}
    depth: dict[str, int] = {}
    for s in np.unique(stacks).tolist():
        frames = d.snapshot.stack_frames(s)
        for pos, f in enumerate(frames):
            if f.filename != "<nn.Module>":
                continue
            m = _INSTANCE.match(f.name)
            if not m or not m.group(1).isidentifier():
                continue  # the name goes into fix code: a class name or nothing
            inst.setdefault(m.group(1), set()).add(m.group(2))
            depth[m.group(1)] = max(depth.get(m.group(1), 0), pos)
    cands = [c for c, v in inst.items() if len(v) == repeats]
    if not cands:
        return None
    name = max(cands, key=lambda c: depth[c])
    # FSDP2 swaps the class of a sharded module for a dynamic `FSDP<Class>`, replicate() for
    # `Replicate<Class>`
    for prefix in ("FSDP", "Replicate"):
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    return name


def hugging_face(d: DeviceAnalysis) -> bool:
    """The run's frames come from the `transformers` package: its model has HF's own switches
    (`gradient_checkpointing_enable`), which a fix may then lead with."""
    return any("transformers/" in f.filename.replace("\\", "/") for f in d.snapshot.frames)
