"""What every ground-truth example shares: the model-size flags and ``--truth DIR``, and the
truth file each rank writes (``DIR/truth.rank{R}.json``, read from the running state)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def parser(*, layers: int, dim: int, batch: int, seq: int, steps: int) -> argparse.ArgumentParser:
    """An argument parser with the shared flags, each example's defaults."""
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--truth", type=Path, help="write DIR/truth.rank{R}.json")
    return p


def write_truth(folder: Path | None, rank: int, truth: dict[str, Any]) -> None:
    """This rank's truth file, where ``--truth`` asked for one."""
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"truth.rank{rank}.json").write_text(json.dumps(truth))
