"""Atomic writes: a temp file in the target directory, fsync, chmod 0644, ``os.replace``."""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

TMP_PREFIX = ".snapforensics-tmp-"


def _atomic(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX + path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; torch_npu's own dump makes 0200
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_pickle(path: Path, obj: Any) -> None:
    """``pickle.dump(obj, protocol=4)`` to ``path``, atomically."""
    _atomic(path, lambda f: pickle.dump(obj, f, protocol=4))


def write_json(path: Path, obj: Any) -> None:
    _atomic(path, lambda f: f.write(json.dumps(obj).encode()))
