"""Inductor's generated code, mapped back to the model (issue 29, item 3).

A block Inductor's compiled graph allocates has, as its innermost frames, the Python module
Inductor wrote for the graph (``/tmp/torchinductor_<user>/xx/cxxxx.py``, function ``call``),
at a line such as ``buf1 = empty_strided_cpu((2, 64, 512), ...)``. That file is gone, or not
the reader's, by the time a snapshot is read. What it meant is known only in the recorded
process, and torch keeps it there: ``PyCodeCache.linemaps[path]`` holds, for each generated
wrapper module, the first line of each scheduler node's code and the FX node it came from
(``graph.py``: ``(line_no, node.stack_trace)``, written as the scheduler ``enter_context``-s
each node, so a buffer's allocation line falls in the node that produces it). torch's own
``PyCodeCache.stack_frames_for_code(path, line)`` bisects it to give the model source frames of
a generated line; the same is written here, at the dump, so the reader can do it too.

``data()`` is what the recorder writes under the snapshot's top-level
``snapforensics_graph_code`` key (torch's ``_memory_viz`` reads only ``segments`` and
``device_traces``)::

    {"format": "snapforensics.graph_code/1",
     "files": [{"path": str, "starts": [int, ...], "stacks": [int, ...],
                "allocs": [[line, name, nbytes, def_line], ...]}, ...],
     "stacks": [[[filename, line, name, code], ...], ...],   # innermost first
     "errors": [...]}

``starts``/``stacks``: the linemap (node code starting at ``starts[i]`` came from
``stacks[stacks[i]]``, -1: a node without a stack trace); ``allocs``: the lines that allocate
a generated buffer (``bufN = empty_strided_<device>(sizes, strides, dtype)``), in the order the
code runs them, with the storage's bytes when the sizes are literal (-1: symbolic) and the
first line of the function holding it (``call``, or a subgraph's function written before
it). On CUDA/NPU
a block's frame carries the allocating line itself; the CPU recorder's frames carry a
function's first line only (the profiler's Python events), so there the reader pairs the
k-th allocation of one run of a function with its k-th allocating line, checked by bytes.
The reader is ``snapshot/graph_code.py``. Nothing here runs unless the script imported
Inductor.
"""

from __future__ import annotations

import linecache
import re
import sys

FORMAT = "snapforensics.graph_code/1"
KEY = "snapforensics_graph_code"
MAX_FILES = 4096
MAX_FILE_BYTES = 16 << 20  # a generated wrapper module larger than this is skipped
MAX_FRAMES = 64  # model frames kept per node stack (innermost)
MAX_TEXT = 512
MAX_STACKS = 100_000  # the reader's bounds (snapshot/graph_code.py): past them, files are
MAX_LINES = 1 << 20  # left out (and said) rather than the whole key dropped by the reader
MAX_PATH = 4096
MAX_BYTES = 1 << 50
# torch's own pattern (codecache.PyCodeCache.stack_frames_for_code), plus the code line the
# traceback format prints under each frame (not the next frame's "File" line: a frame of code
# without source, exec'd or shipped as .pyc, has no code line)
_FRAME = re.compile(r'File "(.+)", line (\d+), in (.+)\n(?:[ \t]+(?!File ")(\S[^\n]*)\n?)?')
# what allocates a generated buffer: empty_strided_<device>(sizes, strides, dtype) in the wrapper
# codegen (wrapper.py make_allocation), or the generic empty_strided(sizes, strides,
# device=..., dtype=...) of other devices; a reuse (`buf3 = buf0; del buf0  # reuse`) does not
_ALLOC = re.compile(r"^[ \t]+(buf\w+)[ \t]*=[ \t]*empty_strided\w*\(")
_SHAPE = re.compile(r"\(([^()]*)\),[ \t]*\(([^()]*)\),")  # literal sizes, strides
_DTYPE = re.compile(r"(?:dtype=)?torch\.(\w+)")
_DEF = re.compile(r"^[ \t]*def[ \t]+\w+[ \t]*\(")
_ITEMSIZE = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8,
             "double": 8, "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "int8": 1,
             "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
             "float8_e5m2": 1}


def _nbytes(sizes: str, strides: str, dtype: str) -> int:
    """The storage bytes of ``empty_strided(sizes, strides, dtype)`` (torch's
    ``computeStorageNbytes``: 1 + sum((size - 1) * stride) elements, 0 when a size is 0), -1
    when a size or stride is symbolic or the dtype unknown."""
    try:
        sz = [int(x) for x in sizes.split(",") if x.strip()]
        st = [int(x) for x in strides.split(",") if x.strip()]
    except ValueError:
        return -1
    if len(sz) != len(st) or dtype not in _ITEMSIZE:
        return -1
    if any(x == 0 for x in sz):
        return 0
    n = (1 + sum((a - 1) * b for a, b in zip(sz, st))) * _ITEMSIZE[dtype]
    return n if 0 <= n <= MAX_BYTES else -1


def _allocs(text: str) -> list[list]:
    """``[line, buffer, bytes, def line]`` of each allocating line, in the file's order: the
    line of the enclosing ``def`` tells ``call`` from subgraph functions written before it (the
    CPU recorder's frames carry that line). Lines are counted on ``\\n`` as Python does."""
    out, fn = [], 0
    for i, line in enumerate(text.split("\n"), start=1):
        if _DEF.match(line):
            fn = i
            continue
        m = _ALLOC.match(line)
        if m is None:
            continue
        rest = line[m.end():]
        shape = _SHAPE.match(rest)
        dt = _DTYPE.search(rest, shape.end()) if shape else None
        nb = _nbytes(shape.group(1), shape.group(2), dt.group(1)) if shape and dt else -1
        out.append([i, m.group(1)[:MAX_TEXT], nb, fn])
    return out


def _frames(stack_trace: str) -> list[list] | None:
    """The node's model frames, innermost first; None when a frame's code is not what its file
    says now: Inductor's FX graph cache serves a graph with the stack traces of the run that
    compiled it, so an edit that moved the model's lines (same graph) leaves them stale."""
    found = _FRAME.findall(stack_trace)
    out = [[f[:MAX_TEXT], int(ln), n.strip()[:MAX_TEXT], (c or "").strip()[:MAX_TEXT]]
           for f, ln, n, c in reversed(found)]
    for f, ln, _, code in out:
        now = linecache.getline(f, ln).strip()
        if code and now and now != code:
            return None
    return out[:MAX_FRAMES]


def data() -> dict | None:
    """The linemaps of every generated module this process loaded, or None when Inductor was
    never imported (or loaded no module)."""
    cc = sys.modules.get("torch._inductor.codecache")
    if cc is None:
        return None
    errors: list[str] = []
    try:
        linemaps = dict(cc.PyCodeCache.linemaps)
    except Exception as e:  # a torch without linemaps: nothing to map
        return {"format": FORMAT, "files": [], "stacks": [], "errors": [f"{type(e).__name__}: {e}"]}
    files: list[dict] = []
    stacks: list[list] = []
    seen: dict[str, int] = {}  # stack trace text -> index into stacks
    same: dict[str, int] = {}  # parsed frames (repr) -> index: texts differing only in markers
    stale = lines = 0
    for path, lm in list(linemaps.items())[:MAX_FILES]:
        if len(str(path)) > MAX_PATH:
            continue
        try:
            starts, nodes = (list(lm[0]), list(lm[1])) if len(lm) == 2 else ([], [])
            if len(stacks) + len(nodes) > MAX_STACKS or lines + 2 * len(starts) > MAX_LINES:
                errors.append(f"more than {MAX_LINES} lines or {MAX_STACKS} node stacks: "
                              f"{len(linemaps) - len(files)} generated modules left out")
                break
            idx = []
            for st in nodes:
                if not isinstance(st, str) or not st:
                    idx.append(-1)
                    continue
                if st not in seen:
                    fr = _frames(st)
                    if fr is None:
                        stale += 1
                        seen[st] = -1
                    else:
                        seen[st] = same.setdefault(repr(fr), len(stacks))
                        if seen[st] == len(stacks):
                            stacks.append(fr)
                idx.append(seen[st])
            with open(path, "rb") as f:
                text = f.read(MAX_FILE_BYTES + 1)
            allocs = [] if len(text) > MAX_FILE_BYTES else _allocs(
                text.decode("utf-8", "replace"))
            if lines + len(starts) + len(allocs) > MAX_LINES:
                errors.append(f"more than {MAX_LINES} lines: "
                              f"{len(linemaps) - len(files)} generated modules left out")
                break
            lines += len(starts) + len(allocs)
            order = sorted(range(len(starts)), key=lambda i: int(starts[i]))  # as torch wrote
            files.append({"path": str(path), "starts": [int(starts[i]) for i in order],
                          "stacks": [idx[i] for i in order], "allocs": allocs})
        except Exception as e:  # never the recording's failure: this file stays unmapped
            errors.append(f"{path}: {type(e).__name__}: {e}"[:MAX_TEXT])
    if stale:
        errors.append(f"{stale} node stack traces left out: their lines are not the source's "
                      "now (Inductor's FX graph cache served a graph compiled from an older "
                      "version of the code)")
    if not files and not errors:
        return None
    return {"format": FORMAT, "files": files, "stacks": stacks, "errors": errors}


def attach(snap: dict) -> dict:
    """``snap`` with the generated code's map under ``KEY`` when the run compiled with
    Inductor (the recorder's backends call this at the dump)."""
    try:
        got = data()
    except Exception as e:
        got = {"format": FORMAT, "files": [], "stacks": [], "errors": [f"{type(e).__name__}: {e}"]}
    if got is not None:
        snap[KEY] = got
    return snap
