"""Hostile files through the CLI, each in a subprocess under a 2 GiB address-space cap and a time
limit: exit 0 or 2, exactly one stderr line on exit 2, bounded time and peak RSS, and no raw
control character in the terminal or Markdown report. The files are assembled opcode by opcode
(tests/hostile.py) from the repository's fixtures, so this runs on a clean clone."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostile import CASES

ROOT = Path(__file__).resolve().parents[1]
MEMORY = 2 << 30
SECONDS = 120  # a loaded CI machine; unbounded versions take minutes or never end


def _cap() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def run(*args: str) -> tuple[int, str, bytes, float, int]:
    """(exit code, stderr, stdout, seconds, peak RSS bytes) of the CLI under the caps."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SNAPFORENSICS_EXPANSION", None)
    # RUSAGE_CHILDREN is the max over every child this process ever waited for (recordings
    # included): a fresh wrapper process reports the peak RSS of this one CLI run alone, on the
    # pipe whose fd it is given first.
    wrapper = ("import os, resource, subprocess, sys\n"
               "rc = subprocess.run(sys.argv[2:]).returncode\n"
               "os.write(int(sys.argv[1]),\n"
               "         str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss).encode())\n"
               "sys.exit(rc)")
    r, w = os.pipe()
    t = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", wrapper, str(w), sys.executable, "-m",
                          "snapforensics", *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, preexec_fn=_cap, pass_fds=(w,))
    os.close(w)
    try:
        out, err = p.communicate(timeout=SECONDS)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail(f"{args}: still running after {SECONDS} s")
    finally:
        with os.fdopen(r, "rb") as f:
            reported = f.read()
    seconds = time.monotonic() - t
    rss = int(reported or 0) * 1024
    return p.returncode, err.decode("utf-8", "replace"), out, seconds, rss


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    return {name: build(d) for name, build in CASES.items()}


# What each case must end in: exit 2 with the one line naming what was refused (the limit and
# how to raise it, for budgets), or exit 0 (None). Every case is listed.
EXPECTED = {
    "deep_tuple_key": "not a memory snapshot",  # was SIGSEGV (exit 139) in hash()
    "deep_frozenset": "not a memory snapshot",
    "deep_dicts": None,
    "deep_lists_frames": "a frame is list",
    "huge_length_unicode": "SNAPFORENSICS_LOAD_MEMORY",
    "huge_length_bytearray": "SNAPFORENSICS_LOAD_MEMORY",
    "huge_memo_index": "SNAPFORENSICS_LOAD_MEMORY",
    "bytearray_in_field": "must be strings",
    "infinite_time": "time_us inf is out of range",
    "huge_int_size": "out of range",
    "huge_int_text": "4300 digits",
    "shared_blocks": "SNAPFORENSICS_EXPANSION",
    "shared_traces": "SNAPFORENSICS_EXPANSION",
    "shared_long_stack": None,
    "joined_names": "SNAPFORENSICS_EXPANSION",
    "many_devices": "SNAPFORENSICS_EXPANSION",
    "gzip_trailing_zeros": None,
    "control_chars": None,
}


def test_every_case_has_an_expectation():
    assert set(EXPECTED) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_file_exits_cleanly(files, name):
    code, err, out, seconds, rss = run("diagnose", str(files[name]), "--format", "json")
    assert code in (0, 2), f"{name}: exit {code}\n{err[-2000:]}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    want = EXPECTED[name]
    if want is None:
        assert code == 0, err
    else:
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith("snapforensics: error: ") and want in lines[0], err
    if name == "gzip_trailing_zeros":  # 1 GiB of zeros after the pickle: not all inflated
        assert b'"stale_bytes"' in out and rss < 1 << 30
    assert seconds < SECONDS and rss < MEMORY


def test_the_budget_is_a_factor_the_message_names():
    """A budget, not a ban: SNAPFORENSICS_EXPANSION scales it (here down, on a real fixture)."""
    fixture = ROOT / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SNAPFORENSICS_EXPANSION="0.001")
    r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(fixture),
                        "--format", "json"], env=env, capture_output=True, timeout=SECONDS,
                       preexec_fn=_cap)
    lines = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "SNAPFORENSICS_EXPANSION=" in lines[0]


@pytest.mark.parametrize("fmt", ["terminal", "markdown"])
def test_control_characters_never_reach_the_output(files, fmt):
    code, err, out, *_ = run("diagnose", str(files["control_chars"]), "--format", fmt)
    assert code == 0, err
    text = out.decode("utf-8")
    assert "\x1b" not in text and "\x07" not in text and "\x00" not in text
    assert "\u202e" not in text
