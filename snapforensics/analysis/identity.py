"""Which tensor each block is: the recorder's names (`snapshot/tensors.py`) joined to blocks.

An observation (storage data pointer `ptr`, time `t`) names the block at address `ptr` that is
alive at the trace row the time falls in (the last row at or before `t`): an address the
allocator hands out again later is another block, and the observation of one never names the
other. Where no block at `ptr` is alive at that row (the device clock and the recorder's differ
by some microseconds on CUDA), the block at `ptr` allocated within `SKEW_US` after it is taken.
A trace without times (torch_npu's snapshot writes none: `THNPModule_memorySnapshot`) cannot
place an observation in it: there an observation names the block at `ptr` only when `ptr` held
one block in the whole trace (no reuse to confuse), and addresses reused stay unnamed.

A block seen under several identities (FSDP2's reduce-scatter output holds a unit's sharded
gradients, one view each) gets all their names in offset order; its kind is the strongest
(`PRIORITY`) and its `module` the modules' common dotted prefix. A block saved for backward
keeps that fact (`saved`) whatever else it is (a linear's weight is saved too).

For dumps without names (`torch.cuda.memory._dump_snapshot`), `without_names` says what the
frames and record_function ranges can tell, and `RECIPE` gives the next dump names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from snapforensics.snapshot.tensors import KINDS, Identity, TensorTable

SKEW_US = 1000.0
# the kind a block shows when several name it, strongest first
PRIORITY = ("parameter", "unsharded_parameter", "gradient", "optimizer_state",
            "unsharded_gradient", "all_gather_buffer", "saved_for_backward")
_RANK = np.array([PRIORITY.index(k) for k in KINDS], np.int64)
SAVED = KINDS.index("saved_for_backward")
WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_fsdp_wrapped_module|_orig_mod|module)"
                      r"(?=\.|$)")
RECIPE = ("torch.cuda.memory._record_memory_history(max_entries=1_000_000); "
          "with snapforensics.record.names(model, optimizer, path=\"snap.pickle\"): train()")


@dataclass
class BlockNames:
    """Per block of one device (`lt` order): its identity, -1 when unnamed."""

    table: TensorTable
    ident: np.ndarray  # int32: the block's primary identity
    saver: np.ndarray  # int32: the first saved_for_backward identity, -1 when not saved
    extra: dict[int, list[int]]  # block -> every identity naming it, offset order (when > 1)
    matched: int  # observations that found their block
    observations: int  # observations of this device
    # tensor parallelism: the most ways TP splits a tensor seen in the block (1: replicated,
    # 0: unknown), and the block's bytes in tensors TP splits (distinct views summed)
    tp: np.ndarray  # int32
    tp_bytes: np.ndarray  # int64

    @property
    def saved(self) -> np.ndarray:
        return self.saver >= 0

    def identity(self, b: int) -> Identity | None:
        i = int(self.ident[b])
        return self.table.identities[i] if i >= 0 else None

    def kind(self, b: int) -> str | None:
        i = self.identity(b)
        return i.kind if i is not None else None

    def tensor(self, b: int) -> str | None:
        ids = self.extra.get(int(b))
        if ids:
            names = [n for n in dict.fromkeys(self.table.identities[i].tensor for i in ids) if n]
            return ", ".join(names) if names else None
        i = self.identity(b)
        return i.tensor if i is not None else None

    def module(self, b: int) -> str | None:
        i = self.identity(b)
        if i is None:
            return None
        if i.kind == "saved_for_backward" and self.saver[b] >= 0:
            return self.table.identities[int(self.saver[b])].module
        ids = self.extra.get(int(b))
        if ids:
            return common_module([self.table.identities[j].module for j in ids]) or i.module
        return i.module

    @cached_property
    def kinds(self) -> np.ndarray:
        """int8 per block: index into KINDS of its primary identity, -1 unnamed."""
        k = np.array([KINDS.index(i.kind) for i in self.table.identities] or [0], np.int8)
        return np.where(self.ident >= 0, k[np.clip(self.ident, 0, None)], -1).astype(np.int8)


def common_module(modules: list[str | None]) -> str | None:
    parts = [m.split(".") for m in modules if m]
    if not parts:
        return None
    out = []
    for segs in zip(*parts):
        if len(set(segs)) != 1:
            break
        out.append(segs[0])
    return ".".join(out) or None


def join(table: TensorTable, lt, trace) -> BlockNames:
    """The names of the blocks in `lt` (one device's lifetimes) from `table`."""
    nblocks = len(lt)
    ident = np.full(nblocks, -1, np.int32)
    saver = np.full(nblocks, -1, np.int32)
    dev = np.array([i.device for i in table.identities] or [0], np.int64)
    mine = np.flatnonzero(dev[table.identity] == lt.device) if len(table) else np.zeros(0, int)
    empty = BlockNames(table, ident, saver, {}, 0, len(mine), np.zeros(nblocks, np.int32),
                       np.zeros(nblocks, np.int64))
    t = trace.time_us
    if not len(mine) or not nblocks or not len(t):
        return empty
    uniq, addr_rank, per_addr = np.unique(lt.addr, return_inverse=True, return_counts=True)
    if np.isnan(t).all():  # untimed (torch_npu): addresses that held one block only
        ptr = table.ptr[mine]
        g = np.searchsorted(uniq, ptr)
        gc = np.clip(g, 0, len(uniq) - 1)
        single = (g < len(uniq)) & (uniq[gc] == ptr) & (per_addr[gc] == 1)
        first_at = np.full(len(uniq), -1, np.int64)
        first_at[addr_rank[::-1]] = np.arange(nblocks)[::-1]
        return _named(table, mine, np.where(single, first_at[gc], -1), ident, saver)
    if np.isnan(t).any() or (np.diff(t) < 0).any():
        return empty
    ptr, when = table.ptr[mine], table.time_us[mine]
    row = np.searchsorted(t, when, side="right") - 1  # -1: before the first row
    # blocks by (address, alloc row): the block at ptr alive at row, by one search
    span = np.int64(lt.rows + 2)
    bkey = addr_rank.astype(np.int64) * span + (lt.alloc_row + 1)
    order = np.argsort(bkey, kind="stable")
    skey = bkey[order]
    g = np.searchsorted(uniq, ptr)
    known = (g < len(uniq)) & (uniq[np.clip(g, 0, len(uniq) - 1)] == ptr)
    okey = g.astype(np.int64) * span + (row + 1)
    pos = np.searchsorted(skey, okey, side="right") - 1
    cand = order[np.clip(pos, 0, None)]
    hit = known & (pos >= 0) & (addr_rank[cand] == g) & (lt.alloc_row[cand] <= row) & \
        (lt.free_row[cand] > row)
    # clock skew: the next block at ptr, allocated just after the observation
    nxt = order[np.clip(pos + 1, 0, len(order) - 1)]
    alloc_t = t[np.clip(lt.alloc_row[nxt], 0, len(t) - 1)]
    late = ~hit & known & (pos + 1 < len(order)) & (addr_rank[nxt] == g) & \
        (lt.alloc_row[nxt] > row) & (alloc_t - when <= SKEW_US)
    return _named(table, mine, np.where(hit, cand, np.where(late, nxt, -1)), ident, saver)


def _named(table: TensorTable, mine: np.ndarray, block: np.ndarray, ident: np.ndarray,
           saver: np.ndarray) -> BlockNames:
    """The names from the observations `mine`, each of the block `block` (-1: none)."""
    ok = block >= 0
    obs = mine[ok]
    block = block[ok]
    ids = table.identity[obs].astype(np.int64)
    kinds = np.array([KINDS.index(i.kind) for i in table.identities], np.int64)[ids]
    off = table.offset[obs]
    # primary identity: strongest kind, then smallest offset, then the first seen
    o = np.lexsort((np.arange(len(obs)), off, _RANK[kinds], block))
    first = np.ones(len(o), bool)
    first[1:] = block[o][1:] != block[o][:-1]
    ident[block[o][first]] = ids[o][first]
    # the first saver of each saved block (by time)
    sv = np.flatnonzero(kinds == SAVED)
    if len(sv):
        so = sv[np.lexsort((table.time_us[obs][sv], block[sv]))]
        f = np.ones(len(so), bool)
        f[1:] = block[so][1:] != block[so][:-1]
        saver[block[so][f]] = ids[so][f]
    # blocks named by more than one distinct non-saved identity: all of them, offset order
    extra: dict[int, list[int]] = {}
    ns = kinds != SAVED
    if ns.any():
        pairs = sorted(set(zip(block[ns].tolist(), off[ns].tolist(), ids[ns].tolist())))
        by: dict[int, list[int]] = {}
        for b, _, i in pairs:
            lst = by.setdefault(b, [])
            if i not in lst:
                lst.append(i)
        extra = {b: v for b, v in by.items() if len(v) > 1}
    tp, tp_bytes = _tp(table, obs, block, ids, len(ident))
    return BlockNames(table, ident, saver, extra, int(ok.sum()), len(mine), tp, tp_bytes)


def _tp(table: TensorTable, obs: np.ndarray, block: np.ndarray, ids: np.ndarray,
        nblocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block: the most ways TP splits a tensor seen in it, and its bytes in split tensors
    (each distinct (offset, nbytes) view once: a tensor saved by several ops is one)."""
    tp = np.zeros(nblocks, np.int32)
    tp_bytes = np.zeros(nblocks, np.int64)
    split = np.array([i.tp for i in table.identities] or [0], np.int64)[ids]
    np.maximum.at(tp, block, split.astype(np.int32))
    sp = split > 1
    if sp.any():
        views = np.unique(np.stack([block[sp], table.offset[obs][sp], table.nbytes[obs][sp]]),
                          axis=1)
        np.add.at(tp_bytes, views[0], views[2])
    return tp, tp_bytes


def layer_of(module: str | None) -> str:
    """The repeated layer a module belongs to: wrapper segments dropped, the path up to its
    first numeric segment (`layers.3.mlp.w1` -> `layers.3`), else its first segment."""
    if not module:
        return "(no module)"
    m = WRAPPERS.sub("", module).strip(".") or module
    segs = m.split(".")
    for i, s in enumerate(segs):
        if s.isdigit():
            return ".".join(segs[:i + 1])
    return segs[0]


def _natural(s: str) -> list:
    # a digit run as (its length, itself) without leading zeros, not int(): a name from a
    # snapshot may hold more digits than int() converts (4300, Python 3.11+)
    return [(len(x.lstrip("0")), x.lstrip("0")) if i % 2 else x
            for i, x in enumerate(re.split(r"(\d+)", s))]


def summary(d, names: BlockNames, rows: int = 24) -> dict:
    """What the device summary carries: the named bytes at the peak, by kind; the tensors saved
    for backward alive at the peak, by layer (and the modules inside each); the largest named
    tensors at the peak."""
    lt = d.lt
    out: dict = {"recorded": True, "observations": names.observations,
                 "matched": names.matched}
    if d.peak_row < 0:
        return out
    alive = np.flatnonzero(lt.alive_at(d.peak_row))
    kinds = names.kinds[alive]
    size = lt.size[alive]
    out["named_bytes_at_peak"] = int(size[kinds >= 0].sum())
    out["bytes_at_peak"] = int(size.sum())
    out["by_kind_at_peak"] = {KINDS[k]: int(size[kinds == k].sum())
                              for k in sorted(set(kinds.tolist()) - {-1})}
    act = alive[(kinds == SAVED)]
    layers: dict[str, dict] = {}
    for b in act.tolist():
        mod = names.module(b)
        lay = layer_of(mod)
        e = layers.setdefault(lay, {"layer": lay, "bytes": 0, "blocks": 0, "modules": {}})
        e["bytes"] += int(lt.size[b])
        e["blocks"] += 1
        inner = WRAPPERS.sub("", mod or "").strip(".")
        inner = inner[len(lay):].lstrip(".") if inner.startswith(lay) else inner
        e["modules"][inner or "(itself)"] = e["modules"].get(inner or "(itself)", 0) + \
            int(lt.size[b])
    table = sorted(layers.values(), key=lambda e: _natural(e["layer"]))
    for e in table:
        e["modules"] = sorted(([m, b] for m, b in e["modules"].items()), key=lambda x: -x[1])[:4]
    out["saved_by_layer"] = table[:rows]
    out["saved_layers_left_out"] = max(0, len(table) - rows)
    out["saved_bytes_at_peak"] = int(lt.size[act].sum())
    named = alive[kinds >= 0]
    big = named[np.argsort(-lt.size[named], kind="stable")][:8]
    largest = []
    for b in big.tolist():
        i = names.identity(b)
        if i is not None:
            largest.append({"tensor": names.tensor(b), "kind": i.kind, "module": names.module(b),
                            "shape": list(i.shape), "dtype": i.dtype, "bytes": int(lt.size[b])})
    out["largest_at_peak"] = largest
    return out


def finding_tensors(names: BlockNames, lt, members: np.ndarray, rows: int = 8) -> list[dict]:
    """A finding's largest named blocks (`Finding.members`), each tensor once (a unit re-gathered
    every iteration names the same parameter in each): what the reports list under it."""
    m = np.asarray(members, np.int64)
    m = m[(m >= 0) & (m < len(names.ident))]
    m = m[names.ident[m] >= 0]
    out: list[dict] = []
    seen = set()
    for b in m[np.argsort(-lt.size[m], kind="stable")].tolist():
        i = names.identity(b)
        if i is None:
            continue
        key = (names.tensor(b), i.kind, names.module(b))
        if key in seen:
            continue
        seen.add(key)
        out.append({"tensor": key[0], "kind": i.kind, "module": key[2], "shape": list(i.shape),
                    "dtype": i.dtype, "bytes": int(lt.size[b])})
        if len(out) == rows:
            break
    return out


def without_names(snapshot) -> dict:
    """For a dump with no recorder names: what its frames and record_function ranges say
    about modules, and the recipe for the next dump (once per file: every device shares it)."""
    module_frames = sum(1 for f in snapshot.frames if f.filename == "<nn.Module>")
    starts = [a.name for a in snapshot.annotations if a.stage == "START"]
    units = sorted({m.group(1) for n in set(starts) if (m := _UNIT.search(n))}, key=_natural)
    user_ranges = sorted({n for n in starts if not _TORCH_RANGE.match(n)})
    forward = any(f.name == "forward" for f in snapshot.frames)
    said = []
    if module_frames:
        said.append(f"{module_frames} module frames (<nn.Module> in stacks): a block is placed "
                    "in the module call that allocated it, not named")
    elif forward:
        said.append("Python frames show which forward() allocated each block (file:line), "
                    "not which module instance or tensor")
    else:
        said.append("no Python frames: blocks have no module at all")
    if units:
        said.append(f"FSDP units from record_function ranges: {len(units)} "
                    f"({', '.join(units[:4])}{', ...' if len(units) > 4 else ''}); a block made "
                    "inside a unit's range is that unit's, not a tensor's")
    if user_ranges:
        said.append(f"{len(user_ranges)} record_function ranges of the script's own "
                    f"({', '.join(user_ranges[:3])}{', ...' if len(user_ranges) > 3 else ''})")
    said.append("no tensor names, shapes or dtypes, and no record of what was saved for "
                "backward: the snapshot keeps addresses, sizes and stacks only")
    recorder = snapshot.provenance.get("recorder")
    if type(recorder) is str and recorder.startswith("snapforensics"):
        recipe = ("record the run again with this version's `snapforensics record`: it names "
                  "tensors (SNAPFORENSICS_NAMES=0 was set, or an older recorder made this file)")
    elif snapshot.backend.value == "npu":
        recipe = RECIPE.replace("torch.cuda.memory", "torch_npu.npu.memory").replace(
            'path="snap.pickle")', 'path="snap.pickle", device="npu")')
    else:
        recipe = RECIPE
    return {"recorded": False, "said": said, "recipe": recipe}


_UNIT = re.compile(r"^FSDP::\w+ \((.+)\)$")
_TORCH_RANGE = re.compile(r"^(FSDP|Optimizer|ProfilerStep|aten|c10d|gloo|nccl|hccl|"
                          r"torch|autograd|## |cudaGraph|Forward|Backward)")
