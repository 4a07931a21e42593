"""Issue 26's differential test (tests/test_differential.py): opcode-level mutants of real
pickles, each read in this process by the three read paths, which must agree.

Sources: the committed fixtures/*.pickle.gz (decompressed) and, when present, the smaller files
of ../shared/corpus. A mutant is named by (seed, index): `mutant(seed, k)` rebuilds it exactly,
so a failure names everything needed to reproduce it:

    python -c "import sys; sys.path.insert(0, 'tests'); import differential as d; \
        print(d.describe(d.compare(*d.mutant(SEED, K)[1:])))"

Mutations (one to three per mutant), each at an opcode boundary found by pickletools.genops:
a bit flipped in an opcode or its argument, an opcode deleted, duplicated or swapped with the
next one, a stack or mark opcode inserted, a memo index (GET/PUT) changed, the stream cut short,
a FRAME's length changed.

Read paths: the streaming C reader (the default), the C unpickler + C columns
(SNAPFORENSICS_STREAM=0), pure Python (SNAPFORENSICS_PURE_PYTHON=1). Both switches are read from
os.environ at each call (stream.reader(), native.native()), so the loader is called directly
with the variable set; `snapshot.load` never uses the snapshot cache.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import pickletools
import random
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from corpus import CORPUS

from snapforensics.errors import SnapError
from snapforensics.snapshot import load, stream

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = sorted((ROOT / "fixtures").glob("*.pickle.gz"))
FIXTURE_SHARE = 0.15  # of mutants made from a fixture when small corpus files are there too
SMALL = 12_000  # corpus files up to this size: a mutant costs ~1-3 ms per read path there
PATHS: dict[str, dict[str, str]] = {
    "stream": {},
    "no_stream": {"SNAPFORENSICS_STREAM": "0"},
    "pure": {"SNAPFORENSICS_PURE_PYTHON": "1"},
}
_SWITCHES = ("SNAPFORENSICS_STREAM", "SNAPFORENSICS_PURE_PYTHON")
MUTATIONS = ("flip", "delete", "duplicate", "swap", "memo", "truncate", "frame", "insert")
# opcodes `insert` puts at an opcode boundary: the ones that push, pop or read the stack top and
# the mark fence (issue 26: MEMOIZE after MARK, MARK before STOP, two MARKs then APPENDS)
INSERTS = {"MARK": b"(", "MEMOIZE": b"\x94", "POP": b"0", "POP_MARK": b"1", "DUP": b"2",
           "STOP": b".", "NONE": b"N", "EMPTY_LIST": b"]", "EMPTY_DICT": b"}", "APPEND": b"a",
           "APPENDS": b"e", "SETITEM": b"s", "SETITEMS": b"u", "TUPLE1": b"\x85",
           "BINGET 0": b"h\x00", "BININT1 7": b"K\x07"}
_GETS = {"BINGET": "<B", "LONG_BINGET": "<I", "BINPUT": "<B", "LONG_BINPUT": "<I"}


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    data: bytes
    ops: tuple[tuple[str, int, int], ...]  # (opcode name, start, end) per opcode


def _parse(name: str, data: bytes) -> Source:
    starts = [(op.name, pos) for op, _arg, pos in pickletools.genops(data)]
    ends = [p for _, p in starts[1:]] + [len(data)]
    return Source(name, data, tuple((n, p, e) for (n, p), e in zip(starts, ends)))


@cache
def sources(fixtures: bool = True) -> tuple[Source, ...]:
    """The real pickles mutants are made from (the corpus part is () when it is absent)."""
    out = []
    if fixtures:
        out += [_parse(p.name, gzip.decompress(p.read_bytes())) for p in FIXTURES]
    if CORPUS.is_dir():
        for p in sorted(CORPUS.iterdir()):
            if p.is_file() and p.suffix in (".pickle", ".pkl") and p.stat().st_size <= SMALL:
                try:
                    out.append(_parse(p.name, p.read_bytes()))
                except Exception:  # noqa: BLE001 - not a pickle genops can walk: not a source
                    continue
    return tuple(out)


def _mutate(src: Source, data: bytearray, rng: random.Random) -> str:
    """One mutation of `data` (at `src`'s opcode boundaries while they still hold); its name."""
    if not data:  # an earlier edit truncated it all: nothing left to mutate
        return "empty"
    kind = rng.choice(MUTATIONS)
    ops = src.ops
    k = rng.randrange(len(ops))
    name, a, b = ops[k]
    b = min(b, len(data))
    a = min(a, len(data) - 1)
    if kind == "flip":
        at = rng.randrange(a, max(a + 1, b))
        bit = rng.randrange(8)
        data[at] ^= 1 << bit
        return f"flip bit {bit} at {at} ({name})"
    if kind == "delete":
        del data[a:b]
        return f"delete {name} at {a}"
    if kind == "duplicate":
        data[b:b] = data[a:b]
        return f"duplicate {name} at {a}"
    if kind == "insert":
        op = rng.choice(sorted(INSERTS))
        data[a:a] = INSERTS[op]
        return f"insert {op} before {name} at {a}"
    if kind == "swap" and k + 1 < len(ops):
        n2, _, c = ops[k + 1]
        c = min(c, len(data))
        data[a:c] = data[b:c] + data[a:b]
        return f"swap {name} at {a} with {n2}"
    if kind == "memo":
        memo = [op for op in ops if op[0] in _GETS and op[2] <= len(data)]
        if memo:
            name, a, b = rng.choice(memo)
            fmt = _GETS[name]
            old = struct.unpack_from(fmt, data, a + 1)[0]
            new = rng.choice([0, 1, old + 1, max(0, old - 1), old + rng.randrange(1, 50),
                              (1 << (8 * struct.calcsize(fmt))) - 1])
            new %= 1 << (8 * struct.calcsize(fmt))
            struct.pack_into(fmt, data, a + 1, new)
            return f"memo {name} at {a}: {old} -> {new}"
    if kind == "frame":
        frames = [op for op in ops if op[0] == "FRAME" and op[2] <= len(data)]
        if frames:
            _, a, _b = rng.choice(frames)
            old = struct.unpack_from("<Q", data, a + 1)[0]
            new = max(0, old + rng.choice([-9, -2, -1, 1, 2, 9, 1 << 20, -old]))
            struct.pack_into("<Q", data, a + 1, new)
            return f"frame length at {a}: {old} -> {new}"
    cut = a if rng.random() < 0.5 else rng.randrange(len(data))  # truncate (and the fallback)
    del data[cut:]
    return f"truncate at {cut} ({len(src.data)} bytes)"


def mutant(seed: int, k: int, fixtures: bool = True) -> tuple[str, bytes, str]:
    """Mutant `k` of run `seed`: (description, bytes, source name). Deterministic."""
    srcs = sources(fixtures)
    rng = random.Random(f"{seed}:{k}")
    fx = [s for s in srcs if s.name.endswith(".gz")]
    small = [s for s in srcs if not s.name.endswith(".gz")]
    # A fixture read costs ~10x a small corpus file's: one mutant in FIXTURE_SHARE comes from one
    pool = fx if fx and (not small or rng.random() < FIXTURE_SHARE) else small
    src = pool[rng.randrange(len(pool))]
    data = bytearray(src.data)
    edits = [_mutate(src, data, rng) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    return f"{src.name}: " + "; ".join(edits), bytes(data), src.name


@contextmanager
def read_path(label: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in _SWITCHES}
    for k in _SWITCHES:
        os.environ.pop(k, None)
    os.environ.update(PATHS[label])
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def canonical(v: Any) -> Any:
    """A comparable, printable form of a Snapshot (numpy arrays by dtype, shape and digest)."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v).__name__, tuple((f.name, canonical(getattr(v, f.name)))
                                        for f in dataclasses.fields(v)))
    if isinstance(v, np.ndarray):
        a = np.ascontiguousarray(v)
        if a.dtype == object:
            return ("object array", canonical(a.tolist()))
        return ("array", a.dtype.str, a.shape, hashlib.sha1(a.tobytes()).hexdigest())
    if isinstance(v, dict):
        return ("dict", tuple(sorted(((repr(canonical(k)), canonical(x)) for k, x in v.items()),
                                     key=lambda t: t[0])))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(canonical(x) for x in v))
    if isinstance(v, (set, frozenset)):
        return ("set", tuple(sorted(repr(canonical(x)) for x in v)))
    if hasattr(v, "__slots__") and not isinstance(v, (str, bytes, int, float)):
        return (type(v).__name__, tuple((s, canonical(getattr(v, s, None)))
                                        for s in v.__slots__))
    return repr(v)  # scalars: repr makes NaN equal to NaN


def read(path: Path, label: str) -> tuple[str, Any]:
    """("ok", canonical Snapshot) or ("refused", (exit code, message)); any other exception
    is ("crash", its repr) — a bug whatever the other paths say."""
    with read_path(label):
        try:
            snap = load(path)
        except SnapError as e:
            msg = str(e)
            return "refused", (e.exit_code, msg.replace(str(path), "<file>"), "\n" in msg)
        except Exception as e:  # noqa: BLE001 - reported, never swallowed
            return "crash", f"{type(e).__name__}: {str(e)[:300]}"
    snap.source = "<file>"
    return "ok", canonical(snap)


def compare(data: bytes, name: str = "mutant") -> dict[str, tuple[str, Any]]:
    """Each read path's outcome on `data` (written to a temporary file)."""
    with tempfile.TemporaryDirectory(prefix="snapforensics-diff-") as d:
        p = Path(d) / (name.split(".")[0] + ".pickle")
        p.write_bytes(data)
        return {label: read(p, label) for label in PATHS}


def disagreement(results: dict[str, tuple[str, Any]]) -> str:
    """'' when the paths agree (all refuse with one line and the same exit code, or all give
    the same Snapshot); else what differs."""
    kinds = {r[0] for r in results.values()}
    if "crash" in kinds:
        return "a read path raised a non-SnapError exception"
    if kinds != {"ok"} and kinds != {"refused"}:
        return "some paths accept the file, others refuse it"
    if kinds == {"refused"}:
        if any(r[1][2] for r in results.values()):
            return "an error message spans several lines"
        if len({r[1][0] for r in results.values()}) > 1:
            return "the paths refuse with different exit codes"
        return ""
    first = results["stream"][1]
    if any(r[1] != first for r in results.values()):
        return "the paths give different Snapshots"
    return ""


def describe(results: dict[str, tuple[str, Any]], width: int = 400) -> str:
    lines = []
    for label, (kind, v) in results.items():
        text = repr(v) if kind != "ok" else \
            f"Snapshot digest {hashlib.sha1(repr(v).encode()).hexdigest()[:12]}"
        lines.append(f"  {label}: {kind}: {text[:width]}")
    return "\n".join(lines)


def run(seed: int, count: int, fixtures: bool = True) -> tuple[list[str], dict[str, int]]:
    """`count` mutants of run `seed`: (failures, outcome counts)."""
    failures = []
    tally: dict[str, int] = {}
    for k in range(count):
        what, data, src = mutant(seed, k, fixtures)
        results = compare(data, src)
        kind = "+".join(sorted({r[0] for r in results.values()}))
        if kind == "ok":  # read by the stream reader itself, or declined to the Python path
            kind = "ok, stream declined" if stream.last_decline else "ok, streamed"
        tally[kind] = tally.get(kind, 0) + 1
        why = disagreement(results)
        if why:
            failures.append(f"seed {seed} mutant {k} [{what}]: {why}\n{describe(results)}")
    return failures, tally
