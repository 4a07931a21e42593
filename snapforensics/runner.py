"""The runner layer: inputs given as paths (files, run folders, globs, URLs) to finished
Diagnoses and Comparisons. The Python API (`api.py`) and the commands (`commands/`) both call
it; it runs every diagnosis through `parallel.run` (worker processes, the document cache).

The analysis gets finished Diagnosis objects; finding and loading files is this layer's work.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from snapforensics.analysis.diagnosis import Diagnosis
from snapforensics.analysis.fleet import Fleet, WorstPlots, fleet
from snapforensics.errors import SnapError
from snapforensics.parallel import expand, is_url, run

__all__ = ["compare_folders", "compare_paths", "diagnose_paths", "expand", "fleet_paths"]


def diagnose_paths(paths: Sequence[str | Path], jobs: int | None = None, cache: bool = True,
                   progress: bool = False, full: bool | None = None,
                   **opts: Any) -> list[Diagnosis]:
    """Diagnose each input once (a file given twice is read once), in order, in parallel
    processes and through the cache (`parallel.run`; `full`: key it by every byte; `opts`:
    its `scheduler` and `categories`). Every local path is checked first, so a typo in the
    last one fails before minutes of work; the first unreadable input is the error."""
    srcs = [str(p) for p in paths]
    missing = [s for s in srcs if not is_url(s) and not Path(s).exists()]
    if missing:
        raise SnapError(f"{missing[0]}: no such file")
    unique = list(dict.fromkeys(srcs))
    docs = dict(zip(unique, run(unique, jobs=jobs, cache=cache, progress=progress,
                                expanded=True, full=full, **opts)))
    bad = next((d for d in docs.values() if "error" in d), None)
    if bad is not None:
        raise SnapError(f"{bad['source']}: {bad['error']}")
    made = {s: Diagnosis.from_dict(d) for s, d in docs.items()}
    return [made[s] for s in srcs]


def fleet_paths(files: Sequence[str], **opts: Any) -> Fleet:
    """Many rank files (`expand`'s result) into one fleet view; an unreadable file is listed in
    the fleet's errors, not raised. Only the plot the fleet draws is kept (`WorstPlots`)."""
    return fleet(run(list(files), expanded=True, on_doc=WorstPlots().add, **opts))


def compare_paths(paths: Sequence[str | Path], mode: str = "auto", **run):
    """Expand folders and globs, diagnose each file once, compare (analysis.compare)."""
    from snapforensics.analysis.compare import compare

    files = expand(paths)
    if len(files) < 2:
        raise SnapError("compare needs at least two snapshots (baseline first), "
                        f"got {len(files)}")
    return compare(diagnose_paths(files, **run), mode=mode)


def compare_folders(a: str, b: str, **run):
    """Two run folders, rank by rank (analysis.gate.compare_runs)."""
    from snapforensics.analysis.gate import compare_runs

    fa, fb = expand([a]), expand([b])
    diags = diagnose_paths(fa + fb, **run)
    return compare_runs(a, b, diags[:len(fa)], diags[len(fa):])


def pipeline_forecast_paths(paths: Sequence[str | Path], stages=(), microbatches=(), schedules=(),
                            source_name: str = "", world_sizes=(), tps=()):
    """The pipeline forecast (analysis/forecast/pipeline.py) of the stage files at `paths` (a
    run folder, a glob, files), each file's device with the longest trace."""
    from snapforensics.analysis.context import analyse
    from snapforensics.analysis.forecast.pipeline import pipeline_forecast
    from snapforensics.snapshot import load

    analyses = []
    for path in expand(list(paths)):
        snap = load(path)
        traces = [t for t in snap.active_traces if len(t)]
        if traces:
            analyses.append(analyse(snap, max(traces, key=len)))
    return pipeline_forecast(analyses, stages, microbatches, schedules, source_name,
                             world_sizes, tps)
