"""`snapforensics diagnose SNAPSHOT`: load, analyse, render."""

from __future__ import annotations

from pathlib import Path

import click

from snapforensics.errors import EXIT_ANOMALY
from snapforensics.report import FORMATS


@click.command("diagnose")
@click.argument("snapshot", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="terminal",
              show_default=True, help="Report format.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Write the report to FILE instead of stdout.")
@click.option("--fail-on", type=click.Choice(["anomalous", "never"]), default="never",
              show_default=True, help="Exit 1 when a finding with this verdict is found (CI gate).")
@click.option("--redact-paths", is_flag=True,
              help="Keep only file names / package-relative paths (for public tickets).")
@click.option("--category", "categories", multiple=True, metavar="NAME=REGEX",
              help="User category (repeatable): blocks whose stack frames ('function "
                   "file:line') or record_function ranges match REGEX are reported as NAME, "
                   "after the built-in classification; the first match wins.")
def diagnose_command(snapshot: Path, fmt: str, output: Path | None, fail_on: str,
                     redact_paths: bool, categories: tuple[str, ...]) -> int:
    """Diagnose one memory snapshot (.pickle, .pkl, gzip'd too)."""
    from snapforensics.analysis import diagnose
    from snapforensics.analysis.classify import user_categories
    from snapforensics.snapshot import load

    user = user_categories(categories)  # a bad regex fails before the file is read
    d = diagnose(load(snapshot), user)
    if redact_paths:
        from snapforensics.report.redact import redact
        d = redact(d)
    write_report(d, fmt, output)
    return EXIT_ANOMALY if fail_on == "anomalous" and d.anomalies else 0


def write_report(d, fmt: str, output: Path | None) -> None:
    from snapforensics.report import render_text

    if output is None and fmt == "terminal":
        from rich.console import Console

        from snapforensics.report import terminal
        terminal.render(d, Console())
        return
    if fmt == "markdown" and output is not None:
        from snapforensics.report import markdown, plot
        series = [dev.plot for dev in d.devices if dev.plot is not None]
        image = output.with_suffix(".png") if series else None
        if image is not None:  # the plot beside the report, linked by its file name
            plot.png(series, image)
        text = markdown.render(d, image.name if image else None)
    else:
        text = render_text(d, fmt)
    if output is None:
        click.echo(text)
        return
    from snapforensics.report import write_file
    write_file(output, text)
