"""Every report: (document kind, format) -> one renderer that returns text.

A renderer is `render(doc, screen: Screen) -> str`; only terminal renderers read `screen`. The
table below is the one place that says which formats exist for which document. Entries are
`module:function` strings, imported on first use, so `--help` and the JSON path never import
rich's syntax highlighter or the HTML templates.

Adding a report format or a new document (forecast, fleet, ...): add its row to `RENDERERS`
and write the function; `emit()` (report/output.py) and the commands' `--format`/`-o` options
(commands/_options.py) pick it up, including the extension inference of `-o FILE`.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

FORMATS = ("terminal", "markdown", "json", "html")
# `-o FILE` without --format: the format its extension names; no extension: terminal text.
EXTENSIONS = {".md": "markdown", ".markdown": "markdown", ".json": "json", ".html": "html",
              ".htm": "html", ".txt": "terminal"}

RENDERERS: dict[str, dict[str, str]] = {
    "diagnosis": {
        "terminal": "snapforensics.report.terminal:render",
        "markdown": "snapforensics.report.markdown:render",
        "json": "snapforensics.report.json:render",
        "html": "snapforensics.report.html:render",
    },
    "compare": {
        "terminal": "snapforensics.report.compare:terminal",
        "markdown": "snapforensics.report.compare:markdown",
        "json": "snapforensics.report.json:render",
        "html": "snapforensics.report.compare:html",
    },
    "compare_runs": {
        "terminal": "snapforensics.report.compare_runs:terminal",
        "markdown": "snapforensics.report.compare_runs:markdown",
        "json": "snapforensics.report.json:render",
        "html": "snapforensics.report.compare_runs:html",
    },
    "fleet": {
        "terminal": "snapforensics.report.fleet:terminal",
        "markdown": "snapforensics.report.fleet:markdown",
        "json": "snapforensics.report.json:render",
        "html": "snapforensics.report.fleet:html",
    },
    "forecast": {
        "terminal": "snapforensics.report.forecast:terminal",
        "markdown": "snapforensics.report.forecast:markdown",
        "json": "snapforensics.report.json:render",
        "html": "snapforensics.report.forecast:html",
    },
    "pipeline_forecast": {
        "terminal": "snapforensics.report.forecast:pipeline_terminal",
        "markdown": "snapforensics.report.forecast:pipeline_markdown",
        "json": "snapforensics.report.json:render",
        "html": "snapforensics.report.forecast:pipeline_html",
    },
}


# Reports that, written to FILE, also write files beside it (the Markdown report's PNG plot):
# `render(doc, path) -> str`, used instead of the plain renderer for `-o FILE`.
BESIDE: dict[tuple[str, str], str] = {
    ("diagnosis", "markdown"): "snapforensics.report.markdown:render_beside",
    ("fleet", "markdown"): "snapforensics.report.fleet:render_beside",
}


@dataclass(frozen=True)
class Screen:
    """Where terminal text goes: the terminal's width (None: no terminal, the renderer picks
    the width its tables read best at) and colours (None: plain text, no escape codes)."""

    width: int | None = None
    color_system: str | None = None

    @classmethod
    def detect(cls, stream: TextIO) -> Screen:
        """The real terminal's width and colours when `stream` is one (rich's own detection,
        so NO_COLOR, TERM=dumb and COLUMNS are honoured); plain text otherwise."""
        from rich.console import Console

        c = Console(file=stream)
        if not c.is_terminal:
            return cls()
        return cls(width=c.width, color_system=c.color_system)

    def console(self, width: int = 100):
        """A console that records into a buffer, `width` columns unless a real terminal says
        otherwise: no markup parsing, no emoji codes, no highlighting of numbers in our own
        text (untrusted strings are never markup here)."""
        from rich.console import Console

        return Console(file=io.StringIO(), width=self.width or width,
                       color_system=self.color_system,  # type: ignore[arg-type]  # rich detected it
                       force_terminal=self.color_system is not None, markup=False, emoji=False,
                       highlight=False, no_color=self.color_system is None, soft_wrap=False)


PLAIN = Screen()
Renderer = Callable[[Any, Screen], str]


def formats(kind: str) -> tuple[str, ...]:
    return tuple(RENDERERS[kind])


def renderer(kind: str, fmt: str) -> Renderer:
    from snapforensics.errors import SnapError

    target = RENDERERS[kind].get(fmt)
    if target is None:
        raise SnapError(f"{kind} has no {fmt} report (formats: {', '.join(formats(kind))})")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def render(kind: str, doc: Any, fmt: str, screen: Screen = PLAIN) -> str:
    return renderer(kind, fmt)(doc, screen)


def render_to_file(kind: str, doc: Any, fmt: str, path) -> str:
    """The text of `-o path`, after writing what goes beside it (see BESIDE)."""
    target = BESIDE.get((kind, fmt))
    if target is None:
        return render(kind, doc, fmt, PLAIN)
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(doc, path)
