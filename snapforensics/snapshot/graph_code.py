"""The recorder's map of Inductor's generated code (`snapforensics_graph_code`, written by
`record/graph_code.py`): for each generated wrapper module, which model source lines each of
its lines came from, and which lines allocate a generated buffer (`bufN = empty_strided_...`),
in the order the code runs them, with the buffer's bytes (-1: symbolic sizes).

A top-level key beside `segments` and `device_traces` (torch's `_memory_viz` reads only those).
Validated here: anything irregular drops the whole key with one warning (the map is an extra,
never the file's failure). The join to blocks is `analysis/compiled.py`.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from snapforensics.snapshot.columns import (
    LISTS,
    MAX_BYTES,
    BadExtra,
    clean_str,
    read_extra,
    short,
    tname,
)

KEY = "snapforensics_graph_code"
FORMAT = "snapforensics.graph_code/1"
MAX_FILES = 4096
MAX_LINES = 1 << 20  # linemap entries and buffer lines, all files together
MAX_STACKS = 100_000
MAX_FRAMES = 64
MAX_TEXT = 4096
MAX_LINE = 1 << 31


class SourceFrame(NamedTuple):
    filename: str
    line: int
    name: str
    code: str  # the source line's text, as the traceback printed it ("" when absent)


class Alloc(NamedTuple):
    line: int
    buffer: str  # bufN
    nbytes: int  # the storage's bytes, -1 when the sizes are symbolic
    function: int  # the first line of the function holding it (what CPU frames carry)


@dataclass(frozen=True)
class GraphFile:
    starts: tuple[int, ...]  # sorted: node code starting at starts[i] ...
    stacks: tuple[int, ...]  # ... came from the model frames GraphCode.stacks[stacks[i]] (-1)
    allocs: tuple[Alloc, ...]  # in the code's order

    def stack_of(self, line: int) -> int:
        """The model stack index of the node `line` belongs to (-1): torch's
        `PyCodeCache.stack_frames_for_code`."""
        p = bisect_right(self.starts, line)
        return self.stacks[p - 1] if p else -1


@dataclass
class GraphCode:
    files: dict[str, GraphFile]  # the generated module's path (a frame's filename)
    stacks: list[tuple[SourceFrame, ...]]  # innermost first
    notes: dict[str, Any] = field(default_factory=dict)  # errors

    def raw(self) -> dict:
        """The recorder's form (what `read` takes back: the loader's cache keeps it so)."""
        return {"format": FORMAT, "stacks": [[list(f) for f in s] for s in self.stacks],
                "files": [{"path": p, "starts": list(f.starts), "stacks": list(f.stacks),
                           "allocs": [list(x) for x in f.allocs]}
                          for p, f in self.files.items()],
                "errors": self.notes.get("errors", [])}


_Bad = BadExtra


def _text(v: Any) -> str:
    if type(v) is not str or len(v) > MAX_TEXT:
        raise _Bad(f"a name is {tname(v)} or too long")
    return clean_str(v)


def _line(v: Any) -> int:
    if type(v) is not int or not 0 <= v < MAX_LINE:
        raise _Bad("a line number is not one")
    return v


def _ints(v: Any, lo: int, hi: int) -> tuple[int, ...]:
    if type(v) not in LISTS or any(type(x) is not int or not lo <= x < hi for x in v):
        raise _Bad("a line map is not a list of indexes")
    return tuple(v)


def read(raw: dict, warnings: list[str]) -> GraphCode | None:
    """The map in `raw[KEY]`, None when absent or dropped (with a warning)."""
    return read_extra(raw, KEY, "the recorder's map of compiled code", _read, warnings)


def parse(v: Any) -> GraphCode:
    """`v` validated (ValueError when it is not a map of compiled code)."""
    return _read(v)


def _read(v: Any) -> GraphCode:
    if type(v) is not dict:
        raise _Bad(f"is {tname(v)}, expected a dict")
    if v.get("format") != FORMAT:
        raise _Bad(f"has format {short(v.get('format'))}, expected {FORMAT!r}")
    raw_stacks, raw_files = v.get("stacks", []), v.get("files", [])
    if type(raw_stacks) not in LISTS or len(raw_stacks) > MAX_STACKS:
        raise _Bad("has no list of stacks")
    if type(raw_files) not in LISTS or len(raw_files) > MAX_FILES:
        raise _Bad("has no list of files")
    stacks = []
    for s in raw_stacks:
        if type(s) not in LISTS or len(s) > MAX_FRAMES:
            raise _Bad("a stack is not a list of frames")
        fr = []
        for f in s:
            if type(f) not in LISTS or len(f) != 4:
                raise _Bad("a frame is not a 4-item list")
            fr.append(SourceFrame(_text(f[0]), _line(f[1]), _text(f[2]), _text(f[3])))
        stacks.append(tuple(fr))
    files: dict[str, GraphFile] = {}
    lines = 0
    for f in raw_files:
        if type(f) is not dict:
            raise _Bad("a file is not a dict")
        raw_starts, raw_idx, raw_allocs = (f.get(k, []) for k in ("starts", "stacks", "allocs"))
        if type(raw_starts) not in LISTS or type(raw_idx) not in LISTS or \
                type(raw_allocs) not in LISTS:
            raise _Bad("a file's line map or allocations are not lists")
        lines += len(raw_starts) + len(raw_allocs)
        if lines > MAX_LINES:
            raise _Bad(f"maps more than {MAX_LINES} lines")
        starts = _ints(raw_starts, 0, MAX_LINE)
        idx = _ints(raw_idx, -1, len(stacks))
        if len(starts) != len(idx) or any(a > b for a, b in zip(starts, starts[1:])):
            raise _Bad("a line map is not sorted or its columns differ in length")
        allocs = []
        for b in raw_allocs:
            if type(b) not in LISTS or len(b) != 4 or type(b[2]) is not int or \
                    not -1 <= b[2] <= MAX_BYTES:
                raise _Bad("an allocation is not a [line, name, bytes, function] list")
            allocs.append(Alloc(_line(b[0]), _text(b[1]), b[2], _line(b[3])))
        path = _text(f.get("path"))
        if path in files:
            raise _Bad("lists a generated module twice")
        files[path] = GraphFile(starts, idx, tuple(allocs))
    notes: dict[str, Any] = {}
    errs: Any = v.get("errors")
    if type(errs) in LISTS:
        notes["errors"] = [clean_str(e[:300]) for e in errs[:5] if type(e) is str]
    return GraphCode(files, stacks, notes)
