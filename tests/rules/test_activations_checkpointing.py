"""activations.no_checkpointing: activations of repeated layers kept for backward with no
checkpointing, on a real recording (`noac`), its saving checked against the same layout recorded
WITH checkpointing at the same batch (`fixed --batch 8`)."""

from __future__ import annotations

import pytest
from findings import one

from snapforensics.analysis.rules.activations_checkpointing import RULE


@pytest.mark.slow
def test_noac_variant_suggests_checkpointing_with_its_saving(diagnosed):
    d = diagnosed("noac")
    f = one(d, RULE.id)
    assert f.verdict == "info"  # a memory/compute trade, not a bug (see the rule's docstring)
    ev = f.evidence
    assert ev["layers"] == 6 and ev["layer_class"] == "Block"  # the example's 6 blocks
    assert ev["activation_share"] >= 0.3
    assert f.saving_bytes > 0.05 * d.peaks["overall_bytes"]
    assert "apply_activation_checkpointing" in f.fix and "isinstance(m, Block)" in f.fix
    assert f.predicted_peak_bytes == d.peaks["overall_bytes"] - f.saving_bytes


@pytest.mark.slow
def test_checkpointing_saving_matches_the_checkpointed_run(diagnosed):
    """`fixed` is `noac` plus checkpoint_wrapper per block: same batch, measured peak."""
    f = one(diagnosed("noac"), RULE.id)
    measured = diagnosed("fixed", extra=["--batch", "8"]).peaks["overall_bytes"]
    assert abs(f.predicted_peak_bytes - measured) / measured < 0.10, (f.predicted_peak_bytes,
                                                                      measured)


@pytest.mark.slow
def test_a_module_name_from_the_file_never_becomes_code_in_the_fix(recording):
    """The fix names the repeated layer class from the stacks' `<nn.Module>` frames; a name that
    is not a Python identifier (a hostile file) is left out, so the snippet still compiles."""
    from snapforensics.analysis import diagnose
    from snapforensics.snapshot import normalize, read_raw

    raw, _ = read_raw(recording("noac"))
    seen = set()
    for e in raw["device_traces"][0]:
        for f in e.get("frames") or ():
            if id(f) not in seen and f["filename"] == "<nn.Module>" and "Block_" in f["name"]:
                seen.add(id(f))  # a module name that is code, on one line
                f["name"] = f["name"].replace(
                    "Block_", "Block) if __import__('os').system('id') else (Block_")
    assert seen
    f = one(diagnose(normalize(raw, source="hostile")), RULE.id)
    compile(f.fix, "<fix>", "exec")
    assert "__import__" not in f.fix
    named = f.fix.split("isinstance(m, ", 1)[1].split(")", 1)[0]
    assert named.isidentifier(), named  # another repeated class, or the placeholder
