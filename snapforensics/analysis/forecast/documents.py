"""What a forecast takes and gives: a `Scenario` (world size, sharding strategy, checkpointing,
micro-batch scale, a fix), one `Prediction` per scenario and the `Forecast` document (its JSON
dict and its DataFrame); `Refused` when the recording cannot support a scenario.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA = "snapforensics.forecast/1"
FULL_SHARD, SHARD_GRAD_OP, NO_SHARD = "full_shard", "shard_grad_op", "no_shard"
STRATEGIES = (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)  # and "hsdp:R"
NONE, FULL = "none", "full"


class Refused(Exception):
    """A scenario this recording cannot support; the message says why."""


@dataclass(frozen=True)
class Scenario:
    world_size: int
    strategy: str = FULL_SHARD
    checkpointing: str = NONE
    micro_batch_scale: float = 1.0
    fix: str | None = None  # anomalous rule whose fix is applied first
    tp: int | None = None  # tensor-parallel degree (None: not a TP recording)

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
                "fix_applied": sc.fix, "tp": sc.tp,
                "predicted_peak_bytes": self.predicted_peak_bytes,
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
