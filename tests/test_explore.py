"""The explorer's HTTP JSON API (explore/server.py over explore/queries.py), driven through
Starlette's TestClient on the committed recordings, its answers held against `snapforensics.api`
(the same diagnosis the report makes), and the command run as a user runs it."""

from __future__ import annotations

import json
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

from snapforensics.explore import queries  # noqa: E402
from snapforensics.explore.server import app  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
FIXED = REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"
FLEET = [BUGGY, FIXED, REPO / "fixtures" / "hf_fabric_fsdp1_full_rank0.pickle.gz"]


@cache
def report(path: Path = BUGGY) -> sf.Report:
    return sf.diagnose(path)


def client(rep, fleet=None) -> tuple[TestClient, dict[str, str]]:
    web = app(rep, fleet)
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
    for path in ("/", "/api/overview", "/api/window", "/api/block/0", "/api/finding/0",
                 "/api/compare", "/api/segments"):
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


def _expected(rep: sf.Report, axis: str, x0: float, x1: float, width: int) -> list:
    """The overlay's series of one run, from `rep.timeline` alone: row i in column
    floor((x_i - x0) / (x1 - x0) * width); a column's max, else the last row before it, else
    None (before the first row, or past the run's end)."""
    t = rep.timeline
    t = t[t.device == rep.diagnosis.primary.device]
    n = len(t)
    x = (t.row / n if axis == "fraction" else t.time_s.cummax()).to_numpy()
    end = 1.0 if axis == "fraction" else x[-1]
    col = np.floor((x - x0) / (x1 - x0) * width).astype(np.int64)
    live = t.live_bytes.to_numpy()
    out = []
    for k in range(width):
        here = live[col == k]
        before = np.flatnonzero(col < k)
        start = x0 + (x1 - x0) * k / width
        out.append(int(here.max()) if len(here) else None
                   if not len(before) or (start >= end if axis == "fraction" else start > end)
                   else int(live[before[-1]]))
    return out


@pytest.mark.parametrize("axis,x0,x1,width", [
    ("fraction", None, None, 500), ("fraction", 0.5, 0.52, 800), ("time", None, None, 700),
    ("time", 1.0, 1.01, 300)])
def test_two_runs_overlaid_on_one_axis_are_their_own_timelines(axis, x0, x1, width):
    a, b = report(BUGGY), report(FIXED)
    c, h = client(queries.Sources([a, b]))
    q = f"axis={axis}&width={width}" + (f"&x0={x0}&x1={x1}" if x0 is not None else "")
    got = c.get(f"/api/compare?{q}", headers=h).json()
    o = got["overlay"]
    ends = [float(r.timeline.time_s.iloc[-1]) for r in (a, b)]
    lo, hi = (x0, x1) if x0 is not None else (0.0, 1.0 if axis == "fraction" else max(ends))
    assert o["x0"] == lo and abs(o["x1"] - hi) < 1e-9
    ea, eb = _expected(a, axis, lo, o["x1"], width), _expected(b, axis, lo, o["x1"], width)
    assert o["live_a"] == ea and o["live_b"] == eb
    assert o["diff"] == [None if u is None or v is None else v - u for u, v in zip(ea, eb)]
    if x0 is None:  # the whole runs: each line keeps its run's peak
        assert max(v for v in o["live_a"] if v is not None) == a.peaks["overall_bytes"]
        assert max(v for v in o["live_b"] if v is not None) == b.peaks["overall_bytes"]
        if axis == "time":  # the shorter run ends before the axis does
            assert o["live_a"][-1] is None and o["live_b"][-1] is not None
    else:  # zoomed past one row per column: the empty columns carry the last row's bytes
        assert None not in o["live_a"] and len(set(o["live_a"])) < width
    assert o["a"]["peak_bytes"] == a.peaks["overall_bytes"] and o["axes"] == ["fraction", "time"]
    # B against A as `compare` says it
    assert got["comparison"] == json.loads(json.dumps(sf.compare(a, b).to_dict(), default=str))
    assert c.get("/api/compare?axis=rows", headers=h).status_code == 400
    assert c.get("/api/compare?x0=0.5&x1=0.5", headers=h).status_code == 400
    # and the main view opens either run
    ov = c.get("/api/overview?snapshot=1", headers=h).json()
    assert ov["mode"] == "compare" and ov["peaks"] == b.peaks
    assert c.get("/api/overview?snapshot=2", headers=h).status_code == 404


def test_a_fleet_folder_is_a_strip_of_every_ranks_peak(tmp_path):
    import shutil

    for r, f in enumerate(FLEET):
        shutil.copy(f, tmp_path / f"rank{r}.pickle.gz")
    (tmp_path / "rank3.pickle").write_bytes(b"not a pickle")
    srcs, strip = queries.open_inputs([str(tmp_path)])
    c, h = client(srcs, strip)
    got = c.get("/api/fleet", headers=h).json()
    assert [r["snapshot"] for r in got["ranks"]] == [0, 1, 2]
    peaks = [report(f).peaks["overall_bytes"] for f in FLEET]
    assert [r["peak_bytes"] for r in got["ranks"]] == peaks
    assert got["worst"] == 0  # the buggy rank: an anomaly, the top peak
    # the unreadable rank is listed, and opening it is one line, not a crash
    assert [e["snapshot"] for e in got["errors"]] == [3]
    bad = c.get("/api/overview?snapshot=3", headers=h)
    assert bad.status_code == 400 and "\n" not in bad.json()["error"]
    for i, p in enumerate(peaks):  # each opens its own timeline
        assert c.get(f"/api/overview?snapshot={i}", headers=h).json()["peaks"]["overall_bytes"] \
            == p
        w = c.get(f"/api/window?snapshot={i}&width=300", headers=h).json()
        assert max(w["live"]) == p
    assert c.get("/api/overview", headers=h).json()["mode"] == "fleet"
    assert client(report())[0].get("/api/fleet", headers=h).status_code == 403
    c1, h1 = client(report())
    assert c1.get("/api/fleet", headers=h1).status_code == 404


def test_explore_a_b_serves_the_overlay_and_three_files_are_one_line():
    p = subprocess.Popen([sys.executable, "-m", "snapforensics", "explore", str(BUGGY),
                          str(FIXED), "--no-browser"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=os.environ | {"SNAPFORENSICS_CACHE": "off"})
    try:
        base, token = p.stdout.readline().split()[2].split("/?token=")
        got = _get(f"{base}/api/compare?token={token}&width=50")
        assert got["overlay"]["a"]["peak_bytes"] == report(BUGGY).peaks["overall_bytes"]
        assert got["overlay"]["b"]["peak_bytes"] == report(FIXED).peaks["overall_bytes"]
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(20)
    r = subprocess.run([sys.executable, "-m", "snapforensics", "explore", *map(str, FLEET),
                        "--no-browser"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _get(url: str):
    import time
    for _ in range(100):
        try:
            return json.loads(urllib.request.urlopen(url, timeout=5).read())
        except OSError:
            time.sleep(0.1)
    raise AssertionError(url)


def _phase_runs(rep: sf.Report, lo: int, hi: int) -> list[tuple[str, int, int]]:
    """The runs of one phase among rows [lo, hi), from the diagnosis' timeline alone."""
    ph = rep.timeline.phase.astype(str).to_numpy()[lo:hi]
    cut = [0] + [i for i in range(1, len(ph)) if ph[i] != ph[i - 1]] + [len(ph)]
    return [(ph[a], lo + a, lo + b) for a, b in zip(cut[:-1], cut[1:])]


@pytest.mark.parametrize("lo,hi,width", [(0, None, 1000), (2000, 6000, 700), (5000, 5010, 300)])
def test_a_window_shades_the_diagnosis_phases_and_marks_the_peak(lo, hi, width):
    rep = report()
    c, h = client(rep)
    d = rep.analyses[0]
    hi = d.lt.rows if hi is None else hi
    w = c.get(f"/api/window?lo={lo}&hi={hi}&width={width}", headers=h).json()
    assert [(p["phase"], p["lo"], p["hi"]) for p in w["phases"]] == _phase_runs(rep, lo, hi)
    per = (hi - lo) / width
    assert all(abs(p["c0"] - (p["lo"] - lo) / per) < 1e-6 for p in w["phases"])
    assert w["phases"][-1]["c1"] == width
    starts = [it.start for it in d.tl.iterations if lo <= it.start < hi]
    assert [it["row"] for it in w["iterations"]] == starts
    assert (w["peak"]["c"] is not None) == (lo <= d.peak_row < hi)
    assert w["peak"]["bytes"] == rep.peaks["overall_bytes"]
    # every column's live bytes are those of the row it names (a click there asks for it)
    live = rep.timeline.live_bytes.to_numpy()
    assert [int(live[r]) for r in w["moment"]] == w["live"]


def test_a_window_on_the_time_axis_is_the_rows_of_those_seconds():
    rep = report()
    c, h = client(rep)
    t = rep.timeline.time_s.cummax().to_numpy()
    x0, x1 = float(t[3000]), float(t[9000])
    w = c.get(f"/api/window?axis=time&x0={x0}&x1={x1}&width=500", headers=h).json()
    assert (w["x0"], w["x1"], w["axis"]) == (x0, x1, "time")
    assert w["lo"] == int(np.searchsorted(t, x0, "right")) - 1 and w["hi"] == \
        int(np.searchsorted(t, x1, "left"))
    assert [(p["phase"], p["lo"], p["hi"]) for p in w["phases"]] == \
        _phase_runs(rep, w["lo"], w["hi"])
    # a phase's columns are its seconds
    for p in w["phases"][1:]:
        assert abs(p["c0"] - (t[p["lo"]] - x0) / (x1 - x0) * 500) < 1e-6
    live = rep.timeline.live_bytes.to_numpy()
    assert max(w["live"]) == int(live[w["lo"]:w["hi"]].max())
    ov = c.get("/api/overview", headers=h).json()
    assert ov["devices"][0]["axes"] == ["row", "time"] and ov["phase_colors"]["forward"]
    assert c.get("/api/window?axis=seconds", headers=h).status_code == 400


def test_the_unit_filter_keeps_the_unit_and_the_modules_inside_it():
    rep = report()
    d = rep.analyses[0]
    c, h = client(rep)
    units = c.get("/api/overview", headers=h).json()["devices"][0]["units"]
    assert "layers.1" in units, units
    m = queries.keep_mask(rep, d.device, unit="layers.1")
    want = np.array([(d.module_of(i) or "") in ("layers.1",) or
                     (d.module_of(i) or "").startswith("layers.1.") for i in range(len(d.lt))])
    assert m.any() and (m == want).all()


NIU = "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"  # a CUDA run whose trace logs every segment


def test_the_allocator_at_a_moment_has_the_segments_blocks_and_free_gaps():
    from corpus import corpus_file

    path = corpus_file(NIU)
    rep = sf.diagnose(path)
    c, h = client(rep)
    d = rep.analyses[0]
    # at the last row (the dump's moment): the file's own segments, each free gap the
    # segment's total minus the blocks the file says are allocated in it
    raw = sorted((s for s in sf.load(path).segments if s.device == d.device),
                 key=lambda s: s.address)
    got = c.get(f"/api/segments?row={d.lt.rows - 1}", headers=h).json()
    assert [(s["address"], s["total_size"]) for s in got["segments"]] == \
        [(s.address, s.total_size) for s in raw]
    for g, s in zip(got["segments"], raw):
        active = sum(b.size for b in s.blocks if b.state != "inactive")
        assert g["gap_bytes"] == s.total_size - active, hex(s.address)
        assert sum(x["size"] for x in g["gaps"]) == g["gap_bytes"]
    assert sum(g["gap_bytes"] for g in got["segments"]) > 0
    # at the peak: what was reserved then (the timeline's reserved bytes), each segment's
    # blocks the blocks alive then at its addresses, the rest of it reserved but unused
    at = c.get(f"/api/segments?row={d.peak_row}", headers=h).json()
    tl = rep.timeline
    assert at["reserved_bytes"] == int(tl.reserved_bytes[d.peak_row]) and at["unplaced"] == 0
    assert at["allocated_bytes"] == int(tl.live_bytes[d.peak_row])
    b = rep.blocks
    alive = b[(b.alloc_row <= d.peak_row) & ((b.free_row > d.peak_row) | (b.free_row < 0))]
    for s in at["segments"]:
        inside = alive[(alive.address >= s["address"]) &
                       (alive.address < s["address"] + s["total_size"])]
        assert sorted(x["id"] for x in s["blocks"]) == sorted(inside.index.tolist())
        assert s["allocated_size"] == int(inside["size"].sum())
        assert s["reserved_unused"] == s["total_size"] - s["allocated_size"] == \
            s["gap_bytes"] + s["tail_bytes"]
    assert at["reserved_unused"] == at["reserved_bytes"] - at["allocated_bytes"] > 0
    # a CPU recording says so
    cpu = client(report())
    s = cpu[0].get("/api/segments?row=10", headers=cpu[1]).json()
    assert s["segments"] == [] and "no caching allocator" in s["statement"]


def test_a_path_is_diagnosed_with_its_lifetimes_from_the_cache(tmp_path, monkeypatch):
    from snapforensics import doccache
    from snapforensics.analysis import lifetimes

    monkeypatch.setenv("SNAPFORENSICS_CACHE_DIR", str(tmp_path))
    want = report()
    first = queries.Sources([BUGGY])[0]
    entry = next(tmp_path.glob("*.report-v*.npz"))
    # the second run pairs nothing: the entry's lifetimes, the same report
    monkeypatch.setattr(lifetimes, "compute", lambda *a: pytest.fail("paired again"))
    again = queries.Sources([BUGGY])[0]
    for got in (first, again):
        assert got.to_dict() == want.to_dict() and got.blocks.equals(want.blocks)
    # an entry that is not this trace's is deleted, and the lifetimes paired again
    monkeypatch.undo()
    monkeypatch.setenv("SNAPFORENSICS_CACHE_DIR", str(tmp_path))
    import numpy as np
    a = dict(np.load(entry))
    a["d0_free_row"] = a["d0_free_row"] + len(want.timeline)
    with open(entry, "wb") as f:
        np.savez(f, **a)
    assert doccache.report(BUGGY).to_dict() == want.to_dict()
    assert entry.exists() and dict(np.load(entry))["d0_free_row"].max() <= len(want.timeline)


def _answers(rep: sf.Report) -> dict:
    """Every query's answer the page and the MCP tools ask of one snapshot."""
    out: dict = {"overview": queries.overview(rep), "blocks": rep.blocks.to_dict("list")}
    for d in rep.analyses:
        n = d.lt.rows
        for lo, hi, width in ((0, n, 800), (max(d.peak_row - 300, 0), d.peak_row + 300, 97),
                              (n // 3, n // 3 + 5, 13)):
            out[f"window {d.device} {lo} {hi}"] = queries.window(rep, d.device, lo, hi, width)
        for cat in d.category_names[:3]:
            keep = queries.keep_mask(rep, d.device, category=cat, min_size=1)
            out[f"filter {d.device} {cat}"] = queries.window(rep, d.device, 0, n, 200, keep)
        out[f"segments {d.device}"] = queries.segments(rep, d.device, d.peak_row)
    out["block"] = [queries.block(rep, i) for i in range(0, len(rep.blocks), 97)]
    out["findings"] = [queries.finding(rep, i, 200) for i in range(len(rep.diagnosis.findings))]
    return out


@pytest.mark.parametrize("path", [BUGGY, FLEET[2]], ids=["fsdp2", "fsdp1"])
def test_a_warm_load_answers_exactly_as_a_cold_one(path, tmp_path, monkeypatch):
    """The report entry's analysis columns (each block's key index, each row's phase and
    iteration) replace the pairing of the keys and the phases' assignment: the warm load
    runs neither and every answer is the cold one's."""
    from snapforensics import doccache
    from snapforensics.analysis import context, phases

    want = report(path).to_dict()  # no cache
    monkeypatch.setenv("SNAPFORENSICS_CACHE_DIR", str(tmp_path))
    cold = doccache.report(path)
    assert len(list(tmp_path.glob("*.report-v*.npz"))) == 1
    monkeypatch.setattr(phases, "assign", lambda *a: pytest.fail("phases assigned again"))
    monkeypatch.setattr(context, "_distinct", lambda *a: pytest.fail("keys paired again"))
    warm = doccache.report(path)
    for a, b in zip(cold.analyses, warm.analyses):
        for col in ("info", "category", "path", "phase", "iteration", "keys"):
            assert np.array_equal(getattr(a, col), getattr(b, col)), col
        assert np.array_equal(a.tl.phase, b.tl.phase) and a.tl.iterations == b.tl.iterations
        assert a.block_module == b.block_module
    assert json.dumps(_answers(warm), default=str) == json.dumps(_answers(cold), default=str)
    assert warm.to_dict() == cold.to_dict() == want
