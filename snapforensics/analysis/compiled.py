"""Which torch.compile graph made each block: its region, forward or backward, and the source.

Forward: c10 writes each allocation's `compile_context` (`Trace.compile_context`), the
`Torch-Compiled Region: F/C` range Dynamo's eval-frame opens around the compiled frame's code,
so a block made there belongs to region `F/C`.

Backward: AOTAutograd's compiled backward runs from the autograd engine
(`CompiledFunctionBackward`, `CompiledFunction.backward` in `_functorch/_aot_autograd/`), not
from Dynamo's frame, so c10 has no region open there and writes "N/A" (on CUDA and in the CPU
recorder alike). What ties a backward to its region is what it consumes: the graph frees the
activations its forward saved (`ctx.maybe_clear_saved_tensors()`, then the graph's own `del`s),
and those were made inside the forward's region. So each run of consecutive compiled-backward
rows (one graph's call; a change of graph code, `<eval_with_key>.N` or Inductor's module,
starts another) takes the region whose forward-made blocks it frees the most bytes of. A call
that frees none takes the region of other calls of the same graph code; else it stays unknown.

The source of a region is the user's function Dynamo compiled: the innermost frame of the
user's own code (not torch, not a library, not generated graph code) in its forward rows'
stacks, the most frequent by bytes.

Inductor's buffers: a block allocated by Inductor's generated module (its innermost frame in a
file the recorder's map names, `snapshot/graph_code.py`) gets the buffer that line binds
(`buf3`) and the model source line its FX node came from (the node's stack trace, as torch's
`PyCodeCache.stack_frames_for_code` gives it): the innermost frame outside torch, e.g.
`forward  model.py:57: h = F.gelu(self.fc1(x))`. A dump made without the recorder has no map:
its compiled blocks keep their region, pass and source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from snapforensics.analysis.stacks import is_native, is_noise, user_frame
from snapforensics.snapshot.model import NO_STACK, A

if TYPE_CHECKING:
    from snapforensics.analysis.context import DeviceAnalysis

REGION = "Torch-Compiled Region: "
UNKNOWN = "?"  # a compiled backward whose region nothing in the trace says
_AOT = "_functorch/_aot_autograd/"
# eager code a compiled backward calls back into: the recompute of a checkpointed region (its
# saved-tensor unpack hook), which makes its own rows
_EAGER_FILES = ("torch/utils/checkpoint.py",)
# AOTAutograd compiles a backward graph lazily, on its first call, under its backward frames:
# what the compiler allocates there (Inductor's fake-tensor propagation, constants) is not the
# graph's
_COMPILING = {"get_or_compile"}
_AOT_BACKWARD = {"backward", "_backward_impl", "call_compiled_backward", "_backward_prologue"}
# generated graph code: FX's `<eval_with_key>.N` (aot_eager, and every FX graph module), and the
# Python module Inductor writes per graph (`/tmp/torchinductor_<user>/xx/cxxxx.py`)
_GRAPH_FILE = re.compile(r"^<eval_with_key>|torchinductor")


def _is_backward(frames) -> bool:
    """The row ran in a compiled backward graph: walking out from the allocation, AOTAutograd's
    backward comes before any eager code the graph called back into (a checkpoint's recompute
    from a saved-tensor unpack hook, a module, the user's own code) and before the compiler
    that makes the graph on its first call."""
    for f in frames:
        fn = f.filename.replace("\\", "/")
        if f.name == "CompiledFunctionBackward" or (f.name in _AOT_BACKWARD and _AOT in fn):
            return True
        if f.name in _COMPILING and _AOT in fn:
            return False  # the lazy compile of the backward graph on its first call
        if fn.endswith(_EAGER_FILES) or (fn == "<nn.Module>" and not
                                         f.name.startswith("GraphModule")) or \
                (not fn.startswith("<") and "torch/" not in fn and not _GRAPH_FILE.search(fn)
                 and "site-packages/" not in fn and not is_native(f) and not is_noise(f)):
            return False
    return False


def _any_compiled_backward(snap) -> bool:
    """Whether any frame of the file is AOTAutograd's backward (once per file, cached)."""
    got = getattr(snap, "_compiled_backward", None)
    if got is None:
        got = any(f.name == "CompiledFunctionBackward" or
                  (f.name in _AOT_BACKWARD and _AOT in f.filename.replace("\\", "/"))
                  for f in snap.frames)
        object.__setattr__(snap, "_compiled_backward", got)
    return got


def _graph_code(frames) -> str | None:
    """The generated graph the row ran in (innermost), or None."""
    return next((f.filename for f in frames if _GRAPH_FILE.search(f.filename)), None)


@dataclass
class Compiled:
    """Per block of one device (`lt` order): its region (index into `regions`, -1 eager) and
    whether the region's compiled backward made it."""

    regions: list[str]  # "F/C" (the compile id), or UNKNOWN
    region: np.ndarray  # int32 per block, -1 when made outside every compiled graph
    backward: np.ndarray  # bool per block
    source: list[str | None]  # per region: the user's function Dynamo compiled
    backward_calls: int  # runs of compiled-backward rows
    attributed_calls: int  # of them, tied to a region
    # Inductor's buffers (the recorder's map): per block the buffer its generated line binds
    # and the model source line its node came from (indexes into buffers / lines, -1: none)
    buffers: list[str] = field(default_factory=list)
    buffer: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    lines: list[str] = field(default_factory=list)
    line: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


def attribute(d: DeviceAnalysis) -> Compiled | None:
    """Each block's compiled region, or None when no row of this device ran compiled code."""
    t, lt, snap = d.trace, d.lt, d.snapshot
    n = len(t)
    if not n or not t.compile_context and not _any_compiled_backward(snap):
        return None  # an eager run: nothing to walk (the frame table is read once per file)
    # per distinct stack: does it run a compiled backward, and in which graph code
    uniq, inv = np.unique(t.stack, return_inverse=True)
    bw_of = np.zeros(len(uniq), bool)
    codes: dict[str, int] = {}
    code_of = np.full(len(uniq), -1, np.int32)
    for i, s in enumerate(uniq.tolist()):
        if s == NO_STACK:
            continue
        frames = snap.stack_frames(s)
        bw_of[i] = _is_backward(frames)
        g = _graph_code(frames)
        if g is not None:
            code_of[i] = codes.setdefault(g, len(codes))
    if not t.compile_context and not bw_of.any():
        return None

    # forward: the row's region from compile_context
    names: dict[str, int] = {}
    fwd = np.full(n, -1, np.int32)
    for row, ctx in t.compile_context.items():
        if 0 <= row < n:
            fwd[row] = names.setdefault(ctx[len(REGION):] if ctx.startswith(REGION) else ctx,
                                        len(names))
    regions = list(names)

    # backward: runs of consecutive compiled-backward rows outside every region, split where
    # the graph code changes
    is_bw = bw_of[inv] & (fwd < 0)
    code = code_of[inv]
    rows = np.flatnonzero(is_bw)
    call = np.full(n, -1, np.int64)
    calls = 0
    if len(rows):
        gap = np.diff(rows) != 1
        rc = code[rows]
        changed = (rc[1:] != rc[:-1]) & (rc[1:] >= 0) & (rc[:-1] >= 0)
        starts = np.concatenate(([True], gap | changed))
        call[rows] = np.cumsum(starts) - 1
        calls = int(starts.sum())

    # each call's region: the forward region whose blocks it frees the most bytes of
    call_region = np.full(calls, -1, np.int64)
    if calls and regions:
        freed = (lt.free_row < lt.rows) & (lt.alloc_row >= 0)
        fr = np.where(freed, lt.free_row, 0)
        ar = np.where(freed, lt.alloc_row, 0)
        c, r = call[fr], fwd[ar]
        m = freed & (c >= 0) & (r >= 0)
        if m.any():  # bytes per (call, region) pair present, the heaviest pair per call
            nr = len(regions)
            pairs, pinv = np.unique(c[m] * nr + r[m], return_inverse=True)
            votes = np.bincount(pinv, weights=lt.size[m])
            order = np.lexsort((-votes, pairs // nr))
            best = pairs[order]
            first = np.ones(len(best), bool)
            first[1:] = best[1:] // nr != best[:-1] // nr
            call_region[best[first] // nr] = best[first] % nr
        # a call that freed nothing of a forward: the region of the same graph code's calls
        first_code = np.full(calls, -1, np.int64)
        first_code[call[rows]] = code[rows]  # a call's rows share one code (or none)
        by_code: dict[int, int] = {}
        for k in np.flatnonzero(call_region >= 0).tolist():
            if first_code[k] >= 0:
                by_code.setdefault(int(first_code[k]), int(call_region[k]))
        for k in np.flatnonzero(call_region < 0).tolist():
            call_region[k] = by_code.get(int(first_code[k]), -1)
    attributed = int((call_region >= 0).sum())
    if attributed < calls:
        regions.append(UNKNOWN)
        call_region[call_region < 0] = len(regions) - 1

    # per block, from its alloc row
    a = lt.alloc_row
    made = a >= 0
    ar = np.where(made, a, 0)
    region = np.where(made, fwd[ar], -1).astype(np.int32)
    bw_call = np.where(made, call[ar], -1)
    backward = bw_call >= 0
    region[backward] = call_region[bw_call[backward]]
    out = Compiled(regions, region, backward, _sources(d, regions, region, backward),
                   calls, attributed)
    if snap.graph_code is not None:
        _buffers(d, out, uniq, inv)
    return out


def _model_line(frames) -> str:
    """The node's model source line: the innermost frame outside torch (its code text)."""
    f = next((f for f in frames if "/torch/" not in f.filename.replace("\\", "/")), frames[0])
    path = f.filename.replace("\\", "/")
    if path.startswith("/"):  # torch writes absolute paths: the last folder and the file
        path = "/".join(path.rsplit("/", 2)[-2:])
    return f"{f.name}  {path}:{f.line}" + (f": {f.code}" if f.code else "")


def _buffers(d: DeviceAnalysis, c: Compiled, uniq: np.ndarray, inv: np.ndarray) -> None:
    """Each block Inductor's generated code allocated: its buffer and model source line.

    A row is the code's own allocation when the innermost Python frame of its stack is a
    generated module's (C++ frames and the CPU recorder's `<op>` markers skipped): a call
    back into eager code (a checkpoint's recompute) is not. On CUDA/NPU its frame's line is the
    allocating line: the buffer that line allocates (none for a fallback op's or an extern
    kernel's own output) and the model line of the node the line belongs to. The CPU
    recorder's frame carries its function's first line, so there each run of consecutive rows
    under one function pairs its k-th allocation with the function's k-th allocating line
    (cyclically: a graph may run twice in a row), as long as the bytes the line computes (when
    literal) are the block's: a mismatch leaves the rest of the run unpaired, not shifted."""
    gc, lt, t = d.snapshot.graph_code, d.lt, d.trace
    n = len(lt)
    c.buffer, c.line = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
    if gc is None or not gc.files:
        return
    paths = {p: i for i, p in enumerate(gc.files)}
    files = list(gc.files.values())  # uniq, inv: the trace's distinct stacks (attribute's)
    under = np.full(len(uniq), -1, np.int32)  # the generated module anywhere in the stack
    own = np.zeros(len(uniq), bool)  # ... as the innermost Python frame
    line_at = np.zeros(len(uniq), np.int64)
    for i, s in enumerate(uniq.tolist()):
        if s == NO_STACK:
            continue
        frames = d.snapshot.stack_frames(s)
        k = next((j for j, f in enumerate(frames) if f.filename in paths), -1)
        if k < 0:
            continue
        under[i], line_at[i] = paths[frames[k].filename], frames[k].line
        own[i] = all(is_native(f) or f.filename.startswith("<") for f in frames[:k])
    row_file, row_own, row_line = under[inv], own[inv], line_at[inv]
    is_alloc = t.action == A["alloc"]
    by_order = d.snapshot.kind.cpu_recorded
    bufs: dict[str, int] = {}
    lines: dict[str, int] = {}
    labels: dict[int, int] = {}
    row_buf = np.full(len(t), -1, np.int32)
    row_ln = np.full(len(t), -1, np.int32)
    by_line = [{a.line: a for a in f.allocs} for f in files]
    by_function: dict[tuple[int, int], list] = {}
    for fi, f in enumerate(files):
        for a in f.allocs:
            by_function.setdefault((fi, a.function), []).append(a)
    run, k = (-1, -1), 0
    prev = -2
    for r in np.flatnonzero(row_file >= 0).tolist():
        fi, ln = int(row_file[r]), int(row_line[r])
        if r != prev + 1 or (fi, ln) != run:
            run, k = (fi, ln), 0
        prev = r
        if not (is_alloc[r] and row_own[r]):
            continue
        f = files[fi]
        if by_order:
            allocs = by_function.get((fi, ln))
            if not allocs or k < 0:
                continue
            got = allocs[k % len(allocs)]
            if got.nbytes not in (-1, int(t.size[r])):
                k = -1
                continue
            k += 1
            buf, node_line = got.buffer, got.line
        else:
            hit = by_line[fi].get(ln)
            buf, node_line = (hit.buffer if hit else None), ln
        if buf is not None:
            row_buf[r] = bufs.setdefault(buf, len(bufs))
        st = f.stack_of(node_line)
        if st >= 0 and gc.stacks[st]:
            if st not in labels:
                labels[st] = lines.setdefault(_model_line(gc.stacks[st]), len(lines))
            row_ln[r] = labels[st]
    made = lt.alloc_row >= 0
    ar = np.where(made, lt.alloc_row, 0)
    c.buffers, c.lines = list(bufs), list(lines)
    c.buffer = np.where(made, row_buf[ar], -1).astype(np.int32)
    c.line = np.where(made, row_ln[ar], -1).astype(np.int32)


def _sources(d: DeviceAnalysis, regions: list[str], region: np.ndarray,
             backward: np.ndarray) -> list[str | None]:
    """Per region, the user frame that made the most of its forward blocks' bytes (one pass over
    the (region, stack) pairs: a file names as many regions as it likes)."""
    lt = d.lt
    m = (region >= 0) & ~backward
    stacks, sinv = np.unique(lt.stack[m], return_inverse=True)
    frame_names: dict[str, int] = {}
    frame = np.array([-1 if s == NO_STACK else
                      frame_names.setdefault(f, len(frame_names))
                      if (f := user_frame(d, s)) is not None else -1
                      for s in stacks.tolist()], np.int64)[sinv] if len(stacks) else \
        np.zeros(0, np.int64)
    r, size = region[m].astype(np.int64), lt.size[m]
    ok = frame >= 0
    out: list[str | None] = [None] * len(regions)
    if ok.any():
        nf = len(frame_names)
        pairs, pinv = np.unique(r[ok] * nf + frame[ok], return_inverse=True)
        by = np.bincount(pinv, weights=size[ok])
        order = np.lexsort((-by, pairs // nf))  # per region, the heaviest frame first
        first = np.ones(len(order), bool)
        first[1:] = (pairs[order] // nf)[1:] != (pairs[order] // nf)[:-1]
        names = list(frame_names)
        for p in pairs[order][first].tolist():
            out[p // nf] = names[p % nf]
    return out


ROWS = 64  # regions listed per device (the rest summed in `left_out`)
LINES = 16  # model source lines listed per device


def _lines(c: Compiled, alive: np.ndarray, size_all: np.ndarray) -> list[dict] | None:
    """The model source lines whose compiled buffers hold the most at the peak (then made the
    most): region, pass, buffers; None without the recorder's map of compiled code."""
    if not len(c.line) or not c.lines:
        return None
    m = c.line >= 0
    ln = c.line[m].astype(np.int64)
    peak = np.bincount(ln, weights=np.where(alive[m], size_all[m], 0), minlength=len(c.lines))
    made = np.bincount(ln, weights=size_all[m], minlength=len(c.lines))
    order = np.lexsort((-made, -peak))[:LINES]
    rows = []
    for k in order.tolist():
        sel = np.flatnonzero(m)[ln == k]
        regs = sorted({c.regions[r] for r in c.region[sel].tolist() if r >= 0})
        passes = sorted({"backward" if b else "forward" for b in c.backward[sel].tolist()})
        names = sorted({c.buffers[b] for b in c.buffer[sel].tolist() if b >= 0},
                       key=lambda x: (len(x), x))
        rows.append({"line": c.lines[k], "regions": regs, "passes": passes,
                     "buffers": names[:8], "bytes_at_peak": int(peak[k]),
                     "bytes_allocated": int(made[k]), "blocks": int(len(sel))})
    return rows


def summary(d: DeviceAnalysis, c: Compiled) -> dict:
    """What the device summary carries: per region (the ROWS holding the most at the peak),
    its source and its forward and backward bytes alive at the peak and made over the trace;
    the compiled and eager bytes at the peak."""
    lt = d.lt
    alive = lt.alive_at(d.peak_row) if d.peak_row >= 0 else np.zeros(len(lt), bool)
    n = len(c.regions)
    comp = c.region >= 0
    reg = c.region[comp].astype(np.int64)
    bw, size, live = c.backward[comp], lt.size[comp], alive[comp]

    def per(mask: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(reg[mask], weights=None if weights is None else weights[mask],
                           minlength=n)

    fwd_peak, bwd_peak = per(~bw & live, size), per(bw & live, size)
    fwd_blocks, bwd_blocks, made = per(~bw), per(bw), per(np.ones(len(reg), bool), size)
    order = np.argsort(-(fwd_peak + bwd_peak), kind="stable")
    rows = [{"region": c.regions[r], "source": c.source[r],
             "forward_bytes_at_peak": int(fwd_peak[r]), "backward_bytes_at_peak": int(bwd_peak[r]),
             "forward_blocks": int(fwd_blocks[r]), "backward_blocks": int(bwd_blocks[r]),
             "bytes_allocated": int(made[r])} for r in order[:ROWS].tolist()]
    return {"regions": rows, "regions_left_out": max(0, n - ROWS),
            "lines": _lines(c, alive, size_all=lt.size),
            "map_notes": (d.snapshot.graph_code.notes.get("errors") or None)
            if d.snapshot.graph_code is not None else None,
            "compiled_bytes_at_peak": int(lt.size[comp & alive].sum()),
            "eager_bytes_at_peak": int(lt.size[~comp & alive].sum()),
            "backward_calls": c.backward_calls, "backward_calls_attributed": c.attributed_calls}
