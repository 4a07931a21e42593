"""The scenario matrix: verdicts checked against ground truth read from FSDP itself.

`snapforensics.examples.scenarios` records 40-odd small layouts (FSDP2 / FSDP1 / DDP / none;
unit granularities; every checkpointing flavour; init styles; mixed precision; offload; HSDP on a
2x2 mesh; gradient accumulation right and wrong; prefetch; leaks; three model families) in two
torch.distributed jobs (2 ranks, then 4), once per test session, and writes next to each
snapshot a truth file from FSDP's own state during the run (unsharded storage alive after each
backward, all-gathers issued / consumed / still pending at finalize, unsharded grads, the full
model's bytes when built before sharding, a module cache's bytes per step).

The expected verdicts come from that truth and the measured peaks (the trace replayed by
`recordings.replay_peak`, independent of the analyzer), never from `diagnose`:

- a bug the truth shows (parameters still unsharded after the last micro-batch's backward;
  an all-gather pending, never used, when FSDP finalizes backward; a unit all-gathered and used
  twice in one backward; a module cache growing every step; the full model built before
  sharding) must be reported `anomalous` by its rule when the layout's peak is above its fixed
  twin's by more than 3%, and must not be `anomalous` when the peak is within 1% of the twin's
  (removing it would not lower the peak);
- every other `anomalous` finding is a false anomaly;
- an anomaly's predicted peak is within 5% of the twin's measured peak.

Set SNAPFORENSICS_MATRIX=DIR to reuse a matrix recorded earlier into DIR (by
``python -m snapforensics.examples.scenarios --out DIR`` and ``... --world 4``).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from corpus import corpus_files  # noqa: E402
from edits import cuda_shaped  # noqa: E402
from recordings import REPO, load_strict, replay_peak  # noqa: E402

from snapforensics.analysis import diagnose
from snapforensics.analysis.diagnosis import LOWER_BOUND
from snapforensics.snapshot import load, normalize, read_raw

pytestmark = pytest.mark.slow

RESHARD = "fsdp.unsharded_params_not_resharded"
STALE = "fsdp.stale_prefetch_all_gather"
DOUBLE = "fsdp.double_all_gather_in_backward"
LEAK = "leak.iteration_growth"
FULL_INIT = "fsdp.full_model_materialized_at_init"
BUCKET_VIEW = "ddp.gradient_as_bucket_view"
GRAD_SYNC = "fsdp.gradient_sync_disabled"
RAF = "fsdp.reshard_after_forward_disabled"

# A bug raises the peak when the layout's peak exceeds its twin's by this much; within NO_EFFECT
# it does not (the rest is the CPU recording's run-to-run noise, left undecided).
EFFECT, NO_EFFECT = 1.03, 1.01
PREDICTION_TOLERANCE = 0.05


def _layouts() -> dict:
    pytest.importorskip("torch")
    from snapforensics.examples.scenarios.layouts import LAYOUTS

    return LAYOUTS


@cache
def _truth(folder: Path) -> dict:
    return json.loads((folder / "truth.rank0.json").read_text())


@cache
def _measured(folder: Path) -> int:
    return replay_peak(load_strict(folder / "rank0.pickle"))


@cache
def _diagnosis(folder: Path, shape: str = "cpu"):
    if shape == "cpu":
        return diagnose(load(folder / "rank0.pickle"))
    raw, _ = read_raw(folder / "rank0.pickle")
    shaped = cuda_shaped(raw, annotations=shape == "cuda")  # a fresh dict: edited in place
    return diagnose(normalize(shaped, source=f"{folder.name}-{shape}.pickle"))


def bugs(truth: dict) -> set[str]:
    """The rules whose bug FSDP's state (or the configuration) shows in this run."""
    out = set()
    for bw in truth.get("backwards", []):
        if bw["last"] and bw["root"] + bw["nonroot"] > 0:
            out.add(RESHARD)  # unsharded storage alive after the step's final backward
        if bw["pending_at_finalize"]:
            out.add(STALE)  # gathered in backward, never consumed
        if any(n >= 2 for n in bw["used"].values()):
            out.add(DOUBLE)  # a unit gathered and consumed twice in one backward
    cache = [s["cache_bytes"] for s in truth.get("steps", [])]
    if len(cache) >= 3 and all(b > a for a, b in zip(cache, cache[1:])):
        out.add(LEAK)
    if truth.get("full_model_bytes"):
        out.add(FULL_INIT)
    if truth.get("ddp_bucket_view") is False:
        out.add(BUCKET_VIEW)  # every gradient twice: .grad and its bucket (DDP's default)
    return out


def expectation(matrix: Path, name: str) -> tuple[set[str], set[str], float | None]:
    """(anomalies required, anomalies allowed, layout peak / twin peak).

    A bug raises the peak when the layout's measured peak is above its twin's. For the full
    model built before sharding the question is narrower (is the start-up peak the run's
    peak?): the full model FSDP was handed, measured in the run, against the twin's peak. It
    is at least the start-up peak, and at most that plus the shards made from it (1/world)."""
    lay = _layouts()[name]
    truth = _truth(matrix / name)
    found = bugs(truth)
    if not found:
        return set(), set(), None
    twin = lay.twin
    if twin is None:  # no twin to measure the effect against: allowed, not required
        return set(), found, None
    twin_peak = _measured(matrix / twin)
    ratio = _measured(matrix / name) / twin_peak
    required, allowed = set(), set()
    for rule in found:
        if rule == FULL_INIT:
            low = truth["full_model_bytes"] / twin_peak
            high = low * (1 + 1 / truth["world"])
            effect, none = low > EFFECT, high <= NO_EFFECT
        else:
            effect, none = ratio > EFFECT, ratio <= NO_EFFECT
        if effect:
            required.add(rule)
        if not none:
            allowed.add(rule)
    return required, allowed, ratio


def _names() -> list[str]:
    try:
        from snapforensics.examples.scenarios.layouts import LAYOUTS
    except Exception:  # no torch: the fixture skips
        return ["(no torch)"]
    return list(LAYOUTS)


def test_matrix_is_wide():
    layouts = _layouts()
    assert len(layouts) >= 30
    assert {lay.world for lay in layouts.values()} == {2, 4}
    assert {lay.family for lay in layouts.values()} == {"gpt", "mlp", "encoder"}
    assert {lay.init for lay in layouts.values()} == {"meta", "build", "local"}
    assert {lay.accumulation for lay in layouts.values()} >= {"none", "right", "wrong"}


def test_every_layout_ran_and_the_truth_has_both_kinds(matrix):
    truths = {n: _truth(matrix / n) for n in _layouts()}
    errors = {n: t["error"] for n, t in truths.items() if "error" in t}
    assert not errors
    with_bug = [n for n, t in truths.items() if bugs(t)]
    assert len(with_bug) >= 6 and len(truths) - len(with_bug) >= 20, with_bug
    # the twins of buggy layouts are healthy
    for name, lay in _layouts().items():
        if lay.twin and bugs(truths[name]) - {FULL_INIT}:
            assert not bugs(truths[lay.twin]), (name, lay.twin)


@pytest.mark.parametrize("shape", ["cpu", "cuda", "cuda-no-annotations"])
@pytest.mark.parametrize("name", _names())
def test_verdicts_follow_the_truth(matrix, name, shape):
    required, allowed, ratio = expectation(matrix, name)
    d = _diagnosis(matrix / name, shape)
    anomalous = {f.rule for f in d.anomalies}
    false = anomalous - allowed
    truth = sorted(bugs(_truth(matrix / name)))
    assert not false, f"false anomalies {sorted(false)} (truth: {truth}, peak/twin {ratio})"
    missed = required - anomalous
    assert not missed, f"missed {sorted(missed)} (peak/twin {ratio:.3f})"
    twin = _layouts()[name].twin
    for f in d.anomalies:
        if f.rule in required:
            measured = _measured(matrix / twin)
            assert f.predicted_peak_bytes, (f.rule, "no predicted peak")
            err = abs(f.predicted_peak_bytes - measured) / measured
            assert err <= PREDICTION_TOLERANCE, (f.rule, f.predicted_peak_bytes, measured)


@pytest.mark.parametrize("name", _names())
def test_cuda_shape_gives_the_same_verdicts_and_predictions(matrix, name):
    base = _diagnosis(matrix / name, "cpu")
    ref = {f.rule: f for f in base.findings if f.verdict != "info"}
    for shape in ("cuda", "cuda-no-annotations"):
        d = _diagnosis(matrix / name, shape)
        got = {f.rule: f for f in d.findings if f.verdict != "info"}
        verdicts = {r: f.verdict for r, f in got.items()}
        assert verdicts == {r: f.verdict for r, f in ref.items()}, shape
        for rule, f in got.items():
            if f.predicted_peak_bytes and ref[rule].predicted_peak_bytes:
                a, b = f.predicted_peak_bytes, ref[rule].predicted_peak_bytes
                if f.evidence.get("prediction") == LOWER_BOUND:  # said so: at most the full one
                    assert a <= b * (1 + PREDICTION_TOLERANCE), (shape, rule, a, b)
                else:
                    assert abs(a - b) / b <= PREDICTION_TOLERANCE, (shape, rule, a, b)


def _same_verdicts(eager, comp) -> None:
    """Rule by rule the eager twin's verdicts, predicted peaks within 5%."""
    ref = {f.rule: f for f in eager.findings if f.verdict != "info"}
    got = {f.rule: f for f in comp.findings if f.verdict != "info"}
    assert {r: f.verdict for r, f in got.items()} == {r: f.verdict for r, f in ref.items()}
    for rule, f in got.items():
        a, b = f.predicted_peak_bytes, ref[rule].predicted_peak_bytes
        assert (a is None) == (b is None), (rule, a, b)
        if a and b:
            assert abs(a - b) / b <= PREDICTION_TOLERANCE, (rule, a, b)


@pytest.mark.parametrize("name", [n for n in _names() if n.endswith("_c")])
def test_compiled_layouts_get_the_eager_verdicts_and_predictions(matrix, name):
    """A layout with each block's mlp torch.compile-d (aot_eager) and its eager twin (the same
    name without `_c`): the same verdicts rule by rule, predicted peaks within 5%; and every
    compiled backward tied to its forward's region. Truth from the layout's configuration: one
    compiled backward per block's mlp per micro-batch per step (analysis/compiled.py)."""
    lay = _layouts()[name]
    assert lay.compile != "none" and name[:-2] in _layouts(), name
    eager, comp = _diagnosis(matrix / name[:-2]), _diagnosis(matrix / name)
    _same_verdicts(eager, comp)
    assert eager.devices[0].compiled is None
    calls = lay.layers * lay.micro_batches * lay.steps
    for shape in ("cpu", "cuda"):  # CUDA's shape: no module frames, the autograd thread's stack
        c = _diagnosis(matrix / name, shape).devices[0].compiled
        assert c is not None, shape
        assert c["backward_calls"] == c["backward_calls_attributed"] == calls, (shape, c)


@pytest.mark.full
@pytest.mark.parametrize("name", ["f2_block_cw_ci", "f2_block_cw_rab_false_ci",
                                  "f2_block_noac_ci", "f2_block_noac_rab_false_ci"])
def test_inductor_layouts_get_the_eager_verdicts_and_name_their_lines(matrix, name):
    """The compiled layouts again with Inductor's C++ CPU backend (issue 29 item 3): the eager
    twin's verdicts rule by rule and predicted peaks within 5%, every compiled backward tied;
    and every compiled forward block names its Inductor buffer and a line of the model's own
    `MLP.forward` (the recorder's map of the generated code; truth: `inspect` of the source)."""
    import inspect

    from recordings import inductor_matrix

    from snapforensics.examples import fsdp_ckpt
    from snapforensics.examples.scenarios.layouts import INDUCTOR_LAYOUTS

    lay = INDUCTOR_LAYOUTS[name]
    folder = inductor_matrix() / name
    eager, comp = _diagnosis(matrix / name[:-3]), _diagnosis(folder)
    _same_verdicts(eager, comp)
    c = comp.devices[0].compiled
    calls = lay.layers * lay.micro_batches * lay.steps
    assert c["backward_calls"] == c["backward_calls_attributed"] == calls, c
    src, first = inspect.getsourcelines(fsdp_ckpt.MLP.forward)
    mlp = {first + i for i in range(len(src))}
    import snapforensics as sf

    b = sf.diagnose(str(folder / "rank0.pickle")).blocks
    fw = b[b.compiled_pass == "forward"]
    assert len(fw) and fw.compiled_buffer.notna().all(), name
    lines = fw.compiled_line.astype(str).str.extract(r"fsdp_ckpt\.py:(\d+)")[0]
    assert lines.notna().all() and set(lines.astype(int)) <= mlp, (name, set(lines))


def test_deliberate_costs_are_reported_as_expected(matrix):
    """What the truth shows the configuration chose is reported, as `expected`."""
    checked = 0
    for name in _layouts():
        t = _truth(matrix / name)
        d = _diagnosis(matrix / name)
        by_rule = {f.rule: f.verdict for f in d.findings}
        held = [b["grads"] for b in t.get("backwards", []) if not b["last"]]
        if t.get("fsdp") in ("fsdp1", "fsdp2") and any(held):
            # FSDP2 set_requires_gradient_sync(False) and FSDP1 no_sync(): the unsharded grads
            # FSDP's own state held after a non-final backward
            assert by_rule.get(GRAD_SYNC) == "expected", name
            f = next(f for f in d.findings if f.rule == GRAD_SYNC)
            assert abs(f.bytes - max(held)) <= 0.05 * max(held), (name, f.bytes, held)
            checked += 1
        if any(fw["nonroot"] for fw in t.get("forwards", [])):
            assert by_rule.get(RAF) == "expected", name
            checked += 1
    assert checked >= 3


def _fixes(d) -> list[tuple[str, str]]:
    return [(f.rule, f.fix) for f in d.findings if f.fix]


def _compiles(src: str) -> bool:
    try:
        compile(src, "<fix>", "exec")
    except SyntaxError:
        return False
    return True


def test_every_fix_compiles_on_the_matrix_and_fixtures(matrix):
    fixes = []
    for name in _layouts():
        for shape in ("cpu", "cuda"):
            fixes += [(name, *x) for x in _fixes(_diagnosis(matrix / name, shape))]
    for p in sorted((REPO / "fixtures").glob("*.pickle.gz")):
        fixes += [(p.name, *x) for x in _fixes(diagnose(load(p)))]
    assert len(fixes) >= 10
    bad = [(where, rule) for where, rule, fix in fixes if not _compiles(fix)]
    assert not bad


def _other_stacks() -> list[Path]:
    """Corpus files of stacks other than FSDP (the manifest's notes say which are FSDP)."""
    files = corpus_files()
    if not files:
        return []
    notes = {}
    for line in (files[0].parent / "MANIFEST.tsv").read_text().splitlines()[1:]:
        cols = line.split("\t")
        if len(cols) >= 6:
            notes[cols[1]] = cols[5]
    return [p for p in files if "fsdp" not in notes.get(p.name, "").lower()]


def test_corpus_other_stacks_get_no_fsdp_finding_and_fixes_compile(corpus_dir):
    files = _other_stacks()
    assert files
    for path in files:
        d = diagnose(load(path))
        assert not [f.rule for f in d.findings if f.rule.startswith("fsdp.")], path.name
        bad = [rule for rule, fix in _fixes(d) if not _compiles(fix)]
        assert not bad, (path.name, bad)
