"""`snapforensics compare A B [C ...]`: before/after a fix, rank vs rank, or two run folders
rank by rank, relative to A; `--fail-on` makes it a CI gate (exit 1)."""

from __future__ import annotations

import os

import click

from snapforensics.commands._options import report_options, run_options
from snapforensics.errors import EXIT_ANOMALY


@click.command("compare", short_help="Did the fix work? Before/after, rank vs rank, CI gate.",
               epilog="""\b
Examples:
  snapforensics compare buggy/rank0.pickle fixed/rank0.pickle  # before/after
  snapforensics compare runs/x                    # the ranks of one run
  snapforensics compare runs/main runs/pr --fail-on regression=5% \\
      --fail-on new-anomaly                       # two runs, a CI gate
  snapforensics compare a.pickle b.pickle -o compare.html""")
@click.argument("snapshots", nargs=-1, required=True)
@report_options("compare")
@click.option("--mode", type=click.Choice(["auto", "before-after", "ranks"]), default="auto",
              show_default=True,
              help="auto: ranks when every input is a distinct rank of one run (same folder or "
                   "same recorded command), else before-after.")
@click.option("--fail-on", "fail_on", multiple=True, metavar="regression=P%|new-anomaly",
              help="Exit 1 when a peak grew by more than P% over the baseline, or an anomaly "
                   "appears that the baseline did not have (repeatable; CI gate).")
@run_options
def compare_command(snapshots: tuple[str, ...], fmt: str | None, output: str | None,
                    mode: str, fail_on: tuple[str, ...], jobs: int | None, no_cache: bool,
                    quiet: bool) -> int:
    """Compare snapshots against the first: before/after a fix (A = baseline, B = after) or
    the ranks of one run (a folder or rank*.pickle glob). Two run folders are compared rank by
    rank (rank0 with rank0, ...). Peaks and their change, what is alive at the peak, findings
    that appear / disappear / persist, A's predicted peak vs B's measured peak, and the rank
    that deviates most from the median."""
    from snapforensics import runner
    from snapforensics.analysis import gate
    from snapforensics.report.output import choose_format, emit
    from snapforensics.snapshot.cache import full_hash

    gate.parse(fail_on)  # a typo in the gate is an error before minutes of work
    # the gate keys the cache by every byte of each file (an attacker may edit one in place)
    run = {"jobs": jobs, "cache": not no_cache, "progress": not quiet,
           "full": full_hash(gate=bool(fail_on))}
    folders = len(snapshots) == 2 and all(map(os.path.isdir, snapshots)) and mode != "ranks"
    kind = "compare_runs" if folders else "compare"
    choose_format(kind, fmt, output)  # a bad -o fails before the diagnoses
    if folders:
        doc = runner.compare_folders(*snapshots, **run)
        pairs = doc.pairs
    else:
        doc = runner.compare_paths(snapshots, mode=mode.replace("-", "_"), **run)
        pairs = [doc]
    if fail_on:
        doc.gate = gate.failures(pairs, fail_on)
    emit(kind, doc, fmt, output)
    from snapforensics.errors import echo_error

    for x in doc.gate or []:
        echo_error(x, "gate failed")  # labels are file names: neutralized for the terminal
    return EXIT_ANOMALY if doc.gate else 0
