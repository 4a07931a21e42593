"""Renderers of one finished Diagnosis: terminal, markdown, json, html."""

from __future__ import annotations

from snapforensics.analysis.diagnosis import Diagnosis

FORMATS = ("terminal", "markdown", "json", "html")


def write_file(path, text: str) -> None:
    """Write a report atomically: a reader never sees half a file, a failure leaves none."""
    from pathlib import Path

    from snapforensics.errors import SnapError

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True) if not tmp.is_dir() else None
        raise SnapError(f"cannot write {path}: {e.strerror or e}") from None


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
