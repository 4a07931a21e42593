"""Record a block of code in this process: ``with recording(path): train()``.

The same backends as ``snapforensics record`` (CUDA/NPU allocator history, or the CPU allocator
through the profiler), started on entry and dumped to ``path`` on exit with the same provenance,
so one script can record several runs into several snapshots (the scenario matrix does). The
caller owns the process (torch.distributed is initialized or not as it likes); RANK / WORLD_SIZE /
LOCAL_RANK are read from the environment as the bootstrap does.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from pathlib import Path

from snapforensics.record._bootstrap import _provenance, rank_env
from snapforensics.record._write import write_pickle


@contextlib.contextmanager
def recording(path: Path, *, device: str = "auto", stacks: str = "python",
              max_entries: int = 1_000_000, command: list[str] | None = None) -> Iterator[None]:
    """Record allocations made inside the block; write the snapshot to ``path`` when it ends
    (also when the block raises: the exit code is then 1)."""
    import torch

    from snapforensics.record.backends import make_backend, select_backend

    name = select_backend(device)
    rank, world, local, local_known = rank_env()
    backend = make_backend(name, stacks, max_entries, local if local_known else None)
    started = datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(
        timespec="seconds")
    backend.start()
    code = 1
    try:
        yield
        code = 0
    finally:
        snap = backend.snapshot()
        extra = snap.get("snapforensics") if isinstance(snap.get("snapforensics"), dict) else {}
        prov = _provenance(backend=name, torch_version=str(torch.__version__),
                           rank=rank, world=world, local=local,
                           command=command or [f"pid {os.getpid()}"], stacks=stacks,
                           max_entries=max_entries, exit_code=code, started_at=started)
        snap["snapforensics"] = {**prov, **extra}
        write_pickle(Path(path), snap)
