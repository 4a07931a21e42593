"""DeepSpeed ZeRO-3's gathered parameters at the peak: what its all-gathers hold, and why.

ZeRO-3 keeps each parameter partitioned (1/dp a rank) and all-gathers it into a flat buffer
(`deepspeed.gathered_param`) when a module needs it. Two kinds of gathered parameters live at a
moment, told apart by what gathered them (deepspeed 0.19.8's code):
- fetched: the coordinator's `fetch_sub_module` (`partitioned_param_coordinator.py`) gathers a
  module's parameters before its forward or backward, and the ones after it up to
  `stage3_prefetch_bucket_size` elements, at most `stage3_max_live_parameters` alive; released
  after the module unless `stage3_max_reuse_distance` keeps them for an upcoming reuse;
- kept: the persistent parameters, those under `stage3_param_persistence_threshold` elements
  (`mark_persistent_parameters`: `ds_persist`), gathered at set-up and again after every
  optimizer step (`_post_step`), never released: whole on every rank for the run.

This is what the configuration chose, so the verdict is `expected`; the finding says how much of
the peak each kind is and which knob bounds it (no fix: a smaller bucket or threshold trades
memory for more, smaller all-gathers).
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import CAT_CODE, Category, Verdict

_COORDINATOR = "deepspeed/runtime/zero/partitioned_param_coordinator.py"


def _fetched(d: DeviceAnalysis, blocks: np.ndarray) -> np.ndarray:
    """Which of the blocks the coordinator gathered for a module (else kept: persistent)."""
    stacks = np.unique(d.lt.stack[blocks])
    by = {int(s) for s in stacks.tolist() if s >= 0 and any(
        f.name == "fetch_sub_module" and f.filename.replace("\\", "/").endswith(_COORDINATOR)
        for f in d.snapshot.stack_frames(int(s)))}
    return np.isin(d.lt.stack[blocks], np.fromiter(by, np.int64, len(by)))


def check(d: DeviceAnalysis) -> list[Finding]:
    lt = d.lt
    if d.peak_row < 0:
        return []
    held = np.flatnonzero((d.category == CAT_CODE[Category.DEEPSPEED_GATHERED_PARAM]) &
                          lt.alive_at(d.peak_row))
    if not len(held):
        return []
    fetched = _fetched(d, held)
    fetched_bytes = int(lt.size[held[fetched]].sum())
    kept_bytes = int(lt.size[held[~fetched]].sum())
    total = fetched_bytes + kept_bytes
    parts = []
    if fetched_bytes:
        parts.append(f"{human(fetched_bytes)} fetched for the modules running and prefetched "
                     "ahead of them (stage3_prefetch_bucket_size elements ahead, at most "
                     "stage3_max_live_parameters alive; stage3_max_reuse_distance keeps a "
                     "module's for its next use)")
    if kept_bytes:
        parts.append(f"{human(kept_bytes)} of persistent parameters, kept gathered on every "
                     "rank for the whole run (those under stage3_param_persistence_threshold "
                     "elements, default 1e5: re-gathered after each optimizer step)")
    cause = (f"At the peak ZeRO-3 holds {human(total)} of all-gathered (whole) parameters: "
             + "; ".join(parts) + ". Lowering those settings trades memory for more, smaller "
             "all-gathers.")
    return [Finding(
        rule=RULE.id, verdict=Verdict.EXPECTED,
        title="ZeRO-3 gathered parameters alive at the peak",
        cause=cause, bytes=total, blocks=len(held), device=d.device,
        evidence={"fetched_bytes_at_peak": fetched_bytes,
                  "persistent_bytes_at_peak": kept_bytes,
                  "stacks": top_stacks(d, held, 1)},
        members=held)]


RULE = Rule(
    id="deepspeed.gathered_parameters", check=check, family=Family.PARALLELISM,
    verdicts=frozenset({Verdict.EXPECTED}), fix=None)
