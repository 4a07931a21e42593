"""The cache: what comes back equals what the loader builds, a tampered entry is never trusted,
the folder stays under its bound, a changed file is a miss, the CLI re-run skips the work."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from corpus import corpus_file

from snapforensics import doccache
from snapforensics.analysis import diagnose
from snapforensics.snapshot import cache
from snapforensics.snapshot.cache import loader
from snapforensics.snapshot.unpickle import open_file

REPO = Path(__file__).resolve().parents[1]
FIXTURES = sorted((REPO / "fixtures").glob("*.pickle.gz"))
# Corpus files with what an entry must carry: several devices, expandable segments, segments
# with blocks and no trace, annotations, NPU quirks, inline annotations.
CORPUS = ["MemSnapDump_snapshot_with_multi_devices.pkl", "MemSnapDump_snapshot_expandable.pkl",
          "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle", "Maphsge4_snapshot_10k.pickle",
          "notHanmin_memory_snapshot.pickle", "mosaic_output.pickle"]


@pytest.fixture
def cdir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("SNAPFORENSICS_CACHE_DIR", str(d))
    monkeypatch.delenv("SNAPFORENSICS_NO_CACHE", raising=False)
    monkeypatch.delenv("SNAPFORENSICS_CACHE_SIZE", raising=False)
    return d


def _key(path: Path) -> str | None:
    with open_file(path) as f:
        return cache.key(f)


def assert_same(a, b) -> None:
    """Field by field, arrays by value and dtype: the cached model is the loader's model."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "traces":
            assert len(x) == len(y)
            for t, u in zip(x, y):
                for g in dataclasses.fields(t):
                    p, q = getattr(t, g.name), getattr(u, g.name)
                    if isinstance(p, np.ndarray):
                        assert p.dtype == q.dtype and np.array_equal(p, q, equal_nan=True), \
                            (f.name, g.name)
                    else:
                        assert p == q, (f.name, g.name)
        else:
            assert x == y, f.name


def entry(cdir: Path) -> Path:
    (e,) = cdir.glob("*.npz")
    return e


@pytest.mark.parametrize("name", [p.name for p in FIXTURES] + CORPUS)
def test_round_trip_equals_the_loader(cdir, name):
    path = REPO / "fixtures" / name if name.endswith(".gz") else corpus_file(name)
    fresh = loader.load(path)
    first = cache.load(path)  # a miss: loads and stores
    assert entry(cdir).stat().st_size > 0
    again = cache.load(path)  # a hit
    assert_same(fresh, first)
    assert_same(fresh, again)
    assert diagnose(again).to_dict() == diagnose(fresh).to_dict()


def test_a_hit_does_not_read_the_snapshot(cdir, monkeypatch):
    path = FIXTURES[0]
    want = doccache.diagnose(path).to_dict()
    monkeypatch.setattr(loader, "load", lambda *a: pytest.fail("the loader ran on a hit"))
    assert doccache.diagnose(path).to_dict() == json.loads(json.dumps(want, default=str))
    cache.load(path)  # the model too


def _rewrite(e: Path, change) -> None:
    """Rewrite the npz entry with `change(arrays)` applied (still a well-formed npz)."""
    with np.load(e, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    with open(e, "wb") as f:
        np.savez(f, **arrays)


def _deflate(e: Path) -> None:
    with zipfile.ZipFile(e) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(e, "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in members.items():
            z.writestr(k, v)


TAMPER = {
    "stack id beyond the table": lambda a: a.__setitem__("t0_stack", np.full_like(
        a["t0_stack"], 1 << 30)),
    "negative size": lambda a: a.__setitem__("t0_size", -a["t0_size"] - 1),
    "size beyond any device": lambda a: a.__setitem__("t0_size", a["t0_size"] + (1 << 51)),
    "wrong dtype": lambda a: a.__setitem__("t0_addr", a["t0_addr"].astype(np.float64)),
    "rows disagree": lambda a: a.__setitem__("t0_time_us", a["t0_time_us"][:-1]),
    "action code unknown": lambda a: a.__setitem__("t0_action", a["t0_action"] + 100),
    "frame id beyond the table": lambda a: a.__setitem__("stack_frames", a["stack_frames"]
                                                         + (1 << 40)),
    "string offsets past the text": lambda a: a.__setitem__("frame_file_end",
                                                            a["frame_file_end"] + 7),
    "not UTF-8": lambda a: a.__setitem__("frame_file_text", np.full_like(
        a["frame_file_text"], 0xFF)),
    "meta not JSON": lambda a: a.__setitem__("meta", np.frombuffer(b"\x80\x04K\x01.", np.uint8)),
    "object array": lambda a: a.__setitem__("t0_stream", np.array([object()] * 3, dtype=object)),
    "member missing": lambda a: a.pop("t0_time_us"),
}


@pytest.mark.parametrize("how", list(TAMPER) + ["deflated", "truncated", "not a zip",
                                                "huge header shape"])
def test_tampered_entry_is_ignored_and_rewritten(cdir, how):
    path = FIXTURES[0]
    fresh = loader.load(path)
    cache.load(path)
    e = entry(cdir)
    if how in TAMPER:
        try:
            _rewrite(e, TAMPER[how])
        except ValueError:  # numpy refuses to write it (object arrays): write it with pickles
            with np.load(e) as z:
                arrays = {k: z[k] for k in z.files}
            TAMPER[how](arrays)
            with open(e, "wb") as f:
                np.savez(f, **arrays)
    elif how == "deflated":
        _deflate(e)
    elif how == "truncated":
        e.write_bytes(e.read_bytes()[: e.stat().st_size // 2])
    elif how == "not a zip":
        e.write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    else:  # a header claiming 2**40 rows over a few bytes of data
        data = e.read_bytes()
        i = data.index(b"'shape': (")
        j = data.index(b")", i)
        e.write_bytes(data[:i] + b"'shape': (1099511627776,)".ljust(j + 1 - i) + data[j + 1:])
    with pytest.raises(cache.BadEntry):
        cache.read_entry(e, str(path))
    got = cache.load(path)  # ignored: the loader's model, and a good entry again
    assert_same(fresh, got)
    assert_same(fresh, cache.read_entry(entry(cdir), str(path)))


def test_changed_file_is_a_miss(cdir, tmp_path):
    src = tmp_path / "rank0.pickle.gz"
    shutil.copy(FIXTURES[0], src)
    k1 = _key(src)
    cache.load(src)
    os.utime(src, ns=(0, src.stat().st_mtime_ns + 10**9))
    assert _key(src) != k1
    shutil.copy(FIXTURES[1], src)
    assert_same(loader.load(src), cache.load(src))


def test_copied_file_keeps_its_own_name_and_rank(cdir, tmp_path):
    """A copy with the same content and mtime (cp -p) hits the entry of the original; what
    the name decides (source, the rank of a file without a recorded one) is the copy's."""
    src = tmp_path / "snapshot_rank_3.pickle"
    with gzip.open(FIXTURES[0]) as f:
        raw = pickle.loads(f.read())
    raw.pop("snapforensics", None)  # a foreign file: no recorded rank
    src.write_bytes(pickle.dumps(raw))
    copy = tmp_path / "snapshot_rank_5.pickle"
    shutil.copy2(src, copy)
    assert _key(src) == _key(copy)
    assert cache.load(src).rank == doccache.diagnose(src).rank == 3
    hit, doc = cache.load(copy), doccache.diagnose(copy)
    assert hit.source == doc.source == str(copy)
    assert hit.rank == doc.rank == loader.load(copy).rank == 5


def test_eviction_keeps_the_folder_under_its_bound(cdir, monkeypatch, tmp_path):
    sizes = []
    for i, f in enumerate(FIXTURES * 2):
        p = tmp_path / f"rank{i}.pickle.gz"
        shutil.copy(f, p)
        os.utime(p, ns=(0, 10**18 + i))  # distinct keys
        cache.load(p)
        sizes.append(sum(x.stat().st_size for x in cdir.iterdir()))
    one = max(x.stat().st_size for x in cdir.glob("*.npz"))
    bound = int(2.5 * one)
    monkeypatch.setenv("SNAPFORENSICS_CACHE_SIZE", str(bound))
    newest = tmp_path / "rank9.pickle.gz"
    shutil.copy(FIXTURES[0], newest)
    cache.load(newest)
    left = list(cdir.iterdir())
    assert sum(x.stat().st_size for x in left) <= bound
    assert (cdir / f"{_key(newest)}.npz") in left  # the most recent stays
    assert 1 <= len(left) < 5


def test_disabled_cache_writes_nothing(cdir, monkeypatch):
    monkeypatch.setenv("SNAPFORENSICS_NO_CACHE", "1")
    doccache.diagnose(FIXTURES[0])
    assert not cdir.exists() or not any(cdir.iterdir())


def test_cli_no_cache_and_rerun(cdir):
    def cli(*a):
        return subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", *a,
                               "--format", "json"], capture_output=True, text=True, cwd=REPO,
                              timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
    r = cli(str(FIXTURES[0]), "--no-cache")
    assert r.returncode == 0, r.stderr
    assert not cdir.exists() or not any(cdir.iterdir())
    first, again = cli(str(FIXTURES[0])), cli(str(FIXTURES[0]))
    assert sorted(p.suffix for p in cdir.iterdir()) == [".json", ".npz"]
    assert json.loads(first.stdout) == json.loads(again.stdout) == json.loads(r.stdout)


def test_the_loader_cache_never_imports_the_analysis(cdir):
    """snapshot/ sits below analysis/ (issue 19): loading through the model cache, a miss and a
    hit, imports nothing from analysis/ or report/."""
    code = ("import sys\nfrom snapforensics.snapshot import cache\n"
            f"cache.load({str(FIXTURES[0])!r}); cache.load({str(FIXTURES[0])!r})\n"
            "bad = [m for m in sys.modules if m.startswith(('snapforensics.analysis', "
            "'snapforensics.report', 'snapforensics.doccache'))]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert sorted(p.suffix for p in cdir.iterdir()) == [".npz"]


def test_a_cached_document_is_checked_field_by_field(cdir):
    """A document of this version with one field retyped (issue 21: exit 70 in the renderers)
    or the entry swapped for a FIFO (a hang) is a miss: deleted and made again."""
    path = FIXTURES[0]
    want = doccache.diagnose(path).to_dict()
    (doc,) = [p for p in cdir.iterdir() if p.suffix == ".json"]
    good = json.loads(doc.read_text())
    for change in ("peaks", "verdict", "fifo"):
        doc.unlink()
        if change == "fifo":
            os.mkfifo(doc)
        else:
            bad = json.loads(json.dumps(good))
            if change == "peaks":
                bad["devices"][0]["peaks"] = [1, 2]
            else:
                bad["findings"][0]["verdict"] = "harmless"
            doc.write_text(json.dumps(bad))
        with pytest.raises(cache.BadEntry):
            doccache.validate(json.loads(doc.read_text())) if change != "fifo" else \
                cache.read_entry(doc, str(path))
        got = doccache.diagnose(path).to_dict()
        assert got == json.loads(json.dumps(want, default=str))
        assert json.loads(doc.read_text()) == good  # rewritten
