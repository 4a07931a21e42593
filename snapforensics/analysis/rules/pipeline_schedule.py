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

def _replay(d: DeviceAnalysis, stage: int, stages: int) -> Replay:
    """The trace with every GPipe step rebuilt in 1F1B's order (forecast/pipeline.py's model, at
    the recorded stage count and micro-batches): each block at its first instance's rows in the
    new order, its further instances (FSDP's gathers, replayed where 1F1B gathers again) as
    extra intervals, and the step's blocks the rebuild does not make (gathers GPipe made and
    1F1B does not) gone."""
    lt = d.lt
    ar, fr = lt.alloc_row.copy(), lt.free_row.copy()
    extra: list[tuple[int, int, int]] = []
    steps = pipeline.stage_steps(d)
    for src in steps if not isinstance(steps, str) else []:
        if src.schedule != pipeline.GPIPE:
            continue
        rb = pipeline.rebuild(src, pipeline.PipeScenario(stages, src.microbatches,
                                                         pipeline.ONE_F_ONE_B), stage, 1.0)
        step = np.flatnonzero(((lt.alloc_row < src.start) & (lt.free_row > src.start)) |
                              ((lt.alloc_row >= src.start) & (lt.alloc_row < src.stop)))
        gone = np.setdiff1d(step, rb.block)
        fr[gone] = np.maximum(ar[gone], 0)  # no rows alive
        _, first = np.unique(rb.block, return_index=True)
        again = np.setdiff1d(np.arange(len(rb.block)), first)
        for i in again.tolist():
            extra.append((src.start + max(int(rb.alloc[i]), 0), src.start + int(rb.free[i]),
                          int(rb.size[i])))
        blocks, alloc, free = rb.block[first], rb.alloc[first], rb.free[first]
        born = alloc >= 0
        ar[blocks[born]] = src.start + alloc[born]
        ended = free < rb.rows
        fr[blocks[ended]] = src.start + free[ended]
    return Replay(free_row=fr, alloc_row=ar, extra=tuple(extra))


def check(d: DeviceAnalysis) -> list[Finding]:
    counted = [(pipeline.all_forward_first(s), s) for s in pipeline.gpipe_ranges(d)]
    m = max((n for n, _ in counted), default=0)
    if not m or d.peak_row < 0:
        return []
    steps = [s for n, s in counted if n == m]
    lt, p = d.lt, d.peak_row
    # the micro-batch of each block: the `Forward k` span it was made in
    mb = np.full(len(lt), -1, np.int64)
    for step in steps:
        for k in range(m):
            f0, f1 = pipeline.made_in_forward(step, k, m)
            mb[(lt.alloc_row >= f0) & (lt.alloc_row < f1)] = k
    held_mask = lt.alive_at(p) & (mb >= 0)
    held = sorted(set(mb[held_mask].tolist()))
    held_bytes = int(lt.size[held_mask].sum())
    layout = d.layout
    stage, stages = layout.index("pp"), layout.degree("pp")
    evidence = {"microbatches": m, "held_at_peak": len(held), "held_bytes": held_bytes,
                "stage": stage, "stages": stages,
                "stacks": top_stacks(d, np.flatnonzero(held_mask), 1)}
    title = f"The pipeline runs all {m} micro-batches' forwards before any backward (GPipe)"
    cause = (f"At the peak this stage holds activations of {len(held)} micro-batch(es), "
             f"{human(held_bytes)}: every `Forward i` of the step ran before its first "
             "`Backward`, so each micro-batch's activations wait for the whole forward phase.")

    def info(why: str) -> list[Finding]:
        return [Finding(rule=RULE.id, verdict=Verdict.INFO, title=title, bytes=held_bytes,
                        cause=cause + " " + why, blocks=int(held_mask.sum()),
                        device=d.device, evidence=evidence, members=np.flatnonzero(held_mask))]

    if not (type(stage) is int and type(stages) is int and 0 <= stage < stages):
        return info("The stage index and count are not in this file (record with "
                    "`snapforensics record` for the saving).")
    try:
        replay = _replay(d, stage, stages)
    except SnapError as e:  # a step past the rebuild's bound: no saving, the rest stands
        return info(f"No saving is predicted: {str(e).split(': ', 1)[-1]}.")
    w = min(m, stages - stage)
    predicted = int(lt.replay(free_row=replay.free_row, alloc_row=replay.alloc_row,
                              extra=replay.extra).max())
    predicted = max(predicted, lt.baseline)
    saving = d.peak_bytes - predicted
    evidence["one_f_one_b_holds"] = w
    cause += (f" Under 1F1B stage {stage} of {stages} (from {layout.source('pp')}) holds at most "
              f"min({m}, {stages} - {stage}) = {w}.")
    anomalous = w < m and saving > 0
    return [Finding.replayed(
        anomalous, rule=RULE.id, title=title,
        cause=cause, bytes=held_bytes, blocks=int(held_mask.sum()), device=d.device,
        fix=FIX.format(m=m), predicted=predicted, saving=saving, evidence=evidence,
        replay=replay, members=np.flatnonzero(held_mask))]


RULE = Rule(
    id="pipeline.all_forward_before_backward", check=check, family=Family.PARALLELISM,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX.format(m=8))
