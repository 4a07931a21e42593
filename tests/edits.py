"""Edits of real recordings into shapes our CPU recorder cannot make (each test says it edits).

`cuda_shaped(raw, annotations)`: what a CUDA recording of the same run looks like. On CUDA the
autograd engine runs backward on a device thread: an allocation made by a backward op has no
Python frames at all, and one made inside a hook (FSDP pre/post-backward, the checkpoint unpack
hook) only has the hook's own frames, not `loss.backward()`'s. Profiler op, module and
record_function frames do not exist either; the ranges come as `external_annotations` (or, with
`annotations=False`, not at all). Every stack is cut at the autograd engine boundary and
stripped of non-Python frames, and the recorder's provenance is dropped.

`cuda_all_shaped(raw, annotations)`: the same with torch's `stacks="all"` C++ frames interleaved
(their shapes copied from the corpus's CUDA dumps); `python_only(raw)`: a `stacks="all"` dump's
`stacks="python"` twin.

`edited_corpus_file(name, edit)`: the Diagnosis of a corpus file after `edit(raw)` changed a copy
of its raw dict (skips when the corpus is absent).
"""

from __future__ import annotations

import copy

from corpus import corpus_file

from snapforensics.analysis import diagnose
from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.snapshot import normalize, read_raw

ENGINE = {"_engine_run_backward", "run_backward"}
PSEUDO = ("<op>", "<record_function>", "<nn.Module>", "<snapforensics>")


def cuda_shaped(raw: dict, annotations: bool = True) -> dict:
    cache: dict[int, list] = {}

    def cut(frames):
        if not frames:
            return frames
        key = id(frames)
        if key not in cache:
            names = [f["name"] for f in frames]
            in_bw = any(n in ENGINE for n in names) or any(
                n.startswith("autograd::engine::evaluate_function") for n in names)
            out = []
            for f in frames:  # innermost first; stop at the engine boundary
                if in_bw and (f["name"].startswith("autograd::engine::") or f["name"] in ENGINE):
                    break
                if f["filename"] not in PSEUDO:
                    out.append(f)
            cache[key] = out
        return cache[key]

    for trace in raw["device_traces"]:
        for e in trace:
            if "frames" in e:
                e["frames"] = cut(e["frames"])
    for seg in raw["segments"]:
        seg["frames"] = cut(seg.get("frames"))
        for b in seg["blocks"]:
            b["frames"] = cut(b.get("frames"))
    if not annotations:
        raw.pop("external_annotations", None)
    raw.pop("snapforensics", None)  # look like a foreign file: no provenance
    return raw


def edited_corpus_file(name: str, edit) -> Diagnosis:
    raw, _ = read_raw(corpus_file(name))
    raw = copy.deepcopy(raw)
    edit(raw)
    return diagnose(normalize(raw, source=f"edited-{name}"))


# `stacks="all"`: torch's C++ frames as its symbolizer writes them, copied from real CUDA dumps
# of the corpus (notHanmin_memory_snapshot, bcrafton_memory_snapshot): the unwinder and the
# caching allocator innermost, then the op's dispatch, autograd nodes and the engine, with each
# run of Python frames entered through the interpreter, and the thread's start outermost.
_MALLOC = [("torch::unwind::unwind()", "??"),
           ("torch::CapturedTraceback::gather(bool, bool, bool)", "??"),
           ("torch::cuda::(anonymous namespace)::gather_with_cpp()", "memory_snapshot.cpp"),
           ("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, "
            "unsigned long, CUstream_st*)", "CUDACachingAllocator.cpp"),
           ("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate("
            "unsigned long)", "")]
_FREE = [("torch::unwind::unwind()", "??"),
         ("torch::CapturedTraceback::gather(bool, bool, bool)", "??"),
         ("torch::cuda::(anonymous namespace)::gather_with_cpp()", "memory_snapshot.cpp"),
         ("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::free("
          "c10::cuda::CUDACachingAllocator::Native::(anonymous namespace)::Block*)",
          "CUDACachingAllocator.cpp"),
         ("c10::TensorImpl::~TensorImpl() [clone .localalias]", "TensorImpl.cpp")]
_ENGINE_THREAD = [
    ("torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&, "
     "torch::autograd::Node*, torch::autograd::InputBuffer&, std::shared_ptr<torch::autograd::"
     "ReadyQueue> const&)", "??"),
    ("torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)",
     "??"),
    ("torch::autograd::Engine::thread_init(int, std::shared_ptr<torch::autograd::ReadyQueue> "
     "const&, bool)", "??"),
    ("torch::autograd::python::PythonEngine::thread_init(int, std::shared_ptr<torch::autograd::"
     "ReadyQueue> const&, bool)", "??"),
    ("execute_native_thread_routine", "thread48.o"), ("pthread_condattr_setpshared", "??"),
    ("clone", "??")]
_MAIN_THREAD = [("PyEval_EvalCode", "/usr/local/src/conda/python-3.12.3/Python/ceval.c"),
                ("Py_BytesMain", "/usr/local/src/conda/python-3.12.3/Modules/main.c"),
                ("__libc_start_main", "??"), ("_start", "??")]
_EVAL = ("_PyEval_EvalFrameDefault",
         "/croot/python-split_1715024085344/work/build-static/Python/bytecodes.c")


def cuda_all_shaped(raw: dict, annotations: bool = True) -> dict:
    """`cuda_shaped` with torch's `stacks="all"` C++ frames: its Python frames are exactly those
    of `cuda_shaped(raw)` (torch gathers them the same way for both settings), with the native
    frames a CUDA dump interleaves. An op (`<op>` aten::mm) becomes its dispatcher entry, an
    autograd node (`<op>` MmBackward0) its generated `apply`, and a row cut at the engine
    boundary runs on the engine's device thread."""
    cache: dict[tuple[int, bool], list] = {}

    def native(name: str, file: str) -> dict:
        return {"name": name, "filename": file, "line": 0}

    def grow(frames, free: bool):
        if not frames:
            return frames
        key = (id(frames), free)
        if key in cache:
            return cache[key]
        names = [f["name"] for f in frames]
        in_bw = any(n in ENGINE for n in names) or any(
            n.startswith("autograd::engine::evaluate_function") for n in names)
        out = [native(n, p) for n, p in (_FREE if free else _MALLOC)]
        python = False
        for f in frames:  # innermost first
            name, file = f["name"], f["filename"]
            if in_bw and (name.startswith("autograd::engine::") or name in ENGINE):
                break
            if file == "<op>" and "::" in name:
                out.append(native(f"at::_ops::{name.split('::', 1)[1]}::call(at::Tensor const&)",
                                  "??"))
            elif file == "<op>" and not python:  # an autograd node's own op
                out += [native(f"torch::autograd::generated::{name}::apply(std::vector<at::Tensor,"
                               " std::allocator<at::Tensor> >&&)", "??"),
                        native("torch::autograd::Node::operator()(std::vector<at::Tensor, "
                               "std::allocator<at::Tensor> >&&)", "")]
            elif file not in PSEUDO:
                if not python:
                    out.append(native(*_EVAL))
                python = True
                out.append(dict(f))
        out += [native(n, p) for n, p in (_ENGINE_THREAD if in_bw else _MAIN_THREAD)]
        cache[key] = out
        return out

    for trace in raw["device_traces"]:
        for e in trace:
            if "frames" in e:
                e["frames"] = grow(e["frames"], e["action"].startswith("free"))
    for seg in raw["segments"]:
        seg["frames"] = grow(seg.get("frames"), False)
        for b in seg["blocks"]:
            b["frames"] = grow(b.get("frames"), False)
    if not annotations:
        raw.pop("external_annotations", None)
    raw.pop("snapforensics", None)
    return raw


def python_only(raw: dict) -> dict:
    """What torch's `stacks="python"` would have recorded of a `stacks="all"` dump: its Python
    frames (a `.py` file or a `<frozen ...>` pseudo file), the native ones dropped."""
    cache: dict[int, list] = {}

    def keep(frames):
        if not frames:
            return frames
        if id(frames) not in cache:
            cache[id(frames)] = [f for f in frames if f["filename"].endswith(".py")
                                 or f["filename"].startswith("<")]
        return cache[id(frames)]

    for trace in raw["device_traces"]:
        for e in trace:
            if "frames" in e:
                e["frames"] = keep(e["frames"])
    for seg in raw["segments"]:
        seg["frames"] = keep(seg.get("frames"))
        for b in seg.get("blocks", ()):
            b["frames"] = keep(b.get("frames"))
    return raw


def recording_thread_annotations(raw: dict) -> tuple[dict, int]:
    """What torch 2.5-2.7 keeps of a recording's record_function ranges: before
    `global_record_annotations` (torch 2.8) the allocator's RecordFunction callback is thread
    local (`at::addThreadLocalCallback`, pytorch#153839/#154932), so only ranges opened on the
    thread that started recording are kept. On CUDA the autograd engine runs backward on a
    device thread: every range opened while `backward()` runs (FSDP's pre/post-backward hooks,
    its backward prefetch, the root's final callback, a recompute's pre-forward) is lost. A
    range is dropped when it starts inside a `backward()` call of this CPU recording: between
    the row before its first row under the engine and the row after its last (rows of a
    collective's worker thread, which show no engine frame, do not end the call). Also drops
    `compile_context` (torch 2.8). Returns the edited dict and how many ranges it dropped."""
    trace = raw["device_traces"][0]
    state = []  # per row: 1 under the engine, 0 on the main thread, -1 a worker thread's row
    for e in trace:
        frames = e.get("frames") or ()
        if any(f["name"] in ENGINE for f in frames):
            state.append(1)
        elif frames and all(f["filename"].startswith("<") for f in frames):
            state.append(-1)
        else:
            state.append(0 if frames else -1)
    windows = []
    start = None
    last_main = float("-inf")
    for e, s in zip(trace, state):
        if s == 1 and start is None:
            start = last_main
        elif s == 0:
            if start is not None:
                windows.append((start, e["time_us"]))
                start = None
            last_main = e["time_us"]
    if start is not None:
        windows.append((start, float("inf")))
    kept, dropped, open_dropped = [], 0, {}
    for a in raw.get("external_annotations", ()):
        if a["stage"] == "START" and any(lo < a["time_us"] < hi for lo, hi in windows):
            open_dropped[a["name"]] = open_dropped.get(a["name"], 0) + 1
            dropped += 1
        elif a["stage"] != "START" and open_dropped.get(a["name"]):
            open_dropped[a["name"]] -= 1
        else:
            kept.append(a)
    raw["external_annotations"] = kept
    for t in raw["device_traces"]:
        for e in t:
            e.pop("compile_context", None)
    return raw, dropped


def without_worker_blocks(raw: dict) -> tuple[dict, int]:
    """Drop the blocks a collective backend's worker thread allocated (gloo's staging buffers:
    rows whose only frames are ops under a `gloo:` range, and their frees). NCCL and HCCL
    allocate nothing from the caching allocator on such a thread, so a CUDA recording of the
    same run has no such blocks. Returns the edited dict and how many blocks it dropped."""
    dropped = 0
    for t, trace in enumerate(raw["device_traces"]):
        out, pending = [], set()
        for e in trace:
            frames = e.get("frames") or ()
            if e["action"] == "alloc" and frames and all(
                    f["filename"].startswith("<") for f in frames) and any(
                    f["name"].startswith(("gloo:", "nccl:", "hccl:")) for f in frames):
                pending.add(e["addr"])
                dropped += 1
                continue
            if e["action"] in ("free_requested", "free_completed") and e["addr"] in pending:
                if e["action"] == "free_completed":  # the CPU recorder writes both, in order
                    pending.discard(e["addr"])
                continue
            out.append(e)
        raw["device_traces"][t] = out
    return raw, dropped
