"""JSON: the contracts others script against (snapforensics.diagnosis/1 in
analysis/diagnosis.py, snapforensics.compare/1 in analysis/compare.py). Strings stay exact."""

from __future__ import annotations

import json
from typing import Any

import orjson

from snapforensics.report.registry import PLAIN, Screen


def dumps(v: Any, indent: bool = False) -> str:
    """JSON that never fails on what a stranger's provenance block may hold."""
    try:
        opt = orjson.OPT_NON_STR_KEYS | (orjson.OPT_INDENT_2 if indent else 0)
        return orjson.dumps(v, default=str, option=opt).decode()
    except (TypeError, orjson.JSONEncodeError):  # e.g. an int beyond 64 bits
        return json.dumps(v, default=str, skipkeys=True, indent=2 if indent else None,
                          separators=None if indent else (",", ":"))


def render(doc: Any, screen: Screen = PLAIN) -> str:
    """Any document with `to_dict()`: a diagnosis, a comparison, ..."""
    return dumps(doc.to_dict(), indent=True)
