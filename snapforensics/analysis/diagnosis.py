"""The finished diagnosis: plain data that every renderer reads and the JSON contract mirrors."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, NamedTuple

import numpy as np

from snapforensics.analysis.series import Series, panels
from snapforensics.analysis.vocab import Verdict

SCHEMA = "snapforensics.diagnosis/1"
INTERNAL = {"json": False}  # field metadata: kept for renderers and the API, not in the JSON
# the evidence every renderer shows as tables (`Finding.modules`, `Finding.stacks`), written by
# `evidence.by_module` and `evidence.top_stacks`; the rest of a finding's evidence is its own
MODULES, STACKS, TENSORS = "modules", "stacks", "tensors"


def public(obj: Any) -> dict[str, Any]:
    """A dataclass as JSON-ready data, without its INTERNAL fields. Like `dataclasses.asdict`
    (containers rebuilt, nested dataclasses converted) but leaves are shared, not deep-copied:
    the result is serialized, never mutated (asdict's copies were a third of a second on a
    2M-row trace's evidence)."""
    return {f.name: _data(getattr(obj, f.name)) for f in fields(obj)
            if f.metadata.get("json") is not False}


def _data(v: Any) -> Any:
    t = type(v)
    if t in _LEAVES:
        return v
    if is_dataclass(v) and not isinstance(v, type):
        return public(v)
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple, as asdict keeps it
        return t(*map(_data, v))
    if isinstance(v, (list, tuple)):
        return t(map(_data, v))
    if isinstance(v, dict):
        return t((_data(k), _data(x)) for k, x in v.items())
    return v


_LEAVES = {str, int, float, bool, type(None)}


class Replay(NamedTuple):
    """A fix as a counterfactual trace: blocks' moved rows (None: unchanged) and extra
    (start_row, end_row, bytes) intervals, as `Lifetimes.replay` takes them. `split`: the
    (start_row, end_row, bytes, tp) of blocks the fix leaves split over the recorded `tp` TP
    ranks (each in `extra` as -(bytes - bytes // tp)), which another TP degree splits its way
    (`at_tp`)."""

    free_row: np.ndarray | None = None
    alloc_row: np.ndarray | None = None
    extra: tuple = ()
    split: tuple = ()

    def at_tp(self, tp: int) -> tuple:
        """`extra` with the blocks in `split` split over `tp` ranks instead."""
        if not self.split:
            return self.extra
        recorded = Counter((a, e, -(b - b // t)) for a, e, b, t in self.split)
        out = []
        for x in self.extra:
            if recorded[x] > 0:
                recorded[x] -= 1
            else:
                out.append(x)
        return tuple(out) + tuple((a, e, -(b - b // tp)) for a, e, b, _ in self.split)


# evidence["prediction"] of a finding whose replay can only free sooner than the fix would (the
# file lacks what places the frees exactly): its predicted peak is a lower bound
LOWER_BOUND = "lower_bound"


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
    # the fix as a counterfactual trace (moved rows): the forecast applies it before its own
    # scenario, the plots draw the live bytes it replays to; not in the JSON
    replay: Replay | None = field(default=None, repr=False, compare=False, metadata=INTERNAL)
    # the indexes (into the device's Lifetimes) of the blocks it counts, where the rule names
    # them: the explorer highlights them; not in the JSON
    members: np.ndarray | None = field(default=None, repr=False, compare=False,
                                       metadata=INTERNAL)

    def to_dict(self) -> dict[str, Any]:
        return public(self)

    @classmethod
    def replayed(cls, anomalous: bool, *, fix: str | None, predicted: int | None,
                 saving: int | None, replay: Replay | None, **rest: Any) -> Finding:
        """A finding whose fix was replayed: `anomalous` (the rule's reading of the replay: it
        lowers this run's peak) gives the verdict, and only an anomaly carries the fix, the
        predicted peak, the saving and the replay; otherwise it is `info`."""
        if not anomalous:
            fix = predicted = saving = replay = None
        return cls(verdict=Verdict.ANOMALOUS if anomalous else Verdict.INFO, fix=fix,
                   predicted_peak_bytes=predicted, saving_bytes=saving, replay=replay, **rest)

    @property
    def modules(self) -> list[dict[str, Any]]:
        """Its blocks' bytes by module, largest first (`evidence.by_module`): may be empty."""
        return (self.evidence or {}).get(MODULES) or []

    @property
    def tensors(self) -> list[dict[str, Any]]:
        """The recorder's names of its largest blocks (`evidence.tensors`: tensor, kind, module,
        shape, dtype, bytes), where the file has names and the rule lists its blocks."""
        return (self.evidence or {}).get(TENSORS) or []

    @property
    def stacks(self) -> list[dict[str, Any]]:
        """Its representative stacks, most bytes first (`evidence.top_stacks`): may be empty."""
        return (self.evidence or {}).get(STACKS) or []


def saving_rank(f: Finding) -> tuple[int, int]:
    """What to fix first: the peak saving (what fixing it buys), then bytes (how big it is)."""
    return (f.saving_bytes or 0, f.bytes)


def top_anomaly(findings: list[Finding]) -> Finding | None:
    """The anomaly to fix first (the one the headline names)."""
    bad = [f for f in findings if f.verdict == Verdict.ANOMALOUS]
    return max(bad, key=saving_rank) if bad else None


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
    # which tensors the blocks are (analysis/identity.py): with the recorder's names, the named
    # bytes at the peak and what was saved for backward by layer; without, what frames and
    # record_function ranges say and the recipe that names the next dump
    tensors: dict[str, Any] = field(default_factory=dict)
    # the torch.compile regions that made blocks (analysis/compiled.py): per region its source,
    # forward and backward bytes at the peak; None when nothing ran compiled
    compiled: dict[str, Any] | None = None
    # the parallel dimensions its blocks show in use (analysis/mesh.py `shown`: tp, pp,
    # dp_shard), which the process groups may not name
    parallel_dims: list[str] = field(default_factory=list)
    # the timeline plot's series (analysis/timeline.py), for renderers; not part of the JSON,
    # in the document (`Diagnosis.to_doc`) for the devices a report draws
    plot: Series | None = field(default=None, repr=False, compare=False, metadata=INTERNAL)


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
    # the training framework and the user's layer as the run shows them
    # (analysis/frameworks/detect.py)
    framework: dict[str, Any] = field(default_factory=dict)

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

    @property
    def top(self) -> Finding | None:
        """The anomaly to fix first (the headline's): the largest saving, else the most bytes."""
        return top_anomaly(self.findings)

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
            "devices": [public(d) for d in self.devices],
            "findings": [public(f) for f in self.findings],
            "framework": self.framework,
        }

    def to_doc(self) -> dict[str, Any]:
        """The document every input's diagnosis travels as (from a worker process, to and
        from the cache): the JSON (`to_dict`) plus, on each device, `plot`: the series of the
        timeline plot (`Series.to_doc`) for the MAX_PANELS devices a report draws, else null.
        Bounded: at most MAX_PANELS series of at most POINTS points."""
        doc = self.to_dict()
        drawn = {id(s) for s in panels([d.plot for d in self.devices if d.plot is not None])}
        for dev, out in zip(self.devices, doc["devices"]):
            out["plot"] = (dev.plot.to_doc() if dev.plot is not None and id(dev.plot) in drawn
                           else None)
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Diagnosis:
        """The inverse of `to_dict` and `to_doc` (a worker's or the cache's document, with the
        plot series); fields this version does not know are ignored, so newer documents still
        load. ValueError for a plot series that is not one (`Series.from_doc`)."""
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document")
        return cls(source=doc["source"], rank=doc["rank"], format=doc["format"],
                   provenance=doc["provenance"], warnings=list(doc["warnings"]),
                   devices=[_device(x) for x in doc["devices"]],
                   findings=[_known(Finding, x) for x in doc["findings"]], tool=doc["tool"],
                   framework=dict(doc.get("framework") or {}))


def _device(d: dict[str, Any]) -> DeviceSummary:
    plot = d.get("plot")
    dev = _known(DeviceSummary, {k: v for k, v in d.items() if k != "plot"})
    dev.plot = None if plot is None else Series.from_doc(plot)
    return dev


def _known(cls, d: dict[str, Any]):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
