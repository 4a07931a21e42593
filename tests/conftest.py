"""Shared fixtures: the corpus folder, real FSDP recordings and their diagnoses.

Helpers that are plain functions live in modules next to this file (`corpus`, `recordings`,
`edits`, `findings`); fixtures live here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from corpus import CORPUS

from snapforensics.analysis import diagnose
from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.snapshot import load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    if not CORPUS.is_dir():
        pytest.skip(f"snapshot corpus not found at {CORPUS} (set SNAPFORENSICS_CORPUS)")
    return CORPUS


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """The suite never reads or writes the user's cache (~/.cache/snapforensics): one private
    cache folder for the session, inherited by the CLI subprocesses."""
    if not os.environ.get("SNAPFORENSICS_TEST_CACHE"):
        os.environ["SNAPFORENSICS_TEST_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    monkeypatch.setenv("SNAPFORENSICS_CACHE_DIR", os.environ["SNAPFORENSICS_TEST_CACHE"])


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The committed real recordings (fsdp2_ckpt_{buggy,fixed}_rank0.pickle.gz)."""
    return FIXTURES


@pytest.fixture(scope="session")
def recording(tmp_path_factory):
    """`recording(variant, **kw)`: rank 0's snapshot of a real run of the bundled example
    (CPU, gloo; `recordings.recorded` keywords), recorded once per session."""
    pytest.importorskip("torch")
    from recordings import recorded

    def get(variant: str, **kw) -> Path:
        return recorded(variant, tmp_path_factory, **kw)[0]

    return get


@pytest.fixture(scope="session")
def diagnosed(recording):
    """`diagnosed(variant, **kw)`: the Diagnosis of `recording(variant, **kw)`, made once."""
    cache: dict[tuple, Diagnosis] = {}

    def get(variant: str, **kw) -> Diagnosis:
        key = (variant, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in cache:
            cache[key] = diagnose(load(recording(variant, **kw)))
        return cache[key]

    return get
