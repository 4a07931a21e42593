"""runtime.memory_outside_allocator: the device's used memory beside the allocator's reserved
bytes, on CUDA recordings made by the recorder through torch's real `torch.cuda` code with only
the C bindings stubbed (tests/device_stubs.py: the stub device holds `context` bytes outside
the allocator, set by the test: the truth)."""

from __future__ import annotations

import builtins
import textwrap

from device_stubs import cuda_allocator

import snapforensics as sf
from snapforensics.analysis.rules.runtime_outside_allocator import RULE
from snapforensics.record import _bootstrap

SCRIPT = """
    import builtins, torch
    torch.cuda.init()
    class Opt(torch.optim.Optimizer):
        def step(self, closure=None):
            pass
    opt = Opt([torch.nn.Parameter(torch.zeros(4))], {})
    for i in range(4):
        x = builtins._sf_dev.alloc(32 << 20)
        builtins._sf_dev.context += builtins._sf_grow
        opt.step()
        builtins._sf_dev.free(x, 32 << 20)
"""


def _record(monkeypatch, tmp_path, context: int, grow: int, rank: int = 0):
    import torch._dynamo  # noqa: F401  (the optimizer imports it: before the CUDA stubs)

    a = cuda_allocator(monkeypatch)
    a.context = context
    monkeypatch.setattr(builtins, "_sf_dev", a, raising=False)
    monkeypatch.setattr(builtins, "_sf_grow", grow, raising=False)
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(SCRIPT))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "3")
    status = _bootstrap.run_recorded({"out": str(tmp_path / "out"), "device": "cuda"},
                                     str(script), [])
    assert status["exit_code"] == 0, status
    return sf.diagnose(tmp_path / "out" / f"rank{rank}.pickle")


def _finding(report):
    return next((f for f in report.diagnosis.findings if f.rule == RULE.id), None)


def test_a_steady_context_is_expected_and_measured(monkeypatch, tmp_path):
    f = _finding(_record(monkeypatch, tmp_path, context=700 << 20, grow=0))
    assert f is not None and f.verdict == "expected"
    assert f.bytes == 700 << 20
    assert f.evidence["growth_bytes"] == 0
    assert [s["step"] for s in f.evidence["samples"]] == ["start", 1, 2, 3, 4, "end"]
    assert "grew" not in f.cause


def test_a_gap_that_keeps_growing_is_called_out(monkeypatch, tmp_path):
    f = _finding(_record(monkeypatch, tmp_path, context=500 << 20, grow=100 << 20))
    assert f.bytes == 900 << 20  # after the 4th step
    assert f.evidence["growth_bytes"] == 300 << 20  # step 1 -> step 4
    assert "grew by 300.0 MiB from step 1 to step 4" in f.cause


def test_cpu_recordings_say_it_is_not_measured(tmp_path):
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
    rep = sf.diagnose(fixture)
    assert _finding(rep) is None
    assert "outside the allocator not measured" in rep.render("markdown")


def test_the_fleet_names_the_rank_whose_gap_differs(monkeypatch, tmp_path):
    """Three ranks, rank 2 with 1 GiB more outside the allocator (a communicator only it
    made): the fleet row names it beside the median."""
    import json

    from recordings import run_cli

    for rank, ctx in enumerate((600 << 20, 610 << 20, 1624 << 20)):
        _record(monkeypatch, tmp_path, context=ctx, grow=0, rank=rank)
    proc = run_cli(["diagnose", str(tmp_path / "out"), "--format", "json"])
    assert proc.returncode == 0, proc.stderr
    row = next(r for r in json.loads(proc.stdout)["findings"] if r["rule"] == RULE.id)
    assert row["on_all_ranks"] and row["off_ranks"] == [2]
    assert row["bytes_median"] == 610 << 20
    text = run_cli(["diagnose", str(tmp_path / "out"), "--format", "markdown"]).stdout
    assert "off the median (610.0 MiB): 2" in text
