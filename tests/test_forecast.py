"""Forecast: the recorded run's peak at other world sizes, strategies, checkpointing and
micro-batch sizes, checked against runs actually recorded that way.

Slow tests record the bundled example with the project's recorder (CPU, gloo) and forecast one
recording from another: world size 2 <-> 4 for three model shapes (FSDP2 with checkpointing,
FSDP1, FSDP2 without checkpointing) and 2 <-> 8 for the last, reshard_after_forward
True <-> False (FSDP2), FULL_SHARD <-> SHARD_GRAD_OP (FSDP1), checkpointing on <-> off,
micro-batch x2, and a run with an anomaly.
The default-shape recordings are the ones other test modules make (session cache). Run with
`-s` to see the validation table. Fast tests use the committed fixtures and the corpus.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from corpus import corpus_file

from snapforensics.analysis.context import analyse
from snapforensics.analysis.forecast.capacity import parse_size
from snapforensics.analysis.forecast.core import forecast, forecast_frame
from snapforensics.analysis.forecast.documents import Scenario
from snapforensics.analysis.forecast.replay import Forecaster
from snapforensics.analysis.rules import fsdp_reshard
from snapforensics.analysis.vocab import Category, Verdict
from snapforensics.snapshot import load

RESHARD = fsdp_reshard.RULE.id

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BUGGY = FIXTURES / "fsdp2_ckpt_buggy_rank0.pickle.gz"
FIXED = FIXTURES / "fsdp2_ckpt_fixed_rank0.pickle.gz"
slow = pytest.mark.slow
# the pairs recorded for the forecast alone (world sizes 2 <-> 4 on two models, 2 <-> 8 on the
# smallest, FSDP1's two strategies, micro-batch x2): `make test-full`; `make test` checks the
# forecast on the pairs the rules' tests record anyway (strategy, checkpointing with
# micro-batch, the fix) and on the smallest model's 2 <-> 4 pair (FSDP2, 4 x 128, 2 steps)
full = pytest.mark.full

# Model shapes (the example's flags); () is the default 6 blocks of dim 512.
S1 = ()
S2 = ("--layers", "4", "--dim", "256")
S3 = ("--layers", "4", "--dim", "128")

TABLE: list[tuple[str, int, int, float]] = []


_FX: dict = {}


def _fx(path) -> Forecaster:
    """One analysed recording per path for the whole module (forecasting does not mutate it)."""
    if path not in _FX:
        s = load(path)
        _FX[path] = Forecaster(analyse(s, s.active_traces[0]))
    return _FX[path]


@pytest.fixture(scope="module", autouse=True)
def _print_table():
    yield
    if TABLE:
        print("\n\n| scenario | forecast | recorded | error |\n|---|---|---|---|")
        for name, f, r, e in TABLE:
            print(f"| {name} | {f / 2**20:.2f} MiB | {r / 2**20:.2f} MiB | {e:+.1%} |")


@pytest.fixture(scope="session")
def rec(recording):
    """`rec(variant, nproc, extra)`: rank 0 of a real recording, analysed for forecasting."""

    def get(variant: str, nproc: int = 2, extra: tuple = ()) -> Forecaster:
        # default-shape runs: 3 steps, as other modules record them (one recording per
        # session); the small shapes only here: 2 steps (iteration 1 already holds the
        # optimizer state, so its peak is every later iteration's)
        steps = 3 if extra[:1] != ("--layers",) else 2
        return _fx(recording(variant, nproc=nproc, steps=steps, extra=extra))

    return get


def _check(name: str, src: Forecaster, dst: Forecaster, tol: float, scale: float = 1.0,
           fix: str | None = None) -> float:
    """Forecast `dst`'s recorded settings from `src`; the relative error against dst's peak,
    which must lie in the error band the forecast states (forecast_band.py's stored pairs)."""
    b = dst.baseline()
    p = src.predict(Scenario(b.world_size, b.strategy, b.checkpointing, scale, fix, tp=b.tp))
    assert p.refused is None, p.refused
    recorded = dst.d.peak_bytes
    err = (p.predicted_peak_bytes - recorded) / recorded
    TABLE.append((name, p.predicted_peak_bytes, recorded, err))
    assert abs(err) <= tol, (name, p.predicted_peak_bytes, recorded, err)
    band = p.error_band
    assert band["validated"], band
    assert band["low"] <= err <= band["high"], (name, err, band)
    return err


# ---------------------------------------------------------------------------- fast: fixtures


def test_replaying_the_unchanged_run_gives_the_recorded_peak():
    for path in (BUGGY, FIXED):
        fx = _fx(path)
        p = fx.predict(fx.baseline())
        assert p.predicted_peak_bytes == fx.d.peak_bytes
        assert p.peak_row == fx.d.peak_row and p.phase == fx.d.phase_name(fx.d.peak_row)


def test_shards_halve_and_units_stay_when_the_world_doubles():
    fx = _fx(FIXED)
    b = fx.baseline()
    assert (b.world_size, b.strategy, b.checkpointing) == (2, "full_shard", "full")
    p2, p4 = fx.predict(b), fx.predict(Scenario(4, b.strategy, b.checkpointing))
    assert p4.peak_row == p2.peak_row  # same moment, so the same blocks are alive
    shard, unit = "shard", "unit"
    # FSDP pads each shard to ceil(numel / W): within a few elements per block of exactly half
    assert abs(p4.by_scaling[shard] - p2.by_scaling[shard] / 2) <= 64 * 8
    assert p4.by_scaling[unit] == p2.by_scaling[unit]
    # AdamW keeps two states per sharded parameter: optimizer state is all 1/W
    assert abs(p4.breakdown["optimizer_state"] - p2.breakdown["optimizer_state"] / 2) <= 64 * 8
    assert p4.predicted_peak_bytes < p2.predicted_peak_bytes


def test_strategies_move_unshards_and_no_shard_keeps_whole_state():
    fx = _fx(FIXED)
    b = fx.baseline()
    fs = fx.predict(b)
    sgo = fx.predict(Scenario(2, "shard_grad_op", b.checkpointing))
    # keeping five blocks unsharded from forward to backward costs memory somewhere
    assert sgo.predicted_peak_bytes > fs.predicted_peak_bytes
    ns = fx.predict(Scenario(2, "no_shard", b.checkpointing))
    assert "fsdp.unsharded_param" not in ns.breakdown  # nothing is gathered
    assert ns.by_scaling["shard"] > 1.9 * fs.by_scaling["shard"]  # state is whole, not 1/2
    # hsdp:2 on 4 ranks shards over 2: the recorded sharding, so the recorded peak
    assert fx.predict(Scenario(4, "hsdp:2", b.checkpointing)).predicted_peak_bytes == \
        fs.predicted_peak_bytes
    assert "divid" in fx.predict(Scenario(4, "hsdp:3", b.checkpointing)).refused


def test_cuda_shaped_recording_without_ranges_or_provenance():
    """The fixture edited to look like a CUDA recording (edits.cuda_shaped: stacks cut at the
    autograd engine, no profiler frames, no provenance), with and without FSDP's ranges."""
    from edits import cuda_shaped

    from snapforensics.snapshot import normalize, read_raw

    ref = _fx(FIXED)
    b = ref.baseline()
    for ranges in (True, False):
        s = normalize(cuda_shaped(read_raw(FIXED)[0], annotations=ranges), source=str(FIXED))
        fx = Forecaster(analyse(s, s.active_traces[0]))
        assert fx.d.fsdp.world.estimated and fx.w0 == 2  # from reduce-scatter sizes
        assert (fx.strategy, fx.checkpointing) == (b.strategy, b.checkpointing)
        for sc in (Scenario(4, b.strategy, b.checkpointing),
                   Scenario(2, "shard_grad_op", b.checkpointing),
                   Scenario(2, b.strategy, "none", 4.0)):
            want = ref.predict(sc).predicted_peak_bytes
            got = fx.predict(sc).predicted_peak_bytes
            # units named by FSDP's ranges: the same forecast; unnamed (events matched by
            # size): backward all-gather buffers stay with shard_grad_op (docs/forecast.md)
            assert abs(got - want) <= (0 if ranges else 0.15) * want, (ranges, sc, got, want)


def test_anomalous_run_is_forecast_as_recorded_and_with_the_fix():
    f = forecast(load(BUGGY), world_sizes=[2, 4])
    assert any("as recorded" in n and RESHARD in n for n in f.notes)
    plain = [p for p in f.scenarios if p.scenario.fix is None]
    fixed = [p for p in f.scenarios if p.scenario.fix == RESHARD]
    assert [p.scenario.world_size for p in plain] == [2, 4] == \
        [p.scenario.world_size for p in fixed]
    # the fix lowers every scenario; at the recorded world size it is the fixed run's peak
    # (a separate recording of the same script with set_reshard_after_backward(True))
    for a, b in zip(plain, fixed):
        assert b.predicted_peak_bytes < a.predicted_peak_bytes
    recorded_fixed = _fx(FIXED).d.peak_bytes
    assert abs(fixed[0].predicted_peak_bytes - recorded_fixed) / recorded_fixed <= 0.05


def test_capacity_finds_the_smallest_world_size_that_fits():
    fx = _fx(FIXED)
    at2 = fx.predict(fx.baseline()).predicted_peak_bytes
    f = forecast(load(FIXED), world_sizes=[2, 4, 8], capacity=at2 - 1)
    assert [p.fits for p in f.scenarios] == [False, True, True]
    assert f.fit["smallest_world_size"] == 4
    assert f.fit["peak_bytes_there"] <= at2 - 1


def test_frame_has_one_row_per_scenario():
    df = forecast_frame(FIXED, world_sizes=[2, 8], micro_batch_scales=[1, 2])
    assert len(df) == 4
    assert {"world_size", "strategy", "checkpointing", "micro_batch_scale",
            "predicted_peak_bytes", "phase", "refused"} <= set(df.columns)
    assert df["predicted_peak_bytes"].is_monotonic_increasing is False  # W=8 drops, x2 rises
    at = df.set_index(["world_size", "micro_batch_scale"])["predicted_peak_bytes"]
    assert at[(8, 1.0)] < at[(2, 1.0)] < at[(2, 2.0)]


def test_no_fsdp_refuses_world_size_but_scales_the_batch():
    path = corpus_file("NiuHuangxiaozi_fwd_bwd_200_mixed.pickle")
    f = forecast(load(path), world_sizes=[4], micro_batch_scales=[2])
    assert f.scenarios[0].refused and "no FSDP" in f.scenarios[0].refused
    f = forecast(load(path), micro_batch_scales=[1, 2])
    one, two = (p.predicted_peak_bytes for p in f.scenarios)
    assert one == f.baseline["peak_bytes"] and two > one


def test_checkpointing_without_units_is_refused():
    path = corpus_file("NiuHuangxiaozi_fwd_bwd_200_mixed.pickle")
    f = forecast(load(path), checkpointing=["full"])
    assert "module boundaries" in f.scenarios[0].refused


def test_parse_size():
    assert parse_size("80GiB") == 80 * 2 ** 30
    assert parse_size("512MB") == 512 * 10 ** 6
    assert parse_size("1e9B") == 10 ** 9
    with pytest.raises(ValueError):
        parse_size("lots")


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI in-process (as `python -m snapforensics` runs it): exit code, stdout, stderr."""
    from snapforensics.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_cli_json_contract_and_bad_arguments(tmp_path, capsys):
    out = tmp_path / "f.json"
    rc, _, err = _cli(capsys, "forecast", str(FIXED), "--world-size", "2,4", "--strategy",
                      "full_shard,shard_grad_op", "--capacity", "1GiB", "--format", "json",
                      "-o", str(out))
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert doc["schema"] == "snapforensics.forecast/1"
    assert doc["baseline"]["world_size"] == 2 and doc["baseline"]["strategy"] == "full_shard"
    assert len(doc["scenarios"]) == 4
    for s in doc["scenarios"]:
        assert {"world_size", "strategy", "checkpointing", "micro_batch_scale",
                "predicted_peak_bytes", "phase", "breakdown"} <= set(s)
        assert sum(s["breakdown"].values()) == s["predicted_peak_bytes"]
    for bad in (["--world-size", "four"], ["--strategy", "zero3"], ["--capacity", "lots"],
                ["--micro-batch-scale", "-1"], ["--checkpointing", "some"],
                # issue 21: out of range (int64 wrapped, -97% claimed, exit 70 before)
                ["--micro-batch-scale", "1e12,1e14,inf"], ["--world-size", str(10 ** 26)],
                ["--world-size", "1" + "0" * 400], ["--capacity", "1e400GiB"],
                ["--strategy", "hsdp:0"], ["--micro-batch-scale", "nan"],
                # issue 18: a bare number was read as bytes (80 B: "fits: NO" everywhere)
                ["--capacity", "80"],
                # a TP degree: a count up to MAX_TP (an internal KeyError before review)
                ["--tp", "0"], ["--tp", "x"], ["--tp", "5000"]):
        rc, _, err = _cli(capsys, "forecast", str(FIXED), *bad)
        assert rc == 2, (bad, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    rc, _, err = _cli(capsys, "forecast", str(tmp_path / "missing.pickle"))
    assert rc == 2 and err.startswith("snapforensics: error:")


def test_every_format_renders_the_same_scenarios(tmp_path):
    from snapforensics.report.registry import render

    f = forecast(load(BUGGY), world_sizes=[8], capacity=parse_size("1GiB"))
    for fmt in ("markdown", "html", "terminal"):
        text = render("forecast", f, fmt).replace("\\", "")  # markdown escapes `_`
        assert "full_shard" in text and RESHARD in text and "smallest world size" in text
    assert json.loads(render("forecast", f, "json"))["schema"] == "snapforensics.forecast/1"
    # the source path is the one string from outside: neutralized for each sink
    f.source = "<script>alert(1)</script>\x1b]52;c;cHduZWQ=\x07.pickle"
    assert "<script>" not in render("forecast", f, "html")
    assert "<script>" not in render("forecast", f, "markdown")
    assert "\x1b" not in render("forecast", f, "terminal")


# ---------------------------------------------------------------------------- slow: recorded


@slow
@pytest.mark.parametrize("variant,shape", [
    pytest.param("fixed", S1, marks=full), pytest.param("fsdp1", S2, marks=full), ("noac", S3)],
    ids=["fsdp2-ckpt-6x512", "fsdp1-4x256", "fsdp2-noac-4x128"])
def test_world_size_both_ways(rec, variant, shape):
    two, four = rec(variant, 2, shape), rec(variant, 4, shape)
    assert (two.w0, four.w0) == (2, 4)
    _check(f"{variant} {shape or 'default'}: W=4 from W=2", two, four, 0.05)
    _check(f"{variant} {shape or 'default'}: W=2 from W=4", four, two, 0.05)


@slow
@full
def test_world_size_four_times(rec):
    """The 4x pair (FSDP2, 4 x 128, 2 steps): W=8 forecast from the 2-rank recording and back,
    against the 8-rank run recorded (what lets the band call 1/4x..4x validated)."""
    two, eight = rec("noac", 2, S3), rec("noac", 8, S3)
    assert (two.w0, eight.w0) == (2, 8)
    _check("noac 4 x 128: W=8 from W=2", two, eight, 0.05)
    _check("noac 4 x 128: W=2 from W=8", eight, two, 0.05)


PIPELINE = ("--layers", "4", "--dim", "256")


@slow
@pytest.mark.parametrize("m", [8, 4])
def test_pipeline_schedule_forecast(m):
    """GPipe -> 1F1B at M micro-batches (the pipeline rule's replay, applied as the scenario's
    fix) forecast per stage from the GPipe recording, against the 1F1B recording of the same
    run; the worst stage forecast is the worst stage recorded."""
    from recordings import recorded_module

    from snapforensics.analysis.rules.pipeline_schedule import RULE as PIPE

    def stages(schedule):
        folder = recorded_module("snapforensics.examples.pipeline",
                                 ("--schedule", schedule, "--microbatches", str(m), *PIPELINE))
        return [_fx(folder / f"rank{r}.pickle") for r in (0, 1)]

    gpipe, one_f_one_b = stages("gpipe"), stages("1f1b")
    for s, (g, t) in enumerate(zip(gpipe, one_f_one_b)):
        _check(f"pipeline GPipe -> 1F1B, {m} micro-batches, stage {s}", g, t, 0.05, fix=PIPE.id)
    worst_forecast = max(range(2), key=lambda s: gpipe[s].predict(
        replace(gpipe[s].baseline(), fix=PIPE.id)).predicted_peak_bytes)
    assert worst_forecast == max(range(2), key=lambda s: one_f_one_b[s].d.peak_bytes)


@slow
def test_fsdp2_reshard_after_forward_both_ways(rec):
    true, false = rec("fixed"), rec("reshard_after_forward_false")
    assert (true.strategy, false.strategy) == ("full_shard", "shard_grad_op")
    _check("FSDP2 reshard_after_forward=False from True", true, false, 0.10)
    _check("FSDP2 reshard_after_forward=True from False", false, true, 0.10)


@slow
@full
def test_fsdp1_full_shard_and_shard_grad_op_both_ways(rec):
    fs, sgo = rec("fsdp1", 2, S2), rec("fsdp1_shard_grad_op_fp32", 2, S2)
    assert (fs.strategy, sgo.strategy) == ("full_shard", "shard_grad_op")
    _check("FSDP1 SHARD_GRAD_OP from FULL_SHARD", fs, sgo, 0.10)
    _check("FSDP1 FULL_SHARD from SHARD_GRAD_OP", sgo, fs, 0.10)


@slow
def test_checkpointing_both_ways(rec):
    # `noac` runs 4x the micro-batch of `fixed` (8 vs 2 sequences): both knobs at once
    ac, noac = rec("fixed"), rec("noac")
    assert (ac.checkpointing, noac.checkpointing) == ("full", "none")
    _check("checkpointing off, micro-batch x4, from on", ac, noac, 0.15, scale=4)
    _check("checkpointing on, micro-batch x1/4, from off", noac, ac, 0.15, scale=0.25)


@slow
@full
def test_micro_batch_times_two(rec):
    # without checkpointing, activations are ~45% of the peak at batch 8: the batch matters
    half, one = rec("noac", 2, ("--batch", "4")), rec("noac")
    _check("micro-batch x2 (no checkpointing, batch 4 -> 8)", half, one, 0.15, scale=2)
    _check("micro-batch x1/2 (no checkpointing, batch 8 -> 4)", one, half, 0.15, scale=0.5)


@slow
def test_anomalous_recording_gets_both_forecasts(rec):
    buggy, fixed = rec("buggy"), rec("fixed")
    assert RESHARD in buggy.fixes
    p = buggy.predict(buggy.baseline())
    assert p.predicted_peak_bytes == buggy.d.peak_bytes  # as recorded
    _check("buggy + fix (reshard_after_backward=True), vs fixed", buggy, fixed, 0.05,
           fix=RESHARD)


# ------------------------------------------------------------ issue 18: advice you can act on


def test_capacity_gives_no_advice_when_the_recorded_peak_fits(recording):
    """A run whose recorded peak fits gets no change recommended (before: micro_batch_scale=0.5
    with --capacity 80GiB); one that does not fit gets the cheapest change that does, the
    anomaly's fix first (it costs nothing)."""
    from snapforensics.report.registry import render

    fixed, buggy = load(recording("fixed")), load(recording("buggy"))
    f = forecast(fixed, capacity=parse_size("80GiB"))
    assert f.fit["recorded_fits"] and f.fit["cheapest_change"] is None
    text = render("forecast", f, "terminal")
    assert "already fits" in text and "cheapest change" not in text
    # below the recorded peak: a change is advised, and it fits
    peak = f.baseline["peak_bytes"]
    f = forecast(fixed, capacity=peak - 1)
    assert not f.fit["recorded_fits"]
    ch = f.fit["cheapest_change"]
    assert ch is None or ch["peak_bytes"] <= peak - 1
    # the buggy run fits once fixed (the fixed run's peak): the fix is the advice
    f = forecast(buggy, capacity=peak)
    assert f.fit["cheapest_change"]["change"] == {"fix": RESHARD}


def test_checkpointing_none_keeps_activations_where_the_buggy_run_peaks(recording):
    """The buggy example keeps its parameters unsharded after step 0's backward, so steps 1
    and 2 gather nothing in forward: their units come from FSDP's pre_forward ranges, and
    checkpointing none moves their recompute into forward (before: no unit in step 1, where
    the peak is, so none gave the bytes of full)."""
    buggy = _fx(recording("buggy"))
    assert all(buggy.units[it.index] for it in buggy.d.tl.iterations)
    full = buggy.predict(Scenario(8, "full_shard", "full"))
    none = buggy.predict(Scenario(8, "full_shard", "none"))
    assert none.predicted_peak_bytes > full.predicted_peak_bytes
    # where the peak does not move (W=2: end of backward, activations freed) the output says why
    f = forecast(load(recording("buggy")), checkpointing=["none", "full"])
    plain = [p for p in f.scenarios if p.scenario.fix is None]
    assert plain[0].predicted_peak_bytes == plain[1].predicted_peak_bytes
    assert any("checkpointing none gives the same peak" in n for n in f.notes)


def test_buggy_run_with_its_fix_forecasts_like_the_fixed_run(recording):
    """The same scenario from the buggy run with its fix applied and from the fixed recording
    (before: 91.3 vs 107.3 MiB for W=8 checkpointing none)."""
    buggy, fixed = _fx(recording("buggy")), _fx(recording("fixed"))
    for w in (2, 8, 64):
        for ckpt in ("none", "full"):
            sc = Scenario(w, "full_shard", ckpt)
            a = buggy.predict(replace(sc, fix=RESHARD)).predicted_peak_bytes
            b = fixed.predict(sc).predicted_peak_bytes
            assert abs(a - b) <= 0.01 * b, (sc, a / 2**20, b / 2**20)


def test_every_scenario_carries_its_error_band_and_says_what_was_never_validated(recording):
    from snapforensics.analysis.forecast import band as forecast_band
    from snapforensics.report.registry import render

    f = forecast(load(recording("fixed")), world_sizes=[2, 4, 8, 16, 64],
                 strategies=["full_shard", "hsdp:2"])
    by = {(p.scenario.world_size, p.scenario.strategy): p.error_band for p in f.scenarios}
    assert by[(2, "full_shard")] == {"low": 0, "high": 0, "pairs": 0, "changes": [],
                                     "validated": True, "not_validated": []}
    w4 = by[(4, "full_shard")]
    assert w4["validated"] and w4["pairs"] >= 2 and w4["low"] <= 0 <= w4["high"]
    assert by[(8, "full_shard")]["validated"]  # 4x: the 2 <-> 8 pair
    assert not by[(16, "full_shard")]["validated"]
    assert "8x the recorded 2" in by[(16, "full_shard")]["not_validated"][0]
    assert not by[(64, "full_shard")]["validated"]
    assert "32x the recorded 2" in by[(64, "full_shard")]["not_validated"][0]
    assert not by[(4, "hsdp:2")]["validated"]
    text = render("forecast", f, "markdown").replace("\\", "")
    assert "NOT VALIDATED" in text and "not validated: W=64" in text
    assert forecast_band.SOURCE.split(",")[0] in text
    doc = json.loads(render("forecast", f, "json"))
    assert all("error_band" in s for s in doc["scenarios"])
    # the stored band holds what these recordings measure: the fix pair, remeasured
    buggy, fixed = _fx(recording("buggy")), _fx(recording("fixed"))
    p = buggy.predict(replace(fixed.baseline(), fix=RESHARD))
    err = (p.predicted_peak_bytes - fixed.d.peak_bytes) / fixed.d.peak_bytes
    assert p.error_band["low"] <= err <= p.error_band["high"], (err, p.error_band)


def test_help_and_reports_point_to_installed_text_not_the_repository(capsys):
    from snapforensics.report.registry import render

    rc, out, _ = _cli(capsys, "forecast", "--help")
    assert rc == 0 and "docs/forecast.md" not in out
    assert "Error band" in out and "NOT VALIDATED" in out and "80GiB" in out
    f = forecast(load(FIXED))
    for fmt in ("terminal", "markdown", "html"):
        text = render("forecast", f, fmt)
        assert "docs/forecast.md" not in text and "forecast --help" in text.replace("\\", "")


PIPE_LAYOUT = ("--layers", "8", "--dim", "256")
# A pair's errors as stored in a table were measured on one recording of each layout; a fresh
# recording of the same layout on another machine moved one of them by 0.33% (FSDP under the
# looped runtime, S=2 M=8 GPipe -> S=2x2 M=4 interleaved: the CI clone at f4d8dc7, where three
# recordings here, idle and under load, were byte-identical). The checks allow 1% either side of
# the stored pair: a regression of the forecast still fails them, a re-recording does not.
RERECORDED = 0.01


def _timing_slack(*runs: Iterable) -> float:
    """How far a communication thread's timing can move the compared peaks, as a fraction of
    the smallest: the largest pipeline receive buffer (`pp.p2p_buffer`) each run's recorder saw
    freed on a thread the profiler does not trace (`free_on_untraced_thread`, record/cpu.py),
    summed over the runs. Such a buffer is freed when gloo's thread drops its last reference,
    or by the program's thread when that thread lets go last: which one, the scheduler decides,
    and the run holds the buffer longer when gloo's does. (A collective's buffers freed on
    gloo's worker thread are not counted: the recorder places their frees at the collective's
    end, whenever the thread gets to them.) TP inside the stages, CI moved a pair by exactly one
    such buffer twice (S=2 M=8 gpipe tp=2 -> tp=4, the last stage: -0.71%, 262,144 B, at
    9ad3547; S=2 M=4 1f1b tp=2 -> S=2 M=8 1f1b tp=4, the first stage: +2.98%, 524,288 B of the
    source, at b9dc7f8), where recordings here, idle, under load and at five collector
    thresholds, were byte-identical; here the tp=4 run's stage-boundary ranks freed a gradient
    receive buffer on gloo's thread in one recording and in none of another, with equal peaks.
    A run without such frees gets no slack."""
    from snapforensics.record.cpu import INFERRED_FREE_FRAME

    total, peaks = 0, []
    for run in runs:
        biggest = 0
        for d in run:
            peaks.append(d.peak_bytes)
            freed = np.flatnonzero(d.mask(Category.PP_P2P) & (d.lt.free_row < d.lt.rows))
            for b in freed.tolist():
                sid = int(d.trace.stack[d.lt.free_row[b]])
                frames = d.snapshot.stack_frames(sid) if sid >= 0 else []
                if frames and tuple(frames[0]) == INFERRED_FREE_FRAME:
                    biggest = max(biggest, int(d.lt.size[b]))
        total += biggest
    return total / min(peaks) if peaks else 0.0


def _pipeline_run(stages: int, schedule: str, m: int, layout: tuple[str, ...] = PIPE_LAYOUT):
    """The bundled pipeline example recorded at `stages` stages: its analyses, its truth."""
    import json

    from recordings import recorded_module

    folder = recorded_module("snapforensics.examples.pipeline",
                             ("--schedule", schedule, "--microbatches", str(m), *layout),
                             nproc=stages)
    out = []
    for r in range(stages):
        s = load(folder / f"rank{r}.pickle")
        truth = json.loads((folder / f"truth.rank{r}.json").read_text())
        out.append((analyse(s, s.active_traces[0]), truth))
    return out


@slow
@pytest.mark.parametrize("source", [(s, m, k) for s in (2, 4) for m in (8, 4)
                                    for k in ("gpipe", "1f1b")],
                         ids=lambda x: f"from-S{x[0]}-M{x[1]}-{x[2]}")
def test_pipeline_layout_forecast(source):
    """Each stage's peak at another stage count, micro-batch count and schedule, forecast from
    one recording (every stage's file; 1F1B's micro-batches cut at the recorder's marks) against
    the run recorded in that layout: the
    micro-batches each stage holds equal the running schedule's count (the example's truth,
    counted by wrapping the stage's own forward/backward), every error lies in the band stored
    in forecast/pipeline.py, and the stage named worst is the worst recorded (within a tie)."""
    from snapforensics.analysis.forecast import pipeline as pf

    src = _pipeline_run(source[0], source[2], source[1])
    analyses = [d for d, _ in src]
    assert [pf.source(d).layers for d in analyses] == [8 // source[0]] * source[0]
    pairs = {(p[0], p[1]): p for p in pf.PAIRS}
    name = f"S={source[0]} M={source[1]} {source[2]}"
    checked = 0
    for (a, target), (_, _, lo, hi) in pairs.items():
        if a != name:
            continue
        stages, m, schedule = (int(target.split()[0][2:]), int(target.split()[1][2:]),
                               target.split()[2])
        twin = _pipeline_run(stages, schedule, m)
        doc = pf.pipeline_forecast(analyses, [stages], [m], [schedule])
        sc, = doc.scenarios
        errors = []
        for p, (d, truth) in zip(sc["per_stage"], twin):
            assert truth["stage"] == p["stage"]
            assert p["held_microbatches"] == max(truth["held_per_step"]), (target, p)
            errors.append((p["predicted_peak_bytes"] - d.peak_bytes) / d.peak_bytes)
        print(f"pipeline {name} -> {target}: " + " ".join(f"{e:+.2%}" for e in errors))
        slack = RERECORDED + _timing_slack(analyses, [d for d, _ in twin])
        assert lo - slack <= min(errors) and max(errors) <= hi + slack, (target, errors, lo, hi)
        assert max(abs(e) for e in errors) <= 0.05, (target, errors)
        assert sc["error_band"]["validated"] and not sc["error_band"]["exact"]
        peaks = [d.peak_bytes for d, _ in twin]
        assert peaks[sc["worst_stage"]] >= 0.99 * max(peaks), (target, sc["worst_stage"], peaks)
        checked += 1
    assert checked == 7


@slow
def test_pipeline_forecast_command():
    """`forecast FOLDER --pp ...` through the CLI: the JSON names each stage and the worst; a
    1F1B recording (cut at the recorder's marks, every step) forecasts GPipe; a run without a
    pipeline, a bad --schedule and micro-batches past the bound are one-line errors, exit 2."""
    import json

    from recordings import recorded_module, run_cli

    gpipe = recorded_module("snapforensics.examples.pipeline",
                            ("--schedule", "gpipe", "--microbatches", "8", *PIPE_LAYOUT))
    p = run_cli(["forecast", str(gpipe), "--pp", "2,4,3", "--schedule", "1f1b",
                 "--format", "json"])
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["recorded"] | {"peaks": None} == {
        "stages": 2, "virtual_stages": 1, "microbatches": 8, "schedule": "gpipe", "layers": 4,
        "world_size": None, "tp": None, "stage_files": [0, 1], "peaks": None}
    two, four, three = doc["scenarios"]
    assert [s["held_microbatches"] for s in four["per_stage"]] == [4, 3, 2, 1]
    assert four["worst_stage"] == 0 and two["worst_stage"] == 0
    assert all(s["refused"] and "do not split evenly" in s["refused"]
               for s in three["per_stage"])
    # the terminal report names the worst stage of each scenario (the JSON's), not only a column
    text = run_cli(["forecast", str(gpipe), "--pp", "4", "--schedule", "1f1b"]).stdout
    assert f"4 stages, 8 micro-batches, 1f1b: worst stage {four['worst_stage']} at" in text
    # from one stage's file the others are rebuilt from its blocks: said (the folder's are not)
    assert not any("recorded here" in n for n in doc["notes"])
    one = json.loads(run_cli(["forecast", str(gpipe / "rank0.pickle"), "--schedule", "1f1b",
                              "--format", "json"]).stdout)
    assert any("only stage(s) 0 of 2 recorded here" in n for n in one["notes"]), one["notes"]
    one_f = recorded_module("snapforensics.examples.pipeline",
                            ("--schedule", "1f1b", "--microbatches", "8", *PIPE_LAYOUT))
    p = run_cli(["forecast", str(one_f), "--schedule", "gpipe", "--format", "json"])
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["recorded"]["schedule"] == "1f1b"
    assert [s["held_microbatches"] for s in doc["scenarios"][0]["per_stage"]] == [8, 8]
    # the recorder marked every step's micro-batches, the first too (torch opens no range
    # around 1F1B's)
    from snapforensics.analysis.forecast import pipeline as pf

    for r in (0, 1):
        steps = pf.stage_steps(_fx(one_f / f"rank{r}.pickle").d)
        assert [s.schedule for s in steps] == ["1f1b", "1f1b"], steps
    # a run with no pipeline at all (the FSDP fixture), and a bad --schedule
    for args in ([str(FIXED), "--pp", "4"], [str(gpipe), "--schedule", "zb"],
                 [str(gpipe), "--schedule", "interleaved:1"],
                 [str(gpipe), "--microbatches", "5000"],
                 [str(gpipe), "--pp", "4", "--strategy", "no_shard"]):  # not silently dropped
        p = run_cli(["forecast", *args])
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "Traceback" not in p.stderr
    # another FSDP world size or TP degree goes with the pipeline's changes; a run with neither
    # FSDP nor TP names refuses them on every stage, saying why
    p = run_cli(["forecast", str(gpipe), "--pp", "4", "--world-size", "8", "--tp", "1,2",
                 "--format", "json"])
    assert p.returncode == 0, p.stderr
    scen = json.loads(p.stdout)["scenarios"]
    assert [(s["world_size"], s["tp"]) for s in scen] == [(8, 1), (8, 2)]
    assert all("no FSDP" in st["refused"] for s in scen for st in s["per_stage"])
    p = run_cli(["forecast", str(gpipe), "--pp", "4", "--tp", "2", "--format", "json"])
    scen = json.loads(p.stdout)["scenarios"]
    assert all("tensor parallelism" in st["refused"] for st in scen[0]["per_stage"])


@slow
def test_dp_degree_on_a_2d_mesh():
    """FSDP2 + TP on a 2-D mesh (dp_shard x tp 2, `examples/tp.py --dp`): the world size a
    forecast reads is the dp_shard degree of the running mesh (its process groups), not the
    world; dp_shard 2 -> 4 (4 -> 8 ranks) and back, every rank against the recorded twin."""
    import json

    from recordings import recorded_module

    small = ("--layers", "2", "--dim", "64", "--seq", "64", "--batch", "2", "--steps", "2")
    runs = {}
    for dp in (2, 4):
        folder = recorded_module("snapforensics.examples.tp", (*small, "--dp", str(dp)),
                                 nproc=2 * dp)
        runs[dp] = [(_fx(folder / f"rank{r}.pickle"),
                     json.loads((folder / f"truth.rank{r}.json").read_text()))
                    for r in range(2 * dp)]
    for dp, ranks in runs.items():
        assert all(fx.w0 == truth["dp"] == dp and truth["tp"] == 2 for fx, truth in ranks)
    for a, b in ((2, 4), (4, 2)):
        for r, (fx, _) in enumerate(runs[a]):
            twin = runs[b][r % (2 * b)][0]  # the same TP rank (rank = dp index * 2 + tp index)
            _check(f"FSDP2 + TP 2 (2-D mesh): dp_shard {b} from {a}, rank {r}", fx, twin, 0.05)


@slow
def test_dp_and_tp_degree_together():
    """FSDP2 + TP on a 2-D mesh, the dp_shard degree and the TP degree changed at once (8 ranks
    both ways: dp_shard 4 x TP 2 <-> dp_shard 2 x TP 4), every rank against the twin's rank of
    the same dp and TP index (modulo the twin's degrees): validated (a recorded combination,
    band.COMBINED), within 5%."""
    import json

    from recordings import recorded_module

    runs = {}
    for dp, tp in ((4, 2), (2, 4)):
        folder = recorded_module("snapforensics.examples.tp", (*TP_SMALL, "--dp", str(dp)),
                                 nproc=dp * tp)
        runs[dp, tp] = [(_fx(folder / f"rank{r}.pickle"),
                         json.loads((folder / f"truth.rank{r}.json").read_text()))
                        for r in range(dp * tp)]
    for (dp, tp), ranks in runs.items():
        assert all((fx.w0, fx.tp[0], t["dp"], t["tp"]) == (dp, tp, dp, tp) for fx, t in ranks)
    for a, b in (((4, 2), (2, 4)), ((2, 4), (4, 2))):
        for r, (fx, _) in enumerate(runs[a]):
            i, j = divmod(r, a[1])  # rank = dp index * tp + tp index
            twin = runs[b][(i % b[0]) * b[1] + j % b[1]][0]
            err = _check(f"FSDP2 + TP: dp_shard {b[0]} x TP {b[1]} from dp_shard {a[0]} x "
                         f"TP {a[1]}, rank {r}", fx, twin, 0.05)
            assert fx.predict(replace(twin.baseline(), tp=b[1])).error_band["changes"] == [
                "world_size", "tp"], err


TP_SMALL = ("--layers", "2", "--dim", "64", "--seq", "64", "--batch", "2", "--steps", "2")
TP_LAYOUTS = {"tp": (), "tp_sp": ("--sp",), "fsdp_tp_2d": ("--dp", "2")}


@slow
@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_tp_degree_both_ways(layout):
    """The TP degree (`forecast --tp`): `examples/tp.py` recorded at TP 2 and TP 4 (torchtitan's
    plan; with SequenceParallel; FSDP2 + TP on a 2-D mesh, dp_shard 2 kept), each rank's peak
    forecast at the other degree against the recorded twin's. The recorded degree the forecast
    reads (the most ways the recorder saw TP split a tensor) is the running mesh's."""
    import json

    from recordings import recorded_module

    args = TP_LAYOUTS[layout]
    dp = 2 if "--dp" in args else 1
    runs = {}
    for tp in (2, 4):
        folder = recorded_module("snapforensics.examples.tp", (*TP_SMALL, *args), nproc=tp * dp)
        runs[tp] = [(_fx(folder / f"rank{r}.pickle"),
                     json.loads((folder / f"truth.rank{r}.json").read_text()))
                    for r in range(tp * dp)]
    for tp, ranks in runs.items():
        assert all(fx.tp[0] == truth["tp"] == tp and truth["dp"] == dp for fx, truth in ranks)
    for a, b in ((2, 4), (4, 2)):
        for r, (fx, _) in enumerate(runs[a]):
            twin = runs[b][(r // a) * b][0]  # the same dp index (rank = dp index * tp + tp index)
            _check(f"{layout}: TP {b} from {a}, rank {r}", fx, twin, 0.05)
    # the fleet names the worst rank's TP index; without FSDP the mesh is 1-D over the world and
    # names no group of its own (torch reuses the default one): read from its blocks' TP work
    from snapforensics import parallel
    from snapforensics.analysis.fleet import fleet

    f = fleet(parallel.run(sorted(folder.glob("rank*.pickle")), jobs=1, progress=False))
    assert f.statement["tp"] == 4 and f.statement["tp_rank"] in range(4), f.statement


LM_TP = {"tp": (), "tp_sp": ("--sp",)}


def _lm_tp(tp: int, args: tuple[str, ...]) -> list[Forecaster]:
    """tests/lm_tp.py (a Llama-like decoder under torchtitan's whole TP plan, the loss under
    loss_parallel) on `tp` ranks: each rank's forecaster."""
    from recordings import recorded_script

    folder = recorded_script(Path(__file__).parent / "lm_tp.py", args, nproc=tp)
    return [_fx(folder / f"rank{r}.pickle") for r in range(tp)]


@slow
@pytest.mark.parametrize("layout", LM_TP)
def test_tp_language_model(layout):
    """What a real TP run puts around the blocks (tests/lm_tp.py: embeddings sharded over the
    vocabulary, the head's logits kept sharded by loss_parallel, AdamW), recorded at TP 2, 4
    and 8: each rank forecast from TP 2 to 4 and 8 and back, within the stored band (TP 8 <-> 2
    is what validates 1/4x..4x), and without SequenceParallel the rule's saving checked against
    the --sp twin at each degree.

    What it caught: the logits the script holds through backward (a DTensor's local shard, which
    autograd does not save, so no name reached it) were taken as replicated: TP 4 from 2 was
    7.9% high, TP 2 from 4 5.3% low, TP 2 from 8 25% low (at TP 8 the logits' shard is the
    whole embedding's size, and its gradient, named, had vetoed that size). And the embedding's
    RowwiseParallel all-reduce made the whole model a "TP module", so the rule shrank nothing:
    its predicted peak was 6.9% (TP 2) and 19.6% (TP 4) above the SP twin's."""
    args = LM_TP[layout]
    runs = {tp: _lm_tp(tp, args) for tp in (2, 4, 8)}
    for tp, ranks in runs.items():  # the degree read is the running mesh's (TP over every rank)
        assert all(fx.tp[0] == tp for fx in ranks), [fx.tp[0] for fx in ranks]
        assert all(fx.loss_parallel for fx in ranks)
    for a, b in ((2, 4), (4, 2), (2, 8), (8, 2)):
        for r, fx in enumerate(runs[a]):
            _check(f"Llama-like TP, {layout}: TP {b} from {a}, rank {r}", fx, runs[b][0], 0.05)
    # to TP 1 the loss is the plain cross-entropy: said, not validated
    src = runs[2][0]
    band = src.predict(replace(src.baseline(), tp=1)).error_band
    assert not band["validated"] and "loss_parallel" in band["not_validated"][0], band
    if layout == "tp_sp":
        return
    # the fleet names the worst rank's TP index and degree, and does not say the files hide it
    from recordings import recorded_script

    from snapforensics import parallel
    from snapforensics.analysis.fleet import fleet
    from snapforensics.report import fleet as report

    folder = recorded_script(Path(__file__).parent / "lm_tp.py", args, nproc=4)
    f = fleet(parallel.run([folder / f"rank{r}.pickle" for r in range(4)], jobs=1,
                           progress=False))
    assert f.statement["tp"] == 4 and f.statement["tp_rank"] in range(4), f.statement
    assert "tensor-parallel rank" not in report.statement(f)
    for tp in (2, 4, 8):  # the rule's fix: its finding, and the forecast's scenario (the band)
        twin = max(fx.d.peak_bytes for fx in _lm_tp(tp, ("--sp",)))
        for fx in runs[tp]:
            f, = (f for f in fx.findings if f.rule == "tp.sequence_parallel_off")
            assert f.verdict == Verdict.ANOMALOUS, f
            err = (f.predicted_peak_bytes - twin) / twin
            print(f"SP rule, Llama-like TP {tp}: {err:+.2%}")
            assert abs(err) <= 0.05, (tp, f.predicted_peak_bytes, twin)
            assert not {"Llama_0"} & set(f.evidence["tp_modules"]), f.evidence
            p = fx.predict(replace(fx.baseline(), fix=f.rule))
            assert p.predicted_peak_bytes == f.predicted_peak_bytes
            assert p.error_band["validated"], p.error_band
            assert p.error_band["low"] <= err <= p.error_band["high"], (tp, err, p.error_band)
    # the fix at another TP degree at once: what SP leaves split is split that degree's way
    # (with the recorded degree's split kept, TP 4 with SP from TP 2 without was 7.7% high)
    twins = {tp: max(fx.d.peak_bytes for fx in _lm_tp(tp, ("--sp",))) for tp in (2, 4, 8)}
    for a, b in ((2, 4), (2, 8), (4, 2), (4, 8), (8, 2), (8, 4)):
        fx = runs[a][0]
        p = fx.predict(replace(fx.baseline(), tp=b, fix="tp.sequence_parallel_off"))
        err = (p.predicted_peak_bytes - twins[b]) / twins[b]
        print(f"SP fix, Llama-like TP {a} -> TP {b} with SP: {err:+.2%}")
        assert p.error_band["validated"], p.error_band
        assert p.error_band["low"] <= err <= p.error_band["high"], (a, b, err, p.error_band)


def _gpt_tp(tp: int, sp: bool) -> Forecaster:
    """tests/gpt_tp.py (a GPT-2-like decoder: LayerNorm, a ColwiseParallel head whose logits
    are gathered, the plain cross-entropy) on `tp` ranks: rank 0's forecaster."""
    from recordings import recorded_script

    folder = recorded_script(Path(__file__).parent / "gpt_tp.py", ("--sp",) if sp else (),
                             nproc=tp)
    return _fx(folder / "rank0.pickle")


@slow
def test_tp_gathered_logits_stay_whole():
    """A head whose logits are gathered (`output_layouts=Replicate()`, no loss_parallel): the
    loss's gradients of them, unnamed and of the MLP hidden's split size at TP 2, are whole at
    every degree (what a forward all-gather makes is replicated). Read as split, TP 4 from 2
    was 4.1% low, and with the SP fix 7.0% low (its peak is at the loss's gradients)."""
    runs = {tp: _gpt_tp(tp, False) for tp in (2, 4)}
    twins = {tp: _gpt_tp(tp, True) for tp in (2, 4)}
    for a, b in ((2, 4), (4, 2)):
        _check(f"GPT-2-like TP, gathered logits: TP {b} from {a}", runs[a], runs[b], 0.05)
        p = runs[a].predict(replace(runs[a].baseline(), tp=b, fix="tp.sequence_parallel_off"))
        err = (p.predicted_peak_bytes - twins[b].d.peak_bytes) / twins[b].d.peak_bytes
        print(f"SP fix, GPT-2-like TP {a} -> TP {b} with SP: {err:+.2%}")
        assert abs(err) <= 0.05, (a, b, err)
        assert p.error_band["low"] <= err <= p.error_band["high"], (a, b, err, p.error_band)


def test_tp_degree_without_tp_names_is_refused():
    """A recording with no tensor TP splits (the FSDP fixture) refuses another TP degree and
    says why; its other scenarios are unchanged."""
    fx = _fx(FIXED)
    assert fx.tp[0] is None
    p = fx.predict(replace(fx.baseline(), tp=4))
    assert p.refused and "tensor parallelism" in p.refused
    assert fx.predict(fx.baseline()).predicted_peak_bytes == fx.d.peak_bytes
    # the report keeps the TP column for the refused rows (they would read alike without it)
    from snapforensics.report import render

    def header(doc) -> list[str]:
        line = next(x for x in render("forecast", doc, "markdown").splitlines()
                    if x.startswith("| W |"))
        return [c.strip() for c in line.strip("|").split("|")]

    assert "TP" in header(forecast(load(FIXED), tps=[2, 4]))
    assert "TP" not in header(forecast(load(FIXED)))


def _fsdp_pipeline_run(stages: int, schedule: str, m: int, dp: int = 2):
    """The pipeline example with FSDP2 sharding each stage over `dp` ranks (--dp, a (pp,
    dp_shard) mesh, as torchtitan composes them): each rank's analysis and truth."""
    return _mesh_run(stages, m, schedule, dp)


def _check_fsdp_pair(source: tuple, target: tuple) -> list[float]:
    """One FSDP + PP pair ((stages, micro-batches, schedule[, FSDP world size: 2])), checked
    by `_check_mesh_pair` against its stored table (FSDP_PAIRS, FSDP_INTERLEAVED_PAIRS, or
    with another world size FSDP_WORLD_PAIRS, FSDP_WORLD_INTERLEAVED_PAIRS), validated; the
    stages the sources cut are the ones the running stages were."""
    from snapforensics.analysis.forecast import pipeline as pf

    source, target = (*source, 2)[:4], (*target, 2)[:4]
    src = _mesh_run(source[0], source[1], source[2], source[3])
    assert [pf.source(d).stage for d, _ in src] == [t["stage"] for _, t in src]
    looped = target[2] == "interleaved"
    world = source[3] != target[3]
    pairs = {(False, False): pf.FSDP_PAIRS, (True, False): pf.FSDP_INTERLEAVED_PAIRS,
             (False, True): pf.FSDP_WORLD_PAIRS,
             (True, True): pf.FSDP_WORLD_INTERLEAVED_PAIRS}[(looped, world)]
    name = "S={0} M={1} {2}" + (" dp={3}" if world else "")
    return _check_mesh_pair(source, target, pairs, name,
                            world_sizes=[target[3]] if world else [])


@slow
def test_pipeline_fsdp_forecast():
    """FSDP2 + PP (each stage fully_shard-ed over its dp group): torch's pipelining keeps what a
    backward gathers until the next forward reshards it, so GPipe's backwards gather once and
    1F1B's after every forward; the rebuild replays each unit's gathers in the new order.
    GPipe <-> 1F1B at 2 stages and both to 4 stages and 1F1B (8 ranks), within the measured
    band; copying the recorded operations' gathers instead was off by -12%..+37%."""
    layouts = [(2, 8, "gpipe"), (2, 8, "1f1b")]
    for source in layouts:
        for target in [x for x in layouts if x != source] + [(4, 8, "1f1b")]:
            assert max(abs(e) for e in _check_fsdp_pair(source, target)) <= 0.05
    # and to ScheduleInterleaved1F1B, 2 FSDP roots per rank, each replaying its own gathers
    assert max(abs(e) for e in _check_fsdp_pair((2, 8, "gpipe"), (2, 4, "interleaved"))) <= 0.05


@slow
def test_pipeline_fsdp_world_forecast():
    """FSDP + PP at another FSDP world size (the ranks FSDP shards each stage over) with the
    pipeline's changes: the stage's shards scale by w0 / w as the world-size forecast scales
    them, inside the rebuilt step. dp 2 -> 4 at the same layout, and dp 4 at 2 stages -> dp 2 at
    4 stages (8 ranks both), within the stored band; without the world size the first misses by
    more than 3% (the shards are what changes)."""
    from snapforensics.analysis.forecast import pipeline as pf

    same = _check_fsdp_pair((2, 8, "1f1b", 2), (2, 8, "1f1b", 4))
    assert max(abs(e) for e in same) <= 0.005
    assert max(abs(e) for e in _check_fsdp_pair((2, 8, "1f1b", 4), (4, 8, "1f1b", 2))) <= 0.05
    assert max(abs(e) for e in _check_fsdp_pair((2, 8, "1f1b", 4), (2, 4, "interleaved"))) <= 0.05
    src = _fsdp_pipeline_run(2, "1f1b", 8, 2)
    sc, = pf.pipeline_forecast([d for d, _ in src], [2], [8], ["1f1b"]).scenarios
    twin = max(d.peak_bytes for d, _ in _fsdp_pipeline_run(2, "1f1b", 8, 4))
    assert sc["worst_peak_bytes"] > 1.03 * twin  # the dp 2 shards kept: too high
    # past the pairs' ratio the band says so; a stage without FSDP refuses another world size
    far, = pf.pipeline_forecast([d for d, _ in src], [2], [8], ["1f1b"],
                                world_sizes=[16]).scenarios
    assert not far["error_band"]["validated"]
    assert any("FSDP world size 16" in w for w in far["error_band"]["not_validated"])
    plain = _pipeline_run(2, "1f1b", 8)
    sc, = pf.pipeline_forecast([d for d, _ in plain], [2], [8], ["1f1b"],
                               world_sizes=[4]).scenarios
    assert all("no FSDP" in p["refused"] for p in sc["per_stage"])


@full
@pytest.mark.parametrize("source", [(s, m, k, 2) for s in (2, 4) for m in (8, 4)
                                    for k in ("gpipe", "1f1b")] +
                         [(2, m, k, 4) for m in (8, 4) for k in ("gpipe", "1f1b")],
                         ids=lambda x: f"from-S{x[0]}-M{x[1]}-{x[2]}-dp{x[3]}")
def test_pipeline_fsdp_world_layout_forecast(source):
    """Every FSDP + PP layout at dp 2 forecast to every one recorded at dp 4 (2 stages, 8 ranks)
    and back, with the world size (FSDP_WORLD_PAIRS)."""
    other = 4 if source[3] == 2 else 2
    for target in [(s, m, k, other) for s in ((2,) if other == 4 else (2, 4)) for m in (8, 4)
                   for k in ("gpipe", "1f1b")]:
        _check_fsdp_pair(source, target)
    for m in (8, 4):  # ScheduleInterleaved1F1B, 2 x 2 stages
        _check_fsdp_pair(source, (2, m, "interleaved", other))


@slow
def test_schedule_fix_scenario_frees_nothing_before_it_is_made(monkeypatch):
    """A forecast scenario that applies pipeline.all_forward_before_backward's fix takes the rows
    its 1F1B replay moves (allocations earlier, frees later too): the replayed trace never goes
    below zero live bytes, and its peak is the rule's own prediction. Combined by earliest free
    and latest allocation (as the FSDP fixes are), the `--dp 2` run went down to -73 MB."""
    from dataclasses import replace as swap

    from recordings import recorded_module

    from snapforensics.analysis.forecast import replay as fr

    folder = recorded_module("snapforensics.examples.pipeline",
                             ("--schedule", "gpipe", "--microbatches", "8", "--dp", "2",
                              *PIPE_LAYOUT), nproc=4)
    lows = []
    real = fr.evaluate

    def watch(d, p, sizes, cls):
        extra = [(a, e, int(sizes[b])) for b, a, e in p.copies] + p.fixed_extra
        live = d.lt.replay(free_row=p.free_row, alloc_row=p.alloc_row,
                           size=np.where(p.keep, sizes, 0), extra=extra)
        lows.append(int(live.min()))
        return real(d, p, sizes, cls)

    monkeypatch.setattr(fr, "evaluate", watch)
    for r in (0, 3):
        f = _fx(folder / f"rank{r}.pickle")
        rule = next(x for x in f.anomalies if x.rule == "pipeline.all_forward_before_backward")
        p = f.predict(swap(f.baseline(), fix=rule.rule))
        assert p.predicted_peak_bytes == rule.predicted_peak_bytes
    assert lows and min(lows) >= 0, lows


@slow
def test_pipeline_fsdp_without_ranges_is_not_validated(monkeypatch):
    """A stage FSDP shards whose trace lacks FSDP2's per-unit ranges (the file loses its
    annotations): the gathers cannot be placed, so they are copied as recorded and every
    scenario says NOT VALIDATED with that reason; and a scenario whose rebuilt step would run
    past the row bound is one SnapError line, not a memory blow-up."""
    from dataclasses import replace as swap

    from recordings import recorded_module

    from snapforensics.analysis.forecast import pipeline as pf
    from snapforensics.errors import SnapError

    folder = recorded_module("snapforensics.examples.pipeline",
                             ("--schedule", "gpipe", "--microbatches", "8", "--dp", "2",
                              *PIPE_LAYOUT), nproc=4)
    bare = []
    for r in range(4):
        s = load(folder / f"rank{r}.pickle")
        s = swap(s, annotations=[a for a in s.annotations if not a.name.startswith("FSDP::")])
        bare.append(analyse(s, s.active_traces[0]))
    assert all(pf.source(d).gathered is None for d in bare)
    sc, = pf.pipeline_forecast(bare, [2], [8], ["1f1b"]).scenarios
    assert not sc["error_band"]["validated"]
    assert any("cannot be replayed" in w for w in sc["error_band"]["not_validated"])
    monkeypatch.setattr(pf, "MAX_ROWS", 1000)
    with pytest.raises(SnapError, match="rows"):
        pf.pipeline_forecast(bare, [2], [8], ["interleaved:2"])


@full
@pytest.mark.parametrize("source", [(s, m, k) for s in (2, 4) for m in (8, 4)
                                    for k in ("gpipe", "1f1b")],
                         ids=lambda x: f"from-S{x[0]}-M{x[1]}-{x[2]}")
def test_pipeline_fsdp_layout_forecast(source):
    """Every FSDP + PP layout (2 and 4 stages, 4 and 8 micro-batches, GPipe and 1F1B, 4 and 8
    ranks) forecast to the 7 others: the pairs stored in forecast/pipeline.py (FSDP_PAIRS)."""
    for target in [(s, m, k) for s in (2, 4) for m in (8, 4) for k in ("gpipe", "1f1b")]:
        if target != source:
            _check_fsdp_pair(source, target)
    for target in ((2, 8), (2, 4), (4, 8)):  # interleaved, 2 stages per rank, 1/2x..2x
        if 0.5 <= target[0] * 2 / source[0] <= 2:
            _check_fsdp_pair(source, (*target, "interleaved"))


@slow
def test_pipeline_forecast_api_frame():
    """`sf.pipeline_forecast(folder, ...)`: the same document as the command, as a frame of one
    row per scenario and stage with the worst flagged."""
    from recordings import recorded_module

    import snapforensics as sf

    folder = recorded_module("snapforensics.examples.pipeline",
                             ("--schedule", "gpipe", "--microbatches", "8", *PIPE_LAYOUT))
    f = sf.pipeline_forecast(folder, stages=[2, 4], schedules=["1f1b"])
    frame = f.to_frame()
    assert list(frame.stages) == [2, 2, 4, 4, 4, 4]
    assert list(frame.held_microbatches) == [2, 1, 4, 3, 2, 1]
    assert frame.groupby("stages").worst.sum().tolist() == [1, 1]
    worst = frame[frame.worst]
    assert list(worst.stage) == [s["worst_stage"] for s in f.to_dict()["scenarios"]]


def _mesh_run(stages: int, m: int, schedule: str, dp: int = 1, tp: int = 1,
              layout: tuple[str, ...] = PIPE_LAYOUT):
    """The pipeline example at `stages` pipeline ranks (2 stages each under `interleaved`),
    FSDP2 over `dp` ranks and TP over `tp` inside each stage: each rank's analysis and truth."""
    import json

    from recordings import recorded_module

    mesh = (("--dp", str(dp)) if dp > 1 else ()) + (("--tp", str(tp)) if tp > 1 else ())
    n = stages * dp * tp
    folder = recorded_module("snapforensics.examples.pipeline",
                             ("--schedule", schedule, "--microbatches", str(m), *mesh,
                              *layout), nproc=n)
    return [(_fx(folder / f"rank{r}.pickle").d,
             json.loads((folder / f"truth.rank{r}.json").read_text())) for r in range(n)]


def _mesh_errors(source: tuple, target: tuple, layout: tuple[str, ...] = PIPE_LAYOUT,
                 **change) -> tuple[list[float], dict, dict[int, tuple[int, int]], float]:
    """Every rank of the source layout ((stages, micro-batches, schedule[, dp[, tp]])) forecast
    to the target (`change`: the world size and TP degree, the target's when not given): each
    stage's error against the worst recorded peak of its dp and tp ranks, the scenario, and per
    stage the twin's (peak, micro-batches held), and the comparison's `_timing_slack`; the held
    count must be the running stage's."""
    from snapforensics.analysis.forecast import pipeline as pf

    source, target = (*source, 1, 1)[:5], (*target, 1, 1)[:5]
    if not change:
        change = {"world_sizes": [target[3]] if target[3] != source[3] else [],
                  "tps": [target[4]] if target[4] != source[4] else []}
    src = _mesh_run(*source, layout=layout)
    looped = target[2] == "interleaved"
    doc = pf.pipeline_forecast([d for d, _ in src], [target[0]], [target[1]],
                               ["interleaved:2" if looped else target[2]], **change)
    sc, = doc.scenarios
    twin: dict[int, tuple[int, int]] = {}
    recorded = _mesh_run(*target, layout=layout)
    for d, t in recorded:
        old = twin.get(t["stage"], (0, 0))
        twin[t["stage"]] = (max(old[0], d.peak_bytes), max(t["held_per_step"]))
    errors = []
    for p in sc["per_stage"]:
        peak, held = twin[p["stage"]]
        assert p["held_microbatches"] == held, (target, p)
        errors.append((p["predicted_peak_bytes"] - peak) / peak)
    return errors, sc, twin, _timing_slack([d for d, _ in src], [d for d, _ in recorded])


def _check_mesh_pair(source: tuple, target: tuple, pairs, name: str, validated: bool = True,
                     **change) -> list[float]:
    """One pair ((stages, micro-batches, schedule, dp, tp) each): every rank of the source
    forecast to the target layout (`change`: its world size or TP degree), each stage against
    the worst recorded peak of its dp and tp ranks, within the pair's stored band (`name`
    formats a layout as the table does) and `validated` or not; the micro-batches held are the
    running stages', the stage named worst the worst recorded."""
    errors, sc, twin, slack = _mesh_errors(source, target, **change)

    def label(x: tuple) -> str:
        return name.format(f"{x[0]}x2" if x[2] == "interleaved" else x[0], *x[1:])

    pair = next(x for x in pairs if x[:2] == (label(source), label(target)))
    print(f"pipeline {pair[0]} -> {pair[1]}: " + " ".join(f"{e:+.2%}" for e in errors) +
          f" (timing slack {slack:.2%})")
    slack += RERECORDED
    assert pair[2] - slack <= min(errors) <= max(errors) <= pair[3] + slack, (pair, errors)
    assert sc["error_band"]["pairs"] == len(pairs)
    assert sc["error_band"]["validated"] == validated, sc["error_band"]
    # the stage named worst is the worst recorded, or one closer to it than the pair's own
    # spread of errors (the forecast cannot tell stages apart more finely)
    peaks = [twin[s][0] for s in sorted(twin)]
    close = 1 - max(0.01, pair[3] - pair[2])
    assert peaks[sc["worst_stage"]] >= close * max(peaks), (target, sc["worst_stage"], peaks)
    return errors


TP_NAME = "S={0} M={1} {2} tp={4}"
FROM_INTERLEAVED_NAME = "S={0} M={1} {2}"


@slow
def test_pipeline_tp_forecast():
    """TP inside the pipeline's stages (examples/pipeline.py --tp: each block's MLP column- and
    row-wise parallel, as torchtitan composes TP with PP): another TP degree with the
    pipeline's changes, what TP splits scaled by tp0 / tp in the rebuilt step. tp 2 -> 4 at the
    same layout and to 1F1B (from GPipe and from M=4), within the stored band (exact, but for a
    re-recording's RERECORDED and gloo's thread's `_timing_slack`); without --tp the forecast
    misses by more than 5%."""
    from snapforensics.analysis.forecast import pipeline as pf

    _check_mesh_pair((2, 8, "gpipe", 1, 2), (2, 8, "gpipe", 1, 4), pf.TP_PAIRS, TP_NAME, tps=[4])
    _check_mesh_pair((2, 8, "gpipe", 1, 2), (2, 8, "1f1b", 1, 4), pf.TP_PAIRS, TP_NAME, tps=[4])
    # 1F1B drops a backward's send at the next backward: the one before the last backward is
    # freed past the last mark (read as held to the step's end, the last stage at M=8 was
    # +6.2% off: one more micro-batch's gradient per backward)
    _check_mesh_pair((2, 4, "1f1b", 1, 2), (2, 8, "1f1b", 1, 4), pf.TP_PAIRS, TP_NAME, tps=[4])
    src = _mesh_run(2, 8, "gpipe", tp=2)
    assert {pf.source(d).tp for d, _ in src} == {2}
    sc, = pf.pipeline_forecast([d for d, _ in src]).scenarios
    twin = max(d.peak_bytes for d, _ in _mesh_run(2, 8, "gpipe", tp=4))
    assert sc["worst_peak_bytes"] > 1.05 * twin  # TP 2's shards kept: too high


@full
@pytest.mark.parametrize("source", [(s, m, k, 1, 2) for s in (2, 4) for m in (8, 4)
                                    for k in ("gpipe", "1f1b")] +
                         [(2, m, k, 1, 4) for m in (8, 4) for k in ("gpipe", "1f1b")],
                         ids=lambda x: f"from-S{x[0]}-M{x[1]}-{x[2]}-tp{x[4]}")
def test_pipeline_tp_layout_forecast(source):
    """Every layout at tp 2 forecast to every one at tp 4 (2 stages, 8 ranks) and back, and to
    ScheduleInterleaved1F1B at the other degree (TP_PAIRS)."""
    from snapforensics.analysis.forecast import pipeline as pf

    other = 4 if source[4] == 2 else 2
    targets = [(s, m, k, 1, other) for s in ((2,) if other == 4 else (2, 4)) for m in (8, 4)
               for k in ("gpipe", "1f1b")] + [(2, m, "interleaved", 1, other) for m in (8, 4)]
    for target in targets:
        _check_mesh_pair(source, target, pf.TP_PAIRS, TP_NAME, tps=[other])


LM_LAYOUTS = {"gpt": ((2, 8, "gpipe"), (2, 4, "1f1b"), (4, 8, "1f1b"), (2, 8, "interleaved")),
              "llama": ((2, 8, "gpipe"), (4, 4, "1f1b"), (3, 6, "1f1b"), (2, 4, "interleaved"))}


def _lm_folder(model: str, stages: int, m: int, schedule: str, dp: int = 1) -> Path:
    """tests/lm_pipeline.py (embeddings first; a norm, a head over the vocabulary and
    cross-entropy last) recorded at one layout, FSDP over `dp` ranks inside each stage, with
    its truth files (rank = stage index * dp + dp index)."""
    from recordings import recorded_script

    return recorded_script(Path(__file__).parent / "lm_pipeline.py",
                           ("--model", model, "--schedule", schedule, "--microbatches", str(m),
                            *(("--dp", str(dp)) if dp > 1 else ())), nproc=stages * dp,
                           truth=True)


def _lm_run(model: str, stages: int, m: int, schedule: str, dp: int = 1) -> list:
    """`_lm_folder`'s recording: each rank's analysis."""
    folder = _lm_folder(model, stages, m, schedule, dp)
    return [_fx(folder / f"rank{r}.pickle").d for r in range(stages * dp)]


def _lm_errors(model: str, source: tuple, target: tuple, dp: int = 1) -> dict:
    """The source layout's ranks forecast to the target's: each stage's error against the
    worst of its dp ranks in the target's recording, and the scenario's error band; the
    micro-batches each stage holds are the running stage's (the twin's truth files)."""
    from snapforensics.analysis.forecast import pipeline as pf

    stages, m, schedule = target
    sc, = pf.pipeline_forecast(_lm_run(model, *source, dp), [stages], [m], [
        "interleaved:2" if schedule == "interleaved" else schedule]).scenarios
    twin = _lm_run(model, *target, dp)
    peaks = [max(d.peak_bytes for d in twin[i * dp:(i + 1) * dp]) for i in range(stages)]
    folder = _lm_folder(model, *target, dp)
    truths = [json.loads((folder / f"truth.rank{r}.json").read_text())
              for r in range(stages * dp)]
    held = {t["stage"]: max(t["held_per_step"]) for t in truths}
    assert [p["held_microbatches"] for p in sc["per_stage"]] == \
        [held[p["stage"]] for p in sc["per_stage"]], (source, target, sc["per_stage"], held)
    errors = [(p["predicted_peak_bytes"] - peaks[p["stage"]]) / peaks[p["stage"]]
              for p in sc["per_stage"]]
    print(f"{model} dp={dp} {source} -> {target}: " + " ".join(f"{e:+.2%}" for e in errors))
    assert len(errors) == stages
    return {"errors": errors, "band": sc["error_band"]}


@slow
@pytest.mark.parametrize("model", LM_LAYOUTS)
def test_pipeline_language_model_forecast(model):
    """Models with what real pipelines put on their end stages (tests/lm_pipeline.py: GPT-like,
    and Llama-like with torchtitan's names, RoPE and SwiGLU; embeddings first, a norm, a head
    over the vocabulary and cross-entropy last): each of 4 layouts forecast to the 3 others,
    every stage against the recorded twin's rank, within 6%. A middle stage is rebuilt from the
    last stage's recording without its head, loss and step return (`_head`); with them it was
    up to +149% (GPT) and +162% (Llama) off at 4 stages, up to +47% to the interleaved
    schedule. The rules were derived on the GPT model; the Llama model was held out (measured
    once the rules were done: 72 pairs by hand, -2.19%..+2.88%)."""
    worst = 0.0
    for source in LM_LAYOUTS[model]:
        for target in LM_LAYOUTS[model]:
            if source != target:
                errors = _lm_errors(model, source, target)["errors"]
                assert max(map(abs, errors)) <= 0.06, (source, target, errors)
                worst = max(worst, *map(abs, errors))
    assert worst > 0.005  # the stages differ from the recorded ones: not a replay


@slow
def test_pipeline_head_without_saved_names_is_not_validated():
    """A last stage whose parameters are named but no tensor it saved is (a script's own
    saved-tensor hooks shadow the recorder's) has a head `_head` cannot find: a middle stage
    rebuilt from it keeps the norm, head and loss. The forecast says NOT VALIDATED there (GPT,
    2 stages -> 4), and only there: the same recording with its names is validated, and 2 stages
    (no middle stage) is validated without them."""

    from snapforensics.analysis.forecast import pipeline as pf
    from snapforensics.analysis.identity import BlockNames

    ds = _lm_run("gpt", 2, 8, "gpipe")
    s = load(_lm_folder("gpt", 2, 8, "gpipe") / "rank1.pickle")
    last = analyse(s, s.active_traces[0])  # its own analysis: `ds` is shared by the module
    n = last.names
    last.names = BlockNames(n.table, n.ident, np.full_like(n.saver, -1), n.extra, n.matched,
                            n.observations, n.tp, n.tp_bytes)
    for srcs, stages, validated in (([ds[0], ds[-1]], 4, True), ([ds[0], last], 4, False),
                                    ([ds[0], last], 2, True)):
        sc, = pf.pipeline_forecast(srcs, [stages], [8], ["1f1b"]).scenarios
        band = sc["error_band"]
        assert band["validated"] == validated, (stages, band)
        assert validated or "saved-tensor hooks" in band["not_validated"][0], band


@full
def test_pipeline_language_model_fsdp_forecast():
    """The Llama-like model with FSDP2 inside the stages (`--dp 2`, a (pp, dp_shard) mesh, 4 and
    8 ranks), held out from the end-stage rules: GPipe and 1F1B at 2 stages, 1F1B at 4 and 2 x 2
    interleaved, each to the others, every stage against the worst of its dp ranks, within 5%
    and validated. A middle stage of an interleaved rank leaves its end stage's unnumbered
    units (the norm and head) to that stage: taken as its own, they were gathers no range of
    its placed, copied as recorded and NOT VALIDATED (+10.95% on one stage of 4)."""
    layouts = ((2, 8, "gpipe"), (2, 4, "1f1b"), (4, 8, "1f1b"), (2, 8, "interleaved"))
    for source in layouts:
        for target in layouts:
            if source != target:
                got = _lm_errors("llama", source, target, dp=2)
                assert max(map(abs, got["errors"])) <= 0.05, (source, target, got)
                assert got["band"]["validated"], got["band"]


FSDP_TP_NAME = "S={0} M={1} {2} dp={3} tp={4}"


@slow
def test_pipeline_fsdp_tp_forecast():
    """FSDP2 and TP inside the stages (examples/pipeline.py --dp 2 --tp 2, a (pp, dp_shard, tp)
    mesh of 8 ranks): forecast without TP, alone and with the dp_shard degree doubled at once
    (the same 8 ranks, TP traded for FSDP), to another schedule and micro-batch count; validated
    within FSDP_TP_PAIRS' band; TP 4 under FSDP (never recorded: 16 ranks) is NOT VALIDATED."""
    from snapforensics.analysis.forecast import pipeline as pf

    src = (2, 8, "gpipe", 2, 2)
    for target, change in (((2, 4, "1f1b", 2, 1), {"tps": [1]}),
                           ((2, 8, "1f1b", 4, 1), {"tps": [1], "world_sizes": [4]})):
        _check_mesh_pair(src, target, pf.FSDP_TP_PAIRS, FSDP_TP_NAME, **change)
    sc, = pf.pipeline_forecast([d for d, _ in _mesh_run(*src)], tps=[4]).scenarios
    assert not sc["error_band"]["validated"]
    assert any("with FSDP" in w for w in sc["error_band"]["not_validated"])


@full
@pytest.mark.parametrize("source", [(2, 8, "gpipe", 2, 2), (2, 4, "1f1b", 2, 2)],
                         ids=lambda x: f"from-S{x[0]}-M{x[1]}-{x[2]}-dp2-tp2")
def test_pipeline_fsdp_tp_layout_forecast(source):
    """Every FSDP_TP_PAIRS row of `source`: without TP at 2 and 4 stages, GPipe, 1F1B and
    ScheduleInterleaved1F1B, and with dp_shard 4 at once."""
    from snapforensics.analysis.forecast import pipeline as pf

    rows = [r for r in pf.FSDP_TP_PAIRS if r[0] == FSDP_TP_NAME.format(*source)]
    assert len(rows) == 14
    for _, label, *_ in rows:
        s, m, k, dp, tp = (x.split("=")[-1] for x in label.split())
        target = (int(s[0]), int(m), k, int(dp), int(tp))
        change = {"tps": [1]} | ({"world_sizes": [4]} if target[3] == 4 else {})
        _check_mesh_pair(source, target, pf.FSDP_TP_PAIRS, FSDP_TP_NAME, **change)


@slow
def test_pipeline_from_interleaved_forecast():
    """ScheduleInterleaved1F1B recorded (two stages per rank, examples/pipeline.py --schedule
    interleaved; the recorder's marks name each stage): each of a rank's stages is a source of
    its own (its operations, its layers by the model's names, its share of the receive
    buffers), forecast through the CLI to other layouts: the recorded layout replays exact, 2
    and 4 stages of 1F1B lie within the stored band; the GPipe rule says nothing and the
    schedule is named interleaved. With FSDP sharding the stages, the looped runtime's UNSHARD
    actions gather each stage's units before the rank's first mark: they are the stage's first
    forward's gathers (left out, a stage of 4 at M=4 was +13.1% off), and the parameters'
    gradients, reduced inside the stage's last backward, stay to the last backward of the
    new order (validated, within the stored band)."""
    import json

    from recordings import recorded_module, run_cli

    import snapforensics as sf
    from snapforensics.analysis.forecast import pipeline as pf

    folder = recorded_module("snapforensics.examples.pipeline",
                             ("--schedule", "interleaved", "--microbatches", "4", *PIPE_LAYOUT))
    p = run_cli(["forecast", str(folder), "--pp", "2", "--format", "json"])
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert (doc["recorded"]["stages"], doc["recorded"]["virtual_stages"]) == (2, 2)
    sc, = doc["scenarios"]
    assert sc["error_band"]["exact"]
    peaks = {t["stage"]: d.peak_bytes for d, t in _mesh_run(2, 4, "interleaved")}
    assert [s["predicted_peak_bytes"] for s in sc["per_stage"]] == [peaks[0], peaks[1]]
    for target in ((2, 8, "1f1b"), (4, 8, "1f1b")):
        errors = _check_mesh_pair((2, 4, "interleaved"), target, pf.FROM_INTERLEAVED_PAIRS,
                                  FROM_INTERLEAVED_NAME)
        assert max(abs(e) for e in errors) <= 0.05
    for r in (0, 1):
        d = sf.diagnose(folder / f"rank{r}.pickle").diagnosis
        assert "pipeline.all_forward_before_backward" not in {f.rule for f in d.findings}
        assert d.framework["pipeline"]["schedule"] == "interleaved_1f1b"  # not taken for 1F1B
        # each rank ran torch's interleaved order, as `order` computes it
        assert all(s.regular for s in pf.sources(_fx(folder / f"rank{r}.pickle").d))
    # the looped runtime's UNSHARD gathers run on gloo's thread: two recordings of this run with
    # identical peaks differed in their rows, and one stage's forecast by 2.4% (a fresh clone
    # at 11ef482: +0.58%, here +2.94%); each stage is held to the family's band, not the pair's
    pairs = pf.FSDP_FROM_INTERLEAVED_PAIRS
    lo, hi = min(p[2] for p in pairs), max(p[3] for p in pairs)
    for target in ((2, 8, "1f1b", 2), (4, 4, "1f1b", 2)):
        errors, sc, _, slack = _mesh_errors((2, 4, "interleaved", 2), target)
        print(f"FSDP from interleaved -> {target}: " + " ".join(f"{e:+.2%}" for e in errors))
        assert sc["error_band"]["validated"], sc["error_band"]
        slack += RERECORDED
        assert lo - slack <= min(errors) <= max(errors) <= hi + slack, (target, errors)


ZERO_BUBBLE = """\
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

from snapforensics.examples.pipeline import Block, Chunk

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
blocks = [Block(64) for _ in range(4)]
idx = [rank, 2 * world - 1 - rank]  # the V shape: rank 0 runs stages 0 and 3
stages = [PipelineStage(Chunk({i: blocks[i]}), i, 2 * world, torch.device("cpu")) for i in idx]
sched = ScheduleZBVZeroBubble(stages, n_microbatches=4,
                              loss_fn=lambda o, t: ((o - t) ** 2).mean())
opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.01)
for _ in range(2):
    x, y = torch.randn(8, 16, 64), torch.randn(8, 16, 64)
    sched.step(x, target=y, losses=[]) if rank == 0 else sched.step()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


ALIKE = """\
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

from snapforensics.examples.pipeline import Block

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
blocks = [Block(64) for _ in range(4)]
idx = [rank, rank + world]
# each stage an nn.Sequential of its own blocks: both stages name theirs 0.up.weight, ...
stages = [PipelineStage(nn.Sequential(blocks[i]), i, 2 * world, torch.device("cpu"))
          for i in idx]
sched = ScheduleInterleaved1F1B(stages, n_microbatches=4,
                                loss_fn=lambda o, t: ((o - t) ** 2).mean())
opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.01)
for _ in range(2):
    x, y = torch.randn(8, 16, 64), torch.randn(8, 16, 64)
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def _refused_pipeline(tmp_path, script: str):
    """`script` recorded fresh by the recorder on 2 CPU ranks, then forecast with --pp 2: the
    run folder and the one-line refusal (exit 2) the forecast must give."""
    from recordings import run_cli

    path = tmp_path / "script.py"
    path.write_text(script)
    out = tmp_path / "out"
    p = run_cli(["record", "--nproc-per-node", "2", "--device", "cpu", "--out", str(out),
                 str(path)])
    assert p.returncode == 0, p.stderr
    p = run_cli(["forecast", str(out), "--pp", "2"])
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    return out, p.stderr


@slow
def test_interleaved_stages_named_alike_are_refused(tmp_path):
    """An interleaved run whose stages each name their layers from 0 (an nn.Sequential per
    stage, not the model's names): which stage holds which parameter is unknown, so the
    pipeline forecast refuses in one line (exit 2) rather than split them by guess."""
    _, why = _refused_pipeline(tmp_path, ALIKE)
    assert "alike" in why


@slow
def test_zero_bubble_recording_is_refused(tmp_path):
    """ScheduleZBVZeroBubble recorded by the recorder (2 ranks, stages in a V): its stages
    compute weight gradients apart from the backward (`backward_weight_one_chunk`), which the
    marks do not delimit, so the pipeline forecast refuses in one line (exit 2) rather than take
    it for an interleaved schedule; diagnose names the schedule zero_bubble."""
    import snapforensics as sf

    out, why = _refused_pipeline(tmp_path, ZERO_BUBBLE)
    assert "zero-bubble" in why
    d = sf.diagnose(out / "rank0.pickle").diagnosis
    assert d.framework["pipeline"]["schedule"] == "zero_bubble"


@full
@pytest.mark.parametrize("source", [(s, m, "interleaved") for s in (2, 4) for m in (8, 4)] +
                         [(s, m, "interleaved", 2) for s, m in ((2, 8), (2, 4), (4, 8))],
                         ids=lambda x: f"from-S{x[0]}x2-M{x[1]}-dp{(x + (1,))[3]}")
def test_pipeline_from_interleaved_layout_forecast(source):
    """Every interleaved recording forecast to every GPipe, 1F1B and other interleaved layout
    whose stages are 1/2x..2x its own (FROM_INTERLEAVED_PAIRS; with FSDP,
    FSDP_FROM_INTERLEAVED_PAIRS)."""
    from snapforensics.analysis.forecast import pipeline as pf

    dp = (*source, 1)[3]
    pairs = pf.FSDP_FROM_INTERLEAVED_PAIRS if dp > 1 else pf.FROM_INTERLEAVED_PAIRS
    inter = [(s, m, "interleaved", dp) for s, m in
             (((2, 8), (2, 4), (4, 8)) if dp > 1 else ((2, 8), (2, 4), (4, 8), (4, 4)))]
    for target in [(s, m, k, dp) for s in (2, 4) for m in (8, 4) for k in ("gpipe", "1f1b")] + \
            [x for x in inter if x[:3] != source[:3]]:
        total = target[0] * (2 if target[2] == "interleaved" else 1)
        if 0.5 <= total / (source[0] * 2) <= 2:
            _check_mesh_pair((*source, 1)[:4], target, pairs, FROM_INTERLEAVED_NAME)


def _check_interleaved_pair(source: tuple[int, int, str], target: tuple[int, int]
                            ) -> list[float]:
    """A GPipe or 1F1B recording forecast to ScheduleInterleaved1F1B with 2 stages per rank
    (`target`: ranks, micro-batches) against the example recorded with --schedule interleaved:
    each rank within the pair's stored band, the micro-batches held those the running stages
    counted, the rank named worst the worst recorded."""
    from snapforensics.analysis.forecast import pipeline as pf

    src = _pipeline_run(source[0], source[2], source[1])
    doc = pf.pipeline_forecast([d for d, _ in src], [target[0]], [target[1]], ["interleaved:2"])
    sc, = doc.scenarios
    assert (sc["schedule"], sc["virtual_stages"]) == ("interleaved_1f1b", 2)
    twin = _pipeline_run(target[0], "interleaved", target[1])
    errors = []
    for p, (d, truth) in zip(sc["per_stage"], twin):
        assert truth["stage"] == p["stage"]
        assert p["held_microbatches"] == max(truth["held_per_step"]), (target, p)
        errors.append((p["predicted_peak_bytes"] - d.peak_bytes) / d.peak_bytes)
    pair = next(x for x in pf.INTERLEAVED_PAIRS if x[:2] == (
        "S={} M={} {}".format(*source), "S={}x2 M={} interleaved".format(*target)))
    print(f"interleaved {pair[0]} -> {pair[1]}: " + " ".join(f"{e:+.2%}" for e in errors))
    slack = RERECORDED + _timing_slack([d for d, _ in src], [d for d, _ in twin])
    assert pair[2] - slack <= min(errors) <= max(errors) <= pair[3] + slack, (pair, errors)
    assert sc["error_band"]["validated"], sc["error_band"]
    peaks = [d.peak_bytes for d, _ in twin]
    assert peaks[sc["worst_stage"]] >= 0.99 * max(peaks), (target, sc["worst_stage"], peaks)
    return errors


@slow
def test_pipeline_interleaved_forecast():
    """ScheduleInterleaved1F1B forecast from GPipe and 1F1B recordings: torch's order on each
    rank (its warm-up, a round of micro-batches per stage), each of a rank's stages rebuilt from
    the recorded stage in that stage's position (a middle stage receives both activations and
    gradients), the sends held to the step's end as torch's looped runtime waits on them.
    With the rank's own stage standing for both of its stages these were -18.0%..-0.5% (every
    layout to every interleaved one); from each stage's position without the held sends,
    -9.8%..+9.3%."""
    for source in ((2, 8, "gpipe"), (2, 8, "1f1b"), (4, 8, "1f1b")):
        assert max(abs(e) for e in _check_interleaved_pair(source, (2, 4))) <= 0.06


@full
@pytest.mark.parametrize("source", [(s, m, k) for s in (2, 4) for m in (8, 4)
                                    for k in ("gpipe", "1f1b")],
                         ids=lambda x: f"from-S{x[0]}-M{x[1]}-{x[2]}")
def test_pipeline_interleaved_layout_forecast(source):
    """Every GPipe and 1F1B layout forecast to every interleaved one whose stages are 1/2x..2x
    the recorded (INTERLEAVED_PAIRS), and the band a 4x one is refused as validated."""
    from snapforensics.analysis.forecast import pipeline as pf

    for target in ((2, 8), (2, 4), (4, 8), (4, 4)):
        if 0.5 <= target[0] * 2 / source[0] <= 2:
            _check_interleaved_pair(source, target)
        else:
            src = _pipeline_run(source[0], source[2], source[1])
            doc = pf.pipeline_forecast([d for d, _ in src], [target[0]], [target[1]],
                                       ["interleaved"])
            assert not doc.scenarios[0]["error_band"]["validated"]


def test_fsdp_units_a_stage_of_other_layers_runs():
    """What a stage with another share of the layers gathers: its numbered layers' units thinned
    to the last ones (the backward's first gather and the prefetch made during it) or repeated
    (each layer its own FSDP unit), the root (embeddings, head) once as recorded; a stage FSDP
    wraps whole (no numbered unit) scales its one unit with the layers."""
    from snapforensics.analysis.forecast.pipeline import _unit_copies

    units = ["(root)", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert _unit_copies(units, 0.5) == [("(root)", 0.0, 1.0, 1.0), ("layers.2", 0.0, 1.0, 1.0),
                                        ("layers.3", 0.0, 1.0, 1.0)]
    doubled = _unit_copies(units, 2.0)
    assert doubled[0] == ("(root)", 0.0, 1.0, 1.0) and len(doubled) == 9
    assert doubled[1:3] == [("layers.0", 0.0, 0.5, 1.0), ("layers.0", 0.5, 0.5, 1.0)]
    assert _unit_copies(units, 0.75) == [("(root)", 0.0, 1.0, 1.0)] + [
        (u, 0.0, 1.0, 0.75) for u in units[1:]]  # 3 of 4 layers: no whole thinning
    assert _unit_copies(["(root)"], 0.5) == [("(root)", 0.0, 1.0, 0.5)]


def test_interleaved_order_is_torchs():
    """The interleaved order is torch's own: ScheduleInterleaved1F1B's pipeline_order (its
    actions, without the idle slots) for every rank of several layouts, when torch is here."""
    torch = pytest.importorskip("torch")
    del torch
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from snapforensics.analysis.forecast import pipeline as pf

    class Stage:  # what the schedule's constructor reads of its stages (the order is torch's)
        def __init__(self, rank: int, size: int, index: int, num_stages: int):
            self.group_size, self.group_rank, self.stage_index = size, rank, index
            self.num_stages = num_stages
            self.is_first, self.is_last = index == 0, index == num_stages - 1

    checked = 0
    for stages, v, m in ((2, 2, 8), (2, 2, 4), (4, 2, 8), (4, 2, 4), (3, 2, 8), (4, 3, 12)):
        for rank in range(stages):
            try:
                sched = ScheduleInterleaved1F1B(
                    [Stage(rank, stages, rank + j * stages, stages * v) for j in range(v)],
                    n_microbatches=m)
            except (AttributeError, TypeError) as e:  # a torch whose constructor reads more
                pytest.skip(f"ScheduleInterleaved1F1B needs more of a stage: {e}")
            want = [("F" if a.computation_type == _ComputationType.FORWARD else "B",
                     (a.stage_index // stages) * m + a.microbatch_index)
                    for a in sched.pipeline_order[rank] if a is not None]
            assert pf.order(pf.INTERLEAVED, rank, stages, m, v) == want, (stages, v, m, rank)
            checked += 1
    assert checked == 2 + 2 + 4 + 4 + 3 + 4


# A layout the pipeline model was not tuned on: 12 thinner layers, longer sequences, 3 samples a
# micro-batch at M=8 (the pairs above are 8 layers of dim 256)
PIPE_HELD_OUT = ("--layers", "12", "--dim", "128", "--seq", "128", "--batch", "24")
HELD_OUT_LAYOUTS = ((2, 8, "gpipe"), (2, 8, "1f1b"), (2, 4, "gpipe"), (4, 8, "gpipe"),
                    (4, 8, "1f1b"), (4, 4, "1f1b"))


@slow
def test_pipeline_forecast_held_out_layout():
    """Every one of 6 recorded layouts of the held-out model forecast to the 5 others (30
    pairs, every stage): each error inside the band the tuned pairs measured and within 5%, the
    stage named worst the worst recorded (within 1%), the micro-batches held the running
    stage's count. Measured 2026-12-05: -1.52%..+3.23%."""
    from snapforensics.analysis.forecast import pipeline as pf

    runs = {lay: _pipeline_run(lay[0], lay[2], lay[1], PIPE_HELD_OUT) for lay in HELD_OUT_LAYOUTS}
    lo, hi = min(p[2] for p in pf.PAIRS), max(p[3] for p in pf.PAIRS)
    errors = []
    for src, twin in ((a, b) for a in runs for b in runs if a != b):
        slack = RERECORDED + _timing_slack(*([d for d, _ in runs[x]] for x in (src, twin)))
        doc = pf.pipeline_forecast([d for d, _ in runs[src]], [twin[0]], [twin[1]], [twin[2]])
        sc, = doc.scenarios
        assert sc["error_band"]["validated"], (src, twin, sc["error_band"])
        peaks = [d.peak_bytes for d, _ in runs[twin]]
        pair = [(p["predicted_peak_bytes"] - d.peak_bytes) / d.peak_bytes
                for p, (d, _) in zip(sc["per_stage"], runs[twin])]
        for p, (_, truth) in zip(sc["per_stage"], runs[twin]):
            assert p["held_microbatches"] == max(truth["held_per_step"]), (src, twin, p)
        assert lo - slack <= min(pair) <= max(pair) <= hi + slack, (src, twin, pair)
        assert peaks[sc["worst_stage"]] >= 0.99 * max(peaks), (src, twin, sc["worst_stage"])
        errors += pair
    print(f"pipeline held-out: {min(errors):+.2%}..{max(errors):+.2%} over {len(errors)} stages")
    assert max(abs(e) for e in errors) <= 0.05


# The held-out model across the mesh: (family's table, source, targets), the FSDP and TP degrees
# in the layouts (stages, micro-batches, schedule, dp, tp)
HELD_OUT_MESH = (
    ("INTERLEAVED_PAIRS", HELD_OUT_LAYOUTS, ((2, 8, "interleaved"), (2, 4, "interleaved"))),
    ("FROM_INTERLEAVED_PAIRS", ((2, 8, "interleaved"), (2, 4, "interleaved")), HELD_OUT_LAYOUTS),
    ("FSDP_WORLD_PAIRS", ((2, 8, "gpipe", 2),), ((2, 8, "1f1b", 4), (2, 4, "1f1b", 4))),
    ("TP_PAIRS", ((2, 8, "gpipe", 1, 2),), ((2, 8, "1f1b", 1, 4), (2, 4, "1f1b", 1, 4))),
    ("FSDP_FROM_INTERLEAVED_PAIRS", ((2, 8, "interleaved", 2),),
     ((2, 8, "1f1b", 2), (4, 8, "1f1b", 2))),
)


@full
def test_pipeline_mesh_held_out():
    """The held-out model (12 layers of dim 128, PIPE_HELD_OUT) recorded across the mesh and
    forecast as each family's pairs were: its 6 GPipe / 1F1B layouts to interleaved 2 x 2 at M=8
    and M=4 and back, FSDP dp 2 -> 4, TP 2 -> 4, FSDP from an interleaved recording. Every
    stage inside its family's stored band (`RERECORDED` and `_timing_slack` either side) and
    validated; the figures per family are printed."""
    from snapforensics.analysis.forecast import pipeline as pf

    for table, sources, targets in HELD_OUT_MESH:
        pairs = getattr(pf, table)
        lo, hi = min(p[2] for p in pairs), max(p[3] for p in pairs)
        errors: list[float] = []
        for source in sources:
            for target in targets:
                got, sc, _, timing = _mesh_errors(source, target, PIPE_HELD_OUT)
                assert sc["error_band"]["validated"], (source, target, sc["error_band"])
                slack = RERECORDED + timing  # each pair within its own recordings' slack
                assert lo - slack <= min(got) <= max(got) <= hi + slack, (table, source,
                                                                           target, got)
                errors += got
        print(f"held out, {table}: {len(sources) * len(targets)} pairs, {len(errors)} stages, "
              f"{min(errors):+.2%}..{max(errors):+.2%}")
