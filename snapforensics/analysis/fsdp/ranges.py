"""FSDP2's record_function range names, parsed in one place.

FSDP2 names each unit's ranges after the unit's module (`_fsdp_param_group.py`, `_with_fqn`):
`FSDP::KIND (fqn)`, and the root unit's (empty fqn) plain `FSDP::KIND`; a few state-level ranges
read `FSDP::KIND for fqn`. CUDA recordings carry them as `external_annotations`, CPU recordings
as `<record_function>` frames. FSDP1's ranges (`FullyShardedDataParallel._pre_forward`, ...) name
no unit; classify.py maps them to these kinds itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from typing import NamedTuple

RANGE = re.compile(r"^FSDP::(\w+)(?: \((.*)\)| for (.*))?$")

# the ranges a unit's gradient reduction runs in (its post-backward)
POST_BACKWARD = frozenset({"post_backward_accumulate", "post_backward_reshard",
                           "post_backward_reduce"})


class FsdpRange(NamedTuple):
    kind: str  # pre_forward, all_gather, post_backward_reduce, ...
    fqn: str | None  # the unit's module; None for the root's ranges and state-level ones


@lru_cache(maxsize=4096)
def parse(name: str) -> FsdpRange | None:
    """`FSDP::KIND (fqn)` / `FSDP::KIND for fqn` / `FSDP::KIND` -> (kind, fqn); None otherwise."""
    m = RANGE.match(name)
    if m is None:
        return None
    fqn = m.group(2) if m.group(2) is not None else m.group(3)
    return FsdpRange(m.group(1), fqn)


def rows_by_unit(annotations: Iterable[tuple[int, str]], kinds: Iterable[str]
                 ) -> dict[str, list[int]]:
    """Rows of the ranges of `kinds` that name a unit, by the unit's fqn, in the given order
    (`annotations`: (row, name) pairs, e.g. `DeviceAnalysis.annotation_rows(RANGE)`)."""
    want = set(kinds)
    out: dict[str, list[int]] = {}
    for row, name in annotations:
        r = parse(name)
        if r is not None and r.kind in want and r.fqn is not None:
            out.setdefault(r.fqn, []).append(row)
    return out
