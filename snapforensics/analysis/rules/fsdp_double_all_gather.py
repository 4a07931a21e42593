"""Two all-gathers per unit per backward: the recompute unshards and reshards a unit, then its
backward gathers it again.

Signature: in one iteration's backward (recompute included) more unshard events than units were
resharded during that forward (each resharded unit needs exactly one all-gather in backward).
With FSDP2's `FSDP::... (fqn)` ranges this is counted per unit (a unit gathered twice); without
names, as a total (backward unshards at least 1.5x the units resharded in forward). Stale
prefetches (`fsdp.stale_prefetch_all_gather`) are not counted again here.

Known causes: FSDP1 with HF-style *reentrant* checkpointing around the wrapped layer (the
recompute re-runs FSDP's pre-forward: unshard, post-forward reshard; then the pre-backward hook
unshards again; pytorch #105635), FSDP2 units nested inside a checkpointed layer on torch before
pytorch PR 164009 / #175406. Verdict `anomalous`: the second all-gather of every layer is wasted
communication (the whole model all-gathered once more per step) and extra allocator churn; the
predicted peak keeps the first gather alive through the unit's backward instead.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import (
    by_module,
    by_path,
    counterfactual,
    human,
    lowers_peak,
    seen_in,
    top_stacks,
)
from snapforensics.analysis.fsdp.units import FsdpUnits, forward_end, unit_of_event
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import BACKWARD_PHASES, Verdict

FIX = """\
# FSDP1 + HF-style checkpointing: checkpoint *inside* the FSDP unit, non-reentrant
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))  # Block: your layer class
apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block),
                               checkpoint_impl=CheckpointImpl.NO_REENTRANT)
# (HF: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}))
# FSDP2: fully_shard the checkpointed block, not modules nested inside it, and use a torch
# with pytorch PR 164009."""

_RATIO = 1.5  # unnamed units: backward unshards vs units resharded in forward


class IterationEvents(NamedTuple):
    """One iteration's unshard events, each the array of its blocks."""

    resharded_in_forward: list[np.ndarray]
    backward: list[np.ndarray]


class Pair(NamedTuple):
    """Two gathers of the same unit in one backward."""

    first: np.ndarray
    second: np.ndarray


def _events_by_iteration(d: DeviceAnalysis, f: FsdpUnits,
                         stale: np.ndarray) -> dict[int, IterationEvents]:
    ev = f.event
    idx = np.flatnonzero(ev >= 0)
    groups: dict[int, list[int]] = {}
    for b in idx.tolist():
        groups.setdefault(int(ev[b]), []).append(b)
    out = {it.index: IterationEvents([], []) for it in d.tl.iterations}
    starts = np.array([it.start for it in d.tl.iterations], np.int64)
    for blocks in groups.values():
        bl = np.array(blocks, np.int64)
        b = blocks[0]
        fr = int(d.lt.free_row[bl].max())
        # resharded during some iteration's forward (allocated then, or kept from before)
        k = int(np.searchsorted(starts, fr, side="right")) - 1
        if 0 <= k < len(d.tl.iterations):
            it = d.tl.iterations[k]
            if it.backward_start >= 0 and it.start <= fr <= forward_end(it) and \
                    int(d.lt.alloc_row[b]) < fr:
                out[k].resharded_in_forward.append(bl)
        if d.phase[b] in BACKWARD_PHASES and d.iteration[b] >= 0 and not stale[bl].any():
            out[int(d.iteration[b])].backward.append(bl)
    return out


def _pairs(d: DeviceAnalysis, bw: list[np.ndarray]) -> list[Pair]:
    """Gathers of the same unit: same name, else the next event of equal size that starts
    after the first was freed."""
    bw = sorted(bw, key=lambda bl: int(d.lt.alloc_row[bl].min()))
    used: set[int] = set()
    pairs: list[Pair] = []
    for i, first in enumerate(bw):
        if i in used:
            continue
        m = unit_of_event(d, first)
        size = int(d.lt.size[first].sum())
        end = int(d.lt.free_row[first].max())
        for j in range(i + 1, len(bw)):
            if j in used:
                continue
            second = bw[j]
            m2 = unit_of_event(d, second)
            same = (m is not None and m == m2) or (
                m is None and m2 is None and int(d.lt.size[second].sum()) == size and
                int(d.lt.alloc_row[second].min()) >= end)
            if same:
                pairs.append(Pair(first, second))
                used.update((i, j))
                break
            if m is None and int(d.lt.alloc_row[second].min()) >= end:
                break  # unnamed: only the very next gather can be the same unit again
    return pairs


def check(d: DeviceAnalysis) -> list[Finding]:
    f = d.fsdp
    stale = d.fsdp.stale
    found: dict[int, list] = {}
    for k, (resharded, bw) in _events_by_iteration(d, f, stale).items():
        if not bw:
            continue
        named = all(unit_of_event(d, bl) is not None for bl in bw + resharded)
        if named:
            exp: dict[str | None, int] = {}
            got: dict[str | None, int] = {}
            for bl in resharded:
                exp[unit_of_event(d, bl)] = exp.get(unit_of_event(d, bl), 0) + 1
            for bl in bw:
                got[unit_of_event(d, bl)] = got.get(unit_of_event(d, bl), 0) + 1
            doubled = {u for u, n in got.items() if n >= 2 and n >= 2 * exp.get(u, 0)}
            if not doubled:
                continue
            pairs = [p for p in _pairs(d, bw) if unit_of_event(d, p.first) in doubled]
        else:
            if len(bw) < _RATIO * len(resharded) or len(bw) - len(resharded) < 1:
                continue
            pairs = _pairs(d, bw)
        if pairs:
            found[k] = pairs
    if not found:
        return []
    free_row = d.lt.free_row.copy()
    for pairs in found.values():
        for first, second in pairs:
            keep_until = int(d.lt.free_row[second].max())
            free_row[first] = np.maximum(free_row[first], keep_until)
            free_row[second] = d.lt.alloc_row[second]
    after, replay = counterfactual(d, free_row)
    per_iter = {k: sum(int(d.lt.size[s].sum()) for _, s in p) for k, p in found.items()}
    worst = max(per_iter, key=per_iter.__getitem__)
    seconds = np.concatenate([s for _, s in found[worst]])
    firsts = np.concatenate([fi for fi, _ in found[worst]])
    paths = {f"{label}: {p}": v for label, bl in (("first", firsts), ("second", seconds))
             for p, v in by_path(d, bl).items()}
    n_pairs = len(found[worst])
    at_peak = lowers_peak(d, d.peak_bytes - after["overall_bytes"])
    cause = (
        f"{n_pairs} FSDP unit(s) were all-gathered twice in one backward "
        f"({seen_in(d, per_iter, worst)}): "
        f"{human(per_iter[worst])} gathered a second time. The recompute re-ran the unit's "
        "pre-forward (unshard) and post-forward (reshard), then the unit's pre-backward "
        "unshard gathered the same parameters again; every checkpointed layer pays one extra "
        "all-gather of its full parameters per step, and the reshard/re-gather churns the "
        "allocator; the communication is doubled. "
        + (f"Gathering once puts the peak at {human(after['overall_bytes'])} instead of "
           f"{human(d.peak_bytes)}." if at_peak else
           f"The memory peak does not move ({human(d.peak_bytes)}): this costs communication, "
           "not memory."))
    return [Finding(
        replay=replay,
        rule=RULE.id, verdict=Verdict.ANOMALOUS if at_peak else Verdict.INFO,
        title="Units all-gathered twice per backward (recompute reshards, backward re-gathers)",
        cause=cause, bytes=per_iter[worst], blocks=int(len(seconds)), device=d.device, fix=FIX,
        members=seconds,
        predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=max(d.peak_bytes - after["overall_bytes"], 0),
        evidence={
            "iteration": worst,
            "units_gathered_twice": n_pairs,
            "per_iteration_bytes": {str(k): v for k, v in sorted(per_iter.items())},
            "by_path": paths,
            "modules": by_module(d, seconds),
            "stacks": top_stacks(d, seconds, 1) + top_stacks(d, firsts, 1),
            "predicted_peaks": after,
        },
    )]


RULE = Rule(
    id="fsdp.double_all_gather_in_backward", check=check, family=Family.FSDP_CONFIGURATION,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX)
