"""torch.compile runs (issue 29 item 3): each trace entry's `compile_context` is read into the
model (`Trace.compile_context`: row -> "Torch-Compiled Region: F/C", the region Dynamo opened
around a compiled frame's code; c10's "N/A" rows absent), by all three read paths alike, and a
compiled run gets the eager run's verdicts and predictions.

The recordings are the bundled example (`snapforensics/examples/fsdp_ckpt.py --compile B`: each
block's `mlp` compiled with `nn.Module.compile(backend=B)`, FSDP and checkpointing eager) and its
eager twin, 2 ranks, 2 blocks of dim 128, 3 steps. The test knows what it compiled (the `MLP`
modules), so it checks the compiled rows against that, never against what the analyzer prints.
aot_eager records in ~13 s; Inductor's C++ CPU backend compiles C++ for a minute or more on a
2-core machine, so that run is `full`-marked.
"""

from __future__ import annotations

import pickle

import pytest
from differential import compare, disagreement
from findings import near

import snapforensics as sf
from snapforensics.snapshot import load
from snapforensics.snapshot.stream import read_info as stream_info

slow = pytest.mark.slow
REGION = "Torch-Compiled Region"


def _paths(backend: str):
    from recordings import S_COMPILE, recorded

    return recorded("buggy", extra=(*S_COMPILE, "--compile", backend))


def _entries(ctxs):
    rows = []
    for i, c in enumerate(ctxs):
        frames = [{"filename": "m.py", "line": 3 + i % 2, "name": "forward"}]
        e = {"action": "alloc", "addr": 4096 * (i + 1), "size": 512, "stream": 0,
             "time_us": 1.0e15 + i, "frames": frames}
        if c is not ...:
            e["compile_context"] = c
        rows.append(e)
    return rows


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("SNAPFORENSICS_NO_CACHE", "1")


def test_three_read_paths_read_compile_context_alike():
    """The streaming reader (C), the native column reader and the pure-Python reader give the
    same rows: "N/A", None and a missing key are outside every region; a region name is kept."""
    ctxs = ["N/A", "Torch-Compiled Region: 0/0", ..., None, "Torch-Compiled Region: 1/0", "N/A"]
    data = pickle.dumps({"segments": [], "device_traces": [_entries(ctxs)]})
    got = compare(data, "compile.pickle")
    assert not disagreement(got), got
    assert all(kind == "ok" for kind, _ in got.values()), got
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.pickle"
        p.write_bytes(data)
        t = load(p).traces[0]
        with open(p, "rb") as f:  # the streaming reader read it as columns (did not decline)
            got_stream = stream_info(p, f)
    assert got_stream is not None
    root = got_stream[0]
    assert root["device_traces"][0].extras["compile_context"] == {
        1: "Torch-Compiled Region: 0/0", 4: "Torch-Compiled Region: 1/0"}
    assert t.compile_context == {1: "Torch-Compiled Region: 0/0", 4: "Torch-Compiled Region: 1/0"}


def test_a_compile_context_that_is_not_a_string_is_refused_alike():
    data = pickle.dumps({"segments": [], "device_traces": [_entries(["N/A", 7])]})
    got = compare(data, "compile_bad.pickle")
    assert not disagreement(got), got
    assert {kind for kind, _ in got.values()} == {"refused"}, got
    assert all("compile_context must be a string" in v[1] for _, v in got.values()), got


def _compiled_rows_are_the_compiled_modules(paths):
    """Every row inside a compiled region was made under a compiled module (the test compiled each
    block's `MLP`, nothing else), and every compiled module call made some."""
    for p in paths:
        s = load(p)
        t = s.active_traces[0]
        assert t.compile_context, p  # without compile_context reading: no row (fails)
        regions = set(t.compile_context.values())
        assert all(r.startswith(REGION + ": ") for r in regions), regions
        for row in t.compile_context:
            frames = s.stack_frames(int(t.stack[row]))
            mods = [f.name for f in frames if f.filename == "<nn.Module>"]
            assert any(m.startswith("MLP") for m in mods), (row, mods)
        # Outside the regions compiled code runs only as AOTAutograd's backward: the autograd
        # engine calls it (CompiledFunctionBackward), not Dynamo's frame, so c10 has no region
        # open there (CUDA writes "N/A" for those rows too).
        backward = 0
        for row in range(len(t)):
            if row in t.compile_context or int(t.stack[row]) < 0:
                continue
            frames = s.stack_frames(int(t.stack[row]))
            if any(f.filename.startswith("<eval_with_key>") or "torchinductor" in f.filename
                   for f in frames):
                assert any(f.name == "CompiledFunctionBackward" for f in frames), row
                backward += 1
        assert backward, p


def _same_findings(eager, compiled):
    """Rule by rule: the same verdicts, predicted peaks and savings within 5%."""
    out = []
    for pe, pc in zip(eager, compiled):
        fe = {f.rule: f for f in sf.diagnose(pe).diagnosis.findings}
        fc = {f.rule: f for f in sf.diagnose(pc).diagnosis.findings}
        assert fe, pe
        assert set(fe) == set(fc), (sorted(fe), sorted(fc))
        for rule, a in fe.items():
            b = fc[rule]
            assert a.verdict == b.verdict, (rule, a.verdict, b.verdict)
            for attr in ("predicted_peak_bytes", "saving_bytes"):
                x, y = getattr(a, attr), getattr(b, attr)
                assert (x is None) == (y is None), (rule, attr, x, y)
                if x:
                    assert near(y, x, 0.05), (rule, attr, x, y)
            out.append((rule, a.verdict, a.predicted_peak_bytes, b.predicted_peak_bytes))
    return out


def _backward_is_tied_to_its_region(paths, layers: int = 2, steps: int = 3):
    """The compiled backward (no compile_context: the autograd engine runs it) is attributed
    to the region whose forward saved what it consumes. Truth from the run: each of the `layers`
    compiled MLPs runs one compiled backward per step; the gradients it makes are the MLPs'
    parameters' (the recorder's names, from `named_parameters()`); its region's forward rows
    ran under an MLP module (raw frames)."""
    for p in paths:
        rep = sf.diagnose(p)
        (d,) = rep.analyses
        c = d.compiled
        assert c is not None, p
        assert c.backward_calls == layers * steps, (c.backward_calls, p)
        assert c.attributed_calls == c.backward_calls and "?" not in c.regions, c.regions
        b = rep.blocks
        bw = b[b.compiled_pass == "backward"]
        grads = bw.tensor.dropna()
        grads = grads[grads.str.endswith(".grad")]
        assert len(grads) and grads.str.contains(r"\.mlp\.").all(), grads.tolist()
        s = load(p)
        t = s.active_traces[0]
        for region in set(bw.compiled_region.astype(str)):
            rows = [r for r, ctx in t.compile_context.items() if ctx == f"{REGION}: {region}"]
            assert rows, region
            assert all(any(f.name.startswith("MLP") for f in s.stack_frames(int(t.stack[r])))
                       for r in rows), region
        # the summary the reports render adds up to the blocks
        js = rep.diagnosis.devices[0].compiled
        assert js["compiled_bytes_at_peak"] == sum(
            r["forward_bytes_at_peak"] + r["backward_bytes_at_peak"] for r in js["regions"])
        assert js["backward_calls"] == layers * steps
        assert sum(r["backward_blocks"] for r in js["regions"]) == len(bw)
        assert "torch.compile regions" in rep.render("markdown")


@slow
def test_eager_twin_has_no_compiled_rows():
    for p in _paths("none"):
        assert not load(p).active_traces[0].compile_context
        rep = sf.diagnose(p)
        assert rep.analyses[0].compiled is None
        assert rep.diagnosis.devices[0].compiled is None
        assert rep.blocks.compiled_region.isna().all()
        assert "torch.compile regions" not in rep.render("markdown")


@slow
def test_aot_eager_backward_is_tied_to_its_forward_region():
    _backward_is_tied_to_its_region(_paths("aot_eager"))


@slow
def test_aot_eager_rows_are_attributed_to_the_compiled_modules():
    _compiled_rows_are_the_compiled_modules(_paths("aot_eager"))


@slow
def test_aot_eager_gets_the_eager_verdicts_and_predictions():
    print(_same_findings(_paths("none"), _paths("aot_eager")))


def _inductor_buffers_name_their_lines(paths):
    """Inductor's buffers carry the model source line their graph node came from (the
    recorder's map of the generated code). Truth from the example's own source (`inspect`):
    `MLP.forward` runs fc1, gelu, fc2 on three lines, in that order; fc1's and gelu's outputs
    are (tokens, 4 x dim), fc2's (tokens, dim). So, in allocation order, the compiled forward's
    blocks are (fc1's line, gelu's line, fc2's line) again and again, sized (4s, 4s, s); the
    compiled backward's buffers come from those lines too (AOTAutograd gives backward nodes
    their forward node's stack)."""
    import inspect

    from snapforensics.examples import fsdp_ckpt

    src, first = inspect.getsourcelines(fsdp_ckpt.MLP.forward)
    line = {op: first + i for i, text in enumerate(src)
            for op in ("self.fc1(x)", "F.gelu(h)", "self.fc2(h)") if op in text}
    assert len(line) == 3 and len(set(line.values())) == 3, line
    order = [line["self.fc1(x)"], line["F.gelu(h)"], line["self.fc2(h)"]]
    for p in paths:
        rep = sf.diagnose(p)
        b = rep.blocks.sort_values("alloc_row")
        fw = b[b.compiled_pass == "forward"]
        assert len(fw) and fw.compiled_buffer.notna().all(), fw.compiled_buffer.tolist()
        got = fw.compiled_line.astype(str).str.extract(r"fsdp_ckpt\.py:(\d+)")[0].astype(int)
        assert got.tolist() == order * (len(fw) // 3), got.tolist()
        sizes = fw["size"].to_numpy().reshape(-1, 3)
        assert (sizes[:, 0] == sizes[:, 1]).all() and (sizes[:, 0] == 4 * sizes[:, 2]).all()
        bw = b[(b.compiled_pass == "backward") & b.compiled_line.notna()]
        assert len(bw), p
        got = bw.compiled_line.astype(str).str.extract(r"fsdp_ckpt\.py:(\d+)")[0].astype(int)
        assert set(got) <= set(order), set(got)
        # the summary's table adds up to the blocks it lists, and every format shows it
        rows = rep.diagnosis.devices[0].compiled["lines"]
        named = b[b.compiled_line.notna()]
        assert sum(r["bytes_allocated"] for r in rows) == int(named["size"].sum())
        for fmt in ("markdown", "html", "terminal"):
            assert "by model source line" in rep.render(fmt), fmt


@pytest.mark.full
def test_inductor_cpu_gets_the_eager_verdicts_and_attribution():
    paths = _paths("inductor")
    _compiled_rows_are_the_compiled_modules(paths)
    _backward_is_tied_to_its_region(paths)
    _inductor_buffers_name_their_lines(paths)
    print(_same_findings(_paths("none"), paths))


@slow
def test_aot_eager_has_no_map_of_generated_code():
    """aot_eager runs FX's own graph modules, no Inductor: no map, no buffers (not guessed)."""
    for p in _paths("aot_eager"):
        assert load(p).graph_code is None
        b = sf.diagnose(p).blocks
        assert b.compiled_region.notna().any() and b.compiled_buffer.isna().all()
