"""The fuzz tier: generated hostile inputs (tests/fuzz.py: long strings, equality bombs, special
files, extreme numbers, many devices, tampered cache entries, out-of-range options) against the
CLI, the API and every renderer, each case in a forked child under a 3 GiB address-space cap and
a time limit. Fails on exit 70, a signal, a hang past the limit, a traceback, or an exit 2 that
is not one line. The seed is printed; SNAPFORENSICS_FUZZ_SEED replays it, SNAPFORENSICS_FUZZ_SCALE
(default 1: the fast CI tier) grows the cases and the sizes."""

from __future__ import annotations

import os
import random
import sys
import time
from collections import Counter

import pytest
from fuzz import FAMILIES, FORMATS, run

# a fixed seed by default: the CI tier is the same cases every run (a random one let a run miss a
# renderer); SNAPFORENSICS_FUZZ_SEED=random explores
_SEED = os.environ.get("SNAPFORENSICS_FUZZ_SEED") or "0"
SEED = random.SystemRandom().randrange(1 << 20) if _SEED == "random" else int(_SEED)
SCALE = int(os.environ.get("SNAPFORENSICS_FUZZ_SCALE") or 1)
MEMORY = 3 << 30
# a loaded 2-core machine; the bounded versions take a few seconds
SECONDS = float(os.environ.get("SNAPFORENSICS_FUZZ_SECONDS") or 60 * SCALE)
USED: set[str] = set()


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Everything a case needs, imported once: each forked child starts with it."""
    import matplotlib.figure  # noqa: F401

    import snapforensics.api  # noqa: F401
    import snapforensics.cli  # noqa: F401
    import snapforensics.report.html  # noqa: F401
    import snapforensics.report.markdown  # noqa: F401
    import snapforensics.report.terminal  # noqa: F401


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPFORENSICS_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("SNAPFORENSICS_EXPANSION", "SNAPFORENSICS_NO_CACHE", "CI",
                 "SNAPFORENSICS_CACHE_SIZE", "SNAPFORENSICS_CACHE_HASH"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family(family, isolated):
    rng = random.Random(f"{SEED} {family}")
    t = time.monotonic()
    cases = FAMILIES[family](isolated, rng, SCALE)
    outcomes = [run(c, isolated, SECONDS, MEMORY) for c in cases]
    took = time.monotonic() - t
    codes = Counter(str(o.code) for o in outcomes)
    print(f"\n{family}: {len(cases)} cases in {took:.1f} s (seed {SEED}, scale {SCALE}); "
          f"slowest {max(o.seconds for o in outcomes):.1f} s; exits {dict(codes)}",
          file=sys.stderr)
    USED.update(c.renderer for c in cases)
    bad = [f"{o.case.name}: {o.failed} after {o.seconds:.1f} s\n{o.stderr[-1500:]}"
           for o in outcomes if o.failed]
    assert not bad, f"seed {SEED}: " + "\n".join(bad)


def test_every_renderer_was_fuzzed():
    if len(USED) < 2:
        pytest.skip("run with the families")
    assert set(FORMATS) <= USED, USED
