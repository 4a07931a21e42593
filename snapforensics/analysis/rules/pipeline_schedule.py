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

The replay moves the trace into 1F1B's order: the blocks made while micro-batch k >= w was
forwarded (from its `Forward k` to the next micro-batch's) are made right after `Backward k - w`
instead (w = min(M, S - s)), those freed inside that span with them; the gradient sends GPipe
waits for only after its last backward (blocks made in `Backward j`, freed after the last
`Backward` but before the optimizer) are freed after `Backward j + 1`, where 1F1B waits for them.
"""

from __future__ import annotations

import re

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding, Replay
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.mesh import mesh
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Phase, Verdict

RANGE = re.compile(r"^(Forward|Backward) (\d+)$")

FIX = """\
from torch.distributed.pipelining import Schedule1F1B

# was ScheduleGPipe: every micro-batch's activations held until the backward phase
schedule = Schedule1F1B(stage, n_microbatches={m}, loss_fn=loss_fn)
# torchtitan: config.parallelism.pipeline_parallel_schedule = "1F1B"  # was "GPipe"
"""

Span = tuple[int, int]


def _steps(d: DeviceAnalysis) -> list[dict[tuple[str, int], Span]]:
    """Per step (a run of ranges from `Forward 0`), each (kind, micro-batch) range's rows."""
    steps: list[dict[tuple[str, int], Span]] = []
    opened: dict[tuple[str, int], int] = {}
    for a in d.snapshot.annotations:
        m = RANGE.match(a.name) if a.device == d.device else None
        if not m:
            continue
        k = (m.group(1), int(m.group(2)))
        if a.stage == "START":
            if k == ("Forward", 0):
                steps.append({})
            opened[k] = a.row
        elif k in opened and steps:
            steps[-1][k] = (opened.pop(k), a.row)
    return steps


def _all_forward_first(step: dict[tuple[str, int], Span]) -> int:
    """M when the step ran M >= 2 forwards, each before its first backward, and M backwards;
    else 0 (not GPipe's order)."""
    fwd = sorted(mb for kind, mb in step if kind == "Forward")
    bwd = sorted(mb for kind, mb in step if kind == "Backward")
    m = len(fwd)
    if m < 2 or fwd != list(range(m)) or bwd != fwd:
        return 0
    first_b = min(step[("Backward", j)][0] for j in bwd)
    return m if max(step[("Forward", i)][0] for i in fwd) < first_b else 0


def _made_in_forward(step: dict[tuple[str, int], Span], k: int, m: int) -> Span:
    """Rows of micro-batch k's forward: its `Forward k` to the next one's (the loss a last stage
    computes after the range belongs to it), the last one's to the first `Backward`."""
    end = step[("Forward", k + 1)][0] if k + 1 < m else step[("Backward", 0)][0]
    return step[("Forward", k)][0], end


def _replay(d: DeviceAnalysis, steps: list[dict[tuple[str, int], Span]], m: int, w: int
            ) -> Replay:
    lt = d.lt
    ar, fr = lt.alloc_row.copy(), lt.free_row.copy()
    freed_phase = d.tl.phase[np.clip(lt.free_row, 0, max(lt.rows - 1, 0))]
    for step in steps:
        for k in range(w, m):
            f0, f1 = _made_in_forward(step, k, m)
            off = step[("Backward", k - w)][1] - f0
            made = (lt.alloc_row >= f0) & (lt.alloc_row < f1)
            ar[made] += off
            inside = made & (lt.free_row < f1)
            fr[inside] += off
        last = step[("Backward", m - 1)][1]
        for j in range(m - 1):
            b0, b1 = step[("Backward", j)]
            waited = (lt.alloc_row >= b0) & (lt.alloc_row < b1) & (lt.free_row >= last) & \
                (lt.free_row < lt.rows) & (freed_phase != int(Phase.OPTIMIZER))
            fr[waited] = np.minimum(fr[waited], step[("Backward", j + 1)][1])
    return Replay(free_row=fr, alloc_row=ar)


def check(d: DeviceAnalysis) -> list[Finding]:
    counted = [(_all_forward_first(s), s) for s in _steps(d)]
    m = max((n for n, _ in counted), default=0)
    if not m or d.peak_row < 0:
        return []
    steps = [s for n, s in counted if n == m]
    lt, p = d.lt, d.peak_row
    # the micro-batch of each block: the `Forward k` span it was made in
    mb = np.full(len(lt), -1, np.int64)
    for step in steps:
        for k in range(m):
            f0, f1 = _made_in_forward(step, k, m)
            mb[(lt.alloc_row >= f0) & (lt.alloc_row < f1)] = k
    held_mask = lt.alive_at(p) & (mb >= 0)
    held = sorted(set(mb[held_mask].tolist()))
    held_bytes = int(lt.size[held_mask].sum())
    layout = mesh(d.snapshot.provenance)
    stage, stages = layout.index("pp"), layout.degree("pp")
    evidence = {"microbatches": m, "held_at_peak": len(held), "held_bytes": held_bytes,
                "stage": stage, "stages": stages,
                "stacks": top_stacks(d, np.flatnonzero(held_mask), 1)}
    title = f"The pipeline runs all {m} micro-batches' forwards before any backward (GPipe)"
    cause = (f"At the peak this stage holds activations of {len(held)} micro-batch(es), "
             f"{human(held_bytes)}: every `Forward i` of the step ran before its first "
             "`Backward`, so each micro-batch's activations wait for the whole forward phase.")
    if not (type(stage) is int and type(stages) is int and 0 <= stage < stages):
        return [Finding(rule=RULE.id, verdict=Verdict.INFO, title=title, bytes=held_bytes,
                        cause=cause + " The stage index and count are not in this file "
                        "(record with `snapforensics record` for the saving).",
                        blocks=int(held_mask.sum()), device=d.device, evidence=evidence,
                        members=np.flatnonzero(held_mask))]
    w = min(m, stages - stage)
    replay = _replay(d, steps, m, w)
    predicted = int(lt.replay(free_row=replay.free_row, alloc_row=replay.alloc_row).max())
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
