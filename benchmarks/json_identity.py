"""Is the JSON of every corpus file and fixture identical to a baseline? (issue 12's check)

    python benchmarks/json_identity.py BASELINE_DIR [--fixtures DIR] [--corpus DIR]

Diagnoses each snapshot of the corpus (`../shared/corpus` next to the checkout, or
$SNAPFORENSICS_CORPUS) and of `fixtures/` with this tree's CLI (`diagnose --format json`, what
users script against), and compares it with BASELINE_DIR/<file name>.json, ignoring only the
`tool` field (the version string). The baseline is made the same way from another tree (one
`<name>.json` per input, e.g. by /work/wt/make_baseline.sh). Prints every difference (its JSON
path, before and after) and exits 1 when there is one, 0 when all are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")


def inputs(corpus: Path, fixtures: Path) -> list[Path]:
    out = []
    for folder in (corpus, fixtures):
        if folder.is_dir():
            out += sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIXES))
    return out


def diagnose_json(path: Path, out: Path) -> tuple[int, dict | None, str]:
    # never a cached diagnosis (made by whichever tree wrote the cache): this tree's analysis
    env = dict(os.environ, PYTHONPATH=str(ROOT), SNAPFORENSICS_NO_CACHE="1")
    r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(path),
                        "--format", "json", "-o", str(out)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    doc = json.loads(out.read_text()) if out.is_file() else None
    return r.returncode, doc, r.stderr.strip()


def differences(a, b, where: str = "$") -> list[str]:
    if type(a) is not type(b):
        return [f"{where}: {_short(a)} -> {_short(b)}"]
    if isinstance(a, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in b:
                out.append(f"{where}.{k}: removed (was {_short(a[k])})")
            elif k not in a:
                out.append(f"{where}.{k}: added ({_short(b[k])})")
            else:
                out += differences(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items -> {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {_short(a)} -> {_short(b)}"]


def _short(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 120 else s[:117] + "..."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", type=Path)
    ap.add_argument("--corpus", type=Path, default=Path(
        os.environ.get("SNAPFORENSICS_CORPUS") or ROOT.parent / "shared" / "corpus"))
    ap.add_argument("--fixtures", type=Path, default=ROOT / "fixtures")
    args = ap.parse_args()
    files = inputs(args.corpus, args.fixtures)
    same = differ = missing = 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in files:
            base_file = args.baseline / f"{path.name}.json"
            if not base_file.is_file():
                print(f"{path.name}: no baseline ({base_file})")
                missing += 1
                continue
            rc, doc, err = diagnose_json(path, Path(tmp) / f"{path.name}.json")
            if doc is None:
                print(f"{path.name}: no JSON (exit {rc}): {err.splitlines()[-1] if err else ''}")
                differ += 1
                continue
            base = json.loads(base_file.read_text())
            base.pop("tool", None)
            doc.pop("tool", None)
            diffs = differences(base, doc)
            if diffs:
                differ += 1
                print(f"{path.name}: {len(diffs)} difference(s)")
                for d in diffs:
                    print(f"  {d}")
            else:
                same += 1
    print(f"{same} identical, {differ} different, {missing} without baseline "
          f"(of {len(files)} inputs)")
    return 1 if differ or missing or not files else 0


if __name__ == "__main__":
    sys.exit(main())
