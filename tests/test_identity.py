"""Tensor identity (issue 29, items 1 and 2): the recorder's names, checked against torch itself.

The proof is a real FSDP2 run on 2 CPU ranks recorded by `snapforensics record`
(`tests/identity_probe.py`, cached like every recording): the probe writes, without the
recorder's identity data, what `model.named_parameters()`, the gradients, `optimizer.state`,
FSDP2's unsharded parameters (as each Linear's forward pre hook sees them) and the autograd
graph's saved tensors (each node's `_saved_*`, owned by the modules whose forward made the
node) say, with the storage address and the time. Each is located in `d.blocks` by address and
lifetime only (never by the analyzer's names) and its `tensor`, `module`, `shape`, `dtype` must
match. Also here: the loader's handling of the key (a reused address, a damaged key), torch's
`_memory_viz` opening a named file, the report's table and the recipe for dumps without names.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import recordings

import snapforensics as sf
from snapforensics.analysis.identity import RECIPE, layer_of
from snapforensics.snapshot import load
from snapforensics.snapshot.tensors import KEY, KINDS

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "identity_probe.py"
FIXTURE = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"


def _probe_recording() -> Path:
    """The probe recorded on 2 CPU ranks through the CLI: the folder with rank{R}.pickle and
    truth.rank{R}.json, cached under the recorder's sources and the probe's text."""
    digest = hashlib.sha256(PROBE.read_bytes()).hexdigest()[:12]
    folder = recordings.CACHE / f"identity-w2-{recordings.key('identity', digest)}"
    with recordings._flock(folder.name):
        if (folder / "truth.rank1.json").is_file():
            return folder
        recordings.CACHE.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=".identity-", dir=recordings.CACHE))
        proc = recordings.run_cli(["record", "--nproc-per-node", "2", "--device", "cpu",
                                   "--out", str(out), str(PROBE), "--truth", str(out)])
        if proc.returncode != 0 or not (out / "truth.rank1.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            raise AssertionError(f"recording the probe failed: {proc.returncode}\n"
                                 f"{proc.stderr[-4000:]}")
        out.chmod(0o755)
        recordings._publish(out, folder)
    return folder


@pytest.fixture(scope="module")
def probe():
    pytest.importorskip("torch")
    folder = _probe_recording()
    out = []
    for r in (0, 1):
        truth = json.loads((folder / f"truth.rank{r}.json").read_text())
        out.append((sf.diagnose(folder / f"rank{r}.pickle"), truth, folder / f"rank{r}.pickle"))
    return out


def _block(blocks, entry: dict):
    """The row of the block at the entry's storage address alive at its time (by the trace
    alone: address and lifetime)."""
    t = entry["t_us"]
    alive = (blocks.address == entry["ptr"]) & ((blocks.alloc_row < 0)
                                                | (blocks.alloc_time_us <= t)) & (
        (blocks.free_row < 0) | (blocks.free_time_us >= t))
    rows = blocks[alive]
    assert len(rows) == 1, f"{entry.get('name', entry.get('node'))}: {len(rows)} blocks"
    return rows.iloc[0]


def _names(row) -> list[str]:
    return (row.tensor or "").split(", ")


def test_parameters_gradients_and_optimizer_state(probe):
    for d, truth, _ in probe:
        b = d.blocks
        for e in truth["params"]:  # the sharded parameter: the DTensor's local shard
            row = _block(b, e)
            assert (row.tensor, row.tensor_kind) == (e["name"], "parameter")
            assert (list(row["shape"]), row["dtype"]) == (e["shape"], e["dtype"])
            assert row.module == (e["name"].rpartition(".")[0] or None)
        for e in truth["grads"]:  # views of the unit's reduce-scatter output
            row = _block(b, e)
            assert row.tensor_kind == "gradient" and e["name"] in _names(row), e["name"]
        for e in truth["states"]:
            row = _block(b, e)
            assert (row.tensor, row.tensor_kind) == (e["name"], "optimizer_state")
            assert (list(row["shape"]), row["dtype"]) == (e["shape"], e["dtype"])
        assert len(truth["states"]) == 3 * len(truth["params"])  # exp_avg, exp_avg_sq, step


def test_fsdp2_unsharded_parameters(probe):
    """The storage FSDP's all-gather copy-out fills, per unshard, named as the parameter with
    its unsharded shape (the sharded one is another block, named too)."""
    for d, truth, _ in probe:
        b = d.blocks
        assert truth["unsharded"]
        for e in truth["unsharded"]:
            row = _block(b, e)
            assert row.tensor_kind == "unsharded_parameter" and e["name"] in _names(row)
            assert list(row["shape"]) == e["shape"] and row["dtype"] == e["dtype"]
        shard = {e["name"]: e["shape"] for e in truth["params"]}
        full = {e["name"]: e["shape"] for e in truth["unsharded"]}
        assert any(shard[n] != full[n] for n in full)  # really sharded: two storages


def _param_blocks(blocks, truth) -> set:
    """The blocks of the parameters' storages (sharded and unsharded), located by address and
    time (an address is handed out again later: by address alone, an activation would be
    taken for a parameter)."""
    return {_block(blocks, e).name for e in truth["unsharded"] + truth["params"]}


def _owner(mods: list[str], root: str) -> str:
    return mods[0] if mods[0] else root


def test_saved_for_backward_owners(probe):
    for d, truth, _ in probe:
        b = d.blocks
        params = _param_blocks(b, truth)
        checked = 0
        by_block: dict = {}
        for e in truth["saved"]:
            row = _block(b, e)
            if row.name in params:  # a weight the linear saved: named as the parameter
                continue
            by_block.setdefault(row.name, (row, set(), set()))[1].add(_owner(e["modules"],
                                                                           "<Model>"))
            by_block[row.name][2].add(tuple(e["shape"]))
        for row, owners, shapes in by_block.values():
            assert row.saved_for_backward and row.tensor_kind == "saved_for_backward"
            assert row.module in owners, (row.module, owners)
            assert tuple(row["shape"]) in shapes or row["dtype"] == "int64"
            checked += 1
        assert checked >= 10


def test_saved_by_layer_table(probe):
    """The table's bytes per layer: the truth's saved blocks alive at the peak, by layer."""
    for d, truth, _ in probe:
        b = d.blocks
        dev = d.diagnosis.devices[0]
        peak = dev.peak_row
        params = _param_blocks(b, truth)
        want: dict[str, int] = {}
        seen = set()
        for e in truth["saved"]:
            row = _block(b, e)
            alive = row.alloc_row <= peak and (row.free_row < 0 or row.free_row > peak)
            if row.name in params or row.name in seen or not alive:
                continue
            seen.add(row.name)
            lay = layer_of(row.module)
            want[lay] = want.get(lay, 0) + int(row["size"])
        got = {r["layer"]: r["bytes"] for r in dev.tensors["saved_by_layer"]}
        assert got == want and want
        text = d.render("markdown")
        assert "Saved for backward, by layer" in text and "layers.1" in text


def test_memory_viz_opens_named_file(probe):
    torch = pytest.importorskip("torch")
    from torch.cuda import _memory_viz

    _, _, path = probe[0]
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert KEY in snap
    assert _memory_viz.trace_plot(snap) and _memory_viz.segment_plot(snap)
    assert torch  # imported for _memory_viz only


def test_kinds_match_recorder():
    from snapforensics.record import identity

    assert identity.KINDS == KINDS and identity.KEY == KEY


def _named_file(tmp_path: Path, key_value) -> Path:
    """Two blocks at one address, one after the other, and observations of each."""
    fr = [{"filename": "x.py", "line": 1, "name": "f"}]
    trace = [
        {"action": "alloc", "addr": 4096, "size": 1024, "stream": 0, "time_us": 10.0,
         "frames": fr},
        {"action": "free_requested", "addr": 4096, "size": 1024, "stream": 0, "time_us": 20.0,
         "frames": fr},
        {"action": "free_completed", "addr": 4096, "size": 1024, "stream": 0, "time_us": 20.0,
         "frames": fr},
        {"action": "alloc", "addr": 4096, "size": 1024, "stream": 0, "time_us": 5000.0,
         "frames": fr},
    ]
    snap = {"segments": [], "device_traces": [trace], KEY: key_value}
    p = tmp_path / "named.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    return p


def _key(obs):
    return {"format": "snapforensics.tensors/1", "clock": "epoch_us", "kinds": list(KINDS),
            "identities": [["a.weight", "parameter", "a", [16, 16], "float32", 0],
                           ["b.weight.exp_avg", "optimizer_state", "b", [256], "float32", 0]],
            "ptr": [o[0] for o in obs], "offset": [0] * len(obs), "nbytes": [1024] * len(obs),
            "time_us": [o[1] for o in obs], "identity": [o[2] for o in obs]}


def test_reused_address_is_not_misnamed(tmp_path):
    p = _named_file(tmp_path, _key([(4096, 15.0, 0), (4096, 5010.0, 1)]))
    b = sf.diagnose(p).blocks.sort_values("alloc_row")
    assert list(b.tensor) == ["a.weight", "b.weight.exp_avg"]
    assert list(b.module) == ["a", "b"] and list(b["shape"]) == [(16, 16), (256,)]
    # an observation between the two lifetimes names neither; one a clock skew before an
    # allocation (SKEW_US) names the block allocated right after it
    p = _named_file(tmp_path, _key([(4096, 25.0, 0)]))
    assert sf.diagnose(p).blocks.tensor.isna().all()
    p = _named_file(tmp_path, _key([(4096, 4990.0, 1)]))
    assert list(sf.diagnose(p).blocks.sort_values("alloc_row").tensor.fillna("-")) == [
        "-", "b.weight.exp_avg"]


def test_damaged_key_is_dropped_with_a_warning(tmp_path):
    bad = _key([(4096, 15.0, 7)])  # identity index out of range
    s = load(_named_file(tmp_path, bad))
    assert s.tensors is None and any(KEY in w for w in s.warnings)
    s = load(_named_file(tmp_path, {"format": "other"}))
    assert s.tensors is None and s.warnings
    # format /2: a 7th item, the TP split, a bounded count; /1's 6 items under /2 are refused
    for tp in (-1, 1 << 40, 4097, "4", None):
        v2 = _key([(4096, 15.0, 0)]) | {"format": "snapforensics.tensors/2"}
        v2["identities"] = [e + [tp] for e in v2["identities"]]
        s = load(_named_file(tmp_path, v2))
        assert s.tensors is None and any(KEY in w for w in s.warnings), tp
    s = load(_named_file(tmp_path, _key([(4096, 15.0, 0)]) | {"format": "snapforensics.tensors/2"}))
    assert s.tensors is None and any("7-item" in w for w in s.warnings)
    for ptr in (5, 2.5, True):  # a column that is no list (a TypeError out of the loader before)
        s = load(_named_file(tmp_path, _key([(4096, 15.0, 0)]) | {"ptr": ptr}))
        assert s.tensors is None and any(KEY in w for w in s.warnings), ptr


def test_tp_split_reads_and_survives_the_cache(tmp_path):
    """Format /2's TP split reaches `d.blocks.tp_split` and the npz cache keeps it; /1 reads as
    0 (unknown)."""
    from snapforensics.snapshot import npz

    v2 = _key([(4096, 15.0, 0)]) | {"format": "snapforensics.tensors/2"}
    v2["identities"] = [e + [4] for e in v2["identities"]]
    s = load(_named_file(tmp_path, v2))
    assert [i.tp for i in s.tensors.identities] == [4, 4]
    b = sf.diagnose(_named_file(tmp_path, v2)).blocks
    assert b.loc[b.tensor == "a.weight", "tp_split"].tolist() == [4]
    f = tmp_path / "e.npz"
    with open(f, "wb") as out:
        npz.save(s, out)
    with open(f, "rb") as src:
        assert npz.read(src, s.source).tensors.identities == s.tensors.identities
    old = load(_named_file(tmp_path, _key([(4096, 15.0, 0)])))
    assert [i.tp for i in old.tensors.identities] == [0, 0]


def test_cache_keeps_names(tmp_path):
    from snapforensics.snapshot import npz

    s = load(_named_file(tmp_path, _key([(4096, 15.0, 0)])))
    f = tmp_path / "e.npz"
    with open(f, "wb") as out:
        npz.save(s, out)
    with open(f, "rb") as src:
        back = npz.read(src, s.source)
    assert back.tensors.identities == s.tensors.identities
    assert np.array_equal(back.tensors.ptr, s.tensors.ptr)


def test_dump_without_names_says_what_can_be_said(tmp_path):
    """A dump torch made alone (the fixture without the recorder's provenance): what frames and
    ranges say, and the recipe; a recorder file without names is told to record again."""
    import gzip

    snap = pickle.loads(gzip.decompress(FIXTURE.read_bytes()))
    assert KEY not in snap
    t = sf.diagnose(FIXTURE).diagnosis.devices[0].tensors
    assert t["recorded"] is False and "snapforensics record" in t["recipe"]
    del snap["snapforensics"]
    p = tmp_path / "torch_dump.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    d = sf.diagnose(p)
    t = d.diagnosis.devices[0].tensors
    assert t["recorded"] is False and t["recipe"] == RECIPE
    assert any("FSDP units" in s for s in t["said"])
    for fmt in ("markdown", "terminal", "html"):
        text = d.render(fmt)
        assert "snapforensics.record.names(model, optimizer" in text, fmt
        assert "_record_memory_history(max_entries=1_000_000)" in text, fmt
    assert d.blocks.tensor.isna().all()


def test_names_context_manager_in_a_plain_script():
    """`snapforensics.record.names(model, optimizer)` in the user's own process: the
    parameters', gradients' and state's storages against named_parameters()/optimizer.state."""
    torch = pytest.importorskip("torch")
    from snapforensics.record import names

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters())
    with names(model, opt) as n:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().sum().backward()
            opt.step()
    data = n.attach({})[KEY]
    seen = {}
    for ptr, i in zip(data["ptr"], data["identity"]):
        seen.setdefault(ptr, set()).add(data["identities"][i][0])
    for name, p in model.named_parameters():
        assert name in seen[p.untyped_storage().data_ptr()]
        assert name + ".grad" in seen[p.grad.untyped_storage().data_ptr()]
        for k, v in opt.state[p].items():
            assert f"{name}.{k}" in seen[v.untyped_storage().data_ptr()]
    saved = {data["identities"][i][2] for i in data["identity"]
             if data["identities"][i][1] == "saved_for_backward"}
    assert {"0", "1", "2"} <= saved  # each layer saved its input (ReLU its output)


def test_names_from_the_file_are_neutralized_in_every_report():
    """Layer, module and tensor names are the file's strings: each renderer passes them through
    its sink's neutralizer (as test_sinks.py checks for every other string)."""
    import dataclasses

    from test_sinks import CONTROL, HOSTILE, SGR

    d = sf.diagnose(FIXTURE).diagnosis
    named = {"recorded": True, "named_bytes_at_peak": 1 << 20, "bytes_at_peak": 2 << 20,
             "by_kind_at_peak": {HOSTILE: 1 << 20},
             "saved_by_layer": [{"layer": HOSTILE, "bytes": 1 << 20, "blocks": 2,
                                 "modules": [[HOSTILE, 1 << 19]]}],
             "largest_at_peak": [{"tensor": HOSTILE, "kind": HOSTILE, "module": HOSTILE,
                                  "shape": [2, 3], "dtype": HOSTILE, "bytes": 1 << 19}]}
    d = dataclasses.replace(d, devices=[dataclasses.replace(d.devices[0], tensors=named)])
    from snapforensics.report import render_text

    term = render_text(d, "terminal")
    assert "saved for backward, by layer" in term
    assert not CONTROL.findall(SGR.sub("", term).replace("\n", ""))
    md = render_text(d, "markdown")
    assert "Saved for backward, by layer" in md and "\n# INJECTED" not in md
    assert "<script>" not in md.split("```")[0]
    page = render_text(d, "html")
    assert "Saved for backward, by layer" in page and "<script>alert(1)" not in page


def test_untimed_trace_names_only_addresses_that_held_one_block(tmp_path):
    """torch_npu's snapshot has no `time_us`: an observation cannot be placed in the trace, so
    a reused address (two blocks at 4096) stays unnamed, and an address that held one block
    only is named."""
    p = _named_file(tmp_path, _key([(4096, 15.0, 0), (8192, 15.0, 1)]))
    snap = pickle.loads(p.read_bytes())
    trace = snap["device_traces"][0]
    trace.append({"action": "alloc", "addr": 8192, "size": 1024, "stream": 0,
                  "frames": trace[0]["frames"]})
    for e in trace:
        e.pop("time_us", None)
    p.write_bytes(pickle.dumps(snap, protocol=4))
    b = sf.diagnose(p).blocks.sort_values("alloc_row")
    assert list(b.address) == [4096, 4096, 8192]
    assert list(b.tensor.fillna("-")) == ["-", "-", "b.weight.exp_avg"]


def fsdp1_units_from_names(path: Path, tmp_path: Path) -> None:
    """FSDP1's units on a CUDA-shaped copy of a CPU recording (its module frames cut, as a
    CUDA trace has none): the recorder's names of the unsharded flat parameters give each
    unshard its unit, one for one with the units the module frames give the original."""
    import copy

    import numpy as np
    from edits import cuda_shaped

    raw = pickle.loads(path.read_bytes())
    orig = sf.diagnose(path).analyses[0]
    flat = np.flatnonzero(orig.fsdp.fsdp1_flat)
    assert len(flat) >= 3
    shaped = tmp_path / "cuda_shaped.pickle"
    shaped.write_bytes(pickle.dumps(cuda_shaped(copy.deepcopy(raw)), protocol=4))
    cuda = sf.diagnose(shaped).analyses[0]
    assert np.array_equal(np.flatnonzero(cuda.fsdp.fsdp1_flat), flat)
    pairs = {(orig.module_of(b), cuda.module_of(b)) for b in flat.tolist()}
    by_frames = {a for a, _ in pairs}
    by_names = {b for _, b in pairs}
    assert None not in by_frames and None not in by_names, pairs
    assert len(pairs) == len(by_frames) == len(by_names), pairs  # one for one
    layers = len(by_names) - 1
    assert by_names == {"(root)"} | {f"layers.{i}" for i in range(layers)}, by_names
    # without the names the CUDA-shaped copy has no units: the names named them
    bare = cuda_shaped(copy.deepcopy(raw))
    bare.pop(KEY)
    shaped.write_bytes(pickle.dumps(bare, protocol=4))
    d = sf.diagnose(shaped).analyses[0]
    assert all(d.module_of(b) is None for b in flat.tolist())


def test_fsdp1_units_named_by_the_names_where_frames_have_no_modules(recording, tmp_path):
    fsdp1_units_from_names(recording("fsdp1"), tmp_path)


def test_findings_name_their_tensors(probe):
    """Every rule that lists its blocks gets their names (`evidence.tensors`, one mechanism in
    the engine): the probe's reduce-scatter finding names the units' gradient buffers, and
    every name it lists is a gradient the probe saw (`param.grad` after backward), all of them
    (3 units, within the 8 rows); each listed row is one of the finding's blocks. The reports
    show them."""
    for d, truth, _ in probe:
        (f,) = [f for f in d.diagnosis.findings if f.rule == "fsdp.reduce_scatter_accumulation"]
        assert f.tensors and all(t["kind"] == "gradient" for t in f.tensors)
        names = {n for t in f.tensors for n in t["tensor"].split(", ")}
        assert names == {e["name"] for e in truth["grads"]}
        members = d.blocks[d.blocks.device == f.device].iloc[np.asarray(f.members)]
        assert {t["tensor"] for t in f.tensors} <= set(members.tensor.dropna())
        assert f.tensors[0]["tensor"].split(", ")[0] in d.render("markdown")


TP_PROBE = REPO / "tests" / "tp_split_probe.py"


@pytest.mark.parametrize("variant", ["plain", "sp", "gathered", "head"])
def test_recorder_names_what_tp_splits(variant):
    """Each tensor autograd saves under torch's own `parallelize_module` (TP 4, fake process
    group), through the recorder's real pack hook, carries the split the running state shows:
    its bytes against the plain twin's save at the same position (4: split, 1: whole). Plans:
    torchtitan's without and with SequenceParallel, and one whose column-wise w1 all-gathers its
    output (`output_layouts=Replicate()`), after which nothing is split until w2; and a model
    whose column-wise output projection's logits the script gathers after the model returns
    (the region ends with the module that called the projection: the softmax is whole)."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, str(TP_PROBE), variant], capture_output=True,
                       text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout.strip().splitlines()[-1])
    assert d["saves"][0] == d["saves"][1] > 10  # the two runs save the same sequence
    split = [r for r in d["rows"] if r[0] == 4]
    whole = [r for r in d["rows"] if r[0] == 1]
    assert split and whole and len(split) + len(whole) == len(d["rows"])
    assert all(r[1] == 4 for r in split), split
    assert all(r[1] in (0, 1) for r in whole), whole
    # what only the region (no DTensor) tells: the MLP's activation between w1 and w2, SDPA's
    owners = {r[2] for r in split}
    if variant == "gathered":
        assert "feed_forward" in {r[2] for r in whole} and "feed_forward" not in owners
    elif variant == "head":  # the block's own regions, the head's output, and the whole softmax
        assert {"block.feed_forward", "block.attention"} <= owners
        assert [r for r in whole if r[2] is None and r[3] == [2, 16, 256]]
    else:
        assert {"feed_forward", "attention"} <= owners
    norms = {"attention_norm", "ffn_norm", "block.attention_norm", "block.ffn_norm"}
    if variant == "sp":  # SequenceParallel's norms take the sequence shard
        assert {"attention_norm", "ffn_norm"} <= owners
    else:
        assert not norms & owners


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_of_the_model_runs_under_the_names(backend):
    """`torch.compile(model)` trains under the recorder's names (it raised inside Dynamo before:
    the global module hooks were traced into the graph), and the parameters are still named."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, str(REPO / "tests" / "compiled_model_probe.py"), backend],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert [layer_of(n) for n in got] == ["w1", "w1", "w2", "w2"], got
