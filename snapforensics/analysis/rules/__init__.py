"""Rules: each a module with a stable RULE id and `check(DeviceAnalysis) -> list[Finding]`."""

from snapforensics.analysis.rules import fsdp_reduce_scatter, fsdp_reshard

RULES = [fsdp_reshard, fsdp_reduce_scatter]

# allocator / lifecycle rules (issue 3)
from snapforensics.analysis.rules import (  # noqa: E402
    activations_checkpointing,
    allocator_fragmentation,
    allocator_record_stream,
    leak_iteration_growth,
    oom_report,
)

RULES += [allocator_fragmentation, allocator_record_stream, leak_iteration_growth,
          activations_checkpointing, oom_report]

# FSDP configuration rules (issue 3)
from snapforensics.analysis.rules import (  # noqa: E402
    fsdp_all_gather_concurrency,
    fsdp_double_all_gather,
    fsdp_full_init,
    fsdp_grad_sync_off,
    fsdp_mixed_precision,
    fsdp_reshard_after_forward,
    fsdp_stale_prefetch,
)

RULES += [fsdp_reshard_after_forward, fsdp_stale_prefetch, fsdp_double_all_gather,
          fsdp_all_gather_concurrency, fsdp_full_init, fsdp_mixed_precision, fsdp_grad_sync_off]
