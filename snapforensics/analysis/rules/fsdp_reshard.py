"""FSDP parameters unsharded in backward (or recompute) and never resharded: the seed bug.

With `reshard_after_backward=False` (or a recompute path that unshards with no matching
reshard), every unit's parameters gathered during backward stay allocated after its backward
ends, so live bytes climb one layer at a time and backward peaks far above forward.
"""

from __future__ import annotations

import re

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import (
    by_module,
    by_path,
    counterfactual,
    human,
    max_alive,
    top_stacks,
)
from snapforensics.analysis.vocab import Category, Verdict

RULE = "fsdp.unsharded_params_not_resharded"
_POST_BACKWARD = re.compile(r"^FSDP::post_backward_(?:accumulate|reshard|reduce) \((.*)\)$")

FIX = """\
# after fully_shard(...) on each block (and on the root):
for module in model.modules():
    if isinstance(module, FSDPModule):
        module.set_reshard_after_backward(True)
# with gradient accumulation, only keep False on non-final micro-batches:
#   model.set_reshard_after_backward(is_last_microbatch)"""


def _reshard_rows(d: DeviceAnalysis, blocks: np.ndarray) -> np.ndarray:
    """Where a reshard would have freed each block: its unit's post-backward.

    Prefer the unit's own `FSDP::post_backward_* (fqn)` range; else the first reduce-scatter
    allocated for that unit; else the first reduce-scatter after the block; else backward end.
    """
    post: dict[str, list[int]] = {}
    for row, name in d.annotation_rows(_POST_BACKWARD):
        hit = _POST_BACKWARD.match(name)
        if hit:
            post.setdefault(hit.group(1), []).append(row)
    rs = np.flatnonzero(d.mask(Category.REDUCE_SCATTER, Category.SHARDED_GRAD))
    rs_rows = np.sort(d.lt.alloc_row[rs])
    rs_by_mod: dict[str, list[int]] = {}
    for b in rs.tolist():
        m = d.module_of(b)
        if m:
            rs_by_mod.setdefault(m, []).append(int(d.lt.alloc_row[b]))
    out = d.lt.free_row[blocks].copy()
    for k, b in enumerate(blocks.tolist()):
        a = int(d.lt.alloc_row[b])
        it = d.tl.iteration_of(a)
        end = it.backward_end if it else d.lt.rows - 1
        unit = d.module_of(b) or ""
        cands = post.get(unit, []) or sorted(rs_by_mod.get(unit, []))
        nxt = [r for r in cands if r > a]
        if not nxt and not cands:
            nxt = rs_rows[rs_rows > a][:1].tolist()
        target = nxt[0] if nxt and nxt[0] <= end else end + 1
        out[k] = min(int(out[k]), target)
    return out


MIN_SHARE = 0.01  # of the peak: below it the leftover is noise, not a finding


def check(d: DeviceAnalysis) -> list[Finding]:
    blocks = d.fsdp.leaked
    if not blocks.size:
        return []
    # Most bytes left unsharded at once in each backward; report the worst iteration.
    per_iter = {int(i): max_alive(d, blocks[d.iteration[blocks] == i])
                for i in np.unique(d.iteration[blocks])}
    worst = max(per_iter, key=per_iter.__getitem__)
    if per_iter[worst] < MIN_SHARE * d.peak_bytes:
        return []
    worst_blocks = blocks[d.iteration[blocks] == worst]
    free_row = d.lt.free_row.copy()
    free_row[blocks] = _reshard_rows(d, blocks)
    before = {"overall_bytes": d.peak_bytes}
    after, replay = counterfactual(d, free_row)
    paths = by_path(d, worst_blocks)
    n_mod = len({d.module_of(b) for b in worst_blocks.tolist()})
    via = ", ".join(f"{p} ({human(v)})" for p, v in sorted(paths.items(), key=lambda x: -x[1]))
    cause = (
        f"FSDP parameters all-gathered during backward were never resharded: "
        f"up to {human(per_iter[worst])} from {len(worst_blocks)} blocks across {n_mod} unit(s) "
        f"stayed unsharded past their unit's backward (iteration {worst}), unsharded via {via}. "
        "Each unit's post-backward skipped its reshard (reshard_after_backward=False, or a "
        "fully_shard unit nested in a checkpointed region re-unsharded by the recompute's "
        "pre-forward / pre-backward hooks), so parameter memory climbs layer by layer through "
        "backward instead of staying at one or two layers.")
    return [Finding(
        replay=replay,
        rule=RULE, verdict=Verdict.ANOMALOUS,
        title="Parameters unsharded in backward/recompute are not resharded",
        cause=cause, bytes=per_iter[worst], blocks=int(len(worst_blocks)), device=d.device,
        fix=FIX, predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=before["overall_bytes"] - after["overall_bytes"],
        evidence={
            "iteration": worst,
            "per_iteration_bytes": {str(k): v for k, v in sorted(per_iter.items())},
            "by_path": paths,
            "modules": by_module(d, worst_blocks),
            "stacks": top_stacks(d, worst_blocks),
            "predicted_peaks": after,
        },
    )]
