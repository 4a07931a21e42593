"""The explorer in a real browser: headless Chromium (the Debian package, driven by playwright,
as tests/test_browser.py) on the server of a committed recording. Skipped without Chromium."""

from __future__ import annotations

import socket
import threading

import pytest
from test_browser import BUGGY, CHROMIUM, FLAGS

import snapforensics as sf

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")


@pytest.fixture(scope="module")
def served():
    uvicorn = pytest.importorskip("uvicorn")
    from snapforensics.explore.server import app

    rep = sf.diagnose(BUGGY)
    web = app(rep)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(web, log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield rep, base, web.state.token
    server.should_exit = True
    t.join(10)


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
