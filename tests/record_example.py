"""Record several runs of the bundled example in one job: each run's ranks are spawned here
(gloo, CPU) and recorded with the project's recorder (`record.inprocess.recording`, the backend
`snapforensics record` uses) into ``DIR/rank{R}.pickle``. The worker can record several runs in
one process group, as the scenario matrix does, but runs after the first then carry 8 bytes
alive before their recording (see `main`), so each run gets fresh processes.

    python tests/record_example.py SPEC.json

SPEC.json: ``{"world": 2, "runs": [[DIR, [example args...]], ...]}``. Run by `recordings.py`
(the parent makes the folders and moves each finished one into the recordings cache).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
from pathlib import Path

EXAMPLE = "snapforensics.examples.fsdp_ckpt"


def _worker(rank: int, world: int, runs: list) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import _random as dtensor_random

    from snapforensics.examples.fsdp_ckpt import parse_args, train
    from snapforensics.record.inprocess import recording

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # as `snapforensics record` sets OMP_NUM_THREADS=1
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for out, argv in runs:
            gc.collect()
            dist.barrier()
            with recording(Path(out) / f"rank{rank}.pickle", command=["-m", EXAMPLE, *argv]):
                train(parse_args(argv), rank, world, torch.device("cpu"))
                gc.collect()
            # What a run leaves to the next in this process goes, so each starts as in a fresh
            # one: DTensor's RNG tracker (made on the first random op over a DTensor, kept in a
            # module global: torch/distributed/tensor/_dispatch.py) holds an 8-byte tensor that
            # would be alive before the next recording (`allocated_before_recording`).
            dtensor_random._rng_tracker = None
    finally:
        dist.destroy_process_group()


def main(spec_path: str) -> int:
    import torch.multiprocessing as mp

    spec = json.loads(Path(spec_path).read_text())
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    # One set of rank processes per run: ranks that had recorded a run of FSDP2 before kept
    # 8 bytes the next recording counted as alive before it (`allocated_before_recording`, and
    # so a "history truncated" warning; not DTensor's RNG tracker alone), so runs do not share
    # processes; the job still starts them all from here, one run after another.
    for run in spec["runs"]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        mp.spawn(_worker, args=(spec["world"], [run]), nprocs=spec["world"], join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
