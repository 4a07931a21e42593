"""The cache of diagnosis documents: a re-run on an unchanged snapshot also skips the analysis.

    from snapforensics import doccache
    d = doccache.diagnose(path)      # the finished Diagnosis: the cached document, else the
                                     # cached model (snapshot/cache.py), else the file

It sits above both the loader (snapshot/) and the analysis: the loader's package never imports
the analysis. Beside the model entry `<key>.npz`, `<key>.<analysis>.json` holds the document
(`Diagnosis.to_doc()`: the JSON and the plot series) for one version of the analysis code and
one set of options.

A document is read as strictly as a snapshot: through the loader's `open_file` (a regular file,
never a FIFO or a device; at most DOC_MAX, 64 MiB), parsed by orjson (plain JSON: no NaN, ints
within 64 bits), then every field is checked against the type its dataclass declares
(`Diagnosis`, `DeviceSummary`, `Finding`; `Any` admits any JSON value), the peaks and
segments dicts must hold the keys the renderers read, and each device's `plot` must be null or
the series of its timeline plot, every array of the length, shape and range the renderers
index (`Series.from_doc`: at most POINTS points, the hover's indices within its stacks).
Anything else is a bad entry: deleted, and the document is made again from the snapshot.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import fields
from typing import IO, Any

import orjson

from snapforensics.analysis.diagnosis import DeviceSummary, Diagnosis, Finding
from snapforensics.analysis.vocab import Verdict
from snapforensics.snapshot import cache
from snapforensics.snapshot import normalization as loader
from snapforensics.snapshot.npz import BadEntry
from snapforensics.snapshot.unpickle import open_file


def diagnose(path: str | os.PathLike, cache_on: bool = True, variant: str = "",
             categories: tuple[str, ...] = (), full: bool | None = None,
             file: IO[bytes] | None = None) -> Diagnosis:
    """The finished Diagnosis of `path` (`variant`: the options that change an analysis;
    `categories`: user categories, `NAME=REGEX`; `full`: key by every byte of the file, see
    `cache.full_hash`; `file`: `path` already opened by `open_file`, consumed), reusing the
    cached document, else the cached model, else loading the file."""
    from snapforensics.analysis import diagnose as analyse
    from snapforensics.analysis.classify import user_categories

    try:
        user = user_categories(categories)
    except BaseException:
        if file is not None:
            file.close()
        raise
    f = open_file(path) if file is None else file
    try:
        k = cache.key(f, full) if cache_on and cache.enabled() else None
        if k is None:
            return analyse(loader.load(path, f), user)
        name = f"{k}.{_vtag(variant, categories)}.json"
        d = cache.read(name, _parse, DOC_MAX)
        if d is not None:
            d.source, d.rank = str(path), _rank(d.provenance, str(path))
            return d
        d = analyse(cache.load(path, file=f, k=k), user)
    finally:
        f.close()
    cache.write(name, lambda out: out.write(orjson.dumps(d.to_doc(), default=str,
                                                         option=orjson.OPT_NON_STR_KEYS)))
    return d


def _vtag(variant: str = "", categories: tuple[str, ...] = ()) -> str:
    """The tag of one version of the analysis code (and of the loader's) and one set of
    options: entries made by another are other names."""
    variant = "\n".join([variant, *categories])
    return hashlib.blake2b(f"{cache.tag('analysis', 'snapshot')} {variant}".encode(),
                           digest_size=8).hexdigest()


def report(path: str | os.PathLike, cache_on: bool = True) -> Any:
    """`sf.diagnose(path)` (a Report: the Diagnosis and the per-device analyses), the model
    from the snapshot cache and, from the entry `<key>.<analysis>.report-v{REPORT_SCHEMA}.npz`
    beside it (written on the first run), each device's lifetimes (its allocs and frees
    paired: 1.9 s of 4.5 on a 1 GB file) and the columns of its analysis that are not the
    stacks' text (`context.columns`: the distinct (stack, ranges) keys, each block's index
    into them, each row's phase and iteration: pairing the keys and assigning the phases
    took 1.8 s more). The rest of the analysis (the classification of each distinct key,
    the rules) runs again: what the explorer needs of it is every block's, more than a
    document holds."""
    from snapforensics.analysis.engine import diagnose_devices
    from snapforensics.api import Report

    f = open_file(path)
    try:
        k = cache.key(f) if cache_on and cache.enabled() else None
        snap = cache.load(path, file=f, k=k) if k is not None else loader.load(path, f)
    finally:
        f.close()
    if k is None:
        return Report(*diagnose_devices(snap), snap)
    name = f"{k}.{_vtag()}.report-v{REPORT_SCHEMA}.npz"
    got = cache.read(name, lambda e: _read_lifetimes(e, snap))
    lts, cols = got if got is not None else (None, None)
    diagnosis, analyses = diagnose_devices(snap, lifetimes=lts, columns=cols)
    if got is None:
        cache.write(name, lambda out: _save_lifetimes(analyses, out))
    return Report(diagnosis, analyses, snap)


# the layout of the report entry: another is another name (version 1 held the lifetimes only)
REPORT_SCHEMA = 2
_LT_ARRAYS = (("addr", "u8"), ("size", "i8"), ("stack", "i4"), ("alloc_row", "i8"),
              ("free_row", "i8"), ("completed_row", "i8"), ("live", "i8"))
_LT_COUNTS = ("rows", "baseline", "orphan_frees", "unseen_live", "reused_addresses")
# `context.columns`: per distinct key, per block, per row, per row
_COLUMNS = (("keys", "i8"), ("info", "i4"), ("phase", "i1"), ("iteration", "i4"))


def _save_lifetimes(analyses: list, out: IO[bytes]) -> None:
    import numpy as np

    from snapforensics.analysis.context import columns
    from snapforensics.snapshot.npz import savez

    a = {}
    for d in analyses:
        lt = d.lt
        p = f"d{lt.device}_"
        for col, dt in _LT_ARRAYS:
            a[p + col] = np.asarray(getattr(lt, col), dt)
        a[p + "counts"] = np.array([getattr(lt, c) for c in _LT_COUNTS], np.int64)
        cols = columns(d)
        for col, dt in _COLUMNS:
            a[p + "c_" + col] = np.asarray(cols[col], dt)
    savez(out, a)


def _read_lifetimes(entry: IO[bytes], snap: Any) -> tuple[dict[int, Any], dict[int, Any]]:
    """The lifetimes and analysis columns `_save_lifetimes` wrote for the traces of `snap`,
    each checked against its trace (lengths, row, stack, key and phase ranges, sizes):
    BadEntry for anything else."""
    import zipfile

    import numpy as np

    from snapforensics.analysis.lifetimes import Lifetimes
    from snapforensics.analysis.phases import range_context
    from snapforensics.analysis.vocab import Phase
    from snapforensics.snapshot.npz import _arrays

    try:
        a = _arrays(entry)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise BadEntry(f"lifetimes: {type(e).__name__}: {e}") from None
    traces = snap.active_traces
    names = [c for c, _ in _LT_ARRAYS] + ["counts"] + ["c_" + c for c, _ in _COLUMNS]
    if set(a) != {f"d{t.device}_{c}" for t in traces for c in names}:
        raise BadEntry("lifetimes: not the devices of this snapshot")
    out, cols_out = {}, {}
    known = np.zeros(256, bool)  # by int8 code + 128: the vocabulary's phases
    known[[int(p) + 128 for p in Phase]] = True
    for t in traces:
        p = f"d{t.device}_"
        col = {c: a[p + c] for c, _ in _LT_ARRAYS}
        counts = a[p + "counts"]
        if any(col[c].dtype != np.dtype(dt) for c, dt in _LT_ARRAYS) or \
                counts.dtype != np.int64 or len(counts) != len(_LT_COUNTS):
            raise BadEntry("lifetimes: a column of another type")
        n, m = len(t), len(col["size"])
        rows = int(counts[0])
        if rows != n or len(col["live"]) != n or any(len(col[c]) != m for c, _ in _LT_ARRAYS
                                                     if c != "live"):
            raise BadEntry("lifetimes: not this trace's lengths")
        ar, fr, cr, st = col["alloc_row"], col["free_row"], col["completed_row"], col["stack"]
        if m and not (ar.min() >= -1 and ar.max() < n and fr.min() >= 0 and fr.max() <= n
                      and (ar < fr).all() and cr.min() >= -1 and cr.max() < max(n, 1)
                      and st.min() >= -1 and st.max() < len(snap.stacks)
                      and col["size"].min() >= 0) or (counts[1:] < 0).any():
            raise BadEntry("lifetimes: a row, stack or size out of range")
        out[t.device] = Lifetimes(t.device, rows, *(col[c] for c, _ in _LT_ARRAYS),
                                  *(int(x) for x in counts[1:]))
        cols = {c: a[p + "c_" + c] for c, _ in _COLUMNS}
        if any(cols[c].dtype != np.dtype(dt) for c, dt in _COLUMNS):
            raise BadEntry("analysis columns: a column of another type")
        keys, info, ph, it = cols["keys"], cols["info"], cols["phase"], cols["iteration"]
        n_ctx = max(len(range_context(snap.annotations, t.device, n)[1]), 1)
        if len(info) != m or len(ph) != n or len(it) != n:
            raise BadEntry("analysis columns: not this trace's lengths")
        # keys: strictly increasing, each a stack id (or -1) and a ranges context; every
        # block's index within them; phases of the vocabulary; iterations from -1 up by steps
        # of at most 1 (each iteration one contiguous slice, as `phases.timeline` reads them)
        if len(keys) and not (np.all(np.diff(keys) > 0) and keys[0] >= -n_ctx
                              and keys[-1] < len(snap.stacks) * n_ctx) or \
                m and not (info.min() >= 0 and info.max() < len(keys)) or \
                n and not (known[ph.astype(np.int64) + 128].all() and -1 <= it[0] <= 0
                           and (it[1:] - it[:-1] <= 1).all() and (it[1:] >= it[:-1]).all()):
            raise BadEntry("analysis columns: a key, block, phase or iteration out of range")
        cols_out[t.device] = cols
    return out, cols_out


def _rank(provenance: dict, source: str) -> int | None:
    from snapforensics.snapshot.format import rank_from_name

    rank = provenance.get("rank")
    return rank if type(rank) is int and 0 <= rank < (1 << 31) else rank_from_name(source)


# ------------------------------------------------------------------------------- validation

# A document is tens of kB (a 1,000-device run's a few MB): a bigger entry is not one of ours.
DOC_MAX = 64 << 20
REQUIRED = {"peaks": ("forward_bytes", "backward_bytes", "overall_bytes"),
            "segments": ("allocated_bytes", "reserved_bytes", "count")}


def _parse(f: IO[bytes]) -> Diagnosis:
    try:
        doc = orjson.loads(f.read())
    except (OSError, orjson.JSONDecodeError) as e:
        raise BadEntry(f"not JSON: {e}") from None
    return validate(doc)


def validate(doc: Any) -> Diagnosis:
    """The Diagnosis a document describes when every field has the type it declares; BadEntry
    for anything else."""
    if type(doc) is not dict:
        raise BadEntry("not an object")
    _fields(Diagnosis, doc, skip={"devices", "findings"})
    for name, cls in (("devices", DeviceSummary), ("findings", Finding)):
        items = doc.get(name)
        if type(items) is not list or not all(type(x) is dict for x in items):
            raise BadEntry(f"{name}: not a list of objects")
        for x in items:
            _fields(cls, x)
    if not all("plot" in x for x in doc["devices"]):  # null, or checked by from_dict
        raise BadEntry("DeviceSummary.plot: missing")
    try:  # the plot series too (`Series.from_doc`)
        return Diagnosis.from_dict(doc)
    except (ValueError, TypeError, KeyError) as e:
        raise BadEntry(f"{type(e).__name__}: {e}") from None


def _fields(cls: type, d: dict, skip: frozenset | set = frozenset()) -> None:
    for fl in fields(cls):
        if fl.metadata.get("json") is False or fl.name in skip:
            continue
        if fl.name not in d:
            raise BadEntry(f"{cls.__name__}.{fl.name}: missing")
        v = d[fl.name]
        if not _is(v, str(fl.type)):
            raise BadEntry(f"{cls.__name__}.{fl.name}: not {fl.type}")
        need = REQUIRED.get(fl.name)
        if need and not all(k in v for k in need):
            raise BadEntry(f"{cls.__name__}.{fl.name}: lacks {need}")


_SIMPLE: dict[str, Any] = {"str": (str,), "int": (int,), "float": (float, int),
                           "bool": (bool,), "None": (type(None),)}
_VERDICTS = {v.value for v in Verdict}


def _split(s: str, sep: str) -> list[str]:
    """`s` split at `sep` outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "["
        depth -= ch == "]"
        if ch == sep and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()]


def _is(v: Any, ann: str) -> bool:
    """Whether the JSON value `v` has the type the annotation text `ann` names."""
    alts = _split(ann, "|")
    if len(alts) > 1:
        return any(_is(v, a) for a in alts)
    if ann == "Any":
        return True
    if ann in _SIMPLE:
        return type(v) in _SIMPLE[ann] and not (ann == "int" and type(v) is bool)
    if ann == "Verdict":
        return v in _VERDICTS
    m = re.fullmatch(r"(\w+)\[(.*)\]", ann)
    head, args = (m.group(1), _split(m.group(2), ",")) if m else (ann, [])
    if head == "list":
        return type(v) is list and (not args or all(_is(x, args[0]) for x in v))
    if head == "dict":
        return type(v) is dict and (not args or all(
            _is(k, args[0]) and _is(x, args[1]) for k, x in v.items()))
    if head == "tuple":
        return type(v) is list
    return False  # a type this checker does not know: never trusted


__all__ = ["diagnose", "validate"]
