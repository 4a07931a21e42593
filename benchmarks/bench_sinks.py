"""Report sinks on hostile string shapes: time grows linearly with the string (figures, not a test).

For each shape (runs of slashes, path-like tokens, `-packages` decoys, escapes...) it times
`redact_text` (--redact-paths), `short_path` (terminal stacks) and each sink function of
report/sanitize.py at 10x and 100x a base length, and prints the ratio: ~10 is linear, ~100
would be quadratic (the old site-packages pattern took 4.5 s at 10 kB, minutes at 100 kB).

    python benchmarks/bench_sinks.py            # base 10 kB
    python benchmarks/bench_sinks.py 20000
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapforensics.report import sanitize  # noqa: E402
from snapforensics.report.redact import redact_text, short_path  # noqa: E402

SHAPES = {"slashes": "/", "a/": "a/", "/a": "/a", "-/": "-/", "/ ": "/ ", "C:/": "C:/",
          ":/": ":/", "/-packages": "/-packages", "./": "./", "esc": "\x1b]8;;", "tick": "`|_"}
FUNCS = {"redact_text": redact_text, "short_path": short_path,
         "terminal": lambda s: sanitize.terminal(s, len(s)),
         "markdown": lambda s: sanitize.markdown(s, len(s)),
         "markdown_code": lambda s: sanitize.markdown_code([s], limit=len(s)),
         "html": lambda s: sanitize.html(s, len(s))}


def best(f, s: str, repeat: int = 3) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f(s)
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    base = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    print(f"{'shape':12} {'function':14} {'x10 s':>9} {'x100 s':>9} {'ratio':>6}")
    for name, unit in SHAPES.items():
        for fname, f in FUNCS.items():
            small = unit * (base // len(unit))
            big = unit * (10 * base // len(unit))
            a, b = best(f, small), best(f, big)
            print(f"{name:12} {fname:14} {a:9.4f} {b:9.4f} {b / a if a else 0:6.1f}")


if __name__ == "__main__":
    main()
