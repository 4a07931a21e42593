"""The one error type that reaches the user: a message and an exit code, never a traceback."""

# Exit codes (documented in README.md).
EXIT_ANOMALY = 1  # diagnose --fail-on found what it was told to fail on
EXIT_BAD_INPUT = 2  # unusable input: missing, unreadable, not a snapshot, hostile
EXIT_RECORD_FAILED = 3  # record could not start the script or write a snapshot


class SnapError(Exception):
    """A user-facing failure: printed as one line, exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code
