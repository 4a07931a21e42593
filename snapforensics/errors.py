"""The one error type that reaches the user: a message and an exit code, never a traceback."""

# Exit codes (documented in README.md).
EXIT_ANOMALY = 1  # diagnose --fail-on found what it was told to fail on
EXIT_BAD_INPUT = 2  # user or OS error: unusable input, unwritable output, a full disk
EXIT_RECORD_FAILED = 3  # record could not start the script or write a snapshot
EXIT_INTERNAL = 70  # a bug of ours (EX_SOFTWARE)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away (128 + SIGPIPE), e.g. `| head -1`


class SnapError(Exception):
    """A user-facing failure: printed as one line, exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


def echo_error(message: object, label: str = "error") -> None:
    """One stderr line; a file name in the message cannot break the line or drive the
    terminal (report/sanitize.py)."""
    import click

    from snapforensics.report.sanitize import TEXT, terminal

    click.echo(f"snapforensics: {label}: {terminal(message, TEXT)}", err=True)
