"""The Python API on the committed FSDP recordings: the documented example runs, the DataFrames
agree with the arrays and the Diagnosis they come from, user categories, compare, display."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from corpus import corpus_file

REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
FIXED = REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"


@pytest.fixture(scope="module")
def sf():
    import snapforensics

    return snapforensics


@pytest.fixture(scope="module")
def buggy(sf):
    return sf.diagnose(BUGGY)


def test_import_is_cheap_and_never_imports_torch():
    code = ("import sys, snapforensics as sf; sf.__version__; "
            "print(sorted(m for m in ('numpy', 'pandas', 'torch') if m in sys.modules)); "
            "sf.diagnose; print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "False"]


def test_documented_example_runs(monkeypatch):
    doc = (REPO / "docs" / "api.md").read_text()
    code = re.search(r"```python example\n(.*?)```", doc, re.S).group(1)
    monkeypatch.chdir(REPO)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/api.md", "exec"), {})
    text = out.getvalue()
    assert "fsdp.unsharded_params_not_resharded" in text
    # the per-unit table names every FSDP layer the example model has (6 blocks)
    assert all(f"layers.{i}" in text for i in range(6))


def test_blocks_agree_with_the_diagnosis(buggy):
    b, dev, a = buggy.blocks, buggy.diagnosis.devices[0], buggy.analyses[0]
    assert len(b) == len(a.lt)
    assert b["size"].sum() == a.lt.size.sum()
    r = dev.peak_row
    alive = b[(b.alloc_row <= r) & ((b.free_row > r) | (b.free_row == -1))]
    by_cat = alive.groupby("category", observed=True)["size"].sum()
    assert {k: int(v) for k, v in by_cat.items() if v} == dev.categories_at_peak
    cap = buggy.categories_at_peak
    assert cap["bytes"].sum() == sum(dev.categories_at_peak.values())
    assert cap["bytes"].is_monotonic_decreasing
    for col in ("phase", "category", "fsdp_unit", "top_frame"):
        assert isinstance(b[col].dtype, __import__("pandas").CategoricalDtype), col
    # a block allocated before the trace has no time; a timed file gives the others one
    born = b[b.alloc_row >= 0]
    assert born.alloc_time_us.notna().all()
    assert (born.alloc_time_us.diff().dropna() >= 0).mean() > 0.99


def test_fsdp_units_and_stacks(buggy):
    b = buggy.blocks
    units = set(b.loc[b.category == "fsdp.unsharded_param", "fsdp_unit"].dropna())
    assert {f"layers.{i}" for i in range(6)} <= units
    biggest = b.loc[b["size"].idxmax()]
    frames = buggy.stack(biggest.stack_id)
    assert frames == buggy.snapshot.stack_frames(int(biggest.stack_id))
    assert buggy.stack(-1) == []
    # top_frame is a frame of the block's own stack, outside torch when the stack has one
    row = b[b.top_frame.astype(str).str.contains("fsdp_ckpt.py")].iloc[0]
    assert str(row.top_frame) in {str(f) for f in buggy.stack(row.stack_id)}


def test_timeline_is_per_row(buggy):
    t, a = buggy.timeline, buggy.analyses[0]
    assert len(t) == a.lt.rows and (t.row.to_numpy() == np.arange(a.lt.rows)).all()
    assert t.live_bytes.max() == buggy.peaks["overall_bytes"]
    assert t.reserved_bytes.isna().all()  # CPU recording: no caching allocator
    assert set(t.phase.unique()) >= {"forward", "backward", "recompute", "optimizer"}
    assert t.iteration.max() == len(buggy.diagnosis.devices[0].iterations) - 1


def test_reserved_bytes_on_a_cuda_file(sf):
    d = sf.diagnose(corpus_file("MemSnapDump_snapshot_expandable.pkl"))
    t = d.timeline
    assert t.reserved_bytes.notna().all()
    assert (t.reserved_bytes >= t.live_bytes * 0.99).all()


def test_findings_frame(buggy):
    f = buggy.findings
    assert list(f.rule) == [x.rule for x in buggy.diagnosis.findings]
    top = f[f.verdict == "anomalous"].iloc[0]
    assert top.predicted_peak_bytes < buggy.peaks["overall_bytes"]
    assert top.saving_bytes == buggy.peaks["overall_bytes"] - top.predicted_peak_bytes


def test_user_categories(sf, buggy):
    d = sf.diagnose(BUGGY, categories={"norm": r"rms_norm", "adam": r"torch/optim/adam\.py"})
    b = d.blocks
    norm = b[b.category == "norm"]
    assert len(norm) > 0
    for sid in norm.stack_id.unique()[:20]:
        assert any("rms_norm" in f"{f.name} {f.filename}" for f in d.stack(sid))
    # applied after the rules: same findings, same peaks; the other categories shrank by it
    assert d.to_dict()["findings"] == buggy.to_dict()["findings"]
    assert d.peaks == buggy.peaks
    totals = d.to_dict()["devices"][0]["categories_total"]
    assert totals["norm"]["blocks"] == len(norm) and totals["adam"]["bytes"] > 0
    assert sum(v["bytes"] for v in totals.values()) == b["size"].sum()
    # the regex is also matched on record_function ranges (FSDP's on this CPU recording)
    r = sf.diagnose(BUGGY, categories={"gathered": r"FSDP::all_gather"}).blocks
    assert (r.category == "gathered").sum() > 0


def test_bad_user_category_is_a_clean_error(sf):
    from snapforensics.errors import SnapError

    with pytest.raises(SnapError, match="invalid regular expression"):
        sf.diagnose(BUGGY, categories={"x": "("})
    r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(BUGGY),
                        "--category", "x=("], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


def test_cli_category_in_json_and_its_own_cache_entry(tmp_path):
    env = {**os.environ, "SNAPFORENSICS_CACHE_DIR": str(tmp_path)}

    def totals(*args: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(BUGGY),
                            "--format", "json", *args], capture_output=True, text=True,
                           cwd=REPO, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["devices"][0]["categories_total"]

    plain = totals()
    assert "norm" not in plain
    assert totals("--category", "norm=rms_norm")["norm"]["blocks"] > 0
    assert totals("--category", "adam=adam\\.py")["adam"]["blocks"] > 0  # not the cached one
    assert totals() == plain


def test_compare_paths_and_reports(sf, buggy):
    fixed = sf.diagnose(FIXED)
    by_path = sf.compare(BUGGY, FIXED)
    by_report = sf.compare(buggy, fixed)
    assert by_path.to_dict()["deltas"][0]["peaks"] == by_report.to_dict()["deltas"][0]["peaks"]
    delta = by_report.deltas[0]["peaks"]["overall_bytes"]
    assert delta["after"] == fixed.peaks["overall_bytes"] < buggy.peaks["overall_bytes"]


def test_display(buggy):
    from snapforensics.report.common import human

    text = repr(buggy)
    assert "\n" not in text and len(text) < 300
    assert buggy.diagnosis.source in text and human(buggy.peaks["overall_bytes"]) in text
    html = buggy._repr_html_()
    assert "<svg" in html and "Parameters unsharded" in html
    assert "<html" not in html  # a fragment for the notebook's page
    # its styles never leak into the notebook: every rule is scoped to the fragment's element
    css = re.search(r"<style>(.*?)</style>", html, re.S).group(1)
    selectors = [x.strip() for rule in re.findall(r"([^{}]+)\{[^{}]*\}", css)
                 for x in rule.split(",")]
    assert selectors and all(x.startswith(".sf-report") for x in selectors)


@pytest.mark.parametrize("name", ["Muduard_dump_snapshot_495k.pickle",
                                  "MemSnapDump_snapshot_with_multi_devices.pkl"])
def test_blocks_of_every_device_in_one_frame(sf, name):
    """Devices whose units or frames differ (one with no FSDP unit: empty categories of another
    dtype) still give one frame with every device's blocks, the columns categorical."""
    d = sf.diagnose(corpus_file(name))
    b = d.blocks
    assert len(b) == sum(len(a.lt) for a in d.analyses)
    assert int(b["size"].sum()) == sum(int(a.lt.size.sum()) for a in d.analyses)
    for col in ("phase", "category", "fsdp_unit", "top_frame"):
        assert isinstance(b[col].dtype, __import__("pandas").CategoricalDtype), col


def test_multi_device_file(sf):
    d = sf.diagnose(corpus_file("MemSnapDump_snapshot_with_multi_devices.pkl"))
    devices = {a.device for a in d.analyses}
    assert set(d.blocks.device.unique()) == devices
    assert set(d.timeline.device.unique()) == devices
    assert len(d.blocks) == sum(len(a.lt) for a in d.analyses)
