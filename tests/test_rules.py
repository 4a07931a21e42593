"""All rules together: one shape per rule module, and which rules fire on which real runs.

Healthy layouts (`fixed`, `nested`, FSDP1 FULL_SHARD) must trigger none of the FSDP configuration
rules; CPU-recorded runs no allocator rule; runs without FSDP no fsdp.* rule (the corpus); and the
FSDP rules hold on CUDA-shaped EDITED copies of the recordings."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
from corpus import corpus_files
from edits import cuda_shaped
from findings import FSDP_CONFIGURATION, LIFECYCLE, fired, found

import snapforensics.analysis.rules as rules_pkg
from snapforensics.analysis import diagnose
from snapforensics.analysis.context import analyse
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.rules import (
    BY_ID,
    RULES,
    activations_checkpointing,
    allocator_fragmentation,
    allocator_record_stream,
    fsdp_all_gather_concurrency,
    fsdp_double_all_gather,
    fsdp_full_init,
    fsdp_grad_sync_off,
    fsdp_mixed_precision,
    fsdp_reshard_after_forward,
    fsdp_stale_prefetch,
    leak_iteration_growth,
    oom_report,
    run_rules,
)
from snapforensics.analysis.vocab import Verdict
from snapforensics.snapshot import load, normalize, read_raw

slow = pytest.mark.slow


RULES_DIR = Path(rules_pkg.__file__).parent
TESTS_DIR = Path(__file__).parent / "rules"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "rules.md"
FSDP_FAMILIES = {Family.FSDP_SHARDING, Family.FSDP_CONFIGURATION}


def _module(rule: Rule) -> str:
    """The rule's module name in analysis/rules/ (where its check lives)."""
    return rule.check.__module__.rsplit(".", 1)[1]


def test_every_module_in_the_rules_folder_is_one_registered_rule():
    names = sorted(i.name for i in pkgutil.iter_modules([str(RULES_DIR)]))
    declared = [importlib.import_module(f"{rules_pkg.__name__}.{n}").RULE for n in names]
    assert all(isinstance(r, Rule) for r in declared), names
    assert sorted(map(_module, RULES)) == names
    assert set(declared) == set(RULES) and len(RULES) == len(names)


def test_every_rule_has_the_same_shape():
    """A unique `area.name` id, check(d), the verdicts it can give, and its fix: code that
    compiles, a fix_for(d, evidence), or None for a cost the configuration chose."""
    assert len(BY_ID) == len(RULES)
    for r in RULES:
        assert re.fullmatch(r"[a-z]+\.[a-z_]+", r.id), r.id
        assert list(inspect.signature(r.check).parameters) == ["d"], r.id
        assert r.verdicts and r.verdicts <= set(Verdict), r.id
        # fsdp.* ids are what the corpus test checks no FSDP-less file gets
        assert r.id.startswith("fsdp.") == (r.family in FSDP_FAMILIES), r.id
        if r.fix is None:
            assert r.verdicts == {Verdict.EXPECTED}, r.id
        elif isinstance(r.fix, str):
            compile(r.fix, r.id, "exec")
        else:
            assert list(inspect.signature(r.fix).parameters) == ["d", "evidence"], r.id
        if r.reserved_peak:
            assert r.reserved_peak({"reserved_peak_bytes": 7}) == 7, r.id


def test_no_rule_imports_another():
    for path in RULES_DIR.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("snapforensics.analysis.rules"), path
                assert node.level == 0, path


def test_every_rule_has_its_test_module():
    """tests/rules/test_<rule module>.py, keyed by the module's RULE."""
    for r in RULES:
        name = _module(r)
        test = TESTS_DIR / f"test_{name}.py"
        assert test.is_file(), test
        assert f"from snapforensics.analysis.rules.{name} import RULE" in test.read_text(), test


def test_every_rule_has_its_docs_line():
    """One row of docs/rules.md's table per rule, whose verdict column names its verdicts."""
    found = [(m.group(1), m.group(2)) for m in
             re.finditer(r"^\| `([a-z_]+\.[a-z_]+)` \| ([^|]+) \|", DOCS.read_text(), re.M)]
    rows = dict(found)
    names = [r for r, _ in found]
    assert len(rows) == len(found), sorted({r for r in names if names.count(r) > 1})
    assert set(rows) == set(BY_ID), set(rows) ^ set(BY_ID)
    for rid, cell in rows.items():
        said = {v for v in Verdict if re.search(rf"\b{v.value}\b", cell)}
        assert said == BY_ID[rid].verdicts, (rid, cell)


def test_rules_run_before_user_categories(fixtures_dir):
    """Rules read the built-in categories: run_rules refuses a device with user categories."""
    snap = load(fixtures_dir / "fsdp2_ckpt_buggy_rank0.pickle.gz")
    d = analyse(snap, snap.active_traces[0])
    assert {f.rule for f in run_rules(d)}
    d.add_categories({"mine": re.compile("forward")})
    with pytest.raises(ValueError, match="add_categories"):
        run_rules(d)

@slow
@pytest.mark.parametrize("variant", ["fixed", "nested"])
def test_healthy_layouts_fire_no_fsdp_configuration_rule(diagnosed, variant):
    d = diagnosed(variant)
    assert not d.anomalies, [(f.rule, f.cause) for f in d.anomalies]
    assert not fired(d) & FSDP_CONFIGURATION, [(f.rule, f.cause) for f in d.findings]


@pytest.mark.slow
def test_healthy_and_other_variants_stay_quiet(diagnosed):
    fixed = diagnosed("fixed")
    assert not [f.rule for f in fixed.findings if f.rule in LIFECYCLE]
    assert not found(diagnosed("noac"), leak_iteration_growth.RULE.id)  # no growth without the leak
    # checkpointed: recompute present
    assert not found(diagnosed("leak"), activations_checkpointing.RULE.id)
    for d in (fixed, diagnosed("noac"), diagnosed("leak")):  # CPU-recorded: no allocator findings
        assert not found(d, allocator_fragmentation.RULE.id) and \
            not found(d, allocator_record_stream.RULE.id) and not found(d, oom_report.RULE.id)


@slow
@pytest.mark.parametrize("annotations", [True, False])
def test_rules_hold_on_cuda_shaped_traces(recording, annotations):
    """Edited recordings: op/module/record_function frames removed, stacks cut at the autograd
    engine, ranges as annotations or absent (edits.cuda_shaped)."""
    expect = {"fixed": (), "nested": (),
              "reshard_after_forward_false": (fsdp_reshard_after_forward,),
              "prefetch_in_recompute": (fsdp_stale_prefetch, fsdp_all_gather_concurrency),
              "no_rate_limit": (fsdp_all_gather_concurrency,), "full_init": (fsdp_full_init,),
              "no_grad_sync": (fsdp_grad_sync_off,), "mixed_precision": (fsdp_mixed_precision,),
              "fsdp1_shard_grad_op": (fsdp_reshard_after_forward, fsdp_mixed_precision),
              "fsdp1_reentrant": (fsdp_double_all_gather,)}
    for variant, modules in expect.items():
        want = {m.RULE.id for m in modules}
        raw, _ = read_raw(recording(variant))
        d = diagnose(normalize(cuda_shaped(raw, annotations=annotations), source=variant))
        assert fired(d) & FSDP_CONFIGURATION == want, (variant,
                                                       [(f.rule, f.cause) for f in d.findings])


def _has_fsdp_frames(snap) -> bool:
    return any("/fsdp/" in f.filename.replace("\\", "/") or f.name == "fully_shard"
               for f in snap.frames)


def test_corpus_without_fsdp_gets_a_diagnosis_and_no_fsdp_findings(corpus_dir):
    files = corpus_files()
    assert files
    no_fsdp = 0
    for path in files:
        snap = load(path)
        d = diagnose(snap)
        if not _has_fsdp_frames(snap):
            no_fsdp += 1
            assert not [f.rule for f in d.findings if f.rule.startswith("fsdp.")], path.name
        for dev in d.devices:  # what was alive at the peak, by category and stack
            if dev.history["allocations"] and dev.peaks["overall_bytes"] > 0:
                assert dev.categories_at_peak, (path.name, dev.device)
                assert dev.top_stacks_at_peak, (path.name, dev.device)
        no_history = {dev.device for dev in d.devices if not dev.history["rows"]}
        for f in d.findings:
            assert f.verdict in BY_ID[f.rule].verdicts, (path.name, f.rule, f.verdict)
            assert f.device not in no_history or BY_ID[f.rule].segments_only, (path.name, f.rule)
            if f.rule in LIFECYCLE:
                assert f.bytes > 0 and f.evidence, (path.name, f.rule)
                assert f.verdict != "anomalous" or f.fix, (path.name, f.rule)
    assert no_fsdp >= len(files) // 2
