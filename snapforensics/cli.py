"""The command line: a click group whose commands stay thin.

Exit codes: 0 ok; 1 `diagnose --fail-on` matched; 2 unusable input (one line on stderr);
3 record could not start or write; 70 internal error (set SNAPFORENSICS_DEBUG=1 for the
traceback); 130 interrupted. `record` exits with the training script's own exit code.
"""

from __future__ import annotations

import os
import sys

import click

from snapforensics import __version__
from snapforensics.errors import SnapError

EXIT_INTERNAL = 70


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="snapforensics")
def cli() -> None:
    """Forensics for PyTorch device-memory snapshots (FSDP + activation checkpointing)."""


def _register() -> None:
    from snapforensics.commands.compare import compare_command
    from snapforensics.commands.demo import demo_command
    from snapforensics.commands.diagnose import diagnose_command
    from snapforensics.commands.forecast import forecast_command
    from snapforensics.commands.record import record_command

    cli.add_command(record_command, "record")
    cli.add_command(diagnose_command, "diagnose")
    cli.add_command(demo_command, "demo")
    cli.add_command(compare_command, "compare")
    cli.add_command(forecast_command, "forecast")


_register()


def main(argv: list[str] | None = None) -> None:
    try:
        rc = cli.main(args=argv, prog_name="snapforensics", standalone_mode=False)
    except SnapError as e:
        click.echo(f"snapforensics: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # a bug of ours: still one line unless asked
        if os.environ.get("SNAPFORENSICS_DEBUG"):
            raise
        click.echo(f"snapforensics: internal error: {type(e).__name__}: {e} "
                   "(rerun with SNAPFORENSICS_DEBUG=1 for the traceback)", err=True)
        sys.exit(EXIT_INTERNAL)
    sys.exit(rc if isinstance(rc, int) else 0)
