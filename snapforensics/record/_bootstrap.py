"""Run a user's script unmodified under allocator recording, then dump the snapshot.

``python -m snapforensics.record._bootstrap OPTIONS_JSON TARGET [ARGS...]`` (one rank, launched
by ``snapforensics record``). ``OPTIONS_JSON`` carries ``out``, ``device``, ``stacks``,
``max_entries``, ``module``, ``steps`` (``[A, B]``: record optimizer steps A..B-1 only). The
script sees ``sys.argv`` and ``sys.path[0]`` as under ``python TARGET ARGS`` /
``python -m TARGET ARGS``.

Whatever happens to the script (normal end, ``sys.exit(n)``, an exception, SIGTERM from the
launcher, Ctrl-C), the snapshot is written to ``OUT/rank{RANK}.pickle`` (atomically, mode 0644)
and a status file ``OUT/.rank{RANK}.status.json`` tells the launching ``snapforensics record``
the script's exit code, the snapshot path, or why recording failed. The process exits with the
script's exit code (``EXIT_RECORD_FAILED`` when recording could not start).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from snapforensics import __version__
from snapforensics.errors import EXIT_RECORD_FAILED, SnapError
from snapforensics.record._write import write_json, write_pickle


def status_path(out: Path, rank: int) -> Path:
    return Path(out) / f".rank{rank}.status.json"


def snapshot_path(out: Path, rank: int) -> Path:
    return Path(out) / f"rank{rank}.pickle"


def oom_snapshot_path(out: Path, rank: int) -> Path:
    return Path(out) / f"rank{rank}.oom.pickle"


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


# torchrun's variables first, then SLURM's (``srun`` without a torchrun wrapper)
_RANK_VARS = (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"),
              ("LOCAL_RANK", "SLURM_LOCALID"))


def rank_env(environ: dict[str, str] | None = None) -> tuple[int, int, int, bool]:
    """``(rank, world_size, local_rank, local_known)`` from torchrun's variables, else SLURM's;
    ``local_known``: a launcher said which local rank (device) this process is."""
    env = os.environ if environ is None else environ
    out = []
    for names, default in zip(_RANK_VARS, (0, 1, 0)):
        value = default
        for name in names:
            try:
                value = int(env[name])
                break
            except (KeyError, ValueError):
                continue
        out.append(value)
    known = any(n in env for n in _RANK_VARS[2])
    return out[0], out[1], out[2], known


def _exit_code_of(exc: SystemExit) -> int:
    """What ``python`` would exit with for an uncaught ``SystemExit``."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


_OWN_FILES = {os.path.abspath(__file__), getattr(runpy, "__file__", None)}


def _print_script_traceback(exc: BaseException) -> None:
    """The traceback as ``python script.py`` would print it: our frames and runpy's dropped."""
    tb = exc.__traceback__
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if fn in _OWN_FILES or fn.startswith("<frozen runpy"):
            tb = tb.tb_next
        else:
            break
    traceback.print_exception(type(exc), exc, tb)
    sys.stderr.flush()


def _provenance(*, backend: str, torch_version: str, rank: int, world: int, local: int,
                command: list[str], stacks: str, max_entries: int, exit_code: int | None,
                started_at: str) -> dict:
    return {
        "recorder": f"snapforensics {__version__}",
        "torch_version": torch_version,
        "backend": backend,
        "cpu_recorded": backend == "cpu",
        "rank": rank,
        "world_size": world,
        "local_rank": local,
        "command": [str(a) for a in command],
        "stacks": stacks,
        "max_entries": int(max_entries),
        "script_exit_code": exit_code,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": started_at,
    }


MAX_GROUPS = 256  # analysis/mesh.py reads as many


# The process groups seen at each step's end, held until the process ends. Destroying a gloo
# group joins its worker threads while holding the GIL; a worker still finishing a collective
# restores the thread-local state captured when the work was queued, which holds the
# recorder's saved-tensors hooks (record/identity.py: Python objects, so the worker takes the
# GIL to copy them): a deadlock. Seen in a fresh clone's tests: DDP's Reducer, freed with the
# script's globals after its last step, dropped the last reference to the default group while
# a worker was finishing the step's last all-reduce (main thread in ~ProcessGroupGloo ->
# std::thread::join, worker in SavedTensorDefaultHooks::set_tls_state -> take_gil). Held here,
# the groups are destroyed after the dump, at exit, when their workers have long been idle.
_HELD_GROUPS: dict[int, Any] = {}  # id -> group (held, so an id is never reused meanwhile)


def process_groups() -> list[dict] | None:
    """The process groups this rank is in: each one's description (`mesh_tp`, Megatron's
    `TENSOR_MODEL_PARALLEL_GROUP`, ...: analysis/mesh.py) and global ranks; None when
    torch.distributed is not initialized (before init_process_group, or after the script
    destroyed it). Each group is also held until the process ends (`_HELD_GROUPS`)."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not (dist.is_available() and dist.is_initialized()):
            return None
        out = []
        for pg in list(c10d._world.pg_map)[:MAX_GROUPS]:
            _HELD_GROUPS.setdefault(id(pg), pg)
            desc = getattr(pg, "group_desc", None) or c10d._world.pg_names.get(pg, "")
            out.append({"desc": str(desc)[:200],
                        "ranks": [int(r) for r in dist.get_process_group_ranks(pg)]})
        return out
    except Exception:  # a torch without these internals: the analysis falls back on the world
        return None


# The ranges the recorder opens around a pipeline stage's micro-batches, for every schedule
# (torch's own `Forward i` / `Backward i` come from ScheduleGPipe alone): analysis reads
# `snapforensics.pp forward|backward <stage index> <micro-batch>` (forecast/pipeline.py).
PP_RANGE = "snapforensics.pp {kind} {stage} {chunk}"
# The stages this rank ran and the pipeline's stage count, as its PipelineStage objects say
# (`stage_index`, `num_stages`): written to the snapshot as `pipeline_stages`, so a pipeline
# whose groups carry no name (`dist.new_group`, DDP over each stage) still says its place.
_STAGES: dict[int, int] = {}  # stage index -> num_stages
MAX_STAGES = 1024


def _note_stage(stage: Any, count: Any) -> None:
    if type(stage) is int and type(count) is int and 0 <= stage < count and \
            (stage in _STAGES or len(_STAGES) < MAX_STAGES):
        _STAGES[stage] = count


def pipeline_stages() -> dict | None:
    """{"indices": the stages this rank ran, "num_stages": the pipeline's count}; None when it
    ran none, or its stages disagree on the count."""
    counts = set(_STAGES.values())
    if not _STAGES or len(counts) != 1:
        return None
    return {"indices": sorted(_STAGES), "num_stages": counts.pop()}


def mark_pipeline_chunks() -> bool:
    """Wrap `_PipelineStageBase.forward_one_chunk` / `backward_one_chunk` (torch.distributed
    .pipelining, when the script imported it) in a `record_function` range naming the stage and
    the micro-batch; the methods keep their behaviour. True once they are wrapped."""
    mod = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(mod, "_PipelineStageBase", None)
    if base is None:
        return False
    if getattr(base, "_snapforensics_marked", False):
        return True
    from torch.profiler import record_function

    def wrap(method: Any, kind: str) -> Any:
        def marked(self, chunk_id, *args: Any, **kwargs: Any) -> Any:
            stage = getattr(self, "stage_index", -1)
            _note_stage(stage, getattr(self, "num_stages", None))
            name = PP_RANGE.format(kind=kind, stage=stage, chunk=chunk_id)
            with record_function(name):
                return method(self, chunk_id, *args, **kwargs)
        marked.__wrapped__ = method  # type: ignore[attr-defined]
        return marked

    try:
        base.forward_one_chunk = wrap(base.forward_one_chunk, "forward")
        base.backward_one_chunk = wrap(base.backward_one_chunk, "backward")
        base._snapforensics_marked = True
    except (AttributeError, TypeError):  # another torch's layout: no marks, nothing broken
        return False
    return True


def note_deepspeed_stages() -> bool:
    """Wrap DeepSpeed's `PipelineEngine.train_batch` / `eval_batch` (when the script imported
    deepspeed's pipeline engine) to note the engine's stage and stage count (`stage_id`,
    `num_stages`) for `pipeline_stages` (DeepSpeed names none of its groups), and mark each
    micro-batch's forward and backward in `PP_RANGE`, as torch's stages are: its `ForwardPass`
    and `BackwardPass` instructions, which the engine runs from the class's `_INSTRUCTION_MAP`
    (`_exec_schedule`). An instruction's `buffer_id` is a slot of the engine's ring of pipe
    buffers, not the micro-batch: the micro-batches are counted from each `train_batch` on (its
    TrainSchedule runs the forwards in micro-batch order, and the backwards). True once they
    are wrapped."""
    engine = getattr(sys.modules.get("deepspeed.runtime.pipe.engine"), "PipelineEngine", None)
    schedule = sys.modules.get("deepspeed.runtime.pipe.schedule")
    if engine is None:
        return False
    if getattr(engine, "_snapforensics_noted", False):
        return True
    from torch.profiler import record_function

    def wrap(method: Any) -> Any:
        def noted(self, *args: Any, **kwargs: Any) -> Any:
            _note_stage(getattr(self, "stage_id", None), getattr(self, "num_stages", None))
            self._snapforensics_ran = {"forward": 0, "backward": 0}
            return method(self, *args, **kwargs)
        noted.__wrapped__ = method  # type: ignore[attr-defined]
        return noted

    def mark(func: Any, kind: str) -> Any:
        def marked(self, *args: Any, **kwargs: Any) -> Any:
            ran = getattr(self, "_snapforensics_ran", None)
            if not isinstance(ran, dict):
                return func(self, *args, **kwargs)
            k, ran[kind] = ran[kind], ran[kind] + 1
            name = PP_RANGE.format(kind=kind, stage=getattr(self, "stage_id", -1), chunk=k)
            with record_function(name):
                return func(self, *args, **kwargs)
        marked.__wrapped__ = func  # type: ignore[attr-defined]
        marked.__name__ = getattr(func, "__name__", kind)
        return marked

    try:
        engine.train_batch = wrap(engine.train_batch)
        engine.eval_batch = wrap(engine.eval_batch)
        table = engine._INSTRUCTION_MAP
        for cls, kind in ((getattr(schedule, "ForwardPass", None), "forward"),
                          (getattr(schedule, "BackwardPass", None), "backward")):
            if cls in table:
                table[cls] = mark(table[cls], kind)
        engine._snapforensics_noted = True
    except (AttributeError, TypeError):  # another DeepSpeed's layout: nothing noted or broken
        return False
    return True


class _MarkOnImport:
    """A `sys.meta_path` finder that runs `mark` right after the script imports the module
    `name` (torch.distributed.pipelining's stages: their micro-batches marked from the first
    step on; DeepSpeed's pipeline engine: its stage noted), without importing it here (4 s
    cold); it steps aside after that one import."""

    def __init__(self, name: str, mark: Any) -> None:
        self.NAME, self.mark = name, mark

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.NAME:
            return None
        self.remove()
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module: Any) -> None:
            run(module)
            self.mark()

        loader.exec_module = exec_module  # type: ignore[union-attr]  # this module's own loader
        return spec

    def install(self) -> None:
        if not self.mark():  # already imported (by a sitecustomize): marked now
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _count_entries(snap: dict) -> int:
    traces = snap.get("device_traces") or []
    return sum(len(t) for t in traces if isinstance(t, list))


_HELD = (signal.SIGINT, signal.SIGTERM)


def _hold_signals() -> bool:
    """Block SIGINT/SIGTERM on this (main) thread, and so on every thread started meanwhile
    (torch's import starts some); True when they were blocked here."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _pending(held: bool) -> int:
    """The held signal that has arrived (its number), else 0."""
    return next((int(s) for s in _HELD if s in signal.sigpending()), 0) if held else 0


def _release_signals(held: bool) -> int:
    """Unblock what ``_hold_signals`` blocked; a signal that arrived meanwhile is discarded and
    returned (its number, else 0): the rank then ends before its script runs."""
    if not held:
        return 0
    pending = _pending(held)
    previous = {}
    if pending:
        for s in _HELD:  # pending signals are delivered at unblock: discard them
            previous[s] = signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
    for s, h in previous.items():
        signal.signal(s, h)
    return pending


class _CtrlC:
    """SIGINT -> KeyboardInterrupt, as Python's default, remembering that it came: the
    KeyboardInterrupt that Ctrl-C raises in the script is not the script's failure (no
    traceback), one the script raises itself keeps its traceback."""

    def __init__(self) -> None:
        self.received = False
        self.installed = False
        self.previous: Any = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # ignored, or someone else's handler: leave it
        self.previous = signal.signal(signal.SIGINT, self.handler)
        self.installed = True

    def handler(self, signum, frame):
        self.received = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self.installed and signal.getsignal(signal.SIGINT) is self.handler:
            signal.signal(signal.SIGINT, self.previous)
        self.installed = False


class _TermAsExit:
    """SIGTERM (the launcher stopping this rank) -> SystemExit(143) so the snapshot is written.

    Only when SIGTERM has its default action and we are on the main thread. ``dumping()``
    ignores SIGTERM while the snapshot is written (the launcher sends SIGKILL later anyway).
    """

    def __init__(self) -> None:
        self.installed = False
        self.previous: Any = None
        self.sigint: Any = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return
            self.previous = signal.signal(signal.SIGTERM, self._handler)
            self.installed = True
        except (ValueError, OSError):
            pass

    @staticmethod
    def _handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the dump
        raise SystemExit(128 + signum)

    def dumping(self) -> None:
        """SIGTERM and SIGINT wait until the snapshot is written (SIGKILL still works)."""
        if self.installed:
            self.sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def restore(self) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous)
            if self.sigint is not None:
                signal.signal(signal.SIGINT, self.sigint)
            self.installed = False


# torch warnings that are about the recording set-up, not the user's code (message regexes)
KNOWN_TORCH_WARNINGS = (
    r"DTensor random operators may not have complete support on cpu device mesh",
)


def _hide_known_torch_warnings() -> None:
    for message in KNOWN_TORCH_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


class _StepWindow:
    """``--steps A:B``: record optimizer steps A..B-1 only (0-based, B None = to the end).

    A step ends when any ``torch.optim.Optimizer.step`` returns (torch's global post hook), so
    recording starts right after step A-1's ``optimizer.step()`` and stops right after step
    B-1's. Without a window, recording covers the whole script. The one post hook is
    registered here, before the script runs, and tells the backend of each step's end while
    recording (``backend.step_ended``: the device memory samples); nothing registers or
    removes a step hook inside one (torch iterates over its hook dict there).
    """

    def __init__(self, backend: Any, steps: list | None) -> None:
        self.backend = backend
        self.first, self.stop = (steps or (0, None))
        self.done = 0
        self.started = False
        self.stopped = False
        self._hook = None
        self.groups: list[dict] | None = None  # the process groups, noted at each step's end
        self.marked = False  # a pipeline stage's micro-batches are marked (PP_RANGE)

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook  # torch >= 2.0

        if self.first == 0:
            self._start()
        self._hook = register_optimizer_step_post_hook(self._after_step)

    def _start(self) -> None:
        self.backend.start()
        self.started = True

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.stopped:
            return
        self.done += 1
        if self.started:
            self.backend.step_ended(self.done)
            self.groups = process_groups() or self.groups
        # in case the script imported pipelining before the finder was in place
        self.marked = self.marked or mark_pipeline_chunks()
        if self.done == self.first:
            self._start()
        if self.stop is not None and self.done == self.stop:
            self.backend.stop()
            # the hook stays (inert) until the dump removes it: removing it here, while torch
            # iterates over its post hooks, breaks that iteration when another hook follows
            # (the tensor names' own, identity.py)
            self.stopped = True

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class _LaunchRefused(BaseException):
    """The script launched its ranks in a way the recorder cannot follow (a BaseException so
    that the script's own ``except Exception`` does not swallow it)."""


_SPAWNERS = ("spawn", "start_processes")


def _refuse_mp_spawn() -> None:
    """``torch.multiprocessing.spawn`` starts fresh interpreters that run the script's function
    without the recorder: the parent would write a near-empty file for ranks it never ran.
    Refused with one line saying how to launch instead."""
    import importlib

    try:
        mp = importlib.import_module("torch.multiprocessing")
        mp_spawn = importlib.import_module("torch.multiprocessing.spawn")
    except Exception:
        return

    def refused(name: str):
        def launch(*args: Any, **kwargs: Any) -> Any:
            nprocs = kwargs.get("nprocs", args[2] if len(args) > 2 else None)
            n = nprocs if isinstance(nprocs, int) else "N"
            raise _LaunchRefused(
                f"the script starts its ranks with torch.multiprocessing.{name}, whose processes "
                f"are not recorded; launch the ranks with `snapforensics record --nproc-per-node "
                f"{n} SCRIPT` (or torchrun) and have the script take RANK, LOCAL_RANK and "
                "WORLD_SIZE from the environment")

        return launch

    for name in _SPAWNERS:
        for module in (mp, mp_spawn):
            if hasattr(module, name):
                setattr(module, name, refused(name))


# how long the watcher leaves the main thread to start the dump itself after SIGTERM/SIGINT:
# a thread running Python code gets the signal's exception at its next bytecode (microseconds);
# one still silent after this is blocked in native code (a collective waiting for a dead peer)
WATCH_GRACE_S = 1.0


class _Watcher:
    """Writes the snapshot on SIGTERM/SIGINT even while the main thread is blocked in a native
    wait (an NCCL/HCCL/gloo collective waiting for a rank that died), where the Python-level
    handler never runs until the wait returns, and the launcher kills the rank first.

    The signal's C handler writes the signal number to ``signal.set_wakeup_fd`` from any
    thread; a daemon thread reads it (native waits release the GIL, so it runs), gives the
    main thread ``WATCH_GRACE_S`` to start the dump itself, else dumps and ends the process
    with 128 + the signal. Only while the recorder's own handlers are installed (a script that
    handles SIGTERM itself keeps that), and only when no one else uses the wakeup fd.
    """

    def __init__(self, dump: Any, handlers: dict) -> None:
        self.dump = dump
        self.handlers = handlers  # signal -> the handler that must still be installed
        self.main_dumping = threading.Event()
        self.lock = threading.Lock()
        self.fds: tuple[int, int] | None = None
        self.thread: threading.Thread | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return
        if old != -1:  # someone else's: leave it
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self.fds = (r, w)
        self.thread = threading.Thread(target=self._run, name="snapforensics-dump", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        assert self.fds is not None
        while True:
            try:
                data = os.read(self.fds[0], 64)
            except OSError:
                return
            if not data or 0 in data:  # 0: remove() stops the thread
                return
            for signum in data:
                want = self.handlers.get(signum)
                if want is not None and signal.getsignal(signum) is want:
                    if self.main_dumping.wait(WATCH_GRACE_S):
                        return
                    if self.lock.acquire(blocking=False):
                        self.dump(128 + signum)  # ends the process
                    return

    def remove(self) -> None:
        if self.fds is None:
            return
        try:
            signal.set_wakeup_fd(-1)
        except (ValueError, OSError):
            pass
        try:
            os.write(self.fds[1], b"\0")
        except OSError:
            pass
        if self.thread is not None:
            self.thread.join(5)  # before its fd is closed (and its number reused)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = None


def run_recorded(opts: dict, target: str, args: list[str]) -> dict:
    """Record ``target`` in this process. Returns (and writes) the status dict.

    Status keys: ``rank``, ``exit_code`` (the script's, or EXIT_RECORD_FAILED), ``snapshot``
    (path or None), ``oom_snapshot``, ``entries``, ``bytes``, ``error`` (a one-line message
    when recording failed), ``seconds`` (time spent converting and writing).
    """
    rank, world, local, local_known = rank_env()
    out = Path(opts["out"])
    module = bool(opts.get("module"))
    stacks = opts.get("stacks", "python")
    max_entries = int(opts.get("max_entries", 1_000_000))
    status: dict[str, Any] = {"rank": rank, "exit_code": None, "snapshot": None,
                              "oom_snapshot": None, "entries": None, "bytes": None,
                              "error": None, "seconds": None, "warnings": []}

    def finish() -> dict:
        try:
            write_json(status_path(out, rank), status)
        except OSError as e:  # the launcher then reports the missing status
            print(f"snapforensics record: cannot write status: {e}", file=sys.stderr)
        return status

    # ---- setup: everything that can fail before the script runs. SIGINT/SIGTERM are held
    # until the script starts: a Ctrl-C here would raise inside torch's import (or be swallowed
    # by a bare except there, leaving the rank blocked in init_process_group); held, it ends
    # the rank quietly before the script runs (``_started``)
    held = _hold_signals()
    try:
        out.mkdir(parents=True, exist_ok=True)
        try:
            import torch
        except Exception as e:  # ImportError, or a broken install
            raise SnapError(f"torch is not importable in {sys.executable}: {e}",
                            exit_code=EXIT_RECORD_FAILED) from None
        from snapforensics.record.backends import make_backend, select_backend

        backend_name = select_backend(opts.get("device", "auto"))
        backend = make_backend(backend_name, stacks, max_entries,
                               local if local_known else None)
        if module:
            command = ["-m", target, *args]
            path_entry = os.getcwd()
            saved_path0 = sys.path[0] if sys.path else None
            if sys.path:
                sys.path[0] = path_entry
            else:
                sys.path.insert(0, path_entry)
            try:
                spec = importlib.util.find_spec(target)
            except (ImportError, ValueError) as e:
                spec = None
                why = f": {e}"
            else:
                why = ""
            if spec is None:
                if saved_path0 is not None:
                    sys.path[0] = saved_path0
                raise SnapError(f"no module named {target!r}{why}", exit_code=EXIT_RECORD_FAILED)
            script_path = None
        else:
            command = [target, *args]
            script_path = os.path.abspath(target)
            if not os.path.exists(script_path):
                raise SnapError(f"script not found: {target}", exit_code=EXIT_RECORD_FAILED)
            path_entry = os.path.dirname(os.path.realpath(script_path)) if os.path.isfile(
                script_path) else script_path
            saved_path0 = sys.path[0] if sys.path else None
            if sys.path:
                sys.path[0] = path_entry
            else:
                sys.path.insert(0, path_entry)
    except SnapError as e:
        _release_signals(held)
        status["exit_code"] = e.exit_code
        status["error"] = str(e)
        return finish()
    except OSError as e:
        _release_signals(held)
        status["exit_code"] = EXIT_RECORD_FAILED
        status["error"] = f"cannot create {out}: {e}"
        return finish()

    torch_version = str(getattr(torch, "__version__", "unknown"))
    started_at = datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(
        timespec="seconds")
    prov = dict(backend=backend_name, torch_version=torch_version, rank=rank, world=world,
                local=local, command=command, stacks=stacks, max_entries=max_entries,
                started_at=started_at)

    def on_oom(info: dict) -> None:
        """The backend's observer calls this once, at the first OOM, inside its guard."""
        snap = info.pop("snapshot")
        snap["snapforensics"] = {**_provenance(exit_code=None, **prov), "oom": info}
        p = oom_snapshot_path(out, rank)
        write_pickle(p, snap)
        status["oom_snapshot"] = str(p)

    saved_argv = sys.argv[:]
    term = _TermAsExit()
    code: int | None = None
    window = _StepWindow(backend, opts.get("steps"))
    before: dict[str, Any] = {}
    if backend_name == "cpu" and not _pending(held):  # interrupted: skip the imports
        sys.argv[:] = [target, *args]  # as the script will see them when it imports
        before["imported_before_recording"] = _import_prefix(script_path,
                                                             target if module else None)
        sys.argv[:] = saved_argv
    pending = _release_signals(held)
    if pending:  # interrupted before the script ran: nothing to record
        sys.argv[:] = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        status["exit_code"] = 128 + pending
        status["interrupted_before_start"] = True
        return finish()
    marks = (_MarkOnImport("torch.distributed.pipelining.stage", mark_pipeline_chunks),
             _MarkOnImport("deepspeed.runtime.pipe.engine", note_deepspeed_stages))
    try:
        window.install()
        for m in marks:
            m.install()
    except Exception as e:
        sys.argv[:] = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        status["exit_code"] = EXIT_RECORD_FAILED
        status["error"] = f"cannot start {backend_name} recording: {type(e).__name__}: {e}"
        return finish()
    try:
        backend.attach_oom(on_oom)
    except Exception:
        pass
    term.install()

    def dump(exit_code: int) -> None:
        """Stop recording and write the snapshot (main thread at the end of the script)."""
        status["exit_code"] = exit_code
        window.remove()
        t0 = time.perf_counter()
        try:
            if not window.started:
                raise RuntimeError(f"the script made {window.done} optimizer step(s): step "
                                   f"{window.first} (--steps) was never reached")
            snap = backend.snapshot()
            extra = snap.get("snapforensics") if isinstance(snap.get("snapforensics"), dict) else {}
            snap["snapforensics"] = {**_provenance(exit_code=exit_code, **prov), **before,
                                     **extra}
            groups = process_groups() or window.groups
            if groups is not None:
                snap["snapforensics"]["process_groups"] = groups
            if (stages := pipeline_stages()) is not None:
                snap["snapforensics"]["pipeline_stages"] = stages
            p = snapshot_path(out, rank)
            write_pickle(p, snap)
            status["snapshot"] = str(p)
            status["entries"] = _count_entries(snap)
            status["bytes"] = p.stat().st_size
            status["timings"] = getattr(backend, "timings", None)
            status["warnings"].extend(_empty_recording(backend, status["entries"], rank))
        except BaseException as e:  # reported once, by the launching record
            status["error"] = f"rank {rank}: writing the snapshot failed: {type(e).__name__}: {e}"
        status["seconds"] = round(time.perf_counter() - t0, 3)

    def dump_from_watcher(exit_code: int) -> None:
        """The main thread is stuck in native code: dump from here and end the process."""
        try:
            if exit_code != 128 + signal.SIGINT:  # Ctrl-C: the launcher already said it dumps
                print(f"snapforensics record: rank {rank} is blocked in native code; writing "
                      "its snapshot from the recorder's thread", file=sys.stderr, flush=True)
            dump(exit_code)
            if not opts.get("in_place"):  # a launching record reads it
                finish()
                if _orphaned():  # ... unless it was killed: then the rank cleans up
                    _orphaned_cleanup(out, rank)
            sys.stderr.flush()
        finally:
            os._exit(exit_code)

    ctrl_c = _CtrlC()
    ctrl_c.install()
    watcher = _Watcher(dump_from_watcher, {
        int(signal.SIGTERM): term._handler if term.installed else None,
        int(signal.SIGINT): ctrl_c.handler if ctrl_c.installed else None})
    watcher.install()
    _hide_known_torch_warnings()
    _refuse_mp_spawn()
    refused: str | None = None
    try:
        sys.argv[:] = [target, *args]
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")  # argv[0] as given
            code = 0
        except SystemExit as e:
            code = _exit_code_of(e)
        except KeyboardInterrupt as e:
            if not ctrl_c.received:  # raised by the script itself, not by Ctrl-C
                _print_script_traceback(e)
            code = 130
        except _LaunchRefused as e:
            refused = str(e)
            code = EXIT_RECORD_FAILED
        except BaseException as e:
            _print_script_traceback(e)
            code = 1
    finally:
        watcher.main_dumping.set()
        term.dumping()
        sys.stdout.flush()
        sys.argv[:] = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        with watcher.lock:  # held by the watcher if it dumps (it then ends the process)
            if refused is not None:
                status["exit_code"] = EXIT_RECORD_FAILED
                status["error"] = refused
                window.remove()
                try:
                    backend.stop()  # nothing is written; the profiler must still stop
                except Exception:
                    pass
            else:
                dump(code if code is not None else 1)
        watcher.remove()
        for m in marks:
            m.remove()
        term.restore()
        ctrl_c.restore()
    return finish()


def _import_prefix(script_path: str | None, module: str | None) -> list[str]:
    """Import, before the CPU profiler starts, the modules the script imports before its first
    other statement (its docstring and ``from __future__`` aside): what the script does first
    anyway, in the same order, with its ``sys.argv`` and ``sys.path``. Under the profiler's
    Python tracer, importing a large library (transformers, lightning) records millions of
    calls that allocate nothing, and they made most of the recorder's memory (issue 16).
    Allocations made by these imports are then not in the trace; the allocator's accounting
    shows their bytes as allocated before recording. Stops at the first import that fails (the
    script then meets the same error itself). Returns the modules imported."""
    import ast

    try:
        if module is not None:
            spec = importlib.util.find_spec(module)
            origin = spec.origin if spec is not None else None
        else:
            origin = script_path
        if not origin or not os.path.isfile(origin):
            return []
        with open(origin, "rb") as f:
            tree = ast.parse(f.read())
    except (ImportError, ValueError, SyntaxError, OSError):
        return []
    done: list[str] = []
    for i, node in enumerate(tree.body):
        if (i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            continue  # docstring
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted = [(node.module, a.name) for a in node.names]
        else:
            break
        for name, attr in wanted:
            try:
                mod = importlib.import_module(name)
                if attr and attr != "*" and not hasattr(mod, attr):  # hasattr: lazy modules load
                    importlib.import_module(f"{name}.{attr}")
            except Exception:
                return done
            done.append(name)
    return done


def _empty_recording(backend: Any, entries: int | None, rank: int) -> list[str]:
    """One line when a device recording came out empty although the script used the device."""
    if getattr(backend, "name", "cpu") == "cpu" or entries:
        return []
    if not getattr(backend, "started", True):
        why = getattr(backend, "start_error", None)
        return [f"rank {rank}: nothing recorded: " + (
            f"the recording could not start ({why})" if why else
            f"the script never used {backend.name.upper()} in this process (record its "
            "CPU allocator with --device cpu)")]
    n = backend.allocations()
    if n:
        return [f"rank {rank}: the recording has 0 entries although the script allocated {n} "
                f"block(s) on {backend.name.upper()}: something outside the recorder turned the "
                "allocator's history off or cleared it"]
    return []


_LAUNCHER: list[int] = []  # the launching ``record``'s pid, where `_stop_with_launcher` set it


def _orphaned() -> bool:
    """The launching ``record`` died: this rank's parent is no longer it."""
    return bool(_LAUNCHER) and os.getppid() != _LAUNCHER[0]


def _stop_with_launcher() -> None:
    """Linux: SIGTERM this rank when the launching ``record`` dies (even by SIGKILL). The rank
    runs in its own process group, so nothing else would stop it; SIGTERM still dumps. Notes
    the launcher's pid in `_LAUNCHER` where this is done."""
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    _LAUNCHER[:] = [launcher]
    if os.getppid() != launcher:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _orphaned_cleanup(out: Path, rank: int) -> None:
    """The launching ``record`` died (killed by its caller): nobody will read this rank's
    status file nor remove the lock file it left, so the rank removes both (the snapshot
    stays), at the end of its main thread or of the recorder's thread where that one dumped (the
    main thread blocked in a collective: the process ends there)."""
    from snapforensics.record import LOCK_NAME

    for p in (status_path(out, rank), out / LOCK_NAME):
        try:
            p.unlink()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python -m snapforensics.record._bootstrap OPTIONS_JSON TARGET [ARGS...]",
              file=sys.stderr)
        sys.exit(EXIT_RECORD_FAILED)
    opts = json.loads(argv[0])
    _stop_with_launcher()
    status = run_recorded(opts, argv[1], list(argv[2:]))
    if _orphaned() and not opts.get("in_place"):
        _orphaned_cleanup(Path(opts["out"]), status["rank"])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(status["exit_code"])


if __name__ == "__main__":
    main()
