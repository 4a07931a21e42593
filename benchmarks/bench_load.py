"""Loader throughput: bare `pickle.load` vs `snapforensics.snapshot.load` vs load + diagnose.

Prints figures; it is not a test. For each file (default: the largest files of the shared corpus)
and for one synthetic large snapshot built by repeating a real file's trace to about N entries,
it reports the best of R runs of each step, measured in the same process, and the ratio
ours / pickle.load.

    python benchmarks/bench_load.py                      # corpus files + 1M-entry synthetic
    python benchmarks/bench_load.py --entries 5000000    # ~1 GB synthetic file
    python benchmarks/bench_load.py a.pickle b.pickle --entries 0 --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapforensics.analysis import diagnose  # noqa: E402
from snapforensics.snapshot import load  # noqa: E402

CORPUS = Path(os.environ.get("SNAPFORENSICS_CORPUS",
                             Path(__file__).resolve().parents[1].parent / "shared" / "corpus"))


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bare_pickle(path: Path) -> None:
    with open(path, "rb") as f:
        pickle.load(f)


def bare_pickle_nogc(path: Path) -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        bare_pickle(path)
    finally:
        if was:
            gc.enable()


def measure(path: Path, repeat: int, with_diagnose: bool = True) -> dict:
    t_pickle = best(lambda: bare_pickle(path), repeat)
    t_nogc = best(lambda: bare_pickle_nogc(path), repeat)
    t_load = best(lambda: load(path), repeat)
    t_diag = best(lambda: diagnose(load(path)), repeat) if with_diagnose else float("nan")
    snap = load(path)
    return {"file": path.name, "mb": path.stat().st_size / 1e6,
            "entries": sum(len(t) for t in snap.traces), "pickle": t_pickle, "nogc": t_nogc,
            "load": t_load,
            "diag": t_diag}


def synthetic(src: Path, entries: int, out: Path) -> Path:
    """Repeat `src`'s longest trace until it has about `entries` entries.

    Each copy gets new entry dicts and new frames lists (as torch writes them) but shares the
    frame dicts (as torch's memoized pickle does), addresses shifted per copy so that blocks of
    different copies never collide, and times continuing after the previous copy.
    """
    with open(src, "rb") as f:
        raw = pickle.load(f)
    trace = max(raw["device_traces"], key=len)
    if not trace:
        raise SystemExit(f"{src} has no trace to repeat")
    times = [e.get("time_us", 0) for e in trace]
    span = (max(times) - min(times) + 1) if times else 1
    copies = max(1, -(-entries // len(trace)))
    out_trace = []
    for k in range(copies):
        shift = k << 44
        for e in trace:
            d = dict(e)
            d["addr"] = e.get("addr", 0) + shift if e.get("addr") else e.get("addr", 0)
            if "frames" in e:
                d["frames"] = list(e["frames"])
            if "time_us" in e:
                d["time_us"] = e["time_us"] + k * span
            out_trace.append(d)
    del out_trace[entries:]
    raw["device_traces"] = [out_trace]
    with open(out, "wb") as f:
        pickle.dump(raw, f, protocol=4)
    return out


def row(r: dict) -> str:
    return (f"{r['file'][:40]:40} {r['mb']:7.1f} {r['entries']:8d} {r['pickle']:8.3f} "
            f"{r['nogc']:8.3f} {r['load']:8.3f} {r['diag']:8.3f} {r['load'] / r['pickle']:7.2f}x "
            f"{r['load'] / r['nogc']:7.2f}x {r['diag'] / r['pickle']:7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--entries", type=int, default=1_000_000,
                    help="trace entries of the synthetic snapshot (0: skip it)")
    ap.add_argument("--source", type=Path, default=None,
                    help="file whose trace the synthetic snapshot repeats")
    ap.add_argument("--repeat", type=int, default=3, help="runs per step (best is kept)")
    ap.add_argument("--largest", type=int, default=4, help="corpus files to use by default")
    ap.add_argument("--keep", type=Path, default=None, help="write the synthetic file here")
    args = ap.parse_args()

    files = list(args.files)
    if not files and CORPUS.is_dir():
        pickles = [p for p in CORPUS.iterdir() if p.suffix in (".pickle", ".pkl")]
        files = sorted(pickles, key=lambda p: p.stat().st_size, reverse=True)[:args.largest]
    print(f"python {sys.version.split()[0]}, best of {args.repeat}; times in seconds. pickle = "
          "bare pickle.load (GC on, as a user runs it); nogc = pickle.load with the GC paused "
          "(what our loader does while unpickling); load = snapforensics load (unpickle + "
          "validate + normalize); +diag = load + diagnose")
    print(f"{'file':40} {'MB':>7} {'entries':>8} {'pickle':>8} {'nogc':>8} {'load':>8} "
          f"{'+diag':>8} {'load/pk':>8} {'load/nogc':>8} {'+diag/pk':>8}")
    for p in files:
        print(row(measure(p, args.repeat)), flush=True)
    if args.entries > 0:
        src = args.source or (CORPUS / "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle")
        with tempfile.TemporaryDirectory() as tmp:
            out = args.keep or Path(tmp) / f"synthetic_{args.entries}.pickle"
            t = time.perf_counter()
            synthetic(src, args.entries, out)
            print(f"# synthetic: {src.name} repeated to {args.entries} entries "
                  f"({out.stat().st_size / 1e6:.0f} MB, built in {time.perf_counter() - t:.1f} s)",
                  flush=True)
            print(row(measure(out, args.repeat)), flush=True)


if __name__ == "__main__":
    main()
