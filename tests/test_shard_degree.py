"""FSDP whose shard degree is not the world size, each run by torch's own code and recorded by
the project's recorder (tests/shard_degree.py): replicate() over FSDP2's machinery
(`torch.distributed._composable.replicate_with_fsdp`, torchtitan's DDP) and FSDP1's NO_SHARD
shard over 1 rank; `reshard_after_forward=N` reshards to N ranks after forward.

At shard size 1 FSDP2 gathers nothing and copies each parameter whole into its unsharded buffer
from the unit's forward to its post-backward. The copies the running modules held (read from them
as they ran) are `fsdp.unsharded_param`, the run reads as replicate, and the copies kept across
forward/backward are `expected` with no fix: the real library refuses
`set_reshard_after_forward` on replicate's modules (before, the tool offered
reshard_after_forward=True and predicted a peak after it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import snapforensics as sf
from snapforensics.analysis.context import analyse
from snapforensics.analysis.vocab import Category, Verdict
from snapforensics.snapshot import load

RAF = "fsdp.reshard_after_forward_disabled"


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("--ac",)], ids=["plain", "checkpointed"])
def test_replicate_copies_are_named_and_expected_without_a_fix(args):
    from recordings import recorded_script

    folder = recorded_script(Path(__file__).parent / "shard_degree.py", args, nproc=2, truth=True)
    for r in (0, 1):
        truth = json.loads((folder / f"truth.rank{r}.json").read_text())
        assert truth["reshard_settable"] is False  # the library's answer, not ours
        snap = load(folder / f"rank{r}.pickle")
        d = analyse(snap, snap.active_traces[0])
        assert d.fsdp.replicated
        un = d.mask(Category.UNSHARDED_PARAM)
        named = set(zip(d.lt.addr[un].tolist(), d.lt.size[un].tolist()))
        copies = [c for step in truth["held"] for block in step for c in block]
        assert copies and all((c["addr"], c["bytes"]) in named for c in copies)
        diag = sf.diagnose(folder / f"rank{r}.pickle").diagnosis
        doc = diag.to_dict()
        assert doc["framework"]["fsdp"] == "FSDP2 replicate"
        assert doc["framework"]["layer_class"] == "Block"
        f = next(f for f in diag.findings if f.rule == RAF)
        assert f.verdict == Verdict.EXPECTED and f.fix is None
        assert f.predicted_peak_bytes is None and f.evidence["replicated"]
        # what it counts: the copies of every block but the last to run forward (its backward
        # runs first), all of them the running modules' copies
        step = truth["held"][0]
        assert f.bytes == sum(c["bytes"] for block in step[:-1] for c in block)
        held = {(c["addr"], c["bytes"]) for c in copies}
        assert set(zip(d.lt.addr[f.members].tolist(), d.lt.size[f.members].tolist())) <= held
        assert not any("reshard_after_forward" in (g.fix or "") for g in diag.findings)


@pytest.mark.slow
def test_replicate_is_read_from_the_blocks_not_its_frames():
    """A CUDA recording started after set-up has neither replicate()'s frames nor its
    `Replicate<Class>` module names: the run is still "FSDP2 replicate" (from the blocks,
    `FsdpUnits.replicated`), and the same recording's sharded twin (fully_shard, the bundled
    FSDP2 fixtures) is "FSDP2", not replicated."""
    from recordings import recorded_script

    from snapforensics.analysis.engine import diagnose
    from snapforensics.snapshot.model import Frame

    folder = recorded_script(Path(__file__).parent / "shard_degree.py", (), nproc=2, truth=True)
    snap = load(folder / "rank0.pickle")
    hidden = 0
    for i, f in enumerate(snap.frames):
        if "replicate" in f.filename or (f.filename == "<nn.Module>" and
                                         f.name.startswith("Replicate")):
            snap.frames[i] = Frame(f.filename, 0, f.name[len("Replicate"):]) \
                if f.filename == "<nn.Module>" else Frame("train.py", f.line, "setup")
            hidden += 1
    assert hidden and not any("eplicate" in f.filename + f.name for f in snap.frames)
    assert diagnose(snap).framework["fsdp"] == "FSDP2 replicate"
    fixtures = sorted((Path(__file__).parents[1] / "fixtures").glob("fsdp2_*rank0.pickle.gz"))
    assert fixtures
    for path in fixtures:
        snap = load(path)
        d = analyse(snap, snap.active_traces[0])
        assert d.mask(Category.UNSHARDED_PARAM).any() and not d.fsdp.replicated, path
        assert diagnose(snap).framework["fsdp"] == "FSDP2", path


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("--mode", "no_shard")], ids=["replicate", "no_shard"])
def test_unsharded_fsdp_forecast_on_more_ranks_is_the_recorded_peak(args):
    """replicate() and FSDP1's NO_SHARD shard nothing: a rank's peak does not move with the
    world size (read as no_shard at shard degree 1). Before, replicate read as shard_grad_op
    and NO_SHARD as full_shard over 2 ranks, 4 ranks forecast 26% and 20% low (and NO_SHARD's
    init was "the full model built before sharding"); now 2 -> 4 ranks is checked against the
    4-rank recording."""
    from dataclasses import replace

    from recordings import recorded_script, run_cli

    from snapforensics.analysis.forecast.replay import Forecaster

    script = Path(__file__).parent / "shard_degree.py"
    two, four = (recorded_script(script, args, nproc=n) for n in (2, 4))
    if "no_shard" in args:  # on CUDA its post-backward divides in place and allocates nothing:
        # read from FSDP1's forward with no unsharded flat parameter alone
        from snapforensics.analysis.fsdp import units

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(units, "_NO_SHARD_REDUCE", "(not on any stack)")
            assert _analysed(two / "rank0.pickle").fsdp.replicated
    twin = max(_analysed(four / f"rank{r}.pickle").peak_bytes for r in range(4))
    for r in (0, 1):
        fx = Forecaster(_analysed(two / f"rank{r}.pickle"))
        assert fx.baseline().strategy == "no_shard" and fx.w0 == 1
        p = fx.predict(replace(fx.baseline(), world_size=4))
        assert p.refused is None, p.refused
        assert abs(p.predicted_peak_bytes - twin) <= 0.01 * twin, (p.predicted_peak_bytes, twin)
        cli = run_cli(["forecast", str(two / f"rank{r}.pickle"), "--world-size", "4"])
        assert cli.returncode == 0 and "world size any (nothing sharded)" in cli.stdout, cli
        # no FSDP fix offered where nothing is sharded
        assert not any(f.rule.startswith("fsdp.") and f.fix
                       for f in sf.diagnose(two / f"rank{r}.pickle").diagnosis.findings)


def _analysed(path: Path):
    snap = load(path)
    return analyse(snap, snap.active_traces[0])


@pytest.mark.slow
def test_reshard_after_forward_to_fewer_ranks_is_expected_and_predicts_the_true_twin():
    """fully_shard(reshard_after_forward=2) on 4 ranks: each unit keeps a
    1/2 post-forward shard into backward. The shards the running modules held are
    `fsdp.unsharded_param` (before, `activation`: the activation rule counted them), the
    finding is expected with reshard_after_forward=True as its fix, and the peak predicted after
    it is the recorded reshard_after_forward=True twin's."""
    from recordings import recorded_script

    script = Path(__file__).parent / "shard_degree.py"
    int2 = recorded_script(script, ("--mode", "reshard2"), nproc=4, truth=True)
    twin = max(_analysed(recorded_script(script, ("--mode", "reshard_true"), nproc=4) /
                         f"rank{r}.pickle").peak_bytes for r in range(4))
    for r in range(4):
        truth = json.loads((int2 / f"truth.rank{r}.json").read_text())
        shards = {(s["addr"], s["bytes"]) for step in truth["held"]
                  for block in step for s in block}
        d = _analysed(int2 / f"rank{r}.pickle")
        assert not d.fsdp.replicated  # sharded over 4, gathered
        pf = d.fsdp.post_forward_shards
        assert shards and shards == set(zip(d.lt.addr[pf].tolist(), d.lt.size[pf].tolist()))
        assert (d.category[pf] == d.category_names.index(Category.UNSHARDED_PARAM)).all()
        f = next(f for f in sf.diagnose(int2 / f"rank{r}.pickle").diagnosis.findings
                 if f.rule == RAF)
        assert f.verdict == Verdict.EXPECTED and f.evidence["post_forward_shards"]
        assert "reshard_after_forward=True" in f.fix
        assert abs(f.predicted_peak_bytes - twin) <= 0.01 * twin, (f.predicted_peak_bytes, twin)
