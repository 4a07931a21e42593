"""Reports: every document (diagnosis, compare, ...) in every format, as text.

`registry.RENDERERS` says which renderer makes which (document, format); `output.emit` is the
one way a report is written (-o FILE, -o -, stdout); `sanitize` neutralizes snapshot strings for
each sink.
"""

from __future__ import annotations

from typing import Any

from snapforensics.report.registry import FORMATS, PLAIN, Screen, render

__all__ = ["FORMATS", "Screen", "render", "render_text"]


def render_text(d: Any, fmt: str, screen: Screen = PLAIN) -> str:
    """A diagnosis as text in `fmt` (the Python API's shortcut for render("diagnosis", ...))."""
    return render("diagnosis", d, fmt, screen)
