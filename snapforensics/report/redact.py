"""Path redaction for reports attached to public tickets: keep what code it was, not whose disk.

Library paths keep their package-relative part (`torch/distributed/...`); every other absolute
path keeps only its file name. User names, home folders and hostnames do not leave the machine.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from snapforensics.analysis.diagnosis import Diagnosis

# A path starts only where a token starts (the lookbehind), so each token is scanned once:
# linear on a 100 kB path, where an unanchored lazy pattern retried from every character.
_SITE = re.compile(r"(?<![^\s:'\"])(?:[A-Za-z]:)?[\\/][^\s:'\"]*(?:site|dist)-packages[\\/]")
_ABS = re.compile(r"(?:(?<![\w.])[A-Za-z]:|(?<![\w.]))[\\/](?:[^\s\\/:'\"]+[\\/])+(?=[^\s\\/]+)")
_DROP = {"hostname", "pid"}


def short_path(s: str) -> str:
    """`/home/u/venv/lib/python3.12/site-packages/torch/x.py` -> `torch/x.py`."""
    return _SITE.sub("", s) if "-packages" in s else s


def redact_text(s: str) -> str:
    return _ABS.sub("…/", short_path(s))


def _walk(v: Any) -> Any:
    if isinstance(v, str):
        return redact_text(v)
    if isinstance(v, list):
        return [_walk(x) for x in v]
    if isinstance(v, tuple):  # a NamedTuple (a finding's Replay) stays one
        items = [_walk(x) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
    if isinstance(v, dict):
        return {k: _walk(x) for k, x in v.items() if k not in _DROP}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return dataclasses.replace(v, **{f.name: _walk(getattr(v, f.name))
                                         for f in dataclasses.fields(v)})
    return v


def redact(d: Diagnosis) -> Diagnosis:
    return _walk(d)
