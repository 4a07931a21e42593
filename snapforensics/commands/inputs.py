"""File discovery for the commands: what a folder, a glob, a URL or a path given stands for
(`expand`, from parallel.py, which the library's `parallel.run` shares).

The analysis gets finished Diagnosis objects; finding and loading files is command work.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.errors import SnapError
from snapforensics.parallel import expand

__all__ = ["diagnose_paths", "expand"]

def diagnose_paths(paths: Sequence[str | Path], jobs: int | None = None, cache: bool = True,
                   progress: bool = False, full: bool | None = None) -> list[Diagnosis]:
    """Diagnose each input once (a file given twice is read once), in order, in parallel
    processes and through the cache (`parallel.run`; `full`: key it by every byte). Every
    local path is checked first, so a
    typo in the last one fails before minutes of work; the first unreadable input is the
    error."""
    from snapforensics.parallel import is_url, run

    srcs = [str(p) for p in paths]
    missing = [s for s in srcs if not is_url(s) and not Path(s).exists()]
    if missing:
        raise SnapError(f"{missing[0]}: no such file")
    unique = list(dict.fromkeys(srcs))
    docs = dict(zip(unique, run(unique, jobs=jobs, cache=cache, progress=progress,
                                expanded=True, full=full)))
    bad = next((d for d in docs.values() if "error" in d), None)
    if bad is not None:
        raise SnapError(f"{bad['source']}: {bad['error']}")
    made = {s: Diagnosis.from_dict(d) for s, d in docs.items()}
    return [made[s] for s in srcs]
