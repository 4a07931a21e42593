"""Rules: each a module with a stable RULE id and `check(DeviceAnalysis) -> list[Finding]`."""

from snapforensics.analysis.rules import fsdp_reduce_scatter, fsdp_reshard

RULES = [fsdp_reshard, fsdp_reduce_scatter]
