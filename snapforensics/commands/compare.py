"""`snapforensics compare A B [C ...]`: before/after a fix, rank vs rank, or two run folders
rank by rank; `--fail-on` turns it into a CI gate (exit 1)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from snapforensics.errors import EXIT_ANOMALY

FORMATS = ("terminal", "markdown", "json", "html")


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
@click.option("--fail-on", "fail_on", multiple=True, metavar="regression=P%|new-anomaly",
              help="Exit 1 when a peak grew by more than P% over the baseline, or an anomaly "
                   "appears that the baseline did not have (repeatable; CI gate).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Inputs diagnosed at once [default: the core count, memory permitting].")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the cache.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def compare_command(snapshots: tuple[str, ...], fmt: str, output: Path | None, mode: str,
                    fail_on: tuple[str, ...], jobs: int | None, no_cache: bool,
                    quiet: bool) -> int:
    """Compare snapshots against the first: before/after a fix (A = baseline, B = after) or
    the ranks of one run (a folder or rank*.pickle glob). Two run folders are compared rank by
    rank (rank0 with rank0, ...). Peaks and their change, what is alive at the peak, findings
    that appear / disappear / persist, A's predicted peak vs B's measured peak, and the rank
    that deviates most from the median."""
    from snapforensics.analysis import gate
    from snapforensics.analysis.compare import compare, diagnose_paths
    from snapforensics.parallel import expand
    from snapforensics.report import compare as report
    from snapforensics.report import write_file

    gate.parse(fail_on)  # a typo in the gate is an error before minutes of work
    opts = {"jobs": jobs, "cache": not no_cache, "progress": not quiet}
    if len(snapshots) == 2 and all(os.path.isdir(s) for s in snapshots) and mode != "ranks":
        a, b = expand([snapshots[0]]), expand([snapshots[1]])
        diags = diagnose_paths(a + b, **opts)
        runs = gate.compare_runs(snapshots[0], snapshots[1], diags[:len(a)], diags[len(a):])
        failed = gate.failures(runs.pairs, fail_on) if fail_on else []
        if output is None and fmt == "terminal":
            from rich.console import Console
            report.render_runs(runs, fmt, failed, Console())
        else:
            _emit(report.render_runs(runs, fmt, failed) or "", output, write_file)
        return _verdict(failed)

    srcs = expand(snapshots)
    if len(srcs) < 2:
        from snapforensics.errors import SnapError
        raise SnapError(f"compare needs at least two snapshots (baseline first), got {len(srcs)}")
    c = compare(diagnose_paths(srcs, **opts), mode=mode.replace("-", "_"))
    failed = gate.failures([c], fail_on) if fail_on else []
    if output is None and fmt == "terminal":
        from rich.console import Console
        report.render_terminal(c, Console())
    else:
        text = report.render_html(c, failed) if fmt == "html" else report.render_text(c, fmt)
        if fmt == "json" and fail_on:
            from snapforensics.report.json import dumps
            text = dumps(c.to_dict() | {"gate": {"failures": failed}}, indent=True)
        _emit(text, output, write_file)
    return _verdict(failed)


def _emit(text: str, output: Path | None, write_file) -> None:
    if output is None:
        click.echo(text)
    else:
        write_file(output, text)


def _verdict(failed: list[str]) -> int:
    """The gate's result on stderr (whatever the report's format and destination)."""
    for x in failed:
        click.echo(f"snapforensics: gate failed: {x}", err=True)
    return EXIT_ANOMALY if failed else 0
