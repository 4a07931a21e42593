"""The HTML report in a real browser: headless Chromium (the Debian package, driven by
playwright) opens the file from disk with no console error and no network request, the plot's
hover shows what is alive there, and the screenshot is not blank.

Skipped when /usr/bin/chromium or playwright is missing (`make setup` installs Chromium when it
can). Set SNAPFORENSICS_SCREENSHOTS=DIR to keep the screenshot (docs/report-html.png is made so).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")


@pytest.fixture(scope="module")
def page():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        pg = browser.new_page(viewport={"width": 1280, "height": 1000})
        yield pg
        browser.close()


def _report(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "report.html"
    r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(BUGGY),
                        "--format", "html", "-o", str(out), *args],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def test_report_opens_offline_and_hover_shows_what_is_alive(page, tmp_path):
    out = _report(tmp_path, "--category", "norm=rms_norm")
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(out.as_uri())
    page.wait_for_load_state("load")
    assert requests == [out.as_uri()]  # the file itself, nothing else
    # the top finding's fix is on the first screen
    fix = page.locator(".topfix pre").first
    assert fix.is_visible() and "reshard" in fix.inner_text()
    assert fix.bounding_box()["y"] + 20 < 1000

    tip = page.locator(".sf-tip").first
    assert not tip.is_visible()
    hit = page.locator(".sf-hit").first
    hit.scroll_into_view_if_needed()
    box = hit.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.62, box["y"] + box["height"] / 2)
    assert tip.is_visible()
    text = tip.inner_text()
    assert "live" in text and "MiB" in text
    assert "optimizer_state" in text  # alive from the first step on: in every later point
    assert "allocated by:" in text  # its top stacks
    # the box stays small and beside the cursor on the side already read (it covered half the
    # plot, to the right of the cursor, over the curve ahead)
    tb, pb = tip.bounding_box(), page.locator(".sf-plot svg").first.bounding_box()
    assert tb["width"] * tb["height"] < 0.4 * pb["width"] * pb["height"], (tb, pb)
    assert tb["x"] + tb["width"] <= box["x"] + box["width"] * 0.62, (tb, box)

    shot = page.screenshot(full_page=False)  # the plot with its tooltip
    keep = os.environ.get("SNAPFORENSICS_SCREENSHOTS")
    if keep:
        Path(keep, "report-html.png").write_bytes(shot)
    _assert_not_blank(shot)
    page.mouse.move(box["x"] - 40, box["y"] - 40)
    assert not tip.is_visible()
    assert errors == []


def _assert_not_blank(png: bytes) -> None:
    """Decoded with matplotlib's PNG reader: many distinct colors, not one background."""
    import io

    import numpy as np
    from matplotlib.image import imread

    img = imread(io.BytesIO(png), format="png")
    pixels = (img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colors = np.unique(pixels, axis=0)
    assert len(colors) > 50
    background = (pixels == pixels[0]).all(axis=1).mean()
    assert background < 0.9
