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
import os
import pickle
import struct
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


def _int(v: int) -> bytes:
    """`v` as pickle.save_long writes it at protocol 2+."""
    if 0 <= v <= 0xFF:
        return pickle.BININT1 + bytes((v,))
    if 0 <= v <= 0xFFFF:
        return pickle.BININT2 + struct.pack("<H", v)
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return pickle.BININT + struct.pack("<i", v)
    b = pickle.encode_long(v)
    return pickle.LONG1 + bytes((len(b),)) + b if len(b) < 256 else \
        pickle.LONG4 + struct.pack("<i", len(b)) + b


CHANGED = ("addr", "frames", "time_us")  # the fields `repeat` changes per copy


class _Trace:
    """The repeated trace, generated while it is written."""

    def __init__(self, entries: Iterator[dict]) -> None:
        self.entries = entries


class _Writer(pickle._Pickler):
    """Python's pickler at protocol 4 (the C pickler writes the same opcodes; the frames may be
    cut at other places), writing the trace as it is generated. Its memo forgets what the file
    never refers to again: an entry dict at once, a copy's frames lists once its entries are
    written (`drop`). So memory stays that of the source, not the ~3.6x the file that building
    the whole object first takes (18 GB for a 5 GB file)."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, f: Any) -> None:
        super().__init__(f, protocol=4)
        self.count = 0
        self.forget: dict[int, int] = {}  # entry dicts to memoize without keeping -> the id
        self.templates: dict[int, list[bytes | str]] = {}  # of their source entry; its bytes
        self.gets: dict[int, bytes] = {}  # id -> BINGET, for what the memo keeps
        self.copy_of: dict[int, int] = {}  # id of a copy's frames list -> id of its source's
        self.bodies: dict[int, bytes] = {}  # id of a source list -> its items' bytes

    def memoize(self, obj: Any) -> None:
        self.write(self.put(self.count))
        if id(obj) in self.forget:
            del self.forget[id(obj)]
        else:
            self.memo[id(obj)] = self.count, obj
        self.count += 1

    def drop(self, objs: list) -> None:
        for o in objs:
            self.memo.pop(id(o), None)
            self.gets.pop(id(o), None)
            self.copy_of.pop(id(o), None)

    def save_dict(self, obj: dict) -> None:
        """An entry dict whose keys and strs were all written before: its bytes at once (the
        generic path's bytes, ~10x faster); anything else the generic way."""
        if id(obj) in self.forget and 1 < len(obj) <= self._BATCHSIZE:
            made: list[list] = []
            b = self._entry(obj, made)
            if b is not None:
                self.write(pickle.EMPTY_DICT)
                self.memoize(obj)
                for v in made:  # in the order their MEMOIZEs are in `b`
                    self.memo[id(v)] = self.count, v
                    self.count += 1
                self.write(b)
                return
        super().save_dict(obj)

    def _get(self, o: Any) -> bytes | None:
        """The BINGET of a memoized object, cached by its id (None: not memoized)."""
        b = self.gets.get(id(o))
        if b is None and (m := self.memo.get(id(o))) is not None:
            b = self.gets[id(o)] = self.get(m[0])
        return b

    def _entry(self, d: dict, made: list[list]) -> bytes | None:
        """The bytes after the dict's EMPTY_DICT MEMOIZE; `made`: the lists it writes anew.
        Built from the template of the source entry it copies: only the fields `repeat`
        changes (CHANGED) are encoded per entry."""
        src = self.forget.get(id(d))
        tm = self.templates.get(src) if src is not None else None
        if tm is None:
            tm = self._template(d)
            if tm is None:
                return None
            if src is not None:
                self.templates[src] = tm
        out = []
        for part in tm:
            if type(part) is bytes:
                out.append(part)
                continue
            v = d[part]
            t = type(v)
            if t is int:
                out.append(_int(v))
            elif t is float:
                out.append(pickle.BINFLOAT + struct.pack(">d", v))
            elif v is None:
                out.append(pickle.NONE)
            elif (vb := self._get(v)) is not None:
                out.append(vb)
            elif t is list and (body := self._body(v)) is not None:
                out.append(pickle.EMPTY_LIST + pickle.MEMOIZE + body)
                made.append(v)
            else:
                return None
        return b"".join(out)

    def _template(self, d: dict) -> list[bytes | str] | None:
        """MARK, the keys and the values' bytes, SETITEMS, with the name of each CHANGED field
        in place of its value's bytes; None if a key or a value was not written before."""
        parts: list[bytes | str] = []
        cur = [pickle.MARK]
        for k, v in d.items():
            kb = self._get(k)
            if kb is None:
                return None
            cur.append(kb)
            if k in CHANGED:
                parts += [b"".join(cur), k]
                cur = []
                continue
            t = type(v)
            if t is int:
                cur.append(_int(v))
            elif t is float:
                cur.append(pickle.BINFLOAT + struct.pack(">d", v))
            elif v is None:
                cur.append(pickle.NONE)
            elif (vb := self._get(v)) is not None:
                cur.append(vb)
            else:
                return None
        parts.append(b"".join(cur) + pickle.SETITEMS)
        return parts

    def _body(self, v: list) -> bytes | None:
        """MARK, the BINGETs of a frames list's items, APPENDS; cached by the source list it
        copies (`copy_of`), as its frames are the same objects."""
        src = self.copy_of.get(id(v))
        b = self.bodies.get(src) if src is not None else None
        if b is None and 1 < len(v) <= self._BATCHSIZE:
            gets = [self._get(x) for x in v]
            if any(g is None for g in gets):
                return None
            b = pickle.MARK + b"".join(g for g in gets if g) + pickle.APPENDS
            if src is not None:
                self.bodies[src] = b
        return b

    def save_trace(self, obj: _Trace) -> None:
        self.write(pickle.EMPTY_LIST)
        self.memoize(obj)
        self._batch_appends(obj.entries)

    dispatch[dict] = save_dict
    dispatch[_Trace] = save_trace


def repeat(trace: list[dict], entries: int, shared: bool, w: _Writer | None = None
           ) -> Iterator[dict]:
    """The entries of `trace` repeated up to `entries`: new dicts, addresses shifted per copy,
    times continuing, frames lists new per copy (one per list of the source: torch shares an
    alloc's list with its free) unless `shared`. With a writer `w`, each dict is memoized
    without being kept, and a copy's lists are dropped from the memo once written."""
    times = [e["time_us"] for e in trace if e.get("time_us") is not None]
    span = (max(times) - min(times) + 1) if times else 1
    copies = -(-entries // len(trace))
    lag = 2 + pickle._Pickler._BATCHSIZE // len(trace)
    made: list[list] = []  # per copy, the lists it made (the writer saves in batches)
    left = entries
    for k in range(copies):
        if w is not None and k >= lag:
            w.drop(made[k - lag])
            made[k - lag] = []
        shift = k << 44
        fresh: dict[int, list] = {}
        for e in trace[:left]:
            d = dict(e)
            if e.get("addr"):
                d["addr"] = e["addr"] + shift
            if e.get("frames") is not None and not shared:
                fr = e["frames"]
                if id(fr) not in fresh:
                    fresh[id(fr)] = list(fr)
                    if w is not None:
                        w.copy_of[id(fresh[id(fr)])] = id(fr)
                d["frames"] = fresh[id(fr)]
            if e.get("time_us") is not None:
                d["time_us"] = e["time_us"] + k * span
            if w is not None:
                w.forget[id(d)] = id(e)
            yield d
        left -= min(left, len(trace))
        made.append(list(fresh.values()))


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
    n = 0

    def counted(it: Iterator[dict]) -> Iterator[dict]:
        nonlocal n
        for d in it:
            n += 1
            yield d

    with open(out, "wb") as f:
        w = _Writer(f)
        raw["device_traces"] = [_Trace(counted(repeat(trace, entries, shared, w)))]
        w.dump(raw)
    return n


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
