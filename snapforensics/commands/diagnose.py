"""`snapforensics diagnose SNAPSHOT...`: load, analyse, render; one report for one file, one
fleet report for a run folder, a glob or several files (every rank diagnosed in parallel)."""

from __future__ import annotations

import click

from snapforensics.commands._options import report_options, run_options
from snapforensics.errors import EXIT_ANOMALY, SnapError


@click.command("diagnose", short_help="Find what made the peak, the fix and the peak after it.",
               epilog="""\b
Examples:
  snapforensics diagnose runs/a/rank0.pickle     # on the terminal
  snapforensics diagnose rank0.pickle -o report.html  # offline, one file
  snapforensics diagnose rank0.pickle -o report.md    # a ticket (+ .png)
  snapforensics diagnose runs/a                  # every rank of the run
  snapforensics diagnose s.pickle --format json --fail-on anomalous""")
@click.argument("snapshots", nargs=-1, required=True)
@report_options("diagnosis")
@click.option("--fail-on", type=click.Choice(["anomalous", "never"]), default="never",
              show_default=True, help="Exit 1 when a finding with this verdict is found (CI gate).")
@click.option("--redact-paths", is_flag=True,
              help="Keep only file names / package-relative paths (for public tickets).")
@click.option("--scheduler", metavar="ADDRESS",
              help="Run on a Dask cluster (tcp://HOST:PORT); inputs may be fsspec URLs "
                   "(s3://, gs://) that its workers read. Needs snapforensics[fleet].")
@click.option("--category", "categories", multiple=True, metavar="NAME=REGEX",
              help="User category (repeatable): blocks whose stack frames ('function "
                   "file:line') or record_function ranges match REGEX are reported as NAME, "
                   "after the built-in classification; the first match wins.")
@run_options
def diagnose_command(snapshots: tuple[str, ...], fmt: str | None, output: str | None,
                     fail_on: str, redact_paths: bool, scheduler: str | None,
                     categories: tuple[str, ...], jobs: int | None, no_cache: bool,
                     quiet: bool) -> int:
    """Diagnose memory snapshots (.pickle, .pkl, gzip'd too; from `record`,
    torch.cuda.memory._dump_snapshot or torch_npu): the phases and their peaks, what made every
    block alive at the peak, findings with a verdict (anomalous, expected, info), the root
    cause, the fix as code and the peak predicted after it. Several files, a glob or a run
    folder (its rank*.pickle) give one fleet report: peaks per rank with their spread, findings
    by rank, the worst rank first."""
    from snapforensics.analysis.classify import user_categories
    from snapforensics.report.output import choose_format, emit
    from snapforensics.runner import diagnose_paths, expand, fleet_paths
    from snapforensics.snapshot.cache import full_hash

    srcs = expand(snapshots)
    single = len(srcs) == 1  # one file, or a folder or glob of one rank: one run's report
    kind = "diagnosis" if single else "fleet"
    fmt = choose_format(kind, fmt, output)  # a bad -o fails before the analysis
    user_categories(categories)  # and so does a bad --category
    # the gate keys the cache by every byte of each file (an attacker may edit one in place)
    opts = {"jobs": jobs, "cache": not no_cache, "scheduler": scheduler, "progress": not quiet,
            "categories": categories, "full": full_hash(gate=fail_on != "never")}
    if single:
        d, = diagnose_paths(srcs, **opts)
        if redact_paths:
            from snapforensics.report.redact import redact
            d = redact(d)
        emit("diagnosis", d, fmt, output)
        return EXIT_ANOMALY if fail_on == "anomalous" and d.anomalies else 0
    f = fleet_paths(srcs, **opts)
    if redact_paths:
        from snapforensics.report.redact import redact
        f = redact(f)  # type: ignore[arg-type]
    emit("fleet", f, fmt, output)
    if f.errors:
        e = f.errors[0]
        raise SnapError(f"{len(f.errors)} of {len(srcs)} inputs unreadable (first: "
                        f"{e['source']}: {e['error']})")
    return EXIT_ANOMALY if fail_on == "anomalous" and f.anomalies else 0

