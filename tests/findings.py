"""Looking findings up in a Diagnosis, and the rule families the cross-rule tests check."""

from __future__ import annotations

from snapforensics.analysis.diagnosis import Diagnosis, Finding
from snapforensics.analysis.rule import Family
from snapforensics.analysis.rules import RULES
from snapforensics.analysis.vocab import Verdict

# the rule families the cross-rule tests check, read from the rules' contracts
FSDP_CONFIGURATION = {r.id for r in RULES if r.family is Family.FSDP_CONFIGURATION}
FSDP_CONFIGURATION_ANOMALOUS = {r.id for r in RULES if r.family is Family.FSDP_CONFIGURATION
                                and Verdict.ANOMALOUS in r.verdicts}
LIFECYCLE = {r.id for r in RULES if r.family is Family.LIFECYCLE}


def found(d: Diagnosis, rule: str) -> list[Finding]:
    assert isinstance(rule, str), rule  # an id (RULE.id): a Rule would match no finding
    return [f for f in d.findings if f.rule == rule]


def finding(d: Diagnosis, rule: str) -> Finding:
    """The first finding of `rule` (asserts there is one)."""
    fs = found(d, rule)
    assert fs, (rule, [(f.rule, f.verdict) for f in d.findings])
    return fs[0]


def one(d: Diagnosis, rule: str) -> Finding:
    """The only finding of `rule` (asserts there is exactly one)."""
    fs = found(d, rule)
    assert len(fs) == 1, ([f.rule for f in d.findings], rule)
    return fs[0]


def fired(d: Diagnosis, verdict: str | None = None) -> set[str]:
    """Rule ids with a finding (of `verdict`, when given)."""
    return {f.rule for f in d.findings if verdict is None or f.verdict == verdict}


def near(a: int, b: int, tol: float = 0.10) -> bool:
    return abs(a - b) / b < tol


def verdict_by_effect(f: Finding, path, twin) -> str | None:
    """A finding's verdict from its effect, measured: `anomalous` when the recording's peak (an
    independent replay of its trace) is >3% above its twin's (the same run without the cause),
    `info` within 1%; asserts it and returns the verdict required (None in between)."""
    from recordings import load_strict, replay_peak

    ratio = replay_peak(load_strict(path)) / replay_peak(load_strict(twin))
    want = "anomalous" if ratio > 1.03 else "info" if ratio <= 1.01 else None
    if want:
        assert f.verdict == want, (f.rule, ratio)
    return want
