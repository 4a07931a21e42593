"""Fleet speed-up: `-j 1` vs `-j N` on the same rank files, cache off, in one run.

Builds RANKS synthetic rank files (a real trace repeated to ENTRIES entries, as bench_load does;
never committed), then diagnoses the folder with 1 worker and with N workers and prints the
ratio. The issue-10 target: `-j 2` on 4 rank files on a 2-core machine >= 1.7x faster.

    python benchmarks/bench_fleet.py                    # 4 ranks x 300k entries, -j 2
    python benchmarks/bench_fleet.py --ranks 8 --jobs 4 --entries 100000
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_load import CORPUS, synthetic  # noqa: E402

from snapforensics.parallel import run  # noqa: E402


def source(tmp: Path) -> Path:
    """A plain-pickle real snapshot: the corpus's, else the committed fixture decompressed."""
    p = CORPUS / "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"
    if p.is_file():
        return p
    out = tmp / "fixture.pickle"
    with gzip.open(ROOT / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz") as f, \
            open(out, "wb") as g:
        shutil.copyfileobj(f, g)
    return out


def _cpu() -> float:
    """CPU seconds of this process and its finished workers: equal for both runs when the
    work splits cleanly, so a ratio below the target on a busy machine is contention."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--entries", type=int, default=300_000)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run_dir = tmp / "run"
        run_dir.mkdir()
        first = synthetic(source(tmp), args.entries, run_dir / "rank0.pickle")
        for r in range(1, args.ranks):
            shutil.copy(first, run_dir / f"rank{r}.pickle")
        mb = first.stat().st_size / 1e6
        print(f"{args.ranks} rank files of {args.entries} entries ({mb:.0f} MB each), "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
        run([run_dir / "rank0.pickle"], jobs=1, cache=False, progress=False)  # warm imports
        times = {}
        for j in (1, args.jobs):
            cpu = _cpu()
            t = time.perf_counter()
            docs = run([run_dir], jobs=j, cache=False, progress=False)
            times[j] = time.perf_counter() - t
            assert all("error" not in d for d in docs), docs
            used = _cpu() - cpu
            print(f"-j {j}: {times[j]:.2f} s wall, {used:.2f} CPU-s ({used / times[j]:.2f} cores "
                  "busy)", flush=True)
        print(f"speed-up -j {args.jobs} vs -j 1: {times[1] / times[args.jobs]:.2f}x "
              f"(load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
