"""The fuzz target's seed corpus: real snapshots (fixtures, corpus when present) cut to a few
entries, segments and frames, pickled with protocols 2, 4 and 5; and every hostile file the
tests build (tests/hostile.py's CASES, tests/shapes26.py's SHAPES), their first max_len bytes;
and cfuzz/regressions/, the inputs the target once failed on."""

import gzip
import pickle
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from corpus import corpus_files  # noqa: E402
from hostile import CASES  # noqa: E402
from shapes26 import SHAPES  # noqa: E402


def cut(raw):
    if isinstance(raw, dict):
        raw = dict(raw)
        raw["segments"] = [dict(s, blocks=(s.get("blocks") or [])[:3])
                           for s in (raw.get("segments") or [])[:3]]
        raw["device_traces"] = [t[:6] + t[-6:] for t in (raw.get("device_traces") or [])[:2]]
    return raw


def main(out: str, max_len: int) -> None:
    d = Path(out)
    d.mkdir(exist_ok=True)
    files = sorted((ROOT / "fixtures").glob("*.pickle*")) + corpus_files()
    for p in files:
        b = p.read_bytes()
        raw = pickle.loads(gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b)  # our own files
        small = cut(raw)
        for proto in (2, 4, 5):
            (d / f"{p.stem}.p{proto}").write_bytes(pickle.dumps(small, protocol=proto))
    for p in sorted((ROOT / "cfuzz" / "regressions").glob("*")):  # inputs it once failed on
        (d / f"regression-{p.name}").write_bytes(p.read_bytes())
    with tempfile.TemporaryDirectory() as t:
        for name, build in [*CASES.items(), *SHAPES]:
            b = build(Path(t)).read_bytes()
            b = gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b
            (d / f"hostile-{name}").write_bytes(b[:max_len])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
