"""Shared fixtures: the corpus folder, real FSDP recordings and their diagnoses.

Helpers that are plain functions live in modules next to this file (`corpus`, `recordings`,
`edits`, `findings`); fixtures live here.
"""

from __future__ import annotations

import importlib.util
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


@pytest.fixture(scope="session")
def matrix(tmp_path_factory) -> Path:
    """The scenario matrix (snapforensics.examples.scenarios, 2 then 4 ranks) from the recordings
    cache (`recordings.matrix_folders`, recorded when absent): one folder holding
    <layout>/rank{R}.pickle and truth.rank{R}.json for every layout.
    SNAPFORENSICS_MATRIX=DIR reads a matrix recorded earlier into DIR instead."""
    pytest.importorskip("torch")
    from recordings import matrix_folders

    from snapforensics.examples.scenarios.layouts import LAYOUTS

    reuse = os.environ.get("SNAPFORENSICS_MATRIX")
    if reuse:
        out = Path(reuse)
    else:
        out = tmp_path_factory.mktemp("matrix")
        for folder in matrix_folders():
            for layout in folder.iterdir():
                (out / layout.name).symlink_to(layout, target_is_directory=True)
    missing = [n for n in LAYOUTS if not (out / n / "truth.rank0.json").is_file()]
    assert not missing, f"layouts not recorded: {missing}"
    return out


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Slow tests (those that need real FSDP recordings) run last, and the recordings they need
    that the cache lacks (`recordings.SUITE`, the matrix) are started in the background when the
    session begins, so the other tests run meanwhile."""
    slow = [i for i in items if i.get_closest_marker("slow")]
    if not slow:
        return
    items[:] = [i for i in items if not i.get_closest_marker("slow")] + slow
    if importlib.util.find_spec("torch") is None or config.option.collectonly:
        return
    import recordings

    modules = {i.module.__name__ for i in slow}
    if modules - {"test_matrix"}:
        full = any(i.get_closest_marker("full") for i in slow)
        recordings.start(recordings.SUITE + (recordings.FULL_SUITE if full else ()))
    if "test_matrix" in modules and not os.environ.get("SNAPFORENSICS_MATRIX"):
        recordings.start_matrix()
