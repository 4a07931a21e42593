"""Where the real snapshot corpus lives, and its files.

The corpus (`../shared/corpus` next to the checkout, or `$SNAPFORENSICS_CORPUS`) holds snapshot
files from public repositories (see its MANIFEST.tsv). Tests that need it skip cleanly when it is
absent: `corpus_file(name)` skips, `corpus_files()` is [] (for parametrizing at collection).
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
