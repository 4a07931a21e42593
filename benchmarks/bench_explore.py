"""`explore` on a big file in headless Chromium, beside the unpickling floor, `diagnose` and
torch's memory_viz, in one run. Prints a table; asserts nothing.

    python benchmarks/make_big.py /tmp/big.pickle --entries 6400000   # ~1 GB, a corpus trace
    python benchmarks/bench_explore.py /tmp/big.pickle [--torch] [--torch-timeout 900]
        [--torch-as-limit GB] [--big5 /work/big/big5g.pickle [--big5-as-limit 8]]

Rows (each step its own process; times are whole-process wall times, start-up included):
  floor        `gc.disable(); pickle.load(f)`: time, peak RSS (bench_diagnose.run)
  diagnose     `diagnose FILE --format json --no-cache`, cold
  paint cold   `explore FILE --no-browser` with an empty model cache: from the process's start
               to the first window drawn in the page (Chromium, the Debian package)
  paint warm   the same again: the model cache the cold run wrote
  zoom/pan     each window the page asks for (the whole trace; the peak +-10 %, +-1 %, +-1000
               rows, +-10 rows; 4 pans of half a window): asking, answer, JSON, drawing, timed
               in the page; the answer's size
  server RSS   the explore process's peak (VmHWM) and current RSS after every window
  JS heap      Chromium's JSHeapUsedSize (CDP Performance.getMetrics), the largest seen
  memory_viz   (with --torch) `python -m torch.cuda._memory_viz trace_plot FILE -o HTML`: time,
               peak RSS, HTML size; then that HTML opened in the same Chromium: time to its
               load event, what it drew or how it failed
  5 GB         (with --big5 FILE, made by `make_big.py FILE --entries 32000000` when absent:
               ~5 GB) `explore FILE` under an address-space cap (RLIMIT_AS, --big5-as-limit
               GiB, default 8): first paint cold and warm, RSS, the whole-trace window
Needs the `explore` extra, playwright and /usr/bin/chromium.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_diagnose import LOAD, ROOT, run  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-dev-shm-usage"]


def _kib(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    return 0


def heap(cdp) -> int:
    m = {x["name"]: x["value"] for x in cdp.send("Performance.getMetrics")["metrics"]}
    return int(m.get("JSHeapUsedSize", 0))


def explore(browser, path: Path, env: dict[str, str], zoom: bool, limit: int = 0) -> dict:
    """One `explore` process (its address space capped at `limit` bytes, 0: none): first
    paint, then (if `zoom`) every window of WINDOWS."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "snapforensics", "explore", str(path),
                          "--no-browser"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, preexec_fn=cap if limit else None)
    out: dict = {}
    try:
        line = p.stdout.readline()
        if not line:
            return {"error": (p.stderr.read().strip().splitlines() or ["no URL"])[-1][:80]}
        page = browser.new_page(viewport={"width": 1400, "height": 900}, bypass_csp=True)
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")
        page.goto(line.split()[2])
        page.wait_for_function("win !== null && rects !== undefined", timeout=600_000)
        out["paint"] = time.perf_counter() - t0
        heaps = [heap(cdp)]
        status = Path(f"/proc/{p.pid}/status")
        out["rss_paint"] = _kib(status, "VmRSS")
        if zoom:
            dev = page.evaluate("ov.devices[0]")
            rows, peak = dev["rows"], dev["peak_row"]
            wins = [("whole trace", 0, rows)]
            for name, half in (("peak +-10 %", rows // 10), ("peak +-1 %", rows // 100),
                               ("peak +-1000 rows", 1000), ("peak +-10 rows", 10)):
                wins.append((name, max(0, peak - half), min(rows, peak + half)))
            lo, hi = wins[2][1], wins[2][2]
            step = (hi - lo) // 2 * (1 if peak < rows // 2 else -1)  # towards the far end
            for k in range(4):
                lo, hi = max(0, lo + step), min(rows, hi + step)
                wins.append((f"pan {k + 1} (+-1 % window)", lo, hi))
            out["windows"] = []
            for name, a, b in wins:
                ms, size = page.evaluate("""async ([a, b]) => { lo = a; hi = b;
                    const t = performance.now(); await load();
                    return [performance.now() - t, JSON.stringify(win).length]; }""", [a, b])
                heaps.append(heap(cdp))
                out["windows"].append((name, b - a, ms, size, heaps[-1]))
        out["rss_now"] = _kib(status, "VmRSS")
        out["rss_peak"] = _kib(status, "VmHWM")
        out["heap_max"] = max(heaps)
        page.close()
    finally:
        p.terminate()
        p.wait(30)
    return out


def memory_viz(browser, path: Path, tmp: Path, timeout: float, limit: int) -> dict:
    html = tmp / "trace.html"
    wall, rss, why = run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot",
                          str(path), "-o", str(html)], timeout, limit)
    out = {"make": (wall, rss, why), "html": html.stat().st_size if html.exists() else 0}
    if why or not html.exists():
        out["open"] = "no HTML"
        return out
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    cdp = page.context.new_cdp_session(page)
    cdp.send("Performance.enable")
    failed: list[str] = []
    page.on("requestfailed", lambda r: failed.append(f"{r.url} ({r.failure})"))
    page.on("pageerror", lambda e: failed.append(f"script error: {str(e)[:100]}"))
    page.on("crash", lambda _p: failed.append("the page crashed"))
    t0 = time.perf_counter()
    try:
        page.goto(html.as_uri(), wait_until="load", timeout=timeout * 1000)
        out["load"] = time.perf_counter() - t0
        page.wait_for_timeout(10_000)
        out["heap"] = heap(cdp)
        drew = page.evaluate("document.querySelectorAll('svg, canvas').length")
        out["open"] = (f"drew {drew} svg/canvas" if drew else "drew nothing") + \
            (f"; {'; '.join(failed)}" if failed else "; no error reported")
    except Exception as e:  # noqa: BLE001 - a crash or a timeout is the figure
        out["open"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    finally:
        page.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--torch", action="store_true", help="also memory_viz's trace_plot")
    ap.add_argument("--torch-timeout", type=float, default=900)
    ap.add_argument("--torch-as-limit", type=float, default=0,
                    help="cap trace_plot's address space at this many GiB")
    ap.add_argument("--big5", type=Path, default=None,
                    help="also open this ~5 GB file (made by make_big.py when absent)")
    ap.add_argument("--big5-as-limit", type=float, default=8)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    path = args.file
    py = sys.executable
    gib = 2 ** 30
    print(f"{path.name}: {path.stat().st_size / 1e6:.0f} MB; {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        tmp = Path(tmp)
        floor = run([py, "-c", LOAD.format(gc="gc.disable()"), str(path)])
        diag = run([py, "-m", "snapforensics", "diagnose", str(path), "--format", "json",
                    "-o", str(tmp / "d.json"), "--no-cache", "-q"])
        env = dict(os.environ, PYTHONPATH=str(ROOT), SNAPFORENSICS_CACHE_DIR=str(tmp / "cache"),
                   SNAPFORENSICS_CACHE_SIZE="64G")
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        cold = explore(browser, path, env, zoom=True)
        warm = explore(browser, path, env, zoom=False)
        big5 = None
        if args.big5 is not None:
            if not args.big5.exists():
                subprocess.run([py, str(Path(__file__).parent / "make_big.py"), str(args.big5),
                                "--entries", "32000000"], check=True)
            lim = int(args.big5_as_limit * gib)
            big5 = (explore(browser, args.big5, env, zoom=True, limit=lim),
                    explore(browser, args.big5, env, zoom=False, limit=lim))
        mv = memory_viz(browser, path, tmp, args.torch_timeout,
                        int(args.torch_as_limit * gib)) if args.torch else None
        browser.close()

    def row(name: str, value: str, note: str = "") -> None:
        print(f"  {name:28} {value:>22}  {note}")

    row("floor (gc off pickle.load)", f"{floor[0]:.2f} s {floor[1] / gib:.2f} GB", floor[2])
    row("diagnose, cold", f"{diag[0]:.2f} s {diag[1] / gib:.2f} GB", diag[2])
    for name, r in (("explore first paint, cold", cold), ("explore first paint, warm", warm)):
        if "error" in r:
            row(name, "failed", r["error"])
            continue
        row(name, f"{r['paint']:.2f} s", f"{r['paint'] / diag[0]:.2f}x diagnose; server RSS "
            f"{r['rss_paint'] / gib:.2f} GB at paint, peak {r['rss_peak'] / gib:.2f} GB "
            f"({r['rss_peak'] / floor[1]:.2f}x floor's); JS heap {r['heap_max'] / 2**20:.1f} MB")
    for name, n, ms, size, h in cold.get("windows", []):
        row(f"  {name}", f"{ms:.0f} ms", f"{n:,} rows, answer {size / 1024:.0f} KiB, JS heap "
            f"{h / 2**20:.1f} MB")
    if cold.get("windows"):
        row("server RSS after the zooms", f"{cold['rss_now'] / gib:.2f} GB",
            f"peak {cold['rss_peak'] / gib:.2f} GB")
    if big5 is not None:
        print(f"  {args.big5.name}: {args.big5.stat().st_size / 1e6:.0f} MB, address space capped "
              f"at {args.big5_as_limit:g} GiB; load {os.getloadavg()[0]:.1f}")
        for name, r in zip(("first paint, cold", "first paint, warm"), big5):
            if "error" in r:
                row(name, "failed", r["error"])
                continue
            row(name, f"{r['paint']:.2f} s", f"server RSS {r['rss_paint'] / gib:.2f} GB at "
                f"paint, peak {r['rss_peak'] / gib:.2f} GB; JS heap {r['heap_max'] / 2**20:.1f} MB")
        for name, n, ms, size, _h in big5[0].get("windows", []):
            row(f"  {name}", f"{ms:.0f} ms", f"{n:,} rows, answer {size / 1024:.0f} KiB")
    if mv is not None:
        w, r, why = mv["make"]
        row("memory_viz trace_plot", f"{w:.2f} s {r / gib:.2f} GB" if not why else why,
            f"HTML {mv['html'] / 1e6:.0f} MB")
        row("memory_viz HTML in Chromium", f"{mv['load']:.2f} s" if "load" in mv else "-",
            mv["open"] + (f"; JS heap {mv['heap'] / 2**20:.1f} MB" if "heap" in mv else ""))


if __name__ == "__main__":
    main()
