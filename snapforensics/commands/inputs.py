"""File discovery for the commands: what a folder, a glob or a path given stands for.

The analysis gets finished Diagnosis objects; finding and loading files is command work.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Sequence
from pathlib import Path

from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.errors import SnapError

SNAPSHOT_SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")


def _rank_order(paths: Iterable[Path]) -> list[Path]:
    from snapforensics.snapshot import rank_from_name

    def key(q: Path):
        r = rank_from_name(str(q))
        return (r is None, r or 0, str(q))
    return sorted(paths, key=key)


def expand(args: Iterable[str | Path]) -> list[Path]:
    """Paths as given; a folder stands for its rank*.pickle files, in rank order; a quoted glob
    that names no file as such is expanded. Nothing is deduplicated: order is meaning."""
    out: list[Path] = []
    for a in args:
        p = Path(a)
        if p.is_dir():
            files = [q for q in p.iterdir() if q.is_file() and q.name.lower().startswith("rank")
                     and q.name.lower().endswith(SNAPSHOT_SUFFIXES)]
            if not files:
                raise SnapError(f"{p}: is a directory with no rank*.pickle files")
            out += _rank_order(files)
        elif not p.exists() and any(ch in str(a) for ch in "*?["):
            hits = glob.glob(str(a))
            if not hits:
                raise SnapError(f"{a}: no file matches this pattern")
            out += _rank_order(Path(h) for h in hits)
        else:
            out.append(p)
    return out


def diagnose_paths(paths: Sequence[Path], categories: dict | None = None) -> list[Diagnosis]:
    """Load and diagnose each path once (a file given twice is read once), in order. Every
    path is checked first, so a typo in the last one fails before minutes of work.
    `categories`: user categories (`analysis.classify.user_categories`)."""
    from snapforensics.analysis.diagnose import diagnose
    from snapforensics.snapshot import load

    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise SnapError(f"{missing[0]}: no such file")
    cache: dict[str, Diagnosis] = {}
    for p in paths:
        key = str(Path(p).resolve())
        if key not in cache:
            cache[key] = diagnose(load(p), categories)
    return [cache[str(Path(p).resolve())] for p in paths]
