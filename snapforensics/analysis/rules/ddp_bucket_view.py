"""DDP with `gradient_as_bucket_view=False` (its default) keeps every gradient twice: the
Reducer's flat buckets (`ddp.bucket`, one slot per parameter, the all-reduce's input and output)
and each parameter's `.grad` (`ddp.grad_copy`), which the Reducer copies into its bucket slot in
the gradient's hook (`mark_variable_ready_dense`: `mul_out(bucket_view, grad, 1/world)`) and, once
the bucket is reduced, copies back (`finalize_bucket_dense`: `copy_bucket_to_grad`). Both live
until the optimizer has stepped (and the buckets for the whole run). With
`gradient_as_bucket_view=True` the hook makes `.grad` the bucket view itself
(`grad = bucket_view`), so the autograd engine's fresh gradient is freed inside that hook and
nothing but the bucket is left.

The threshold is the mechanism: the copies hold the same values as the bucket, so the fix trades
nothing away (no compute, no communication) and any peak byte it removes is a saving; anomalous
whenever the replay lowers the peak, info when the copies are not alive at the peak (a peak the
buckets and copies do not reach: the forward's activations, a rebuild of the buckets).

The replay frees each copy where the view mode frees the fresh gradient: at the end of the
Reducer's hook that copies it into the bucket, the first `torch::distributed::reducer::` or
`AccumulateGrad` row after the gradient was made (CPU recordings show those C++ frames), else
the row right after it was made: a lower bound, so on a CUDA dump (no C++ frames unless
recorded with stacks="all") the predicted peak can be lower than the twin's (a matrix layout
with no_sync accumulation: 16.9 MB without the frames, 18.8 MB with them); the twin checks
(tests/rules/test_ddp_bucket_view.py) are on CPU recordings.
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import LOWER_BOUND, Finding, Replay
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Category, Verdict

FIX = """\
from torch.nn.parallel import DistributedDataParallel

# was gradient_as_bucket_view=False (DDP's default): every .grad a second copy of its bucket slot
model = DistributedDataParallel(model, gradient_as_bucket_view=True)
# .grad are then views into the buckets: do not detach_() them or assign them new tensors
# (optimizer.zero_grad(), set_to_none or not, is fine)
# torchtitan (no config key): apply_ddp's replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
# passes its keywords to DistributedDataParallel: add gradient_as_bucket_view=True there
"""

# the C++ frames of the Reducer's hook (CPU recordings, `stacks="all"` on CUDA): the autograd
# engine's AccumulateGrad node the hook runs in, the `record_function` ranges the Reducer opens
_HOOK_FRAMES = ("torch::distributed::reducer::", "torch::autograd::AccumulateGrad")


def _hook_rows(d: DeviceAnalysis) -> np.ndarray:
    """Rows made inside the Reducer's gradient hook (sorted)."""
    stacks = d.trace.stack
    ids = np.unique(stacks[stacks >= 0])
    hook = {int(s) for s in ids.tolist()
            if any(any(h in f.name for h in _HOOK_FRAMES) for f in d.snapshot.stack_frames(int(s)))}
    if not hook:
        return np.zeros(0, np.int64)
    return np.flatnonzero(np.isin(stacks, np.fromiter(hook, np.int64)))


def _replay(d: DeviceAnalysis, copies: np.ndarray, hook: np.ndarray) -> Replay:
    lt = d.lt
    fr = lt.free_row.copy()
    made = lt.alloc_row[copies]
    view_free = made + 1
    if len(hook):
        at = np.searchsorted(hook, made, side="right")
        nxt = hook[np.minimum(at, len(hook) - 1)]
        view_free = np.where(at < len(hook), np.maximum(nxt, made) + 1, made + 1)
    fr[copies] = np.minimum(fr[copies], view_free)
    return Replay(free_row=fr)


def check(d: DeviceAnalysis) -> list[Finding]:
    copies = np.flatnonzero(d.mask(Category.DDP_GRAD_COPY))
    if not len(copies) or d.peak_row < 0:
        return []
    lt, p = d.lt, d.peak_row
    alive = lt.alive_at(p)
    held = copies[alive[copies]]
    held_bytes = int(lt.size[held].sum())
    buckets = np.flatnonzero(d.mask(Category.DDP_BUCKET) & alive)
    bucket_bytes = int(lt.size[buckets].sum())
    hook = _hook_rows(d)
    replay = _replay(d, copies, hook)
    predicted = max(int(lt.replay(free_row=replay.free_row).max()), lt.baseline)
    saving = d.peak_bytes - predicted
    anomalous = saving > 0
    evidence = {"copies_at_peak": int(len(held)), "copy_bytes_at_peak": held_bytes,
                "bucket_bytes_at_peak": bucket_bytes, "copies": int(len(copies)),
                "stacks": top_stacks(d, held if len(held) else copies, 1)}
    if not len(hook):  # each copy freed the row after it was made: sooner than the hook ends
        evidence["prediction"] = LOWER_BOUND
    title = "DDP keeps every gradient twice (gradient_as_bucket_view=False)"
    cause = (f"At the peak {len(held)} gradient(s), {human(held_bytes)}, are separate tensors "
             f"beside the Reducer's buckets ({human(bucket_bytes)} alive): each `.grad` is "
             "copied into its bucket slot for the all-reduce and back, and both live until the "
             "optimizer step. With `gradient_as_bucket_view=True` each `.grad` is its bucket "
             "slot.")
    if not anomalous:
        cause += " The copies do not raise this run's peak: the fix would not lower it."
    elif not len(hook):
        cause += (" The file has no C++ frames of the Reducer's hook (record with "
                  "stacks=\"all\"): the predicted peak is a lower bound.")
    return [Finding.replayed(
        anomalous, rule=RULE.id, title=title,
        cause=cause, bytes=held_bytes, blocks=int(len(held)), device=d.device,
        fix=FIX, predicted=predicted, saving=saving, evidence=evidence,
        replay=replay, members=held if len(held) else copies)]


RULE = Rule(
    id="ddp.gradient_as_bucket_view", check=check, family=Family.PARALLELISM,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX)
