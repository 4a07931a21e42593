"""The one way a report leaves the process: `-o FILE`, `-o -` or stdout.

Files are written through a temp file that `mkstemp` creates exclusively in the target's folder
(unique random name, O_CREAT|O_EXCL: a planted symlink or file under that name is never
followed or reused), then renamed over the target, so a reader never sees half a report and a
failure leaves nothing behind. A target that exists but is not a regular file (a directory, a
device such as /dev/null, a FIFO, or a symlink to one of those) is refused: renaming over it
would silently replace the node with a regular file. `-` means stdout.

Stdout: a reader that goes away (`| head -1`) ends the command quietly with 141 (128 + SIGPIPE,
what a shell reports for a tool killed by the closed pipe); a failed write (a full disk,
`> /dev/full`) is exit 2 with one line.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from snapforensics.errors import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, SnapError
from snapforensics.report.registry import (
    EXTENSIONS,
    PLAIN,
    Screen,
    formats,
    render,
    render_to_file,
)

STDOUT = "-"


def choose_format(kind: str, fmt: str | None, output: str | None) -> str:
    """--format when given, else what the extension of `-o FILE` names, else terminal; also
    refuses an unusable `-o` (empty, or not a regular file), so commands call it before the
    work of analysis."""
    if output == "":
        raise SnapError("-o needs a file name (or - for stdout)")
    if output not in (None, STDOUT):
        check_target(output)
    if fmt is None and output not in (None, STDOUT):
        suffix = Path(output).suffix.lower()
        fmt = EXTENSIONS.get(suffix) if suffix else "terminal"
        if fmt is None:
            raise SnapError(f"-o {output}: cannot tell the report format from {suffix!r} "
                            f"(known: {', '.join(sorted(EXTENSIONS))}); give --format")
    fmt = fmt or "terminal"
    if fmt not in formats(kind):
        raise SnapError(f"{kind} has no {fmt} report (formats: {', '.join(formats(kind))})")
    return fmt


def emit(kind: str, doc: Any, fmt: str | None = None, output: str | None = None) -> None:
    """Render `doc` once and write it to `output` (a file, `-` or None for stdout)."""
    fmt = choose_format(kind, fmt, output)
    if output in (None, STDOUT):
        screen = Screen.detect(sys.stdout) if fmt == "terminal" else PLAIN
        write_stdout(render(kind, doc, fmt, screen))
    else:
        write_file(output, render_to_file(kind, doc, fmt, output))


def write_stdout(text: str) -> None:
    if not text.endswith("\n"):
        text += "\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_broken_pipe()
    except OSError as e:
        _silence_stdout()
        raise SnapError(f"cannot write the report to stdout: {e.strerror or e}") from None


def quiet_broken_pipe() -> None:
    """The reader left: exit 141 without a word (and without Python's own complaint when it
    flushes stdout again at exit)."""
    _silence_stdout()
    raise SystemExit(EXIT_BROKEN_PIPE)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def check_target(path: str | os.PathLike) -> None:
    """Refuse a target that exists and is not a regular file (symlinks followed)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise SnapError(f"cannot write {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(
            st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(
            st.st_mode) else "not a regular file"
        raise SnapError(f"cannot write {path}: it is {what}; give a regular file "
                        "(or - for stdout)", EXIT_BAD_INPUT)


def write_file(path: str | os.PathLike, text: str | bytes) -> None:
    """Write `text` (or bytes: the Markdown report's PNG) to `path` atomically (see the module
    docstring)."""
    check_target(path)
    target = Path(path)
    folder = target.parent
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".snapforensics-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        where = f"{path}" if e.errno != errno.ENOENT or folder.is_dir() else \
            f"{path} (no folder {folder})"
        raise SnapError(f"cannot write {where}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _mode_for(target: Path) -> int:
    """Keep an existing report's permissions; a new one gets the umask's (mkstemp's 0600 is
    for secrets, not for reports people share)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask
