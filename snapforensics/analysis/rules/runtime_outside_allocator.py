"""Device memory PyTorch's caching allocator does not hold: what the device reports in use
(`cudaMemGetInfo`, all processes and the driver) minus what the allocator reserved, sampled by
`snapforensics record` at the start, after every optimizer step and at the end (CUDA/NPU; the
recorder's `device_memory` block). It is the CUDA/CANN context (a few hundred MiB per process),
NCCL/HCCL communicators' buffers (per communicator and peer, made on first use of each process
group: the gap grows in the first steps, then stays), cuBLAS/cuDNN workspaces, memory of other
libraries (cupy, TransformerEngine's userbuffers, NCCL user buffers) or of other processes on the
same device. What the job pays to run, not a block any rule can move: verdict expected.

A gap that keeps growing after the first steps is called out (the growth after step 1, from its
sample to the last): beyond communicator creation that is memory held outside PyTorch and never
given back. Threshold: more than 64 MiB, a size NCCL's default 4 MiB buffers reach only with a new
communicator of 16 channels, which a steady training loop does not make.
"""

from __future__ import annotations

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding
from snapforensics.analysis.evidence import human
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.vocab import Verdict

GROWTH = 64 << 20


def samples(d: DeviceAnalysis) -> list[dict]:
    """The recorder's samples, each with its gap, keeping only well-formed ones."""
    block = d.snapshot.provenance.get("device_memory")
    rows = block.get("samples") if isinstance(block, dict) else None
    out = []
    for s in rows if isinstance(rows, list) else []:
        if not isinstance(s, dict):
            continue
        used, reserved = s.get("used_bytes"), s.get("reserved_bytes")
        if type(used) is int and type(reserved) is int and used >= 0 and reserved >= 0:
            step = s.get("step")  # the recorder writes an int, "start" or "end": nothing else
            step = step if type(step) is int or step in ("start", "end") else None
            out.append({"step": step, "used_bytes": used,
                        "reserved_bytes": reserved, "gap_bytes": used - reserved})
    return out


def check(d: DeviceAnalysis) -> list[Finding]:
    rows = samples(d)
    if not rows or d.device != min(d.snapshot.devices or [d.device]):
        return []  # one finding per file: the samples are of the rank's own device
    worst = max(rows, key=lambda r: r["gap_bytes"])
    steps = [r for r in rows if type(r["step"]) is int]
    growth = steps[-1]["gap_bytes"] - steps[0]["gap_bytes"] if len(steps) >= 2 else 0
    cause = (f"The device reported {human(worst['used_bytes'])} in use at step "
             f"{worst['step']} while PyTorch's allocator reserved "
             f"{human(worst['reserved_bytes'])}: {human(worst['gap_bytes'])} outside the "
             "allocator, which no snapshot block shows. Usually the CUDA/CANN context, "
             "NCCL/HCCL communicators' buffers (made when each process group is first used), "
             "cuBLAS/cuDNN workspaces, other libraries' memory, or another process on the "
             "device.")
    if growth > GROWTH:
        cause += (f" It grew by {human(growth)} from step {steps[0]['step']} to step "
                  f"{steps[-1]['step']}: memory held outside PyTorch and not given back "
                  "(a communicator made per step, a library's cache).")
    return [Finding(
        rule=RULE.id, verdict=Verdict.EXPECTED,
        title="Device memory outside PyTorch's allocator", cause=cause,
        bytes=worst["gap_bytes"], blocks=0, device=d.device,
        evidence={"samples": rows[:64], "worst_step": worst["step"],
                  "growth_bytes": growth})]


RULE = Rule(
    id="runtime.memory_outside_allocator", check=check, family=Family.LIFECYCLE,
    verdicts=frozenset({Verdict.EXPECTED}), fix=None, segments_only=True)
