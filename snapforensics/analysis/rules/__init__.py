"""Rules: each a module whose `RULE` is its contract (`analysis/rule.py`: id, check, family,
verdicts, fix, what it needs). Facts several rules share live in `analysis/` modules
(fsdp_units, allocator, stacks, evidence), never in a rule.

The order below is the order of the findings in every report.
"""

from __future__ import annotations

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.rule import Rule
from snapforensics.analysis.rules import (
    activations_checkpoint_granularity,
    activations_checkpointing,
    allocator_fragmentation,
    allocator_private_pool,
    allocator_record_stream,
    ddp_bucket_view,
    deepspeed_reduce_bucket,
    deepspeed_zero3_gathered,
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
    megatron_distributed_optimizer,
    moe_capacity_padding,
    oom_report,
    pipeline_schedule,
    runtime_outside_allocator,
    tp_sequence_parallel,
)
from snapforensics.analysis.vocab import CATEGORIES

RULES: tuple[Rule, ...] = tuple(m.RULE for m in (
    fsdp_reshard,
    fsdp_deferred_reshard,
    fsdp_reduce_scatter,
    allocator_fragmentation,
    allocator_record_stream,
    allocator_private_pool,
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
    pipeline_schedule,
    ddp_bucket_view,
    deepspeed_reduce_bucket,
    deepspeed_zero3_gathered,
    megatron_distributed_optimizer,
    moe_capacity_padding,
    tp_sequence_parallel,
    runtime_outside_allocator,
))
BY_ID = {r.id: r for r in RULES}


def run_rules(d: DeviceAnalysis) -> list[Finding]:
    """Every rule's findings on one device, in RULES order; on a device with segments but no
    history, only the `segments_only` rules. Rules read the built-in categories: run them before
    `DeviceAnalysis.add_categories`."""
    if d.category_names != CATEGORIES:
        raise ValueError("rules read the built-in categories: run them before add_categories")
    history = len(d.trace) > 0
    return [f for r in RULES if history or r.segments_only for f in r.check(d)]
