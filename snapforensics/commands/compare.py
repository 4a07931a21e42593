"""`snapforensics compare A B [C ...]`: before/after a fix, or rank vs rank, relative to A."""

from __future__ import annotations

from pathlib import Path

import click

FORMATS = ("terminal", "markdown", "json")


@click.command("compare")
@click.argument("snapshots", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="terminal",
              show_default=True, help="Report format.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Write the report to FILE instead of stdout.")
@click.option("--mode", type=click.Choice(["auto", "before-after", "ranks"]), default="auto",
              show_default=True,
              help="auto: ranks when every input is a distinct rank of one run (same folder or "
                   "same recorded command), else before-after.")
def compare_command(snapshots: tuple[str, ...], fmt: str, output: Path | None,
                    mode: str) -> int:
    """Compare snapshots against the first: before/after a fix (A = baseline, B = after) or
    the ranks of one run (a folder or rank*.pickle glob). Peaks and their change, what is alive
    at the peak, findings that appear / disappear / persist, A's predicted peak vs B's measured
    peak, and the rank that deviates most from the median."""
    from snapforensics.analysis.compare import compare_paths
    from snapforensics.report.compare import render_terminal, render_text

    c = compare_paths(list(snapshots), mode=mode.replace("-", "_"))
    if output is None and fmt == "terminal":
        from rich.console import Console
        render_terminal(c, Console())
        return 0
    text = render_text(c, fmt)
    if output is None:
        click.echo(text)
        return 0
    from snapforensics.report import write_file
    write_file(output, text)
    return 0
