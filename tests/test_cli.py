"""The command line as a user meets it: exit codes, one-line errors, redaction, every format."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from corpus import corpus_file

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapforensics", *args], capture_output=True,
                          text=True, cwd=cwd or REPO, timeout=120)


@pytest.mark.parametrize("make", ["missing", "directory", "text", "truncated", "global"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, make):
    p = tmp_path / "x.pickle"
    if make == "directory":
        p.mkdir()
    elif make == "text":
        p.write_text("this is not a snapshot\n")
    elif make == "truncated":
        p.write_bytes(corpus_file("silmont2000_mem_snapshot.pickle").read_bytes()[:5000])
    elif make == "global":
        p.write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    r = run("diagnose", str(p))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("snapforensics: error:"), r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "pwned").exists()


def test_every_format_and_gzip(tmp_path):
    src = corpus_file("NiuHuangxiaozi_fwd_bwd_200_mixed.pickle")
    gz = tmp_path / "snap.pickle.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    peaks = set()
    for fmt in ("json", "markdown", "html", "terminal"):
        out = tmp_path / f"report.{fmt}"
        r = run("diagnose", str(gz), "--format", fmt, "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert out.stat().st_size > 500
        if fmt == "json":
            peaks.add(json.loads(out.read_text())["peaks"]["overall_bytes"])
    r = run("diagnose", str(src), "--format", "json")
    peaks.add(json.loads(r.stdout)["peaks"]["overall_bytes"])
    assert len(peaks) == 1  # gzip'd and plain say the same


def test_fail_on_passes_a_healthy_file():
    r = run("diagnose", str(corpus_file("NiuHuangxiaozi_fwd_bwd_200_mixed.pickle")),
            "--format", "json", "--fail-on", "anomalous")
    doc = json.loads(r.stdout)
    anomalies = [f for f in doc["findings"] if f["verdict"] == "anomalous"]
    assert r.returncode == (1 if anomalies else 0)


def test_redact_paths_hides_user_paths_keeps_library_paths():
    src = str(corpus_file("MAGMA27_memory_snapshot.pickle"))  # Windows D:\ paths
    plain = run("diagnose", src, "--format", "json").stdout
    red = run("diagnose", src, "--format", "json", "--redact-paths").stdout
    assert "D:\\\\" in plain and "D:\\\\" not in red
    assert "/work/" not in red  # the source path is redacted too
    assert json.loads(red)["peaks"] == json.loads(plain)["peaks"]
    assert len(json.loads(red)["devices"][0]["top_stacks_at_peak"]) > 0


def test_version_and_help():
    assert run("--version").returncode == 0
    r = run("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("record", "diagnose", "demo"))


def test_analyzer_needs_no_torch():
    """diagnose with `import torch` made impossible: the analyzer never imports it."""
    src = str(corpus_file("NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"))
    code = ("import sys; sys.modules['torch'] = None; sys.argv = ['snapforensics', 'diagnose', "
            f"{src!r}, '--format', 'json']; from snapforensics.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["peaks"]["overall_bytes"] > 0


COMMANDS = ("record", "diagnose", "compare", "forecast", "demo")


def test_no_arguments_prints_the_help():
    """`snapforensics` alone: the help as click formats it (lines, not one error line with
    literal \\n), exit 2 like any usage error."""
    r = run()
    assert r.returncode == 2, r.returncode
    assert r.stdout.startswith("Usage: snapforensics") and "\\n" not in r.stdout + r.stderr
    assert all(f"  {c} " in r.stdout for c in COMMANDS)


def test_every_command_has_a_complete_description_and_examples():
    top = run("--help").stdout
    listed = {ln.split()[0]: ln for ln in top.split("Commands:")[1].splitlines()
              if ln.startswith("  ") and ln.split()[0] in COMMANDS}
    assert set(listed) == set(COMMANDS)
    assert not [ln for ln in listed.values() if ln.rstrip().endswith("...")], listed
    for c in COMMANDS:
        h = run(c, "--help").stdout
        assert "Examples:" in h and f"snapforensics {c} " in h.split("Examples:")[1], c
    from snapforensics.cli import cli

    # every option says what it does (demo's --steps had no help)
    bare = [(c, p.name) for c, cmd in cli.commands.items() for p in cmd.params
            if isinstance(p, click.Option) and not p.help]
    assert not bare, bare


@pytest.mark.parametrize("args", [["diagnose", "--bogus"], ["diagnose"], ["nosuchcommand"],
                                  ["record"], ["record", "--device", "tpu", "x.py"],
                                  ["diagnose", "x.pickle", "--format", "pdf"],
                                  ["compare", "a.pickle", "b.pickle", "--mode", "sideways"]])
def test_usage_errors_are_one_line_exit_2(args):
    r = run(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("snapforensics: error:"), r.stderr
    assert "--help" in r.stderr and r.stdout == ""
