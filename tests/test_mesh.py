"""analysis/mesh.py: a rank's place in the layout from the recorder's process groups, and which
dimension spans the world where no group names it (a 1-D mesh reuses the default group), read
from what the blocks show. The groups are the shapes the recorder writes for torch's DeviceMesh,
Megatron's parallel_state and DeepSpeed (`undefined`); the categories the classifier's names."""

from __future__ import annotations

import pytest

from snapforensics.analysis.mesh import mesh, shown
from snapforensics.analysis.vocab import Category


def _mesh(prov: dict, categories: list = ()):
    return mesh(prov, shown(categories))


def _prov(world: int, rank: int, *groups: tuple[str, list[int]]) -> dict:
    return {"world_size": world, "rank": rank,
            "process_groups": [{"desc": d, "ranks": r} for d, r in groups]}


TP = [Category.TP_ALL_REDUCE, Category.ACTIVATION]
FSDP = [Category.ALL_GATHER, Category.SHARDED_GRAD]


def test_a_1d_tp_mesh_over_the_world_is_tp_and_not_fsdp():
    # init_device_mesh("cuda", (4,), mesh_dim_names=("tp",)): the default group, reused
    m = _mesh(_prov(4, 1, ("default_pg", [0, 1, 2, 3])), TP)
    assert m.degree("tp") == 4 and m.index("tp") == 1 and m.uses("tp")
    assert m.degree("dp_shard") is None and m.degree("pp") is None
    assert not m.uses("dp_shard")


def test_a_1d_fsdp_mesh_is_fsdp_and_says_nothing_of_tp():
    m = _mesh(_prov(2, 0, ("default_pg", [0, 1])), FSDP)
    assert m.degree("dp_shard") == 2 and m.uses("dp_shard")
    assert m.degree("tp") is None and not m.uses("tp")


def test_groups_that_name_no_dimension_say_nothing_of_tp():
    # DeepSpeed's pipeline engine: its groups are `undefined`; its received buffers show PP
    m = _mesh(_prov(2, 1, ("default_pg", [0, 1]), ("undefined", [0, 1])), [Category.PP_P2P])
    assert not m.uses("tp") and m.degree("pp") == 2 and m.index("pp") == 1


def test_a_named_group_wins_over_the_blocks():
    # torchtitan's (pp, tp) mesh: pp named; tp spans the rest
    m = _mesh(_prov(4, 3, ("default_pg", [0, 1, 2, 3]), ("mesh_pp", [1, 3]), ("mesh_tp", [2, 3])),
             TP + [Category.PP_P2P])
    assert (m.degree("pp"), m.index("pp"), m.degree("tp"), m.index("tp")) == (2, 1, 2, 1)


def test_without_groups_another_shown_dimension_leaves_the_degree_unknown():
    # torch's own dump (no group list) of Megatron TP x PP: the rank is not the stage
    prov = {"world_size": 4, "rank": 2}
    assert _mesh(prov, TP + [Category.PP_P2P]).degree("pp") is None
    assert _mesh(prov, [Category.PP_P2P]).degree("pp") == 4  # PP alone: one stage per rank
    assert _mesh(prov).degree("tp") == 4 and _mesh(prov).source("tp") == "the world size"


def test_data_parallel_dimensions_share_the_ranks_of_a_1d_mesh():
    # FSDP's gathers show dp_shard; DeepSpeed's or Megatron's rules ask for "dp": the same ranks
    m = _mesh(_prov(4, 2, ("default_pg", [0, 1, 2, 3])), FSDP)
    assert m.degree("dp") == 4 and m.degree("dp_replicate") == 4 and m.degree("tp") is None


def test_unnamed_groups_that_split_the_world_leave_unnamed_dimensions_unknown():
    # 2 stages x 2 DDP ranks over `dist.new_group` (no description: "undefined"), rank 1
    m = _mesh(_prov(4, 1, ("default_pg", [0, 1, 2, 3]), ("undefined", [1, 3]),
                    ("undefined", [0, 1])), [Category.PP_P2P])
    assert m.degree("pp") is None and m.index("pp") is None and not m.uses("pp")
    # named groups still say their degree
    m = _mesh(_prov(4, 1, ("default_pg", [0, 1, 2, 3]), ("mesh_pp", [1, 3]),
                    ("undefined", [0, 1])), [Category.PP_P2P])
    assert (m.degree("pp"), m.index("pp")) == (2, 0)  # rank 1 is stage 0
    # data parallelism keeps the world: DeepSpeed-MoE's expert groups (ep 2 of 4) lie inside it
    m = _mesh(_prov(4, 1, ("default_pg", [0, 1, 2, 3]), ("undefined", [0, 1]),
                    ("undefined", [1, 3])))
    assert m.degree("dp") == 4 and m.degree("dp_shard") == 4 and m.degree("tp") is None
    # DeepSpeed's groups of one rank or of all of them split nothing
    m = _mesh(_prov(2, 1, ("default_pg", [0, 1]), ("undefined", [0, 1]), ("undefined", [1])),
              [Category.PP_P2P])
    assert (m.degree("pp"), m.index("pp")) == (2, 1)


def test_the_recorders_pipeline_stages_say_the_stage_where_no_group_names_it():
    # 2 stages x 2 DDP ranks over unnamed groups, rank 1 running stage 0 of 2
    groups = (("default_pg", [0, 1, 2, 3]), ("undefined", [1, 3]), ("undefined", [0, 1]))
    prov = {**_prov(4, 1, *groups), "pipeline_stages": {"indices": [0], "num_stages": 2}}
    m = _mesh(prov, [Category.PP_P2P])
    assert (m.degree("pp"), m.index("pp"), m.uses("pp")) == (2, 0, True)
    assert m.source("pp") == "the rank's pipeline stages"
    assert m.degree("tp") is None  # still split some way the file does not say
    # an interleaved rank (stages 1 and 3 of 4): one of 2 ranks, at stage 1's place
    prov = {**_prov(2, 1, ("default_pg", [0, 1])),
            "pipeline_stages": {"indices": [1, 3], "num_stages": 4}}
    m = _mesh(prov, [Category.PP_P2P])
    assert (m.degree("pp"), m.index("pp")) == (2, 1)
    # a named group wins; a world split two ways by pp leaves tp unknown, not the world
    prov = {**_prov(4, 1, ("default_pg", [0, 1, 2, 3]), ("mesh_pp", [1, 3])),
            "pipeline_stages": {"indices": [1], "num_stages": 9}}
    assert (_mesh(prov).degree("pp"), _mesh(prov).index("pp")) == (2, 0)
    prov = {**_prov(4, 1, ("default_pg", [0, 1, 2, 3])),
            "pipeline_stages": {"indices": [0], "num_stages": 2}}
    assert _mesh(prov, TP).degree("tp") is None
    # what a stranger's file may hold instead: not read
    for bad in ({"indices": [0, 0], "num_stages": 2}, {"indices": [2], "num_stages": 2},
                {"indices": [0, 1, 2], "num_stages": 4}, {"indices": [3], "num_stages": 4.0},
                {"indices": [True], "num_stages": 2}, {"indices": [], "num_stages": 2},
                {"indices": [0], "num_stages": 1 << 40}, [0, 2], "0/2"):
        m = _mesh({**_prov(4, 1, *groups), "pipeline_stages": bad}, [Category.PP_P2P])
        assert m.degree("pp") is None, bad


@pytest.mark.slow
def test_deepspeed_moe_expert_groups_recorded_leave_data_parallelism_the_world():
    """The groups DeepSpeed-MoE really builds (tests/ds_moe.py --ep 2 on 4 ranks: expert
    parallel over 2, expert-data parallel over the other 2, both unnamed), as the recorder
    noted them: data parallelism keeps the world, no model-parallel degree is taken for it."""
    import json
    from pathlib import Path

    pytest.importorskip("deepspeed", reason="deepspeed is not installed (make setup installs it)")
    from recordings import recorded_script

    from snapforensics.snapshot import load

    folder = recorded_script(Path(__file__).parent / "ds_moe.py", ("--ep", "2"), nproc=4,
                             truth=True)
    for r in range(4):
        truth = json.loads((folder / f"truth.rank{r}.json").read_text())
        prov = load(folder / f"rank{r}.pickle").provenance
        listed = {tuple(g["ranks"]) for g in prov["process_groups"] if g["desc"] == "undefined"}
        assert {tuple(truth["ep_ranks"]), tuple(truth["ep_dp_ranks"])} <= listed
        assert len(truth["ep_ranks"]) == 2 < truth["world"] == 4
        m = _mesh(prov, [Category.MOE_DISPATCH, Category.ACTIVATION])
        assert m.degree("dp") == 4 and m.degree("tp") is None and m.degree("ep") is None
