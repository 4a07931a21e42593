"""``snapforensics record``: run a training script unmodified and write one snapshot per rank.

``record(target, script_args, ...)`` launches ``target`` (a script path, or a module with
``module=True``) under allocator recording:

- ``nproc_per_node`` ranks (1 by default) are started by the recorder itself, each a child
  ``python -m snapforensics.record._bootstrap`` with torchrun's environment (RANK, LOCAL_RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port; OMP_NUM_THREADS=1
  when unset and there are several ranks), so a torchrun-style script runs as under
  ``torchrun --standalone``. The ranks share one new process group: SIGINT/SIGTERM/SIGHUP sent
  to the recorder are forwarded to that whole group (each rank stops its script and still writes
  what it recorded; a second signal kills them). When one rank fails, the others are stopped the
  same way (a rank blocked in a collective, where Python never sees the signal, dumps from
  the bootstrap's watcher thread); one still running ``STOP_GRACE_S`` after that is killed.
- already inside a torchrun launch (``TORCHELASTIC_RUN_ID``, or ``LOCAL_RANK`` + ``WORLD_SIZE``)
  or an ``srun`` task (``SLURM_PROCID`` + ``SLURM_NTASKS`` + ``SLURM_STEP_ID``) with
  ``nproc_per_node=1``: this process is recorded in place.

Each rank writes ``OUT/rank{R}.pickle`` (the ``torch.cuda.memory._snapshot()`` format, plus a
top-level ``"snapforensics"`` provenance dict). CUDA and NPU record the device caching
allocator's history; without an accelerator the CPU allocator is recorded through the profiler
(``snapforensics.record.cpu``). ``OUT`` is locked while recording (``.snapforensics-record.lock``,
``flock``): a second record into it is refused, and so is a non-empty ``OUT`` unless ``force``.
No temp, status or lock file is left behind. torch is never imported by this module.
"""

from __future__ import annotations

import datetime
import fcntl
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from snapforensics.errors import EXIT_BAD_INPUT, EXIT_RECORD_FAILED, SnapError
from snapforensics.record._write import TMP_PREFIX
from snapforensics.record.backends import DEVICES, STACKS

__all__ = ["DEVICES", "STACKS", "RecordResult", "in_torchrun", "names", "record"]


def names(model=None, optimizer=None, path=None, device=None):
    """``with snapforensics.record.names(model, optimizer, path="snap.pickle"): train()``
    after ``torch.cuda.memory._record_memory_history(...)``: the dump at ``path`` names every
    parameter, gradient, optimizer state and tensor saved for backward (``record/identity.py``;
    torch is imported when it is called, not here)."""
    from snapforensics.record.identity import names as _names

    return _names(model, optimizer, path, device)



@dataclass
class RecordResult:
    exit_code: int  # the script's own exit code; several ranks: the first nonzero, else 0
    out_dir: Path
    snapshots: list[Path]  # OUT/rank{R}.pickle, in rank order
    oom_snapshots: list[Path] = field(default_factory=list)  # OUT/rank{R}.oom.pickle (CUDA/NPU OOM)


def in_torchrun(environ: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """Inside a launch that gave this process its rank: torchrun's variables, or SLURM's
    (``srun`` sets ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS`` in each task)."""
    env = os.environ if environ is None else environ
    return (bool(env.get("TORCHELASTIC_RUN_ID")) or ("LOCAL_RANK" in env and "WORLD_SIZE" in env)
            or ("SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env))


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
        job = os.environ.get("SLURM_JOB_ID")
        if job and "SLURM_PROCID" in os.environ:
            return base / f"record-slurm-{job}.{os.environ.get('SLURM_STEP_ID', '0')}"
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


_LAUNCHERS = ("python", "python3", "torchrun")
_LAUNCHER_FLAGS = ("--standalone", "--no-python", "--no_python", "--run-path", "--run_path")
_OWN_OPTIONS = ("--nproc-per-node", "--out", "--device", "--stacks", "--max-entries", "--force",
                "--quiet")


def _check_target(target: str, module: bool, script_args: list[str] = ()) -> None:
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
    else:
        hint = None if target.endswith(".py") else _launcher_suggestion(target, list(script_args))
        if hint or not os.path.exists(target):
            raise SnapError(hint or f"script not found: {target}", exit_code=EXIT_RECORD_FAILED)


def _launcher_suggestion(target: str, args: list[str]) -> str | None:
    """``record python x.py`` / ``record torchrun --nproc-per-node 2 x.py``: what to type."""
    name = os.path.basename(target)
    if name not in _LAUNCHERS and not name.startswith("python"):
        return None
    rest = list(args)
    if rest[:2] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
        rest = rest[2:]
    ours: list[str] = []
    while rest and rest[0].startswith("-") and rest[0] != "-m":  # the launcher's own options
        opt, eq, value = rest[0].partition("=")
        step = 1 if eq or opt in _LAUNCHER_FLAGS or not opt.startswith("--") else 2
        if step == 2:
            value = rest[1] if len(rest) > 1 else ""
        if opt.replace("_", "-") == "--nproc-per-node":
            ours += ["--nproc-per-node", value]
        rest = rest[step:]
    usage = "snapforensics record [--nproc-per-node N] SCRIPT [ARGS]"
    try_ = f"; try: {' '.join(['snapforensics record', *ours, *rest])}" if rest else ""
    return (f"{target} is a launcher, not a script: record launches the script itself "
            f"({usage}){try_}")


def _hint_misplaced_options(script_args: list[str], quiet: bool) -> None:
    misplaced = [a for a in script_args if a.split("=", 1)[0] in _OWN_OPTIONS]
    if misplaced:
        opt = misplaced[0].split("=", 1)[0]
        _say(quiet, f"hint: options after the script go to the script; put {opt} before it")


def _check_torch() -> None:
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SnapError(f"torch is not importable in {sys.executable}; install it "
                        "(pip install 'snapforensics[record]') to record",
                        exit_code=EXIT_RECORD_FAILED)


# after a rank failed, the others get SIGTERM and this long to dump (the CPU recorder's stop and
# conversion take seconds to a minute); one still running then is blocked where Python never
# sees the signal (a collective waiting for the dead rank): killed
STOP_GRACE_S = 120.0
LOCK_NAME = ".snapforensics-record.lock"
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_HELD = {signal.SIGINT, signal.SIGTERM}  # as the bootstrap's _HELD


# MASTER_PORT is bound by rank 0's store after this process let it go: a port the kernel hands
# out (32768-60999 on Linux) can be taken in between by any connect() on the machine, gloo's
# many among them (a clean clone's tests, 4 recordings at once: EADDRINUSE). One below that
# range is taken only by a process that asks for it by number.
_PORTS = (20000, 32767)


def _free_port() -> int:
    rng = random.Random()  # not the script's seeded generator: its own, from the OS
    for _ in range(64):
        port = rng.randint(*_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all busy: the kernel's
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(base: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    """What ``torchrun --standalone --nproc-per-node WORLD`` gives rank ``rank``."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does (without its banner)
    return env


class _Ranks:
    """The rank processes, in one process group, and the signals forwarded to it."""

    def __init__(self, cmd: list[str], envs: list[dict[str, str]]) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pgid: int | None = None
        self.signals = 0
        self.first_signal: int | None = None
        self.failed: list[int] = []  # ranks that exited nonzero, in the order they did
        self.stop_at: float | None = None
        # forwarding from before the first rank starts: a Ctrl-C meanwhile is not lost
        self.handlers = _install(_FORWARDED, self.on_signal)
        # each rank starts with SIGINT/SIGTERM blocked (the mask is inherited through exec): it
        # holds them until its script starts, so a Ctrl-C during its imports ends it quietly
        held = _HELD.intersection(signal.pthread_sigmask(signal.SIG_BLOCK, _HELD))
        try:
            for env in envs:
                group = self.procs[0].pid if self.procs else 0
                self.procs.append(subprocess.Popen(cmd, env=env, process_group=group))
                self.pgid = self.procs[0].pid
        except BaseException:
            self._send(signal.SIGKILL)
            _install(_FORWARDED, self.handlers)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD - held)
        if self.first_signal is not None:  # came while the ranks were being started
            self._send(self.first_signal)

    def _send(self, sig: int) -> None:
        if self.pgid is None:
            return
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def on_signal(self, signum, frame) -> None:
        self.signals += 1
        self._send(signum if self.signals == 1 else signal.SIGKILL)
        if self.signals == 1:
            self.first_signal = signum
            # a rank that never answers (blocked where neither Python nor the watcher runs) is
            # killed after the same grace as when a rank fails
            self.stop_at = time.monotonic() + STOP_GRACE_S
            name = "interrupted" if signum == signal.SIGINT else signal.Signals(signum).name
            _say(False, f"{name}: writing snapshots ...")

    def wait(self) -> list[int]:
        try:
            while True:
                for r, p in enumerate(self.procs):
                    if p.returncode is None and p.poll() is not None and p.returncode != 0:
                        self.failed.append(r)
                if all(p.returncode is not None for p in self.procs):
                    return [p.returncode for p in self.procs]
                if self.failed and not self.signals and self.stop_at is None:
                    self._send(signal.SIGTERM)  # the others would wait for the failed rank
                    self.stop_at = time.monotonic() + STOP_GRACE_S
                elif self.stop_at is not None and time.monotonic() > self.stop_at:
                    self._send(signal.SIGKILL)
                time.sleep(0.05)
        finally:
            _install(_FORWARDED, self.handlers)


def _install(signals, handler):
    """Set ``handler`` (one, or a list per signal) for ``signals``; the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return handler
    old = []
    for i, sig in enumerate(signals):
        h = handler[i] if isinstance(handler, list) else handler
        old.append(signal.signal(sig, h if h is not None else signal.SIG_DFL))
    return old


class _OutLock:
    """``OUT`` for this record only: created, locked (``flock`` on a lock file, released by the
    kernel even if the recorder is killed), refused when it holds files unless ``force`` (which
    removes earlier ``rank*.pickle``). At exit: status, temp and lock files removed."""

    def __init__(self, out: Path, force: bool) -> None:
        self.out = out
        self.force = force
        self.fd: int | None = None
        self.created = False

    def __enter__(self) -> _OutLock:
        try:
            self.created = not self.out.exists()
            self.out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.out / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise SnapError(f"cannot create {self.out}: {e.strerror or e}",
                            exit_code=EXIT_BAD_INPUT) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise SnapError(f"another snapforensics record is writing into {self.out}; "
                            "choose another --out", exit_code=EXIT_BAD_INPUT) from None
        self.fd = fd
        others = sorted(p.name for p in self.out.iterdir() if p.name != LOCK_NAME)
        if others and not self.force:  # leave the folder exactly as it was
            (self.out / LOCK_NAME).unlink(missing_ok=True)
            os.close(fd)
            self.fd = None
            raise SnapError(f"--out {self.out} is not empty ({others[0]}"
                            f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}); "
                            "choose a new folder, or --force to replace its snapshots",
                            exit_code=EXIT_BAD_INPUT)
        if self.force:
            for p in self.out.glob("rank*.pickle"):
                p.unlink(missing_ok=True)
        self._clean()
        return self

    def _clean(self) -> None:
        for pattern in (".rank*.status.json", TMP_PREFIX + "*"):
            for p in self.out.glob(pattern):
                p.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        self._clean()  # a rank killed mid-dump leaves its temp file: ours to remove
        (self.out / LOCK_NAME).unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None
        if self.created:  # made by this record and nothing written (Ctrl-C at start-up)
            try:
                self.out.rmdir()
            except OSError:  # not empty: it holds what was written
                pass


def record(target: str, script_args: list[str], *, module: bool = False, out: Path | None = None,
           nproc_per_node: int = 1, device: str = "auto", stacks: str = "python",
           max_entries: int = 1_000_000, quiet: bool = False, force: bool = False,
           steps: tuple[int, int | None] | None = None) -> RecordResult:
    """Run ``target`` with ``script_args`` under memory recording; see the module docstring.

    ``steps=(A, B)`` records optimizer steps A..B-1 only (0-based; B None: to the end)."""
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
    if steps and (steps[0] < 0 or (steps[1] is not None and steps[1] <= steps[0])):
        raise SnapError(f"--steps {steps[0]}:{steps[1] if steps[1] is not None else ''} selects "
                        "no step (A:B records steps A to B-1, 0-based)", exit_code=EXIT_BAD_INPUT)
    _check_torch()
    _check_target(target, module, script_args)

    inside = in_torchrun() and nproc_per_node == 1
    out_dir = Path(out) if out is not None else _default_out(Path.cwd(), inside)
    out_dir = out_dir.resolve()
    opts = {"out": str(out_dir), "device": device, "stacks": stacks,
            "max_entries": int(max_entries), "module": bool(module),
            "steps": list(steps) if steps else None}

    if inside:  # every rank shares OUT: no lock (the ranks of one launch write distinct files)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SnapError(f"cannot create {out_dir}: {e}", exit_code=EXIT_BAD_INPUT) from None
        from snapforensics.record._bootstrap import run_recorded

        status = run_recorded({**opts, "in_place": True}, target, script_args)
        (out_dir / f".rank{status['rank']}.status.json").unlink(missing_ok=True)
        return _result([status], out_dir, expected=[status["rank"]], codes=[None], quiet=quiet)

    _hint_misplaced_options(script_args, quiet)
    ranks = list(range(nproc_per_node))
    env = dict(os.environ)
    root = _package_root()
    env["PYTHONPATH"] = os.pathsep.join(
        [root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    cmd = [sys.executable, "-m", "snapforensics.record._bootstrap", json.dumps(opts), target,
           *script_args]
    what = f"-m {target}" if module else target
    with _OutLock(out_dir, force):
        port = _free_port()
        launched = _Ranks(cmd, [_rank_env(env, r, nproc_per_node, port) for r in ranks])
        _say(quiet, f"recording {what} on {nproc_per_node} rank(s), device {device} -> {out_dir}")
        codes = launched.wait()
        statuses = []
        for r in ranks:
            try:
                statuses.append(json.loads((out_dir / f".rank{r}.status.json").read_text()))
            except (OSError, ValueError):
                continue
    first = launched.failed[0] if launched.failed else None
    return _result(statuses, out_dir, expected=ranks, codes=codes, quiet=quiet, first_failed=first)


def _rank_code(status: dict | None, returncode: int | None) -> int | None:
    """The script's exit code on one rank: from its status, else from its process (os._exit, a
    kill: what a shell would report), None when unknown."""
    if status is not None and status.get("exit_code") is not None:
        return int(status["exit_code"])
    if returncode is None:
        return None
    return 128 - returncode if returncode < 0 else returncode


def _result(statuses: list[dict], out_dir: Path, *, expected: list[int], codes: list,
            quiet: bool, first_failed: int | None = None) -> RecordResult:
    by_rank = {s["rank"]: s for s in statuses}
    setup_failed = [s for s in statuses if s.get("error") and s.get("snapshot") is None
                    and s.get("exit_code") == EXIT_RECORD_FAILED]
    if setup_failed:
        raise SnapError(setup_failed[0]["error"], exit_code=EXIT_RECORD_FAILED)
    snapshots = [Path(by_rank[r]["snapshot"]) for r in expected
                 if r in by_rank and by_rank[r].get("snapshot")]
    ooms = [Path(by_rank[r]["oom_snapshot"]) for r in expected
            if r in by_rank and by_rank[r].get("oom_snapshot")]
    rank_codes = {r: _rank_code(by_rank.get(r), codes[i]) for i, r in enumerate(expected)}
    if statuses and all(s.get("interrupted_before_start") for s in statuses):
        _say(quiet, "nothing was recorded: interrupted before the script started")
        return RecordResult(exit_code=max(int(s["exit_code"]) for s in statuses),
                            out_dir=out_dir, snapshots=[])
    order = ([first_failed] if first_failed is not None else []) + expected
    failing = next((r for r in order if rank_codes.get(r)), None)
    exit_code = rank_codes[failing] if failing is not None else 0
    problems = []
    for r in expected:
        s = by_rank.get(r)
        problems.extend((s or {}).get("warnings") or [])
        if s and s.get("snapshot"):
            t = s.get("timings") or {}
            detail = "".join(f", {k[:-2].replace('_', ' ')} {v} s" if k.endswith("_s") else
                             f", {v} {k.replace('_', ' ')}" for k, v in t.items())
            _say(quiet, f"rank {r}: {s['snapshot']} ({s.get('entries')} trace entries, "
                        f"{(s.get('bytes') or 0) / 1e6:.1f} MB, written in {s.get('seconds')} s"
                        f"{detail})")
        elif s and s.get("error"):
            problems.append(s["error"])
        elif s and s.get("interrupted_before_start"):
            problems.append(f"rank {r} was interrupted before its script started")
        else:
            problems.append(f"rank {r} wrote no snapshot (its process ended with code "
                            f"{rank_codes[r]} before the recorder could dump: os._exit, or killed)")
    if not snapshots and not exit_code:
        raise SnapError(problems[0] if problems else "no snapshot was written",
                        exit_code=EXIT_RECORD_FAILED)
    for line in problems:
        _say(False, f"warning: {line}")
    written = f"{len(snapshots)} snapshot(s) written to {out_dir}"
    if exit_code:
        _say(False, f"the script exited with code {exit_code}"
                    f"{f' on rank {failing}' if len(expected) > 1 else ''}; {written}")
    else:
        _say(quiet, written)
    if snapshots:
        _say(quiet, f"next: snapforensics diagnose {out_dir}")
    return RecordResult(exit_code=int(exit_code), out_dir=out_dir, snapshots=snapshots,
                        oom_snapshots=ooms)
