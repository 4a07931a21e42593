"""JSON: the contract others script against (schema in analysis/diagnosis.py)."""

from __future__ import annotations

import json
from typing import Any

import orjson

from snapforensics.analysis.diagnosis import Diagnosis


def dumps(v: Any, indent: bool = False) -> str:
    """JSON that never fails on what a stranger's provenance block may hold."""
    try:
        opt = orjson.OPT_NON_STR_KEYS | (orjson.OPT_INDENT_2 if indent else 0)
        return orjson.dumps(v, default=str, option=opt).decode()
    except (TypeError, orjson.JSONEncodeError):  # e.g. an int beyond 64 bits
        return json.dumps(v, default=str, skipkeys=True, indent=2 if indent else None,
                          separators=None if indent else (",", ":"))


def render(d: Diagnosis) -> str:
    return dumps(d.to_dict(), indent=True)
