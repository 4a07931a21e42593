"""FSDP configuration rules, proven on real runs of the bundled example (CPU, gloo, 2 ranks).

Each variant that sets up one configuration must trigger its rule (with the verdict, evidence and
a predicted peak checked against a recording of the configuration the fix describes, where the
example has one), and the healthy layouts (`fixed`, `nested`, FSDP1 FULL_SHARD) must trigger
none of them. New recordings here: reshard_after_forward_false, prefetch_in_recompute,
no_rate_limit, full_init, mixed_precision, no_grad_sync, fsdp1_shard_grad_op, fsdp1_reentrant
(fixed, nested and buggy are shared with test_diagnose_fsdp through the session cache).

Two shapes are made by editing recordings (said so at each test): FSDP2 units all-gathered twice
per backward (fixed on torch 2.13 by pytorch PR 164009, so `fixed` gets an extra recompute
unshard per unit), and CUDA-shaped traces (no op/module/record_function frames, ranges only as
annotations or not at all).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from snapforensics.analysis import diagnose
from snapforensics.analysis.classify import classify
from snapforensics.analysis.context import analyse
from snapforensics.analysis.vocab import CAT_CODE, Category, Phase
from snapforensics.snapshot import Frame, load, normalize, read_raw

RAF = "fsdp.reshard_after_forward_disabled"
STALE = "fsdp.stale_prefetch_all_gather"
DOUBLE = "fsdp.double_all_gather_in_backward"
CONC = "fsdp.too_many_concurrent_all_gathers"
INIT_RULE = "fsdp.full_model_materialized_at_init"
MP = "fsdp.mixed_precision_extras"
SYNC = "fsdp.gradient_sync_disabled"
SEED = "fsdp.unsharded_params_not_resharded"
NEW_RULES = {RAF, STALE, DOUBLE, CONC, INIT_RULE, MP, SYNC}
NEW_ANOMALOUS = {STALE, DOUBLE, CONC, INIT_RULE}

slow = pytest.mark.slow


@pytest.fixture(scope="session")
def diag(tmp_path_factory):
    pytest.importorskip("torch")
    from recordings import recorded

    cache = {}

    def get(variant: str):
        if variant not in cache:
            rank0 = recorded(variant, tmp_path_factory)[0]
            cache[variant] = (rank0, diagnose(load(rank0)))
        return cache[variant]

    return get


def finding(d, rule):
    found = [f for f in d.findings if f.rule == rule]
    assert found, (rule, [(f.rule, f.verdict) for f in d.findings])
    return found[0]


def rules(d, verdict=None):
    return {f.rule for f in d.findings if verdict is None or f.verdict == verdict}


def near(a: int, b: int, tol: float = 0.10) -> bool:
    return abs(a - b) / b < tol


# ------------------------------------------------------------------ healthy runs fire nothing


@slow
@pytest.mark.parametrize("variant", ["fixed", "nested"])
def test_healthy_layouts_fire_no_fsdp_configuration_rule(diag, variant):
    _, d = diag(variant)
    assert not d.anomalies, [(f.rule, f.cause) for f in d.anomalies]
    assert not rules(d) & NEW_RULES, [(f.rule, f.cause) for f in d.findings]


@slow
def test_seed_bug_fires_only_the_seed_rule(diag):
    _, d = diag("buggy")
    assert SEED in rules(d, "anomalous")
    assert not rules(d) & NEW_RULES, [(f.rule, f.cause) for f in d.findings]


# ------------------------------------------------------------------ 1. reshard_after_forward


@slow
def test_reshard_after_forward_false_is_expected_with_its_cost(diag):
    _, d = diag("reshard_after_forward_false")
    f = finding(d, RAF)
    assert f.verdict == "expected"
    # 6 blocks of ~12 MiB kept from forward to backward; the root (FSDP keeps it by design) and
    # the last block (runs backward first) are not counted.
    mods = {m["module"] for m in f.evidence["modules"]}
    assert mods == {f"layers.{i}" for i in range(5)}, mods
    assert f.bytes >= 5 * 12 * 2**20
    assert "reshard_after_forward=True" in f.fix
    assert f.evidence["stacks"][0]["stack"]
    # Predicted: the same run with reshard_after_forward=True, i.e. `fixed`.
    measured = diag("fixed")[1].peaks["overall_bytes"]
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert f.saving_bytes > 0
    assert near(f.predicted_peak_bytes, measured), (f.predicted_peak_bytes, measured)
    assert not rules(d, "anomalous") & NEW_ANOMALOUS


# ------------------------------------------------------------------ 2. prefetch in backward


@slow
def test_forward_prefetch_in_recompute_leaves_stale_all_gathers(diag):
    _, d = diag("prefetch_in_recompute")
    f = finding(d, STALE)
    assert f.verdict == "anomalous"
    # one attention all-gather buffer per layer but the first, from the recompute's prefetch
    assert f.blocks >= 4 and f.bytes >= 4 * 4 * 2**20
    assert "prefetch" in f.evidence["by_path"]
    assert all(".attn" in m["module"] for m in f.evidence["modules"]), f.evidence["modules"]
    assert "_prefetch_unshard" in " ".join(f.evidence["stacks"][0]["stack"])
    # Without the buffers: the same layout without prefetch lists (`nested`).
    measured = diag("nested")[1].peaks["overall_bytes"]
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert near(f.predicted_peak_bytes, measured), (f.predicted_peak_bytes, measured)
    # Its prefetch lists reach two units ahead: three units in flight in forward, but rate
    # limiting them would not lower the peak (the stale buffers set it): info, not anomalous.
    c = finding(d, CONC)
    assert c.evidence["max_in_flight_by_phase"]["forward"] == 3
    assert c.verdict == "info" and c.saving_bytes < 0.05 * d.peaks["overall_bytes"], c.saving_bytes
    assert SEED not in rules(d) and DOUBLE not in rules(d)


@slow
def test_fsdp1_reentrant_checkpoint_gathers_every_layer_twice(diag):
    """A real recording on torch 2.13: FSDP1 + HF-style reentrant checkpointing (#105635)."""
    _, d = diag("fsdp1_reentrant")
    f = finding(d, DOUBLE)
    assert f.verdict == "anomalous"
    assert f.evidence["units_gathered_twice"] == 6
    assert f.bytes >= 6 * 12 * 2**20
    paths = " ".join(f.evidence["by_path"])
    assert "first: recompute" in paths and "second: backward_pre_hook" in paths
    assert "use_reentrant" in f.fix or "NO_REENTRANT" in f.fix
    # FULL_SHARD keeps only the root unsharded after forward: not reshard_after_forward=False.
    assert RAF not in rules(d) and STALE not in rules(d) and SEED not in rules(d)


def _with_recompute_regather(path) -> dict:
    """Edit a `fixed` recording: before each unit's backward unshard, the recompute unshards the
    unit (a copy of its forward all-gather outputs, recompute frames) and reshards it at once:
    what torch before pytorch PR 164009 did with units nested in a checkpointed region."""
    raw, _ = read_raw(path)
    snap = normalize(raw)
    d = analyse(snap, snap.traces[0])
    trace = raw["device_traces"][0]
    unsh = [b for b in range(len(d.lt))
            if d.lt.alloc_row[b] >= 0 and d.category[b] == CAT_CODE[Category.UNSHARDED_PARAM]]
    fw: dict[tuple, list[int]] = {}
    bw_first: dict[tuple, int] = {}
    for b in unsh:
        key = (int(d.iteration[b]), d.module_of(b))
        if key[1] in (None, "(root)") or key[0] < 0:
            continue
        if d.phase[b] == Phase.FORWARD:
            fw.setdefault(key, []).append(b)
        elif d.phase[b] in (Phase.BACKWARD, Phase.RECOMPUTE):
            bw_first[key] = min(bw_first.get(key, 1 << 62), int(d.lt.alloc_row[b]))
    recompute = [{"filename": "torch/utils/checkpoint.py", "line": 0, "name": "recompute_fn"},
                 {"filename": "torch/utils/checkpoint.py", "line": 0, "name": "unpack_hook"}]
    inserts: dict[int, list] = {}
    addr = 1 << 46
    for key, row in bw_first.items():
        entries, frees = [], []
        for b in fw.get(key, []):
            src = trace[int(d.lt.alloc_row[b])]
            frames = list(src["frames"]) + recompute
            e = dict(src, addr=addr, frames=frames, time_us=trace[row]["time_us"])
            entries.append(e)
            frees += [dict(e, action="free_requested"), dict(e, action="free_completed")]
            addr += int(src["size"]) + 4096
        inserts[row] = entries + frees
    out = []
    for r, e in enumerate(trace):
        out.extend(inserts.get(r, []))
        out.append(e)
    raw["device_traces"][0] = out
    return raw


@slow
def test_double_all_gather_per_named_unit_on_an_edited_recording(diag):
    path, _ = diag("fixed")
    d = diagnose(normalize(_with_recompute_regather(path), source="edited-fixed.pickle"))
    f = finding(d, DOUBLE)
    assert f.evidence["units_gathered_twice"] == 6
    assert {m["module"] for m in f.evidence["modules"]} == {f"layers.{i}" for i in range(6)}
    assert "first: recompute" in " ".join(f.evidence["by_path"])
    assert not rules(d) & {SEED, STALE, CONC, RAF}


# ------------------------------------------------------------------ 3. no rate limit


@slow
def test_prefetching_three_units_ahead_is_too_many_all_gathers(diag):
    _, d = diag("no_rate_limit")
    f = finding(d, CONC)
    assert f.verdict == "anomalous"
    assert f.evidence["max_in_flight"] == 4
    assert f.evidence["excess_bytes"] >= 2 * 12 * 2**20
    assert "set_modules_to_forward_prefetch" in f.fix
    # Rate-limited to two in flight: about `fixed` (same layout, default prefetch).
    measured = diag("fixed")[1].peaks["overall_bytes"]
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert near(f.predicted_peak_bytes, measured), (f.predicted_peak_bytes, measured)
    # The saving itself, not only the peak (a no-change prediction is within 10% of the peak):
    # measured 207.3 -> 194.8 MiB; predicted 16.3 MiB (the replay frees units at the rows the
    # trace shows, a little earlier than a rate-limited run would).
    saving = d.peaks["overall_bytes"] - measured
    assert near(f.saving_bytes, saving, 0.35), (f.saving_bytes, saving)
    assert not rules(d) & (NEW_RULES - {CONC})


# ------------------------------------------------------------------ 4. full init


@slow
def test_full_model_built_on_the_device_before_sharding(diag):
    _, d = diag("full_init")
    f = finding(d, INIT_RULE)
    assert f.verdict == "anomalous"
    ev = f.evidence
    assert ev["init_peak_bytes"] > 1.5 * ev["sharded_param_bytes"]
    assert f.bytes >= 0.9 * ev["full_model_bytes"]  # the whole model, at once
    assert "meta" in f.fix
    # With meta-device init the init peak is the sharded parameters, as in `fixed`.
    fixed = load(diag("fixed")[0])
    dx = analyse(fixed, fixed.active_traces[0])
    fixed_init = int(dx.lt.live[:dx.tl.iterations[0].start].max())
    assert near(ev["predicted_init_peak_bytes"], fixed_init), (ev, fixed_init)
    assert not rules(d) & (NEW_RULES - {INIT_RULE})


def _without_fsdp(path, world_size=None) -> dict:
    """Edit a recording into a run with no FSDP: every torch.distributed / FSDP / c10d frame and
    the range annotations removed, the recorder's world size replaced (None: unknown)."""
    raw, _ = read_raw(path)
    for tr in raw["device_traces"]:
        for e in tr:
            if "frames" in e:
                e["frames"] = [fr for fr in e["frames"] if "distributed" not in fr["filename"]
                               and "fsdp" not in fr["name"].lower() and "c10d" not in fr["name"]]
    raw.pop("external_annotations", None)
    raw.get("snapforensics", {}).pop("world_size", None)
    if world_size is not None:
        raw["snapforensics"]["world_size"] = world_size
    return raw


@slow
def test_full_init_needs_fsdp_and_a_world_size_above_one(diag, tmp_path_factory):
    # A real single-rank recording of `full_init` (FSDP over one rank): nothing is sharded away.
    from recordings import recorded

    one = recorded("full_init", tmp_path_factory, nproc=1)[0]
    d = diagnose(load(one))
    assert INIT_RULE not in rules(d), [(f.rule, f.cause) for f in d.findings]
    # The same full-model init with no FSDP in the trace, world size unknown or one.
    for path in (one, diag("full_init")[0], diag("fixed")[0]):
        for ws in (None, 1):
            d = diagnose(normalize(_without_fsdp(path, ws), source="no-fsdp.pickle"))
            assert INIT_RULE not in rules(d), (path, ws, [(f.rule, f.cause) for f in d.findings])


def test_full_init_silent_on_a_real_single_process_file():
    from conftest import corpus_file

    d = diagnose(load(corpus_file("NiuHuangxiaozi_fwd_bwd_200_mixed.pickle")))
    assert INIT_RULE not in rules(d)
    assert not rules(d) & NEW_RULES


# ------------------------------------------------------------------ 5. mixed precision


@slow
def test_mixed_precision_reduce_in_fp32_is_expected_with_its_cost(diag):
    _, d = diag("mixed_precision")
    f = finding(d, MP)
    assert f.verdict == "expected"
    assert abs(f.evidence["reduce_to_param_dtype_ratio"] - 2.0) < 0.1
    assert {"reduce_in_higher_precision", "low_precision_shard_copies"} <= set(
        f.evidence["parts"])
    assert f.bytes > 0
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert "reduce_dtype=torch.bfloat16" in f.fix
    assert not rules(d, "anomalous")


# ------------------------------------------------------------------ 6. gradient sync off


@slow
def test_gradient_sync_off_holds_unsharded_grads_across_micro_batches(diag):
    _, d = diag("no_grad_sync")
    f = finding(d, SYNC)
    assert f.verdict == "expected"
    # the whole model's unsharded fp32 grads (~76 MiB) held into the next micro-batch
    assert f.bytes >= 0.8 * f.evidence["gathered_param_bytes"]
    assert f.evidence["released_in_iteration"] == f.evidence["iteration"] + 1
    assert f.predicted_peak_bytes < d.peaks["overall_bytes"]
    assert f.saving_bytes > 0
    assert "set_requires_gradient_sync(True)" in f.fix
    assert not rules(d, "anomalous")


# ------------------------------------------------------------------ 7. FSDP1


@slow
def test_fsdp1_shard_grad_op_is_classified_and_keeps_params(diag):
    _, d = diag("fsdp1_shard_grad_op")
    totals = d.primary.categories_total
    for cat in (Category.UNSHARDED_PARAM, Category.ALL_GATHER, Category.REDUCE_SCATTER,
                Category.SHARDED_GRAD, Category.SHARDED_PARAM):
        assert totals.get(cat, {}).get("bytes", 0) > 0, (cat, totals)
    f = finding(d, RAF)
    assert f.verdict == "expected"
    # FSDP1 names no unit: the units are its flat parameters, the root is the first one.
    assert f.evidence["named_units"] == 0 and f.evidence["units_kept"] == 5
    assert "_alloc_padded_unsharded_flat_param" in " ".join(f.evidence["stacks"][0]["stack"])
    assert "FULL_SHARD" in f.fix
    # bf16 params, fp32 reduce: the cast of the grad to fp32 and the `_mp_shard` copies
    m = finding(d, MP)
    assert {"reduce_in_higher_precision", "low_precision_shard_copies"} <= set(m.evidence["parts"])
    assert m.evidence["parts"]["low_precision_shard_copies"]["blocks"] >= 7  # one per unshard
    assert not d.anomalies, [(x.rule, x.cause) for x in d.anomalies]


def _f(name, file="torch/distributed/fsdp/_runtime_utils.py"):
    return Frame(file, 1, name)


def test_classify_fsdp1_names():
    flat = [_f("_alloc_storage", "torch/distributed/utils.py"),
            _f("_alloc_padded_unsharded_flat_param", "torch/distributed/fsdp/_flat_param.py"),
            _f("unshard", "torch/distributed/fsdp/_flat_param.py"), _f("_unshard")]
    fwd = classify(flat + [_f("_pre_forward_unshard"), _f("_pre_forward"),
                           _f("forward", "m.py")])
    assert (fwd.category, fwd.path, fwd.phase) == \
        (Category.UNSHARDED_PARAM, "forward", Phase.FORWARD)
    pre = classify(flat + [_f("_pre_backward_hook"), _f("_engine_run_backward", "a.py")])
    assert (pre.category, pre.path, pre.phase) == \
        (Category.UNSHARDED_PARAM, "backward_pre_hook", Phase.BACKWARD)
    pf = classify(flat + [_f("_prefetch_handle"), _f("_pre_backward_hook"),
                          _f("_engine_run_backward", "a.py")])
    assert pf.path == "prefetch"
    # the reentrant recompute: FSDP's pre-forward inside CheckpointFunction.backward
    rc = classify(flat + [_f("_pre_forward_unshard"), _f("_pre_forward"), _f("forward", "m.py"),
                          _f("backward", "torch/utils/checkpoint.py")])
    assert (rc.path, rc.phase) == ("recompute", Phase.RECOMPUTE)
    mp = classify([_f("_alloc_storage", "torch/distributed/utils.py"),
                   _f("_use_low_precision_shard", "torch/distributed/fsdp/_flat_param.py"),
                   _f("pre_unshard", "torch/distributed/fsdp/_flat_param.py"), _f("_unshard"),
                   _f("_pre_forward_unshard"), _f("_pre_forward")])
    assert mp.category == Category.ALL_GATHER
    cast = classify([Frame("<op>", 0, "aten::to"), _f("_post_backward_hook"),
                     _f("_engine_run_backward", "a.py")])
    assert (cast.category, cast.phase) == (Category.REDUCE_SCATTER, Phase.BACKWARD)
    rs = classify([_f("_get_reduce_scatter_tensors"), _f("_reduce_grad"),
                   _f("_post_backward_hook")])
    assert rs.category == Category.REDUCE_SCATTER
    init = [_f("__init__", "torch/distributed/fsdp/fully_sharded_data_parallel.py")]
    full = classify([_f("empty_like", "x.py"),
                     _f("_materialize_meta_module", "torch/distributed/fsdp/_init_utils.py"),
                     _f("_init_param_handle_from_module", "torch/distributed/fsdp/_init_utils.py")
                     ] + init)
    assert (full.category, full.phase) == (Category.PARAMETER, Phase.INIT)
    shard = classify([_f("_get_shard", "torch/distributed/fsdp/_flat_param.py"),
                      _f("shard", "torch/distributed/fsdp/_flat_param.py"),
                      _f("_init_param_handle_from_module", "torch/distributed/fsdp/_init_utils.py")
                      ] + init)
    assert shard.category == Category.SHARDED_PARAM
    # FSDP1's record_function ranges alone (CUDA, no Python frames): category and path, no phase
    ranged = classify([], ("FullyShardedDataParallel.forward",
                           "FullyShardedDataParallel._pre_forward"))
    assert ranged.phase == Phase.UNKNOWN  # also open around a reentrant recompute


# ------------------------------------------------------------------ CUDA-shaped traces


@slow
@pytest.mark.parametrize("annotations", [True, False])
def test_rules_hold_on_cuda_shaped_traces(diag, annotations):
    """Edited recordings: op/module/record_function frames removed, stacks cut at the autograd
    engine, ranges as annotations or absent (test_cuda_like.cuda_shaped)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_like import cuda_shaped

    expect = {"fixed": set(), "nested": set(), "reshard_after_forward_false": {RAF},
              "prefetch_in_recompute": {STALE, CONC}, "no_rate_limit": {CONC},
              "full_init": {INIT_RULE}, "no_grad_sync": {SYNC}, "mixed_precision": {MP},
              "fsdp1_shard_grad_op": {RAF, MP}, "fsdp1_reentrant": {DOUBLE}}
    for variant, want in expect.items():
        raw, _ = read_raw(diag(variant)[0])
        d = diagnose(normalize(cuda_shaped(raw, annotations=annotations), source=variant))
        assert rules(d) & NEW_RULES == want, (variant, [(f.rule, f.cause) for f in d.findings])
