"""The normalized, interned snapshot model every analysis reads.

The loader (`unpickle.py` -> `normalization.py`) is the only code that sees the raw pickle.
Everything after it sees: frames interned once into a table, stacks as tuples of frame ids
interned into a table, and each device's trace as parallel numpy arrays (one row per trace
entry, oldest first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from snapforensics._compat import StrEnum
from snapforensics.snapshot.graph_code import GraphCode
from snapforensics.snapshot.tensors import TensorTable

# Trace actions, as small integer codes. Order is part of no contract; use the names.
ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
    "user_defined",
    "annotate",
    "workspace_snapshot",
    "other",
)
A = {name: code for code, name in enumerate(ACTIONS)}
ALLOC, FREE_REQUESTED, FREE_COMPLETED = A["alloc"], A["free_requested"], A["free_completed"]
SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP = (
    A["segment_alloc"], A["segment_free"], A["segment_map"], A["segment_unmap"])
OOM = A["oom"]
NO_STACK = -1


class Backend(StrEnum):
    CUDA = "cuda"
    NPU = "npu"
    CPU = "cpu"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Format:
    """What kind of recording this is, decided once by the loader; analyses read only this."""

    backend: Backend = Backend.UNKNOWN
    caching_allocator: bool = True  # False on CPU recordings: no segments, no fragmentation
    expandable_segments: bool = False
    cpu_recorded: bool = False  # profiler allocator events written in the snapshot format

    @property
    def alloc_conf_var(self) -> str:
        return "PYTORCH_NPU_ALLOC_CONF" if self.backend == Backend.NPU else \
            "PYTORCH_CUDA_ALLOC_CONF"

    @property
    def device_name(self) -> str:
        """The torch device type to name in fix snippets."""
        return self.backend.value if self.backend != Backend.UNKNOWN else "cuda"


class Frame(NamedTuple):
    filename: str
    line: int
    name: str

    def __str__(self) -> str:
        if self.filename.startswith("<") and self.line == 0:
            return f"{self.name}  [{self.filename.strip('<>')}]"
        return f"{self.name}  {self.filename}:{self.line}"


@dataclass
class Trace:
    """One device's ring buffer of trace entries as arrays (row i = entry i, oldest first)."""

    device: int
    action: np.ndarray  # int8 codes into ACTIONS
    addr: np.ndarray  # uint64
    size: np.ndarray  # int64, bytes
    stream: np.ndarray  # int32 ids into Snapshot.streams
    time_us: np.ndarray  # float64, NaN where the file has no time
    stack: np.ndarray  # int32 ids into Snapshot.stacks, NO_STACK when the entry had no frames
    device_free: dict[int, int] = field(default_factory=dict)  # row -> bytes free (oom rows)
    # row -> the torch.compile region the entry happened in ("Torch-Compiled Region: F/C", the
    # entry's `compile_context`); rows outside every compiled region (c10's "N/A") are absent
    compile_context: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.action)

    @classmethod
    def empty(cls, device: int) -> Trace:
        """A device with segments but no history."""
        z = np.zeros(0, np.int64)
        return cls(device, z.astype(np.int8), z.astype(np.uint64), z, z.astype(np.int32),
                   z.astype(np.float64), z.astype(np.int32), {})


@dataclass
class Block:
    address: int
    size: int
    requested_size: int
    state: str  # active_allocated | active_pending_free | inactive
    stack: int


@dataclass
class Segment:
    device: int
    address: int
    total_size: int
    allocated_size: int
    active_size: int
    requested_size: int
    stream: int
    segment_type: str
    pool_id: tuple
    is_expandable: bool
    stack: int
    blocks: list[Block]


@dataclass
class Annotation:
    """A record_function range edge, placed in its device's trace.

    `row` is the index of the first trace row that happens after it (so rows >= row are
    inside a START and rows < row are before it).
    """

    device: int
    stage: str  # START | END
    name: str
    time_us: float
    row: int


@dataclass
class Snapshot:
    source: str
    frames: list[Frame]
    stacks: list[tuple[int, ...]]  # frame ids, innermost first
    streams: list[int]
    traces: list[Trace]  # one per device list in the file (empty ones included)
    segments: list[Segment]
    annotations: list[Annotation]
    allocator_settings: dict
    provenance: dict  # the recorder's "snapforensics" block, {} for foreign files
    format: dict  # what the loader saw: era, backend (+ backend_evidence), entries, quirks
    rank: int | None
    warnings: list[str]
    kind: Format = field(default_factory=Format)  # typed: what analyses branch on
    # the recorder's tensor names (snapshot/tensors.py), None when the file has none
    tensors: TensorTable | None = None
    # the recorder's map of Inductor's generated code to the model (snapshot/graph_code.py)
    graph_code: GraphCode | None = None

    @property
    def active_traces(self) -> list[Trace]:
        return [t for t in self.traces if len(t)]

    @property
    def devices(self) -> list[int]:
        found = {t.device for t in self.traces if len(t)} | {s.device for s in self.segments}
        return sorted(found)

    @cached_property
    def _segments_by_device(self) -> dict[int, list[Segment]]:
        by: dict[int, list[Segment]] = {}
        for s in self.segments:
            by.setdefault(s.device, []).append(s)
        return by

    def segments_on(self, device: int) -> list[Segment]:
        """The segments of one device (grouped once: files may list 65,536 devices)."""
        return self._segments_by_device.get(device, [])

    def segment_totals(self, device: int) -> dict[str, int]:
        """What the allocator held on `device` at dump time."""
        segs = self.segments_on(device)
        live = [b.size for s in segs for b in s.blocks if b.state != "inactive"]
        return {"count": len(segs), "reserved_bytes": sum(s.total_size for s in segs),
                "allocated_bytes": sum(live), "active_blocks": len(live)}

    def stack_frames(self, stack_id: int) -> list[Frame]:
        if stack_id < 0:
            return []
        return [self.frames[f] for f in self.stacks[stack_id]]

    @property
    def backend(self) -> Backend:
        return self.kind.backend
