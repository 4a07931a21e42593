"""The API's objects in a notebook: Report, Comparison and Forecast each show as their HTML
report, readable whatever the notebook's stylesheet and theme, with times in seconds.

The host page below carries JupyterLab's own rules for rendered HTML outputs (JupyterLab 4,
packages/rendermime/style/base.css, `.jp-RenderedHTMLCommon` pre/code/tables; as bundled in
nbconvert 7.17's lab template static/index.css lines 4103-4175) with the values of its light
and dark themes (theme-light.css / theme-dark.css: --jp-layout-color0, --jp-content-font-color1,
--jp-layout-color2, --jp-ui-font-color1, --jp-rendermime-table-row-background). Chromium lays the
cell out under them; every piece of text must keep a WCAG contrast of 4.5 against what is
really behind it. Before this, the dark theme put the page's white text on the report's light
cards and the "command" line was white on light grey (contrast ~1.1).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
FIXED = REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"
CHROMIUM = Path("/usr/bin/chromium")

THEMES = {
    "light": {"layout0": "white", "content1": "rgba(0, 0, 0, 0.87)", "layout2": "#eeeeee",
              "ui1": "rgba(0, 0, 0, 0.87)", "row": "#f5f5f5", "link": "#0d47a1"},
    "dark": {"layout0": "#111", "content1": "rgba(255, 255, 255, 1)", "layout2": "#424242",
             "ui1": "rgba(255, 255, 255, 0.87)", "row": "#212121", "link": "#64b5f6"},
}
JUPYTER = """
body{{background:{layout0};color:{content1};font-family:sans-serif}}
.jp-RenderedHTMLCommon{{color:{content1}}}
.jp-RenderedHTMLCommon a{{color:{link}}}
.jp-RenderedHTMLCommon pre,.jp-RenderedHTMLCommon code{{border:0;background-color:{layout0};
color:{content1};padding:0;white-space:pre-wrap}}
.jp-RenderedHTMLCommon :not(pre) > code{{background-color:{layout2};padding:1px 5px}}
.jp-RenderedHTMLCommon table{{border-collapse:collapse;color:{ui1};table-layout:fixed;
margin-left:auto;margin-right:auto}}
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td,
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon th,
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon tr{{text-align:right}}
.jp-RenderedHTMLCommon tbody tr:nth-child(odd){{background:{layout0}}}
.jp-RenderedHTMLCommon tbody tr:nth-child(even){{background:{row}}}
"""

# For every element with its own text: its colour and the first opaque background behind it
# (composited over the page), as WCAG relative luminances -> contrast ratio.
CONTRASTS = """
(root) => {
  function rgba(s) {
    const m = s.match(/[\\d.]+/g).map(Number);
    return m.length > 3 ? m : [...m, 1];
  }
  function lum([r, g, b]) {
    const f = c => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  }
  function behind(el) {
    for (let e = el; e; e = e.parentElement) {
      const c = rgba(getComputedStyle(e).backgroundColor);
      if (c[3] > 0.5) return c;
    }
    return rgba(getComputedStyle(document.body).backgroundColor);
  }
  const out = [];
  for (const el of root.querySelectorAll("*")) {
    if (el.closest("svg") || el.closest("script") || el.closest("style")) continue;
    const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
    if (!own || !el.getClientRects().length) continue;
    const st = getComputedStyle(el);
    if (st.visibility === "hidden" || st.display === "none") continue;
    const fg = rgba(st.color), bg = behind(el);
    const mix = fg.slice(0, 3).map((c, i) => c * fg[3] + bg[i] * (1 - fg[3]));
    const [a, b] = [lum(mix), lum(bg)].sort((x, y) => y - x);
    out.push([(a + 0.05) / (b + 0.05), el.tagName, el.textContent.trim().slice(0, 40)]);
  }
  return out;
}
"""


@cache
def cells() -> dict[str, str]:
    import snapforensics as sf

    return {"report": sf.diagnose(BUGGY)._repr_html_(),
            "comparison": sf.compare(str(BUGGY), str(FIXED))._repr_html_(),
            "forecast": sf.forecast(FIXED, world_sizes=[4, 64], capacity="200MiB")._repr_html_()}


@pytest.fixture(scope="module")
def page():
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--headless",
                                                                         "--no-sandbox"])
        yield browser.new_page(viewport={"width": 1200, "height": 900})
        browser.close()


@pytest.mark.parametrize("theme", sorted(THEMES))
@pytest.mark.parametrize("kind", ["report", "comparison", "forecast"])
def test_cell_is_readable_under_the_notebook_css(page, tmp_path, kind, theme):
    html = (f"<!doctype html><html><head><style>{JUPYTER.format(**THEMES[theme])}</style>"
            "</head><body><div class='jp-RenderedHTMLCommon'>"
            "<table id='outside'><tbody><tr><td>a</td></tr></tbody></table>"
            f"<div id='cell'>{cells()[kind]}</div></div></body></html>")
    f = tmp_path / "nb.html"
    f.write_text(html)
    page.goto(f.as_uri())
    found = page.locator("#cell").evaluate(CONTRASTS)
    assert len(found) > 20
    low = [x for x in found if x[0] < 4.5]
    assert not low, (kind, theme, low[:8])
    # nothing leaks out: the notebook's own table keeps its styles
    assert page.locator("#outside td").evaluate("e => getComputedStyle(e).textAlign") == "right"


def test_findings_links_stay_inside_their_cell():
    """The summary's links pointed to sections the notebook display did not contain; now the
    cell holds the whole report and its anchors are its own (two reports never collide)."""
    import re

    import snapforensics as sf

    d = sf.diagnose(BUGGY)
    a, b = d._repr_html_(), d._repr_html_()
    for html in (a, b):
        links = re.findall(r'href="#([^"]+)"', html)
        ids = set(re.findall(r'id="([^"]+)"', html))
        assert links and set(links) <= ids, (links, ids)
        assert "set_reshard_after_backward(True)" in html  # the fix, in every finding
    assert not set(re.findall(r'id="([^"]+)"', a)) & set(re.findall(r'id="([^"]+)"', b))


def test_reprs_are_one_line_and_times_are_seconds():
    import numpy as np

    import snapforensics as sf

    c = sf.compare(str(BUGGY), str(FIXED))
    assert "\n" not in repr(c) and len(repr(c)) < 300 and "256.8 MiB -> 194.8 MiB" in repr(c)
    assert c.to_dict()["schema"] == "snapforensics.compare/1"
    f = sf.forecast(FIXED, world_sizes=[4])
    assert "\n" not in repr(f) and len(f.to_frame()) == len(f.scenarios)
    d = sf.diagnose(BUGGY)
    t = d.timeline
    assert t["time_s"].iloc[0] == 0 and np.isfinite(t["time_s"]).all()
    assert np.allclose(t["time_s"], (t["time_us"] - t["time_us"].iloc[0]) / 1e6)
    # the plot's axis and the column agree: the peak's point is at the peak row's seconds
    s = d.diagnosis.devices[0].plot
    assert t["time_s"].iloc[int(s.rows[s.peak])] == pytest.approx(s.x[s.peak], abs=1e-3)
