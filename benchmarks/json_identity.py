"""Is the JSON of every corpus file and fixture identical to a baseline? (issue 12's check)

    python benchmarks/json_identity.py BASELINE_DIR [--fixtures DIR] [--corpus DIR]
    python benchmarks/json_identity.py BASELINE_DIR --write     # make the baseline (this tree)

Diagnoses each snapshot of the corpus (`../shared/corpus` next to the checkout, or
$SNAPFORENSICS_CORPUS) and of `fixtures/` with this tree's CLI (`diagnose --format json`, what
users script against), and compares it with BASELINE_DIR/<file name>.json, ignoring only the
`tool` field (the version string). Each input is also forecast (`forecast --format json` over
world sizes, strategies, checkpointing, micro-batch scales and a capacity: `FORECAST`) and
compared with BASELINE_DIR/<file name>.forecast.json. The baseline is made the same way from
another tree (this script copied there, run with `--write`: one `<name>.json` and
`<name>.forecast.json` per input). Prints every difference (its JSON path, before and after) and
exits 1 when there is one, 0 when all are identical.
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
# every forecast path: world sizes (one, half, double, far), each strategy change, checkpointing
# both ways, micro-batch scales, and --capacity's fit and cheapest change
FORECAST = ("--world-size", "1,2,4,8,64", "--strategy", "full_shard,shard_grad_op,no_shard,hsdp:2",
            "--checkpointing", "none,full", "--micro-batch-scale", "0.5,1,2", "--capacity",
            "1GiB")


def inputs(corpus: Path, fixtures: Path) -> list[Path]:
    out = []
    for folder in (corpus, fixtures):
        if folder.is_dir():
            out += sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIXES))
    return out


def diagnose_json(path: Path, out: Path, command: tuple[str, ...] = ("diagnose",)
                  ) -> tuple[int, dict | None, str]:
    # never a cached diagnosis (made by whichever tree wrote the cache): this tree's analysis
    env = dict(os.environ, PYTHONPATH=str(ROOT), SNAPFORENSICS_NO_CACHE="1")
    r = subprocess.run([sys.executable, "-m", "snapforensics", command[0], str(path),
                        *command[1:], "--format", "json", "-o", str(out)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    doc = json.loads(out.read_text()) if out.is_file() else None
    err = r.stderr.strip()
    if doc is None and r.returncode != 0 and command[0] != "diagnose":
        # a refusal (e.g. no history to forecast) is an output too: its exit code and message
        doc = {"exit": r.returncode, "error": err.splitlines()[-1] if err else ""}
        out.write_text(json.dumps(doc))
    return r.returncode, doc, err


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
    ap.add_argument("--write", action="store_true", help="write the baseline with this tree")
    args = ap.parse_args()
    files = inputs(args.corpus, args.fixtures)
    runs = [(p, f"{p.name}{kind}.json", cmd) for p in files
            for kind, cmd in (("", ("diagnose",)), (".forecast", ("forecast", *FORECAST)))]
    if args.write:
        args.baseline.mkdir(parents=True, exist_ok=True)
        for path, name, cmd in runs:
            rc, doc, err = diagnose_json(path, args.baseline / name, cmd)
            print(f"{name}: {'written' if doc is not None else f'no JSON (exit {rc})'}")
        return 0
    same = differ = missing = 0
    with tempfile.TemporaryDirectory() as tmp:
        for path, name, cmd in runs:
            base_file = args.baseline / name
            if not base_file.is_file():
                print(f"{name}: no baseline ({base_file})")
                missing += 1
                continue
            rc, doc, err = diagnose_json(path, Path(tmp) / name, cmd)
            if doc is None:
                print(f"{name}: no JSON (exit {rc}): {err.splitlines()[-1] if err else ''}")
                differ += 1
                continue
            base = json.loads(base_file.read_text())
            base.pop("tool", None)
            doc.pop("tool", None)
            diffs = differences(base, doc)
            if diffs:
                differ += 1
                print(f"{name}: {len(diffs)} difference(s)")
                for d in diffs:
                    print(f"  {d}")
            else:
                same += 1
    print(f"{same} identical, {differ} different, {missing} without baseline "
          f"(of {len(runs)} outputs, {len(files)} inputs)")
    return 1 if differ or missing or not files else 0


if __name__ == "__main__":
    sys.exit(main())
