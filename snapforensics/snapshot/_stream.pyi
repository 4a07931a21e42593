# Types of the C extension built from _stream.c (optional: `stream.reader()` is None without it).
from typing import Any, Protocol

class _Readable(Protocol):
    def read(self, n: int, /) -> bytes: ...

def read(
    file: _Readable, actions: dict[str, int], other: int, max_bytes: int, max_rows: int,
    max_in: int, /
) -> tuple[Any, int, int] | tuple[None, str, int]:
    """(root, bytes consumed up to STOP, 1 when the root's device_traces were read as columns)
    or (None, why it declined, 0): the checked Python path reads the file. In `root`, each
    device trace is a tuple (n, action, addr, size, stream, time_us, group, reps, first, keys,
    extras): columns as bytearrays, see _stream.c."""
