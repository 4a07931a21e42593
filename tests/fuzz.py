"""The fuzz tier's generators and runner (tests/test_fuzz.py).

Families (issue 21): long strings, equality bombs, special files, extreme numbers, many devices,
tampered cache entries, out-of-range options. Each generated case is a CLI command line or an
API call, run in a child forked from an interpreter that has already imported the tool (a case
costs its own work, not an interpreter start), under an address-space cap and a time limit.
A case fails on exit 70 (a bug of ours), any exit but 0/1/2, a signal, a timeout, a traceback, or
more than one stderr line on exit 2.

    SNAPFORENSICS_FUZZ_SEED=7 SNAPFORENSICS_FUZZ_SCALE=10 python -m pytest tests/test_fuzz.py

SCALE multiplies the cases per family and the sizes (the default, 1, is the fast CI tier).
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hostile import (
    APPENDS,
    EMPTY_LIST,
    FIXTURE,
    MARK,
    MEMOIZE,
    entry,
    f,
    frame,
    get,
    i,
    pkl,
    snapshot_dict,
    trace_of,
)

FORMATS = ("terminal", "markdown", "json", "html")
EXT = {"terminal": ".txt", "markdown": ".md", "json": ".json", "html": ".html"}
NASTY = "\x1b[2J\x07\u202e`<script>alert(1)</script>$x^2$\ud800\x00"


@dataclass
class Case:
    family: str
    name: str
    argv: list[str] | None = None  # CLI arguments, or
    call: Callable[[], object] | None = None  # an API call, or
    script: str | None = None  # Python code (as `python -c`)
    env: dict[str, str] = field(default_factory=dict)
    renderer: str = ""


@dataclass
class Outcome:
    case: Case
    code: int | str  # exit code, or "timeout" / "signal N"
    seconds: float
    stderr: str

    @property
    def failed(self) -> str:
        """Why this outcome is a failure ("" when it is not)."""
        lines = self.stderr.strip().splitlines()
        if isinstance(self.code, str):
            return self.code
        if self.code not in (0, 1, 2):
            return f"exit {self.code}"
        if "Traceback" in self.stderr:
            return "traceback"
        if self.code == 2 and len(lines) != 1:
            return f"exit 2 with {len(lines)} stderr lines"
        return ""


# ------------------------------------------------------------------------------- the runner

def run(case: Case, tmp: Path, seconds: float, memory: int) -> Outcome:
    """`case` in a forked child that may map `memory` bytes beyond what the interpreter it was
    forked from already maps (RLIMIT_AS = that + `memory`), under a `seconds` limit (the child's
    whole process group is killed there). The cap is relative: a pytest worker that earlier tests
    left with torch imported and a thread pool's malloc arenas maps over a GiB before the case
    starts, and an absolute cap left the case nothing (CI: MemoryError before the first read)."""
    err_path = tmp / f"stderr-{os.getpid()}"
    t = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            os.setpgid(0, 0)
            cap = memory + _mapped()
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
            fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            # pytest's capture replaces the std streams: the child writes to its own fds
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            os.environ.update(case.env)
            code = _child(case)
        except BaseException:  # noqa: BLE001 - reported as exit 70 with its traceback
            import traceback
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)
    status = None
    while time.monotonic() - t < seconds:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        _kill(pid)
        os.waitpid(pid, 0)
        status = None  # a timeout, whatever the kill made of the child
    _kill(pid)  # workers a case left behind
    wall = time.monotonic() - t
    err = err_path.read_text("utf-8", "replace") if err_path.exists() else ""
    if status is None:
        return Outcome(case, "timeout", wall, err)
    if os.WIFSIGNALED(status):
        return Outcome(case, f"signal {os.WTERMSIG(status)}", wall, err)
    return Outcome(case, os.WEXITSTATUS(status), wall, err)


def _mapped() -> int:
    """Bytes this process maps now (VmSize; 0 where /proc is absent)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _child(case: Case) -> int:
    from snapforensics.errors import SnapError

    if case.argv is not None:
        from snapforensics.cli import main
        try:
            main(case.argv)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return 0
    if case.script is not None:
        try:
            exec(compile(case.script, "<case>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return 0
    assert case.call is not None
    try:
        case.call()
    except SnapError as e:
        print(f"snapforensics: error: {e}", file=sys.stderr)
        return 2
    return 0


# ------------------------------------------------------------------------------- generators

def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _diagnose_cases(family: str, name: str, path: Path, rng: random.Random,
                    extra: tuple[str, ...] = ()) -> list[Case]:
    """`path` through the CLI with one renderer (cycled) and through the API with another."""
    fmt = rng.choice(FORMATS)
    out = path.with_name(path.name.split(".")[0] + "-out" + EXT[fmt])
    api_fmt = rng.choice(FORMATS)

    def api() -> None:
        import snapforensics as sf
        sf.diagnose(str(path)).render(api_fmt)
    return [Case(family, f"{name} cli {fmt}", ["diagnose", str(path), "-o", str(out),
                                                 "--no-cache", *extra], renderer=fmt),
            Case(family, f"{name} api {api_fmt}", call=api, renderer=api_fmt)]


def long_strings(d: Path, rng: random.Random, scale: int) -> list[Case]:
    cases = []
    for k in range(2 * scale):
        n = rng.choice([5_000, 100_000, 2_000_000 * scale])
        refs = rng.choice([1, 10, 100])
        where = rng.choice(["name", "filename"])
        text = (NASTY * (n // len(NASTY) + 1))[:n]
        fr = frame(**{where: text}) + MEMOIZE
        frames = EMPTY_LIST + MARK + fr + get(0) * (refs - 1) + APPENDS
        cats = ("--category", f"c=(x|{re.escape(text[:50])})+$")
        p = _write(d / f"long{k}.pickle", pkl(snapshot_dict(EMPTY_LIST, trace_of(
            [entry(frames=frames), entry("free_completed", frames=frames)]))))
        cases += _diagnose_cases("long strings", f"{n} chars x{refs} in {where}", p, rng, cats)
    return cases


def equality_bombs(d: Path, rng: random.Random, scale: int) -> list[Case]:
    from attacks import equality_bomb_file

    cases = []
    for k in range(scale):
        sub = d / f"eq{k}"
        sub.mkdir()
        lists, items = rng.choice([50, 200]) * scale, rng.choice([10_000, 200_000]) * scale
        p = equality_bomb_file(sub, lists, items)
        cases += _diagnose_cases("equality bombs", f"{lists} lists x {items}", p, rng)
        cases.append(Case("equality bombs", f"{lists} lists x {items} python",
                          ["diagnose", str(p), "--format", "json", "--no-cache"],
                          env={"SNAPFORENSICS_PURE_PYTHON": "1"}, renderer="json"))
    return cases


def special_files(d: Path, rng: random.Random, scale: int) -> list[Case]:
    run_dir = d / "run"
    run_dir.mkdir()
    (run_dir / "rank0.pickle.gz").write_bytes(FIXTURE.read_bytes())
    kinds: dict[str, Callable[[Path], None]] = {
        "fifo": lambda p: os.mkfifo(p),
        "dev_zero": lambda p: p.symlink_to("/dev/zero"),
        "dev_null": lambda p: p.symlink_to("/dev/null"),
        "directory": lambda p: p.mkdir(),
        "socket": lambda p: socket.socket(socket.AF_UNIX).bind(str(p)),
        "loop": lambda p: p.symlink_to(p.name),
        "empty": lambda p: p.write_bytes(b""),
        "dangling": lambda p: p.symlink_to("/nonexistent/x"),
    }
    cases = []
    for kind, make in kinds.items():
        p = run_dir / f"rank{len(cases) + 1}.pickle"
        make(p)
        fmt = rng.choice(FORMATS)
        good = str(run_dir / "rank0.pickle.gz")
        every = [
            Case("special files", f"{kind} compare", ["compare", good, str(p)]),
            Case("special files", f"{kind} forecast", ["forecast", str(p), "--world-size", "4"]),
            Case("special files", f"{kind} api compare",
                 call=lambda p=p, good=good: _api_compare(good, p)),
        ]
        cases += [
            Case("special files", f"{kind} diagnose", ["diagnose", str(p), "--format", fmt],
                 renderer=fmt),
            Case("special files", f"{kind} api load", call=lambda p=p: _api_load(p)),
            *rng.sample(every, 1 if scale == 1 else 3),
        ]
    cases += [Case("special files", "run folder with all of them",
                   ["diagnose", str(run_dir), "--format", "json", "-j", "2", "-q"]),
              Case("special files", "glob over all of them",
                   ["diagnose", str(run_dir / "rank*"), "--format", "json", "-j", "2", "-q"]),
              Case("special files", "api load bytes", call=lambda: _api_load(b"\x80\x04N.")),
              Case("special files", "api load None", call=lambda: _api_load(None))]
    return cases


def _api_load(p: object) -> None:
    import snapforensics as sf
    sf.load(p)  # type: ignore[arg-type]


def _api_compare(a: str, b: Path) -> None:
    import snapforensics as sf
    sf.compare(a, str(b))


def extreme_numbers(d: Path, rng: random.Random, scale: int) -> list[Case]:
    times = [1e308, -1e308, float("inf"), float("-inf"), float("nan"), 2.0 ** 63, 1e20, -1.0, 0.0]
    ints = [0, 1, (1 << 50), (1 << 50) + 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, -1,
            -(1 << 63), 10 ** 30]
    cases = []
    for k in range(3 * scale):
        es = []
        for r in range(rng.randint(2, 6)):
            t = f(rng.choice(times)) if rng.random() < 0.7 else i(rng.choice(ints))
            act = rng.choice(["alloc", "free_requested", "free_completed", "oom", "segment_alloc"])
            es.append(entry(act, addr=rng.choice(ints[:7]) if rng.random() < 0.3 else (r + 1) << 20,
                            size=rng.choice(ints) if rng.random() < 0.3 else 512, time=t))
        p = _write(d / f"num{k}.pickle", pkl(snapshot_dict(EMPTY_LIST, trace_of(es))))
        cases += _diagnose_cases("extreme numbers", f"file {k}", p, rng)
        cases.append(Case("extreme numbers", f"file {k} forecast",
                          ["forecast", str(p), "--world-size", "2,1048576",
                           "--micro-batch-scale", "0.001,1024", "--format",
                           rng.choice(["json", "markdown", "html", "terminal"])]))
    return cases


def many_devices(d: Path, rng: random.Random, scale: int) -> list[Case]:
    from attacks import many_devices_file

    cases = []
    for k, n in enumerate([12, 30] if scale == 1 else [100, 300, 1000]):
        sub = d / f"dev{k}"
        sub.mkdir()
        p = many_devices_file(sub, n * scale)
        for fmt in ("markdown", "html"):
            out = sub / f"r{EXT[fmt]}"
            cases.append(Case("many devices", f"{n * scale} devices {fmt}",
                              ["diagnose", str(p), "-o", str(out), "--no-cache"], renderer=fmt))
    return cases


def tampered_cache(d: Path, rng: random.Random, scale: int) -> list[Case]:
    """Entries made by diagnosing the fixture (in this process, once), then each case gets its
    own cache folder with one entry changed."""
    seed = d / "seed-cache"
    src = d / "rank0.pickle.gz"
    src.write_bytes(FIXTURE.read_bytes())
    run(Case("tampered cache entries", "seed", ["diagnose", str(src), "--format", "json"],
             env={"SNAPFORENSICS_CACHE_DIR": str(seed)}), d, 300, 3 << 30)
    entries = sorted(seed.iterdir())
    assert {p.suffix for p in entries} == {".json", ".npz"}, entries

    def retype(v: object) -> object:
        return rng.choice([None, "x", -1, 1e300, [], {}, [1, "a"], {"a": None}, True,
                           2 ** 63 - 1])

    cases = []
    for k in range(6 * scale):
        cdir = d / f"cache{k}"
        cdir.mkdir()
        for e in entries:
            (cdir / e.name).write_bytes(e.read_bytes())
        victim = cdir / rng.choice(entries).name
        how = rng.choice(["fifo", "dev_zero", "truncate", "flip", "retype", "delete key"])
        if victim.suffix == ".npz" and how in ("retype", "delete key"):
            how = "flip"
        data = victim.read_bytes()
        victim.unlink()
        if how == "fifo":
            os.mkfifo(victim)
        elif how == "dev_zero":
            victim.symlink_to("/dev/zero")
        elif how == "truncate":
            victim.write_bytes(data[: rng.randrange(len(data))])
        elif how == "flip":
            b = bytearray(data)
            for _ in range(rng.choice([1, 10, 100])):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            victim.write_bytes(bytes(b))
        else:
            doc = json.loads(data)
            obj, keys = doc, []
            while isinstance(obj, (dict, list)) and obj and rng.random() < 0.8:
                k2 = rng.choice(list(obj) if isinstance(obj, dict) else range(len(obj)))
                keys.append(k2)
                parent, obj = obj, obj[k2]
            if keys:
                if how == "delete key" and isinstance(parent, dict):
                    del parent[keys[-1]]
                else:
                    parent[keys[-1]] = retype(obj)
            victim.write_text(json.dumps(doc))
        fmt = rng.choice(FORMATS)
        cases.append(Case("tampered cache entries", f"{victim.suffix} {how} {fmt}",
                          ["diagnose", str(src), "--format", fmt],
                          env={"SNAPFORENSICS_CACHE_DIR": str(cdir)}, renderer=fmt))
    return cases


def out_of_range_options(d: Path, rng: random.Random, scale: int) -> list[Case]:
    fx = str(FIXTURE)
    bad_numbers = ["inf", "-inf", "nan", "1e400", "-1", "0", "1e12", "10" * 60, "abc", "",
                   "1e-400", "0x10", "1_000"]
    opts = [
        lambda v: ["forecast", fx, "--world-size", v],
        lambda v: ["forecast", fx, "--micro-batch-scale", v],
        lambda v: ["forecast", fx, "--capacity", v + "GiB"],
        lambda v: ["forecast", fx, "--strategy", "hsdp:" + v],
        lambda v: ["diagnose", fx, "--format", "json", "-j", v],
    ]
    envs = ["SNAPFORENSICS_EXPANSION", "SNAPFORENSICS_LOAD_MEMORY",
            "SNAPFORENSICS_PROGRESS_AFTER", "SNAPFORENSICS_CACHE_SIZE", "SNAPFORENSICS_CACHE_HASH",
            "SNAPFORENSICS_SCHEDULER_TIMEOUT"]
    cases = []
    for k in range(8 * scale):
        v = rng.choice(bad_numbers)
        cases.append(Case("out-of-range options", f"option {k}: {v!r}", rng.choice(opts)(v)))
    for name in envs:
        v = rng.choice(bad_numbers)
        cases.append(Case("out-of-range options", f"{name}={v!r}",
                          ["diagnose", fx, "--format", "json", "--no-cache"], env={name: v}))
    cases.append(Case("out-of-range options", "130 categories",
                      ["diagnose", fx, "--format", "json", "--no-cache",
                       *[x for k in range(130) for x in ("--category", f"c{k}=f{k}")]]))
    return cases


FAMILIES: dict[str, Callable[[Path, random.Random, int], list[Case]]] = {
    "long strings": long_strings,
    "equality bombs": equality_bombs,
    "special files": special_files,
    "extreme numbers": extreme_numbers,
    "many devices": many_devices,
    "tampered cache entries": tampered_cache,
    "out-of-range options": out_of_range_options,
}
