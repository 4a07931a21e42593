"""What the fleet and compare reports share: a small self-contained HTML page (tables, one inline
stylesheet, no script, no URL fetched) and Markdown tables. Every cell passes its sink's
function of report/sanitize.py (file names and rule titles quote snapshots)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from snapforensics.report.sanitize import TEXT
from snapforensics.report.sanitize import html as h
from snapforensics.report.sanitize import markdown as md

CSS = ("body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}"
       "table{border-collapse:collapse;margin:8px 0 20px}td,th{padding:3px 10px;"
       "border-bottom:1px solid #ddd;text-align:left;vertical-align:top}th{background:#f4f4f4}"
       "tr.anomalous td{color:#b00020}tr.specific td{font-weight:600}"
       "pre{background:#f6f8fa;padding:8px;overflow:auto}.warn{color:#8a6d00}"
       ".fail{color:#b00020;font-weight:600}footer{color:#666;font-size:12px;margin-top:24px}")


def table(head: Sequence[str], rows: Sequence[Sequence[Any]],
          classes: Sequence[str] | None = None) -> str:
    cls = classes or [""] * len(rows)
    return ("<table><tr>" + "".join(f"<th>{h(x)}</th>" for x in head) + "</tr>"
            + "".join(f"<tr class='{h(c)}'>" + "".join(f"<td>{h(x, TEXT)}</td>" for x in r)
                      + "</tr>" for r, c in zip(rows, cls)) + "</table>")


def page(title: str, headline: str, body: Sequence[str], footer: str = "") -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{h(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{h(title)}</h1>"
            f"<p><b>{h(headline, TEXT)}</b></p>" + "".join(body)
            + f"<footer>{h(footer)}</footer></body></html>\n")


def lines(items: Sequence[str], cls: str = "warn") -> list[str]:
    return [f"<p class='{cls}'>{h(x, TEXT)}</p>" for x in items]


def md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(md(x, TEXT) for x in r) + " |" for r in rows] + [""]
