"""What fleet and compare reports share: a small self-contained HTML page (escaped text and
tables, one inline stylesheet, no script, no URL fetched) and Markdown tables with neutralized
cells."""

from __future__ import annotations

import html as _html
from collections.abc import Sequence
from typing import Any

CSS = ("body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}"
       "table{border-collapse:collapse;margin:8px 0 20px}td,th{padding:3px 10px;"
       "border-bottom:1px solid #ddd;text-align:left;vertical-align:top}th{background:#f4f4f4}"
       "tr.anomalous td{color:#b00020}tr.specific td{font-weight:600}tr.fail td{color:#b00020}"
       "pre{background:#f6f8fa;padding:8px;overflow:auto}.warn{color:#8a6d00}"
       "footer{color:#777;font-size:12px;margin-top:24px}")


def h(s: Any) -> str:
    """Every string that reaches the page passes here (file names come from strangers)."""
    return _html.escape(str(s), quote=True)


def table(head: Sequence[str], rows: Sequence[Sequence[Any]],
          classes: Sequence[str] | None = None) -> str:
    cls = classes or [""] * len(rows)
    return ("<table><tr>" + "".join(f"<th>{h(x)}</th>" for x in head) + "</tr>"
            + "".join(f"<tr class='{h(c)}'>" + "".join(f"<td>{h(x)}</td>" for x in r) + "</tr>"
                      for r, c in zip(rows, cls)) + "</table>")


def page(title: str, headline: str, body: Sequence[str], footer: str = "") -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{h(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{h(title)}</h1><p><b>{h(headline)}</b></p>"
            + "".join(body) + f"<footer>{h(footer)}</footer></body></html>\n")


def lines(items: Sequence[str], cls: str = "warn") -> list[str]:
    return [f"<p class='{cls}'>{h(x)}</p>" for x in items]


def md(s: Any) -> str:
    """A Markdown table cell: no line breaks, no column separators, no markup from file names."""
    return str(s).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ") \
        .replace("<", "&lt;").replace("`", "\\`").replace("*", "\\*").replace("_", "\\_")


def md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(map(md, r)) + " |" for r in rows] + [""]
