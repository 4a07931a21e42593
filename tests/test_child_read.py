"""A read in a process whose other threads run (a server, a Dask worker) caps a forked child,
never this process: the other threads keep their address space, the file is still bounded, and
the model that comes back is the one an in-process read makes."""

from __future__ import annotations

import resource
import threading
from pathlib import Path

import numpy as np
import pytest

from snapforensics.errors import SnapError
from snapforensics.snapshot import normalization, npz

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"


class Watcher:
    """Another thread of the process: the tightest address-space cap it saw while running."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.seen = resource.RLIM_INFINITY
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            soft = resource.getrlimit(resource.RLIMIT_AS)[0]
            if soft != resource.RLIM_INFINITY:
                self.seen = soft if self.seen == resource.RLIM_INFINITY else min(self.seen, soft)
            self.stop.wait(0.0005)

    def __enter__(self) -> Watcher:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _arrays(snap) -> dict[str, np.ndarray]:
    import io

    buf = io.BytesIO()
    npz.save(snap, buf)
    buf.seek(0)
    return npz._arrays(buf)


@pytest.fixture(autouse=True)
def _uncapped():
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        pytest.skip("this process already runs under an address-space cap")


def test_other_threads_keep_their_address_space(monkeypatch):
    monkeypatch.delenv("SNAPFORENSICS_LOAD_MEMORY", raising=False)
    alone = normalization.load(FIXTURE) if threading.active_count() == 1 else None
    with Watcher() as w:
        snap = normalization.load(FIXTURE)
    assert w.seen == resource.RLIM_INFINITY, "the read capped the whole process"
    assert snap.source == str(FIXTURE)
    if alone is not None:  # the model that came back through the child is the in-process one
        a, b = _arrays(alone), _arrays(snap)
        assert a.keys() == b.keys()
        for k in a:
            assert np.array_equal(a[k], b[k]), k


def test_the_child_is_still_capped(monkeypatch, tmp_path):
    """BYTEARRAY8 claiming 2**40 bytes: only the address-space cap refuses it."""
    from hostile import huge_length_bytearray

    monkeypatch.delenv("SNAPFORENSICS_LOAD_MEMORY", raising=False)
    with Watcher() as w, pytest.raises(SnapError) as e:
        normalization.load(huge_length_bytearray(tmp_path))
    assert w.seen == resource.RLIM_INFINITY, "the read capped the whole process"
    assert "SNAPFORENSICS_LOAD_MEMORY" in str(e.value) and "\n" not in str(e.value)


def test_the_streams_decline_comes_back_from_the_child(monkeypatch, tmp_path):
    """Why the stream declined a file is the same whether it read in this process or in a
    child (test_stream compares the read paths by it, in workers other tests leave threads in)."""
    import pickle

    from test_native import _raw

    from snapforensics.snapshot import stream

    if stream.reader() is None:
        pytest.skip("the streaming reader is not built")
    monkeypatch.delenv("SNAPFORENSICS_LOAD_MEMORY", raising=False)
    data = pickle.dumps(_raw(), protocol=4)
    p = tmp_path / "cut.pickle"
    p.write_bytes(data[: len(data) * 2 // 3])
    said = []
    for threads in (False, True):
        stream.last_decline = ""
        with (Watcher() if threads else _Nothing()), pytest.raises(SnapError) as e:
            normalization.load(p)
        said.append((stream.last_decline, str(e.value)))
    assert said[0] == said[1] and said[0][0].startswith("truncated pickle")
    stream.last_decline = ""
    with Watcher():
        normalization.load(FIXTURE)  # a file it reads clears it, in the child too
    assert stream.last_decline == ""


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
