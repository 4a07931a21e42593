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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("SNAPFORENSICS_CORPUS", ROOT.parent / "shared" / "corpus"))


def default_source() -> Path:
    p = CORPUS / "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"
    return p if p.is_file() else ROOT / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"


def read(src: Path) -> dict:
    opener = gzip.open if src.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(src, "rb") as f:
        return pickle.load(f)  # our own corpus/fixture files, not a stranger's


def make(src: Path, entries: int, shared: bool, out: Path) -> int:
    raw = read(src)
    trace = max(raw["device_traces"], key=len)
    if not trace:
        raise SystemExit(f"{src} has no trace to repeat")
    times = [e["time_us"] for e in trace if e.get("time_us") is not None]
    span = (max(times) - min(times) + 1) if times else 1
    copies = -(-entries // len(trace))
    out_trace = []
    for k in range(copies):
        shift = k << 44
        fresh: dict[int, list] = {}  # one new list per list of the source (torch shares an
        for e in trace[: entries - len(out_trace)]:  # alloc's list with its free)
            d = dict(e)
            if e.get("addr"):
                d["addr"] = e["addr"] + shift
            if e.get("frames") is not None and not shared:
                d["frames"] = fresh.setdefault(id(e["frames"]), list(e["frames"]))
            if e.get("time_us") is not None:
                d["time_us"] = e["time_us"] + k * span
            out_trace.append(d)
    raw["device_traces"] = [out_trace]
    # Segments describe the dump-time state of the last copy.
    last = (copies - 1) << 44
    for s in raw.get("segments") or []:
        s["address"] = s.get("address", 0) + last
        for b in s.get("blocks") or []:
            if "address" in b:
                b["address"] += last
    with open(out, "wb") as f:
        pickle.dump(raw, f, protocol=4)
    return len(out_trace)


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
