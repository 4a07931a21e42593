"""Small seed inputs for the fuzz harness: real snapshots (fixtures, corpus when present) cut
to a few entries, segments and frames, pickled with protocols 2, 4 and 5."""

import gzip
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from corpus import corpus_files  # noqa: E402


def cut(raw):
    if isinstance(raw, dict):
        raw = dict(raw)
        raw["segments"] = [dict(s, blocks=(s.get("blocks") or [])[:3])
                           for s in (raw.get("segments") or [])[:3]]
        raw["device_traces"] = [t[:6] + t[-6:] for t in (raw.get("device_traces") or [])[:2]]
    return raw


def main(out: str) -> None:
    d = Path(out)
    d.mkdir(exist_ok=True)
    files = sorted((ROOT / "fixtures").glob("*.pickle*")) + corpus_files()
    for p in files:
        b = p.read_bytes()
        raw = pickle.loads(gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b)  # our own files
        small = cut(raw)
        for proto in (2, 4, 5):
            (d / f"{p.stem}.p{proto}").write_bytes(pickle.dumps(small, protocol=proto))


if __name__ == "__main__":
    main(sys.argv[1])
