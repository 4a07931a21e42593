"""`snapforensics compare A B [C ...]`: before/after a fix, or rank vs rank, relative to A."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from snapforensics.commands._options import report_options


def compare_paths(paths: Sequence[str | Path], mode: str = "auto"):
    """Expand folders and globs, diagnose each file once, compare (analysis.compare)."""
    from snapforensics.analysis.compare import compare
    from snapforensics.commands.inputs import diagnose_paths, expand
    from snapforensics.errors import SnapError

    files = expand(paths)
    if len(files) < 2:
        raise SnapError("compare needs at least two snapshots (baseline first), "
                        f"got {len(files)}")
    return compare(diagnose_paths(files), mode=mode)


@click.command("compare")
@click.argument("snapshots", nargs=-1, required=True)
@report_options("compare")
@click.option("--mode", type=click.Choice(["auto", "before-after", "ranks"]), default="auto",
              show_default=True,
              help="auto: ranks when every input is a distinct rank of one run (same folder or "
                   "same recorded command), else before-after.")
def compare_command(snapshots: tuple[str, ...], fmt: str | None, output: str | None,
                    mode: str) -> int:
    """Compare snapshots against the first: before/after a fix (A = baseline, B = after) or
    the ranks of one run (a folder or rank*.pickle glob). Peaks and their change, what is alive
    at the peak, findings that appear / disappear / persist, A's predicted peak vs B's measured
    peak, and the rank that deviates most from the median."""
    from snapforensics.report.output import choose_format, emit

    choose_format("compare", fmt, output)  # a bad -o fails before the diagnoses
    emit("compare", compare_paths(snapshots, mode=mode.replace("-", "_")), fmt, output)
    return 0
