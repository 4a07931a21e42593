"""Issue 26: each hostile shape read by all three read paths (the streaming C reader; the C
unpickler + C trace columns, SNAPFORENSICS_STREAM=0; pure Python, SNAPFORENSICS_PURE_PYTHON=1)
through `diagnose --format json` in a child under a 4 GiB address-space cap (the issue's; a
lower one would refuse the old code's blow-ups before they show in its RSS) and a timeout: exit
0 or 2 with one line, the same result in every path, and a peak RSS bounded by the file's size
(a small fixed allowance for the interpreter, numpy and the analysis, plus 96x the pickle).
"""

from __future__ import annotations

import gzip
import json

import pytest
from shapes26 import SHAPES
from test_hostile import run

PATHS = {"stream": {}, "no_stream": {"SNAPFORENSICS_STREAM": "0"},
         "pure": {"SNAPFORENSICS_PURE_PYTHON": "1"}}
FIXED_RSS = 400 << 20  # the CLI's own peak on a tiny file is ~150 MiB
RSS_PER_BYTE = 96  # of pickle: one EMPTY_LIST byte is an ~80-byte list in pickle.load
CASES = SHAPES


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes26")
    return {name: b(d) for name, b in CASES}


@pytest.mark.parametrize("name", [n for n, _ in CASES])
def test_every_read_path_agrees_in_bounded_memory(built, name, monkeypatch):
    path = built[name]
    data = path.read_bytes()
    size = len(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)  # pickle bytes
    results = {}
    for label, env in PATHS.items():
        for k in ("SNAPFORENSICS_STREAM", "SNAPFORENSICS_PURE_PYTHON", "SNAPFORENSICS_LOAD_MEMORY"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("SNAPFORENSICS_NO_CACHE", "1")  # each path reads the file itself
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        rc, err, out, _seconds, rss = run("diagnose", str(path), "--format", "json",
                                          memory=4 << 30)
        assert rc in (0, 2), f"{name} [{label}]: exit {rc}: {err[-2000:]}"
        if rc == 2:
            assert len(err.strip().splitlines()) == 1, f"{name} [{label}]: {err[-2000:]}"
            results[label] = (rc, err.strip())
        else:
            results[label] = (rc, json.loads(out))
        assert rss <= FIXED_RSS + RSS_PER_BYTE * size, \
            f"{name} [{label}]: peak RSS {rss >> 20} MiB for a {size:,}-byte file"
    assert results["stream"] == results["no_stream"] == results["pure"], name
