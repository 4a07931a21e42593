"""Renderers of one finished Diagnosis: terminal, markdown, json, html."""

from __future__ import annotations

from snapforensics.analysis.diagnosis import Diagnosis

FORMATS = ("terminal", "markdown", "json", "html")


def render_text(d: Diagnosis, fmt: str) -> str:
    """Render to a string (for -o FILE and for every non-terminal format)."""
    if fmt == "json":
        from snapforensics.report import json
        return json.render(d)
    if fmt == "markdown":
        from snapforensics.report import markdown
        return markdown.render(d)
    if fmt == "html":
        from snapforensics.report import html
        return html.render(d)
    from io import StringIO

    from rich.console import Console

    from snapforensics.report import terminal
    buf = StringIO()
    terminal.render(d, Console(file=buf, width=110, force_terminal=False, no_color=True))
    return buf.getvalue()
