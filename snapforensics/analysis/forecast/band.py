"""The forecast's error band: how far forecasts landed from peaks actually recorded, per kind of
change, as data, and which scenarios lie outside what was checked.

Where the numbers come from: `tests/test_forecast.py` (slow tests; the pairs recorded for the
forecast alone are `full` tests, run by `make test-full`) records the bundled example
(`snapforensics.examples.fsdp_ckpt`) with the project's recorder on CPU (gloo, torch 2.13.0,
Python 3.12) and forecasts rank 0 of each recording from a second recording of the same script
with one setting changed; the error is (forecast - recorded) / recorded of the allocated peak.
Those tests check that every error they measure lies inside the band stored here, so a band
that no longer matches the model fails the suite.

What it does not cover: CUDA/NPU recordings (allocator rounding, stream-ordered frees, NCCL's
buffers are not in a CPU trace), world sizes further than 4x from the recorded one, HSDP and
NO_SHARD, micro-batch scales outside 1/4..4, and combinations of changes other than
checkpointing with micro-batch and dp_shard with TP (a combination is given the sum of its
changes' bands).
"""

from __future__ import annotations

SOURCE = ("tests/test_forecast.py, slow tests: the bundled examples (FSDP: rank 0; pipeline: "
          "each stage) recorded on CPU (gloo), one setting changed between the two recordings "
          "of each pair")

# (kind of change, pair, forecast MiB, recorded MiB), as the slow tests printed them (`-s`).
PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("world_size", "FSDP2 + checkpointing, 6 x 512: W=4 from W=2", 125.80, 125.80),
    ("world_size", "FSDP2 + checkpointing, 6 x 512: W=2 from W=4", 194.82, 194.82),
    ("world_size", "FSDP1 + checkpointing, 4 x 256: W=4 from W=2", 27.77, 27.77),
    ("world_size", "FSDP1 + checkpointing, 4 x 256: W=2 from W=4", 39.78, 39.78),
    ("world_size", "FSDP2 no checkpointing, 4 x 128: W=4 from W=2", 30.84, 30.84),
    ("world_size", "FSDP2 no checkpointing, 4 x 128: W=2 from W=4", 33.84, 33.84),
    ("world_size", "FSDP2 no checkpointing, 4 x 128: W=8 from W=2", 29.34, 29.34),
    ("world_size", "FSDP2 no checkpointing, 4 x 128: W=2 from W=8", 33.84, 33.84),
    # FSDP2 + TP 2 on a 2-D mesh (examples/tp.py --dp, 2 x 64, rank 0): W is the dp_shard degree
    ("world_size", "FSDP2 + TP 2 (2-D mesh): dp_shard 4 from 2", 1.1458, 1.1458),
    ("world_size", "FSDP2 + TP 2 (2-D mesh): dp_shard 2 from 4", 1.1927, 1.1929),
    ("strategy", "FSDP2 reshard_after_forward=False from True", 216.10, 216.10),
    ("strategy", "FSDP2 reshard_after_forward=True from False", 194.82, 194.82),
    ("strategy", "FSDP1 SHARD_GRAD_OP from FULL_SHARD", 43.04, 43.04),
    ("strategy", "FSDP1 FULL_SHARD from SHARD_GRAD_OP", 39.91, 39.78),
    ("checkpointing", "checkpointing off + micro-batch x4, from on", 267.29, 267.18),
    ("checkpointing", "checkpointing on + micro-batch x1/4, from off", 197.57, 194.82),
    ("micro_batch", "micro-batch x2 (no checkpointing, batch 4 -> 8)", 267.17, 267.18),
    ("micro_batch", "micro-batch x1/2 (no checkpointing, batch 8 -> 4)", 220.61, 220.61),
    ("fix", "buggy (reshard_after_backward=False) with the rule's fix, vs fixed", 194.82, 194.82),
    # GPipe -> 1F1B (pipeline.all_forward_before_backward's replay) vs the 1F1B recording, 2
    # stages of 4 x 256 (tests/test_forecast.py::test_pipeline_schedule_forecast)
    ("fix", "pipeline GPipe -> 1F1B, 8 micro-batches, stage 0", 25.02, 25.27),
    ("fix", "pipeline GPipe -> 1F1B, 8 micro-batches, stage 1", 22.77, 22.77),
    ("fix", "pipeline GPipe -> 1F1B, 4 micro-batches, stage 0", 35.02, 35.52),
    ("fix", "pipeline GPipe -> 1F1B, 4 micro-batches, stage 1", 28.52, 28.52),
    # tp.sequence_parallel_off's fix (its replay) vs the --sp twin, tests/lm_tp.py (the worst
    # rank; tests/test_forecast.py::test_tp_language_model)
    ("fix", "TP 2 without SequenceParallel with the rule's fix, vs SP on", 51.109001, 51.230583),
    ("fix", "TP 4 without SequenceParallel with the rule's fix, vs SP on", 27.312622, 27.494995),
    ("fix", "TP 8 without SequenceParallel with the rule's fix, vs SP on", 15.203506, 15.416275),
    # the TP degree (`--tp`), examples/tp.py 2 x 64 (tests/test_forecast.py::
    # test_tp_degree_both_ways, rank 0; MiB to 6 places: these peaks are under 1.2 MiB)
    ("tp", "TP (torchtitan plan): TP 4 from 2", 0.815933, 0.815941),
    ("tp", "TP (torchtitan plan): TP 2 from 4", 1.098167, 1.098160),
    ("tp", "TP + SequenceParallel: TP 4 from 2", 0.588268, 0.580463),
    ("tp", "TP + SequenceParallel: TP 2 from 4", 0.933372, 0.972427),
    ("tp", "FSDP2 + TP (2-D mesh, dp_shard 2): TP 4 from 2", 0.862820, 0.863319),
    ("tp", "FSDP2 + TP (2-D mesh, dp_shard 2): TP 2 from 4", 1.193874, 1.192890),
    # a Llama-like decoder under torchtitan's whole TP plan (tests/lm_tp.py: vocabulary-sharded
    # embeddings, the head's logits kept sharded by loss_parallel, AdamW; 6 x 96, 8 heads, rank
    # 0; tests/test_forecast.py::test_tp_language_model): TP 2 <-> 4 and 2 <-> 8
    ("tp", "TP, Llama-like (embeddings, head, loss_parallel): TP 4 from 2", 32.981560, 33.007935),
    ("tp", "TP, Llama-like (embeddings, head, loss_parallel): TP 2 from 4", 54.976196, 54.905876),
    ("tp", "TP, Llama-like (embeddings, head, loss_parallel): TP 8 from 2", 22.019402, 21.870010),
    ("tp", "TP, Llama-like (embeddings, head, loss_parallel): TP 2 from 8", 54.439578, 54.905876),
    ("tp", "TP + SequenceParallel, Llama-like: TP 4 from 2", 27.468620, 27.494995),
    ("tp", "TP + SequenceParallel, Llama-like: TP 2 from 4", 51.301636, 51.230583),
    ("tp", "TP + SequenceParallel, Llama-like: TP 8 from 2", 15.587639, 15.416275),
    ("tp", "TP + SequenceParallel, Llama-like: TP 2 from 8", 50.562637, 51.230583),
    # both at once, 8 ranks each way (tests/test_forecast.py::test_dp_and_tp_degree_together)
    ("tp", "FSDP2 + TP (2-D mesh): dp_shard 2 x TP 4 from dp_shard 4 x TP 2", 0.862591, 0.863319),
    ("tp", "FSDP2 + TP (2-D mesh): dp_shard 4 x TP 2 from dp_shard 2 x TP 4", 1.146755, 1.145786),
)

# What the pairs span: world size ratios (forecast W / recorded W), strategy changes, scales.
WORLD_RATIOS = (0.25, 4.0)  # the 2 <-> 8 pair: 1/4x and 4x
TP_RATIOS = (0.25, 4.0)  # the tp 2 <-> 8 pairs (Llama-like; the rest 2 <-> 4)
STRATEGY_CHANGES = frozenset({("full_shard", "shard_grad_op"), ("shard_grad_op", "full_shard")})
SCALES = (0.25, 4.0)
FIXES = ("fsdp.unsharded_params_not_resharded", "pipeline.all_forward_before_backward",
         "tp.sequence_parallel_off")
# changes recorded together in one pair (the rest are summed from their single-change bands);
# "fix:RULE" where one rule's fix was (tp.sequence_parallel_off's with another TP degree: the
# Llama-like model from TP 2, 4 and 8 without SP to each other degree with it, -1.69%..-0.13%,
# tests/test_forecast.py::test_tp_language_model)
COMBINED = ({"checkpointing", "micro_batch"}, {"world_size", "tp"},
            {"tp", "fix:tp.sequence_parallel_off"})
# The MiB figures above are rounded to 0.005 MiB each (the TP pairs to 0.000005 MiB: their peaks
# are under 60 MiB): the band is widened by what that can move an error on the smallest
# recorded peak of the pairs rounded alike (rounding, not model error).
_FINE = ("tp",)
_ROUNDING = 0.01 / min(r for kind, _, _, r in PAIRS if kind not in _FINE)
_ROUNDING_FINE = 1e-5 / min(r for kind, _, _, r in PAIRS if kind in _FINE)


def bands() -> dict[str, tuple[float, float]]:
    """Kind of change -> (lowest, highest) relative error measured on its pairs."""
    out: dict[str, tuple[float, float]] = {}
    for kind, _, f, r in PAIRS:
        e = (f - r) / r
        lo, hi = out.get(kind, (0.0, 0.0))
        w = _ROUNDING_FINE if kind in _FINE else _ROUNDING
        out[kind] = (min(lo, e - w), max(hi, e + w))
    return out


def band(changes: list[str]) -> dict:
    """The band of a scenario that makes `changes` (kinds of change; [] = the recording
    replayed, exact): the sum of their bands, and the pairs' count."""
    b = bands()
    lo = sum(b[c][0] for c in changes)
    hi = sum(b[c][1] for c in changes)
    n = sum(1 for kind, *_ in PAIRS if kind in changes)
    return {"low": lo, "high": hi, "pairs": n}
