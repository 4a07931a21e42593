"""The streaming reader (snapshot/_stream.c) against the reader it replaces.

Every real file (fixtures, corpus) and both shapes of benchmarks/make_big.py must be read by the
stream (not declined) into a Snapshot identical to the one the current reader gives
(`SNAPFORENSICS_STREAM=0`: the C unpickler then `_native.trace_columns`, itself equal to the
pure-Python path in test_native): columns, frames, stacks, streams, segments, annotations,
format, warnings, metadata. A file it declines (an opcode, a structure or a value it does not
implement) is read by the Python path: the hostile files and edited entries below get the same
Snapshot or the same one-line error either way.
"""

from __future__ import annotations

import gzip
import pickle
import sys
from pathlib import Path

import pytest
from hostile import CASES, pkl, trace_of
from hostile import f as f_
from hostile import i as i_
from hostile import s as s_
from test_native import EDITS, FILES, _entries, _raw, _same

from snapforensics.errors import SnapError
from snapforensics.snapshot import load, stream
from snapforensics.snapshot.model import A
from snapforensics.snapshot.stream import reader

ROOT = Path(__file__).resolve().parents[1]
needs_stream = pytest.mark.skipif(reader() is None, reason="the streaming reader is not built")
# Hostile cases whose Python path needs GBs or minutes in process (test_hostile runs them all
# through the CLI, under caps, with the stream on).
HEAVY = {"shared_blocks", "shared_traces", "many_devices", "gzip_trailing_zeros",
         "joined_names", "deep_dicts"}


def _same_all(a, b) -> None:
    _same(a, b)
    for f in ("source", "rank", "allocator_settings", "provenance", "kind"):
        assert getattr(a, f) == getattr(b, f), f


def _both(path, monkeypatch):
    """(stream result or error, why it declined ("" if it read the file), current reader's)."""
    out = []
    for off in ("", "0"):
        monkeypatch.setenv("SNAPFORENSICS_STREAM", off)
        stream.last_decline = ""
        try:
            out.append(load(path))
        except SnapError as e:
            out.append(str(e))
        if not off:
            out.append(stream.last_decline)
    return out


def test_the_streaming_reader_is_built_where_a_c_compiler_is():
    import shutil
    import sysconfig
    if shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc"):
        assert reader() is not None


@needs_stream
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_real_file_streams_into_the_same_snapshot(path, monkeypatch):
    a, why, b = _both(path, monkeypatch)
    assert why == ""  # read by the stream, not declined
    _same_all(a, b)


@needs_stream
@pytest.mark.parametrize("shared", [False, True], ids=["shape_a", "shape_b"])
def test_both_big_file_shapes_stream_into_the_same_snapshot(shared, tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import make_big
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    if make_big.default_source().parent.name == "fixtures":
        # Known defect, not mended: make_big's copies 1+ refer to memo indexes the file never
        # defines when it repeats the fixture (pickle.loads: "Memo value not found"); it is
        # right on the corpus trace it was made for. Skipped without ../shared/corpus.
        pytest.skip("make_big needs the corpus source (../shared/corpus)")
    out = tmp_path / "big.pickle"
    n = make_big.make(make_big.default_source(), 60_000, shared, out)
    assert n == 60_000
    # make_big writes as it generates, with a memo that forgets: the file must hold the trace
    # built in memory, with the same sharing (one dict per frame; lists per copy or shared)
    source = max(make_big.read(make_big.default_source())["device_traces"], key=len)
    want = [e for copy in make_big.repeat(source, 60_000, shared) for e in copy]
    got = pickle.loads(out.read_bytes())["device_traces"]
    assert got == [want]
    for attr in ("frames", None):
        def ids(t, attr=attr):
            return {id(x) for e in t for x in ([e["frames"]] if attr else e["frames"] or [])
                    if e.get("frames") is not None}
        assert len(ids(got[0])) == len(ids(want))
    a, why, b = _both(out, monkeypatch)
    assert why == ""
    _same_all(a, b)
    assert sum(map(len, a.traces)) == 60_000


@needs_stream
@pytest.mark.parametrize("proto", [2, 3, 5])
def test_other_protocols_stream_too(proto, tmp_path, monkeypatch):
    raw = _raw()
    p = tmp_path / f"p{proto}.pickle"
    p.write_bytes(pickle.dumps(raw, protocol=proto))
    a, why, b = _both(p, monkeypatch)
    assert why == ""
    _same_all(a, b)


@needs_stream
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_stale_bytes_after_stop_warn_the_same(gz, tmp_path, monkeypatch):
    data = pickle.dumps(_raw(), protocol=4) + b"\x00" * 1000
    p = tmp_path / "stale.pickle"
    p.write_bytes(gzip.compress(data) if gz else data)
    a, why, b = _both(p, monkeypatch)
    assert why == ""
    _same_all(a, b)
    assert any("1000 stale bytes" in w for w in a.warnings)


@needs_stream
@pytest.mark.parametrize("field,value,reads", EDITS, ids=lambda v: repr(v)[:20])
def test_an_odd_entry_value_reads_or_fails_the_same(field, value, reads, tmp_path,
                                                     monkeypatch):
    raw = _raw()
    entries = _entries(raw)
    row = len(entries) // 2
    entries[row] = dict(entries[row], **{field: value})
    p = tmp_path / "edited.pickle"
    p.write_bytes(pickle.dumps(raw, protocol=4))
    a, why, b = _both(p, monkeypatch)
    assert (why == "") == reads  # the stream declines exactly what the C reader declines
    if isinstance(a, str) or isinstance(b, str):
        assert a == b and f"[{row}]" in a
    else:
        _same_all(a, b)


@needs_stream
@pytest.mark.parametrize("body,declined", [
    (b"\x80\x04cos\nsystem\n.", True),  # a global
    (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00}\x94.", False),
    (b"(dp0\n.", True),  # protocol 0
    (b"\x80\x04]\x94(K\x01K\x02e.", False),  # a bare list (segments only)
    (b"\x80\x04}\x94\x8c\x0edevice_traces\x94]\x94]\x94}\x94\x8c\x06action\x94\x8c\x05alloc"
     b"\x94sah\x03a", True),  # a trace referred to twice
])
def test_what_it_declines_fails_or_reads_the_same(body, declined, tmp_path, monkeypatch):
    p = tmp_path / "x.pickle"
    p.write_bytes(body)
    a, why, b = _both(p, monkeypatch)
    assert bool(why) == declined
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
    else:
        _same_all(a, b)


@needs_stream
def test_a_truncated_file_fails_the_same(tmp_path, monkeypatch):
    data = pickle.dumps(_raw(), protocol=4)
    p = tmp_path / "cut.pickle"
    p.write_bytes(data[: len(data) * 2 // 3])
    a, why, b = _both(p, monkeypatch)
    assert why.startswith("truncated pickle") and a == b and "truncated" in a


@needs_stream
@pytest.mark.parametrize("name", sorted(set(CASES) - HEAVY))
def test_hostile_files_get_the_same_outcome(name, tmp_path, monkeypatch):
    path = CASES[name](tmp_path)
    a, _, b = _both(path, monkeypatch)
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
    else:
        _same_all(a, b)



@needs_stream
def test_action_strs_not_memoized_read_each_by_value(tmp_path, monkeypatch):
    """Keys memoized, action strs written anew in every entry (a pickler may): each str is
    freed after its row and the next one of the same length may get its address, so a code
    cached by address alone read free_completed as free_requested."""
    keys = ["action", "addr", "size", "stream", "time_us", "frames"]
    entries = []
    for n in range(400):
        act = "free_completed" if n % 2 else "free_requested"
        vals = [s_(act), i_(1 << 20), i_(512), i_(0), f_(float(n)), b"N"]
        kv = b"".join((s_(k) + b"q" + bytes([j + 1]) if n == 0 else b"h" + bytes([j + 1])) + v
                      for j, (k, v) in enumerate(zip(keys, vals)))
        entries.append(b"}(" + kv + b"u")
    body = pkl(b"}q\x00(" + s_("segments") + b"]" + s_("device_traces") + trace_of(entries)
               + b"u")
    path = tmp_path / "fresh_actions.pickle"
    path.write_bytes(body)
    a, why, b = _both(path, monkeypatch)
    assert why == ""
    _same_all(a, b)
    assert a.traces[0].action.tolist() == [A["free_requested"], A["free_completed"]] * 200


BEYOND = "truncated pickle: a length beyond the end of the stream"


class _Endless:
    """A stream of `total` zero bytes after `head`, counting what the reader takes."""

    def __init__(self, head: bytes, total: int) -> None:
        self.head, self.total, self.given = head, total, 0

    def read(self, n: int) -> bytes:
        k = min(n, self.total - self.given)
        out = (self.head + bytes(k))[self.given:self.given + k] if self.given < len(self.head) \
            else bytes(k)
        self.given += k
        return out


@needs_stream
@pytest.mark.parametrize("head", [
    b"\x80\x04\x8d" + (1 << 40).to_bytes(8, "little"),  # BINUNICODE8
    b"\x80\x04X" + (0xFFFFFFF0).to_bytes(4, "little"),  # BINUNICODE
    b"\x80\x04\x95" + (1 << 29).to_bytes(8, "little"),  # FRAME (under its 1 GiB cap)
], ids=["BINUNICODE8", "BINUNICODE", "FRAME"])
def test_a_length_beyond_the_allowed_bytes_is_refused_before_reading(head):
    """A length field larger than what the stream may still hold (max_in) is refused at once:
    the reader used to read on until the end of the data (a gzip stream far beyond max_in,
    ~5 GB of buffer for a 5 GB file whose first string claims 2^40 bytes)."""
    src = _Endless(head, 256 << 20)
    root, why, traces = stream._stream.read(src, A, stream.OTHER, 1 << 40, 1 << 20, 1 << 20)
    assert (root, why, traces) == (None, BEYOND, 0)
    assert src.given <= 8 << 20  # the first chunk only (4 MiB)


@needs_stream
def test_a_gzip_string_claiming_more_than_the_cap_fails_the_same(tmp_path, monkeypatch):
    body = b"\x80\x04\x8d" + (1 << 40).to_bytes(8, "little") + bytes(96 << 20)
    p = tmp_path / "claim.pickle.gz"
    p.write_bytes(gzip.compress(body, 1))
    a, why, b = _both(p, monkeypatch)
    assert why == BEYOND
    assert isinstance(a, str) and a == b
