"""The switch to the C extension (`_native.c`, typed in `_native.pyi`): the trace reader that
normalization uses and the pairing walk that analysis/lifetimes uses.

`native()` is the built module, or None when it was not built (no C compiler at install) or is
turned off with SNAPFORENSICS_PURE_PYTHON=1; every caller then takes its Python path, which gives
the same results (tests/test_native.py).
"""

from __future__ import annotations

import os
from types import ModuleType

_mod: ModuleType | None
try:
    from snapforensics.snapshot import _native as _mod
except ImportError:  # built without a C compiler
    _mod = None


def native() -> ModuleType | None:
    """The C extension, or None (not built, or SNAPFORENSICS_PURE_PYTHON set)."""
    return None if os.environ.get("SNAPFORENSICS_PURE_PYTHON") else _mod
