"""The explorer in a real browser: headless Chromium (the Debian package, driven by playwright,
as tests/test_browser.py) on the server of a committed recording. Skipped without Chromium."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import urllib.request
from contextlib import contextmanager

import pytest
from test_browser import BUGGY, CHROMIUM, FLAGS, REPO

import snapforensics as sf

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")


@contextmanager
def _serve(sources, fleet=None):
    """The explorer's app on a free port of 127.0.0.1: (base URL, token)."""
    uvicorn = pytest.importorskip("uvicorn")
    from snapforensics.explore.server import app

    web = app(sources, fleet)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(web, log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started and t.is_alive():  # listening before the page asks
        t.join(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", web.state.token
    finally:
        server.should_exit = True
        t.join(10)


@pytest.fixture(scope="module")
def served():
    rep = sf.diagnose(BUGGY)
    with _serve(rep) as (base, token):
        yield rep, base, token


def _api(base: str, token: str, path: str):
    sep = "&" if "?" in path else "?"
    return json.loads(urllib.request.urlopen(f"{base}{path}{sep}token={token}", timeout=30).read())


@pytest.fixture(scope="module")
def page():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        # the probes below evaluate script, which the page's CSP (no eval) would refuse
        pg = browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)
        yield pg
        browser.close()


def _click_block(page, block_id: int) -> None:
    """Click the middle of the block's rectangle on the canvas (where the page drew it)."""
    x, y = page.evaluate("""(id) => { const cv = document.getElementById('plot');
        const [b, y0] = rects.find(([b]) => b.id === id); const n = win.width;
        const W = cv.clientWidth, H = cv.clientHeight, ymax = +cv.dataset.ymax;
        return [(b.c0 + b.c1) / 2 * W / n, H - ((y0 + b.size / 2) / ymax) * (H - 10)]; }""",
                         block_id)
    page.locator("#plot").click(position={"x": x, "y": y})


def test_page_loads_offline_and_a_click_shows_the_block(served, page):
    rep, base, token = served
    requests: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{base}/?token={token}")
    page.wait_for_function("typeof win !== 'undefined' && win !== null && rects.length > 0")
    page.wait_for_load_state("networkidle")  # the bar's text is in: the canvas stays put
    assert requests and all(u.startswith(base + "/") for u in requests), requests
    b = rep.blocks
    big = int(b[b.category == "fsdp.unsharded_param"].sort_values("size", kind="stable")
              .index[-1])
    _click_block(page, big)
    page.wait_for_selector("#stack", state="attached")
    panel = page.locator("#block")
    assert page.locator("[data-field=id]").inner_text() == f"id: {big}"
    assert f"({int(b['size'][big])} B)" in page.locator("[data-field=size]").inner_text()
    assert page.locator("[data-field='FSDP unit']").inner_text() == \
        f"FSDP unit: {b['fsdp_unit'][big]}"
    # the fixture has no recorder names and ran eager: both rows say so
    assert page.locator("[data-field=tensor]").inner_text() == "tensor: —"
    assert page.locator("[data-field=compiled]").inner_text() == "compiled: —"
    assert page.locator("[data-field='compiled buffer']").inner_text() == "compiled buffer: —"
    from snapforensics.analysis.stacks import is_native

    python = [f for f in rep.stack(int(b.stack_id[big])) if not is_native(f)]
    assert python, "the block has Python frames (else the panel proves nothing)"
    assert panel.locator("#stack").text_content().splitlines() == \
        [f"{f.name}  {f.filename}:{f.line}" for f in python]
    assert not errors, errors


def test_choosing_the_anomalous_finding_highlights_exactly_its_blocks(served, page):
    rep, base, token = served
    page.goto(f"{base}/?token={token}")
    page.wait_for_function("typeof win !== 'undefined' && win !== null && rects.length > 0")
    page.wait_for_load_state("networkidle")  # the bar's text is in: the canvas stays put
    i, f = next((i, f) for i, f in enumerate(rep.diagnosis.findings) if f.verdict == "anomalous")
    page.locator(f".finding[data-index='{i}']").click()
    page.wait_for_function("highlighted.size > 0 && afterFix !== null")
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(300)  # the filtered window drawn
    got = set(page.evaluate("[...highlighted]"))
    d = rep.analyses[0]
    assert got == {int(x) for x in f.members} and len(got) == f.blocks
    assert d.device == f.device
    # the filtered view draws only its blocks; the rest is the grey band
    drawn = set(page.evaluate("win.blocks.map((b) => b.id)"))
    assert drawn and drawn <= got
    assert "filtered out" in page.evaluate("Object.keys(win.bands)")


FIXED = REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"


def _colour_pixels(page, canvas: str, rgb: str) -> int:
    """How many pixels of the canvas are (about) the colour #rrggbb."""
    return page.evaluate("""([id, hex]) => { const cv = document.getElementById(id);
        const d = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
        const c = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16)); let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 200 && Math.abs(d[i] - c[0]) < 40
            && Math.abs(d[i + 1] - c[1]) < 40 && Math.abs(d[i + 2] - c[2]) < 40) n++;
        return n; }""", [canvas, rgb])


def test_two_runs_show_both_lines_and_their_difference(page):
    from snapforensics.explore.queries import Sources

    a, b = sf.diagnose(BUGGY), sf.diagnose(FIXED)
    with _serve(Sources([a, b])) as (base, token):
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(f"{base}/?token={token}")
        page.wait_for_function("cmp !== null && win !== null")
        page.wait_for_load_state("networkidle")
        width = page.evaluate("cmp.overlay.width")
        want = _api(base, token, f"/api/compare?width={width}")["overlay"]
        assert page.evaluate("cmp.overlay") == want
        # both lines drawn, in their colours, and each legend names its run and peak
        series = page.evaluate("SERIES")
        assert _colour_pixels(page, "overlay", series["a"]) > 50
        assert _colour_pixels(page, "overlay", series["b"]) > 50
        for k, rep in (("a", a), ("b", b)):
            text = page.locator(f"#legend [data-series={k}]").inner_text()
            assert text.startswith(f"{k.upper()}: {rep.diagnosis.source}")
            assert page.evaluate("(n) => human(n)", rep.peaks["overall_bytes"]) in text
        # the difference at the moment under the mouse: B - A of the API's columns
        box = page.locator("#overlay").bounding_box()
        i = max(range(width), key=lambda k: abs(want["diff"][k] or 0))
        page.mouse.move(box["x"] + (i + 0.5) * box["width"] / width, box["y"] + 20)
        hover = page.locator("#cmphover").inner_text()
        assert page.evaluate("(n) => human(n)", want["diff"][i]) in hover
        # the time axis: the same on the API's time answer
        page.select_option("#axis", "time")
        page.wait_for_function("cmp.overlay.axis === 'time'")
        assert page.evaluate("cmp.overlay") == \
            _api(base, token, f"/api/compare?axis=time&width={width}")["overlay"]
        assert all(u.startswith(base + "/") for u in requests), requests


def test_a_fleet_strip_click_opens_that_ranks_timeline(page, tmp_path):
    from snapforensics.explore.queries import open_inputs

    ranks = [BUGGY, FIXED, REPO / "fixtures" / "hf_fabric_fsdp1_full_rank0.pickle.gz"]
    for r, f in enumerate(ranks):
        shutil.copy(f, tmp_path / f"rank{r}.pickle.gz")
    with _serve(*open_inputs([str(tmp_path)])) as (base, token):
        page.goto(f"{base}/?token={token}")
        page.wait_for_function("strip !== null && win !== null")
        strip = _api(base, token, "/api/fleet")
        assert page.locator(".rank").count() == len(strip["ranks"]) == 3
        assert page.evaluate("snap") == strip["worst"]
        for r in strip["ranks"]:
            if r["snapshot"] == strip["worst"]:
                continue
            page.locator(f".rank[data-snapshot='{r['snapshot']}']").click()
            page.wait_for_function("(i) => snap === i && win !== null", arg=r["snapshot"])
            page.wait_for_load_state("networkidle")
            peak = _api(base, token, f"/api/overview?snapshot={r['snapshot']}")["devices"][0][
                "peak_bytes"]
            assert page.evaluate("Math.max(...win.live)") == peak == r["peak_bytes"]
            assert page.locator(f".rank[data-snapshot='{r['snapshot']}']").get_attribute(
                "class").split().count("sel") == 1


def _open(page, base: str, token: str) -> None:
    page.goto(f"{base}/?token={token}")
    page.wait_for_function("typeof win !== 'undefined' && win !== null && rects.length > 0")
    page.wait_for_load_state("networkidle")


def _query(page) -> str:
    return page.evaluate("'/api/window?' + query()")


def test_the_timeline_shades_the_diagnosis_phases_and_pans_on_a_drag(served, page):
    rep, base, token = served
    _open(page, base, token)
    w = _api(base, token, _query(page))
    assert page.evaluate("win") == w
    # the shading: the API's phase spans, each at its columns, and those the diagnosis' phases
    shading = page.evaluate("shading")
    W = page.evaluate("document.getElementById('plot').clientWidth")
    assert [(p, a, b) for _, _, p, a, b in shading] == \
        [(p["phase"], p["lo"], p["hi"]) for p in w["phases"]]
    for (x0, x1, *_), p in zip(shading, w["phases"]):
        assert abs(x0 - p["c0"] * W / w["width"]) < 1e-6
        assert abs(x1 - p["c1"] * W / w["width"]) < 1e-6
    ph = rep.timeline.phase.astype(str).to_numpy()
    runs = [(ph[a], a) for a in range(len(ph)) if a == 0 or ph[a] != ph[a - 1]]
    assert [(p, a) for _, _, p, a, _ in shading] == runs
    # drawn in the report's colour at its opacity, above the bars (the top rows of the plot)
    x0, x1, phase = max(shading, key=lambda s: s[1] - s[0])[:3]
    hexa = page.evaluate("ov.phase_colors")[phase]
    alpha = page.evaluate("ov.phase_alpha")
    rgba = page.evaluate("""(x) => Array.from(document.getElementById('plot').getContext('2d')
        .getImageData(x, 3, 1, 1).data)""", int((x0 + x1) / 2))
    want = [int(hexa[i:i + 2], 16) for i in (1, 3, 5)] + [round(255 * alpha)]
    # (a canvas keeps colours premultiplied: a faint one reads back a few units off)
    assert all(abs(a - b) <= 8 for a, b in zip(rgba, want)), (rgba, want)
    # the peak marked where it is, and a drag pans the window by what the mouse moved
    d = rep.analyses[0]
    assert page.evaluate("win.peak") == {"row": d.peak_row, "bytes": d.peak_bytes,
                                         "c": w["peak"]["c"]}
    page.evaluate("setView(3000, 5000)")
    page.wait_for_function("win.lo === 3000 && win.hi === 5000")
    box = page.locator("#plot").bounding_box()
    page.mouse.move(box["x"] + 600, box["y"] + 50)
    page.mouse.down()
    page.mouse.move(box["x"] + 500, box["y"] + 50, steps=5)
    page.mouse.up()
    page.wait_for_function("win.lo !== 3000")
    shift = round(100 / box["width"] * 2000)
    assert abs(page.evaluate("win.lo") - (3000 + shift)) <= 1
    assert page.evaluate("win.hi - win.lo") == 2000
    # the time axis: the same phases, on the seconds of their rows
    page.select_option("#xaxis", "time")
    page.wait_for_function("win.axis === 'time'")
    wt = _api(base, token, _query(page))
    assert [(p, a, b) for _, _, p, a, b in page.evaluate("shading")] == \
        [(p["phase"], p["lo"], p["hi"]) for p in wt["phases"]]
    assert [(p, a) for _, _, p, a, _ in page.evaluate("shading")] == runs


def test_filtered_and_grey_bytes_at_the_peak_are_the_unfiltered_total(served, page):
    rep, base, token = served
    _open(page, base, token)
    d = rep.analyses[0]
    page.evaluate("(r) => setView(r - 200, r + 200)", d.peak_row)
    page.wait_for_function("(r) => win.lo === r - 200", arg=d.peak_row)
    whole = _api(base, token, _query(page))
    c = int(whole["peak"]["c"])
    assert whole["live"][c] == d.peak_bytes
    unit = next(u for u in page.evaluate("ov.devices[0].units") if u.startswith("layers"))
    for sel, value in (("#cat", "fsdp.unsharded_param"), ("#unit", unit), ("#minsize", "4096"),
                       ("#text", "forward")):
        if sel in ("#cat", "#unit"):
            page.select_option(sel, value)
        else:
            page.fill(sel, value)
            page.dispatch_event(sel, "change")
        page.wait_for_function("drawn === '/api/window?' + query()")
        assert page.evaluate("win") == _api(base, token, _query(page))
        t = page.evaluate("(c) => totalsAt(c)", c)
        assert t["grey"] > 0 and t["kept"] + t["grey"] == d.peak_bytes == t["live"], (sel, t)
        # the page's hover says the same
        box = page.locator("#plot").bounding_box()
        page.mouse.move(box["x"] + (c + 0.5) * box["width"] / whole["width"], box["y"] + 2)
        hover = page.locator("#hover").inner_text()
        human = page.evaluate("(n) => human(n)", t["grey"])
        assert f"filtered out {human}" in hover or "(block" in hover


def test_a_cuda_file_shows_the_allocator_at_the_peak_and_at_a_clicked_moment(page):
    from corpus import corpus_file
    from test_explore import NIU

    path = corpus_file(NIU)
    rep = sf.diagnose(path)
    d = rep.analyses[0]
    with _serve(rep) as (base, token):
        _open(page, base, token)
        page.wait_for_function("segs !== null")
        assert page.evaluate("segs.row") == d.peak_row
        b = rep.blocks
        alive = b[(b.alloc_row <= d.peak_row) & ((b.free_row > d.peak_row) | (b.free_row < 0))]
        shown = page.locator(".seg")
        api = _api(base, token, f"/api/segments?row={d.peak_row}")
        assert shown.count() == len(api["segments"]) > 0
        assert int(rep.timeline.reserved_bytes[d.peak_row]) == sum(
            int(shown.nth(i).get_attribute("data-total")) for i in range(shown.count()))
        for i in range(shown.count()):
            e = shown.nth(i)
            a, total = int(e.get_attribute("data-address")), int(e.get_attribute("data-total"))
            live = int(alive[(alive.address >= a) & (alive.address < a + total)]["size"].sum())
            s = api["segments"][i]
            # free gaps + what the allocator's rounding left with the blocks: total - live
            assert int(e.get_attribute("data-gap-bytes")) + s["tail_bytes"] == total - live
        # the dump's moment: each gap the raw segment's total minus its allocated blocks
        page.evaluate("(r) => showSegments(r)", d.lt.rows - 1)
        page.wait_for_function("(r) => segs.row === r", arg=d.lt.rows - 1)
        raw = sorted((s for s in sf.load(path).segments if s.device == d.device),
                     key=lambda s: s.address)
        shown = page.locator(".seg")
        assert shown.count() == len(raw)
        for i, s in enumerate(raw):
            e = shown.nth(i)
            assert int(e.get_attribute("data-address")) == s.address
            assert int(e.get_attribute("data-gap-bytes")) == s.total_size - sum(
                x.size for x in s.blocks if x.state != "inactive")
        # a click on the plot (not on a block) asks for that column's moment
        page.locator("#plot").click(position={"x": 5, "y": 5})
        page.wait_for_function("(r) => segs.row !== r", arg=d.lt.rows - 1)
        k = int(5 / page.locator("#plot").bounding_box()["width"] * page.evaluate("win.width"))
        assert page.evaluate("segs.row") == page.evaluate("win.moment")[k]
    # and a CPU recording says plainly there is none
    with _serve(sf.diagnose(BUGGY)) as (base, token):
        _open(page, base, token)
        page.wait_for_function("segs !== null")
        assert "no caching allocator" in page.locator("#segments").inner_text()
