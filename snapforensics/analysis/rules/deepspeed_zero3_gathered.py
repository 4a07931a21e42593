"""DeepSpeed ZeRO-3's gathered parameters at the peak: what its all-gathers hold, and why.

ZeRO-3 keeps each parameter partitioned (1/dp a rank) and all-gathers it into a flat buffer
(`deepspeed.gathered_param`) when a module needs it. Two kinds of gathered parameters live at a
moment, told apart by what gathered them (deepspeed 0.19.8's code):
- fetched: the coordinator's `fetch_sub_module` (`partitioned_param_coordinator.py`) gathers a
  module's parameters before its forward or backward, and the ones after it up to
  `stage3_prefetch_bucket_size` elements, at most `stage3_max_live_parameters` alive; released
  after the module unless `stage3_max_reuse_distance` keeps them for an upcoming reuse;
- kept: the persistent parameters, those under `stage3_param_persistence_threshold` elements
  (`mark_persistent_parameters`: `ds_persist`), gathered at set-up and again after every
  optimizer step (`_post_step`), never released: whole on every rank for the run.

This is what the configuration chose, so the verdict is `expected`; the finding says how much of
the peak each kind is and which knob bounds it (a smaller bucket or threshold trades memory for
more, smaller all-gathers). But one: the persistence threshold is meant for parameters whose
all-gather is latency-bound (norms, biases: a few KiB each); a model whose weight matrices fall
under it too keeps them whole for the run and stage 3 partitions nothing of them. The threshold
is the mechanism, not a ratio: fetched instead, a parameter is gathered for its module's forward
and backward and released after it, so about one module's (the running one) is gathered at a
time. Persistence is then the anomaly when it holds more at the peak than fetching ever held at
once anywhere in the run (norms and biases beside fetched weights stay `expected`, wherever the
peak falls) and the replay says dropping it lowers the peak: every persistent
block replayed without its lifetime, and the largest module's persistent bytes (the recorder's
names: `module.0.weight` -> `module.0`) added over the run. Then `anomalous`, with the fix
(`stage3_param_persistence_threshold` 0); a file without names gets no prediction.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding, Replay
from snapforensics.analysis.evidence import human, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import CAT_CODE, Category, Verdict

_COORDINATOR = "deepspeed/runtime/zero/partitioned_param_coordinator.py"


def _fetched(d: DeviceAnalysis, blocks: np.ndarray) -> np.ndarray:
    """Which of the blocks the coordinator gathered for a module (else kept: persistent)."""
    stacks = np.unique(d.lt.stack[blocks])
    by = {int(s) for s in stacks.tolist() if s >= 0 and any(
        f.name == "fetch_sub_module" and f.filename.replace("\\", "/").endswith(_COORDINATOR)
        for f in d.snapshot.stack_frames(int(s)))}
    return np.isin(d.lt.stack[blocks], np.fromiter(by, np.int64, len(by)))


def fix_for(d: DeviceAnalysis, evidence: dict) -> str:
    return """\
# DeepSpeed config (the dict given to deepspeed.initialize, or the same keys in its JSON file):
# no parameter kept gathered for the whole run; each is fetched for its module and released
ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
# (a value under the smallest weight matrix's element count keeps norms and biases persistent)
# HF Trainer / accelerate: the same key in their DeepSpeed config
"""


def _persistence(d: DeviceAnalysis, kept: np.ndarray, persistent: np.ndarray
                 ) -> tuple[int, int, Replay] | None:
    """The peak without persistence (every block the coordinator did not fetch replayed
    without its lifetime, the largest module's persistent bytes added over the run), the
    modules and the replay; None when a persistent block has no module name."""
    lt, names = d.lt, d.names
    by_module: dict[str, int] = defaultdict(int)
    for b in kept.tolist():
        m = names.module(b) if names is not None else None
        if m is None:
            return None
        by_module[m] += int(lt.size[b])
    extra = [(int(lt.alloc_row[b]), int(lt.free_row[b]), -int(lt.size[b]))
             for b in persistent.tolist()]
    extra.append((0, lt.rows, max(by_module.values())))
    predicted = max(int(lt.replay(extra=tuple(extra)).max()), lt.baseline)
    return predicted, len(by_module), Replay(extra=tuple(extra))


def _most_fetched(d: DeviceAnalysis, fetched: np.ndarray, persistent: np.ndarray) -> int:
    """The most bytes the coordinator had fetched at once anywhere in the run (the working set
    fetching costs: 0 when every parameter is persistent). Persistence is decided by a
    parameter's element count, so a fetched block the size of a persistent one is a persistent
    parameter gathered before it was kept (the first forward fetches them too): not counted."""
    lt = d.lt
    size = np.zeros(len(lt), np.int64)
    fetched = fetched[~np.isin(lt.size[fetched], lt.size[persistent])]
    if not len(fetched):
        return 0
    size[fetched] = lt.size[fetched]
    return int(lt.replay(size=size).max(initial=0))


def check(d: DeviceAnalysis) -> list[Finding]:
    lt = d.lt
    if d.peak_row < 0:
        return []
    every = np.flatnonzero(d.category == CAT_CODE[Category.DEEPSPEED_GATHERED_PARAM])
    alive = lt.alive_at(d.peak_row)[every]
    if not alive.any():
        return []
    every_fetched = _fetched(d, every)  # one pass over the gathered blocks' stacks
    held, fetched = every[alive], every_fetched[alive]
    fetched_bytes = int(lt.size[held[fetched]].sum())
    kept_bytes = int(lt.size[held[~fetched]].sum())
    total = fetched_bytes + kept_bytes
    parts = []
    if fetched_bytes:
        parts.append(f"{human(fetched_bytes)} fetched for the modules running and prefetched "
                     "ahead of them (stage3_prefetch_bucket_size elements ahead, at most "
                     "stage3_max_live_parameters alive; stage3_max_reuse_distance keeps a "
                     "module's for its next use)")
    if kept_bytes:
        parts.append(f"{human(kept_bytes)} of persistent parameters, kept gathered on every "
                     "rank for the whole run (those under stage3_param_persistence_threshold "
                     "elements, default 1e5: re-gathered after each optimizer step)")
    cause = (f"At the peak ZeRO-3 holds {human(total)} of all-gathered (whole) parameters: "
             + "; ".join(parts) + ".")
    evidence = {"fetched_bytes_at_peak": fetched_bytes, "persistent_bytes_at_peak": kept_bytes,
                "stacks": top_stacks(d, held, 1)}
    title = "ZeRO-3 gathered parameters alive at the peak"
    persistent = every[~every_fetched]
    alt = _persistence(d, held[~fetched], persistent) \
        if kept_bytes > _most_fetched(d, every[every_fetched], persistent) else None
    if alt is not None and alt[0] < d.peak_bytes:
        predicted, modules, replay = alt
        evidence |= {"persistent_modules": modules}
        return [Finding.replayed(
            True, rule=RULE.id, title="ZeRO-3 keeps parameters gathered for the whole run "
            "(stage3_param_persistence_threshold)", cause=cause + f" The persistent ones "
            f"belong to {modules} module(s): fetched instead, about one module's would be "
            "gathered at a time, and the peak would be lower.", bytes=total,
            blocks=len(held), device=d.device, fix=fix_for(d, evidence), predicted=predicted,
            saving=d.peak_bytes - predicted, evidence=evidence, replay=replay, members=held)]
    return [Finding(
        rule=RULE.id, verdict=Verdict.EXPECTED, title=title,
        cause=cause + " Lowering those settings trades memory for more, smaller all-gathers.",
        bytes=total, blocks=len(held), device=d.device, evidence=evidence, members=held)]


RULE = Rule(
    id="deepspeed.gathered_parameters", check=check, family=Family.PARALLELISM,
    verdicts=frozenset({Verdict.EXPECTED, Verdict.ANOMALOUS}), fix=fix_for)
