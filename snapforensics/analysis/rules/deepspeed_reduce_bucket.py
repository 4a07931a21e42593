"""DeepSpeed ZeRO's gradient reduction bucket larger than the model's gradients: ZeRO makes it
`zero_optimization.reduce_bucket_size` elements whatever the model's size (the default 5e8 is
2 GB in fp32, 1 GB in bf16: more than a small or medium model's whole gradient), and a bucket
that can hold every gradient of a backward never fills, so the bytes past the gradients are
never written. The threshold is the mechanism: a bucket no larger than the gradients reduces
them in the same one pass (ZeRO flushes it when full or at the end of the backward), so any
byte the replay takes off the peak is a saving.

Seen by `deepspeed.reduce_bucket` blocks (classify.py) alive at the peak. The gradients' size G:
the model's parameter count from the recorder's names (the optimizer's fp32 parameter partition
on this rank, x the world size: ZeRO partitions it over the data-parallel ranks), at 4 bytes
each (an upper bound for a bf16 bucket: the saving is then under-stated). A file without names
gets the finding without a prediction. Predicted peak by replaying each bucket block at
min(size, G).
"""

from __future__ import annotations

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding, Replay
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import CAT_CODE, Category, Verdict
from snapforensics.snapshot.tensors import KINDS


def fix_for(d: DeviceAnalysis, evidence: dict) -> str:
    params, stage = evidence.get("params_assumed") or 0, evidence.get("stage", 2)
    return f"""\
# DeepSpeed config (the dict given to deepspeed.initialize, or the same keys in its JSON file):
# the bucket is reduce_bucket_size ELEMENTS, at most the model's parameter count ({params:,})
ds_config["zero_optimization"] = {{"stage": {stage}, "reduce_bucket_size": {params}}}
# HF Trainer / accelerate: the same key in their DeepSpeed config ("auto" gives
# hidden_size * hidden_size)
"""


def check(d: DeviceAnalysis) -> list[Finding]:
    lt = d.lt
    if d.peak_row < 0:
        return []
    bucket = d.category == CAT_CODE[Category.DEEPSPEED_REDUCE_BUCKET]
    held = bucket & lt.alive_at(d.peak_row)
    if not held.any():
        return []
    held_bytes = int(lt.size[held].sum())
    world = d.layout.degree("dp")  # ZeRO partitions over data parallelism
    names = d.names
    params = None
    if names is not None and type(world) is int and world > 0:
        part = (names.kinds == KINDS.index("parameter")) & lt.alive_at(d.peak_row)
        if part.any():
            params = int(lt.size[part].sum()) // 4 * world
    stage = 3 if any(f.filename.replace("\\", "/").endswith("zero/stage3.py")
                     for f in d.snapshot.frames) else 2
    evidence = {"bucket_bytes_at_peak": held_bytes, "buckets_at_peak": int(held.sum()),
                "params_assumed": params, "stage": stage,
                "stacks": top_stacks(d, np.flatnonzero(held), 1)}
    title = "DeepSpeed's reduction bucket is larger than the model's gradients"
    cause = (f"ZeRO's gradient reduction bucket holds {human(held_bytes)} at the peak "
             f"({int(held.sum())} buffer(s) of reduce_bucket_size elements, made whatever the "
             "model's size).")
    if params is None:
        return [Finding(rule=RULE.id, verdict=Verdict.INFO, title=title, bytes=held_bytes,
                        cause=cause + " The model's parameter count is not in this file "
                        "(record with `snapforensics record` for the saving); set "
                        "reduce_bucket_size to at most it.", blocks=int(held.sum()),
                        device=d.device, evidence=evidence, members=np.flatnonzero(held))]
    need = params * 4
    cut = np.flatnonzero(bucket & (lt.size > need)).tolist()
    if not cut:
        return []  # no bucket larger than the gradients: nothing to say
    extra = tuple((int(lt.alloc_row[b]), int(lt.free_row[b]), need - int(lt.size[b]))
                  for b in cut)
    predicted = max(int(lt.replay(extra=extra).max()), lt.baseline)
    saving = d.peak_bytes - predicted
    anomalous = saving > 0
    cause += (f" The model has {params:,} parameters (its fp32 partition here x {world} ranks): "
              f"at most {human(need)} of gradients ever pass through it in one backward.")
    return [Finding.replayed(
        anomalous, rule=RULE.id, title=title,
        cause=cause, bytes=held_bytes, blocks=int(held.sum()), device=d.device,
        fix=fix_for(d, evidence), predicted=predicted, saving=saving, evidence=evidence,
        replay=Replay(extra=extra), members=np.flatnonzero(held))]


RULE = Rule(
    id="deepspeed.reduce_bucket_oversized", check=check, family=Family.PARALLELISM,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=fix_for)
