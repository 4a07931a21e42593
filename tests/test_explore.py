"""The explorer's HTTP JSON API (explore/server.py over explore/queries.py), driven through
Starlette's TestClient on the committed recordings, its answers held against `snapforensics.api`
(the same diagnosis the report makes), and the command run as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from functools import cache
from pathlib import Path

import numpy as np
import pytest

import snapforensics as sf

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from snapforensics.explore.server import app  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"


@cache
def report(path: Path = BUGGY) -> sf.Report:
    return sf.diagnose(path)


def client(rep: sf.Report) -> tuple[TestClient, dict[str, str]]:
    web = app(rep)
    return TestClient(web), {"X-Token": web.state.token}


@pytest.mark.parametrize("width", [1, 37, 800])
def test_window_is_bounded_by_the_width_and_keeps_every_byte(width):
    rep = report()
    c, h = client(rep)
    d = rep.analyses[0]
    lo, hi = d.peak_row - 500, d.peak_row + 500
    w = c.get(f"/api/window?lo={lo}&hi={hi}&width={width}", headers=h).json()
    assert len(w["blocks"]) <= width and all(len(v) == width for v in w["bands"].values())
    assert len(w["live"]) == width
    # every block alive in the window is drawn or merged, none lost
    b = rep.blocks
    start, end = b.alloc_row.clip(lower=0), b.free_row.where(b.free_row >= 0, d.lt.rows)
    alive = int(((start < hi) & (end > lo)).sum())
    assert len(w["blocks"]) + w["merged_blocks"] == alive
    # the live curve keeps the window's peak (the trace's timeline, not re-derived)
    t = rep.timeline.live_bytes.to_numpy()[lo:hi]
    assert max(w["live"]) == int(t.max())
    # the drawn blocks are the largest ones
    if w["merged_blocks"] and w["blocks"]:
        assert min(x["size"] for x in w["blocks"]) >= 1


def test_block_details_are_the_api_blocks_row():
    rep = report()
    c, h = client(rep)
    b = rep.blocks
    big = b[b.category == "fsdp.unsharded_param"].sort_values("size", kind="stable").index[-1]
    got = c.get(f"/api/block/{big}", headers=h).json()
    row = b.loc[big]
    for col in ("address", "size", "alloc_row", "free_row", "iteration", "stack_id"):
        assert got[col] == int(row[col]), col
    for col in ("phase", "category", "fsdp_unit"):
        assert got[col] == str(row[col]), col
    frames = [(f.name, f.filename, f.line) for f in rep.stack(int(row.stack_id))]
    got_frames = [(f["name"], f["file"], f["line"]) for f in got["stack"] + got["native_frames"]]
    # every frame, Python ones first, each group in the stack's order
    assert sorted(got_frames) == sorted(frames)
    assert [x for x in frames if x in got_frames[:len(got["stack"])]] == \
        got_frames[:len(got["stack"])]
    anomalous = [i for i, f in enumerate(rep.diagnosis.findings) if f.verdict == "anomalous"]
    assert set(got["findings"]) <= set(range(len(rep.diagnosis.findings)))
    assert c.get(f"/api/block/{len(b)}", headers=h).status_code == 404
    assert anomalous


def test_a_finding_names_its_blocks_and_the_curve_after_its_fix():
    rep = report()
    c, h = client(rep)
    i, f = next((i, f) for i, f in enumerate(rep.diagnosis.findings) if f.verdict == "anomalous")
    got = c.get(f"/api/finding/{i}?width=400", headers=h).json()
    assert len(got["block_ids"]) == f.blocks
    # each of them says it belongs to the finding
    assert all(i in c.get(f"/api/block/{b}", headers=h).json()["findings"]
               for b in got["block_ids"])
    # the same replay as the report: its peak is the predicted peak
    assert max(got["after_fix"]) == f.predicted_peak_bytes
    # filtering by the finding draws only its blocks; the rest is the grey band
    w = c.get(f"/api/window?width=4096&finding={i}", headers=h).json()
    assert {x["id"] for x in w["blocks"]} <= set(got["block_ids"])
    assert "filtered out" in w["bands"]


def test_filters_and_cpu_segments():
    rep = report()
    c, h = client(rep)
    w = c.get("/api/window?width=4096&category=fsdp.unsharded_param&min_size=1024",
              headers=h).json()
    b = rep.blocks
    assert {x["category"] for x in w["blocks"]} <= {"fsdp.unsharded_param"}
    ids = np.array([x["id"] for x in w["blocks"]], np.int64)
    assert (b["size"].to_numpy()[ids] >= 1024).all()
    s = c.get("/api/segments", headers=h).json()
    assert not rep.snapshot.kind.caching_allocator
    assert s["segments"] == [] and "no caching allocator" in s["statement"]


def test_every_request_needs_the_token():
    c, h = client(report())
    for path in ("/", "/api/overview", "/api/window", "/api/block/0", "/api/finding/0"):
        assert c.get(path).status_code == 403
        assert c.get(path, headers={"X-Token": "wrong"}).status_code == 403
        assert c.get(path, headers=h).status_code == 200, path
    assert c.get("/?token=" + h["X-Token"]).status_code == 200
    # no endpoint takes a path
    assert c.get("/api/overview?path=/etc/passwd", headers=h).json()["source"] == str(BUGGY)


def test_hostile_strings_come_back_as_plain_json_strings(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    from hostile import control_chars

    path = control_chars(tmp_path)
    rep = sf.diagnose(path)
    c, h = client(rep)
    big = int(rep.blocks["size"].idxmax())
    got = c.get(f"/api/block/{big}", headers=h).json()
    names = [f.name for f in rep.stack(int(rep.blocks.stack_id[big]))]
    assert got["stack"] or got["native_frames"]
    hostile = [n for n in names if any(ch in n for ch in "<\x1b\u202e\x00")]
    assert hostile, names  # else the rest proves nothing
    # the same strings, as JSON strings, byte for byte (bounded as the JSON sink caps them)
    assert sorted(f["name"] for f in got["stack"] + got["native_frames"]) == sorted(names)
    page = c.get("/", headers=h)
    # the page inserts every string as text and runs no script from elsewhere
    assert "innerHTML" not in page.text and "insertAdjacentHTML" not in page.text
    assert "http://" not in page.text.replace("http://127.0.0.1", "")
    assert "https://" not in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]


def test_the_command_serves_on_localhost_and_stops_on_ctrl_c():
    p = subprocess.Popen([sys.executable, "-m", "snapforensics", "explore", str(BUGGY),
                          "--no-browser"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=os.environ | {"SNAPFORENSICS_CACHE": "off"})
    try:
        line = p.stdout.readline()
        url = line.split()[2]
        assert url.startswith("http://127.0.0.1:") and "token=" in url
        base, token = url.split("/?token=")
        import json
        for _ in range(50):
            try:
                got = json.loads(urllib.request.urlopen(f"{base}/api/overview?token={token}",
                                                        timeout=5).read())
                break
            except OSError:
                import time
                time.sleep(0.1)
        assert got["peaks"] == report().peaks
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(20)
    assert p.returncode in (0, 130)


def test_explore_a_missing_file_is_one_line():
    r = subprocess.run([sys.executable, "-m", "snapforensics", "explore", "/nonexistent.pickle",
                        "--no-browser"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_html_report_says_which_explore_command_opens_each_findings_blocks(tmp_path):
    out = tmp_path / "r.html"
    r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(BUGGY), "-o",
                        str(out), "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import re
    html = out.read_text()
    rep = report()
    got = {int(n) for n in re.findall(r"snapforensics explore \S+ --finding (\d+)", html)}
    assert got == {i for i, f in enumerate(rep.diagnosis.findings) if f.blocks}
    # and each number names that finding in the explorer's API
    c, h = client(rep)
    for n in got:
        sec = html[html.index(f"--finding {n}") - 4000:html.index(f"--finding {n}")]
        rule = c.get(f"/api/finding/{n}", headers=h).json()["rule"]
        assert sec[sec.rindex("rule <code>"):].startswith(f"rule <code>{rule}</code>")


def test_a_cuda_corpus_file_shows_its_segments_with_the_free_gaps():
    path = REPO.parent / "shared" / "corpus" / "ConstructorSun_memory_snapshot.pickle"
    if not path.exists():
        pytest.skip("needs ../shared/corpus")
    rep = sf.diagnose(path)
    assert rep.snapshot.kind.caching_allocator
    c, h = client(rep)
    dev = rep.analyses[0].device
    got = c.get(f"/api/segments?device={dev}", headers=h).json()
    segs = sorted((s for s in sf.load(path).segments if s.device == dev),
                  key=lambda s: s.address)
    assert [s["address"] for s in got["segments"]] == [s.address for s in segs]
    for g, s in zip(got["segments"], segs):
        assert g["reserved_unused"] == s.total_size - s.allocated_size
        free = [b["size"] for b in g["blocks"] if b["state"] == "inactive"]
        assert free == [b.size for b in s.blocks if b.state == "inactive"]
    assert any(b["state"] == "inactive" for s in got["segments"] for b in s["blocks"])
