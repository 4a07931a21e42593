"""Record several runs of the bundled example in ONE torch.distributed job, as the scenario
matrix does (`snapforensics.examples.scenarios`): torch is imported and gloo is set up once per
rank, then each run is recorded with the project's recorder (`record.inprocess.recording`, the
backend `snapforensics record` uses) into ``DIR/rank{R}.pickle``.

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(_worker, args=(spec["world"], spec["runs"]), nprocs=spec["world"], join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
