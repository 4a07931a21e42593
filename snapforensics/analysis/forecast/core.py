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


from dataclasses import replace

from snapforensics.analysis.context import analyse
from snapforensics.analysis.forecast.capacity import capacity_fit
from snapforensics.analysis.forecast.documents import Forecast, Prediction, Scenario
from snapforensics.analysis.forecast.replay import Forecaster
from snapforensics.snapshot.model import Snapshot


def _scenarios(fx: Forecaster, world_sizes, strategies, checkpointing, scales,
               tps=()) -> list[Scenario]:
    base = fx.baseline()
    out = []
    for w in world_sizes or [base.world_size]:
        for s in strategies or [base.strategy]:
            for c in checkpointing or [base.checkpointing]:
                for k in scales or [1.0]:
                    for tp in tps or [base.tp]:
                        out.append(Scenario(int(w), s, c, float(k), tp=tp))
    return out


def forecast(snapshot: Snapshot, world_sizes=(), strategies=(), checkpointing=(),
             micro_batch_scales=(), capacity: int | None = None,
             device: int | None = None, tps=()) -> Forecast:
    """Forecast the peak of `snapshot`'s run under each combination of the given settings
    (empty = as recorded; `tps`: tensor-parallel degrees, the data-parallel ones kept). With
    `capacity`, also the smallest world size that fits."""
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
                     "(neither the recorder's process groups nor a 1-D mesh's world say it)")
    scen = _scenarios(fx, world_sizes, strategies, checkpointing, micro_batch_scales, tps)
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
        fit = capacity_fit(fx, capacity, scen, fixable)
    bl = fx.predict(base)
    baseline = {"world_size": fx.w0, "tp": base.tp, "strategy": fx.strategy,
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


def forecast_frame(snapshot, **kw):
    """`forecast` of a Snapshot or a path, as a DataFrame (one row per scenario): what
    `sf.forecast(...)` returns."""
    if not isinstance(snapshot, Snapshot):
        from snapforensics.snapshot import load
        snapshot = load(snapshot)
    return forecast(snapshot, **kw).to_frame()
