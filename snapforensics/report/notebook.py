"""Reports as notebook cells (`_repr_html_` of the API's Report, Comparison and Forecast): the
HTML report's own sections, readable whatever the notebook's stylesheet and theme.

A notebook styles every `pre`, `code`, `table` and row of an output (JupyterLab's
`.jp-RenderedHTMLCommon` rules: row stripes, right-aligned cells, its theme's text colour on
`pre` and `code`). So the cell's element sets its own text and background colours, every rule is
scoped under three classes of that element (more specific than any of those rules, so the
report's look wins and nothing leaks out), and the elements the notebook styles get a colour and
a background together: a dark theme's light text never lands on the report's light background,
nor the fix's light text on a light line background.

Anchors (the findings' links) are prefixed per cell, so two reports in one notebook do not
link into each other. Strings from snapshots were escaped by the HTML renderers; this module
only moves their output.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

SCOPE = ".sf-report.sf-nb.sf-iso"
ROOT = "sf-report sf-nb sf-iso"
# Applied before the report's own CSS (same specificity: the report's rules then win where
# they set something; these give everything else a colour and a background).
ISOLATE = """
.sf-report{color:#1d2430;background:#f5f7fa;text-align:left;padding:8px 12px;border-radius:8px;
font:14px/1.5 -apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
h1,h2,h3,h4,p,li,ul,details,summary,strong,b,div,span,footer{color:inherit;background:transparent}
a{color:#1565c0;background:transparent}
table{color:inherit;background:transparent;table-layout:auto;margin-left:0}
tr,thead tr,tbody tr,tbody tr:nth-child(odd),tbody tr:nth-child(even),tbody tr:hover{
background:transparent}
td,th{color:inherit;background:transparent;text-align:left;white-space:normal;padding:3px 10px}
pre{color:#1d2430;background:#f6f8fa;padding:8px 10px;white-space:pre;margin:6px 0}
pre code,pre.fix code{color:inherit;background:transparent;padding:0}
:not(pre)>code{color:#1d2430;background:#eef1f5;padding:1px 4px}
"""
_CELLS = itertools.count(1)


def diagnosis(d: Any) -> str:
    """One diagnosis as a cell: the whole report (header and fix, devices with their plot,
    findings), without the embedded JSON."""
    from snapforensics.report import html, plot

    has_plot = any(dev.plot is not None for dev in d.devices)
    return _cell(html.CSS + plot.CSS, "".join(html.body(d)), plot.JS if has_plot else "")


def document(kind: str, doc: Any) -> str:
    """Any other document (compare, forecast, fleet) as a cell: its HTML report's body."""
    from snapforensics.report.registry import render

    page = render(kind, doc, "html")
    css = re.search(r"<style>(.*?)</style>", page, re.S)
    body = page.split("<body", 1)[1].split(">", 1)[1].rsplit("</body>", 1)[0]
    return _cell(css[1] if css else "", body)


def _cell(css: str, body: str, script: str = "") -> str:
    from snapforensics.report.html import scoped

    n = next(_CELLS)
    body = re.sub(r'(id="|href="#)(finding|device|findings|tensor-names)', rf"\1sf{n}-\2", body)
    body = body.replace("<main>", "<div>").replace("</main>", "</div>")
    js = f"<script>{script}</script>" if script else ""
    return (f'<div class="{ROOT}"><style>{scoped(ISOLATE + css, SCOPE)}</style>{body}{js}'
            "</div>")
