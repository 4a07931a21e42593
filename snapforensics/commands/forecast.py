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
        raise SnapError(f"--{what}: cannot read {text!r}") from None


def _strategy(s: str) -> str:
    s = s.strip().lower()
    if s in ("full_shard", "shard_grad_op", "no_shard") or (
            s.startswith("hsdp:") and s[5:].isdigit() and int(s[5:]) >= 1):
        return s
    raise ValueError(s)


def _positive_int(s: str) -> int:
    n = int(s)
    if n < 1:
        raise ValueError(s)
    return n


def _scale(s: str) -> float:
    k = float(s)
    if not k > 0:
        raise ValueError(s)
    return k


@click.command("forecast", short_help="The peak on more ranks, another strategy or batch.",
               epilog="""\b
Examples:
  snapforensics forecast runs/a/rank0.pickle --world-size 4,8,64,512
  snapforensics forecast runs/a/rank0.pickle --capacity 80GiB \\
      --strategy full_shard,hsdp:8 --checkpointing none,full \\
      --micro-batch-scale 0.5,2""")
@click.argument("snapshot", type=click.Path(path_type=Path))
@click.option("--world-size", help="World sizes to forecast, comma-separated (e.g. 4,8,64,512).")
@click.option("--strategy", help="full_shard | shard_grad_op | no_shard | hsdp:R (R replicas), "
                                 "comma-separated.")
@click.option("--checkpointing", help="none | full, comma-separated.")
@click.option("--micro-batch-scale", help="Micro-batch size relative to the recorded one "
                                          "(e.g. 0.5,2).")
@click.option("--capacity", help="Device memory (e.g. 80GiB): which scenarios fit, the "
                                 "smallest world size and the cheapest change that fit.")
@report_options("forecast")
def forecast_command(snapshot: Path, world_size, strategy, checkpointing, micro_batch_scale,
                     capacity, fmt: str | None, output: str | None) -> int:
    """Forecast the peak of the recorded run under other settings: world sizes, sharding
    strategies, activation checkpointing and micro-batch sizes, each block scaled by what made
    it and the trace replayed; with --capacity, which scenarios fit. A run with an anomaly is
    forecast as recorded and with the fix applied. Model and limits: docs/forecast.md in the
    project's repository."""
    from snapforensics.analysis.forecast import forecast, parse_size
    from snapforensics.report.output import choose_format, emit
    from snapforensics.snapshot import load

    choose_format("forecast", fmt, output)  # a bad -o fails before the analysis
    cap = None
    if capacity:
        try:
            cap = parse_size(capacity)
        except ValueError as e:
            raise SnapError(f"--capacity: {e}") from None
    ckpt = _list(checkpointing, str.strip, "checkpointing")
    if any(c not in ("none", "full") for c in ckpt):
        raise SnapError(f"--checkpointing: expected none or full, got {checkpointing!r}")
    worlds = _list(world_size, _positive_int, "world-size")
    strategies = _list(strategy, _strategy, "strategy")
    scales = _list(micro_batch_scale, _scale, "micro-batch-scale")
    emit("forecast", forecast(load(snapshot), worlds, strategies, ckpt, scales, cap), fmt, output)
    return 0
