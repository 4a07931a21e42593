"""A pipeline stage that runs every micro-batch's forward before any backward (GPipe) holds the
activations of all M micro-batches at once; 1F1B starts each backward as soon as the last stage
can, so stage s of S holds at most min(M, S - s) (torch's `Schedule1F1B._step_microbatches`:
`warmup_chunks = min(n_microbatches, num_stages - stage_index)`, then one backward before each
further forward). The threshold is the mechanism: anomalous whenever M > S - s, i.e. whenever
1F1B would hold fewer micro-batches on this stage, with the replayed saving.

Seen by the ranges the schedule opens around each micro-batch (`Forward {i}` / `Backward {i}`,
`torch/distributed/pipelining/schedules.py`, `ScheduleGPipe`): a step whose every `Forward i`
starts before its first `Backward`. The stage is taken as the rank of a one-stage-per-rank run
(the recorder's rank and world size); a file without them gets the finding without a prediction.

The replay is the pipeline forecast's (`analysis/forecast/pipeline.py`) at the recorded stage
count and micro-batches: every GPipe step cut into its micro-batches' forwards and backwards and
rebuilt in 1F1B's order for this stage (w = min(M, S - s) forwards first, then one backward
before each further forward), each block at its offset in the operations that make and free
it; what GPipe's lists of send works keep until the step returns is freed where 1F1B drops it.

The looped form: a rank running V stages (torch's looped runtime; the recorder's marks name the
stage of each micro-batch's forward and backward) whose every forward, on every stage, starts
before its first backward (`ScheduleLoopedBFS`) holds all M micro-batches on each stage, where
`ScheduleInterleaved1F1B` holds its warmup's share (`forecast.pipeline.held` of its order). The
replay is the forecast's interleaved rebuild of the rank's step at the recorded layout, each of
its stages from its own recorded operations.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding, Replay
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.forecast import pipeline
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Verdict
from snapforensics.errors import SnapError

FIX = """\
from torch.distributed.pipelining import Schedule1F1B

# was ScheduleGPipe: every micro-batch's activations held until the backward phase
schedule = Schedule1F1B(stage, n_microbatches={m}, loss_fn=loss_fn)
# torchtitan: config.parallelism.pipeline_parallel_schedule = "1F1B"  # was "GPipe"
"""
INTERLEAVED_FIX = """\
from torch.distributed.pipelining import ScheduleInterleaved1F1B

# was ScheduleLoopedBFS: every micro-batch's activations held on each of the rank's stages
# until the backward phase
schedule = ScheduleInterleaved1F1B(stages, n_microbatches={m}, loss_fn=loss_fn)
# torchtitan: config.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"  # was
#   "LoopedBFS"
"""

def _place(d: DeviceAnalysis, start: int, stop: int, rb: pipeline.Rebuilt,
           ar: np.ndarray, fr: np.ndarray, extra: list[tuple[int, int, int]]) -> None:
    """One rebuilt step (rows from `start`) written into the replay: each block at its first
    instance's rows (alive from before the step or past it where the rebuild says so), its
    further instances (FSDP's gathers, replayed where the new order gathers again; a block the
    rank's stages share) and any size its instances give it beyond its own as extra intervals
    within the step's rows (outside them the block is as recorded, or as another step's
    rebuild has it), and the step's blocks the rebuild does not make (gathers the old order
    made and the new does not) gone."""
    lt = d.lt
    step = np.flatnonzero(((lt.alloc_row < start) & (lt.free_row > start)) |
                          ((lt.alloc_row >= start) & (lt.alloc_row < stop)))
    gone = np.setdiff1d(step, rb.block)
    fr[gone] = np.maximum(ar[gone], 0)  # no rows alive
    end = start + rb.rows

    def within(a: int, e: int, n: int) -> None:
        a, e = max(a, start), min(e, end)
        if n and e > a:
            extra.append((a, e, n))

    _, first = np.unique(rb.block, return_index=True)
    again = np.setdiff1d(np.arange(len(rb.block)), first)
    for i in again.tolist():
        within(start + int(rb.alloc[i]), start + int(rb.free[i]), int(round(float(rb.size[i]))))
    blocks, alloc, free = rb.block[first], rb.alloc[first], rb.free[first]
    born = alloc >= 0
    ar[blocks[born]] = start + alloc[born]
    ended = free < rb.rows
    fr[blocks[ended]] = start + free[ended]
    for b, sz in zip(blocks.tolist(), rb.size[first].tolist()):
        within(int(ar[b]), int(fr[b]), int(round(sz)) - int(lt.size[b]))


def _replay(d: DeviceAnalysis, stage: int, stages: int) -> Replay:
    """The trace with every GPipe step rebuilt in 1F1B's order (forecast/pipeline.py's model, at
    the recorded stage count and micro-batches)."""
    lt = d.lt
    ar, fr = lt.alloc_row.copy(), lt.free_row.copy()
    extra: list[tuple[int, int, int]] = []
    steps = pipeline.stage_steps(d)
    for src in steps if not isinstance(steps, str) else []:
        if src.schedule != pipeline.GPIPE:
            continue
        rb = pipeline.rebuild(src, pipeline.PipeScenario(stages, src.microbatches,
                                                         pipeline.ONE_F_ONE_B), stage, 1.0)
        _place(d, src.start, src.stop, rb, ar, fr, extra)
    return Replay(free_row=fr, alloc_row=ar, extra=tuple(extra))


def _looped_steps(d: DeviceAnalysis) -> list[list[pipeline.StageSource]]:
    """The steps of a rank running several stages (a looped schedule, the recorder's marks
    naming each) whose every forward, on every stage of the rank, starts before its first
    backward (ScheduleLoopedBFS): each step's sources, lowest stage first."""
    steps = pipeline.stage_steps(d)
    by: dict[int, list[pipeline.StageSource]] = {}
    for src in steps if not isinstance(steps, str) else []:
        if src.virtual > 1:
            by.setdefault(src.start, []).append(src)
    return [sorted(srcs, key=lambda s: s.stage if s.stage is not None else -1)
            for srcs in by.values() if srcs[0].looped_bfs and srcs[0].microbatches >= 2]


def _looped_replay(d: DeviceAnalysis, steps: list[list[pipeline.StageSource]], rank: int,
                   ranks: int) -> Replay:
    """The trace with every looped all-forwards-first step rebuilt in ScheduleInterleaved1F1B's
    order for this rank (forecast/pipeline.py's interleaved model, at the recorded stages and
    micro-batches: the rank's j-th stage from its j-th recorded one)."""
    lt = d.lt
    ar, fr = lt.alloc_row.copy(), lt.free_row.copy()
    extra: list[tuple[int, int, int]] = []
    for srcs in steps:
        v, m = len(srcs), srcs[0].microbatches
        sc = pipeline.PipeScenario(ranks, m, pipeline.INTERLEAVED, v)

        def pick(st: int, srcs=srcs) -> pipeline.StageSource:
            return srcs[min(st // ranks, len(srcs) - 1)]

        parts = pipeline.interleaved(sc, rank, pick, srcs[0].layers or 0)
        _place(d, srcs[0].start, srcs[0].stop, pipeline.joined(parts), ar, fr, extra)
    return Replay(free_row=fr, alloc_row=ar, extra=tuple(extra))


def check(d: DeviceAnalysis) -> list[Finding]:
    if d.peak_row < 0:
        return []
    counted = [(pipeline.all_forward_first(s), s) for s in pipeline.gpipe_ranges(d)]
    m = max((n for n, _ in counted), default=0)
    looped = [] if m else _looped_steps(d)
    lt, p = d.lt, d.peak_row
    # the micro-batch of each block: the forward it was made in (per stage of the rank)
    mb = np.full(len(lt), -1, np.int64)
    if m:
        for step in (s for n, s in counted if n == m):
            for k in range(m):
                f0, f1 = pipeline.made_in_forward(step, k, m)
                mb[(lt.alloc_row >= f0) & (lt.alloc_row < f1)] = k
    elif looped:
        m = looped[0][0].microbatches
        for srcs in looped:
            for j, src in enumerate(srcs):
                for (kind, k), (r0, r1) in src.ops.items():
                    if kind == "F":
                        mb[(lt.alloc_row >= r0) & (lt.alloc_row < r1)] = j * m + k
    if not m:
        return []
    v = len(looped[0]) if looped else 1
    held_mask = lt.alive_at(p) & (mb >= 0)
    held = sorted(set(mb[held_mask].tolist()))
    held_bytes = int(lt.size[held_mask].sum())
    layout = d.layout
    stage, stages = layout.index("pp"), layout.degree("pp")
    evidence = {"microbatches": m, "held_at_peak": len(held), "held_bytes": held_bytes,
                "stage": stage, "stages": stages,
                "stacks": top_stacks(d, np.flatnonzero(held_mask), 1)}
    if looped:
        evidence["stages_per_rank"] = v
        title = (f"The pipeline runs all {m} micro-batches' forwards on each of the rank's {v} "
                 "stages before any backward (looped BFS)")
        cause = (f"At the peak this rank holds activations of {len(held)} micro-batch(es) over "
                 f"its {v} stages, {human(held_bytes)}: every forward of the step, on every "
                 "stage, ran before its first backward.")
    else:
        title = f"The pipeline runs all {m} micro-batches' forwards before any backward (GPipe)"
        cause = (f"At the peak this stage holds activations of {len(held)} micro-batch(es), "
                 f"{human(held_bytes)}: every `Forward i` of the step ran before its first "
                 "`Backward`, so each micro-batch's activations wait for the whole forward "
                 "phase.")

    def info(why: str) -> list[Finding]:
        return [Finding(rule=RULE.id, verdict=Verdict.INFO, title=title, bytes=held_bytes,
                        cause=cause + " " + why, blocks=int(held_mask.sum()),
                        device=d.device, evidence=evidence, members=np.flatnonzero(held_mask))]

    if not (type(stage) is int and type(stages) is int and 0 <= stage < stages):
        return info("The stage index and count are not in this file (record with "
                    "`snapforensics record` for the saving).")
    if looped and (why := pipeline.interleaved_refusal(stages, m)):
        return info(f"No saving is predicted: {why}.")
    try:
        replay = _looped_replay(d, looped, stage, stages) if looped else \
            _replay(d, stage, stages)
    except SnapError as e:  # a step past the rebuild's bound: no saving, the rest stands
        return info(f"No saving is predicted: {str(e).split(': ', 1)[-1]}.")
    if looped:
        w = pipeline.held(pipeline.order(pipeline.INTERLEAVED, stage, stages, m, v), m)
        fix = INTERLEAVED_FIX.format(m=m)
        cause += (f" Under ScheduleInterleaved1F1B rank {stage} of {stages} (from "
                  f"{layout.source('pp')}) holds at most {w} per stage.")
    else:
        w = min(m, stages - stage)
        fix = FIX.format(m=m)
        cause += (f" Under 1F1B stage {stage} of {stages} (from {layout.source('pp')}) holds "
                  f"at most min({m}, {stages} - {stage}) = {w}.")
    predicted = int(lt.replay(free_row=replay.free_row, alloc_row=replay.alloc_row,
                              extra=replay.extra).max())
    predicted = max(predicted, lt.baseline)
    saving = d.peak_bytes - predicted
    # what the fix's schedule holds on this stage: 1F1B's, Interleaved1F1B's for the looped
    evidence["interleaved_holds" if looped else "one_f_one_b_holds"] = w
    anomalous = w < m and saving > 0
    return [Finding.replayed(
        anomalous, rule=RULE.id, title=title,
        cause=cause, bytes=held_bytes, blocks=int(held_mask.sum()), device=d.device,
        fix=fix, predicted=predicted, saving=saving, evidence=evidence,
        replay=replay, members=np.flatnonzero(held_mask))]


RULE = Rule(
    id="pipeline.all_forward_before_backward", check=check, family=Family.PARALLELISM,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX.format(m=8))
