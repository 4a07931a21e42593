"""Which training framework made the run, and the user's layer as the run names it.

Most FSDP users do not call `fully_shard` themselves: they train with Hugging Face
`transformers` (Trainer), `accelerate`'s FSDP plugin, Lightning (Trainer or Fabric) or
torchtitan. A fix is only useful in the terms the user configures, so the report states the
framework and the fix text (`analysis/frameworks/fixes.py`) speaks it.

Recognized from what the file shows, never guessed from one name alone:
- the package of the frames on the stacks (`transformers/`, `transformers/trainer.py`,
  `accelerate/`, `lightning/pytorch/` / `pytorch_lightning/`, `lightning/fabric/` /
  `lightning_fabric/`, `torchtitan/`, `megatron/core/` (Megatron-LM and NeMo train through
  Megatron-Core), `deepspeed/`), and the recorder's command line (`-m torchtitan.train`);
- the FSDP generation from FSDP's own files (`fsdp/_fully_shard/` is FSDP2,
  `fully_sharded_data_parallel.py` / `_flat_param.py` / `_runtime_utils.py` FSDP1) and the
  CPU recorder's module frames (`FullyShardedDataParallel_N` FSDP1, `FSDP<Class>_N` FSDP2);
  "FSDP2 replicate" where its units shard nothing (`replicate()`, torchtitan's DDP: FSDP2's
  machinery at shard size 1, read from the blocks by `FsdpUnits.replicated`, so a CUDA
  recording started after set-up, without replicate's frames or module names, reads the same);
- the user's repeated layer: its class from the module frames (`LlamaDecoderLayer_3`, FSDP2's
  dynamic `FSDPLlamaDecoderLayer_3`), its path from the FSDP units' names (`model.layers.3`,
  FSDP2's ranges; FSDP1 units named from the module frames, see `fsdp_units`).

The framework the user configures FSDP through ("owner") is the outermost one: Megatron, torchtitan,
else Lightning, else the HF Trainer (which drives accelerate), else accelerate, else DeepSpeed's
own engine, else plain torch (an HF model under the user's own `fully_shard` is "torch" for the
FSDP calls, with `transformers` as the model library).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from snapforensics.analysis.mesh import mesh, shown

if TYPE_CHECKING:
    from snapforensics.analysis.context import DeviceAnalysis
    from snapforensics.snapshot.model import Snapshot

# (name, path fragments of its frames): a frame's normalized filename containing one of them
_PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("megatron", ("megatron/",)),  # megatron/core, /training, /legacy; pre-core megatron/mpu
    ("torchtitan", ("torchtitan/",)),
    ("lightning", ("lightning/pytorch/", "pytorch_lightning/")),
    ("fabric", ("lightning/fabric/", "lightning_fabric/")),
    ("hf_trainer", ("transformers/trainer.py", "transformers/trainer_utils.py")),
    ("accelerate", ("accelerate/",)),
    ("deepspeed", ("deepspeed/",)),  # its engine alone (the Trainer and accelerate drive it too)
    ("transformers", ("transformers/",)),
)
_FSDP2_FILES = ("fsdp/_fully_shard/", "_composable/fsdp/")
_FSDP1_FILES = ("fsdp/fully_sharded_data_parallel.py", "fsdp/_flat_param.py",
                "fsdp/_runtime_utils.py")
_MODULE = re.compile(r"^([A-Za-z_]\w*?)_(\d+)$")
_UNIT = re.compile(r"^([A-Za-z_][\w.]*)\.(\d{1,9})$")
# Path segments a wrapper module adds between the user's module and its parameters, so a unit
# is named `model.layers.0._checkpoint_wrapped_module` when the layer is wrapped (accelerate's
# FSDP2 activation_checkpointing): checkpoint_wrapper's `_CHECKPOINT_WRAPPED_MODULE`
# (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py), FSDP1's
# `FSDP_WRAPPED_MODULE` (fsdp/_common_utils.py), torch.compile's `OptimizedModule._orig_mod`.
_WRAPPER = re.compile(r"\.(?:_checkpoint_wrapped_module|_fsdp_wrapped_module|_orig_mod)(?=\.|$)")


@dataclass(frozen=True)
class Layer:
    """The user's repeated block: its class (None when the run does not show it) and where the
    run puts its instances (`container` "model.layers", indices 0..3)."""

    cls: str | None
    container: str | None
    indices: tuple[int, ...] = ()

    @property
    def path(self) -> str | None:
        """"model.layers.N (N = 0-3)" style, as the run names the units."""
        if not self.container:
            return None
        return f"{self.container}.N" + (f" (N = {_span(self.indices)})" if self.indices else "")


@dataclass(frozen=True)
class Framework:
    owner: str  # megatron | torchtitan | lightning | fabric | hf_trainer | accelerate | torch
    packages: tuple[str, ...]  # every framework package seen, outermost first
    fsdp: str | None  # "FSDP2" | "FSDP2 replicate" | "FSDP1" | None
    layer: Layer = field(default_factory=lambda: Layer(None, None))
    evidence: tuple[str, ...] = ()
    # the pipeline stage this file is (`pipeline`), None when it shows no pipeline schedule
    pipeline: dict[str, Any] | None = None

    @property
    def hf_model(self) -> bool:
        return "transformers" in self.packages or "hf_trainer" in self.packages

    @property
    def label(self) -> str:
        """One line for the report: "HF Trainer (accelerate, transformers), FSDP2"."""
        rest = [_LABEL[p] for p in self.packages if p != self.owner]
        s = _LABEL[self.owner] + (f" ({', '.join(rest)})" if rest else "")
        return s + (f", {self.fsdp}" if self.fsdp else "")

    def to_dict(self) -> dict[str, Any]:
        return {"owner": self.owner, "label": self.label, "packages": list(self.packages),
                "fsdp": self.fsdp, "layer_class": self.layer.cls,
                "layer_container": self.layer.container,
                "layer_indices": list(self.layer.indices), "evidence": list(self.evidence),
                "pipeline": self.pipeline}


_LABEL = {"megatron": "Megatron-Core", "torchtitan": "torchtitan", "lightning": "Lightning Trainer",
          "fabric": "Lightning Fabric", "hf_trainer": "HF Trainer", "accelerate": "accelerate",
          "deepspeed": "DeepSpeed",
          "transformers": "transformers", "torch": "plain torch"}


def _span(ix: tuple[int, ...]) -> str:
    if len(ix) > 1 and list(ix) == list(range(ix[0], ix[-1] + 1)):
        return f"{ix[0]}-{ix[-1]}"
    return ", ".join(map(str, ix))


def detect(snapshot: Snapshot, analyses: list[DeviceAnalysis]) -> Framework:
    files = {f.filename.replace("\\", "/") for f in snapshot.frames}
    seen: list[str] = []
    evidence: list[str] = []
    for name, frags in _PACKAGES:
        # the first matching file in name order: a set's order follows PYTHONHASHSEED
        hit = min((fn for fn in files for fr in frags if fr in fn), default=None)
        if hit is not None:
            seen.append(name)
            evidence.append(f"{name}: frames from {_short(hit)}")
    cmd = snapshot.provenance.get("command") if isinstance(snapshot.provenance, dict) else None
    if "torchtitan" not in seen and isinstance(cmd, (list, tuple)) and \
            any(isinstance(c, str) and c.startswith("torchtitan") for c in cmd):
        seen.insert(0, "torchtitan")
        evidence.append("torchtitan: the recorded command runs a torchtitan module")
    modules = {f.name for f in snapshot.frames if f.filename == "<nn.Module>"}
    fsdp = None
    if any(fr in fn for fn in files for fr in _FSDP2_FILES) or \
            any(m.startswith("FSDP") and not m.startswith("FullyShardedDataParallel")
                for m in modules):
        fsdp = "FSDP2"
    elif any(fn.endswith(_FSDP1_FILES) for fn in files) or \
            any(m.startswith("FullyShardedDataParallel_") for m in modules):
        fsdp = "FSDP1"
    if fsdp == "FSDP2" and any(a.fsdp.replicated for a in analyses):
        fsdp = "FSDP2 replicate"  # replicate(): FSDP2's machinery, nothing sharded
    if fsdp:
        evidence.append(f"{fsdp}: FSDP's own frames")
    owner = next((p for p in seen if p != "transformers"), "torch")
    return Framework(owner, tuple(seen), fsdp, _layer(analyses), tuple(evidence),
                     pipeline(snapshot, analyses))


def pipeline(snapshot: Snapshot, analyses: list[DeviceAnalysis]) -> dict[str, Any] | None:
    """The pipeline stage this file is, None when it shows no pipeline schedule:
    `stage` / `stages` (the rank's place along pp, analysis/mesh.py: its pipeline group where the
    recorder noted the process groups, else one stage per rank; None when unknown) and
    `schedule`.

    torch.distributed.pipelining (`torch/distributed/pipelining/`): "gpipe" when the ranges
    ScheduleGPipe alone opens (`Forward i` / `Backward i`) show every forward of each step before
    its first backward, "interleaved_1f1b" where the recorder's marks show a rank running several
    stages, "zero_bubble" where a stage computed weight gradients apart from its backward
    (`backward_weight_one_chunk`, the zero-bubble schedules), "1f1b" otherwise (Schedule1F1B
    opens no such ranges and starts backwards during the forwards). Megatron-Core (`megatron/core/
    pipeline_parallel/schedules.py`): its pipelined schedules are 1F1B
    (`forward_backward_pipelining_without_interleaving`) or interleaved 1F1B (`..._with_
    interleaving`); without its pipeline group, its stage is the rank only where the file shows no
    tensor-parallel collective (Megatron orders ranks tp fastest, pp slowest: with TP the rank is
    not the stage). DeepSpeed's PipelineEngine (`deepspeed/runtime/pipe/engine.py`): its
    TrainSchedule is synchronous 1F1B (`schedule.py`: a stage keeps as many buffers as the
    micro-batches in flight, the index difference between it and the last stage); its groups are
    unnamed, so its stage is the recorder's note of the engine's (`pipeline_stages`) or the rank
    where the pipeline is the world. Under 1F1B stage s holds at most min(M, S - s)
    micro-batches' activations: the first stage holds the most."""
    from snapforensics.analysis.forecast.pipeline import (
        all_forward_first,
        gpipe_ranges,
        marked_stages,
        zero_bubble,
    )

    names, deepspeed, torch_pp = set(), False, False  # one pass over the frames
    for f in snapshot.frames:
        fn = f.filename.replace("\\", "/")
        if fn.endswith(_MEGATRON_SCHEDULES):
            names.add(f.name)
        deepspeed = deepspeed or fn.endswith(DEEPSPEED_PIPE)
        torch_pp = torch_pp or "distributed/pipelining/" in fn
    megatron = names & set(_MEGATRON_PIPELINED)
    if not (megatron or deepspeed or torch_pp):
        return None
    # the rank is the stage where no group names it only when the blocks show no other
    # dimension (TP's redistributions, FSDP's gathers)
    layout = mesh(snapshot.provenance, shown(c for d in analyses for c in d.present))
    stage, stages = layout.index("pp"), layout.degree("pp")
    ok = stage is not None and stages is not None
    if megatron or deepspeed:
        return {"stage": stage if ok else None, "stages": stages if ok else None,
                "schedule": _MEGATRON_PIPELINED[min(megatron)] if megatron else "1f1b"}
    steps = [st for d in analyses if d.lt.rows for st in gpipe_ranges(d) if st]
    if zero_bubble(snapshot):
        schedule = "zero_bubble"  # weight gradients apart from the backward (I/W split)
    elif steps and all(all_forward_first(st) for st in steps):
        schedule = "gpipe"
    elif any(len(marked_stages(d)) > 1 for d in analyses):  # the recorder's marks
        schedule = "interleaved_1f1b"
    else:
        schedule = "1f1b"
    return {"stage": stage if ok else None, "stages": stages if ok else None,
            "schedule": schedule}


_MEGATRON_SCHEDULES = "megatron/core/pipeline_parallel/schedules.py"
DEEPSPEED_PIPE = "deepspeed/runtime/pipe/engine.py"
_MEGATRON_PIPELINED = {"forward_backward_pipelining_without_interleaving": "1f1b",
                       "forward_backward_pipelining_with_interleaving": "interleaved_1f1b"}


def _short(fn: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in fn:
            return fn.split(marker, 1)[1]
    return fn[-80:]


def _layer(analyses: list[DeviceAnalysis]) -> Layer:
    """The repeated block: container and indices from unit names, class from module frames."""
    units = {i.module for d in analyses for i in d.infos if i.module}
    by_container: dict[str, set[int]] = {}
    for u in units:
        m = _UNIT.match(_WRAPPER.sub("", u))
        if m:
            by_container.setdefault(m.group(1), set()).add(int(m.group(2)))
    container = max(by_container, key=lambda c: (len(by_container[c]), -c.count("."), c)) \
        if by_container else None
    indices = tuple(sorted(by_container[container])) if container else ()
    cls = _layer_class(analyses, len(indices))
    return Layer(cls, container, indices)


def _layer_class(analyses: list[DeviceAnalysis], repeats: int) -> str | None:
    """The outermost module class with `repeats` instances (any repeated class when the run
    names no units) among the module frames of the run's stacks."""
    if not analyses:
        return None
    snap = analyses[0].snapshot
    if not any(f.filename == "<nn.Module>" for f in snap.frames):
        return None  # only the CPU recorder writes module frames
    inst: dict[str, set[str]] = {}
    inside: set[tuple[str, str]] = set()  # (outer, inner) seen nested on some stack
    for d in analyses:
        for s in np.unique(d.lt.stack).tolist():
            frames = snap.stack_frames(s) if s >= 0 else []
            outer: list[str] = []
            for f in reversed(frames):  # outermost first
                m = _MODULE.match(f.name) if f.filename == "<nn.Module>" else None
                if not m:
                    continue
                c = m.group(1)
                if c.startswith("FSDP") and len(c) > 4 and c != "FullyShardedDataParallel":
                    c = c[4:]  # FSDP2's dynamic class FSDP<Class>
                elif c.startswith("Replicate") and len(c) > 9:
                    c = c[9:]  # replicate()'s Replicate<Class>
                inst.setdefault(c, set()).add(m.group(2))
                inside.update((o, c) for o in outer if o != c)
                outer.append(c)
    skip = {"FullyShardedDataParallel", "CheckpointWrapper", "Linear", "Embedding", "Dropout",
            "LayerNorm", "ModuleList", "Sequential"}
    cands = [c for c, v in inst.items() if c not in skip and len(v) > 1 and
             (not repeats or len(v) == repeats)]
    # the outermost repeated class (the block, not the attention or a Linear inside it): a
    # recompute's stack may start inside the block, so "outer" is read from nesting, not depth
    top = [c for c in cands if not any((o, c) in inside for o in cands)]
    return min(top or cands, key=lambda c: (-len(inst[c]), c)) if cands else None
