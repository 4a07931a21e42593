"""Report size and plot cost against trace length: the HTML must stay bounded for 1 GB inputs.

Prints figures; it is not a test. For synthetic snapshots made by repeating a real file's trace
(`bench_load.synthetic`) to each of the given entry counts, it reports: load + diagnose time,
the share of it spent building the timeline series, the HTML report's size, the time to render
it, the Markdown report + PNG plot time, and each size as a ratio to the smallest input's.

    python benchmarks/bench_report.py                         # 100k and 1M entries
    python benchmarks/bench_report.py --entries 100000 5000000  # ~1 GB
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import CORPUS, synthetic  # noqa: E402

from snapforensics.analysis import timeline  # noqa: E402
from snapforensics.analysis.engine import diagnose_devices  # noqa: E402
from snapforensics.report import render_text  # noqa: E402
from snapforensics.report.plot import png  # noqa: E402
from snapforensics.snapshot import load  # noqa: E402


def measure(path: Path, out: Path) -> dict:
    t = time.perf_counter()
    snap = load(path)
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    diagnosis, analyses = diagnose_devices(snap)
    t_diag = time.perf_counter() - t
    t = time.perf_counter()
    for d in analyses:  # what diagnose spent on the plot series, measured again alone
        timeline.build(d, diagnosis.top, d.allocator.reserved)
    t_series = time.perf_counter() - t
    t = time.perf_counter()
    html = render_text(diagnosis, "html")
    t_html = time.perf_counter() - t
    # the plots' part (SVG, hover data): bounded by POINTS, whatever the trace length; the rest
    # (the embedded JSON, the iterations table) grows with the iterations the trace holds
    plot_kb = sum(len(m) for m in re.findall(r'<div class="sf-plot">.*?</script></div>', html,
                                              re.S)) / 1e3
    t = time.perf_counter()
    render_text(diagnosis, "markdown")
    (out / "plot.png").write_bytes(png([dev.plot for dev in diagnosis.devices if dev.plot]))
    t_md = time.perf_counter() - t
    return {"entries": sum(len(x) for x in snap.traces), "mb": path.stat().st_size / 1e6,
            "load": t_load, "diag": t_diag, "series": t_series, "html_kb": len(html) / 1e3,
            "plot_kb": plot_kb,
            "html_s": t_html, "md_s": t_md, "png_kb": (out / "plot.png").stat().st_size / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--source", type=Path,
                    default=CORPUS / "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle")
    args = ap.parse_args()
    print(f"source trace: {args.source.name}; times in seconds, sizes in kB; plot kB = the "
          "plots' SVG and hover data inside the HTML; ratio = plot kB / the smallest input's "
          "(bounded: stays near 1 while entries grow)")
    print(f"{'entries':>9} {'MB':>7} {'load':>7} {'diag':>7} {'series':>7} {'html kB':>8} "
          f"{'plot kB':>8} {'html s':>7} {'md+png s':>8} {'png kB':>7} {'ratio':>6}")
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.entries:
            path = synthetic(args.source, n, Path(tmp) / f"s{n}.pickle")
            r = measure(path, Path(tmp))
            path.unlink()
            first = first or r["plot_kb"]
            print(f"{r['entries']:9d} {r['mb']:7.0f} {r['load']:7.2f} {r['diag']:7.2f} "
                  f"{r['series']:7.2f} {r['html_kb']:8.0f} {r['plot_kb']:8.0f} {r['html_s']:7.2f} "
                  f"{r['md_s']:8.2f} "
                  f"{r['png_kb']:7.0f} {r['plot_kb'] / first:6.2f}", flush=True)


if __name__ == "__main__":
    main()
