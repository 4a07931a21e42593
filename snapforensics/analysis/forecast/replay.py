"""The forecast's replay engine: `Forecaster` analyses one device's recording once (scaling
classes, units, strategy, checkpointing, the rules' replayable fixes) and `predict(scenario)`
builds the scenario's plan and sizes and replays the live bytes to find its peak.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.forecast import band as band_data
from snapforensics.analysis.forecast.documents import (
    FULL,
    FULL_SHARD,
    NO_SHARD,
    NONE,
    SHARD_GRAD_OP,
    Prediction,
    Refused,
    Scenario,
)
from snapforensics.analysis.forecast.plans import (
    Plan,
    base_plan,
    to_checkpointed,
    to_full_shard,
    to_no_shard,
    to_not_checkpointed,
    to_shard_grad_op,
)
from snapforensics.analysis.forecast.scaling import (
    CONST,
    SCALING,
    SHARD,
    UNIT,
    scaled_sizes,
    scaling,
    tp_shares,
)
from snapforensics.analysis.forecast.units import detect_strategy, units
from snapforensics.analysis.rules import run_rules
from snapforensics.analysis.vocab import CAT_CODE, CATEGORIES, Category, Phase, Verdict


class Replayed(NamedTuple):
    peak: int
    row: int
    breakdown: dict[str, int]  # category -> bytes alive at the peak
    by_scaling: dict[str, int]  # scaling class -> bytes alive at the peak
    scales: dict[str, str]  # category -> the scaling class of most of its bytes at the peak


def evaluate(d: DeviceAnalysis, p: Plan, sizes: np.ndarray, cls: np.ndarray) -> Replayed:
    sz = np.where(p.keep, sizes, 0)
    extra = [(a, e, int(sizes[b])) for b, a, e in p.copies] + p.fixed_extra
    live = d.lt.replay(free_row=p.free_row, alloc_row=p.alloc_row, size=sz, extra=extra)
    if not len(live):
        return Replayed(0, -1, {}, {}, {})
    row = int(np.argmax(live))
    alive = (p.alloc_row <= row) & (p.free_row > row) & p.keep
    # bytes alive at the peak by (category, scaling class)
    n = len(SCALING)
    m = np.bincount(d.category[alive].astype(np.int64) * n + cls[alive], weights=sz[alive],
                    minlength=len(CATEGORIES) * n).reshape(len(CATEGORIES), n)
    for b, a, e in p.copies:
        if a <= row < e:
            m[d.category[b], cls[b]] += sizes[b]
    for a, e, nb in p.fixed_extra:
        if a <= row < e:
            m[CAT_CODE[Category.OTHER], CONST] += nb
    bd, bs = m.sum(1), m.sum(0)
    return Replayed(int(live[row]), row,
                    {str(CATEGORIES[i]): int(v) for i, v in enumerate(bd) if v},
                    {SCALING[i]: int(v) for i, v in enumerate(bs) if v},
                    {str(CATEGORIES[i]): SCALING[int(np.argmax(m[i]))]
                     for i, v in enumerate(bd) if v})


# torch's vocabulary-parallel cross-entropy (`torch.distributed.tensor.parallel.loss_parallel`)
LOSS_PARALLEL = "torch/distributed/tensor/parallel/loss.py"


class Forecaster:
    """One device's recording, analysed once; `predict(scenario)` replays it per scenario."""

    def __init__(self, d: DeviceAnalysis):
        self.d = d
        self.w0 = d.fsdp.world.size
        self.fsdp = bool(d.mask(Category.UNSHARDED_PARAM, Category.ALL_GATHER,
                                Category.REDUCE_SCATTER, Category.SHARDED_GRAD).any())
        self.cls = scaling(d, self.w0)
        self.tp = tp_shares(d, self.cls)  # (recorded TP degree or None, share per block)
        if d.fsdp.replicated:  # nothing sharded (replicate(), NO_SHARD): none follows the world
            self.cls = np.where(np.isin(self.cls, [SHARD, UNIT]), CONST, self.cls)
        # the loss ran under torch's loss_parallel (a vocabulary-sharded cross-entropy)
        self.loss_parallel = any(f.filename.endswith(LOSS_PARALLEL) for f in d.snapshot.frames)
        # FSDP units of every iteration (forward order), found once
        self.units = {it.index: units(d, it)[0] for it in d.tl.iterations}
        self.strategy = detect_strategy(d, self.units) if self.fsdp else "none"
        self.checkpointing = FULL if (d.tl.phase == Phase.RECOMPUTE).any() or \
            d.mask(Category.RECOMPUTE_ACTIVATION).any() else NONE
        self.findings = run_rules(d)
        # each anomaly's fix as its rule replayed it
        self.fixes = {f.rule: f.replay for f in self.findings
                      if f.verdict == Verdict.ANOMALOUS and f.replay is not None}

    @property
    def anomalies(self):
        return [f for f in self.findings if f.verdict == Verdict.ANOMALOUS]

    def baseline(self) -> Scenario:
        return Scenario(self.w0 or 1, self.strategy, self.checkpointing, 1.0, tp=self.tp[0])

    def predict(self, sc: Scenario) -> Prediction:
        if sc.tp is None and self.tp[0]:  # no TP degree given: the recorded one
            sc = replace(sc, tp=self.tp[0])
        try:
            p = self._predict(sc)
        except Refused as e:
            return Prediction(sc, refused=str(e))
        p.error_band = self.error_band(sc)
        return p

    def error_band(self, sc: Scenario) -> dict:
        """The error measured on recorded pairs for the changes `sc` makes to the recording,
        and why it is not validated where it lies outside what those pairs covered."""
        base = self.baseline()
        changes, outside = [], []
        if sc.world_size != base.world_size:
            changes.append("world_size")
            r = sc.world_size / base.world_size
            lo, hi = band_data.WORLD_RATIOS
            if not lo <= r <= hi:
                outside.append(f"world size {sc.world_size} is {r:g}x the recorded "
                               f"{base.world_size} (checked: 1/{1 / lo:g}x to {hi:g}x)")
        if sc.strategy != base.strategy:
            changes.append("strategy")
            if (base.strategy, sc.strategy) not in band_data.STRATEGY_CHANGES:
                outside.append(f"{sc.strategy} from {base.strategy} (checked: full_shard <-> "
                               "shard_grad_op)")
        if sc.checkpointing != base.checkpointing:
            changes.append("checkpointing")
        if sc.micro_batch_scale != 1:
            changes.append("micro_batch")
            if not band_data.SCALES[0] <= sc.micro_batch_scale <= band_data.SCALES[1]:
                outside.append(f"micro-batch x{sc.micro_batch_scale:g} (checked: x1/4 to x4)")
        if sc.tp != base.tp:
            changes.append("tp")
            r = (sc.tp or 0) / (base.tp or 1)
            lo, hi = band_data.TP_RATIOS
            if not lo <= r <= hi:
                outside.append(f"TP {sc.tp} is {r:g}x the recorded {base.tp} (checked: "
                               f"{lo:g}x to {hi:g}x)")
            if sc.tp == 1 and self.loss_parallel:
                outside.append("TP 1 from a recording whose loss ran under loss_parallel: at TP 1 "
                               "the plain cross-entropy runs instead, whose backward holds one "
                               "logits-sized temporary fewer (a Llama-like model at TP 2: the "
                               "forecast of TP 1 was 9.9% high)")
        if sc.fix:
            changes.append("fix")
            if sc.fix not in band_data.FIXES:
                outside.append(f"the fix of {sc.fix} (checked: {', '.join(band_data.FIXES)})")
        combo = {f"fix:{sc.fix}" if c == "fix" else c for c in changes}
        if len(changes) > 1 and set(changes) not in band_data.COMBINED and \
                combo not in band_data.COMBINED:
            outside.append(f"{' + '.join(changes)} together (each checked alone; the band is "
                           "their sum)")
        if changes and self.d.snapshot.kind.caching_allocator:
            outside.append("a caching-allocator recording (the band is from CPU recordings: "
                           "allocator rounding and NCCL's buffers are not in it)")
        return band_data.band(changes) | {"changes": changes, "validated": not outside,
                                          "not_validated": outside}

    def _predict(self, sc: Scenario) -> Prediction:
        d, base = self.d, self.baseline()
        if sc.micro_batch_scale <= 0:
            raise Refused("micro-batch scale must be positive")
        if sc.world_size != base.world_size or sc.strategy != base.strategy:
            if not self.fsdp:
                raise Refused("no FSDP in this recording: nothing in it scales with the world "
                              "size or the sharding strategy")
            if not self.w0:
                raise Refused("the recorded world size is unknown (the recorder's process "
                              "groups do not give the dp_shard degree and no reduce-scatter "
                              "pair infers it)")
        if sc.tp != base.tp:
            if base.tp is None:
                raise Refused("no tensor split by tensor parallelism is named in this recording "
                              "(the recorder names DTensors on a mesh dim called 'tp', and what "
                              "their column-wise modules output): the TP degree cannot change")
            if not sc.tp or sc.tp < 1:
                raise Refused("the TP degree must be a positive count")
        if sc.strategy.startswith("hsdp:"):
            reps = sc.strategy.split(":", 1)[1]
            if not reps.isdigit() or int(reps) < 1 or sc.world_size % int(reps):
                raise Refused(f"hsdp:R needs R (replicas) dividing the world size {sc.world_size}")
        p = base_plan(d)
        if sc.fix:
            if sc.fix not in self.fixes:
                raise Refused(f"the rule {sc.fix} gave no replayable fix for this recording")
            fix = self.fixes[sc.fix]  # a Replay: the rows it moves replace these
            # (a schedule's replay moves allocations earlier and frees later too)
            fr, ar = fix.free_row, fix.alloc_row
            if fr is not None:
                p.free_row = np.where(fr != d.lt.free_row, fr, p.free_row)
            if ar is not None:
                p.alloc_row = np.where(ar != d.lt.alloc_row, ar, p.alloc_row)
            # what the fix leaves TP-split, split the scenario's way
            p.fixed_extra = list(fix.at_tp(sc.tp) if sc.tp else fix.extra)
        want = sc.strategy.split(":")[0]
        want = FULL_SHARD if want == "hsdp" else want
        have = base.strategy
        if want != have and self.fsdp:
            if not any(self.units.values()):
                raise Refused("no FSDP unit's forward unshard is in the trace, so when its "
                              "parameters would be freed or gathered cannot be placed")
            if want == NO_SHARD:
                to_no_shard(d, self.units, p)
            elif want == SHARD_GRAD_OP and have == FULL_SHARD:
                to_shard_grad_op(d, self.units, p)
            elif want == FULL_SHARD and have == SHARD_GRAD_OP:
                to_full_shard(d, self.units, p)
            else:
                raise Refused(f"cannot forecast {want} from a {have} recording")
        if sc.checkpointing != base.checkpointing:
            if not any(u.b0 >= 0 and u.b1 >= 0 for us in self.units.values() for u in us):
                raise Refused("checkpointing needs module boundaries (FSDP units' forward and "
                              "backward) in the trace, and this recording has none")
            move = to_checkpointed if sc.checkpointing == FULL else to_not_checkpointed
            move(d, self.units, p)
        sizes = scaled_sizes(d, self.cls, self.w0, sc, self.tp)
        r = evaluate(d, p, sizes, self.cls)
        it = d.tl.iteration_of(r.row)
        return Prediction(sc, r.peak, r.row, d.phase_name(r.row), it.index if it else None,
                          r.breakdown, r.by_scaling, r.scales,
                          max(r.breakdown, key=lambda k: r.breakdown[k]) if r.breakdown else None)
