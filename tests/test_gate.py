"""compare as a CI gate: run folders paired rank by rank, --fail-on regression / new-anomaly,
the HTML report; on the committed FSDP recordings (the fixed run as the baseline)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from snapforensics.analysis.rules import fsdp_reshard

RESHARD = fsdp_reshard.RULE.id

REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
FIXED = REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapforensics", *args, "-q"],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(REPO)})


def diag(p: Path) -> dict:
    r = cli("diagnose", str(p), "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """runs/a: the fixed recording on both ranks; runs/b: rank 1 regressed to the buggy one."""
    root = tmp_path_factory.mktemp("runs")
    for run, files in (("a", (FIXED, FIXED)), ("b", (FIXED, BUGGY))):
        (root / run).mkdir()
        for rank, f in enumerate(files):
            shutil.copy(f, root / run / f"rank{rank}.pickle.gz")
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def growth() -> float:
    """How much the buggy recording's peak exceeds the fixed one's, in percent."""
    b, f = diag(BUGGY)["peaks"]["overall_bytes"], diag(FIXED)["peaks"]["overall_bytes"]
    assert b > f
    return 100.0 * (b - f) / f


def test_folders_are_compared_rank_by_rank(runs, growth):
    r = cli("compare", str(runs[0]), str(runs[1]), "--format", "json")
    assert r.returncode == 0, r.stderr  # no --fail-on: a report, not a gate
    c = json.loads(r.stdout)
    assert c["schema"] == "snapforensics.compare_runs/1" and c["overall"]["ranks"] == 2
    r0, r1 = c["ranks"]
    assert [Path(i["source"]).name for i in r0["inputs"]] == ["rank0.pickle.gz"] * 2
    assert r0["deltas"][0]["peaks"]["overall_bytes"]["delta_bytes"] == 0
    assert r1["deltas"][0]["peaks"]["overall_bytes"]["delta_pct"] == pytest.approx(growth, 0.01)
    assert c["overall"]["new_anomalies"] == [RESHARD]
    assert c["overall"]["largest_growth"]["label"].endswith("rank1.pickle.gz")


def test_regression_threshold(runs, growth):
    below = cli("compare", *map(str, runs), "--fail-on", f"regression={growth - 1:.1f}%")
    assert below.returncode == 1
    assert below.stderr.count("gate failed") == 1 and "rank1" in below.stderr, below.stderr
    above = cli("compare", *map(str, runs), "--fail-on", f"regression={growth + 1:.1f}%")
    assert above.returncode == 0, above.stderr


def test_new_anomaly(runs):
    r = cli("compare", *map(str, runs), "--fail-on", "new-anomaly", "--format", "markdown")
    assert r.returncode == 1 and f"new anomaly {RESHARD}" in r.stderr
    assert "FAIL" in r.stdout
    back = cli("compare", str(runs[1]), str(runs[0]), "--fail-on", "new-anomaly")
    assert back.returncode == 0, back.stderr  # the fix removes it: nothing new


def test_files_before_after_gate_and_html(tmp_path):
    out = tmp_path / "c.html"
    r = cli("compare", str(FIXED), str(BUGGY), "--fail-on", "regression=5%", "--fail-on",
            "new-anomaly", "--format", "html", "-o", str(out))
    assert r.returncode == 1 and r.stderr.count("gate failed") == 2, r.stderr
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "<script" not in page
    assert RESHARD in page and "gate failed" not in page and "peak grew" in page
    ok = cli("compare", str(BUGGY), str(FIXED), "--fail-on", "regression=5%", "--format",
             "json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["gate"]["failures"] == []


def test_gate_misuse_is_one_line(runs):
    r = cli("compare", *map(str, runs), "--fail-on", "regresion=5")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    r = cli("compare", str(runs[1]), "--mode", "ranks", "--fail-on", "new-anomaly")
    assert r.returncode == 2 and "baseline" in r.stderr, r.stderr
