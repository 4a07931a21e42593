"""Shared test helpers: where the real snapshot corpus lives.

The corpus (`../shared/corpus` next to the checkout, or `$SNAPFORENSICS_CORPUS`) holds snapshot
files from public repositories (see its MANIFEST.tsv). Tests that need it skip cleanly when it is
absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CORPUS = Path(os.environ.get("SNAPFORENSICS_CORPUS")
              or Path(__file__).resolve().parents[1].parent / "shared" / "corpus")


def corpus_files() -> list[Path]:
    """Every snapshot file of the corpus (not MANIFEST/README), sorted; [] when absent."""
    if not CORPUS.is_dir():
        return []
    return sorted(p for p in CORPUS.iterdir()
                  if p.is_file() and p.suffix not in (".tsv", ".md", ".txt"))


def corpus_file(name: str) -> Path:
    """One corpus file by name, or skip the test when the corpus (or that file) is absent."""
    p = CORPUS / name
    if not p.is_file():
        pytest.skip(f"corpus file {name} not available (set SNAPFORENSICS_CORPUS)")
    return p


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
