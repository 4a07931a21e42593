"""Share of peak bytes in `other`, per real corpus file with frames (issue 28).

For each device trace of each file in ../shared/corpus (or $SNAPFORENSICS_CORPUS) whose blocks
carry Python frames, prints the bytes alive at the peak row, the share in `other`, and the three
biggest `other` stacks' innermost non-torch frames (what a new category would key on). The
issue's goal: no file with frames above 5% of its peak bytes in `other`.

    .venv/bin/python benchmarks/bench_other_share.py [--stacks] [PATH ...]

With PATHs (snapshot files or folders of them, e.g. a recording of examples/ddp.py), those are
measured instead of the corpus. Run with PYTHONPATH pointing at another checkout to measure its
classification on the same files (before/after a change).

Measured at 50592ef (2 cores, torch 2.13 CPU): every file with frames at or under 5% except six
device traces whose `other` is the user's own code with no module, autograd, optimizer or
framework frame (JasperSolt 14.5%, the three MemSnapDump torch_npu demos 21.2%, silmont2000
mem_snapshot 17.1%) and mosaic's synthetic file (100%, fake /path/to/ frames): the exception list
and its justification are tests/test_corpus_other_share.py. No corpus file carries Megatron,
DeepSpeed or other framework frames (none of its files names `megatron/`), so the 38-47% `other`
of Megatron dumps that issue 28 cites is not in this corpus.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from snapforensics.analysis.context import analyse
from snapforensics.analysis.vocab import CAT_CODE, Category
from snapforensics.errors import SnapError
from snapforensics.snapshot import load

CORPUS = Path(os.environ.get("SNAPFORENSICS_CORPUS")
              or Path(__file__).resolve().parents[1].parent / "shared" / "corpus")


def shares(path: Path):
    """(device, peak bytes, {category: bytes at the peak}, Counter of `other` stacks by bytes)
    for each traced device of `path` whose blocks have frames."""
    snap = load(path)
    for t in snap.active_traces:
        d = analyse(snap, t)
        if not len(d.lt) or not any(i.has_frames for i in d.infos):
            continue
        alive = np.flatnonzero(d.lt.alive_at(d.peak_row))
        by: dict[str, int] = {}
        for code, size in zip(d.category[alive].tolist(), d.lt.size[alive].tolist()):
            name = d.category_names[code]
            by[name] = by.get(name, 0) + int(size)
        other = alive[d.category[alive] == CAT_CODE[Category.OTHER]]
        stacks: Counter = Counter()
        for b in other.tolist():
            stacks[" < ".join(d.stack_text(int(d.lt.stack[b]), 4))] += int(d.lt.size[b])
        yield t.device, int(np.asarray(d.lt.size[alive]).sum()), by, stacks


def main() -> int:
    show = "--stacks" in sys.argv
    given = [Path(a) for a in sys.argv[1:] if not a.startswith("--")]
    if not given and not CORPUS.is_dir():
        print(f"no corpus at {CORPUS}")
        return 0
    files = sorted(f for g in given for f in (sorted(g.glob("*.pickle")) if g.is_dir() else [g])) \
        if given else sorted(CORPUS.iterdir())
    worst = 0.0
    print(f"{'file':<48} {'dev':>3} {'peak MiB':>9} {'other %':>8}  biggest categories")
    for p in files:
        if p.suffix in (".tsv", ".md", ".txt"):
            continue
        try:
            rows = list(shares(p))
        except SnapError as e:
            print(f"{p.name:<48} skipped: {e}")
            continue
        for dev, peak, by, stacks in rows:
            share = by.get(Category.OTHER, 0) / peak if peak else 0.0
            worst = max(worst, share)
            top = ", ".join(f"{k} {v / peak:.0%}" for k, v in
                            sorted(by.items(), key=lambda kv: -kv[1])[:4])
            name = f"{p.parent.name[:24]}/{p.name}" if given else p.name
            print(f"{name:<48} {dev:>3} {peak / 2**20:>9.1f} {share:>8.1%}  {top}")
            if show:
                for s, n in stacks.most_common(3):
                    print(f"      {n / 2**20:8.1f} MiB  {s[:160]}")
    print(f"worst other share: {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
