"""Write a big synthetic snapshot by repeating a real trace (for the benchmarks; never commit one).

    python benchmarks/make_big.py /tmp/big_a.pickle --entries 5000000              # shape (a)
    python benchmarks/make_big.py /tmp/big_b.pickle --entries 16000000 --shared    # shape (b)

The source's longest trace is repeated until it has `--entries` entries. Each copy gets new entry
dicts, addresses shifted per copy (blocks of different copies never collide) and times continuing
after the previous copy. Frame dicts are shared (torch's pickle memoizes them). Frames lists:
by default new lists for every copy, as torch writes them (shape a); with `--shared`, every copy
reuses the source's list objects, so the pickle refers to them by memo (shape b). Like torch, an
alloc and its free share one list in both shapes (as in the source).

Default source: the corpus' NiuHuangxiaozi_fwd_bwd_200_mixed.pickle when present, otherwise the
recorded FSDP fixture in fixtures/.
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("SNAPFORENSICS_CORPUS", ROOT.parent / "shared" / "corpus"))


def default_source() -> Path:
    p = CORPUS / "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"
    return p if p.is_file() else ROOT / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"


def read(src: Path) -> dict:
    opener = gzip.open if src.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(src, "rb") as f:
        return pickle.load(f)  # our own corpus/fixture files, not a stranger's


class _Trace:
    """The repeated trace, generated while it is written."""

    def __init__(self, trace: list[dict], entries: int, shared: bool) -> None:
        self.trace, self.entries, self.shared = trace, entries, shared


class _Writer(pickle._Pickler):
    """Python's pickler at protocol 4, writing the trace as it is generated, one copy at a
    time, so memory stays that of one copy, not the ~3.6x the file that building the whole
    object first takes (18 GB for a 5 GB file).

    Copy 0 is written by this pickler, which memoizes every key, str and frame dict the way
    torch's pickle does. Each later copy is written by the C pickler (~20x faster) at
    protocol 3, its memo seeded with this one's (all of copy 0): every shared object is
    referred to by the index copy 0 gave it, and a copy's own objects (entry dicts, frames
    lists) are put at explicit indexes (BINPUT) from there on, every copy reusing the same
    ones (a PUT replaces; no copy refers to another's lists). The file unpickles to the trace
    `repeat` builds (tests/test_stream.py checks it, sharing included); the opcodes are
    protocol 4's but BINPUT for MEMOIZE in copies 1+, and no FRAME around those."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, f: Any) -> None:
        super().__init__(f, protocol=4)

    def save_trace(self, obj: _Trace) -> None:
        self.write(pickle.EMPTY_LIST)
        self.memoize(obj)
        copies = iter(repeat(obj.trace, obj.entries, obj.shared))
        self._batch_appends(next(copies, []))
        seed = dict(self.memo)  # {id: (index, object)}, indexes 0..n0-1: all of copy 0
        top = n0 = len(seed)
        for entries in copies:
            buf = io.BytesIO()
            p = pickle.Pickler(buf, 3)
            p.memo = seed
            p.dump(entries)
            top = max(top, n0 + len(entries) + 1 + sum(1 for _ in _new_lists(entries, seed)))
            b = buf.getbuffer()
            skip = 5 if b[3] == ord("q") else 8  # PROTO 3, EMPTY_LIST, (LONG_)BINPUT
            self.framer.commit_frame(force=True)
            self.framer.file_write(b[skip:-1])  # the APPENDS into the trace; no STOP
        # as many memo entries as the unpickler has now: later MEMOIZEs go on from there
        self.memo.update((-i, (i, None)) for i in range(n0, top))

    dispatch[_Trace] = save_trace


def _new_lists(entries: list[dict], seed: dict) -> Iterator[list]:
    seen: set[int] = set()
    for e in entries:
        fr = e.get("frames")
        if fr is not None and id(fr) not in seed and id(fr) not in seen:
            seen.add(id(fr))
            yield fr


def repeat(trace: list[dict], entries: int, shared: bool) -> Iterator[list[dict]]:
    """The entries of `trace` repeated up to `entries`, one list per copy: new dicts,
    addresses shifted per copy (blocks of different copies never collide), times continuing,
    frames lists new per copy (one per list of the source: torch shares an alloc's list with
    its free) unless `shared`."""
    times = [e["time_us"] for e in trace if e.get("time_us") is not None]
    span = (max(times) - min(times) + 1) if times else 1
    left = entries
    k = 0
    while left > 0:
        shift = k << 44
        fresh: dict[int, list] = {}
        out = []
        for e in trace[:left]:
            d = dict(e)
            if e.get("addr"):
                d["addr"] = e["addr"] + shift
            if e.get("frames") is not None and not shared:
                d["frames"] = fresh.setdefault(id(e["frames"]), list(e["frames"]))
            if e.get("time_us") is not None:
                d["time_us"] = e["time_us"] + k * span
            out.append(d)
        yield out
        left -= len(out)
        k += 1


def make(src: Path, entries: int, shared: bool, out: Path) -> int:
    raw = read(src)
    trace = max(raw["device_traces"], key=len)
    if not trace:
        raise SystemExit(f"{src} has no trace to repeat")
    # Segments describe the dump-time state of the last copy.
    last = ((-(-entries // len(trace))) - 1) << 44
    for s in raw.get("segments") or []:
        s["address"] = s.get("address", 0) + last
        for b in s.get("blocks") or []:
            if "address" in b:
                b["address"] += last
    raw["device_traces"] = [_Trace(trace, entries, shared)]
    with open(out, "wb") as f:
        _Writer(f).dump(raw)
    return entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--shared", action="store_true", help="frames lists shared between entries")
    ap.add_argument("--source", type=Path, default=None)
    args = ap.parse_args()
    src = args.source or default_source()
    n = make(src, args.entries, args.shared, args.out)
    print(f"{args.out}: {n} entries repeating {src.name}, "
          f"{args.out.stat().st_size / 1e6:.0f} MB, frames lists "
          f"{'shared between entries' if args.shared else 'new in every copy'}")


if __name__ == "__main__":
    main()
