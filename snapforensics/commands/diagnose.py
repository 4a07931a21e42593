"""`snapforensics diagnose SNAPSHOT...`: load, analyse, render; one report per file, or one
fleet report for a run folder, a glob or several files (every rank diagnosed in parallel)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from snapforensics.errors import EXIT_ANOMALY, SnapError
from snapforensics.report import FORMATS


@click.command("diagnose")
@click.argument("snapshots", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="terminal",
              show_default=True, help="Report format.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Write the report to FILE instead of stdout.")
@click.option("--fail-on", type=click.Choice(["anomalous", "never"]), default="never",
              show_default=True, help="Exit 1 when a finding with this verdict is found (CI gate).")
@click.option("--redact-paths", is_flag=True,
              help="Keep only file names / package-relative paths (for public tickets).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Ranks diagnosed at once [default: the core count, fewer when the largest "
                   "file would not fit in memory that many times].")
@click.option("--scheduler", metavar="ADDRESS",
              help="Run on a Dask cluster (tcp://HOST:PORT); inputs may be fsspec URLs "
                   "(s3://, gs://) that its workers read. Needs snapforensics[fleet].")
@click.option("--no-cache", is_flag=True,
              help="Neither read nor write the cache (~/.cache/snapforensics).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def diagnose_command(snapshots: tuple[str, ...], fmt: str, output: Path | None, fail_on: str,
                     redact_paths: bool, jobs: int | None, scheduler: str | None,
                     no_cache: bool, quiet: bool) -> int:
    """Diagnose memory snapshots (.pickle, .pkl, gzip'd too). Several files, a glob or a run
    folder (its rank*.pickle) give one fleet report: peaks per rank with their spread, findings
    by rank, the worst rank first."""
    from snapforensics.analysis.diagnosis import Diagnosis
    from snapforensics.parallel import is_url, run

    single = len(snapshots) == 1 and (is_url(snapshots[0]) or os.path.isfile(snapshots[0])
                                      or not os.path.exists(snapshots[0])
                                      and not any(c in snapshots[0] for c in "*?["))
    docs = run(snapshots, jobs=jobs, cache=not no_cache, scheduler=scheduler,
               progress=not quiet)
    if single:
        if "error" in docs[0]:
            raise SnapError(f"{docs[0]['source']}: {docs[0]['error']}")
        d = Diagnosis.from_dict(docs[0])
        if redact_paths:
            from snapforensics.report.redact import redact
            d = redact(d)
        write_report(d, fmt, output)
        return EXIT_ANOMALY if fail_on == "anomalous" and d.anomalies else 0
    from snapforensics.analysis.fleet import fleet
    from snapforensics.report import fleet as fleet_report

    f = fleet(docs)
    if redact_paths:
        from snapforensics.report.redact import redact
        f = redact(f)  # type: ignore[arg-type]
    _write(lambda c: fleet_report.render_terminal(f, c),
           lambda: fleet_report.render_text(f, fmt), fmt, output)
    if f.errors:
        e = f.errors[0]
        raise SnapError(f"{len(f.errors)} of {len(docs)} inputs unreadable (first: "
                        f"{e['source']}: {e['error']})")
    return EXIT_ANOMALY if fail_on == "anomalous" and f.anomalies else 0


def write_report(d, fmt: str, output: Path | None) -> None:
    from snapforensics.report import render_text, terminal

    _write(lambda c: terminal.render(d, c), lambda: render_text(d, fmt), fmt, output)


def _write(to_console, to_text, fmt: str, output: Path | None) -> None:
    if output is None and fmt == "terminal":
        from rich.console import Console
        to_console(Console())
        return
    text = to_text()
    if output is None:
        click.echo(text)
        return
    from snapforensics.report import write_file
    write_file(output, text)
