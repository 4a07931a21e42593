"""What mixed precision adds on top of the sharded state: expected, with the cost.

Three extras, each measured from the trace:
- reduce in higher precision than the parameters (`reduce_dtype=float32` with
  `param_dtype=bfloat16`): a unit's reduce-scatter input is larger than its all-gather output
  by the dtype ratio (FSDP2 `foreach_reduce`'s `reduce_scatter_input`, FSDP1's cast of the
  unsharded grad in `_post_backward_hook`); the excess is `1 - 1/ratio` of those buffers;
- fp32 accumulated unsharded grads (FSDP2 `to_accumulated_grad_if_needed` /
  `accumulate_unsharded_grad_if_needed`, with gradient sync off): the same `1 - 1/ratio`;
- low-precision copies of the shards made for the all-gather (FSDP2
  `_get_param_all_gather_inputs`, FSDP1 `_mp_shard` from `_use_low_precision_shard`).

Verdict `expected`: it is what the policy is designed to cost. The fix (a `reduce_dtype` equal to
`param_dtype`) trades gradient-reduction accuracy for memory; its saving is predicted by replaying
the trace with the reduce-side buffers at the parameter dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human, peaks, top_stacks
from snapforensics.analysis.fsdp.units import FsdpUnits
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import CAT_CODE, Category, Verdict

_RATIO = 1.5  # reduce-scatter input at least this many times the all-gather output
_MIN_SHARE = 0.01  # extras alive at once, as a share of the peak

FIX = """\
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# Reduce in the parameter dtype (halves the reduce-scatter buffers; less accurate sums):
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
fully_shard(block, mp_policy=mp)
# FSDP1: MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
# Keeping reduce_dtype=float32 is the usual choice for accuracy: then this cost is expected."""


class Ratio(NamedTuple):
    """Reduce-scatter input / all-gather output: the median over units, or of the largest of
    each when units are unnamed (None when unknown); and per named unit."""

    ratio: float | None
    per_unit: dict[str, float]


def _ratio(d: DeviceAnalysis, f: FsdpUnits) -> Ratio:
    rs = np.flatnonzero(d.mask(Category.REDUCE_SCATTER))
    ag = np.flatnonzero(f.primary)
    if not rs.size or not ag.size:
        return Ratio(None, {})
    per: dict[str, list[int]] = {}
    for b in rs.tolist():
        m = d.module_of(b)
        if m is not None:
            per.setdefault(m, [0, 0])[0] = max(per.get(m, [0, 0])[0], int(d.lt.size[b]))
    for b in ag.tolist():
        m = d.module_of(b)
        if m in per:
            per[m][1] = max(per[m][1], int(d.lt.size[b]))
    ratios = {m: v[0] / v[1] for m, v in per.items() if v[0] and v[1]}
    if ratios:
        return Ratio(float(np.median(list(ratios.values()))), ratios)
    big_ag = int(d.lt.size[ag].max())
    return Ratio(int(d.lt.size[rs].max()) / big_ag if big_ag else None, {})


def check(d: DeviceAnalysis) -> list[Finding]:
    f = d.fsdp
    ratio, per_unit = _ratio(d, f)
    wide = ratio is not None and ratio >= _RATIO
    r = ratio if wide else None  # never assumed: without it the fp32-grad extra is not counted
    scale = np.zeros(len(d.lt))  # share of each block that is a mixed-precision extra
    parts: dict[str, np.ndarray] = {}
    ug = np.zeros(len(d.lt), bool)
    if r is not None:
        m = d.category == CAT_CODE[Category.REDUCE_SCATTER]
        scale[m] = 1 - 1 / r
        parts["reduce_in_higher_precision"] = m
        ug = d.category == CAT_CODE[Category.UNSHARDED_GRAD]
    if r is not None and ug.any():
        scale[ug] = 1 - 1 / r
        parts["fp32_accumulated_grads"] = ug
    if f.ag_input.any():
        scale[f.ag_input] = 1.0
        parts["low_precision_shard_copies"] = f.ag_input
    if not parts:
        return []
    extra = (d.lt.size * scale).astype(np.int64)
    live_extra = d.lt.replay(size=extra)
    peak_row = d.peak_row
    at_peak = int(live_extra[peak_row]) if peak_row >= 0 else 0
    most = int(live_extra.max())
    if most < _MIN_SHARE * d.peak_bytes:
        return []
    # Counterfactual: reduce-side buffers at the parameter dtype (the low-precision shard copies
    # are what param_dtype itself costs, kept).
    size = d.lt.size.copy()
    for name in ("reduce_in_higher_precision", "fp32_accumulated_grads"):
        if name in parts:
            size[parts[name]] = (size[parts[name]] / r).astype(np.int64)
    after = peaks(d, d.lt.replay(size=size))
    alive = d.lt.alive_at(peak_row) if peak_row >= 0 else np.zeros(len(d.lt), bool)
    by_part = {}
    for name, m in parts.items():
        by_part[name] = {
            "bytes_at_peak": int(extra[alive & m].sum()),
            "max_alive_bytes": int(d.lt.replay(size=np.where(m, extra, 0)).max()),
            "blocks": int(m.sum()),
        }
    blocks = np.flatnonzero(alive & (scale > 0))
    if not blocks.size:
        blocks = np.flatnonzero(scale > 0)
    txt = []
    if "reduce_in_higher_precision" in parts:
        how = ("reduce-scatter inputs {:.1f}x the all-gather outputs of the same units"
               if per_unit else "the largest reduce-scatter input {:.1f}x the largest all-gather "
               "output").format(r)
        txt.append(f"gradients are reduced in a dtype {r:.0f}x wider than the parameters' "
                   f"({how}), "
                   f"{human(by_part['reduce_in_higher_precision']['bytes_at_peak'])} more at the "
                   "peak")
    if "fp32_accumulated_grads" in parts:
        txt.append("unsharded gradients are accumulated in the reduce dtype across "
                   f"micro-batches ({human(by_part['fp32_accumulated_grads']['max_alive_bytes'])}"
                   " extra at most)")
    if "low_precision_shard_copies" in parts:
        txt.append("each all-gather first copies the shard into param_dtype "
                   f"({human(by_part['low_precision_shard_copies']['max_alive_bytes'])} at most, "
                   "transient)")
    cause = ("Mixed precision extras: " + "; ".join(txt) + ". "
             f"In all {human(at_peak)} at the peak ({human(most)} at most). This is what the "
             "mixed-precision policy costs, not a leak." + (
                 f" Reducing in the parameter dtype would put the peak at "
                 f"{human(after['overall_bytes'])}." if wide or ug.any() else ""))
    return [Finding(
        rule=RULE.id, verdict=Verdict.EXPECTED,
        title="Mixed precision: higher-precision reduce buffers and low-precision copies",
        cause=cause, bytes=at_peak, blocks=int(len(blocks)), members=blocks, device=d.device,
        fix=FIX if (wide or ug.any()) else None,
        predicted_peak_bytes=after["overall_bytes"] if (wide or ug.any()) else None,
        saving_bytes=max(d.peak_bytes - after["overall_bytes"], 0) if (wide or ug.any())
        else None,
        evidence={
            "reduce_to_param_dtype_ratio": round(ratio, 3) if ratio else None,
            "fp32_accumulated_grads_counted": bool(ug.any()),
            "per_unit_ratio": {k: round(v, 3) for k, v in sorted(per_unit.items())[:12]},
            "parts": by_part,
            "max_alive_bytes": most,
            "stacks": top_stacks(d, blocks, 2),
            "predicted_peaks": after,
        },
    )]


RULE = Rule(
    id="fsdp.mixed_precision_extras", check=check, family=Family.FSDP_CONFIGURATION,
    verdicts=frozenset({Verdict.EXPECTED}), fix=FIX)
