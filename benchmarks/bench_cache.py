"""Cache: a first run (nothing cached) vs a re-run of the same unchanged file, in one process.

For each file it prints, in seconds, the first `diagnose` (load + analysis, writing the cache),
the re-run (the cached diagnosis document), the re-run when only the model is cached (analysis
code changed: the npz entry is read, the rules run again), and the ratios to the first run.
The issue-10 target: re-run <= 0.1x the first run. The cache lives in a temporary folder.

    python benchmarks/bench_cache.py                   # the 4 largest corpus files + 300k synthetic
    python benchmarks/bench_cache.py a.pickle --entries 0
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fleet import source  # noqa: E402
from bench_load import CORPUS, synthetic  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(path: Path) -> str:
    from snapforensics import doccache
    from snapforensics.analysis import diagnose
    from snapforensics.snapshot import cache

    first = timed(lambda: doccache.diagnose(path))
    again = timed(lambda: doccache.diagnose(path))
    model = timed(lambda: diagnose(cache.load(path)))
    return (f"{path.name[:40]:40} {path.stat().st_size / 1e6:7.1f} {first:8.3f} {again:8.3f} "
            f"{model:8.3f} {again / first:8.3f}x {model / first:8.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--entries", type=int, default=300_000, help="synthetic file (0: none)")
    args = ap.parse_args()
    files = list(args.files)
    if not files and CORPUS.is_dir():
        files = sorted((p for p in CORPUS.iterdir() if p.suffix in (".pickle", ".pkl")),
                       key=lambda p: -p.stat().st_size)[:4]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SNAPFORENSICS_CACHE_DIR"] = str(Path(tmp) / "cache")
        os.environ.pop("SNAPFORENSICS_NO_CACHE", None)
        if args.entries:
            files.append(synthetic(source(Path(tmp)), args.entries,
                                   Path(tmp) / f"synthetic_{args.entries}.pickle"))
        print(f"{'file':40} {'MB':>7} {'first':>8} {'re-run':>8} {'model':>8} "
              f"{'re/first':>9} {'model/first':>9}")
        for p in files:
            print(measure(p), flush=True)


if __name__ == "__main__":
    main()
