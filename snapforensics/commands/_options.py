"""Options every reporting command shares: --format and -o, from the one report registry."""

from __future__ import annotations

from collections.abc import Callable

import click

from snapforensics.report.registry import EXTENSIONS, formats


def report_options(kind: str) -> Callable:
    """`--format` (the formats `kind` has) and `-o/--output FILE|-`, as `fmt` and `output`."""
    exts = ", ".join(sorted(EXTENSIONS))

    def deco(f: Callable) -> Callable:
        f = click.option("-o", "--output", metavar="FILE|-", default=None,
                         help=f"Write the report to FILE (written whole or not at all; an "
                              f"existing directory, device or FIFO is refused); - is stdout. "
                              f"Without --format the extension picks it ({exts}).")(f)
        return click.option("--format", "fmt", type=click.Choice(formats(kind)), default=None,
                            help="Report format [default: from -o's extension, else "
                                 "terminal].")(f)
    return deco


def run_options(f: Callable) -> Callable:
    """How the inputs are diagnosed: `-j`, `--no-cache`, `-q` (as `jobs`, `no_cache`, `quiet`)."""
    f = click.option("-q", "--quiet", is_flag=True, help="No progress bar.")(f)
    f = click.option("--no-cache", is_flag=True,
                     help="Neither read nor write the cache (~/.cache/snapforensics).")(f)
    return click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
                        help="Inputs diagnosed at once [default: the core count, fewer when "
                             "the largest file would not fit in memory that many times].")(f)
