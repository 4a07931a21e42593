"""Edits of real recordings into shapes our CPU recorder cannot make (each test says it edits).

`cuda_shaped(raw, annotations)`: what a CUDA recording of the same run looks like. On CUDA the
autograd engine runs backward on a device thread: an allocation made by a backward op has no
Python frames at all, and one made inside a hook (FSDP pre/post-backward, the checkpoint unpack
hook) only has the hook's own frames, not `loss.backward()`'s. Profiler op, module and
record_function frames do not exist either; the ranges come as `external_annotations` (or, with
`annotations=False`, not at all). Every stack is cut at the autograd engine boundary and
stripped of non-Python frames, and the recorder's provenance is dropped.

`edited_corpus_file(name, edit)`: the Diagnosis of a corpus file after `edit(raw)` changed a copy
of its raw dict (skips when the corpus is absent).
"""

from __future__ import annotations

import copy

from corpus import corpus_file

from snapforensics.analysis import diagnose
from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.snapshot import normalize, read_raw

ENGINE = {"_engine_run_backward", "run_backward"}
PSEUDO = ("<op>", "<record_function>", "<nn.Module>", "<snapforensics>")


def cuda_shaped(raw: dict, annotations: bool = True) -> dict:
    cache: dict[int, list] = {}

    def cut(frames):
        if not frames:
            return frames
        key = id(frames)
        if key not in cache:
            names = [f["name"] for f in frames]
            in_bw = any(n in ENGINE for n in names) or any(
                n.startswith("autograd::engine::evaluate_function") for n in names)
            out = []
            for f in frames:  # innermost first; stop at the engine boundary
                if in_bw and (f["name"].startswith("autograd::engine::") or f["name"] in ENGINE):
                    break
                if f["filename"] not in PSEUDO:
                    out.append(f)
            cache[key] = out
        return cache[key]

    for trace in raw["device_traces"]:
        for e in trace:
            if "frames" in e:
                e["frames"] = cut(e["frames"])
    for seg in raw["segments"]:
        seg["frames"] = cut(seg.get("frames"))
        for b in seg["blocks"]:
            b["frames"] = cut(b.get("frames"))
    if not annotations:
        raw.pop("external_annotations", None)
    raw.pop("snapforensics", None)  # look like a foreign file: no provenance
    return raw


def edited_corpus_file(name: str, edit) -> Diagnosis:
    raw, _ = read_raw(corpus_file(name))
    raw = copy.deepcopy(raw)
    edit(raw)
    return diagnose(normalize(raw, source=f"edited-{name}"))
