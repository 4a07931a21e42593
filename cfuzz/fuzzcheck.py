"""What cfuzz/fuzz_diff.c calls for each input: the three read paths on the bytes
(tests/differential.py's `compare`), None when they agree, else what differs."""

from __future__ import annotations

import differential

from snapforensics.snapshot import _keys, _native, _stream

# the sanitized builds fuzz_diff.c put in sys.modules (an installed .so has a __file__)
for _m in (_stream, _keys, _native):
    if getattr(_m, "__file__", None):
        raise ImportError(f"{_m.__name__} is the installed {_m.__file__}, not the sanitized build")


def check(data: bytes) -> str | None:
    results = differential.compare(data)
    why = differential.disagreement(results)
    return f"{why}\n{differential.describe(results)}" if why else None
