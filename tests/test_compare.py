"""`snapforensics compare`: before/after a fix and rank vs rank, on real inputs.

The slow tests compare real FSDP2 + checkpoint recordings of the bundled example (the `buggy`
and `fixed` variants other tests record too, so a session records each once); the corpus tests
need no torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from corpus import corpus_file

from snapforensics.analysis.compare import BEFORE_AFTER, RANKS, SCHEMA
from snapforensics.analysis.rules import fsdp_reduce_scatter, fsdp_reshard
from snapforensics.analysis.vocab import Category
from snapforensics.errors import SnapError
from snapforensics.report import render
from snapforensics.runner import compare_paths


def render_text(c, fmt):
    return render("compare", c, fmt)

REPO = Path(__file__).resolve().parents[1]
RESHARD, REDUCE = fsdp_reshard.RULE.id, fsdp_reduce_scatter.RULE.id
FORWARD = "NiuHuangxiaozi_forward_200.pickle"
FWD_BWD = "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapforensics", *args], capture_output=True,
                          text=True, cwd=cwd or REPO, timeout=300)


def rules(items):
    return {f["rule"] for f in items}


# ------------------------------------------------------------------ real recordings (torch)

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("torch")
    from recordings import recorded

    return {v: recorded(v, tmp_path_factory) for v in ("buggy", "fixed")}


@pytest.fixture(scope="module")
def fix_cmp(runs):
    return compare_paths([runs["buggy"][0], runs["fixed"][0]])


@pytest.mark.slow
def test_fix_lowers_the_peak_and_removes_the_anomaly(fix_cmp):
    c = fix_cmp
    assert c.mode == BEFORE_AFTER
    assert [i["rank"] for i in c.inputs] == [0, 0]
    assert c.inputs[0]["label"] != c.inputs[1]["label"]  # buggy/rank0.pickle vs fixed/...
    d = c.deltas[0]
    p = d["peaks"]["overall_bytes"]
    assert p["after"] < p["before"] and p["delta_bytes"] < 0 and p["delta_pct"] < -5
    assert d["peaks"]["backward_bytes"]["delta_bytes"] < 0
    assert RESHARD in rules(d["findings"]["disappeared"])
    assert RESHARD not in rules(d["findings"]["appeared"]) | rules(d["findings"]["persisted"])
    gone = next(f for f in d["findings"]["disappeared"] if f["rule"] == RESHARD)
    assert gone["verdict"] == "anomalous" and gone["bytes"] > 0
    assert REDUCE in rules(d["findings"]["persisted"])  # expected growth stays expected
    assert d["anomalies"]["after"] == 0 < d["anomalies"]["before"]


@pytest.mark.slow
def test_prediction_matches_the_measured_peak_after_the_fix(fix_cmp):
    preds = fix_cmp.deltas[0]["predictions"]
    p = next(p for p in preds if p["rule"] == RESHARD)
    assert p["fixed"]
    assert p["measured_peak_bytes"] == fix_cmp.inputs[1]["peaks"]["overall_bytes"]
    assert p["predicted_peak_bytes"] < p["baseline_peak_bytes"]
    assert abs(p["error_pct"]) < 10, p


@pytest.mark.slow
def test_unsharded_params_at_peak_drop(fix_cmp):
    cats = {x["category"]: x for x in fix_cmp.deltas[0]["categories_at_peak"]}
    u = cats[Category.UNSHARDED_PARAM]
    assert u["after"] < u["before"] and u["delta_bytes"] < 0
    # what the fix removed is mostly the unsharded parameters
    assert -u["delta_bytes"] >= 0.5 * fix_cmp.deltas[0]["removed_at_peak_bytes"]
    # before/after/delta of each category agree with the inputs
    for x in fix_cmp.deltas[0]["categories_at_peak"]:
        assert x["before"] == fix_cmp.inputs[0]["categories_at_peak"].get(x["category"], 0)
        assert x["after"] - x["before"] == x["delta_bytes"]


@pytest.mark.slow
def test_fixed_ranks_are_balanced(runs):
    c = compare_paths(runs["fixed"])
    assert c.mode == RANKS
    assert [i["rank"] for i in c.inputs] == [0, 1]
    im = c.imbalance
    assert im is not None and not im["flagged"]
    assert abs(im["worst"]["deviation_pct"]) < 5 and im["spread_pct"] < 5
    assert "predictions" not in c.deltas[0]
    assert not c.warnings, c.warnings
    # a folder stands for its rank files, in rank order
    assert [i["source"] for i in compare_paths([runs["fixed"][0].parent]).inputs] == \
        [str(p) for p in runs["fixed"]]


@pytest.mark.slow
def test_imbalance_is_flagged_for_the_outlier(runs):
    c = compare_paths([runs["fixed"][0], runs["fixed"][1], runs["buggy"][1]], mode=RANKS)
    im = c.imbalance
    assert im["flagged"]
    assert im["worst"]["source"] == str(runs["buggy"][1])  # the rank with the larger peak
    assert im["worst"]["deviation_pct"] > 5
    assert any("more than once" in w for w in c.warnings)  # rank 1 twice


@pytest.mark.slow
def test_terminal_report_of_the_fix(fix_cmp):
    text = render_text(fix_cmp, "terminal")
    assert "before/after" in text and "disappears" in text and RESHARD in text
    assert "prediction check" in text and "error" in text
    md = render_text(fix_cmp, "markdown")
    assert "## Prediction check" in md and f"| {RESHARD} | anomalous | disappears |" in md


# -------------------------------------------------------------------- corpus (no torch)

def test_corpus_forward_vs_fwd_bwd():
    a, b = corpus_file(FORWARD), corpus_file(FWD_BWD)
    c = compare_paths([a, b])
    assert c.mode == BEFORE_AFTER  # no ranks in the names
    d = c.deltas[0]
    assert c.inputs[0]["peaks"]["backward_bytes"] == 0
    assert d["peaks"]["backward_bytes"]["delta_pct"] is None  # from nothing: no percentage
    assert d["peaks"]["backward_bytes"]["after"] > 0
    assert d["peaks"]["overall_bytes"]["delta_bytes"] == \
        c.inputs[1]["peaks"]["overall_bytes"] - c.inputs[0]["peaks"]["overall_bytes"]
    assert not c.inputs[0]["findings"]
    assert rules(d["findings"]["appeared"]) == rules(c.inputs[1]["findings"])
    assert not d["findings"]["disappeared"] and not d["findings"]["persisted"]
    assert d["predictions"] == []  # the baseline has no anomaly to predict from
    # the reverse direction: what appeared now disappears
    r = compare_paths([b, a]).deltas[0]
    assert rules(r["findings"]["disappeared"]) == rules(d["findings"]["appeared"])
    assert r["peaks"]["overall_bytes"]["delta_bytes"] == -d["peaks"]["overall_bytes"]["delta_bytes"]
    for fmt in ("terminal", "markdown"):
        text = render_text(c, fmt)
        assert FORWARD in text and "appears" in text


def test_analysis_does_not_import_torch():
    a, b = corpus_file(FORWARD), corpus_file(FWD_BWD)
    code = ("import sys; from snapforensics.runner import compare_paths; "
            "from snapforensics.report import render; "
            f"render('compare', compare_paths([{str(a)!r}, {str(b)!r}]), 'markdown'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_cli_json(tmp_path):
    a, b = corpus_file(FORWARD), corpus_file(FWD_BWD)
    r = run("compare", str(a), str(b), "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == SCHEMA
    assert [i["source"] for i in doc["inputs"]] == [str(a), str(b)]
    for i in doc["inputs"]:
        assert {"source", "rank", "peaks"} <= set(i)
        assert set(i["peaks"]) == {"overall_bytes", "forward_bytes", "backward_bytes"}
    assert len(doc["deltas"]) == 1
    assert doc["deltas"][0]["peaks"]["overall_bytes"]["after"] == \
        doc["inputs"][1]["peaks"]["overall_bytes"]
    # the same through -o, and markdown / terminal to files
    out = tmp_path / "cmp.json"
    r = run("compare", str(a), str(b), "--format", "json", "-o", str(out))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert json.loads(out.read_text()) == doc
    for fmt in ("markdown", "terminal"):
        out = tmp_path / f"cmp.{fmt}"
        r = run("compare", str(a), str(b), "--format", fmt, "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert out.stat().st_size > 300
    r = run("compare", str(a), str(b))
    assert r.returncode == 0 and "peak" in r.stdout, r.stderr


@pytest.mark.parametrize("case", ["one", "missing", "text", "directory", "glob"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    good = str(corpus_file(FORWARD))
    bad = tmp_path / "x.pickle"
    if case == "one":
        args = [good]
    elif case == "missing":
        args = [good, str(bad)]
    elif case == "text":
        bad.write_text("this is not a snapshot\n")
        args = [good, str(bad)]
    elif case == "directory":  # a folder with no rank*.pickle in it
        args = [good, str(tmp_path)]
    else:
        args = [good, str(tmp_path / "rank*.pickle")]
    r = run("compare", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("snapforensics: error:"), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_needs_two_inputs_in_the_api():
    with pytest.raises(SnapError):
        compare_paths([corpus_file(FORWARD)])
