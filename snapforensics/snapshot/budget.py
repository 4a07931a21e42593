"""One budget for what a file may make the pipeline expand, in proportion to the file's size.

A pickle refers to an object again with a 2-5 byte memo reference, so a tiny file can describe
a huge graph: one 1e4-block list shared by 1e4 segments, one trace shared by 65,536 devices.
Every stage after unpickling is linear in what the file *describes*, so the loader counts that
as it walks, before expanding anything, and stops with exit 2:

- units: trace rows + segments + blocks + devices + frames of distinct stacks. Without sharing
  each costs the file at least 2 bytes (a memo reference), so a real snapshot stays under 1 per
  byte; UNITS_PER_BYTE leaves 8x room.
- string bytes the analysis reads per stack (frame names and files, joined per stack): a frame
  reference costs 2-5 bytes and real names are < 300 characters, so real files stay under ~150
  bytes per byte of file; STRING_BYTES_PER_BYTE leaves room above that.

`SNAPFORENSICS_EXPANSION=<factor>` multiplies both limits (0 = no limit).
"""

from __future__ import annotations

from snapforensics.errors import SnapError
from snapforensics.settings import number

UNITS_PER_BYTE = 4
UNITS_FLOOR = 1 << 20  # small files: analysis cost is negligible below this
STRING_BYTES_PER_BYTE = 512
STRING_FLOOR = 64 << 20
ENV = "SNAPFORENSICS_EXPANSION"


def factor() -> float:
    return float(number(ENV))


class Budget:
    """Counts what the file describes; `None` file size (an in-memory object) means no limit."""

    def __init__(self, file_bytes: int | None) -> None:
        f = factor()
        self.file_bytes = file_bytes
        self.limited = file_bytes is not None and f > 0
        size = file_bytes or 0
        self.max_units = int((UNITS_PER_BYTE * size + UNITS_FLOOR) * f)
        self.max_strings = int((STRING_BYTES_PER_BYTE * size + STRING_FLOOR) * f)
        self.units = 0

    def add(self, n: int, what: str) -> None:
        """Count `n` more units (trace rows, blocks, ...) before expanding them."""
        self.units += n
        if self.limited and self.units > self.max_units:
            self._refuse(f"{self.units:,} {what} and other items", self.max_units,
                         UNITS_PER_BYTE)

    def strings(self, n: int) -> None:
        if self.limited and n > self.max_strings:
            self._refuse(f"{n:,} bytes of frame names to read per stack", self.max_strings,
                         STRING_BYTES_PER_BYTE)

    def _refuse(self, what: str, limit: int, per_byte: int) -> None:
        raise SnapError(
            f"the file describes {what}, more than a snapshot of {self.file_bytes:,} bytes can "
            f"(limit {limit:,}: {per_byte} per byte; shared references expand a small file); "
            f"if it is genuine, raise the limit with {ENV}=<factor> (0 = no limit)")
