"""Pipeline forecast: each stage's peak at another pipeline degree, micro-batch count and
schedule, from recordings of the stages (one file per stage, or one stage standing for all).

The model. A pipeline step on one stage is a sequence of operations, `F k` (micro-batch k's
forward: its `Forward k` range to the next one's) and `B k` (its `Backward k` range), between
what was alive when the step began (parameters, optimizer state, the batch) and what runs after
its last backward (the optimizer). The schedule only chooses their order on stage s of S with M
micro-batches: GPipe runs every F before any B; 1F1B runs min(M, S - s) F first, then one B
before each further F (torch's `Schedule1F1B._step_microbatches`). So the recorded step is cut
into its operations and the trace rebuilt in the new order, each block keeping its offset in
the operation that made it and in the one that frees it:

- a block made in `F k` and freed in `B k` (what micro-batch k saved for its backward) is made
  and freed by the same micro-batch's operations in the new order; one made in an operation and
  freed in a later one of the same kind moves with that distance (a send waited on at the next
  forward);
- a block made in `B k` and freed after the last backward but before the optimizer (a gradient
  send GPipe waits on only at the end) is freed after the next backward under 1F1B, where it is
  waited on (the pipeline rule's replay);
- a block alive from before the step or freed after it (parameters, their gradients, made in
  the first backward and accumulated in place) keeps its place.

Sizes. Another micro-batch count with the same global batch scales what the operations make
(activations, sends, receive buffers) by M / M'; the parameters' gradients (made in a backward,
alive into the optimizer) do not. Another pipeline degree S' puts L / S' of the model's L layers
on a stage, and (L / S') / (layers recorded on the stage) scales what belongs to the layers: the
parameters of numbered layers, their gradients and optimizer state, and what a forward saves
for its micro-batch's backward. What lives and dies inside one operation does not (one layer's
temporaries: their maximum does not grow with the layers), nor what crosses the stage's boundary
(sends, receive buffers, the outputs kept for the step), nor parameters outside the numbered
layers (embeddings, the head). The layer count is read from the recorder's tensor names
(`layers.3.mlp.w1.weight` -> layer `layers.3`); a file without names forecasts other
micro-batch counts and schedules but refuses another degree. Stage s' of S' is forecast from
the recorded stage in the same position: the first from the first, the last from the last, a
middle one from a recorded middle stage, else from the last (it receives activations as a
middle stage does).

What is not modelled, and refused or noted: interleaved and zero-bubble schedules (several
stages per rank), a source recording whose micro-batch operations the trace does not delimit
(only GPipe opens ranges around them in torch 2.x), layers that do not split evenly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.identity import layer_of
from snapforensics.analysis.mesh import mesh
from snapforensics.analysis.rules import pipeline_schedule as ps
from snapforensics.analysis.vocab import Phase

SCHEMA = "snapforensics.pipeline_forecast/1"
GPIPE, ONE_F_ONE_B = "gpipe", "1f1b"
SCHEDULES = (GPIPE, ONE_F_ONE_B)


@dataclass(frozen=True)
class PipeScenario:
    stages: int
    microbatches: int
    schedule: str


@dataclass
class StageSource:
    """One recorded stage, cut into its step's operations."""

    d: DeviceAnalysis
    stage: int | None
    stages: int | None
    microbatches: int
    schedule: str
    layers: int | None  # numbered layers whose parameters this stage holds
    ops: dict[tuple[str, int], tuple[int, int]]  # (F|B, k) -> rows [r0, r1)
    start: int  # the step's first row
    end: int  # the row after its last backward
    stop: int  # where the step's rows end (the next step's start, or the trace's end)
    layer_params: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


@dataclass
class StagePrediction:
    stage: int
    source_stage: int | None
    layers: int | None
    held: int  # micro-batches whose activations the stage holds at most
    predicted_peak_bytes: int | None = None
    refused: str | None = None

    def to_dict(self) -> dict:
        return {"stage": self.stage, "source_stage": self.source_stage, "layers": self.layers,
                "held_microbatches": self.held, "predicted_peak_bytes": self.predicted_peak_bytes,
                "refused": self.refused}


def _layer_params(d: DeviceAnalysis) -> tuple[int | None, np.ndarray]:
    """Numbered layers among the stage's parameters (tensor names), and which blocks are
    parameters of one (or their gradients and optimizer state: they scale with the layers)."""
    mask = np.zeros(len(d.lt), bool)
    names = d.names
    if names is None:
        return None, mask
    layers = set()
    for b in np.flatnonzero(names.ident >= 0).tolist():
        ident = names.identity(b)
        if ident is None or ident.kind not in ("parameter", "gradient", "optimizer_state"):
            continue
        layer = layer_of(ident.module)
        if any(s.isdigit() for s in layer.split(".")):
            mask[b] = True
            if ident.kind == "parameter":
                layers.add(layer)
    return (len(layers) or None), mask


def source(d: DeviceAnalysis) -> StageSource | str:
    """The stage recorded in `d`, cut into operations; or why it cannot be."""
    counted = [(ps._all_forward_first(s), s) for s in ps._steps(d)]
    full = [(m, s) for m, s in counted if m]
    if not full:
        return ("the trace does not delimit the micro-batches' forwards and backwards (torch's "
                "ScheduleGPipe opens `Forward i` / `Backward i` ranges; record a GPipe step)")
    # the step holding the peak, else the last one
    m, step = full[-1]
    for mm, s in full:
        if s[("Forward", 0)][0] <= d.peak_row <= s[("Backward", mm - 1)][1]:
            m, step = mm, s
    ops = {}
    for k in range(m):
        ops[("F", k)] = ps._made_in_forward(step, k, m)
        nxt = step[("Backward", k + 1)][0] if k + 1 < m else step[("Backward", k)][1]
        ops[("B", k)] = (step[("Backward", k)][0], nxt)
    start, end = ops[("F", 0)][0], ops[("B", m - 1)][1]
    later = [s[("Forward", 0)][0] for _, s in full if s[("Forward", 0)][0] > end]
    stop = min(later) if later else d.lt.rows
    layout = mesh(d.snapshot.provenance)
    stage, stages = layout.index("pp"), layout.degree("pp")
    layers, lp = _layer_params(d)
    return StageSource(d, stage if type(stage) is int else None,
                       stages if type(stages) is int else None, m, GPIPE, layers, ops,
                       start, end, stop, lp)


def order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """The operations of stage `stage` of `stages` over `m` micro-batches, in run order."""
    if schedule == GPIPE:
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    w = min(m, stages - stage)
    out = [("F", k) for k in range(w)]
    for k in range(m):
        out.append(("B", k))
        if w + k < m:
            out.append(("F", w + k))
    return out


def _template(k: int, m_new: int, m_rec: int) -> int:
    """The recorded micro-batch standing for new micro-batch k: itself, the last for the last
    (its backward is the step's last), a middle one for those beyond the recorded count."""
    if k == m_new - 1:
        return m_rec - 1
    return min(k, max(m_rec - 2, 0))


@dataclass
class Rebuilt:
    """The rebuilt step: one row per block instance (a block of a micro-batch's operation once
    per new micro-batch it stands for), its source block, rows and size; -1 = alive from the
    start."""

    rows: int
    block: np.ndarray
    alloc: np.ndarray
    free: np.ndarray
    size: np.ndarray

    def live(self) -> np.ndarray:
        delta = np.zeros(self.rows + 2, np.float64)
        np.add.at(delta, np.maximum(self.alloc, 0), self.size)
        np.add.at(delta, np.minimum(self.free, self.rows), -self.size)
        return np.cumsum(delta[:self.rows])

    def peak(self) -> tuple[int, int]:
        live = self.live()
        if not self.rows:
            return int(round(float(self.size[self.alloc < 0].sum()))), -1
        row = int(np.argmax(live))
        return int(round(float(live[row]))), row


def rebuild(src: StageSource, sc: PipeScenario, stage: int, layer_ratio: float) -> Rebuilt:
    """The step of stage `stage` under `sc`, rebuilt from the recorded one (module docstring),
    with what runs after its last backward until the next step."""
    d, lt = src.d, src.d.lt
    seq = order(sc.schedule, stage, sc.stages, sc.microbatches)
    # each new operation's recorded template and the offset of its rows in the new trace
    tmpl = {x: (x[0], _template(x[1], sc.microbatches, src.microbatches)) for x in seq}
    offsets: dict[tuple[str, int], int] = {}
    pos = 0
    for x in seq:
        r0, r1 = src.ops[tmpl[x]]
        offsets[x] = pos - r0
        pos += r1 - r0
    tail = pos - src.end  # rows after the last backward keep their distance from it
    rows = pos + (src.stop - src.end)
    keys = list(src.ops)
    op_of = np.full(lt.rows + 1, -1, np.int64)
    for i, key in enumerate(keys):
        op_of[src.ops[key][0]:src.ops[key][1]] = i
    a, f, size = lt.alloc_row, lt.free_row, lt.size.astype(np.float64)
    born_in = np.where((a >= 0) & (a < lt.rows), op_of[np.clip(a, 0, lt.rows)], -1)
    dies_in = np.where(f < lt.rows, op_of[np.clip(f, 0, lt.rows)], -1)
    scale_mb = src.microbatches / sc.microbatches
    freed_phase = d.tl.phase[np.clip(f, 0, max(lt.rows - 1, 0))]
    blocks: list[int] = []
    allocs: list[int] = []
    frees: list[int] = []
    sizes: list[float] = []

    def add(b: int, ar: int, fr: int, sz: float) -> None:
        blocks.append(b)
        allocs.append(ar)
        frees.append(max(fr, ar + 1))
        sizes.append(sz)

    def after(b: int) -> int:  # a free after the last backward: its place after the step
        return int(f[b]) + tail if f[b] < src.stop else rows

    # alive when the step begins: parameters and their state scale with the layers; what is
    # freed inside the step (the batch's chunks) goes where its operation now runs
    for b in np.flatnonzero((a < src.start) & (f > src.start)).tolist():
        sz = size[b] * (layer_ratio if src.layer_params[b] else 1.0)
        if f[b] >= src.end:
            add(b, -1, after(b), sz)
            continue
        runs = [x for x in seq if tmpl[x] == keys[dies_in[b]]]
        add(b, -1, int(f[b]) + offsets[runs[0]] if runs else rows, sz)
    # made inside the step, once per new operation its own stands for
    m_new, last = sc.microbatches, src.microbatches - 1
    for b in np.flatnonzero(born_in >= 0).tolist():
        kind, k = keys[born_in[b]]
        freed = keys[dies_in[b]] if dies_in[b] >= 0 else None
        # a parameter's gradient: made in a backward, kept into the optimizer
        to_optimizer = kind == "B" and freed is None and (
            f[b] >= src.stop or freed_phase[b] == Phase.OPTIMIZER)
        # a send GPipe waits on only when every operation of its kind has run: made in one
        # forward and freed in the last, or made in a backward and freed after the last
        waited = (freed == (kind, last) and k < last and kind == "F") or \
            (freed is None and not to_optimizer and kind == "B")
        # per layer of the stage: what a forward saves for its micro-batch's backward and the
        # parameters' gradients (one per parameter, not per micro-batch); not: what lives and
        # dies inside one operation (one layer's temporaries: their maximum does not grow with
        # the layers) and what crosses the stage's boundary (sends, receive buffers, outputs)
        per_layer = to_optimizer or (kind == "F" and freed == ("B", k))
        sz = size[b] * (layer_ratio if per_layer else 1.0) * (1.0 if to_optimizer else scale_mb)
        for inst in [x for x in seq if tmpl[x] == (kind, k)]:
            ar = int(a[b]) + offsets[inst]
            nxt = (kind, inst[1] + 1)
            if waited and sc.schedule == ONE_F_ONE_B and nxt in offsets:
                fr = src.ops[tmpl[nxt]][1] + offsets[nxt]  # waited on at the next one
            elif waited and kind == "F":  # after the last forward, where it was
                fr = int(f[b]) + offsets[("F", m_new - 1)]
            elif freed is not None and not waited:
                target = (freed[0], inst[1] + freed[1] - k)
                if target in offsets:  # the same distance in the new order
                    r0t, r1t = src.ops[tmpl[target]]
                    fr = offsets[target] + min(r0t + int(f[b]) - src.ops[freed][0], r1t)
                else:  # its freeing operation has no instance: freed where its own op ends
                    fr = src.ops[(kind, k)][1] + offsets[inst]
            else:
                fr = after(b)
            add(b, ar, fr, sz)
    # made after the last backward (the optimizer's temporaries scale with the layers)
    for b in np.flatnonzero((a >= src.end) & (a < src.stop)).tolist():
        opt = d.tl.phase[a[b]] == Phase.OPTIMIZER
        add(b, int(a[b]) + tail, after(b), size[b] * (layer_ratio if opt else 1.0))
    return Rebuilt(rows, np.array(blocks, np.int64), np.array(allocs, np.int64),
                   np.array(frees, np.int64), np.array(sizes, np.float64))


def predict(srcs: list[StageSource], sc: PipeScenario) -> list[StagePrediction]:
    """Each stage of `sc` forecast from the recorded stage in its position."""
    by_stage = {s.stage: s for s in srcs if s.stage is not None}
    rec_stages = srcs[0].stages
    out = []
    for st in range(sc.stages):
        if by_stage and rec_stages:
            if st == 0:
                pick = by_stage.get(0)
            elif st == sc.stages - 1:
                pick = by_stage.get(rec_stages - 1)
            else:
                pick = next((by_stage[i] for i in range(1, rec_stages - 1) if i in by_stage),
                            by_stage.get(rec_stages - 1))
            src = pick or srcs[0]
        else:
            src = srcs[0]
        held = min(sc.microbatches, sc.stages - st) if sc.schedule == ONE_F_ONE_B \
            else sc.microbatches
        p = StagePrediction(st, src.stage, None, held)
        ratio = 1.0
        if sc.stages != (src.stages or sc.stages):
            total = (src.layers or 0) * (src.stages or 0)
            if not src.layers:
                p.refused = ("the recording names no layers (record with `snapforensics "
                             "record` for tensor names): another pipeline degree is refused")
            elif total % sc.stages:
                p.refused = f"{total} layers do not split evenly over {sc.stages} stages"
            else:
                p.layers = total // sc.stages
                ratio = p.layers / src.layers
        else:
            p.layers = src.layers
        if p.refused is None:
            p.predicted_peak_bytes = rebuild(src, sc, st, ratio).peak()[0]
        out.append(p)
    return out


# The error band: each stage's forecast against the run recorded in that layout, from
# tests/test_forecast.py::test_pipeline_layout_forecast (the bundled pipeline example, 8 layers
# of dim 256, batch 32 x 64 tokens, recorded on CPU with gloo; each GPipe recording forecast to
# each other layout, every stage): (source, target, lowest error, highest error over stages).
PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8 gpipe", "S=2 M=4 gpipe", 0.0000, 0.0000),
    ("S=2 M=8 gpipe", "S=2 M=8 1f1b", 0.0000, 0.0296),
    ("S=2 M=8 gpipe", "S=2 M=4 1f1b", 0.0220, 0.0244),
    ("S=2 M=8 gpipe", "S=4 M=8 gpipe", 0.0023, 0.0234),
    ("S=2 M=8 gpipe", "S=4 M=4 gpipe", 0.0147, 0.0306),
    ("S=2 M=8 gpipe", "S=4 M=8 1f1b", -0.0045, 0.0365),
    ("S=2 M=8 gpipe", "S=4 M=4 1f1b", 0.0198, 0.0439),
    ("S=2 M=4 gpipe", "S=2 M=8 gpipe", -0.0000, 0.0000),
    ("S=2 M=4 gpipe", "S=2 M=8 1f1b", -0.0142, 0.0177),
    ("S=2 M=4 gpipe", "S=2 M=4 1f1b", 0.0000, 0.0081),
    ("S=2 M=4 gpipe", "S=4 M=8 gpipe", 0.0023, 0.0234),
    ("S=2 M=4 gpipe", "S=4 M=4 gpipe", 0.0147, 0.0306),
    ("S=2 M=4 gpipe", "S=4 M=8 1f1b", -0.0227, 0.0219),
    ("S=2 M=4 gpipe", "S=4 M=4 1f1b", -0.0066, 0.0306),
    ("S=4 M=8 gpipe", "S=2 M=8 gpipe", -0.0114, 0.0083),
    ("S=4 M=8 gpipe", "S=2 M=4 gpipe", -0.0112, 0.0055),
    ("S=4 M=8 gpipe", "S=2 M=8 1f1b", -0.0071, 0.0177),
    ("S=4 M=8 gpipe", "S=2 M=4 1f1b", 0.0081, 0.0110),
    ("S=4 M=8 gpipe", "S=4 M=4 gpipe", 0.0000, 0.0000),
    ("S=4 M=8 gpipe", "S=4 M=8 1f1b", 0.0000, 0.0454),
    ("S=4 M=8 gpipe", "S=4 M=4 1f1b", 0.0000, 0.0395),
    ("S=4 M=4 gpipe", "S=2 M=8 gpipe", -0.0114, 0.0083),
    ("S=4 M=4 gpipe", "S=2 M=4 gpipe", -0.0112, 0.0055),
    ("S=4 M=4 gpipe", "S=2 M=8 1f1b", -0.0213, 0.0059),
    ("S=4 M=4 gpipe", "S=2 M=4 1f1b", -0.0110, -0.0081),
    ("S=4 M=4 gpipe", "S=4 M=8 gpipe", -0.0001, 0.0000),
    ("S=4 M=4 gpipe", "S=4 M=8 1f1b", -0.0220, 0.0272),
    ("S=4 M=4 gpipe", "S=4 M=4 1f1b", 0.0000, 0.0132),
)
# what the pairs span: stage-count and micro-batch-count ratios (new / recorded)
STAGE_RATIOS = (0.5, 2.0)
MICROBATCH_RATIOS = (0.5, 2.0)
SOURCE = ("tests/test_forecast.py::test_pipeline_layout_forecast: the bundled pipeline example "
          "recorded on CPU (gloo) with GPipe at 2 and 4 stages, 4 and 8 micro-batches, each "
          "forecast to the other seven layouts (GPipe and 1F1B)")


def band(sc: PipeScenario, src: StageSource) -> dict:
    """The lowest and highest error measured on the pairs (one band: every pair changes the
    schedule, the stage count or the micro-batch count, several at once), what lies outside
    them; the recorded layout itself is the recording replayed (exact)."""
    if (sc.stages, sc.microbatches, sc.schedule) == (src.stages, src.microbatches, src.schedule):
        return {"low": 0.0, "high": 0.0, "pairs": 0, "validated": True, "not_validated": [],
                "exact": True}
    lo = min(p[2] for p in PAIRS)
    hi = max(p[3] for p in PAIRS)
    why = []
    if sc.stages != src.stages and src.stages:
        r = sc.stages / src.stages
        if not STAGE_RATIOS[0] <= r <= STAGE_RATIOS[1]:
            why.append(f"{sc.stages} stages is {r:g}x the recorded {src.stages} (pairs: "
                       f"{STAGE_RATIOS[0]:g}x..{STAGE_RATIOS[1]:g}x)")
    r = sc.microbatches / src.microbatches
    if not MICROBATCH_RATIOS[0] <= r <= MICROBATCH_RATIOS[1]:
        why.append(f"{sc.microbatches} micro-batches is {r:g}x the recorded "
                   f"{src.microbatches} (pairs: {MICROBATCH_RATIOS[0]:g}x.."
                   f"{MICROBATCH_RATIOS[1]:g}x)")
    if src.d.snapshot.kind.caching_allocator:
        why.append("the pairs are CPU recordings (no caching allocator, no NCCL buffers)")
    return {"low": lo, "high": hi, "pairs": len(PAIRS), "validated": not why,
            "not_validated": why, "exact": False}


@dataclass
class PipelineForecast:
    source: str
    recorded: dict
    scenarios: list[dict]
    notes: list[str]

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "source": self.source, "recorded": self.recorded,
                "notes": self.notes, "scenarios": self.scenarios}


def pipeline_forecast(analyses: list[DeviceAnalysis], stages=(), microbatches=(),
                      schedules=(), source_name: str = "") -> PipelineForecast:
    """Each stage's peak under every combination of pipeline degree, micro-batch count and
    schedule (empty = as recorded), from the recorded stages; the worst stage named."""
    from snapforensics.errors import SnapError

    srcs: list[StageSource] = []
    why: list[str] = []
    for d in analyses:
        s = source(d)
        if isinstance(s, str):
            why.append(s)
        else:
            srcs.append(s)
    if not srcs:
        raise SnapError(f"cannot forecast the pipeline: {why[0] if why else 'no stage'}")
    first = srcs[0]
    if any(s.stages != first.stages for s in srcs):
        raise SnapError("cannot forecast the pipeline: the files are of different pipeline "
                        "layouts (their stage counts differ)")
    notes = []
    if first.stages is None:
        notes.append("the files do not say their stage (no recorder provenance): each is "
                     "taken for every stage")
    by = {s.stage: s for s in srcs}
    recorded = {"stages": first.stages, "microbatches": first.microbatches,
                "schedule": first.schedule, "layers": first.layers,
                "stage_files": sorted(k for k in by if k is not None),
                "peaks": {str(s.stage): s.d.peak_bytes for s in srcs}}
    scen = [PipeScenario(int(p), int(m), str(k))
            for p in (stages or [first.stages or 1])
            for m in (microbatches or [first.microbatches])
            for k in (schedules or [first.schedule])]
    out = []
    for sc in scen:
        preds = predict(srcs, sc)
        ok = [p for p in preds if p.predicted_peak_bytes is not None]
        worst = max(ok, key=lambda p: p.predicted_peak_bytes or 0) if ok else None
        out.append({"stages": sc.stages, "microbatches": sc.microbatches,
                    "schedule": sc.schedule,
                    "worst_stage": worst.stage if worst else None,
                    "worst_peak_bytes": worst.predicted_peak_bytes if worst else None,
                    "error_band": band(sc, first),
                    "per_stage": [p.to_dict() for p in preds]})
    return PipelineForecast(source_name, recorded, out, notes)
