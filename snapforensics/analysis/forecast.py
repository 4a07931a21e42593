"""Forecast: the peak of the recorded run at other world sizes, sharding strategies,
checkpointing and micro-batch sizes, by replaying its trace with scaled and moved blocks.

The model (docs/forecast.md). Every block gets a scaling class from what made it:

- shard (1/W, FSDP's padding): sharded parameters (also those `to_empty` materialized: a block
  whose size times the recorded world size is a parameter's unsharded size), sharded gradients
  (reduce-scatter outputs), optimizer state and temporaries, all-gather inputs. The recorded
  block holds ceil(F / W0) of F elements; at W it holds ceil(F / W).
- full unit (W x ceil(F / W), constant but for padding): unsharded parameters, all-gather
  outputs, reduce-scatter inputs, unsharded gradients, and the parameter gradients autograd
  makes before FSDP reduces them (gradient blocks freed inside FSDP's post-backward).
- micro-batch (x k): activations, recompute activations, other gradients (of activations).
- constant: everything else (init transients, scalars of 64 bytes or less, untraced blocks).

Strategy and checkpointing change *when* blocks live, not their size: units' unsharded
parameters kept from forward to backward (shard_grad_op) or freed after forward and gathered
again in backward (full_shard); saved activations dropped after each unit's forward and
recomputed in its backward (checkpointing), or saved (none). These move alloc/free rows of the
same blocks, per FSDP unit, using the unit boundaries the trace carries (FSDP's
`FSDP::pre_forward (fqn)` ... ranges, or its unshard events). The live-bytes series is then
replayed, so the peak may move to another moment. What the recording cannot support is refused
with the reason, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from snapforensics.analysis import forecast_band as band_data
from snapforensics.analysis import fsdp_ranges
from snapforensics.analysis.context import DeviceAnalysis, analyse
from snapforensics.analysis.fsdp_units import ROOT, forward_end
from snapforensics.analysis.rules import run_rules
from snapforensics.analysis.vocab import (
    BACKWARD_PHASES,
    CAT_CODE,
    CATEGORIES,
    Category,
    Phase,
    Verdict,
)
from snapforensics.snapshot.model import Snapshot

SCHEMA = "snapforensics.forecast/1"
FULL_SHARD, SHARD_GRAD_OP, NO_SHARD = "full_shard", "shard_grad_op", "no_shard"
STRATEGIES = (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)  # and "hsdp:R"
NONE, FULL = "none", "full"

# Scaling classes.
CONST, SHARD, UNIT, BATCH = range(4)
SCALING = ("constant", "shard", "unit", "micro_batch")  # stable ids (JSON `by_scaling`)
SCALING_TEXT = {"constant": "constant", "shard": "1/W", "unit": "unit size",
                "micro_batch": "x micro-batch"}
# A tensor of at most 8 elements of 8 bytes is a scalar (AdamW's step, a collective's divisor,
# RNG offsets): it is not a piece of a parameter and does not grow with the batch.
SCALAR_BYTES = 64
# The caching allocator hands out blocks in multiples of 512 bytes (kMinBlockSize): on CUDA/NPU
# a forecast size is rounded when the recorded one was; CPU recordings keep exact sizes.
ALLOC_ROUND = 512

# Frames under which FSDP consumes a parameter's unsharded gradient (reduce-scatter copy-in).
_REDUCE_FRAMES = {"foreach_reduce", "post_backward", "_post_backward_hook", "_reduce_grad",
                  "_reduce_grad_no_shard", "foreach_reduce_scatter_copy_in"}
_SPLIT_BACKWARD = "SplitWithSizesBackward0"


class Refused(Exception):
    """A scenario this recording cannot support; the message says why."""


@dataclass(frozen=True)
class Scenario:
    world_size: int
    strategy: str = FULL_SHARD
    checkpointing: str = NONE
    micro_batch_scale: float = 1.0
    fix: str | None = None  # anomalous rule whose fix is applied first

    def shard_factor(self) -> int:
        """Ranks a parameter is sharded over: W, W / R for hsdp:R, 1 for no_shard."""
        if self.strategy == NO_SHARD:
            return 1
        if self.strategy.startswith("hsdp:"):
            r = int(self.strategy.split(":", 1)[1])
            return max(self.world_size // r, 1)
        return self.world_size


@dataclass
class Prediction:
    scenario: Scenario
    predicted_peak_bytes: int | None = None
    peak_row: int = -1
    phase: str | None = None
    iteration: int | None = None
    breakdown: dict[str, int] = field(default_factory=dict)  # category -> bytes at the peak
    by_scaling: dict[str, int] = field(default_factory=dict)  # scaling class -> bytes at peak
    scales: dict[str, str] = field(default_factory=dict)  # category -> how it scales
    dominant: str | None = None
    refused: str | None = None
    fits: bool | None = None
    # the error measured on recorded pairs for this scenario's changes, and what was never
    # checked (forecast_band.py)
    error_band: dict | None = None

    def to_dict(self) -> dict:
        sc = self.scenario
        return {"world_size": sc.world_size, "strategy": sc.strategy,
                "checkpointing": sc.checkpointing, "micro_batch_scale": sc.micro_batch_scale,
                "fix_applied": sc.fix, "predicted_peak_bytes": self.predicted_peak_bytes,
                "phase": self.phase, "row": self.peak_row if self.refused is None else None,
                "iteration": self.iteration, "breakdown": self.breakdown,
                "by_scaling": self.by_scaling, "scales": self.scales,
                "dominant": self.dominant,
                "refused": self.refused, "fits": self.fits, "error_band": self.error_band}


@dataclass
class Forecast:
    source: str
    rank: int | None
    baseline: dict
    scenarios: list[Prediction]
    notes: list[str]
    capacity_bytes: int | None = None
    fit: dict | None = None

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "source": self.source, "rank": self.rank,
                "baseline": self.baseline, "notes": self.notes,
                "capacity_bytes": self.capacity_bytes, "fit": self.fit,
                "scenarios": [p.to_dict() for p in self.scenarios]}

    def to_frame(self):
        """One row per scenario (pandas DataFrame), breakdown flattened to `bytes.<category>`."""
        import pandas as pd

        rows = []
        for p in self.scenarios:
            r = p.to_dict()
            bd = r.pop("breakdown")
            r.pop("by_scaling")
            r.pop("scales")
            eb = r.pop("error_band") or {}
            r |= {"error_low": eb.get("low"), "error_high": eb.get("high"),
                  "validated": eb.get("validated")}
            rows.append(r | {f"bytes.{k}": v for k, v in bd.items()})
        return pd.DataFrame(rows)


# ---------------------------------------------------------------------------- scaling


def _param_grads(d: DeviceAnalysis, blocks: np.ndarray, flat_sizes: set[int]) -> np.ndarray:
    """Which gradient `blocks` are parameters' unsharded gradients (full unit size, not
    activation gradients): those FSDP's post-backward frees (its reduce-scatter copy-in), those
    FSDP1's flat parameter gathers (`use_orig_params` views: the flat gradient is the
    concatenation of theirs, `SplitWithSizesBackward0`), and the flat gradient itself (a block
    of an FSDP1 flat parameter's size made in backward)."""
    out = np.isin(d.lt.size[blocks], np.array(sorted(flat_sizes), np.int64))
    seen: dict[tuple[int, int], bool] = {}
    for k, b in enumerate(blocks.tolist()):
        fr = int(d.lt.free_row[b])
        if out[k] or fr >= d.lt.rows:
            continue
        key = (int(d.trace.stack[fr]), int(d.tl.ctx[fr]))
        if key not in seen:
            names = {f.name for f in d.snapshot.stack_frames(key[0])} if key[0] >= 0 else set()
            ranges = d.tl.contexts[key[1]] if d.tl.contexts else ()
            seen[key] = bool(names & _REDUCE_FRAMES) or any(
                r.startswith("FullyShardedDataParallel._post_backward")
                or _kind(r).startswith("post_backward") for r in ranges) or any(
                n.endswith(_SPLIT_BACKWARD) for n in names)
        out[k] = seen[key]
    return out


def scaling(d: DeviceAnalysis, w0: int | None) -> np.ndarray:
    """The scaling class of every block (see the module docstring)."""
    cat, size = d.category, d.lt.size
    cls = np.full(len(size), CONST, np.int8)
    isin = lambda *cs: np.isin(cat, [CAT_CODE[c] for c in cs])  # noqa: E731
    # what the training loop makes around the model (data, the loss's log-softmax) is
    # unclassified but made in forward/backward: it grows with the batch like activations
    step = np.isin(d.phase, [Phase.FORWARD, *BACKWARD_PHASES])
    cls[isin(Category.ACTIVATION, Category.RECOMPUTE_ACTIVATION, Category.GRADIENT) |
        (isin(Category.OTHER) & step)] = BATCH
    cls[isin(Category.UNSHARDED_PARAM, Category.UNSHARDED_GRAD, Category.ALL_GATHER)] = UNIT
    cls[isin(Category.SHARDED_PARAM, Category.SHARDED_GRAD, Category.OPTIMIZER_STATE)] = SHARD
    if w0:
        f = d.fsdp
        cls[f.ag_input] = SHARD
        # Unsharded sizes: each parameter's, each unit's flat buffer, each unshard event's sum.
        un = isin(Category.UNSHARDED_PARAM) | (isin(Category.ALL_GATHER) & f.primary)
        fulls = set(size[un].tolist())
        ev = f.event[f.event >= 0]
        if ev.size:
            fulls |= set(np.bincount(ev, weights=size[f.event >= 0]).astype(np.int64).tolist())
        fulls.discard(0)
        if f.ag_input.any():  # mixed precision: an fp32 shard of a bf16 unsharded parameter
            fulls |= {2 * x for x in fulls}
        shard_like = np.isin(size * w0, np.array(sorted(fulls), np.int64))
        # a parameter's gradient that FSDP's post-backward reduces is the full unit's
        grads = np.flatnonzero(isin(Category.GRADIENT) & (size > SCALAR_BYTES))
        weight_grad = np.zeros(len(size), bool)
        weight_grad[grads[_param_grads(d, grads, set(size[f.fsdp1_flat].tolist()))]] = True
        # a shard is made at init or by the optimizer, never by forward or backward
        cls[isin(Category.PARAMETER, Category.OTHER, Category.UNTRACED) & shard_like & ~step] = \
            SHARD
        cls[isin(Category.REDUCE_SCATTER) & shard_like] = SHARD
        cls[isin(Category.REDUCE_SCATTER) & ~shard_like] = UNIT
        cls[weight_grad] = UNIT
    cls[size <= SCALAR_BYTES] = CONST
    return cls


def scaled_sizes(d: DeviceAnalysis, cls: np.ndarray, w0: int | None, sc: Scenario) -> np.ndarray:
    size = d.lt.size.astype(np.int64)
    out = size.copy()
    w = sc.shard_factor()
    if w0 and w != w0:
        gran = 4  # bytes per element: FSDP pads in elements; fp32 unless the size says less
        g = np.where(size % 4 == 0, gran, np.where(size % 2 == 0, 2, 1))
        full_el = np.ceil(size * w0 / g)  # elements of the padded full (shard blocks)
        sh = cls == SHARD
        out[sh] = (np.ceil(full_el[sh] / w) * g[sh]).astype(np.int64)
        un = cls == UNIT
        el = np.ceil(size[un] / g[un])
        out[un] = (np.ceil(el / w) * w * g[un]).astype(np.int64)
    if sc.micro_batch_scale != 1:
        b = cls == BATCH
        out[b] = np.ceil(size[b] * sc.micro_batch_scale).astype(np.int64)
    if d.snapshot.kind.caching_allocator:  # sizes the trace records rounded stay rounded
        rounded = (size % ALLOC_ROUND == 0) & (out != size)
        out = np.where(rounded, -(-out // ALLOC_ROUND) * ALLOC_ROUND, out)
    return out


# ---------------------------------------------------------------------------- units


@dataclass
class Unit:
    """One FSDP unit in one iteration: rows of its forward and backward, its unshards."""

    key: object
    f0: int  # pre-forward (its forward unshard)
    f1: int  # post-forward (reshard, or where its forward ends)
    b0: int = -1  # pre-backward
    b1: int = -1  # post-backward
    fwd: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # forward unshards
    bwd: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # backward unshards
    fwd_ag: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # all-gather bufs
    bwd_ag: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def _kind(name: str) -> str:
    r = fsdp_ranges.parse(name)
    return r.kind if r else ""


def units(d: DeviceAnalysis, it) -> tuple[list[Unit], object]:
    """Non-root FSDP units of iteration `it` in forward order, and the root's key.

    Forward unshard events name the units (by FQN when the trace carries FSDP2's ranges, else by
    event); backward unshards of the same unit are matched by name, else last-in-first-out by
    size (backward runs the units in reverse). Unit boundaries come from FSDP's own ranges when
    present, else from when its unshards were allocated and freed."""
    f = d.fsdp
    hi = it.end
    un = np.flatnonzero(d.mask(Category.UNSHARDED_PARAM) & (d.iteration == it.index) &
                        (d.lt.alloc_row >= 0))
    un = un[np.argsort(d.lt.alloc_row[un], kind="stable")]
    fw = un[d.phase[un] == Phase.FORWARD]
    bw = un[np.isin(d.phase[un], BACKWARD_PHASES)]
    fend = forward_end(it)

    def group(blocks):
        out: dict = {}
        for b in blocks.tolist():
            m = d.module_of(b)
            out.setdefault(m if m is not None else ("event", int(f.event[b])), []).append(b)
        return {k: np.array(v, np.int64) for k, v in out.items()}

    fg, bg = group(fw), group(bw)
    named = d.annotation_rows(fsdp_ranges.RANGE)
    pre_fw = fsdp_ranges.rows_by_unit(named, ("pre_forward",))
    # a unit whose parameters are still unsharded when its forward starts (FSDP2 with
    # reshard_after_backward=False after the first step, or kept by the previous iteration)
    # gathers nothing in forward: FSDP's own pre_forward range still marks it
    empty = np.zeros(0, np.int64)
    for fqn, rows in pre_fw.items():
        if fqn not in fg and fqn not in ("", ROOT) and any(it.start <= r <= fend for r in rows):
            fg[fqn] = empty

    def start_of(k) -> int:
        if fg[k].size:
            return int(d.lt.alloc_row[fg[k]].min())
        return next(r for r in pre_fw[k] if it.start <= r <= fend)

    if not fg:
        return [], None
    keys = sorted(fg, key=start_of)
    alive = [k for k in keys if (d.lt.free_row[fg[k]] > fend).any()]
    root = ROOT if ROOT in fg else (
        alive[0] if alive and all(not isinstance(k, str) for k in keys) else None)
    # backward unshards of unnamed units: match to forward units last-in-first-out by size
    if any(not isinstance(k, str) for k in bg):
        pending = [k for k in keys if k != root]
        matched: dict = {}
        for k, v in bg.items():
            if isinstance(k, str):
                matched[k] = v
                continue
            size = int(d.lt.size[v].sum())
            for cand in reversed(pending):
                if int(d.lt.size[fg[cand]].sum()) == size:
                    pending.remove(cand)
                    matched[cand] = v
                    break
        bg = matched
    post_fw = fsdp_ranges.rows_by_unit(named, ("post_forward",))
    pre_bw = fsdp_ranges.rows_by_unit(named, ("pre_backward",))
    post_bw = fsdp_ranges.rows_by_unit(named, fsdp_ranges.POST_BACKWARD)

    def first_in(rows, a, b):
        r = [x for x in rows if a <= x <= b]
        return r[0] if r else -1

    ag = np.flatnonzero(d.mask(Category.ALL_GATHER) & f.primary & (d.iteration == it.index))
    out = []
    starts = [start_of(k) for k in keys]
    for i, k in enumerate(keys):
        if k == root:
            continue
        v = fg[k]
        f0 = starts[i]
        nxt = next((s for s in starts[i + 1:] if s > f0), fend)
        name = k if isinstance(k, str) else None
        f1 = first_in(post_fw.get(name, []), f0, hi) if name else -1
        if f1 < 0:
            freed = d.lt.free_row[v]
            f1 = int(freed.max()) if v.size and (freed <= fend).all() else nxt
        b = bg.get(k, np.zeros(0, np.int64))
        b0 = first_in(pre_bw.get(name, []), fend, hi) if name else -1
        if b0 < 0 and b.size:
            b0 = int(d.lt.alloc_row[b].min())
        b1 = first_in(post_bw.get(name, []), max(b0, fend), hi) if name else -1
        if b1 < 0:
            held = b if b.size else v[d.lt.free_row[v] > fend]
            b1 = int(d.lt.free_row[held].min()) if held.size else -1
        if name is not None:
            mods = np.array([d.module_of(x) == name for x in ag.tolist()], bool)
            mine = ag[mods] if ag.size else ag
        else:  # unnamed (FSDP1): its unsharded flat parameter is the all-gather output itself
            mine = np.zeros(0, np.int64)
        fa = mine[d.phase[mine] == Phase.FORWARD] if mine.size else mine
        ba = mine[np.isin(d.phase[mine], BACKWARD_PHASES)] if mine.size else mine
        out.append(Unit(k, f0, f1, b0, b1, v, b, fa, ba))
    # a unit never gathered in backward (kept from forward) starts its backward when the unit
    # before it in backward order finished its own (its post-backward)
    ends = sorted(u.b1 for u in out if u.b1 >= 0)
    for u in out:
        if u.b0 < 0 <= u.b1:
            before = [e for e in ends if e < u.b1]
            u.b0 = before[-1] if before else it.backward_start
    return out, root


# ---------------------------------------------------------------------------- plan


@dataclass
class Plan:
    """A counterfactual trace: each block's rows, whether it exists, and copies of blocks
    (re-gathers, recomputes) as (source block, alloc row, free row)."""

    alloc_row: np.ndarray
    free_row: np.ndarray
    keep: np.ndarray
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    fixed_extra: list[tuple[int, int, int]] = field(default_factory=list)  # rule extras (bytes)


def base_plan(d: DeviceAnalysis) -> Plan:
    return Plan(d.lt.alloc_row.copy(), d.lt.free_row.copy(), np.ones(len(d.lt), bool))


def detect_strategy(d: DeviceAnalysis, us: dict) -> str:
    """shard_grad_op when non-root units keep forward unshards alive into backward."""
    for it in d.tl.iterations:  # the first iteration with gathering units decides
        if any(u.fwd.size for u in us[it.index]):
            fend = forward_end(it)
            gathered = [u for u in us[it.index] if u.fwd.size]
            kept = sum(1 for u in gathered if (d.lt.free_row[u.fwd] > fend).all())
            return SHARD_GRAD_OP if kept > len(gathered) // 2 else FULL_SHARD
    return FULL_SHARD


def to_shard_grad_op(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """Keep each unit's forward unshard until its post-backward; no re-gather in backward."""
    for it in d.tl.iterations:
        fend = forward_end(it)
        for u in us[it.index]:
            if not u.bwd.size or (d.lt.free_row[u.fwd] > fend).all():
                continue
            p.free_row[u.fwd] = np.maximum(p.free_row[u.fwd], int(d.lt.free_row[u.bwd].max()))
            p.keep[u.bwd] = False
            p.keep[u.bwd_ag] = False


def to_full_shard(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """Free each unit's unshard at its post-forward; gather it again for its backward. FSDP's
    default backward prefetch issues the all-gather when the unit before it (in backward order)
    starts its backward: the all-gather output (FSDP1: the unsharded flat parameter itself) is
    allocated then; FSDP2 copies out into the unsharded parameters at the unit's pre-backward
    (where it is not in the trace: when the unit before it finished its backward)."""
    flat = d.fsdp.fsdp1_flat
    for it in d.tl.iterations:
        fend = forward_end(it)
        kept = [u for u in us[it.index] if u.fwd.size and (d.lt.free_row[u.fwd] > fend).all()]
        order = sorted(kept, key=lambda u: u.b1 if u.b1 >= 0 else d.lt.rows)
        prev_b0 = prev_b1 = it.backward_start
        for u in order:
            b0 = u.b0 if u.b0 >= 0 else prev_b1
            for b in u.fwd.tolist():
                fr = int(d.lt.free_row[b])
                p.free_row[b] = min(int(p.free_row[b]), u.f1)
                p.copies.append((b, prev_b0 if flat[b] else b0, fr))
            for b in u.fwd_ag.tolist():  # the all-gather output, alive until the copy-out
                p.copies.append((b, prev_b0, b0 + 1))
            prev_b0, prev_b1 = b0, (u.b1 if u.b1 >= 0 else b0)


def to_no_shard(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """No unshard at all: parameters are whole (shard factor 1), nothing is gathered."""
    for cat in (Category.UNSHARDED_PARAM, Category.ALL_GATHER):
        p.keep[d.mask(cat)] = False


def _unit_activations(d: DeviceAnalysis, u: Unit) -> np.ndarray:
    """Activations made in unit `u`'s forward and freed in its backward: what it saved."""
    m = d.mask(Category.ACTIVATION) & (d.lt.alloc_row >= u.f0) & (d.lt.alloc_row <= u.f1) & \
        (d.lt.free_row >= u.b0) & (d.lt.free_row <= u.b1)
    return np.flatnonzero(m)


def to_checkpointed(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """Checkpoint every unit: what it saved is freed right after its forward uses it and made
    again (recomputed) when its backward starts."""
    for it in d.tl.iterations:
        for u in us[it.index]:
            if u.b0 < 0 or u.b1 < 0:
                continue
            saved = _unit_activations(d, u)
            allocs = np.sort(d.lt.alloc_row[(d.lt.alloc_row > u.f0) & (d.lt.alloc_row <= u.f1)])
            for b in saved.tolist():
                a, fr = int(d.lt.alloc_row[b]), int(d.lt.free_row[b])
                nxt = allocs[np.searchsorted(allocs, a, side="right"):][:1]
                p.free_row[b] = min(fr, int(nxt[0]) if nxt.size else u.f1)
                p.copies.append((b, u.b0, fr))


def to_not_checkpointed(d: DeviceAnalysis, us: dict, p: Plan) -> None:
    """No checkpointing: what each unit's recompute made and its backward consumed is made in
    its forward instead (at the same offset from the unit's pre-forward) and kept; what the
    recompute made and freed itself was a forward transient, already in the trace."""
    rc_all = np.flatnonzero(d.mask(Category.RECOMPUTE_ACTIVATION) & (d.lt.alloc_row >= 0))
    rc_phase = d.tl.phase
    for it in d.tl.iterations:
        for u in us[it.index]:
            if u.b0 < 0 or u.b1 < 0:
                continue
            a = d.lt.alloc_row[rc_all]
            mine = rc_all[(a >= u.b0) & (a <= u.b1)]
            if not mine.size:
                continue
            start = int(d.lt.alloc_row[mine].min())
            for b in mine.tolist():
                fr = int(d.lt.free_row[b])
                if fr < d.lt.rows and rc_phase[fr] == Phase.RECOMPUTE:
                    p.keep[b] = False
                    continue
                p.alloc_row[b] = min(u.f0 + int(d.lt.alloc_row[b]) - start, u.f1)


# ---------------------------------------------------------------------------- evaluate


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


class Forecaster:
    """One device's recording, analysed once; `predict(scenario)` replays it per scenario."""

    def __init__(self, d: DeviceAnalysis):
        self.d = d
        self.w0 = d.fsdp.world.size
        self.fsdp = bool(d.mask(Category.UNSHARDED_PARAM, Category.ALL_GATHER,
                                Category.REDUCE_SCATTER, Category.SHARDED_GRAD).any())
        self.cls = scaling(d, self.w0)
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
        return Scenario(self.w0 or 1, self.strategy, self.checkpointing, 1.0)

    def predict(self, sc: Scenario) -> Prediction:
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
            if not band_data.WORLD_RATIOS[0] <= r <= band_data.WORLD_RATIOS[1]:
                outside.append(f"world size {sc.world_size} is {r:g}x the recorded "
                               f"{base.world_size} (checked: 1/2x to 2x)")
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
        if sc.fix:
            changes.append("fix")
            if sc.fix not in band_data.FIXES:
                outside.append(f"the fix of {sc.fix} (checked: {', '.join(band_data.FIXES)})")
        if len(changes) > 1 and set(changes) not in band_data.COMBINED:
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
                raise Refused("the recorded world size is unknown (no recorder provenance and "
                              "no reduce-scatter pair to infer it from)")
        if sc.strategy.startswith("hsdp:"):
            reps = sc.strategy.split(":", 1)[1]
            if not reps.isdigit() or int(reps) < 1 or sc.world_size % int(reps):
                raise Refused(f"hsdp:R needs R (replicas) dividing the world size {sc.world_size}")
        p = base_plan(d)
        if sc.fix:
            if sc.fix not in self.fixes:
                raise Refused(f"the rule {sc.fix} gave no replayable fix for this recording")
            fr, ar, extra = self.fixes[sc.fix]  # a Replay
            if fr is not None:
                p.free_row = np.minimum(p.free_row, fr)
            if ar is not None:
                p.alloc_row = np.maximum(p.alloc_row, ar)
            p.fixed_extra = list(extra)
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
        sizes = scaled_sizes(d, self.cls, self.w0, sc)
        r = evaluate(d, p, sizes, self.cls)
        it = d.tl.iteration_of(r.row)
        return Prediction(sc, r.peak, r.row, d.phase_name(r.row), it.index if it else None,
                          r.breakdown, r.by_scaling, r.scales,
                          max(r.breakdown, key=lambda k: r.breakdown[k]) if r.breakdown else None)


# ---------------------------------------------------------------------------- facade


def _scenarios(fx: Forecaster, world_sizes, strategies, checkpointing, scales) -> list[Scenario]:
    base = fx.baseline()
    out = []
    for w in world_sizes or [base.world_size]:
        for s in strategies or [base.strategy]:
            for c in checkpointing or [base.checkpointing]:
                for k in scales or [1.0]:
                    out.append(Scenario(int(w), s, c, float(k)))
    return out


def forecast(snapshot: Snapshot, world_sizes=(), strategies=(), checkpointing=(),
             micro_batch_scales=(), capacity: int | None = None,
             device: int | None = None) -> Forecast:
    """Forecast the peak of `snapshot`'s run under each combination of the given settings
    (empty = as recorded). With `capacity`, also the smallest world size that fits."""
    traces = [t for t in snapshot.active_traces if len(t)]
    if device is not None:
        traces = [t for t in traces if t.device == device]
    if not traces:
        from snapforensics.errors import SnapError
        raise SnapError("nothing to forecast: the snapshot has no allocation history "
                        "(a segments-only dump cannot be replayed)")
    fxs = [Forecaster(analyse(snapshot, t)) for t in traces]
    fx = max(fxs, key=lambda f: f.d.peak_bytes)
    d = fx.d
    base = fx.baseline()
    notes = []
    if not fx.w0 and fx.fsdp:
        notes.append("recorded world size unknown: world-size scenarios are refused")
    elif d.fsdp.world.estimated:
        notes.append(f"recorded world size {fx.w0} inferred from reduce-scatter sizes "
                     "(no recorder provenance)")
    scen = _scenarios(fx, world_sizes, strategies, checkpointing, micro_batch_scales)
    preds = [fx.predict(sc) for sc in scen]
    fixable = sorted({f.rule for f in fx.anomalies if f.rule in fx.fixes})
    other = sorted({f.rule for f in fx.anomalies} - set(fixable))
    if fixable:
        notes.append(f"this run has an anomaly ({', '.join(fixable)}): the scenarios forecast "
                     "the run as recorded, and are also given with the anomaly's fix applied "
                     "(fix applied column)")
        for rule in fixable:
            preds += [fx.predict(replace(sc, fix=rule)) for sc in scen]
    if other:
        notes.append(f"this run has an anomaly with no replayable fix ({', '.join(other)}): "
                     "the scenarios forecast the run as recorded, anomaly included")
    notes += _same_peak_notes(base, preds)
    fit = None
    if capacity:
        for p in preds:
            if p.predicted_peak_bytes is not None:
                p.fits = p.predicted_peak_bytes <= capacity
        fit = _fit(fx, capacity, scen, fixable)
    bl = fx.predict(base)
    baseline = {"world_size": fx.w0, "strategy": fx.strategy,
                "checkpointing": fx.checkpointing, "peak_bytes": d.peak_bytes,
                "phase": d.phase_name(d.peak_row), "row": d.peak_row,
                "replayed_peak_bytes": bl.predicted_peak_bytes, "breakdown": bl.breakdown,
                "by_scaling": bl.by_scaling, "scales": bl.scales,
                "device": d.device, "anomalies": [f.rule for f in fx.anomalies]}
    return Forecast(snapshot.source, snapshot.rank, baseline, preds, notes, capacity, fit)


def _same_peak_notes(base: Scenario, preds: list[Prediction]) -> list[str]:
    """Why a checkpointing change leaves a peak where it was: the peak is at a moment when what
    checkpointing changes (the activations kept from a unit's forward to its backward, or their
    recompute) is not alive, e.g. the end of backward, after every unit freed them."""
    by = {p.scenario: p for p in preds if p.refused is None}
    out = []
    for sc, p in by.items():
        twin = by.get(replace(sc, checkpointing=base.checkpointing))
        if sc.checkpointing != base.checkpointing and twin is not None and \
                twin.predicted_peak_bytes == p.predicted_peak_bytes:
            out.append(f"checkpointing {sc.checkpointing} gives the same peak as "
                       f"{base.checkpointing} at W={sc.world_size} {sc.strategy} "
                       f"x{sc.micro_batch_scale:g}{' with the fix' if sc.fix else ''}: the "
                       f"peak is in {p.phase} (row {p.peak_row}), when no activation kept "
                       "from a unit's forward to its backward (or recomputed) is alive")
    return out


# World sizes tried for --capacity: powers of two (FSDP meshes are), up to 2**16 ranks.
_FIT_WORLDS = [2 ** i for i in range(17)]


def _fit(fx: Forecaster, capacity: int, scen: list[Scenario], fixable: list[str]) -> dict:
    """Smallest world size that fits with the first scenario's settings, and, when the recorded
    configuration does not fit, the cheapest single change that fits at the recorded world
    size (a configuration that fits needs no change)."""
    base = fx.baseline()
    ref = scen[0] if scen else base
    peak = fx.d.peak_bytes
    out: dict = {"capacity_bytes": capacity, "recorded_fits": peak <= capacity,
                 "recorded_peak_bytes": peak}
    for w in _FIT_WORLDS:
        p = fx.predict(replace(ref, world_size=w))
        if p.refused or p.predicted_peak_bytes is None:
            out["smallest_world_size"] = None
            out["reason"] = p.refused
            break
        if p.predicted_peak_bytes <= capacity:
            out["smallest_world_size"] = w
            out["peak_bytes_there"] = p.predicted_peak_bytes
            break
    else:
        out["smallest_world_size"] = None
        out["reason"] = "does not fit at any world size up to 65536 (what does not shard " \
                        "exceeds the capacity)"
    # cheapest change at the recorded world size, in order of what it costs: resharding after
    # forward (one more all-gather per unit in backward), checkpointing (about one more
    # forward), half the micro-batch (twice the steps, or gradient accumulation)
    out["cheapest_change"] = None
    if out["recorded_fits"]:
        return out
    # fixing an anomaly costs nothing: tried first
    changes = [(replace(base, fix=r), {"fix": r}) for r in fixable] + [
        (replace(base, strategy=FULL_SHARD), {"strategy": FULL_SHARD}),
        (replace(base, checkpointing=FULL), {"checkpointing": FULL}),
        (replace(base, micro_batch_scale=0.5), {"micro_batch_scale": 0.5})]
    for sc, change in changes:
        if sc == base:
            continue
        p = fx.predict(sc)
        if p.predicted_peak_bytes is not None and p.predicted_peak_bytes <= capacity:
            out["cheapest_change"] = {"change": change, "peak_bytes": p.predicted_peak_bytes,
                                      "error_band": p.error_band}
            break
    return out


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '512MiB', '8e10B' -> bytes. The unit is required: a bare '80' is
    refused (80 bytes is never what a device has; 80 GiB is not guessed either)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?b?|b)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text[:40]!r} (e.g. 80GiB, 512MiB, 8e10B)")
    if not m.group(2):
        raise ValueError(f"{text.strip()[:40]!r} has no unit: write e.g. {text.strip()[:20]}GiB "
                         f"(2^30 bytes), {text.strip()[:20]}GB (10^9 bytes) or "
                         f"{text.strip()[:20]}B (bytes)")
    n = float(m.group(1))
    unit = m.group(2).rstrip("b")
    mult = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20,
            "gi": 2 ** 30, "ti": 2 ** 40}[unit]
    return int(n * mult)


def forecast_frame(snapshot, **kw):
    """`forecast` of a Snapshot or a path, as a DataFrame (one row per scenario): what
    `sf.forecast(...)` returns."""
    if not isinstance(snapshot, Snapshot):
        from snapforensics.snapshot import load
        snapshot = load(snapshot)
    return forecast(snapshot, **kw).to_frame()


__all__ = ["SCHEMA", "Scenario", "Prediction", "Forecast", "Forecaster", "forecast",
           "forecast_frame", "parse_size"]
