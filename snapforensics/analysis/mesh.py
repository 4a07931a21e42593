"""A rank's place in the parallel layout: the degree of each dimension (tp, pp, dp, dp_shard, cp,
ep) and the rank's index in it, from the process groups `snapforensics record` notes
(provenance `process_groups`: each group this rank is in, its description and ranks).

The names are the ones the frameworks give their groups: a DeviceMesh dimension's group is
`mesh_<dim name>` (torch's `DeviceMesh._init_process_groups`; torchtitan's dims are dp_replicate,
dp_shard, cp, tp, pp, ep), Megatron-Core's are `TENSOR_MODEL_PARALLEL_GROUP`,
`PIPELINE_MODEL_PARALLEL_GROUP`, ... (`parallel_state.initialize_model_parallel`). A
one-dimensional mesh over the whole world reuses the default group (`default_pg`), so no group
names its dimension: which dimension spans the world is then read from the blocks. TP's
redistributions, a pipeline's received buffers and FSDP's gathers (`SHOWN_BY`) each show their
dimension is in use, and no two of these share their ranks (a rank holds one TP shard of one
stage of one FSDP shard). A dimension no group names spans the world when no other dimension is
wider than 1, by its group or by the blocks (a TP-only run's TP degree is its world size, and its
dp_shard degree unknown), and, for a model-parallel dimension (tp, pp, cp, ep), no group without
a name (`dist.new_group` with no description: "undefined") splits the world into parts of more
than one rank (a pipeline's stages made that way, each wrapped in DDP over its own group: 2
stages x 2 read as 4 stages); otherwise it is unknown (None), never guessed. Data parallelism
keeps the world there: it is what remains once the model is split, and the unnamed groups a
data-parallel run makes lie inside it (DeepSpeed's expert-data-parallel groups, ZeRO++'s hpZ
and MiCS shard groups, a node's SyncBatchNorm subgroup). Expert parallelism is
not among them: its experts' ranks are the data-parallel ones (FSDP and EP over one 1-D mesh).
Where no group names pp, the recorder's `pipeline_stages` (the stages the rank's PipelineStage
objects ran, and their `num_stages`) say the pipeline's degree and the rank's stage.
Files without the list (torch's own dumps, older recorders) know only the world size: a
dimension's degree is the world size there unless the blocks show another, and `source` says
so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from snapforensics.analysis.vocab import FSDP_CATEGORIES, TP_CATEGORIES, Category

# dimension -> the group descriptions that name it
DIMS: dict[str, tuple[str, ...]] = {
    "tp": ("mesh_tp", "TENSOR_MODEL_PARALLEL_GROUP"),
    "pp": ("mesh_pp", "PIPELINE_MODEL_PARALLEL_GROUP"),
    "cp": ("mesh_cp", "CONTEXT_PARALLEL_GROUP"),
    "ep": ("mesh_ep", "EXPERT_MODEL_PARALLEL_GROUP"),
    "dp_shard": ("mesh_dp_shard", "mesh_dp_shard_cp"),
    "dp_replicate": ("mesh_dp_replicate",),
    "dp": ("mesh_dp", "DATA_PARALLEL_GROUP"),
}
_BY_DESC = {desc: dim for dim, descs in DIMS.items() for desc in descs}
# dimension -> the categories whose blocks show a run splits over it (dimensions no two of which
# share ranks)
SHOWN_BY: dict[str, frozenset[str]] = {
    dim: frozenset(str(c) for c in cats) for dim, cats in (
        ("tp", TP_CATEGORIES), ("pp", {Category.PP_P2P}), ("dp_shard", FSDP_CATEGORIES))}
# the description torch gives a group made without one (ProcessGroup's default `group_desc`)
UNNAMED = ("undefined", "")
MAX_GROUPS = 256  # what the recorder writes at most (record/_bootstrap.process_groups)


@dataclass(frozen=True)
class Mesh:
    world: int | None  # the recorder's world size (None: not in the file)
    rank: int | None
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # dim -> its group's ranks
    shown: frozenset[str] = frozenset()  # the dimensions the blocks show in use (SHOWN_BY)
    # a group that names nothing holds more than one rank, not all of them
    split: bool = False
    # (this rank's stage index along pp, pp's degree) from the recorder's `pipeline_stages`
    # (the PipelineStage objects the rank ran), where no group names pp
    pp: tuple[int, int] | None = None

    def degree(self, dim: str) -> int | None:
        """The number of ranks along `dim` (1: the run does not use it), None when unknown."""
        if dim in self.groups:
            return len(self.groups[dim])
        if dim == "pp" and self.pp is not None:
            return self.pp[1]
        if self.world is None or (self.split and _kin(dim) != "dp"):
            return None
        wider = [d for d, g in self.groups.items() if len(g) > 1 and d != dim]
        wider += ["pp"] if self.pp is not None and self.pp[1] > 1 and dim != "pp" else []
        wider += [d for d in self.shown if d not in self.groups and _kin(d) != _kin(dim)]
        return None if wider else self.world

    def uses(self, dim: str) -> bool:
        """The run splits over `dim` (its group has more than one rank, or the blocks show it
        and the world is its), as far as the file says."""
        known = dim in self.groups or (dim == "pp" and self.pp is not None)
        return (known or dim in self.shown) and (self.degree(dim) or 1) > 1

    def index(self, dim: str) -> int | None:
        """This rank's position along `dim` (a pipeline stage's index for "pp")."""
        ranks = self.groups.get(dim)
        if ranks is not None:
            return ranks.index(self.rank) if self.rank in ranks else None
        if dim == "pp" and self.pp is not None:
            return self.pp[0]
        n = self.degree(dim)
        ok = type(self.rank) is int and n is not None and 0 <= self.rank < n
        return self.rank if ok and n == self.world else None

    def source(self, dim: str) -> str:
        """Where `degree(dim)` comes from, for a finding's text."""
        if dim in self.groups:
            return "its process group"
        if dim == "pp" and self.pp is not None:
            return "the rank's pipeline stages"
        return "the world size" if self.degree(dim) is not None else "unknown"


def _ranks(v: Any) -> tuple[int, ...] | None:
    if type(v) is not list or not v or len(v) > 1 << 16:
        return None
    return tuple(v) if all(type(r) is int and r >= 0 for r in v) else None


def _kin(dim: str) -> str:
    """Data parallelism's dimensions (dp, dp_shard, dp_replicate) share the ranks of a 1-D mesh:
    one showing does not make another narrower."""
    return "dp" if dim.startswith("dp") else dim


def shown(categories: Iterable[str]) -> frozenset[str]:
    """The dimensions blocks of these categories show in use (SHOWN_BY)."""
    present = {str(c) for c in categories}
    return frozenset(dim for dim, cats in SHOWN_BY.items() if present & cats)


def mesh(provenance: Any, dims: Iterable[str] = ()) -> Mesh:
    """The Mesh of a file's provenance (the recorder's block; anything else reads as unknown),
    with the dimensions its blocks show in use (`shown` of their categories)."""
    prov = provenance if isinstance(provenance, dict) else {}
    world, rank = prov.get("world_size"), prov.get("rank")
    world = world if type(world) is int and world >= 1 else None
    rank = rank if type(rank) is int and rank >= 0 else None
    listed = prov.get("process_groups")
    groups: dict[str, tuple[int, ...]] = {}
    split = False
    if type(listed) is list:
        for g in listed[:MAX_GROUPS]:
            desc = g.get("desc") if type(g) is dict else None
            dim = _BY_DESC.get(desc) if type(desc) is str else None
            ranks = _ranks(g.get("ranks")) if type(g) is dict else None
            if dim is not None and ranks is not None and dim not in groups:
                groups[dim] = ranks
            elif desc in UNNAMED and ranks is not None and world is not None:
                split = split or 1 < len(ranks) < world
    return Mesh(world, rank, groups, frozenset(dims), split,
                None if "pp" in groups else _stages(prov.get("pipeline_stages")))


def _stages(v: Any) -> tuple[int, int] | None:
    """(stage index, pp degree) from the recorder's `pipeline_stages` ({"indices": the stages
    the rank ran, "num_stages": N}): a rank running V stages (an interleaved or V-shaped
    schedule) is one of N / V ranks, at the place of its lowest stage (torch places stage i
    of a looped schedule on rank i mod N / V, a V-shape's stage 2S - 1 - r beside r)."""
    if type(v) is not dict:
        return None
    idx, n = _ranks(v.get("indices")), v.get("num_stages")
    if idx is None or type(n) is not int or not 0 < n <= 1 << 16 or n % len(idx) or \
            len(set(idx)) != len(idx) or max(idx) >= n:
        return None
    ranks = n // len(idx)
    return (min(idx), ranks) if min(idx) < ranks else None
