"""Rules: each a module with a stable `RULE` id, `check(DeviceAnalysis) -> list[Finding]` and its
`FIX` (code, or a `fix_for(d)` function when the fix depends on the file). Facts several rules
share live in `analysis/` modules (fsdp_units, allocator, stacks, evidence), never in a rule.

The order below is the order of the findings in every report.
"""

from snapforensics.analysis.rules import (
    activations_checkpoint_granularity,
    activations_checkpointing,
    allocator_fragmentation,
    allocator_record_stream,
    fsdp_all_gather_concurrency,
    fsdp_deferred_reshard,
    fsdp_double_all_gather,
    fsdp_full_init,
    fsdp_grad_sync_off,
    fsdp_mixed_precision,
    fsdp_reduce_scatter,
    fsdp_reshard,
    fsdp_reshard_after_forward,
    fsdp_stale_prefetch,
    leak_iteration_growth,
    oom_report,
)

RULES = [
    fsdp_reshard,
    fsdp_deferred_reshard,
    fsdp_reduce_scatter,
    allocator_fragmentation,
    allocator_record_stream,
    leak_iteration_growth,
    activations_checkpointing,
    activations_checkpoint_granularity,
    oom_report,
    fsdp_reshard_after_forward,
    fsdp_stale_prefetch,
    fsdp_double_all_gather,
    fsdp_all_gather_concurrency,
    fsdp_full_init,
    fsdp_mixed_precision,
    fsdp_grad_sync_off,
]
