"""Renderers on real snapshots: every format says the same thing, the HTML is safe and offline."""

from __future__ import annotations

import dataclasses
import html as htmllib
import json
import os
import re
import subprocess
import sys
from functools import cache
from html.parser import HTMLParser
from pathlib import Path

import orjson
import pytest
from mdtext import rendered_text

from snapforensics.analysis import Finding, diagnose
from snapforensics.analysis.rules import allocator_fragmentation
from snapforensics.report import FORMATS, render_text
from snapforensics.report.common import headline, human, peak_line
from snapforensics.snapshot import load, normalize, read_raw

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("SNAPFORENSICS_CORPUS") or REPO.parent / "shared" / "corpus")

FWD_BWD = "NiuHuangxiaozi_fwd_bwd_200_mixed.pickle"  # 3 iterations, forward + backward
SEGMENTS_ONLY = "Charran78_dump_snapshot.pickle"  # no history: segments alive at dump only
EMPTY = "SunnySood80_dump_snapshot.pickle"  # 0 segments, 4 empty trace lists
TRUNCATED = "MAGMA27_memory_snapshot.pickle"  # ring buffer wrapped: a truncation warning
MULTI = "MemSnapDump_snapshot_with_multi_devices.pkl"  # two devices
CASES = [FWD_BWD, SEGMENTS_ONLY, EMPTY, TRUNCATED, MULTI]

PAYLOAD = "<script>alert(1)</script>"
ATTR_PAYLOAD = '"><img src=x onerror=alert(1)>'
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


def corpus_file(name: str) -> Path:
    p = CORPUS / name
    if not p.is_file():
        pytest.skip(f"corpus file {p} absent (set SNAPFORENSICS_CORPUS)")
    return p


@cache
def _diagnosed(name: str):
    return diagnose(load(corpus_file(name)))


def diagnosed(name: str):
    corpus_file(name)  # skip (not cache a failure) when absent
    return _diagnosed(name)


def as_json(d) -> object:
    """What the JSON contract holds for `d`, as plain Python."""
    return orjson.loads(orjson.dumps(d.to_dict(), option=orjson.OPT_NON_STR_KEYS))


class StrictParser(HTMLParser):
    """Records tags, attributes and the diagnosis script; fails on any mis-nested element."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str, str | None]] = []
        self.scripts: list[tuple[dict, str]] = []
        self._in_script: dict | None = None
        self.doctype = False

    def handle_decl(self, decl: str) -> None:
        self.doctype = self.doctype or decl.lower() == "doctype html"

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        self.attrs += [(tag, k, v) for k, v in attrs]
        if tag == "script":
            self._in_script = dict(attrs)
            self.scripts.append((self._in_script, ""))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs) -> None:
        self.tags.append(tag)
        self.attrs += [(tag, k, v) for k, v in attrs]

    def handle_endtag(self, tag) -> None:
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'} "
                               f"at {self.getpos()}")
            if tag in self.stack:
                while self.stack.pop() != tag:
                    pass
            return
        self.stack.pop()
        if tag == "script":
            self._in_script = None

    def handle_data(self, data) -> None:
        if self._in_script is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)


def parse(doc: str) -> StrictParser:
    p = StrictParser()
    p.feed(doc)
    p.close()
    assert p.doctype, "no <!DOCTYPE html>"
    assert not p.errors, p.errors[:5]
    assert not p.stack, f"unclosed elements: {p.stack}"
    return p


def check_offline(p: StrictParser, doc: str) -> None:
    for tag, k, v in p.attrs:
        if k in ("src", "href", "xlink:href", "action", "srcset", "poster", "data"):
            assert not re.match(r"\s*(https?:)?//", v or "", re.I), f"<{tag} {k}={v!r}>"
            assert not (v or "").lower().startswith(("javascript:", "data:")), f"<{tag} {k}={v!r}>"
        assert not k.startswith("on"), f"event handler attribute <{tag} {k}>"
    for tag in ("link", "img", "iframe", "object", "embed", "base", "image", "use"):
        assert tag not in p.tags, f"<{tag}> in a self-contained report"
    assert "@import" not in doc and "url(" not in doc
    # scripts: the embedded diagnosis, one data block per plot, and the plot's own code (a
    # constant: nothing from the snapshot is ever in executable script)
    from snapforensics.report import plot

    kinds = [a.get("id") or a.get("class") or "code" for a, _ in p.scripts]
    assert kinds.count("diagnosis") == 1
    assert set(kinds) <= {"diagnosis", "sf-data", "code"}
    for attrs, text in p.scripts:
        if "type" in attrs:
            assert attrs["type"] == "application/json"
        else:
            assert text == plot.JS
    assert kinds.count("code") == (1 if "sf-data" in kinds else 0)  # only where a plot is


def embedded_json(p: StrictParser) -> object:
    (attrs, text), = [s for s in p.scripts if s[0].get("id") == "diagnosis"]
    return json.loads(text)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_renders(name, fmt):
    d = diagnosed(name)
    out = render_text(d, fmt)
    if fmt == "json":
        assert json.loads(out)["findings"] == [f.to_dict() for f in d.findings]
        assert all("replay" not in f for f in json.loads(out)["findings"])
        assert all("plot" not in dev for dev in json.loads(out)["devices"])
        return
    text = htmllib.unescape(out) if fmt == "html" else rendered_text(out) \
        if fmt == "markdown" else " ".join(out.split())
    # every human format leads with the same headline and names every finding's rule
    assert " ".join(headline(d).split()) in (text if fmt != "html" else " ".join(text.split()))
    for f in d.findings:
        assert f.rule in out


@pytest.mark.parametrize("name", CASES)
def test_formats_agree_on_the_peak(name):
    d = diagnosed(name)
    figure = human(d.peaks["overall_bytes"])
    md, term, page = (render_text(d, f) for f in ("markdown", "terminal", "html"))
    for fmt, text in (("markdown", md), ("terminal", term), ("html", page)):
        assert figure in text, f"{fmt} does not say the overall peak {figure}"
    assert peak_line(d) in md and htmllib.escape(peak_line(d)) in page
    data = json.loads(render_text(d, "json"))
    assert human(data["peaks"]["overall_bytes"]) == figure
    assert data["peaks"] == d.peaks


@pytest.mark.parametrize("name", CASES)
def test_html_is_wellformed_offline_and_embeds_the_diagnosis(name):
    d = diagnosed(name)
    doc = render_text(d, "html")
    p = parse(doc)
    check_offline(p, doc)
    assert embedded_json(p) == as_json(d)
    for w in d.warnings:  # warnings shown, not only buried in the JSON
        assert htmllib.escape(w) in doc


def test_html_fwd_bwd_report_content_and_size():
    d = diagnosed(FWD_BWD)
    doc = render_text(d, "html")
    dev = d.devices[0]
    # bounded by the plot's points, not by the trace: one polygon per category, each with at
    # most POINTS + 2 vertices
    from snapforensics.analysis.timeline import POINTS

    polys = re.findall(r'<polygon points="([^"]*)"', doc)
    assert len(polys) == len(dev.plot.categories)
    assert all(len(pts.split()) <= POINTS + 2 for pts in polys)
    # the diagnosis JSON, CSS and script (~70 kB), the hover's fixed part per plot (~100 kB)
    # and ~30 kB per category (its polygon and its series in the hover)
    assert len(doc.encode()) < 170_000 + 30_000 * len(polys)
    assert len(dev.timeline) > 100 and len(dev.iterations) == 3
    assert doc.count("<svg") == 1 and "<polyline" in doc  # the reserved line (CUDA file)
    for phase in {p[2] for p in dev.timeline}:  # a legend entry per phase shaded
        assert f">{phase}</span>" in doc
    assert f"peak {human(dev.peaks['overall_bytes'])}" in doc
    for it in dev.iterations:
        assert human(it["forward_peak_bytes"]) in doc and human(it["backward_peak_bytes"]) in doc
    for cat, b in dev.categories_at_peak.items():
        assert f"<div>{cat}</div>" in doc and human(b) in doc
    assert doc.count("<details") >= len(dev.top_stacks_at_peak)
    assert htmllib.escape(dev.top_stacks_at_peak[0]["stack"][0]) in doc
    if d.findings:
        assert all(f.rule in doc for f in d.findings)
    else:
        assert "No findings" in doc


def test_html_segments_only_and_empty():
    seg = render_text(diagnosed(SEGMENTS_ONLY), "html")
    assert "<svg" not in seg and "No allocation history on this device" in seg
    empty_d = diagnosed(EMPTY)
    assert not empty_d.devices
    empty = render_text(empty_d, "html")
    assert "empty snapshot: nothing was allocated" in empty and "<svg" not in empty


def test_html_multi_device_has_one_chart_each():
    d = diagnosed(MULTI)
    doc = render_text(d, "html")
    charted = [dev for dev in d.devices if dev.timeline]
    assert len(d.devices) >= 2 and doc.count("<svg") == len(charted)
    for dev in d.devices:
        assert f'id="device-{dev.device}"' in doc


def _poison(obj) -> int:
    """Rename every Python frame in a raw snapshot to an XSS payload."""
    n = 0
    if isinstance(obj, dict):
        if isinstance(obj.get("name"), str) and str(obj.get("filename", "")).endswith(".py"):
            obj["name"] = PAYLOAD
            obj["filename"] = f"/x/{ATTR_PAYLOAD}/{PAYLOAD}.py"
            return 1
        for v in obj.values():
            n += _poison(v)
    elif isinstance(obj, list):
        for v in obj:
            n += _poison(v)
    return n


def test_html_escapes_hostile_snapshot_strings():
    raw, warnings = read_raw(corpus_file(FWD_BWD))
    assert _poison(raw) > 100
    raw["snapforensics"] = {"command": ["python", PAYLOAD, ATTR_PAYLOAD],
                            "hostname": PAYLOAD, "stacks": ATTR_PAYLOAD, "rank": 0}
    d = diagnose(normalize(raw, source=f"/tmp/{PAYLOAD}{ATTR_PAYLOAD}.pickle",
                           warnings=warnings))
    # the payload reached the report (else this test proves nothing) ...
    assert any(PAYLOAD in line for s in d.devices[0].top_stacks_at_peak for line in s["stack"])
    d = dataclasses.replace(d, warnings=d.warnings + [PAYLOAD], findings=[Finding(
        rule=PAYLOAD, verdict="anomalous", title=PAYLOAD, cause=ATTR_PAYLOAD, bytes=1 << 20,
        blocks=1, device=0, fix=f"x = '{PAYLOAD}'", predicted_peak_bytes=1 << 19,
        saving_bytes=1 << 19,
        evidence={"modules": [{"module": PAYLOAD, "bytes": 1 << 20, "blocks": 1}],
                  "stacks": d.devices[0].top_stacks_at_peak[:1], PAYLOAD: PAYLOAD})])
    doc = render_text(d, "html")
    # ... and came out only escaped
    assert htmllib.escape(PAYLOAD) in doc
    low = doc.lower()
    assert "<script>alert" not in low and "<img" not in low
    p = parse(doc)  # check_offline: no on* attribute, no <img>, one script (the JSON)
    check_offline(p, doc)
    assert embedded_json(p) == as_json(d)


def test_html_findings_sorted_by_verdict_with_evidence():
    d = diagnosed(FWD_BWD)
    dev = d.devices[0]
    stack = dev.top_stacks_at_peak[0]

    def finding(verdict, title, nbytes, **kw):
        return Finding(rule=f"test.{verdict}", verdict=verdict, title=title, cause=f"cause {title}",
                       bytes=nbytes, blocks=3, device=dev.device, **kw)

    d = dataclasses.replace(d, findings=[
        finding("info", "an info note", 10),
        finding("expected", "expected growth", 1 << 20,
                evidence={"modules": [{"module": "layers.1", "bytes": 1 << 20, "blocks": 3}]}),
        finding("anomalous", "a leak", 300 << 20, fix="model.set_reshard_after_backward(True)",
                predicted_peak_bytes=dev.peaks["overall_bytes"] - (300 << 20),
                saving_bytes=300 << 20,
                evidence={"modules": [{"module": "layers.0.attn", "bytes": 300 << 20,
                                       "blocks": 3}],
                          "stacks": [stack], "by_path": {"recompute": 300 << 20},
                          "iteration": 1}),
    ])
    doc = render_text(d, "html")
    parse(doc)
    body = doc[doc.index('id="findings"'):]
    pos = [body.index(f'<span class="badge {v}">{v.upper()}</span>{t}')
           for v, t in (("anomalous", "a leak"), ("expected", "expected growth"),
                        ("info", "an info note"))]
    assert pos == sorted(pos)
    assert "test.anomalous" in body and "<code>layers.0.attn</code>" in body
    assert '<pre class="fix"><code>model.set_reshard_after_backward(True)</code></pre>' in body
    assert "predicted peak after the fix: " + human(dev.peaks["overall_bytes"] - (300 << 20)) \
        in body
    assert htmllib.escape(stack["stack"][0]) in body
    assert "1 anomaly found: a leak" in doc


def test_cli_diagnose_html(tmp_path):
    src = corpus_file(FWD_BWD)
    out = tmp_path / "out.html"
    r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(src),
                        "--format", "html", "-o", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = out.read_text(encoding="utf-8")
    p = parse(doc)
    check_offline(p, doc)
    assert embedded_json(p)["peaks"] == diagnosed(FWD_BWD).peaks
    assert not list(tmp_path.glob("*.tmp"))


# ------------------------------------------------------------ headline and order by saving

FIXTURE = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"


@cache
def fixture_diagnosis():
    return diagnose(load(FIXTURE))


def with_findings(*findings):
    return dataclasses.replace(fixture_diagnosis(), findings=list(findings))


def made(verdict, title, nbytes, saving=None, rule=None, **kw):
    return Finding(rule=rule or f"test.{title.replace(' ', '_')}", verdict=verdict, title=title,
                   cause="cause", bytes=nbytes, blocks=1, device=0, saving_bytes=saving, **kw)


def test_every_format_ranks_findings_by_peak_saving():
    """A big block count that saves little comes after a small one that saves much: the
    headline and every format's order compare saving with saving, not bytes with saving."""
    big = made("anomalous", "big but cheap to keep", 300 << 20, saving=10 << 20)
    small = made("anomalous", "small but on the peak", 10 << 20, saving=100 << 20)
    d = with_findings(big, small)
    peak = d.peaks["overall_bytes"]
    assert headline(d) == (f"2 anomalies found: small but on the peak, fixing it saves "
                           f"~100.0 MiB ({100 * (100 << 20) / peak:.0f}% of the allocated peak)")
    for fmt in ("terminal", "markdown", "html"):
        out = render_text(d, fmt)
        text = rendered_text(out) if fmt == "markdown" else out
        body = text[text.index(headline(d)) + len(headline(d)):]
        assert body.index("small but on the peak") < body.index("big but cheap to keep"), fmt


def test_headline_names_a_large_info_saving():
    peak = fixture_diagnosis().peaks["overall_bytes"]
    d = with_findings(made("info", "checkpoint the blocks", peak // 2, saving=peak // 4),
                      made("expected", "sharded grads", peak))
    assert headline(d) == ("no anomaly; checkpoint the blocks would save "
                           f"~{human(peak // 4)} (25% of the allocated peak)")
    small = with_findings(made("info", "tiny", 1 << 20, saving=peak // 10))
    assert headline(small) == "no anomaly found"  # under a fifth of the peak
    for fmt in ("terminal", "markdown", "html"):
        assert "checkpoint the blocks would save" in render_text(d, fmt)


def test_reserved_savings_are_labelled_reserved():
    """Fragmentation saves reserved memory: its share is of the reserved peak, and says so."""
    res = 400 << 20
    frag = made("anomalous", "fragmentation", 100 << 20, saving=100 << 20,
                rule=allocator_fragmentation.RULE.id, evidence={"reserved_peak_bytes": res})
    d = with_findings(frag)
    assert headline(d).endswith("fixing it saves ~100.0 MiB (25% of the reserved peak)")
    assert "25% of the reserved peak" in render_text(d, "terminal")
