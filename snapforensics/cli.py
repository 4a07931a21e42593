"""The command line: a click group whose commands stay thin.

Exit codes (errors.py, README's table): 0 ok; 1 `diagnose --fail-on` matched; 2 a user or OS
error (unusable input, unwritable output, a full disk: one line on stderr); 3 record could not
start or write; 70 internal error (set SNAPFORENSICS_DEBUG=1 for the traceback); 130
interrupted; 141 stdout's reader went away. `record` exits with the training script's own code.
"""

from __future__ import annotations

import os
import sys

import click

from snapforensics import __version__
from snapforensics.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    SnapError,
    echo_error,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             epilog="""\b
Start here:
  snapforensics demo                 # the bundled example: bug, fix
  snapforensics record --out runs/a train.py   # runs/a/rank{R}.pickle
  snapforensics diagnose runs/a -o report.html # to read or attach
  snapforensics COMMAND --help       # options and examples

Exit codes: 0 ok, 1 a --fail-on gate matched, 2 a usage or input error, 3 record could not
start the script or write a snapshot, 70 a bug (SNAPFORENSICS_DEBUG=1 shows the traceback),
130 interrupted; record exits with the script's own code.""")
@click.version_option(__version__, prog_name="snapforensics")
def cli() -> None:
    """Forensics for PyTorch device-memory snapshots: what made each block, which growth is
    expected and which is a bug (FSDP, activation checkpointing), the fix as code and the peak
    predicted after it."""


def _register() -> None:
    from snapforensics.commands.compare import compare_command
    from snapforensics.commands.demo import demo_command
    from snapforensics.commands.diagnose import diagnose_command
    from snapforensics.commands.explore import explore_command
    from snapforensics.commands.forecast import forecast_command
    from snapforensics.commands.mcp import mcp_command
    from snapforensics.commands.record import record_command

    cli.add_command(record_command, "record")
    cli.add_command(diagnose_command, "diagnose")
    cli.add_command(demo_command, "demo")
    cli.add_command(compare_command, "compare")
    cli.add_command(forecast_command, "forecast")
    cli.add_command(explore_command, "explore")
    cli.add_command(mcp_command, "mcp")


_register()


# click 8.2+ raises it for `snapforensics` alone; older click has none (an empty tuple
# catches nothing)
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def check_settings() -> None:
    """Every numeric SNAPFORENSICS_* variable (settings.NUMBERS) and the cache's
    (snapshot/cache.py), parsed once: a typo fails at once, not in a worker."""
    from snapforensics.settings import NUMBERS, number
    from snapforensics.snapshot import cache

    for name in NUMBERS:
        number(name)
    cache.limit()
    cache.full_hash()


def main(argv: list[str] | None = None) -> None:
    try:
        check_settings()  # a malformed SNAPFORENSICS_* variable fails before any work
        if not (sys.argv[1:] if argv is None else argv) and not _NO_ARGS_IS_HELP:
            # click < 8.2 (the newest for Python 3.9) prints the help and returns 0
            click.echo(cli.get_help(click.Context(cli, info_name="snapforensics")))
            sys.exit(EXIT_BAD_INPUT)
        rc = cli.main(args=argv, prog_name="snapforensics", standalone_mode=False)
    except SnapError as e:
        echo_error(e)
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        sys.exit(EXIT_INTERRUPTED)
    except _NO_ARGS_IS_HELP as e:  # `snapforensics` alone: its help, as click
        click.echo(e.ctx.get_help())  # prints it standalone (exit 2), but on stdout, readable
        sys.exit(EXIT_BAD_INPUT)
    except click.UsageError as e:  # one line, like every other user error
        cmd = e.ctx.command_path if e.ctx else "snapforensics"
        echo_error(f"{e.format_message()} (see {cmd} --help)")
        sys.exit(EXIT_BAD_INPUT)
    except click.ClickException as e:
        echo_error(e.format_message())
        sys.exit(EXIT_BAD_INPUT)
    except BrokenPipeError:  # stdout's reader left (`| head`): quiet, like any Unix tool
        from snapforensics.report.output import quiet_broken_pipe
        quiet_broken_pipe()
    except OSError as e:  # the OS refused something (a full disk, a permission): not a bug
        name = f": {e.filename}" if e.filename else ""
        echo_error(f"{e.strerror or e}{name}")
        sys.exit(EXIT_BAD_INPUT)
    except Exception as e:  # a bug of ours: still one line unless asked
        if os.environ.get("SNAPFORENSICS_DEBUG"):
            raise
        echo_error(f"{type(e).__name__}: {e} (rerun with SNAPFORENSICS_DEBUG=1 for the "
               "traceback)", "internal error")
        sys.exit(EXIT_INTERNAL)
    sys.exit(rc if isinstance(rc, int) else 0)
