"""The finished diagnosis: plain data that every renderer reads and the JSON contract mirrors."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from snapforensics.analysis.vocab import Verdict

SCHEMA = "snapforensics.diagnosis/1"


@dataclass
class Finding:
    rule: str  # stable id, e.g. fsdp.unsharded_params_not_resharded
    verdict: Verdict
    title: str
    cause: str  # the root cause, in words
    bytes: int
    blocks: int
    device: int
    fix: str | None = None  # code
    predicted_peak_bytes: int | None = None
    saving_bytes: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class DeviceSummary:
    device: int
    peaks: dict[str, int]  # forward_bytes, backward_bytes, overall_bytes
    peak_row: int
    peak_phase: str
    iterations: list[dict[str, Any]]
    categories_at_peak: dict[str, int]
    categories_total: dict[str, dict[str, int]]
    top_stacks_at_peak: list[dict[str, Any]]
    history: dict[str, Any]
    segments: dict[str, int]
    # live bytes over the trace, downsampled keeping each bucket's max: [row, bytes, phase]
    timeline: list[list] = field(default_factory=list)


@dataclass
class Diagnosis:
    source: str
    rank: int | None
    format: dict[str, Any]
    provenance: dict[str, Any]
    warnings: list[str]
    devices: list[DeviceSummary]
    findings: list[Finding]
    tool: str = ""

    @property
    def primary(self) -> DeviceSummary | None:
        if not self.devices:
            return None
        return max(self.devices, key=lambda d: d.peaks["overall_bytes"])

    @property
    def peaks(self) -> dict[str, int]:
        p = self.primary
        return dict(p.peaks) if p else {"forward_bytes": 0, "backward_bytes": 0,
                                        "overall_bytes": 0}

    @property
    def anomalies(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict == Verdict.ANOMALOUS]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "tool": self.tool,
            "source": self.source,
            "rank": self.rank,
            "format": self.format,
            "provenance": self.provenance,
            "warnings": self.warnings,
            "peaks": self.peaks,
            "devices": [asdict(d) for d in self.devices],
            "findings": [asdict(f) for f in self.findings],
        }
