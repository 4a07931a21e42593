"""`snapforensics diagnose SNAPSHOT`: load, analyse, render."""

from __future__ import annotations

from pathlib import Path

import click

from snapforensics.commands._options import report_options
from snapforensics.errors import EXIT_ANOMALY


@click.command("diagnose")
@click.argument("snapshot", type=click.Path(path_type=Path))
@report_options("diagnosis")
@click.option("--fail-on", type=click.Choice(["anomalous", "never"]), default="never",
              show_default=True, help="Exit 1 when a finding with this verdict is found (CI gate).")
@click.option("--redact-paths", is_flag=True,
              help="Keep only file names / package-relative paths (for public tickets).")
@click.option("--category", "categories", multiple=True, metavar="NAME=REGEX",
              help="User category (repeatable): blocks whose stack frames ('function "
                   "file:line') or record_function ranges match REGEX are reported as NAME, "
                   "after the built-in classification; the first match wins.")
def diagnose_command(snapshot: Path, fmt: str | None, output: str | None, fail_on: str,
                     redact_paths: bool, categories: tuple[str, ...]) -> int:
    """Diagnose one memory snapshot (.pickle, .pkl, gzip'd too)."""
    from snapforensics.analysis.classify import user_categories
    from snapforensics.commands.inputs import diagnose_paths
    from snapforensics.report.output import choose_format, emit

    choose_format("diagnosis", fmt, output)  # a bad -o fails before the analysis
    user = user_categories(categories)  # and so does a bad regex
    d, = diagnose_paths([snapshot], user)
    if redact_paths:
        from snapforensics.report.redact import redact
        d = redact(d)
    emit("diagnosis", d, fmt, output)
    return EXIT_ANOMALY if fail_on == "anomalous" and d.anomalies else 0
