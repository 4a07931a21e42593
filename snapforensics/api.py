"""The Python API: load, diagnose, compare, and pandas DataFrames for notebooks.

    import snapforensics as sf
    d = sf.diagnose("runs/a/rank0.pickle", categories={"attention": r"attn|sdpa"})
    d.blocks            # one row per block (DataFrame)
    d.timeline          # one row per trace row
    d.findings          # one row per finding
    d.categories_at_peak
    d.stack(stack_id)   # the frames of a stack, innermost first
    d.diagnosis         # the plain Diagnosis every renderer reads; d.to_dict() is the JSON
    sf.compare(a, b)    # a Comparison; sf.forecast(path, world_sizes=[8, 64]) a Forecast

In a notebook each shows as its HTML report (report/notebook.py: readable under any theme).

DataFrames are built from the interned model's numpy arrays (strings as categoricals built
from codes), never from one Python object per row. pandas is imported on first use.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from snapforensics.analysis.compare import Comparison as _Comparison
from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.analysis.forecast.documents import Forecast as _Forecast
from snapforensics.analysis.stacks import is_noise
from snapforensics.snapshot.model import Frame, Snapshot

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["load", "diagnose", "compare", "forecast", "Report", "Comparison", "Forecast"]

# a frame in torch or any installed library is not the user's (recorded paths may be relative)
_LIBRARY = re.compile(r"(^|[\\/])(torch|site-packages|dist-packages|lib[\\/]python[\d.]*)[\\/]")


def load(path: str | Path) -> Snapshot:
    """Read a snapshot file (.pickle/.pkl, gzip'd too) into the interned model."""
    from snapforensics.snapshot import load as _load

    return _load(path)


def diagnose(source: str | Path | Snapshot,
             categories: Mapping[str, str | re.Pattern] | None = None) -> Report:
    """Diagnose a snapshot file or a loaded Snapshot. `categories`: user categories, name ->
    regex matched on stack frames (`function file:line`) and record_function range names;
    applied after the built-in classification (the rules see the built-in categories)."""
    from snapforensics.analysis.classify import user_categories
    from snapforensics.analysis.engine import diagnose_devices

    snap = source if isinstance(source, Snapshot) else load(source)
    diagnosis, analyses = diagnose_devices(snap, user_categories(categories))
    return Report(diagnosis, analyses, snap)


def compare(*inputs: str | Path | Snapshot | Report | Diagnosis, mode: str = "auto"
            ) -> Comparison:
    """Compare against the first input (before/after a fix, or the ranks of one run): paths
    (a run folder or glob stands for its rank files), Snapshots, Reports or Diagnoses."""
    paths = [x for x in inputs if isinstance(x, (str, Path))]
    if len(paths) == len(inputs):
        from snapforensics.runner import compare_paths

        return _shown(Comparison, compare_paths(paths, mode=mode))
    from snapforensics.analysis.compare import compare as _compare

    diags = [x.diagnosis if isinstance(x, Report) else x if isinstance(x, Diagnosis)
             else diagnose(x).diagnosis for x in inputs]
    return _shown(Comparison, _compare(diags, mode=mode))


def forecast(source: str | Path | Snapshot, world_sizes=(), strategies=(), checkpointing=(),
             micro_batch_scales=(), capacity: int | str | None = None, tps=()) -> Forecast:
    """The peak of the recorded run under other settings (`snapforensics forecast`): world
    sizes, strategies (full_shard, shard_grad_op, no_shard, hsdp:R), checkpointing (none,
    full), micro-batch scales, tensor-parallel degrees (`tps`); `capacity` in bytes or a size
    with its unit ("80GiB"). `.to_frame()` is one row per scenario."""
    from snapforensics.analysis.forecast.capacity import parse_size
    from snapforensics.analysis.forecast.core import forecast as _forecast

    snap = source if isinstance(source, Snapshot) else load(source)
    cap = parse_size(capacity) if isinstance(capacity, str) else capacity
    return _shown(Forecast, _forecast(snap, list(world_sizes), list(strategies),
                                      list(checkpointing), list(micro_batch_scales), cap,
                                      tps=list(tps)))


def pipeline_forecast(run: str | Path, stages=(), microbatches=(), schedules=(), world_sizes=(),
                      tps=()):
    """Each pipeline stage's peak at other stage counts, micro-batch counts, schedules, FSDP
    world sizes and TP degrees (`snapforensics forecast RUN --pp ... --microbatches ...
    --schedule ... --world-size ... --tp ...`), from a run folder of one file per stage; the
    worst stage named. `.to_frame()` is one row per scenario and stage."""
    from snapforensics.runner import pipeline_forecast_paths

    return pipeline_forecast_paths([run], list(stages), list(microbatches), list(schedules),
                                   str(run), list(world_sizes), list(tps))


def _shown(cls: type, doc: Any) -> Any:
    """`doc` as `cls`, its subclass that a notebook displays (same fields, same JSON)."""
    import dataclasses

    return cls(**{f.name: getattr(doc, f.name) for f in dataclasses.fields(doc)})


class Comparison(_Comparison):
    """A comparison (analysis.compare.Comparison) that a notebook shows as its HTML report and
    a console as one line."""

    def __repr__(self) -> str:
        from snapforensics.report.compare import headline

        return f"<snapforensics.Comparison {self.mode}: {headline(self)}>"

    def _repr_html_(self) -> str:
        from snapforensics.report import notebook

        return notebook.document("compare", self)


class Report:
    """One diagnosed snapshot: the Diagnosis (what the reports render, the JSON) plus the
    per-device analyses it was made from, as DataFrames."""

    def __init__(self, diagnosis: Diagnosis, analyses: list[DeviceAnalysis], snapshot: Snapshot):
        self.diagnosis = diagnosis
        self.analyses = analyses
        self.snapshot = snapshot

    # -- plain data
    @property
    def peaks(self) -> dict[str, int]:
        return self.diagnosis.peaks

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (`snapforensics.diagnosis/1`)."""
        return self.diagnosis.to_dict()

    def render(self, fmt: str = "markdown") -> str:
        """The report as text: terminal, markdown, json or html."""
        from snapforensics.report import render_text

        return render_text(self.diagnosis, fmt)

    def stack(self, stack_id: int) -> list[Frame]:
        """Frames of a stack (the `stack_id` column), innermost first; [] for -1 (none)."""
        return self.snapshot.stack_frames(int(stack_id))

    # -- DataFrames
    @cached_property
    def findings(self) -> pd.DataFrame:
        import pandas as pd

        cols = ("rule", "verdict", "title", "device", "bytes", "blocks",
                "predicted_peak_bytes", "saving_bytes", "fix", "cause")
        rows = [[getattr(f, c) for c in cols] for f in self.diagnosis.findings]
        df = pd.DataFrame(rows, columns=list(cols))
        for c in ("predicted_peak_bytes", "saving_bytes"):
            df[c] = df[c].astype("Int64")
        return df

    @cached_property
    def blocks(self) -> pd.DataFrame:
        """One row per block: where, how big, when it was allocated and freed (row and
        microseconds; alloc_row -1 = alive before the first row, free_row -1 = alive at dump),
        phase and iteration of its allocation, what made it, its FSDP unit, its stack; and,
        in recordings with the recorder's names (analysis/identity.py), which tensor it is:
        `tensor` (`layers.3.mlp.w1.weight`, `.grad`, `.exp_avg`; several names, comma
        separated, for a buffer holding several views), `tensor_kind`, `module` (the module
        that owns the parameter, or that saved the tensor for backward), `shape`, `dtype`,
        `saved_for_backward`, `tp_split` (how many ways tensor parallelism splits it: 1
        replicated, 0 not known); None / False / 0 where unnamed or the file has no names. In runs
        with torch.compile (analysis/compiled.py): `compiled_region`, the compile id (`F/C`)
        of the graph that made the block ("?" for a compiled backward no forward claims),
        `compiled_pass` (`forward`: the region's graph, `backward`: its compiled backward) and
        `compiled_source` (the user's function Dynamo compiled); None for eager blocks. With
        Inductor under the recorder (its map of the generated code): `compiled_buffer`, the
        generated buffer (`buf3`) and `compiled_line`, the model source line its node came
        from (`forward  model.py:57: h = F.gelu(self.fc1(x))`)."""
        import pandas as pd

        from snapforensics.analysis.vocab import PHASE_LABELS

        parts = []
        for d in self.analyses:
            lt, t = d.lt, d.trace.time_us
            alive = lt.free_row >= lt.rows
            units = [i.module for i in d.infos]
            unit_names = sorted({u for u in units if u})
            unit_code = np.array([unit_names.index(u) if u else -1 for u in units],
                                 np.int32)[d.info] if len(d.info) else np.zeros(0, np.int32)
            frame_names, frame_code = self._top_frames(lt.stack)
            parts.append(pd.DataFrame({
                "device": np.full(len(lt), d.device, np.int32),
                "address": lt.addr,
                "size": lt.size,
                "alloc_row": lt.alloc_row,
                "free_row": np.where(alive, -1, lt.free_row),
                "alloc_time_us": _times(t, lt.alloc_row),
                "free_time_us": _times(t, np.where(alive, -1, lt.free_row)),
                "phase": pd.Categorical.from_codes(d.phase.astype(np.int64), PHASE_LABELS),
                "iteration": d.iteration,
                "category": pd.Categorical.from_codes(d.category.astype(np.int64),
                                                      [str(c) for c in d.category_names]),
                "fsdp_unit": pd.Categorical.from_codes(unit_code, unit_names),
                "stack_id": lt.stack,
                "top_frame": pd.Categorical.from_codes(frame_code, frame_names),
                **_identity_columns(d),
                **_compiled_columns(d),
            }))
        return _concat(parts)

    @cached_property
    def timeline(self) -> pd.DataFrame:
        """One row per trace row: its time (`time_s`: seconds since the device's first row,
        the plot's x axis; `time_us`: the file's own clock, epoch microseconds; NaN where the
        file has no times), live bytes right after it, reserved bytes (NaN without a caching
        allocator or when the dump cannot anchor them), phase and iteration."""
        import pandas as pd

        from snapforensics.analysis.vocab import PHASE_LABELS
        parts = []
        for d in self.analyses:
            res = d.allocator.reserved if self.snapshot.kind.caching_allocator else None
            n = d.lt.rows
            parts.append(pd.DataFrame({
                "device": np.full(n, d.device, np.int32),
                "row": np.arange(n, dtype=np.int64),
                "time_us": d.trace.time_us,
                "time_s": _seconds(d.trace.time_us, n),
                "live_bytes": d.lt.live,
                "reserved_bytes": res.astype(np.float64) if res is not None
                else np.full(n, np.nan),
                "phase": pd.Categorical.from_codes(d.tl.phase.astype(np.int64), PHASE_LABELS),
                "iteration": d.tl.iteration,
            }))
        return _concat(parts)

    @cached_property
    def categories_at_peak(self) -> pd.DataFrame:
        """Bytes alive at each device's peak by what made them, largest first."""
        import pandas as pd

        rows = [(dev.device, c, b, b / (sum(dev.categories_at_peak.values()) or 1))
                for dev in self.diagnosis.devices for c, b in dev.categories_at_peak.items()]
        df = pd.DataFrame(rows, columns=["device", "category", "bytes", "share"])
        return df.sort_values(["device", "bytes"], ascending=[True, False], ignore_index=True)

    def _top_frames(self, stacks: np.ndarray) -> tuple[list[str], np.ndarray]:
        """The innermost user frame (not torch, not a library, not noise) of each block's stack,
        computed once per distinct stack."""
        uniq, inv = np.unique(stacks, return_inverse=True)
        names: dict[str, int] = {}
        codes = np.full(len(uniq), -1, np.int32)
        for i, s in enumerate(uniq.tolist()):
            frames = [f for f in self.snapshot.stack_frames(s) if not is_noise(f)]
            user = next((f for f in frames if not f.filename.startswith("<")
                         and not _LIBRARY.search(f.filename)), None)
            f = user or (frames[0] if frames else None)
            if f is not None:
                codes[i] = names.setdefault(str(f), len(names))
        return list(names), codes[inv] if len(stacks) else np.zeros(0, np.int32)

    # -- display
    def __repr__(self) -> str:
        from snapforensics.report.common import headline, human

        d = self.diagnosis
        return (f"<snapforensics.Report {d.source!r}: peak {human(d.peaks['overall_bytes'])}, "
                f"{len(d.findings)} findings; {headline(d)}>")

    def _repr_html_(self) -> str:
        from snapforensics.report import notebook

        return notebook.diagnosis(self.diagnosis)


def _identity_columns(d: DeviceAnalysis) -> dict[str, Any]:
    """tensor, tensor_kind, module, shape, dtype, saved_for_backward, tp_split per block
    (object columns: None where unnamed)."""
    n = len(d.lt)
    names = d.names
    cols: dict[str, Any] = {c: np.full(n, None, object) for c in
                            ("tensor", "tensor_kind", "module", "shape", "dtype")}
    cols["saved_for_backward"] = np.zeros(n, bool) if names is None else names.saved.copy()
    cols["tp_split"] = np.zeros(n, np.int32) if names is None else names.tp.copy()
    if names is None:
        return cols
    for b in np.flatnonzero(names.ident >= 0).tolist():
        i = names.identity(b)
        assert i is not None
        cols["tensor"][b] = names.tensor(b)
        cols["tensor_kind"][b] = i.kind
        cols["module"][b] = names.module(b)
        cols["shape"][b] = i.shape
        cols["dtype"][b] = i.dtype
    return cols


def _compiled_columns(d: DeviceAnalysis) -> dict[str, Any]:
    """compiled_region, compiled_pass, compiled_source, compiled_buffer, compiled_line per
    block (categoricals, None where eager or not known)."""
    import pandas as pd

    c = d.compiled
    n = len(d.lt)
    none = np.full(n, -1, np.int32)
    if c is None:
        return {k: pd.Categorical.from_codes(none, []) for k in
                ("compiled_region", "compiled_pass", "compiled_source", "compiled_buffer",
                 "compiled_line")}
    sources = sorted({s for s in c.source if s})
    src = np.array([sources.index(s) if s else -1 for s in c.source] + [-1], np.int32)
    has = len(c.buffer) == n
    return {"compiled_region": pd.Categorical.from_codes(c.region, c.regions),
            "compiled_pass": pd.Categorical.from_codes(
                np.where(c.region < 0, -1, c.backward.astype(np.int32)), ["forward", "backward"]),
            "compiled_source": pd.Categorical.from_codes(src[c.region], sources),
            "compiled_buffer": pd.Categorical.from_codes(c.buffer if has else none, c.buffers),
            "compiled_line": pd.Categorical.from_codes(c.line if has else none, c.lines)}


def _seconds(t: np.ndarray, n: int) -> np.ndarray:
    """Seconds since the first row (as the plot's x axis), NaN when the file has no times."""
    t = np.asarray(t, np.float64)
    if len(t) != n or not n or not np.isfinite(t).all() or float(t.max() - t.min()) <= 0:
        return np.full(n, np.nan)
    return (t - t[0]) / 1e6


def _times(t: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Microseconds of each row, NaN for -1 (no such row) or where the file has no time."""
    out = np.full(len(rows), np.nan)
    ok = rows >= 0
    out[ok] = t[rows[ok]] if len(t) else np.nan
    return out


def _concat(parts: list) -> pd.DataFrame:
    import pandas as pd

    if len(parts) == 1:
        return parts[0]
    if not parts:
        return pd.DataFrame()
    # per-device categoricals may differ: union them so the dtype stays categorical
    from pandas.api.types import union_categoricals

    cat_cols = [c for c in parts[0].columns if isinstance(parts[0][c].dtype, pd.CategoricalDtype)]
    # a device with no names has empty categories of another dtype (float): union as objects
    merged = {c: union_categoricals([p[c].cat.set_categories(p[c].cat.categories.astype(object))
                                     for p in parts]) for c in cat_cols}
    df = pd.concat([p.drop(columns=cat_cols) for p in parts], ignore_index=True)
    for c in cat_cols:
        df[c] = merged[c]
    return df[parts[0].columns]



class Forecast(_Forecast):
    """A forecast (analysis.forecast_documents.Forecast) that a notebook shows as its HTML report
    and a console as one line."""

    def __repr__(self) -> str:
        from snapforensics.report.common import human

        return (f"<snapforensics.Forecast {self.source!r}: {len(self.scenarios)} scenarios "
                f"from a recorded peak of {human(self.baseline.get('peak_bytes', 0))}>")

    def _repr_html_(self) -> str:
        from snapforensics.report import notebook

        return notebook.document("forecast", self)
