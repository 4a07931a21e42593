"""`snapforensics forecast SNAPSHOT`: the peak at other world sizes, strategies, checkpointing
and micro-batch sizes, from one recording."""

from __future__ import annotations

from pathlib import Path

import click

from snapforensics.commands._options import report_options
from snapforensics.errors import SnapError


def _list(text: str | None, conv, what: str) -> list:
    if not text:
        return []
    try:
        return [conv(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SnapError(f"--{what}: cannot read {text[:80]!r} ({RANGES[what]})") from None


RANGES = {"world-size": "integers from 1 to 1048576",
          "strategy": "full_shard, shard_grad_op, no_shard or hsdp:R, R from 1 to 1048576",
          "checkpointing": "none or full",
          "micro-batch-scale": "numbers from 1/1024 to 1024",
          "tp": "integers from 1 to 4096",
          "pp": "integers from 1 to 1048576", "microbatches": "integers from 1 to 1048576",
          "schedule": "gpipe, 1f1b or interleaved[:V], V from 2 to 64"}


# Ranges of the options. World sizes (and HSDP replicas): up to 2^20 ranks, above the largest
# clusters built (~1e5 devices); per-rank shards of 1/W stay whole bytes far past a real unit.
# Micro-batch scales: 1/1024 to 1024 times the recorded one: activations scale linearly only
# near the recording, and the scaled int64 byte counts stay exact (2^50 B x 2^10 < 2^62).
# Capacity: up to 2^60 bytes (1 EiB), no device has more.
MAX_WORLD = 1 << 20
SCALES = (1 / 1024, 1024.0)
MAX_CAPACITY = 1 << 60


def _strategy(s: str) -> str:
    s = s.strip().lower()
    if s in ("full_shard", "shard_grad_op", "no_shard") or (
            s.startswith("hsdp:") and s[5:].isdigit() and len(s) < 16
            and 1 <= int(s[5:]) <= MAX_WORLD):
        return s
    raise ValueError(s)


def _positive_int(s: str) -> int:
    s = s.strip()
    if not s.isdigit() or len(s) > 8 or not 1 <= int(s) <= MAX_WORLD:
        raise ValueError(s)
    return int(s)


def _scale(s: str) -> float:
    k = float(s)
    if not SCALES[0] <= k <= SCALES[1]:  # also refuses nan and inf
        raise ValueError(s)
    return k


@click.command("forecast", short_help="The peak on more ranks, another strategy or batch.",
               epilog="""\b
Examples:
  snapforensics forecast runs/a/rank0.pickle --world-size 4,8,64,512
  snapforensics forecast runs/a/rank0.pickle --capacity 80GiB \\
      --strategy full_shard,hsdp:8 --checkpointing none,full \\
      --micro-batch-scale 0.5,2

\b
Model: each block scales by what made it: sharded state 1/W (with FSDP's
padding), unsharded parameters and collective buffers the unit size,
activations x micro-batch, the rest constant; strategy and checkpointing move
when blocks are freed and made again, per FSDP unit; the trace is replayed, so
the peak may move to another phase. Allocated bytes only: add the caching
allocator's headroom (reserved - allocated in `diagnose`) on CUDA.

\b
Error band: every scenario shows the error measured on recorded pairs (the
bundled example recorded twice on CPU with one setting changed: world size
2<->4 and 2<->8, full_shard<->shard_grad_op, checkpointing with micro-batch, micro-batch
x2, a fix). "NOT VALIDATED" marks a scenario outside those pairs (world sizes
beyond 4x the recorded one, hsdp/no_shard, micro-batch beyond x1/4..x4, several
changes at once other than checkpointing with micro-batch or dp_shard with TP,
CUDA/NPU recordings); the lines under the table say why.

\b
Refused, with the reason: world size or strategy without FSDP in the trace or
with the recorded world size unknown; strategy or checkpointing without FSDP
unit boundaries; hsdp:R with R not dividing W. With --capacity: a
configuration whose recorded peak fits gets no advice; otherwise the cheapest
single change that fits (an anomaly's fix, full_shard, checkpointing full,
half the micro-batch).

\b
Tensor parallelism (--tp; a recording made by `snapforensics record`): what
TP splits scales by tp0 / tp, the rest stays. The recorder names each
DTensor's split (its placement on the mesh dim "tp") and the activations a
column-wise module hands to its row-wise one; FSDP's buffers of TP-split
parameters take the parameters' share; a block made where a named one was
(same stack and size) takes its share. Pairs: tp 2 <-> 4 with and without
SequenceParallel and under FSDP2 on a 2-D mesh, dp_shard 4 x TP 2 <-> 2 x 4, and
a Llama-like model (embeddings, head, loss_parallel) tp 2 <-> 4 and 2 <-> 8
(band printed per scenario); beyond 4x the recorded degree, and TP 1 from a
loss_parallel recording, are NOT VALIDATED.

\b
Pipeline (--pp, --microbatches, --schedule; SNAPSHOT a run folder of
one file per stage, or one stage's file): each stage's peak at another
number of stages, micro-batch count (same global batch) or schedule, the
worst stage named. The recorded step is cut into its micro-batches'
forwards and backwards (GPipe's own ranges, or the marks `snapforensics
record` opens around every schedule's) and rebuilt in the new order; what
belongs to the layers scales with the layers per stage (counted from the
recorder's tensor names). 56 recorded pairs (2 <-> 4 stages, 4 <-> 8
micro-batches, GPipe <-> 1F1B): -2.7%..+3.5% per stage; FSDP-sharded
stages (FSDP + PP), each unit's gathers replayed: -1.4%..+6.6%. An
interleaved schedule (--schedule interleaved:V, torch's
ScheduleInterleaved1F1B order, each of a rank's V stages rebuilt from the
recorded stage in its position, sends held to the step's end as torch's
looped runtime does): 24 pairs at V=2, -1.4%..+2.2%; with FSDP, 20 pairs,
-0.6%..+5.1%. With --world-size (the ranks FSDP shards a stage over): each
stage's shards scaled as above, then rebuilt; 64 pairs dp 2 <-> 4 across the
layouts, -1.5%..+6.9%, and 24 to interleaved, -0.7%..+2.7%. With --tp (TP
inside the stages): what TP splits scaled by tp0 / tp, then rebuilt; 88 pairs
tp 2 <-> 4, -3.5%..+1.5%; with FSDP sharding the stages too, 28 pairs tp 2 -> 1
(with dp_shard 2 -> 4 at once in 10), -1.2%..+3.7%. An interleaved recording is a
source too (each of a rank's stages its own, by its marks and the model's
layer names): 36 pairs, -3.3%..+3.5%; with FSDP (the looped runtime's
UNSHARD gathers replayed as the stage's own), 26 pairs, -6.1%..+6.6%. Stages
and micro-batches from 1 to 1024; a zero-bubble recording is refused.""")
@click.argument("snapshot", type=click.Path(path_type=Path))
@click.option("--world-size", help="World sizes to forecast, comma-separated (e.g. 4,8,64,512): "
                                   "the ranks FSDP shards over (dp_shard on a 2-D mesh).")
@click.option("--strategy", help="full_shard | shard_grad_op | no_shard | hsdp:R (R replicas), "
                                 "comma-separated.")
@click.option("--checkpointing", help="none | full, comma-separated.")
@click.option("--micro-batch-scale", help="Micro-batch size relative to the recorded one "
                                          "(e.g. 0.5,2).")
@click.option("--capacity", help="Device memory with its unit (80GiB = 80 x 2^30 bytes, 80GB = "
                                 "80 x 10^9; a bare number is refused): which scenarios fit, "
                                 "the smallest world size and the cheapest change that fit.")
@click.option("--tp", help="Tensor-parallel degrees to forecast, comma-separated (e.g. 1,2,4,8; "
                           "the data-parallel degree kept).")
@click.option("--pp", help="Pipeline stages to forecast, comma-separated (e.g. 2,4,8).")
@click.option("--microbatches", help="Micro-batch counts per step, comma-separated (the global "
                                     "batch kept).")
@click.option("--schedule", help="gpipe | 1f1b | interleaved[:V] (ScheduleInterleaved1F1B, V "
                                 "stages per rank, 2 when not given), comma-separated.")
@report_options("forecast")
def forecast_command(snapshot: Path, world_size, strategy, checkpointing, micro_batch_scale,
                     capacity, tp, pp, microbatches, schedule, fmt: str | None,
                     output: str | None) -> int:
    """Forecast the peak of the recorded run under other settings: world sizes, sharding
    strategies, activation checkpointing and micro-batch sizes, each block scaled by what made
    it and the trace replayed; with --capacity, which scenarios fit. A run with an anomaly is
    forecast as recorded and with the fix applied. Each scenario carries the error band
    measured on recorded pairs; model, band and limits below."""
    from snapforensics.analysis.forecast.capacity import parse_size
    from snapforensics.analysis.forecast.core import forecast
    from snapforensics.report.output import choose_format, emit
    from snapforensics.snapshot import load

    if pp or microbatches or schedule:
        mixed = [f"--{k}" for k, v in (("strategy", strategy), ("checkpointing", checkpointing),
                                       ("micro-batch-scale", micro_batch_scale),
                                       ("capacity", capacity)) if v]
        if mixed:  # the pipeline rebuild scales sizes (world size, TP), it moves no unit
            raise SnapError(f"{', '.join(mixed)} cannot go with --pp/--microbatches/--schedule "
                            "(the pipeline forecast changes the stages, micro-batches, schedule, "
                            "FSDP world size and TP degree): forecast them in two runs")
        return _pipeline(snapshot, pp, microbatches, schedule, world_size, tp, fmt, output)
    choose_format("forecast", fmt, output)  # a bad -o fails before the analysis
    cap = None
    if capacity:
        try:
            cap = parse_size(capacity)
        except (ValueError, OverflowError) as e:
            raise SnapError(f"--capacity: {str(e)[:120]}") from None
        if not 1 <= cap <= MAX_CAPACITY:
            raise SnapError(f"--capacity {capacity[:40]!r}: expected 1 B to 1 EiB")
    ckpt = _list(checkpointing, str.strip, "checkpointing")
    if any(c not in ("none", "full") for c in ckpt):
        raise SnapError(f"--checkpointing: expected none or full, got {checkpointing!r}")
    worlds = _list(world_size, _positive_int, "world-size")
    strategies = _list(strategy, _strategy, "strategy")
    scales = _list(micro_batch_scale, _scale, "micro-batch-scale")
    from snapforensics.snapshot.tensors import MAX_TP

    tps = _list(tp, _positive_int, "tp")
    if any(n > MAX_TP for n in tps):
        raise SnapError(f"--tp: expected {RANGES['tp']}")
    emit("forecast", forecast(load(snapshot), worlds, strategies, ckpt, scales, cap, tps=tps),
         fmt, output)
    return 0


def _schedule(s: str) -> str:
    from snapforensics.analysis.forecast.pipeline import parse_schedule

    parse_schedule(s)
    return s.strip().lower()


def _pipeline(snapshot: Path, pp, microbatches, schedule, world_size, tp, fmt, output) -> int:
    from snapforensics.report.output import choose_format, emit
    from snapforensics.runner import pipeline_forecast_paths

    choose_format("pipeline_forecast", fmt, output)
    stages = _list(pp, _positive_int, "pp")
    counts = _list(microbatches, _positive_int, "microbatches")
    schedules = _list(schedule, _schedule, "schedule")
    worlds = _list(world_size, _positive_int, "world-size")
    tps = _list(tp, _positive_int, "tp")
    doc = pipeline_forecast_paths([snapshot], stages, counts, schedules, str(snapshot),
                                  world_sizes=worlds, tps=tps)
    emit("pipeline_forecast", doc, fmt, output)
    return 0
