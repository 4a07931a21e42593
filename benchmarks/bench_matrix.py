"""Recording cost of the scenario matrix: wall and CPU seconds per layout and in total.

Prints figures; it is not a test. Records every layout (2 ranks, then the 4-rank ones) with
``python -m snapforensics.examples.scenarios`` into a temporary folder (or reads a folder
recorded earlier, ``--from DIR``) and sums what each rank's truth file says the layout took
(``seconds``: wall, ``cpu_seconds``: this rank's CPU) plus the jobs' own wall time (start-up
included). CPU seconds are what the matrix costs on an idle machine; wall time on a shared one
depends on the load (printed).

    python benchmarks/bench_matrix.py
    python benchmarks/bench_matrix.py --from /tmp/matrix
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def record(out: Path) -> dict[int, float]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    walls = {}
    for world in (2, 4):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "snapforensics.examples.scenarios", "--out", str(out),
                        "--world", str(world)], cwd=REPO, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        walls[world] = time.perf_counter() - t0
    return walls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="src", type=Path, help="a matrix recorded earlier")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.src or Path(tmp)
        walls = {} if args.src else record(out)
        rows = []
        for truth in sorted(out.glob("*/truth.rank0.json")):
            t = json.loads(truth.read_text())
            ranks = [json.loads(p.read_text()) for p in truth.parent.glob("truth.rank*.json")]
            cpu = sum(r.get("cpu_seconds", 0) for r in ranks)
            rows.append((t["layout"], t.get("world", 0), t.get("seconds", 0), cpu))
    for name, world, wall, cpu in rows:
        print(f"{name:28s} {world} ranks  wall {wall:7.2f} s  cpu (all ranks) {cpu:6.2f} s")
    total_cpu = sum(r[3] for r in rows)
    total_wall = sum(r[2] for r in rows)
    print(f"{len(rows)} layouts: layouts' wall {total_wall:.0f} s, CPU {total_cpu:.0f} s "
          f"(= {total_cpu / (os.cpu_count() or 1):.0f} s on {os.cpu_count()} idle cores)")
    if walls:
        print("jobs' wall (start-up included): " +
              ", ".join(f"{w} ranks {s:.0f} s" for w, s in walls.items()))
    print(f"load average now: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
