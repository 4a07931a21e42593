"""Out of memory: what was alive when the allocator gave up, and how far the request was.

An `oom` trace row carries the requested bytes (`size`) and what the driver still had free
(`device_free`). Alive at that row: the live blocks (by category and stack); reserved: the
allocator's segments then (reconstructed from the dump, see `Allocator.reserved`). The
request fits in `device_free + cached free` only if the cache's free bytes were usable
(contiguous): when they would have been enough, it is fragmentation; otherwise `short_by` bytes
of live memory must go.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.stacks import hugging_face, user_frame
from snapforensics.analysis.vocab import CATEGORIES, Category, Verdict
from snapforensics.snapshot.model import OOM

_FIXES = {
    Category.ACTIVATION:
        "# activations filled the device: checkpoint the repeated layers (or a smaller\n"
        "# micro-batch with gradient accumulation); Block: your layer class\n"
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
        "    apply_activation_checkpointing)\n\n"
        "apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))",
    Category.OPTIMIZER_STATE:
        "# optimizer state filled the device: shard it (FSDP / ZeRO), or a lighter "
        "optimizer\n# e.g. bitsandbytes.optim.AdamW8bit(model.parameters(), lr=...)",
    Category.PARAMETER:
        "# parameters filled the device: shard them (fully_shard / FSDP), load in "
        "bf16,\n# or build on the meta device and materialize shard by shard",
    Category.GRADIENT:
        "# gradients filled the device: shard them (FSDP), free them early\n"
        "optimizer.zero_grad(set_to_none=True)",
    Category.DDP_GRAD_COPY:
        "# DDP's separate gradient copies filled the device: make each .grad its bucket slot\n"
        "model = DistributedDataParallel(model, gradient_as_bucket_view=True)",
    Category.DDP_BUCKET:
        "# DDP's gradient buckets (one copy of every gradient) filled the device: shard the\n"
        "# gradients instead (fully_shard / FSDP)",
    Category.MOE_DISPATCH:
        "# MoE dispatch buffers filled the device: a lower expert capacity factor (1.0), or a\n"
        "# dropless dispatch (all_to_all_single with the routed token counts as splits)",
    Category.MOE_COMBINE:
        "# MoE combine buffers filled the device: a lower expert capacity factor (1.0), or a\n"
        "# dropless dispatch (all_to_all_single with the routed token counts as splits)",
    Category.ALL_GATHER:
        "# gathered FSDP parameters filled the device: reshard after forward/backward,"
        "\n# prefetch one unit ahead at most",
    Category.UNSHARDED_PARAM:
        "# gathered FSDP parameters filled the device: reshard after "
        "forward/backward,\n# prefetch one unit ahead at most",
}
_HF_ACTIVATIONS = (
    "# activations filled the device: checkpoint every decoder layer (or a smaller micro-batch)\n"
    'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})')
_REDUCE = "# reduce what the largest stacks in the evidence keep alive, or the batch size"


def fix_for(d: DeviceAnalysis, evidence: dict) -> str:
    """Expandable segments when the free bytes were there but in pieces (nothing short), else
    what to do about the category that filled the device (the largest alive)."""
    short = evidence.get("short_by_bytes")
    if short is not None and short <= 0 and not d.allocator.expandable:
        return d.allocator.expandable_fix
    top = next(iter(evidence.get("alive_by_category") or {}), None)
    if top == Category.ACTIVATION and hugging_face(d):
        return _HF_ACTIVATIONS
    return _FIXES.get(top, _REDUCE) if top else _REDUCE


def check(d: DeviceAnalysis) -> list[Finding]:
    rows = np.flatnonzero(d.trace.action == OOM)
    if not rows.size:
        return []
    row = int(rows[-1])  # the one the dump followed
    lt = d.lt
    want = int(d.trace.size[row])
    free = d.trace.device_free.get(row)
    alive = np.flatnonzero(lt.alive_at(row))
    allocated = int(lt.live[row]) if lt.rows else 0
    by_cat = np.bincount(d.category[alive], weights=lt.size[alive], minlength=len(CATEGORIES))
    cats = {CATEGORIES[i]: int(v) for i, v in sorted(enumerate(by_cat), key=lambda x: -x[1]) if v}
    reserved = d.allocator.reserved
    res = int(reserved[row]) if reserved is not None else None
    cached = max(res - allocated, 0) if res is not None else None
    short = want - free - (cached or 0) if free is not None else None
    top = next(iter(cats), None)
    evidence = {
        "oom_rows": rows.tolist(),
        "row": row,
        "phase": d.phase_name(row),
        "requested_bytes": want,
        "device_free_bytes": free,
        "allocated_bytes": allocated,
        "reserved_bytes": res,
        "reserved_unallocated_bytes": cached,
        "short_by_bytes": short,
        "device_total_at_least_bytes": (res + free) if res is not None and free is not None
        else None,
        "alive_by_category": cats,
        "request_stack": d.stack_text(int(d.trace.stack[row])),
        "request_user_code": user_frame(d, int(d.trace.stack[row])),
        "stacks": top_stacks(d, alive, 5),
    }
    it = d.tl.iteration_of(row)
    if it is not None:
        evidence["iteration"] = it.index
    frag = short is not None and short <= 0
    cause = (
        f"Allocation of {human(want)} failed at row {row} ({d.phase_name(row)}): the driver had "
        f"{human(free) if free is not None else 'an unknown amount'} free"
        + (f" and the allocator's cache {human(cached)} of {human(res)} reserved"
           if res is not None and cached is not None else "")
        + f", with {human(allocated)} allocated in {alive.size} live blocks"
        + (f", mostly {top} ({human(cats[top])})" if top else "") + ". "
        + ("The free bytes would have covered it but not in one piece: fragmentation."
           if frag else f"The request was {human(short)} from fitting: at least that much "
                        "live memory must go (or the request shrink)." if short is not None
           else "The file does not say what the driver had free.")
        + (f" {len(rows)} OOMs in this trace." if len(rows) > 1 else ""))
    return [Finding(
        rule=RULE.id, verdict=Verdict.ANOMALOUS,
        title=f"Out of memory: {human(want)} requested"
              + (f", {human(free)} free" if free is not None else ""),
        cause=cause, bytes=allocated, blocks=int(alive.size), members=alive, device=d.device,
        fix=fix_for(d, evidence), evidence=evidence,
    )]


RULE = Rule(
    id="oom.report", check=check, family=Family.LIFECYCLE,
    verdicts=frozenset({Verdict.ANOMALOUS}), fix=fix_for)
