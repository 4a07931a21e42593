"""Real FSDP2 + checkpoint recordings for tests, made by the project's recorder, cached by what
makes them.

    from recordings import record_variant, recorded, load_strict, replay_peak

    # [rank0.pickle, rank1.pickle]
    paths = recorded("buggy")

A recording is keyed by a hash of everything that makes it: the sources of the example and of the
recorder (`snapforensics/examples/`, `snapforensics/record/`, the CLI, `record_example.py`), the
torch and Python versions, and the run's arguments. It lives in the recordings cache
(`.recordings/` in the checkout, gitignored, or `$SNAPFORENSICS_RECORDINGS`) and is reused by
every test and every later run until one of those changes; a folder appears there only when its
recording finished (made aside, then renamed).

`recorded(variant, nproc=2, steps=3, extra=())` records the runs the suite needs (`SUITE`) that
are not cached yet, all at once: one job per world size (`record_example.py`: each run's ranks
spawned in turn and recorded with `record.inprocess.recording`, the backend `snapforensics
record` uses), at most two jobs at once, each run published as soon as its ranks wrote it.
`start()` begins that in the background (conftest calls it when the session has slow tests);
`recorded` waits for the run it needs.

`record_variant(variant, out_dir, ...)` records through the real CLI (`python -m
snapforensics record --nproc-per-node N --device cpu --out DIR -m snapforensics.examples.fsdp_ckpt
-- --variant V --steps S [extra...]`), cached under the same kind of key; `fresh=True` records
into `out_dir` every time (for tests about recording itself).

Also here: ``load_strict(path)`` (a pickle load that refuses every global, as the real loader
does), and ``replay_peak(snapshot)`` (max of cumulative alloc - free_completed over the trace).
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "snapforensics.examples.fsdp_ckpt"
CACHE = Path(os.environ.get("SNAPFORENSICS_RECORDINGS") or REPO / ".recordings")
# what makes a recording: the example (every module of examples/: the bundled example, the
# matrix's models, wrappings, layouts, probe and runner), the recorder and what it imports (the
# package's version and exit codes), the CLI that launches it, the job runner
SOURCES = ("snapforensics/examples", "snapforensics/record", "snapforensics/commands/record.py",
           "snapforensics/cli.py", "snapforensics/__main__.py", "snapforensics/__init__.py",
           "snapforensics/errors.py", "tests/record_example.py")

# The runs the suite asks for (variant, nproc, steps, extra): recorded together on first use
# (a run asked for and not listed here is recorded alone when asked). SUITE: what `make test`
# needs; FULL_SUITE: what only the `full` tests need (`make test-full`: test_forecast's pairs
# recorded for the forecast alone), recorded when such a test is in the session.
S_FSDP1 = ("--layers", "4", "--dim", "256")  # small shapes: test_forecast's world-size pairs
S_NOAC = ("--layers", "4", "--dim", "128")
# activations over parameters (8 thin blocks, 8 x 256 tokens): checkpoint granularity sets the peak
S_AC = ("--layers", "8", "--dim", "256", "--seq", "256", "--batch", "8")
S_COMPILE = ("--layers", "2", "--dim", "128")  # test_compile: each block's mlp compiled
Run = tuple[str, int, int, tuple[str, ...]]
SUITE: tuple[Run, ...] = (
    *((v, 2, 3, ()) for v in (
        "buggy", "fixed", "nested", "noac", "leak", "reshard_after_forward_false",
        "prefetch_in_recompute", "no_rate_limit", "full_init", "no_grad_sync", "mixed_precision",
        "fsdp1", "fsdp1_shard_grad_op", "fsdp1_reentrant")),
    ("fixed", 2, 3, ("--batch", "8")),
    ("full_init", 1, 3, ()),
    ("ac_submodules", 2, 3, ()),
    *((v, 2, 3, S_AC) for v in ("ac_submodules", "fixed")),
    *(("buggy", 2, 3, S_COMPILE + ("--compile", b)) for b in ("none", "aot_eager")),
    *(("noac", w, 2, S_NOAC) for w in (2, 4)),  # test_forecast's cheap 2 <-> 4 pair
)
FULL_SUITE: tuple[Run, ...] = (
    ("noac", 2, 3, ("--batch", "4")),
    *((v, w, 2, shape) for w in (2, 4) for v, shape in (("fsdp1", S_FSDP1),)),
    ("noac", 8, 2, S_NOAC),  # the 4x world-size pair (test_forecast: W=8 from W=2)
    ("fsdp1_shard_grad_op_fp32", 2, 2, S_FSDP1),
    ("fsdp1_no_prefetch", 2, 2, S_FSDP1),
    ("fixed", 4, 3, ()),
    ("buggy", 2, 3, S_COMPILE + ("--compile", "inductor")),  # C++ compiles: ~40-80 s
)
CLI_SUITE = (("fixed", 2, 3, ()),)  # recorded through `snapforensics record` (test_record)


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


@cache
def _sources_digest() -> str:
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    try:
        h.update(f"torch {version('torch')}".encode())
    except PackageNotFoundError:
        h.update(b"no torch")
    h.update(f"python {sys.version_info[:2]}".encode())
    for root in SOURCES:
        p = REPO / root
        for f in sorted([p] if p.is_file() else p.rglob("*.py")):
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def key(*what: object) -> str:
    """The cache folder name of one recording: a hash of its sources and of `what` (its args)."""
    return hashlib.sha256((_sources_digest() + json.dumps(what)).encode()).hexdigest()[:20]


def _paths(folder: Path, nproc: int) -> list[Path]:
    return [folder / f"rank{r}.pickle" for r in range(nproc)]


def _cached(folder: Path, nproc: int) -> list[Path] | None:
    paths = _paths(folder, nproc)
    return paths if all(p.is_file() for p in paths) else None


def _publish(made: Path, folder: Path) -> None:
    """Move a finished recording's folder into the cache (atomic: a rename)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(made, folder)
    except OSError:  # made meanwhile by another session: keep that one
        shutil.rmtree(made, ignore_errors=True)


def _job_folder(variant: str, nproc: int, steps: int, extra: tuple[str, ...]) -> Path:
    return CACHE / f"{variant}-w{nproc}-{key('job', variant, nproc, steps, extra)}"


def _cli_folder(variant: str, nproc: int, steps: int, extra: tuple[str, ...]) -> Path:
    return CACHE / f"cli-{variant}-w{nproc}-{key('cli', variant, nproc, steps, extra)}"


def _argv(variant: str, steps: int, extra: tuple[str, ...]) -> list[str]:
    return ["--variant", variant, "--steps", str(steps), *extra]


_children: set[subprocess.Popen] = set()


@atexit.register
def _stop_children() -> None:
    """A session that ends (or only collects) before its background jobs do leaves no recording
    process behind: they would go on as orphans, unpublished, holding the cores."""
    for proc in list(_children):
        if proc.poll() is None:
            proc.kill()


def _record_job(world: int, runs: list[tuple[str, int, int, tuple[str, ...]]]) -> str:
    """Record `runs` (all for `world` ranks) in one job; '' or what went wrong. Runs another
    process published meanwhile (a pytest-xdist worker, another session) are not recorded
    again: the caller holds this job's lock (`_background`)."""
    runs = [r for r in runs if not _cached(_job_folder(*r), world)]
    if not runs:
        return ""
    stage = Path(tempfile.mkdtemp(prefix=f".job-w{world}-", dir=CACHE))
    try:
        todo = [(stage / str(i), run) for i, run in enumerate(runs)]
        spec = {"world": world, "runs": [[str(d), _argv(v, s, e)] for d, (v, _, s, e) in todo]}
        (stage / "spec.json").write_text(json.dumps(spec))
        for d, _ in todo:
            d.mkdir()
        log = stage / "log.txt"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "record_example.py"),
                                     str(stage / "spec.json")], cwd=REPO, env=_env(),
                                    stdout=out, stderr=subprocess.STDOUT)
            _children.add(proc)
            while todo:  # each run is published as soon as its ranks have written it
                done = proc.poll() is not None
                for d, run in [t for t in todo if _cached(t[0], world)]:
                    _publish(d, _job_folder(*run))
                    todo.remove((d, run))
                if done:
                    break
                try:
                    proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
            proc.wait()
        if proc.returncode != 0 or todo:
            return (f"recording job (world {world}) failed: exit {proc.returncode}\n"
                    f"--- output (tail)\n{log.read_text()[-6000:]}")
        return ""
    finally:
        shutil.rmtree(stage, ignore_errors=True)


_lock = threading.Lock()
_threads: dict[str, threading.Thread] = {}
_errors: dict[str, str] = {}
# Jobs recording at once, over every process using this cache (pytest-xdist's workers each start
# the jobs they lack): two keep both cores busy through each job's waits (start-up, gloo, the
# profiler's post-processing) without holding every rank of every job in memory at once.
SLOTS = 2


@contextmanager
def _flock(name: str, *, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock on CACHE/.lock-NAME shared by every process (flock: released when the
    process dies). Yields whether it is held (always, when `wait`)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    fd = os.open(CACHE / f".lock-{name}", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def _slot() -> Iterator[None]:
    """One of the SLOTS recording slots, across processes."""
    while True:
        for i in range(SLOTS):
            with _flock(f"slot-{i}", wait=False) as held:
                if held:
                    yield
                    return
        time.sleep(0.5)


def _background(name: str, work) -> None:
    """Run `work()` (returns '' or an error) on a thread named `name`, unless one runs: under
    the job's lock (another process recording it finishes first; `work` then finds what it
    published) and in a recording slot."""
    with _lock:
        if name in _threads and _threads[name].is_alive():
            return

        def go() -> None:
            try:
                with _flock(name), _slot():
                    _errors[name] = work()
            except Exception as e:  # reported by whoever waits for it
                _errors[name] = f"{type(e).__name__}: {e}"

        _threads[name] = threading.Thread(target=go, name=name, daemon=True)
        _threads[name].start()


def _wait(name: str, ready=lambda: False) -> str:
    """Wait for the thread `name` to end, or for `ready()`; its error, if it ended with one."""
    with _lock:
        t = _threads.get(name)
    while t is not None and t.is_alive() and not ready():
        t.join(0.5)
    return _errors.get(name, "")


def start(runs: Iterable[tuple[str, int, int, tuple[str, ...]]] = SUITE) -> None:
    """Record the runs not cached yet, one background job per world size (returns at once)."""
    missing: dict[int, list] = {}
    for run in runs:
        if not _cached(_job_folder(*run), run[1]):
            missing.setdefault(run[1], []).append(run)
    for world, todo in missing.items():
        _background(f"example-w{world}", lambda w=world, t=todo: _record_job(w, t))
    for variant, nproc, steps, extra in CLI_SUITE:
        if not _cached(_cli_folder(variant, nproc, steps, extra), nproc):
            _background(f"cli-{variant}-w{nproc}", lambda v=variant, n=nproc, s=steps, e=extra: (
                record_variant(v, None, n, s, e) and ""))


def recorded(variant: str, tmp_path_factory=None, *, nproc: int = 2, steps: int = 3,
             extra: Iterable[str] = ()) -> list[Path]:
    """Rank-ordered snapshot paths of one run of the example, from the recordings cache
    (recorded, with the rest of `SUITE` still missing, when absent). `tmp_path_factory` is
    accepted and unused (older callers pass it)."""
    run = (variant, nproc, steps, tuple(str(e) for e in extra))
    folder = _job_folder(*run)
    for _ in range(2):  # a job already running may lack this run: the next one has it
        if _cached(folder, nproc):
            return _paths(folder, nproc)
        start(SUITE if run in SUITE else FULL_SUITE if run in FULL_SUITE else (run,))
        err = _wait(f"example-w{nproc}", lambda: _cached(folder, nproc) is not None)
    if not _cached(folder, nproc):
        raise AssertionError(f"recording {run} failed\n{err}")
    return _paths(folder, nproc)


def _matrix_folder(world: int) -> Path:
    return CACHE / f"matrix-w{world}-{key('matrix', world)}"


def _record_matrix(world: int) -> str:
    if _matrix_folder(world).is_dir():  # published by another process meanwhile
        return ""
    stage = Path(tempfile.mkdtemp(prefix=f".matrix-w{world}-", dir=CACHE))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snapforensics.examples.scenarios", "--out", str(stage),
             "--world", str(world)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        _children.add(proc)
        try:
            err = proc.communicate(timeout=1800)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            err = proc.communicate()[1]
        if proc.returncode != 0:
            return f"matrix (world {world}) failed: exit {proc.returncode}\n{err[-4000:]}"
        _publish(stage, _matrix_folder(world))
        return ""
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def start_matrix() -> None:
    """Record the scenario matrix's two jobs (2 and 4 ranks) in the background where not
    cached."""
    for world in (2, 4):
        if not _matrix_folder(world).is_dir():
            _background(f"matrix-w{world}", lambda w=world: _record_matrix(w))


def matrix_folders() -> list[Path]:
    """The matrix's folders (2 ranks, 4 ranks), each holding <layout>/rank{R}.pickle and
    truth.rank{R}.json: from the cache, recorded first when absent."""
    start_matrix()
    errors = [e for e in (_wait("matrix-w2"), _wait("matrix-w4")) if e]
    assert not errors, "\n".join(errors)
    return [_matrix_folder(w) for w in (2, 4)]


def inductor_matrix() -> Path:
    """The matrix's compiled layouts again with Inductor's C++ CPU backend
    (`scenarios.layouts.INDUCTOR_LAYOUTS`, `f2_..._ci`), recorded once into the cache: the
    folder holding <layout>/rank{R}.pickle and truth.rank{R}.json (`make test-full` only)."""
    from snapforensics.examples.scenarios.layouts import INDUCTOR_LAYOUTS

    names = sorted(INDUCTOR_LAYOUTS)
    folder = CACHE / f"matrix-ci-{key('matrix-ci', names)}"
    with _flock(folder.name):
        if folder.is_dir():
            return folder
        with _slot():
            CACHE.mkdir(parents=True, exist_ok=True)
            stage = Path(tempfile.mkdtemp(prefix=".matrix-ci-", dir=CACHE))
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "snapforensics.examples.scenarios", "--out",
                     str(stage), "--only", ",".join(names)], cwd=REPO, env=_env(),
                    capture_output=True, text=True, timeout=3600, check=False)
                assert proc.returncode == 0, proc.stderr[-4000:]
                _publish(stage, folder)
            finally:
                shutil.rmtree(stage, ignore_errors=True)
    return folder


def record_variant(variant: str, out_dir: Path | None, nproc: int = 2, steps: int = 3,
                   extra: Iterable[str] = (), *, fresh: bool = False) -> list[Path]:
    """Record one variant of the bundled example through the real CLI (`snapforensics record`);
    the snapshot paths, rank order. Cached like `recorded` (out_dir unused) unless `fresh`
    (then recorded into out_dir every time)."""
    extra = tuple(str(e) for e in extra)
    folder = _cli_folder(variant, nproc, steps, extra)
    if not fresh:
        if threading.current_thread().name != f"cli-{variant}-w{nproc}":
            _wait(f"cli-{variant}-w{nproc}")  # started in the background: its result
        if _cached(folder, nproc):
            return _paths(folder, nproc)
        CACHE.mkdir(parents=True, exist_ok=True)
        out_dir = Path(tempfile.mkdtemp(prefix=".cli-", dir=CACHE))  # empty: `--out` accepts it
    out_dir = Path(out_dir)
    args = ["record", "--nproc-per-node", str(nproc), "--device", "cpu", "--out", str(out_dir),
            "-m", EXAMPLE, "--", *_argv(variant, steps, extra)]
    proc = run_cli(args)
    paths = _paths(out_dir, nproc)
    missing = [p.name for p in paths if not p.is_file()]
    if proc.returncode != 0 or missing:
        if not fresh:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise AssertionError(
            f"recording {variant!r} failed: exit {proc.returncode}, missing {missing}\n"
            f"--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}")
    if fresh:
        return paths
    out_dir.chmod(0o755)
    _publish(out_dir, folder)
    return _paths(folder, nproc)


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


def recorded_module(module: str, args: Iterable[str] = (), nproc: int = 2) -> Path:
    """A run of another example module (``-m MODULE -- ARGS --truth OUT``) recorded through the
    real CLI (`snapforensics record`), cached under a key of the sources and its arguments: the
    folder holding rank{R}.pickle and the module's truth.rank{R}.json."""
    args = tuple(str(a) for a in args)
    name = module.rsplit(".", 1)[-1]
    return _recorded_cli(f"mod-{name}-w{nproc}-{key('module', module, args, nproc)}", nproc,
                         ["-m", module, "--", *args, "--truth"], True)


def recorded_script(script: Path, args: Iterable[str] = (), nproc: int = 2,
                    truth: bool = False) -> Path:
    """A training script of the tests' own (a model no example has) recorded through the real
    CLI (`snapforensics record SCRIPT ARGS [--truth OUT]`), cached under a key of the sources,
    the script's text and its arguments: the folder holding rank{R}.pickle (and, with `truth`,
    the script's truth.rank{R}.json)."""
    args = tuple(str(a) for a in args) + (("--truth",) if truth else ())
    text = hashlib.sha256(script.read_bytes()).hexdigest()
    return _recorded_cli(f"script-{script.stem}-w{nproc}-{key('script', text, args, nproc)}",
                         nproc, [str(script), *args], truth)


def _recorded_cli(name: str, nproc: int, run: list[str], truth: bool) -> Path:
    """`snapforensics record --nproc-per-node N --device cpu --out OUT RUN [OUT]` (OUT after RUN
    when the run writes its truth there), published as CACHE/name once every rank wrote."""
    folder = CACHE / name
    with _flock(folder.name):
        if _cached(folder, nproc):
            return folder
        with _slot():
            CACHE.mkdir(parents=True, exist_ok=True)
            out = Path(tempfile.mkdtemp(prefix=".run-", dir=CACHE))
            proc = run_cli(["record", "--nproc-per-node", str(nproc), "--device", "cpu",
                            "--out", str(out), *run, *([str(out)] if truth else [])])
        missing = [p.name for p in _paths(out, nproc) if not p.is_file()]
        if proc.returncode != 0 or missing:
            shutil.rmtree(out, ignore_errors=True)
            raise AssertionError(f"recording {run} failed: exit {proc.returncode}, missing "
                                 f"{missing}\n{proc.stderr[-4000:]}")
        out.chmod(0o755)
        _publish(out, folder)
    return folder


def bucket_slack(truth: dict, peak: int) -> int:
    """How far a recorded twin's peak can move between recordings of the same run: one of its
    reduction buckets, which gloo reduces on its own thread, so whether one is alive at the
    peak is a matter of timing; none when the bucket is most of the peak (DeepSpeed's default
    2 GB on these models: allocated once, alive through every peak)."""
    b = max((s["bytes"] for s in truth["buckets"]), default=0)
    return b if b <= peak / 4 else 0
