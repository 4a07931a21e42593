"""Real FSDP2 + checkpoint recordings for tests, made by the real recorder CLI.

    from recordings import record_variant, recorded, load_strict, replay_peak

    # [rank0.pickle, rank1.pickle]
    paths = record_variant("buggy", tmp_path_factory.mktemp("buggy"))

`record_variant` runs ``python -m snapforensics record --nproc-per-node N --device cpu --out DIR
-m snapforensics.examples.fsdp_ckpt -- --variant V --steps S [extra...]`` in a subprocess (CPU,
gloo; about 10 s for the default 6-block model on 2 ranks) and returns the snapshot paths in rank
order.

Session cache: the first call for a given ``(variant, nproc, steps, extra)`` records into its
``out_dir``; later calls in the same test session return those same files and ignore their
``out_dir`` (so two test modules asking for ``"fixed"`` record it once). Pass ``fresh=True`` to
force a new recording into ``out_dir``. Out dirs come from ``tmp_path_factory`` (session-scoped),
so the cached files live as long as the session. The ``recorded(variant, tmp_path_factory)``
shorthand makes the folder for you.

Also here: ``load_strict(path)`` (a pickle load that refuses every global, as the real loader
does), and ``replay_peak(snapshot)`` (max of cumulative alloc - free_completed over the trace).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "snapforensics.examples.fsdp_ckpt"

_cache: dict[tuple, list[Path]] = {}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def run_cli(args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m snapforensics ARGS`` with the checkout importable; output captured."""
    return subprocess.run([sys.executable, "-m", "snapforensics", *args], cwd=cwd or REPO,
                          env=env or _env(), capture_output=True, text=True, timeout=timeout)


def record_variant(variant: str, out_dir: Path, nproc: int = 2, steps: int = 3,
                   extra: Iterable[str] = (), *, fresh: bool = False) -> list[Path]:
    """Record one variant of the bundled example; the snapshot paths, rank order."""
    extra = tuple(str(e) for e in extra)
    key = (variant, nproc, steps, extra)
    if not fresh and key in _cache and all(p.is_file() for p in _cache[key]):
        return list(_cache[key])
    out_dir = Path(out_dir)
    args = ["record", "--nproc-per-node", str(nproc), "--device", "cpu", "--out", str(out_dir),
            "-m", EXAMPLE, "--", "--variant", variant, "--steps", str(steps), *extra]
    proc = run_cli(args)
    paths = [out_dir / f"rank{r}.pickle" for r in range(nproc)]
    missing = [p.name for p in paths if not p.is_file()]
    if proc.returncode != 0 or missing:
        raise AssertionError(
            f"recording {variant!r} failed: exit {proc.returncode}, missing {missing}\n"
            f"--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}")
    _cache[key] = paths
    return list(paths)


def recorded(variant: str, tmp_path_factory, **kw) -> list[Path]:
    """``record_variant`` into a fresh session temp folder (only made on a cache miss)."""
    key = (variant, kw.get("nproc", 2), kw.get("steps", 3),
           tuple(str(e) for e in kw.get("extra", ())))
    if key in _cache and all(p.is_file() for p in _cache[key]):
        return list(_cache[key])
    return record_variant(variant, tmp_path_factory.mktemp(f"rec-{variant}"), **kw)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def load_strict(path: Path):
    """Unpickle refusing every global: recorder output must be plain builtins only."""
    with open(path, "rb") as f:
        return _NoGlobals(f).load()


def unrecorded_bytes(snapshot: dict, device: int = 0) -> int:
    """Bytes the recorder found alive before its first entry (one `allocated_before_recording`
    block)."""
    return sum(b["size"] for s in snapshot.get("segments", []) if s["device"] == device
               for b in s["blocks"]
               if any(f["name"] == "allocated_before_recording" for f in b["frames"]))


def replay_peak(snapshot: dict, device: int = 0) -> int:
    """Max over the trace of cumulative (alloc - free_completed) bytes, on top of the bytes the
    recorder found alive before its first entry (the allocator's own total, written as one
    `allocated_before_recording` block): they are alive during the whole trace."""
    cur = peak = unrecorded_bytes(snapshot, device)
    for e in snapshot["device_traces"][device]:
        a = e["action"]
        if a == "alloc":
            cur += e["size"]
            if cur > peak:
                peak = cur
        elif a == "free_completed":
            cur -= e["size"]
    return peak
