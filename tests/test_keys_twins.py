"""keys.scan (Python, the specification) and _keys.scan (C) are one scan written twice: opcode by
opcode they must give the same answer, on real files, on hostile ones, on each opcode family a
refusal rests on, and on thousands of mutations of real pickles (flipped bytes, cuts, spliced
opcodes), where a difference in how far either follows the stream would show."""

from __future__ import annotations

import gzip
import pickle
import random
from pathlib import Path

import pytest
from corpus import corpus_files

from snapforensics.snapshot import keys

_keys = pytest.importorskip("snapforensics.snapshot._keys")
ROOT = Path(__file__).resolve().parents[1]


def _both(data: bytes) -> int:
    py, c = keys.scan(data), _keys.scan(data)
    assert py == c, (py, c, data[:200])
    return py


# each refusal and each pass by the opcode family it rests on, with what the scan must answer
CASES = {
    "str keys (protocol 4)": (pickle.dumps({"a": {"b": [1, 2.0, None, b"x"]}}, 4), keys.FOUND),
    "str keys (protocol 0)": (pickle.dumps({"a": [{"b": 1}]}, 0), keys.FOUND),
    "str keys (protocol 2)": (pickle.dumps({"a": (1, 2)}, 2), keys.FOUND),
    "int key (SETITEM)": (pickle.dumps({1: 2}, 4), keys.KEY),
    "int key (protocol 0)": (pickle.dumps({1: 2}, 0), keys.KEY),
    "tuple key (protocol 2)": (pickle.dumps({(1, 2): 3}, 2), keys.KEY),
    "int key among str (SETITEMS)": (pickle.dumps({"a": 1, "b": 2, 3: 4}, 4), keys.KEY),
    "memoised str key reused": (pickle.dumps([{"k": 1}, {"k": 2}], 4), keys.FOUND),
    "memoised int reused as a key": (b"\x80\x04]\x94(K\x07\x94}\x94h\x01K\x01se.", keys.KEY),
    "set": (pickle.dumps({"a": {1, 2}}, 4), keys.SET),
    "frozenset": (pickle.dumps({"a": frozenset([1])}, 4), keys.SET),
    "memo index past the file": (b"\x80\x04N" + b"r" + (1 << 31).to_bytes(4, "little") + b".",
                                 keys.MEMO),
    "truncated": (pickle.dumps({"a": [1] * 10}, 4)[:-7], keys.FOUND),
    "unknown opcode": (b"\x80\x04\xff.", keys.FOUND),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_opcode_family(name):
    data, want = CASES[name]
    assert _both(data) == want


def _real() -> list[bytes]:
    out = []
    for p in sorted((ROOT / "fixtures").glob("*.pickle*")) + list(corpus_files())[:12]:
        raw = p.read_bytes()
        out.append(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return out


def test_real_files_pass_in_both():
    files = _real()
    assert files
    for data in files:
        assert _both(data) == keys.FOUND


def test_hostile_files_answer_alike(tmp_path):
    from hostile import CASES as HOSTILE

    for build in HOSTILE.values():
        raw = build(tmp_path).read_bytes()
        if raw[:2] == b"\x1f\x8b":
            continue  # the gzip ones hold real pickles
        _both(raw)


def test_mutations_answer_alike():
    """4,000 mutations of the smallest real pickles: the two scans stop, pass and refuse at the
    same opcodes (a mismatch names the mutated bytes)."""
    rnd = random.Random(26)
    seeds = sorted(_real(), key=len)[:3] + [CASES[n][0] for n in sorted(CASES)]
    ops = [bytes([o]) for o in b"}]()sudertqh\x94\x8c\x8fa\x90\x91KJNX.\x80\x95"]
    refused = 0
    for _ in range(4000):
        data = bytearray(rnd.choice(seeds)[:200_000])
        for _k in range(rnd.randint(1, 8)):
            at = rnd.randrange(len(data))
            kind = rnd.random()
            if kind < 0.4:
                data[at] = rnd.randrange(256)
            elif kind < 0.7:
                data[at:at] = rnd.choice(ops)
            elif kind < 0.85:
                del data[at:at + rnd.randint(1, 16)]
            else:
                data = data[:at]
            if not data:
                data = bytearray(b".")
        refused += _both(bytes(data)) != keys.FOUND
    assert refused, "no mutation reached a refusal: the comparison only saw quiet stops"
