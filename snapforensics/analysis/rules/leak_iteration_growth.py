"""A leak in the training loop: memory at the same point of every iteration keeps growing.

Sampled at the start of each iteration (right before its first forward row), the bytes still
alive from earlier iterations should be flat once the first step has created its lazy state
(optimizer state, caches): iteration 0 -> 1 legitimately differs. A leak makes them climb.

Per allocating stack, the bytes alive at each iteration start that were allocated inside an
iteration (init and pre-trace blocks excluded). A stack leaks when its bytes never decrease
across the iteration starts, grew at least twice (three iterations or more), and still grew in
the second half of the run, after iteration 1 at least (so state created once in step 1, or a
cache that fills up and stops, is not it). Significant when the growth per
iteration is at least 0.1% of the peak: at that rate the leak adds 10% of the peak every 100
steps and runs out of memory eventually, however small one step looks.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import counterfactual, human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.stacks import python_stacks, user_frame
from snapforensics.analysis.vocab import CATEGORIES, Category, Verdict

MIN_RATE = 0.001  # growth per iteration, of the peak

FIX = """\
import torch

# something keeps a tensor (and the autograd graph behind it) from every step.
# Keep Python numbers or detached copies across steps:
losses.append(loss.item())                 # not: losses.append(loss)
history.append(logits.detach().cpu())      # not: history.append(logits)
with torch.no_grad():                      # metrics from outputs: no graph at all
    confidence = logits.softmax(-1).amax(-1).mean().item()"""


def check(d: DeviceAnalysis) -> list[Finding]:
    its = d.tl.iterations
    lt = d.lt
    if len(its) < 3 or not len(lt):
        return []
    starts = np.array([it.start for it in its], np.int64)
    n = len(starts)
    # Only blocks that cross an iteration start can be alive at one. A block is alive just
    # before start j when alloc_row < start_j <= free_row: samples [first, last) in a row.
    ok = (d.iteration >= 0) & (lt.alloc_row >= 0)
    first = np.searchsorted(starts, lt.alloc_row, side="right")
    last = np.searchsorted(starts, lt.free_row, side="right")
    cand = np.flatnonzero(ok & (last > first) & (last > 1))
    if not cand.size:
        return []
    uniq, inv = np.unique(python_stacks(d, lt.stack[cand]), return_inverse=True)
    per = np.zeros((len(uniq), n + 1), np.int64)  # difference array over the samples
    np.add.at(per, (inv, first[cand]), lt.size[cand])
    np.add.at(per, (inv, last[cand]), -lt.size[cand])
    per = np.cumsum(per, axis=1)[:, :n]
    steps = np.diff(per, axis=1)
    # never shrinks, grew at least twice, and still grows in the second half of the run (after
    # iteration 1 at least): state created once, or a cache that fills up and stops, is not it
    half = max(1, (n - 1) // 2)
    grows = (steps >= 0).all(1) & ((steps > 0).sum(1) >= 2) & (per[:, -1] > per[:, half])
    if not grows.any():
        return []
    growth = int((per[grows, -1] - per[grows, 1]).sum())
    rate = growth / (n - 2)
    live_at = lt.live[np.maximum(starts - 1, 0)]
    peak = d.peak_bytes
    if peak <= 0 or rate < MIN_RATE * peak or live_at[-1] <= live_at[1]:
        return []
    g_blocks = cand[grows[inv]]
    # leaked: a growing stack's block still alive when the next iteration started
    it_of = d.iteration[g_blocks]
    nxt = np.where(it_of + 1 < n, starts[np.minimum(it_of + 1, n - 1)], lt.rows)
    outlived = (it_of + 1 < n) & (lt.free_row[g_blocks] >= nxt)
    leaked = g_blocks[outlived]
    retained = g_blocks[(first[g_blocks] <= n - 1) & (last[g_blocks] >= n)]
    # the iteration with the most leaked bytes, as the example the user reads
    one_it = int(np.bincount(d.iteration[leaked], weights=lt.size[leaked]).argmax()) \
        if leaked.size else 1
    one = leaked[d.iteration[leaked] == one_it]
    free_row = lt.free_row.copy()
    free_row[leaked] = nxt[outlived]
    after, replay = counterfactual(d, free_row)
    where = []
    for sid in np.unique(lt.stack[one]).tolist():
        u = user_frame(d, sid)
        if u and u not in where:
            where.append(u)
    cats: dict[str, int] = {}
    for b in retained.tolist():
        c = CATEGORIES[d.category[b]]
        cats[c] = cats.get(c, 0) + int(lt.size[b])
    graph = Category.ACTIVATION in cats or any("loss" in w or "backward" in w for w in where)
    kept = int(per[grows, -1].sum())
    at_end = int((lt.free_row[retained] >= lt.rows).sum())
    cause = (
        f"Memory alive at the start of each iteration grows by {human(rate)} per iteration "
        f"({', '.join(human(int(x)) for x in live_at)} at the starts of iterations "
        f"0..{n - 1}); excluding what step 0 created once, {int(grows.sum())} allocating "
        f"stack(s) keep adding blocks that outlive their iteration: {human(kept)} in "
        f"{retained.size} blocks was retained by the start of the last iteration"
        + (f" ({at_end} still alive at the end of the trace)" if at_end else "")
        + (f", allocated at {'; '.join(where[:3])}" if where else "")
        + ". " + ("They include forward outputs, so each kept tensor also pins its autograd "
                  "graph." if graph else "Something in the loop keeps a reference every step."))
    return [Finding(
        replay=replay,
        rule=RULE.id, verdict=Verdict.ANOMALOUS,
        title="Memory grows iteration over iteration (leak in the training loop)",
        cause=cause, bytes=kept, blocks=int(retained.size), members=retained, device=d.device,
        fix=FIX, predicted_peak_bytes=after["overall_bytes"],
        saving_bytes=peak - after["overall_bytes"],
        evidence={
            "growth_per_iteration_bytes": int(rate),
            "iterations": n,
            "live_at_iteration_start_bytes": [int(x) for x in live_at],
            "min_live_per_iteration_bytes": [int(lt.live[it.start:it.end + 1].min())
                                             for it in its],
            "retained_by_stack_per_iteration_start": [
                {"stack": d.stack_text(int(uniq[g]), 8), "bytes": per[g].tolist()}
                for g in np.flatnonzero(grows)[np.argsort(-per[grows, -1])][:5]],
            "example_iteration": one_it,
            "example_iteration_leaked_bytes": int(lt.size[one].sum()),
            "stacks": top_stacks(d, one, 3),
            "retained_categories": cats,
            "user_code": where[:5],
            "predicted_peaks": after,
            "predicted_is": "each leaked block freed when the next iteration starts",
        },
    )]


RULE = Rule(
    id="leak.iteration_growth", check=check, family=Family.LIFECYCLE,
    verdicts=frozenset({Verdict.ANOMALOUS}), fix=FIX)
