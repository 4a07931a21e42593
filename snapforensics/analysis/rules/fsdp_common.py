"""What the FSDP rules share: unshard events and units, the world size, counterfactual replays.

Not a rule (no RULE / check): the `fsdp_*` rule modules import it. Everything is computed from
the per-block arrays of a DeviceAnalysis and cached on it, so each rule stays one numpy pass.

An *unshard event* is one all-gather of one FSDP unit: for FSDP2 the run of per-parameter
unsharded-param blocks that one `foreach_all_gather_copy_out` allocates back to back, for FSDP1
the padded unsharded flat parameter (`_alloc_padded_unsharded_flat_param`, which is the
all-gather output itself). A *unit* is named by its FQN when the trace carries FSDP2's
`FSDP::... (fqn)` ranges (the root is "(root)"); otherwise events stand for units.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from snapforensics.analysis.classify import (
    ALL_GATHER,
    BACKWARD,
    RECOMPUTE,
    REDUCE_SCATTER,
    SHARDED_GRAD,
    UNSHARDED_PARAM,
)
from snapforensics.analysis.context import CAT_CODE, DeviceAnalysis

ROOT = "(root)"

# Transient copies a collective backend makes of an all-gather buffer (gloo's same-size buffer,
# c10d's list all-gather): not a unit's unsharded memory.
_BACKEND_PREFIXES = ("c10d::", "gloo:", "nccl:", "hccl:")
# All-gather *inputs* (the shard cast to param_dtype): FSDP2, FSDP1's `_mp_shard`.
_AG_INPUT_FUNCS = {"_get_param_all_gather_inputs", "_use_low_precision_shard"}
_FSDP1_FLAT = "_alloc_padded_unsharded_flat_param"
_C10D = "<c10d>"
_C10D_FILES = ("distributed/distributed_c10d.py", "distributed/c10d_logger.py",
               "distributed/_functional_collectives.py")


@dataclass
class Facts:
    names: dict[int, frozenset] = field(default_factory=dict)
    primary: np.ndarray | None = None  # bool per block: a unit's full unshard output
    ag_input: np.ndarray | None = None  # bool per block: an all-gather input (mp shard)
    fsdp1_flat: np.ndarray | None = None  # bool per block: FSDP1 unsharded flat param
    event: np.ndarray | None = None  # int per block: unshard event id, -1 if none
    stale: np.ndarray | None = None  # bool per block: unshard made in backward, never used
    world: int | None = None
    world_estimated: bool = False  # from reduce-scatter sizes near each other, not the recorder


def facts(d: DeviceAnalysis) -> Facts:
    def compute() -> Facts:
        f = Facts()
        _stack_flags(d, f)
        f.event = _events(d, f)
        return f

    return d.memo("fsdp_facts", compute)


def stack_names(d: DeviceAnalysis, stack_id: int, f: Facts | None = None) -> frozenset:
    """Frame names of a stack, plus the marker _C10D when a frame is in the c10d Python layer
    (the collective's own allocation, e.g. gloo's same-size all-gather buffer)."""
    f = f or facts(d)
    s = f.names.get(stack_id)
    if s is None:
        frames = d.snapshot.stack_frames(stack_id) if stack_id >= 0 else []
        names = {fr.name for fr in frames}
        if any(fr.filename.replace("\\", "/").endswith(_C10D_FILES) for fr in frames):
            names.add(_C10D)
        s = f.names[stack_id] = frozenset(names)
    return s


def _stack_flags(d: DeviceAnalysis, f: Facts) -> None:
    n = len(d.lt)
    f.primary = np.zeros(n, bool)
    f.ag_input = np.zeros(n, bool)
    f.fsdp1_flat = np.zeros(n, bool)
    ag = d.category == CAT_CODE[ALL_GATHER]
    un = d.category == CAT_CODE[UNSHARDED_PARAM]
    for b in np.flatnonzero(ag | un).tolist():
        names = stack_names(d, int(d.lt.stack[b]), f)
        if un[b]:
            if _FSDP1_FLAT in names:
                f.fsdp1_flat[b] = f.primary[b] = True
            continue
        if names & _AG_INPUT_FUNCS:
            f.ag_input[b] = True
        elif names and _C10D not in names and \
                not any(x.startswith(_BACKEND_PREFIXES) for x in names):
            # FSDP allocates its all-gather output from Python (`allocate`, `all_gather_copy_in`):
            # a frameless all-gather block is a collective's worker-thread buffer.
            f.primary[b] = True


def _events(d: DeviceAnalysis, f: Facts) -> np.ndarray:
    """Group unsharded-param blocks into unshard events (see the module docstring)."""
    ev = np.full(len(d.lt), -1, np.int64)
    idx = np.flatnonzero((d.category == CAT_CODE[UNSHARDED_PARAM]) & (d.lt.alloc_row >= 0))
    if not idx.size:
        return ev
    idx = idx[np.argsort(d.lt.alloc_row[idx], kind="stable")]
    cur = -1
    prev = None
    for b in idx.tolist():
        key = (d.module_of(b), int(d.phase[b]), int(d.path[b]), int(d.iteration[b]))
        new = prev is None or f.fsdp1_flat[b] or b != prev[0] + 1 or key != prev[1] or \
            f.fsdp1_flat[prev[0]]
        if new:
            cur += 1
        ev[b] = cur
        prev = (b, key)
    return ev


def unit_of_event(d: DeviceAnalysis, blocks: np.ndarray) -> str | None:
    mods = {d.module_of(b) for b in blocks.tolist()} - {None}
    return next(iter(mods)) if len(mods) == 1 else None


def world_size(d: DeviceAnalysis) -> int | None:
    """The recorder's world size, else the reduce-scatter input/output ratio of one unit: an
    estimate (pairs found within a window of rows), flagged by `facts(d).world_estimated`."""
    f = facts(d)
    if f.world is not None:
        return f.world or None
    w = d.snapshot.provenance.get("world_size") if isinstance(d.snapshot.provenance, dict) \
        else None
    if not (isinstance(w, int) and w >= 1):
        w = 0
        rs = np.flatnonzero(d.mask(REDUCE_SCATTER))
        sg = np.flatnonzero(d.mask(SHARDED_GRAD))
        ratios = []
        if rs.size and sg.size:
            rs_rows = d.lt.alloc_row[rs]
            for b in sg.tolist():  # the reduce input is allocated a few rows from its output
                a, n = int(d.lt.alloc_row[b]), int(d.lt.size[b])
                near = rs[(np.abs(rs_rows - a) <= 64) & (d.lt.size[rs] > n)]
                if near.size and n:
                    nearest = near[np.argmin(np.abs(d.lt.alloc_row[near] - a))]
                    ratios.append(int(d.lt.size[nearest]) / n)
        if ratios:
            r = float(np.median(ratios))
            if r >= 1.5 and abs(r - round(r)) < 0.1:
                w = int(round(r))
                f.world_estimated = True
    f.world = w
    return w or None


def stale_unshards(d: DeviceAnalysis) -> np.ndarray:
    """Unshards made during backward that nothing used: freed only when backward finalizes.

    A block counts when it is a unit's all-gather output (or FSDP1 flat parameter) allocated in
    backward/recompute, freed before its iteration's backward ends (later is the not-resharded
    bug) and released only by FSDP's end-of-backward cleanup (`finalize_backward`, FSDP1
    `_catch_all_reshard`): freed after that backward's last reduce-scatter. When units are named,
    an FSDP2 all-gather buffer must also be unused (no copy-out of its unit while it was alive),
    and then also counts when it outlived two other units' all-gathers.
    """
    f = facts(d)
    if f.stale is not None:
        return f.stale
    out = np.zeros(len(d.lt), bool)
    cand = f.primary & np.isin(d.phase, [BACKWARD, RECOMPUTE]) & (d.iteration >= 0) & \
        (d.lt.alloc_row >= 0)
    rs = np.flatnonzero(d.mask(REDUCE_SCATTER, SHARDED_GRAD) & (d.iteration >= 0))
    un = np.flatnonzero(d.mask(UNSHARDED_PARAM) & ~f.fsdp1_flat)
    last_rs: dict[int, int] = {}
    for b in rs.tolist():
        it = int(d.iteration[b])
        last_rs[it] = max(last_rs.get(it, -1), int(d.lt.alloc_row[b]))
    acc: dict[str, list[int]] = {}
    for b in un.tolist():
        m = d.module_of(b)
        if m is not None:
            acc.setdefault(m, []).append(int(d.lt.alloc_row[b]))
    un_by_mod = {m: np.array(sorted(v), np.int64) for m, v in acc.items()}
    prim = np.flatnonzero(f.primary & (d.lt.alloc_row >= 0))
    prim = prim[np.argsort(d.lt.alloc_row[prim], kind="stable")]
    prim_rows = d.lt.alloc_row[prim]
    for b in np.flatnonzero(cand).tolist():
        it = d.tl.iterations[int(d.iteration[b])]
        a, fr = int(d.lt.alloc_row[b]), int(d.lt.free_row[b])
        if it.backward_end < 0 or fr > it.backward_end:
            continue
        lr = last_rs.get(it.index, -1)
        tail = lr >= 0 and a < lr < fr
        m = d.module_of(b)
        if m is None or f.fsdp1_flat[b]:
            out[b] = tail  # unnamed: released only by the final callback
            continue
        rows = un_by_mod.get(m, np.zeros(0, np.int64))
        lo, hi = np.searchsorted(rows, [a, fr], side="right")
        if hi > lo:
            continue  # its unit copied out of it: used
        # unused, and released at the end or alive across two other units' all-gathers
        lo, hi = np.searchsorted(prim_rows, [a, fr], side="right")
        if tail or len({d.module_of(o) for o in prim[lo:hi].tolist()} - {m}) >= 2:
            out[b] = True
    f.stale = out
    return out


def forward_end(it) -> int:
    """Last row of an iteration's forward (the row before its backward starts)."""
    return (it.backward_start - 1) if it.backward_start >= 0 else it.end
