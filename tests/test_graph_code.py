"""The recorder's map of Inductor's generated code (issue 29 item 3: `record/graph_code.py`,
`snapshot/graph_code.py`, the join in `analysis/compiled.py`).

The end-to-end proof is `test_compile.py`'s Inductor recording (`full`: Inductor's C++ backend
compiles for a minute): every compiled forward buffer of the example's MLP names the line of
`MLP.forward` that made it, checked against the example's own source. Here, cheaply: the bytes
the recorder computes from `empty_strided(...)` are torch's own, the reader takes the map the
same way on all three read paths and the cache and drops a malformed one with one warning, and
both joins (the allocating line on CUDA/NPU, the k-th allocation of a run on CPU) pair what
they should and nothing else.
"""

from __future__ import annotations

import copy
import pickle

import pytest
from differential import compare, disagreement

from snapforensics.record import graph_code as rec
from snapforensics.snapshot import graph_code, load

GEN = "/tmp/torchinductor_u/ab/cabc.py"  # a generated module's path, as a frame names it
MODEL = "/home/u/model.py"


def _map(allocs=((10, "buf0", 2048, 5), (12, "buf1", 2048, 5), (14, "buf2", 512, 5))) -> dict:
    return {"format": graph_code.FORMAT,
            "stacks": [[[MODEL, 7, "forward", "h = self.fc1(x)"], [MODEL, 30, "run", "m(x)"]],
                       [[MODEL, 8, "forward", "h = F.gelu(h)"]],
                       [[MODEL, 9, "forward", "return self.fc2(h)"]]],
            "files": [{"path": GEN, "starts": [9, 11, 13], "stacks": [0, 1, 2],
                       "allocs": [list(a) for a in allocs]}],
            "errors": []}


@pytest.mark.parametrize("sizes,strides,dtype", [
    ((128, 512), (512, 1), "float32"), ((2, 64, 512), (32768, 512, 1), "bfloat16"),
    ((4, 8), (1, 4), "int64"), ((3, 5), (0, 1), "float16"), ((), (), "float32"),
    ((7, 0, 3), (3, 3, 1), "float32"), ((6,), (2,), "uint8"), ((2, 3), (4, 1), "bool")])
def test_bytes_of_an_allocating_line_are_torchs(sizes, strides, dtype):
    """`empty_strided`'s storage bytes, from the line's text, against torch's own storage."""
    torch = pytest.importorskip("torch")
    want = torch.empty_strided(sizes, strides, dtype=getattr(torch, dtype)).untyped_storage()
    for line in (f"buf7 = empty_strided_cpu({sizes!r}, {strides!r}, torch.{dtype})",
                 f"buf7 = empty_strided({sizes!r}, {strides!r}, device='npu', "
                 f"dtype=torch.{dtype})"):
        assert rec._allocs(f"def call(args):\n    x = 1\n    {line}\n") == \
            [[3, "buf7", want.nbytes(), 1]], line


def test_allocating_lines_and_their_functions():
    """Symbolic sizes have no bytes (still an allocation: the CPU pairing counts it); a reuse
    allocates nothing; each allocation names the function holding it (a subgraph's function is
    written before `call`)."""
    code = "\n".join([
        "def subgraph_0(args):",
        "    buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)",
        "class Runner:",
        "    def call(self, args):",
        "        buf0 = empty_strided_cuda(((-1) + s0, 512), (512, 1), torch.float32)",
        "        buf1 = buf0; del buf0  # reuse",
        "        buf2 = empty_strided_cpu((s0, 8), (8, 1), torch.bfloat16)",
        "        buf3 = torch.ops.aten.addmm.default(a, b, c)"])
    assert rec._allocs(code) == [[2, "buf0", 64, 1], [5, "buf0", -1, 4], [7, "buf2", -1, 4]]


def test_a_frame_without_source_keeps_the_next_frame():
    """exec'd code (or a .pyc-only install) prints no code line under its frame: the next
    frame's `File` line is not taken for it."""
    st = ('  File "<eval_with_key>.3", line 5, in forward\n'
          '  File "/no/such/model.py", line 57, in forward\n    h = self.fc1(x)\n')
    assert rec._frames(st) == [["/no/such/model.py", 57, "forward", "h = self.fc1(x)"],
                               ["<eval_with_key>.3", 5, "forward", ""]]


def _entries(frames_of, sizes, actions=None):
    out = []
    for i, (fr, sz) in enumerate(zip(frames_of, sizes)):
        out.append({"action": (actions or ["alloc"] * len(sizes))[i], "addr": 4096 * (i + 1),
                    "size": sz, "stream": 0, "time_us": 1.0e15 + i, "frames": fr})
    return out


def test_the_recorders_own_map_reads_back():
    """What `record` writes (its `data()` over a linemap of torch's shape) is what the reader
    takes: the buffers, bytes, functions and model stacks come back."""
    import sys
    import tempfile
    import types

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("def call(args):\n"
                "    buf0 = empty_strided_cpu((8, 4), (4, 1), torch.float32)\n"
                "    buf1 = empty_strided_cpu((8, 2), (2, 1), torch.float16)\n")
    st = f'  File "{f.name}", line 2, in call\n    buf0 = empty_strided_cpu((8, 4), (4, 1), ' \
         'torch.float32)\n'
    cache = types.SimpleNamespace(PyCodeCache=types.SimpleNamespace(
        linemaps={f.name: [(1, 3), (st, "")]}))
    saved = sys.modules.get("torch._inductor.codecache")
    sys.modules["torch._inductor.codecache"] = cache  # type: ignore[assignment]
    try:
        got = rec.data()
        from snapforensics.record import identity  # names(...)'s attach and every backend's

        assert identity.attach({}, None)[rec.KEY] == got
    finally:
        if saved is None:
            sys.modules.pop("torch._inductor.codecache")
        else:
            sys.modules["torch._inductor.codecache"] = saved
    warnings: list[str] = []
    gc = graph_code.read({graph_code.KEY: got}, warnings)
    assert gc is not None and not warnings, (got, warnings)
    g = gc.files[f.name]
    assert [tuple(a) for a in g.allocs] == [(2, "buf0", 128, 1), (3, "buf1", 32, 1)]
    assert gc.stacks[g.stack_of(2)][0].line == 2 and g.stack_of(3) == -1


def test_three_read_paths_and_the_cache_read_the_map_alike(tmp_path):
    data = pickle.dumps({"segments": [], "device_traces": [_entries(
        [[{"filename": GEN, "line": 10, "name": "call"}]], [2048])], graph_code.KEY: _map()})
    got = compare(data, "graph_code.pickle")
    assert not disagreement(got), got
    assert all(kind == "ok" for kind, _ in got.values()), got
    p = tmp_path / "g.pickle"
    p.write_bytes(data)
    first = load(p).graph_code
    assert first is not None and first.files[GEN].allocs[1].buffer == "buf1"
    assert load(p).graph_code == first  # the second read comes from the loader's cache


@pytest.mark.parametrize("edit", [
    lambda m: m.update(format="snapforensics.graph_code/9"),
    lambda m: m["files"][0].update(starts=[13, 11, 9]),
    lambda m: m["files"][0].update(stacks=[0, 1, 3]),
    lambda m: m["files"][0]["allocs"].append([20, "buf9", "many", 5]),
    lambda m: m["files"][0]["allocs"].append([20, "x" * 5000, 1, 5]),
    lambda m: m["files"][0]["allocs"].append([20, "buf9", 1]),
    lambda m: m.update(format=10 ** 5000),
    lambda m: m.update(files=[m["files"][0], m["files"][0]]),
    lambda m: m["stacks"][0].append([MODEL, -1, "f", ""]),
    lambda m: m.update(files={"path": GEN}),
])
def test_a_malformed_map_is_dropped_with_one_warning(edit):
    m = copy.deepcopy(_map())
    edit(m)
    warnings: list[str] = []
    assert graph_code.read({graph_code.KEY: m}, warnings) is None
    assert len(warnings) == 1 and graph_code.KEY in warnings[0], warnings


def _blocks(entries, gmap, cpu=False):
    import snapforensics as sf

    data = {"segments": [], "device_traces": [entries], graph_code.KEY: gmap}
    if cpu:  # the CPU recorder's provenance
        data["snapforensics"] = {"cpu_recorded": True, "device": "cpu"}
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as f:
        pickle.dump(data, f)
    b = sf.diagnose(f.name).blocks.sort_values("alloc_row")
    return list(zip(b.compiled_buffer.astype(object).where(b.compiled_buffer.notna(), None),
                    b.compiled_line.astype(object).where(b.compiled_line.notna(), None)))


def _compiled(line: int):
    """A generated module's frame at `line`, under Dynamo's region (as c10 writes it)."""
    return [{"filename": GEN, "line": line, "name": "call"},
            {"filename": MODEL, "line": 30, "name": "run"}]


def _with_region(entries):
    for e in entries:
        e["compile_context"] = "Torch-Compiled Region: 0/0"
    return entries


def test_cuda_frames_name_the_allocating_line():
    """CUDA/NPU: the frame's line is the allocating line (any order of rows); a line that is
    no `empty_strided` (a fallback op's own output) has no buffer, but its node's model line."""
    got = _blocks(_with_region(_entries([_compiled(14), _compiled(10), _compiled(11),
                                         _compiled(12)], [512, 2048, 4096, 2048])), _map())
    assert [b for b, _ in got] == ["buf2", "buf0", None, "buf1"]
    assert got[1][1] == "forward  u/model.py:7: h = self.fc1(x)"
    assert got[2][1] == got[3][1] == "forward  u/model.py:8: h = F.gelu(h)"
    assert got[0][1] == "forward  u/model.py:9: return self.fc2(h)"


def test_cpu_frames_pair_the_kth_allocation_with_the_kth_line():
    """The CPU recorder's frame is `call`'s first line: each run of rows under the module pairs
    its allocations with the allocating lines in order (cyclically: the graph ran twice in a
    row); an eager row between runs starts a new one; a row the module only calls into (a
    recompute: another Python frame innermost) is not the code's own."""
    eager = [{"filename": MODEL, "line": 40, "name": "step"}]
    called = [{"filename": MODEL, "line": 50, "name": "recompute"}, *_compiled(5)]
    frames = [_compiled(5)] * 2 + [called] + [_compiled(5)] * 4 + [eager] + [_compiled(5)] * 2
    sizes = [2048, 2048, 999, 512, 2048, 2048, 512, 64, 2048, 2048]
    got = _blocks(_with_region(_entries(frames, sizes)), _map(), cpu=True)
    assert [b for b, _ in got] == ["buf0", "buf1", None, "buf2", "buf0", "buf1", "buf2", None,
                                   "buf0", "buf1"]
    assert got[0][1] == "forward  u/model.py:7: h = self.fc1(x)"
    assert got[3][1] == "forward  u/model.py:9: return self.fc2(h)"


def test_cpu_pairing_stops_at_a_size_that_is_not_the_lines():
    """A run whose k-th allocation is not the k-th line's bytes (something else allocated in
    the graph's call) leaves the rest of that run unpaired rather than shifted."""
    got = _blocks(_with_region(_entries([_compiled(5)] * 4, [2048, 4096, 2048, 512])), _map(),
                  cpu=True)
    assert [b for b, _ in got] == ["buf0", None, None, None]


def test_cpu_pairing_is_per_function():
    """A subgraph's function (written before `call`) has its own allocating lines: a run under
    `call` (frames at line 5) does not pair with them, and one under the subgraph (line 1)
    pairs only with its own."""
    m = _map(allocs=((2, "buf0", 64, 1), (10, "buf0", 2048, 5), (12, "buf1", 2048, 5)))
    eager = [{"filename": MODEL, "line": 40, "name": "step"}]
    got = _blocks(_with_region(_entries([_compiled(5), _compiled(5), eager, _compiled(1)],
                                        [2048, 2048, 8, 64])), m, cpu=True)
    assert [b for b, _ in got] == ["buf0", "buf1", None, "buf0"]


def test_no_map_no_buffers():
    got = _blocks(_with_region(_entries([_compiled(10)], [2048])), None)
    assert got == [(None, None)]
