"""``snapforensics record``: run a training script unmodified and write one snapshot per rank.

``record(target, script_args, ...)`` launches ``target`` (a script path, or a module with
``module=True``) under allocator recording:

- one rank (``nproc_per_node=1``): a child ``python -m snapforensics.record._bootstrap``, which
  runs the script as ``python SCRIPT ARGS`` would (no torchrun environment is invented);
- several ranks: ``python -m torch.distributed.run --standalone --nproc-per-node N -m
  snapforensics.record._bootstrap ...``; each rank sees RANK/WORLD_SIZE/MASTER_* as under torchrun;
- already inside a torchrun launch (``TORCHELASTIC_RUN_ID``, or ``LOCAL_RANK`` + ``WORLD_SIZE``)
  with ``nproc_per_node=1``: this process is recorded in place.

Each rank writes ``OUT/rank{R}.pickle`` (the ``torch.cuda.memory._snapshot()`` format, plus a
top-level ``"snapforensics"`` provenance dict). CUDA and NPU record the device caching
allocator's history; without an accelerator the CPU allocator is recorded through the profiler
(``snapforensics.record.cpu``). torch is never imported by this module.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from snapforensics.errors import EXIT_RECORD_FAILED, SnapError

__all__ = ["RecordResult", "record", "DEVICES", "STACKS", "in_torchrun"]

DEVICES = ("auto", "cuda", "npu", "cpu")
STACKS = ("python", "all")


@dataclass
class RecordResult:
    exit_code: int  # the script's own exit code; several ranks: the first nonzero, else 0
    out_dir: Path
    snapshots: list[Path]  # OUT/rank{R}.pickle, in rank order
    oom_snapshots: list[Path] = field(default_factory=list)  # OUT/rank{R}.oom.pickle (CUDA/NPU OOM)


def in_torchrun(environ: os._Environ[str] | dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return bool(env.get("TORCHELASTIC_RUN_ID")) or ("LOCAL_RANK" in env and "WORLD_SIZE" in env)


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"snapforensics record: {msg}", file=sys.stderr, flush=True)


def _package_root() -> str:
    """The directory holding the ``snapforensics`` package (children must import it)."""
    import snapforensics

    return str(Path(snapforensics.__file__).resolve().parent.parent)


def _default_out(cwd: Path, inside_torchrun: bool) -> Path:
    base = cwd / "snapforensics-out"
    if inside_torchrun:
        # every rank must agree on the folder without talking to the others
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if run_id and run_id != "none":
            return base / f"record-torchrun-{run_id}"
        ppid = os.getppid()
        try:
            started = os.stat(f"/proc/{ppid}").st_ctime  # the launcher's start
            stamp = datetime.datetime.fromtimestamp(started).strftime("%Y%m%d-%H%M%S")
            return base / f"record-{stamp}-torchrun{ppid}"
        except OSError:
            return base / f"record-torchrun{ppid}"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = base / f"record-{stamp}"
    n = 2
    while out.exists():
        out = base / f"record-{stamp}-{n}"
        n += 1
    return out


def _check_target(target: str, module: bool) -> None:
    if module:
        top = target.split(".")[0]
        if not top or not all(part.isidentifier() for part in target.split(".")):
            raise SnapError(f"not a module name: {target!r}", exit_code=EXIT_RECORD_FAILED)
        saved = sys.path[:]
        try:
            sys.path.insert(0, os.getcwd())  # as `python -m` would see it
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path[:] = saved
        if not found:
            raise SnapError(f"no module named {top!r} (for -m {target})",
                            exit_code=EXIT_RECORD_FAILED)
    elif not os.path.exists(target):
        raise SnapError(f"script not found: {target}", exit_code=EXIT_RECORD_FAILED)


def _check_torch() -> None:
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SnapError(f"torch is not importable in {sys.executable}; install it "
                        "(pip install 'snapforensics[record]') to record",
                        exit_code=EXIT_RECORD_FAILED)


def _run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Run the launcher; Ctrl-C reaches the children through the process group: let them dump."""
    proc = subprocess.Popen(cmd, env=env)
    interrupts = 0
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            # the first Ctrl-C reached the children too: let them write their snapshots;
            # a second one terminates the launcher, a third kills it
            interrupts += 1
            if interrupts == 2:
                proc.terminate()
            elif interrupts > 2:
                proc.kill()


def record(target: str, script_args: list[str], *, module: bool = False, out: Path | None = None,
           nproc_per_node: int = 1, device: str = "auto", stacks: str = "python",
           max_entries: int = 1_000_000, quiet: bool = False) -> RecordResult:
    """Run ``target`` with ``script_args`` under memory recording; see the module docstring."""
    script_args = [str(a) for a in script_args]
    if device not in DEVICES:
        raise SnapError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})",
                        exit_code=EXIT_RECORD_FAILED)
    if stacks not in STACKS:
        raise SnapError(f"unknown stacks {stacks!r} (choose from {', '.join(STACKS)})",
                        exit_code=EXIT_RECORD_FAILED)
    if nproc_per_node < 1:
        raise SnapError("--nproc-per-node must be at least 1", exit_code=EXIT_RECORD_FAILED)
    if max_entries < 1:
        raise SnapError("--max-entries must be at least 1", exit_code=EXIT_RECORD_FAILED)
    _check_torch()
    _check_target(target, module)

    inside = in_torchrun() and nproc_per_node == 1
    out_dir = Path(out) if out is not None else _default_out(Path.cwd(), inside)
    out_dir = out_dir.resolve()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SnapError(f"cannot create {out_dir}: {e}", exit_code=EXIT_RECORD_FAILED) from None
    opts = {"out": str(out_dir), "device": device, "stacks": stacks,
            "max_entries": int(max_entries), "module": bool(module)}

    if inside:
        from snapforensics.record._bootstrap import run_recorded

        status = run_recorded(opts, target, script_args)
        try:
            os.unlink(out_dir / f".rank{status['rank']}.status.json")
        except OSError:
            pass
        return _result([status], out_dir, expected=[status["rank"]], launcher_rc=None, quiet=quiet)

    ranks = list(range(nproc_per_node))
    for r in ranks:  # a stale status from an earlier run must not be read as this run's
        try:
            os.unlink(out_dir / f".rank{r}.status.json")
        except OSError:
            pass
    env = dict(os.environ)
    root = _package_root()
    env["PYTHONPATH"] = os.pathsep.join(
        [root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    boot = ["-m", "snapforensics.record._bootstrap", json.dumps(opts), target, *script_args]
    if nproc_per_node == 1:
        cmd = [sys.executable, *boot]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc_per_node), *boot]
    what = f"-m {target}" if module else target
    _say(quiet, f"recording {what} on {nproc_per_node} rank(s), device {device} -> {out_dir}")
    rc = _run_child(cmd, env)

    statuses = []
    for r in ranks:
        p = out_dir / f".rank{r}.status.json"
        try:
            statuses.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
        try:
            os.unlink(p)
        except OSError:
            pass
    return _result(statuses, out_dir, expected=ranks, launcher_rc=rc, quiet=quiet)


def _result(statuses: list[dict], out_dir: Path, *, expected: list[int], launcher_rc: int | None,
            quiet: bool) -> RecordResult:
    by_rank = {s["rank"]: s for s in statuses}
    errors = [s["error"] for s in statuses if s.get("error")]
    setup_failed = [s for s in statuses if s.get("error") and s.get("snapshot") is None
                    and s.get("exit_code") == EXIT_RECORD_FAILED]
    if setup_failed:
        raise SnapError(setup_failed[0]["error"], exit_code=EXIT_RECORD_FAILED)
    snapshots = [Path(by_rank[r]["snapshot"]) for r in expected
                 if r in by_rank and by_rank[r].get("snapshot")]
    ooms = [Path(by_rank[r]["oom_snapshot"]) for r in expected
            if r in by_rank and by_rank[r].get("oom_snapshot")]
    missing = [r for r in expected if r not in by_rank]
    if not snapshots:
        why = errors[0] if errors else (
            f"the launcher exited with {launcher_rc}" if launcher_rc is not None else "no status")
        raise SnapError(f"no snapshot was written ({why})", exit_code=EXIT_RECORD_FAILED)
    for r in expected:
        s = by_rank.get(r)
        if s and s.get("snapshot"):
            size = s.get("bytes") or 0
            t = s.get("timings") or {}
            detail = "".join(f", {k[:-2].replace('_', ' ')} {v} s" for k, v in t.items())
            _say(quiet, f"rank {r}: {s['snapshot']} ({s.get('entries')} trace entries, "
                        f"{size / 1e6:.1f} MB, written in {s.get('seconds')} s{detail})")
    for e in errors:
        _say(False, f"warning: {e}")
    if missing:
        _say(False, f"warning: rank(s) {', '.join(map(str, missing))} wrote no snapshot "
                    f"(killed? launcher exit code {launcher_rc})")
    codes = [by_rank[r]["exit_code"] for r in expected if r in by_rank]
    exit_code = next((c for c in codes if c), 0)
    if exit_code == 0 and missing and launcher_rc:
        exit_code = _launcher_code(launcher_rc)
    return RecordResult(exit_code=int(exit_code), out_dir=out_dir, snapshots=snapshots,
                        oom_snapshots=ooms)


def _launcher_code(rc: int) -> int:
    if rc < 0:  # killed by a signal: what a shell would report
        return 128 + (-rc)
    return rc

