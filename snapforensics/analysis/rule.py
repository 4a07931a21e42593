"""The rule contract: what each rule in `analysis/rules/` declares as its module's `RULE`.

Everything outside a rule reads this (the engine and the forecast run them through
`rules.run_rules`, the report reads `reserved_peak`, the tests read `family` and `verdicts`),
never the rule module's other names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from snapforensics._compat import StrEnum
from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.vocab import Verdict


class Family(StrEnum):
    # what sharding costs, and parameters FSDP failed to free (its lifecycle)
    FSDP_SHARDING = "FSDP sharding"
    # FSDP's own settings and how it was wrapped: none fires on a healthy layout
    FSDP_CONFIGURATION = "FSDP configuration"
    # the caching allocator, leaks, activations, an OOM: any framework, any model
    LIFECYCLE = "allocator and lifecycle"
    # how the model is split across ranks beyond FSDP: pipeline stages, tensor and data parallel
    PARALLELISM = "parallelism"


# The one signature of a fix that depends on the file: the device and the finding's evidence
# (what `check` measured) in, raw-torch code out.
FixFor = Callable[[DeviceAnalysis, dict[str, Any]], str]


@dataclass(frozen=True)
class Rule:
    id: str  # stable "<area>.<name>": Finding.rule, the JSON, gates and baselines key on it
    check: Callable[[DeviceAnalysis], list[Finding]]
    family: Family
    verdicts: frozenset[Verdict]  # every verdict its findings can carry
    # its fix as raw-torch code; a FixFor when it depends on the file; None when the rule
    # reports a cost the configuration chose (verdict `expected`): nothing to fix
    fix: str | FixFor | None
    # also judged on a device with segments but no allocation history (state at dump only)
    segments_only: bool = False
    # set when its saving is of reserved memory (what the caching allocator holds), not of
    # allocated memory: the reserved peak it is a share of, read from its finding's evidence
    reserved_peak: Callable[[dict[str, Any]], int | None] | None = None
