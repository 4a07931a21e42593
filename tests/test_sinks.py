"""A stranger's strings reach every sink neutralized, and reports are written safely.

Hostile strings (terminal escapes, OSC 8 links and OSC 52 clipboard writes, C1 controls, bidi
overrides, rich markup, a newline + fence + heading, table pipes, HTML) are planted in a real
recording (fixtures/, read raw, edited, normalized): in frame names and file names, in the
FSDP module names the annotations carry, in provenance and in the source path. Then every
format of diagnose and compare is rendered and checked by what would read it: the terminal
(bytes), a Markdown parser (markdown-it-py, which rich uses), an HTML parser, a JSON parser.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from functools import cache
from html.parser import HTMLParser
from pathlib import Path

import pytest
from mdtext import rendered_text, tokens

from snapforensics.analysis import Finding, diagnose
from snapforensics.analysis.compare import compare
from snapforensics.analysis.fleet import fleet
from snapforensics.analysis.forecast.core import forecast
from snapforensics.analysis.gate import compare_runs
from snapforensics.analysis.rules import fsdp_reshard
from snapforensics.report import plot, render
from snapforensics.report.registry import RENDERERS, Screen, formats
from snapforensics.snapshot import graph_code, load, normalize, read_raw, tensors

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
FIXED = REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"

ESCAPES = ("\x1b[2J\x1b[H"  # clear screen
           "\x1b]0;pwned-title\x07"  # window title
           "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"  # OSC 8 hyperlink
           "\x1b]52;c;cm0gLXJmIH4=\x07"  # OSC 52 clipboard write
           "\x9b31m\u202etxt.exe")  # C1 CSI, right-to-left override
MARKUP = "[link=https://evil.example]rich-link[/link][/][bold red]"
FENCE = "\n```\n# INJECTED heading\n<script>alert(1)</script>\n[md-link](https://evil.example)\n"
HTML = '<script>alert(1)</script>"><img src=x onerror=alert(1)>'
HOSTILE = ESCAPES + MARKUP + "|`pipe`|" + FENCE + HTML
# module names come from `FSDP::... (fqn)` annotations, matched up to the line end: no newline
MODULE = "layers.0|evil|" + ESCAPES + MARKUP + "`tick`" + HTML
SITE = "/home/someone/venv/lib/python3.12/site-packages/"


def _edit(raw: dict) -> int:
    """Plant the strings: a hostile frame on top of every stack, the example script's file
    renamed, `layers.0` renamed in frames and annotations, provenance poisoned."""
    n, seen = 0, set()  # the unpickled file shares frame lists and dicts: edit each once
    top = {"filename": f"/x/{HOSTILE}.py", "line": 1, "name": HOSTILE}
    for trace in raw["device_traces"]:
        for i, e in enumerate(trace):
            if i % 7 == 0:  # a torch.compile region named by the file (compiled.py's table)
                e["compile_context"] = "Torch-Compiled Region: " + HOSTILE
            frames = e.get("frames") or []
            if not frames or id(frames) in seen:
                continue
            seen.add(id(frames))
            for fr in frames:
                if id(fr) not in seen:
                    seen.add(id(fr))
                    fr["name"] = fr["name"].replace("(layers.0)", f"({MODULE})")
                    if fr["filename"].startswith("torch/"):
                        fr["filename"] = SITE + fr["filename"]
            frames.insert(0, top)
            n += 1
    for a in raw.get("external_annotations", []):
        a["name"] = a["name"].replace("(layers.0)", f"({MODULE})")
    raw["snapforensics"].update(command=["python", HOSTILE, "--lr", MARKUP], stacks=HOSTILE,
                                hostname=HOSTILE, torch_version=ESCAPES)
    raw[tensors.KEY] = _names(raw["device_traces"][0])
    # the recorder's map of Inductor's generated code: the planted frame is a generated module
    # whose line 1 allocates a hostile buffer, from a hostile model line (compiled.py's table)
    raw[graph_code.KEY] = {
        "format": graph_code.FORMAT, "stacks": [[[f"/x/{HOSTILE}.py", 2, HOSTILE, HOSTILE]]],
        "files": [{"path": top["filename"], "starts": [0], "stacks": [0],
                   "allocs": [[1, "buf" + HOSTILE, -1, 1]]}], "errors": [HOSTILE]}
    return n


def _names(trace: list) -> dict:
    """The recorder's tensor names, hostile (tensor, module, dtype): every block of device 0
    named at its allocation, as a saved activation or a parameter (both tables render)."""
    ids = [[f"layers.0.{MODULE}.weight", "parameter", MODULE, [4, 4], HOSTILE, 0, 2],
           [None, "saved_for_backward", f"layers.0.{MODULE}", [8], HOSTILE, 0, 0]]
    allocs = [e for e in trace if e.get("action") == "alloc" and "time_us" in e]
    return {"format": tensors.FORMAT, "clock": "epoch_us", "kinds": list(tensors.KINDS),
            "identities": ids, "ptr": [e["addr"] for e in allocs], "offset": [0] * len(allocs),
            "nbytes": [e["size"] for e in allocs], "time_us": [e["time_us"] for e in allocs],
            "identity": [i % 2 for i in range(len(allocs))]}


@cache
def hostile_snapshot():
    raw, warnings = read_raw(FIXTURE)
    assert _edit(raw) > 100
    return normalize(raw, source=f"/tmp/{ESCAPES}{MARKUP}{HTML}.pickle", warnings=warnings)


@cache
def hostile():
    d = diagnose(hostile_snapshot())
    # planted strings also as a finding's own words (title, cause, fix, rule) and a warning
    extra = Finding(rule="test." + ESCAPES + MARKUP, verdict="info", title=HOSTILE, cause=HOSTILE,
                    bytes=1 << 20, blocks=1, device=0, fix=f"x = {HOSTILE!r}\n" + HOSTILE,
                    evidence={"modules": [{"module": MODULE, "bytes": 1 << 20, "blocks": 1}],
                              HOSTILE: HOSTILE})
    return dataclasses.replace(d, warnings=[*d.warnings, HOSTILE],
                               findings=[*d.findings, extra])


def test_the_strings_reached_the_diagnosis():
    """Else the rest proves nothing: the edited recording still diagnoses the same bug, and
    the planted module name is in its evidence, the planted frame in its stacks."""
    d = hostile()
    (f,) = [f for f in d.anomalies if f.rule == fsdp_reshard.RULE.id]
    assert MODULE in {m["module"] for m in f.evidence["modules"]}
    assert HOSTILE in d.devices[0].top_stacks_at_peak[0]["stack"][0]
    assert any(SITE in line for s in d.devices[0].top_stacks_at_peak for line in s["stack"])
    names = d.devices[0].tensors
    assert names.get("recorded") is True and names.get("saved_by_layer"), names.keys()
    assert any(MODULE in m[0] for r in names["saved_by_layer"] for m in r["modules"])
    assert any(HOSTILE == r["dtype"] for r in names["largest_at_peak"])
    regions = d.devices[0].compiled["regions"]
    assert any(r["region"] == HOSTILE and HOSTILE in r["source"] for r in regions), regions
    lines = d.devices[0].compiled["lines"]
    assert any(HOSTILE in r["line"] and "buf" + HOSTILE in r["buffers"] for r in lines), lines
    assert d.devices[0].compiled["map_notes"] == [HOSTILE[:300]]


# ------------------------------------------------------------------------------- terminal

CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
SGR = re.compile(r"\x1b\[[0-9;]*m")  # colours and bold: the only escapes we emit


KINDS = ["diagnosis", "compare", "compare_runs", "fleet", "forecast", "pipeline_forecast"]


@cache
def document(kind: str):
    """Each document kind of the registry, made from the planted recording."""
    if kind == "forecast":
        f = forecast(hostile_snapshot(), world_sizes=[4, 8])
        f.notes.append(HOSTILE)
        return f
    if kind == "pipeline_forecast":
        # its strings from outside: the path given, notes quoting it; the rest is numbers
        return _pipeline_document()
    d, fixed = hostile(), diagnose(load(FIXED))
    if kind == "compare":
        return compare([d, fixed])
    if kind == "compare_runs":
        return compare_runs(f"/a/{HTML}{ESCAPES}", f"/b/{MARKUP}", [d], [fixed])
    if kind == "fleet":
        # documents as workers send them: the hostile rank's plot series travel too
        return fleet([d.to_doc(), dataclasses.replace(fixed, rank=1).to_doc()])
    return d


def _pipeline_document():
    from snapforensics.analysis.forecast.pipeline import PipelineForecast

    stage = {"stage": 0, "source_stage": 0, "layers": 2, "held_microbatches": 4,
             "predicted_peak_bytes": 1 << 20, "refused": None}
    band = {"low": -0.03, "high": 0.04, "pairs": 56, "validated": False,
            "not_validated": [HOSTILE], "exact": False}
    return PipelineForecast(f"/runs/{HOSTILE}", {
        "stages": 2, "microbatches": 8, "schedule": "gpipe", "layers": 4, "stage_files": [0],
        "peaks": {"0": 1 << 21}}, [{"stages": 4, "microbatches": 8, "schedule": "1f1b",
                                     "worst_stage": 0, "worst_peak_bytes": 1 << 20,
                                     "error_band": band, "per_stage": [stage]}], [HOSTILE])


def test_the_registry_has_no_kind_this_file_does_not_plant():
    assert set(RENDERERS) == set(KINDS)


@pytest.fixture(params=KINDS)
def kind_doc(request):
    return request.param, document(request.param)


def test_terminal_plain_has_no_control_byte_and_no_live_markup(kind_doc):
    kind, doc = kind_doc
    out = render(kind, doc, "terminal", Screen(width=1000))  # nothing folded
    assert not CONTROL.findall(out), sorted(set(CONTROL.findall(out)))
    assert "\\x1b]52;c;" in out and "\\u202e" in out  # shown, visibly
    assert MARKUP in out  # rich markup printed as text, not applied ("[/]" would raise)


def test_terminal_colour_emits_only_our_colour_codes(kind_doc):
    kind, doc = kind_doc
    out = render(kind, doc, "terminal", Screen(width=1000, color_system="truecolor"))
    assert SGR.search(out), "colours are on"
    rest = SGR.sub("", out)
    assert not CONTROL.findall(rest), sorted(set(CONTROL.findall(rest)))
    assert "\x1b]" not in out  # no OSC at all: no title, hyperlink or clipboard write
    assert MARKUP in rest


def test_terminal_fix_is_whole_lines_outside_any_border_at_80_columns():
    d = hostile()
    f = next(f for f in d.anomalies if f.fix)
    long_line = "model.set_reshard_after_backward(True)  # " + "x" * 100  # wider than 80
    d = dataclasses.replace(d, findings=[dataclasses.replace(f, fix=f.fix + "\n" + long_line)])
    out = render("diagnosis", d, "terminal", Screen(width=80))
    lines = out.splitlines()
    for code in [*f.fix.splitlines(), long_line]:
        assert code in lines, f"fix line cut, wrapped or framed: {code!r}"
    assert not any(c in out for c in "╭╮╰╯┌┐└┘"), "no box around the fix"


def test_terminal_shortens_site_packages_paths():
    d = hostile()
    out = render("diagnosis", d, "terminal", Screen(width=200))
    assert "site-packages" not in out
    assert "torch/distributed/fsdp/" in out


def test_terminal_numbers_are_not_half_highlighted():
    d = diagnose(load(FIXTURE))
    out = render("diagnosis", d, "terminal", Screen(width=120, color_system="truecolor"))
    ratio = re.search(r"backward/forward (\d+\.\d+x)", SGR.sub("", out))[1]
    assert f"backward/forward {ratio}" in out  # no escape code inside the figure


# ------------------------------------------------------------------------------- markdown

OUR_HEADINGS = re.compile(r"^(snapforensics (diagnosis|compare|forecast|fleet)|Ranks, worst first|"
                          r"Findings by rank|Device \d+|Findings|Peaks|The worst rank's timeline|"
                          r"Alive at the peak|Prediction check|Imbalance|Tensor names|"
                          r"\[(ANOMALOUS|EXPECTED|INFO)\] )")


def test_markdown_structure_comes_only_from_us(kind_doc):
    kind, doc = kind_doc
    md = render(kind, doc, "markdown")
    toks = tokens(md)
    every = [*toks, *(c for t in toks for c in t.children or [])]
    assert not [t for t in every if t.type == "link_open"]
    # our own HTML: a collapsed stack's <details><summary> (summary text HTML-escaped)
    ours = re.compile(r"\s*(<details><summary>[^<>]*</summary>|</details>)\s*")
    html_tokens = [t.content for t in every if t.type in ("html_block", "html_inline")]
    assert all(ours.fullmatch(x) for x in html_tokens), html_tokens
    # our own image: the plot written beside the report
    images = [t.attrGet("src") for t in every if t.type == "image"]
    assert all(re.fullmatch(r"[\w.-]+\.png", x or "") for x in images), images
    for i, t in enumerate(toks):
        if t.type == "heading_open":
            title = toks[i + 1].content
            assert OUR_HEADINGS.match(rendered_text(title)), title
    assert not CONTROL.findall(md)
    # the planted fence + heading lines stay inside our code blocks: each raw occurrence in
    # the file is inside a fence token (outside code they are escaped: `\# INJECTED`)
    raw = len(re.findall(r"(?<!\\)# INJECTED", md))
    fenced = sum(t.content.count("# INJECTED") for t in toks if t.type == "fence")
    assert raw == fenced and (kind != "diagnosis" or fenced >= 2)


def test_markdown_pipes_do_not_shift_table_cells():
    md = render("diagnosis", hostile(), "markdown")
    toks = tokens(md)
    cells, row = [], []
    for t in toks:
        if t.type == "tr_open":
            row = []
        elif t.type == "inline" and row is not None:
            row.append(rendered_text(t.content) if "\\" in t.content else t.content)
        if t.type == "tr_close":
            cells.append(row)
            row = None
    planted = [r for r in cells if r and r[0].startswith("layers.0|evil|")]
    assert planted, "the planted module is a table row"
    for r in planted:
        assert len(r) == 3 and re.fullmatch(r"[\d.]+ [KMG]?i?B", r[1]), r


# ----------------------------------------------------------------------------------- html

class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[str] = []
        self.scripts: list[tuple[str | None, str]] = []  # (type, code)
        self.in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [k for k, _ in attrs]
        if tag == "script":
            self.scripts.append((dict(attrs).get("type"), ""))
            self.in_script = True

    def handle_endtag(self, tag):
        self.in_script = self.in_script and tag != "script"

    def handle_data(self, data):
        if self.in_script:
            kind, code = self.scripts[-1]
            self.scripts[-1] = (kind, code + data)


def test_html_escapes_every_planted_string(kind_doc):
    kind, doc = kind_doc
    if "html" not in formats(kind):
        pytest.skip(f"{kind} has no html report")
    page = render(kind, doc, "html")
    p = Tags()
    p.feed(page)
    # scripts: JSON data, or the plot's own hover code; never a planted one; no image
    for kind_, code in p.scripts:
        assert kind_ == "application/json" or code == plot.JS, code[:200]
    assert "img" not in p.tags
    assert not [a for a in p.attrs if a.startswith("on")]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


# ----------------------------------------------------------------------------------- json

def strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from strings(k)
            yield from strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from strings(x)


def test_json_is_exact(kind_doc):
    kind, doc = kind_doc
    back = json.loads(render(kind, doc, "json"))
    assert back == json.loads(json.dumps(doc.to_dict(), default=str))
    assert any(ESCAPES + MARKUP in s for s in strings(back))  # byte for byte


# ----------------------------------------------------------------------------- sizes

def test_report_size_does_not_follow_the_longest_string():
    """A 1 MB frame name and module name: every human report stays the size it was."""
    d = hostile()
    huge = "A" * 1_000_000
    many = [huge[:200_000]] * 60  # more warnings than are shown; the JSON keeps all 12 MB
    f = d.anomalies[0]
    stacks = [dict(s, stack=[huge, *s["stack"]]) for s in f.evidence["stacks"]]
    big = dataclasses.replace(d, findings=[dataclasses.replace(f, title=huge, cause=huge, evidence={
        **f.evidence, "stacks": stacks, "modules": [{"module": huge, "bytes": 1, "blocks": 1}]})],
        warnings=many)
    for fmt in ("terminal", "markdown", "html"):
        out = render("diagnosis", big, fmt)
        if fmt == "html":  # the embedded JSON is exact by contract; the page around it is not
            out = out[:out.index('<script type="application/json"')]
        assert len(out) < 300_000, (fmt, len(out))  # ~1 GB if each copy were shown whole
        flat = " ".join(out.split())
        assert "(1,000,000 chars)" in flat and re.search(r"\(200,0\d\d chars\)", flat)


# ------------------------------------------------------------------------ safe writes (CLI)

@pytest.fixture
def cli(capsys):
    """The CLI in this process (main() as the entry point runs it), for speed; the stdout
    cases that need a real file descriptor run it as a subprocess below."""
    from snapforensics.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        with pytest.raises(SystemExit) as e:
            main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, e.value.code, out, err)
    return run


def one_line_exit_2(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("snapforensics: error:"), r.stderr


@pytest.mark.parametrize("make", ["fifo", "directory", "device", "symlink-to-fifo", "empty"])
def test_output_that_is_not_a_regular_file_is_refused(cli, tmp_path, make):
    target = tmp_path / "out.md"
    if make == "fifo":
        os.mkfifo(target)
    elif make == "directory":
        target.mkdir()
    elif make == "device":
        target = Path(os.devnull)
    elif make == "symlink-to-fifo":
        os.mkfifo(tmp_path / "fifo")
        target.symlink_to(tmp_path / "fifo")
    r = cli("diagnose", str(FIXTURE), "-o", "" if make == "empty" else str(target))
    one_line_exit_2(r)
    if make in ("fifo", "symlink-to-fifo"):
        assert Path(os.path.realpath(target)).is_fifo()  # left as it was
    assert not list(tmp_path.glob(".snapforensics-*"))


def test_planted_temp_symlink_is_not_followed(cli, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "out.md.tmp").symlink_to(victim)  # the old fixed temp name
    r = cli("diagnose", str(FIXTURE), "-o", str(tmp_path / "out.md"))
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "keep me"
    assert (tmp_path / "out.md").read_text().startswith("# snapforensics diagnosis")
    assert not list(tmp_path.glob(".snapforensics-*"))


def test_output_replaces_a_regular_file_keeping_its_mode(cli, tmp_path):
    out = tmp_path / "r.json"
    out.write_text("old")
    out.chmod(0o640)
    r = cli("diagnose", str(FIXTURE), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["schema"] == "snapforensics.diagnosis/1"
    assert out.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("name,check", [
    ("r.md", lambda s: s.startswith("# snapforensics diagnosis")),
    ("r.markdown", lambda s: s.startswith("# snapforensics diagnosis")),
    ("r.json", lambda s: json.loads(s)["schema"] == "snapforensics.diagnosis/1"),
    ("r.htm", lambda s: s.startswith("<!DOCTYPE html>")),
    ("r.txt", lambda s: s.startswith("snapforensics: ") and "\x1b" not in s),
    ("report", lambda s: s.startswith("snapforensics: ") and "\x1b" not in s),
])
def test_output_format_from_the_extension(cli, tmp_path, name, check):
    r = cli("diagnose", str(FIXTURE), "-o", str(tmp_path / name))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert check((tmp_path / name).read_text())


def test_explicit_format_wins_and_unknown_extension_is_refused(cli, tmp_path):
    r = cli("diagnose", str(FIXTURE), "--format", "json", "-o", str(tmp_path / "r.md"))
    assert r.returncode == 0 and json.loads((tmp_path / "r.md").read_text())
    one_line_exit_2(cli("diagnose", str(FIXTURE), "-o", str(tmp_path / "r.pdf")))
    one_line_exit_2(cli("compare", str(FIXTURE), str(FIXED), "-o", str(tmp_path / "c.pdf")))
    assert not (tmp_path / "r.pdf").exists() and not (tmp_path / "c.pdf").exists()
    r = cli("compare", str(FIXTURE), str(FIXED), "-o", str(tmp_path / "c.html"))  # issue 9
    assert r.returncode == 0 and (tmp_path / "c.html").read_text().lower().startswith(
        "<!doctype html>")


def test_dash_is_stdout(cli):
    r = cli("compare", str(FIXTURE), str(FIXED), "-o", "-", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["schema"] == "snapforensics.compare/1"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("fmt", ["terminal", "json"])
def test_full_disk_on_stdout_is_exit_2(fmt):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(FIXTURE),
                            "--format", fmt], stdout=full, stderr=subprocess.PIPE, text=True,
                           cwd=REPO, timeout=120)
    one_line_exit_2(r)
    assert "No space left" in r.stderr


def test_closed_pipe_is_quiet():
    read, write = os.pipe()
    os.close(read)  # the reader is gone before a byte is written (`| head -0`)
    try:
        r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(FIXTURE),
                            "--format", "json"], stdout=write, stderr=subprocess.PIPE,
                           text=True, cwd=REPO, timeout=120)
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == "", (r.returncode, r.stderr)


def test_hostile_file_name_in_an_error_stays_one_line(cli, tmp_path):
    bad = tmp_path / "x\x1b]0;pwned\x07\nsecond line.pickle"
    bad.write_text("not a snapshot")
    r = cli("diagnose", str(bad))
    one_line_exit_2(r)
    assert "\x1b" not in r.stderr


def test_every_registered_format_renders_every_document():
    for kind in KINDS:
        doc = document(kind)
        for fmt in formats(kind):
            assert render(kind, doc, fmt).strip()
