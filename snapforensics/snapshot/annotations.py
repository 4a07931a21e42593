"""External annotations (`record_function` ranges of CUDA recordings): each carries only a time,
and is placed before the first later row of its device's trace."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from snapforensics.errors import SnapError
from snapforensics.snapshot.columns import (
    LISTS,
    MAX_TIME_US,
    check_time,
    clean_str,
    tname,
)
from snapforensics.snapshot.intern import Interner
from snapforensics.snapshot.model import Annotation, Trace


def place(raw: Any, traces: list[Trace], it: Interner,
                       untimed: list[str]) -> list[Annotation]:
    """External annotations carry only a time: place each before the first later trace row."""
    if raw is None:
        return []
    if type(raw) not in LISTS:
        raise SnapError(f"external_annotations must be a list, got {tname(raw)}")
    it.budget.add(len(raw), "annotations")
    by_dev = {t.device: t for t in traces}
    sorted_ok = {t.device: len(t) > 0 and not np.isnan(t.time_us).any()
                 and not (np.diff(t.time_us) < 0).any() for t in traces}
    out = []
    for i, a in enumerate(raw):
        where = f"external_annotations[{i}]"
        if type(a) is not dict:
            raise SnapError(f"{where} is {tname(a)}, expected a dict")
        stage = a.get("stage", "START")
        if type(stage) is not str:
            raise SnapError(f"{where}: stage must be a string, got {tname(stage)}")
        stage = stage.upper()
        name = a.get("name", "")
        if type(name) is not str:
            raise SnapError(f"{where}: name must be a string, got {tname(name)}")
        dev = a.get("device", 0)
        dev = dev if type(dev) is int else 0
        t = check_time(a.get("time_us"), where)
        if abs(t) > MAX_TIME_US:
            untimed.append(f"external annotation {i}")
            continue
        trace = by_dev[dev] if dev in by_dev else (traces[0] if traces else None)
        if trace is None or math.isnan(t):
            continue
        # START sits before rows of the same time, END after them.
        side: Literal["left", "right"] = "left" if stage == "START" else "right"
        row = int(np.searchsorted(trace.time_us, t, side=side)) if sorted_ok[trace.device] \
            else len(trace)
        out.append(Annotation(trace.device, "END" if stage == "END" else "START",
                              clean_str(name), t, row))
    return out
