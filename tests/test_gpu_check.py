"""benchmarks/gpu_check.py runs on a GPU later, once, by someone else: here its CPU-side parts
run (`--dry-run`: the names check recorded on the CPU with its verification code, the analyzer
side of the graph-pool check), so that the script imports, its checks agree with this
version's analyzer, and it prints its table and exits by its results."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from recordings import REPO

pytest.importorskip("torch")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), *args],
                          capture_output=True, text=True, timeout=300, check=False,
                          cwd=REPO)


def test_dry_run_passes_its_cpu_side_checks_and_skips_the_cuda_ones():
    p = _run("--dry-run", "--only", "names,graph_pools,oom")
    assert p.returncode == 0, p.stdout + p.stderr
    table = p.stdout[p.stdout.index("check "):]  # the table after the per-check lines
    for check, result in (("names[cpu]", "PASS"), ("graph_pools[analyzer only]", "PASS"),
                          ("oom", "SKIP")):
        assert re.search(rf"^{re.escape(check)}\s+{result}\s", table, re.M), table
    assert "1 skipped" in p.stdout and "0 failed" in p.stdout


def test_a_failing_check_exits_nonzero():
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run",
                        "--only", "names"], capture_output=True, text=True, timeout=300,
                       check=False, cwd=REPO, env={**os.environ, "SNAPFORENSICS_NAMES": "0"})
    assert p.returncode == 1 and "FAIL" in p.stdout and "1 failed" in p.stdout, p.stdout
