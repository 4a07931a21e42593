"""What Python 3.9/3.10 lack and the package uses (it supports 3.9-3.13)."""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:
    class StrEnum(str, Enum):
        """`enum.StrEnum` (3.11): members are their values as strings (`str()`, f-strings)."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)

__all__ = ["StrEnum"]
