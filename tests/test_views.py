"""Every view tells the same story (issue 18): the figures of a finding explained in every
format, nothing in one format contradicting another, the anomalous category among the stacks
shown at the peak. On the committed recordings of the bundled FSDP example (buggy: parameters
unsharded in backward never resharded)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from mdtext import rendered_text

from snapforensics.analysis import diagnose
from snapforensics.report import render_text
from snapforensics.report.common import human
from snapforensics.snapshot import load

REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
RULE = "fsdp.unsharded_params_not_resharded"


@cache
def buggy():
    return diagnose(load(BUGGY))


def _visible(fmt: str, text: str) -> str:
    if fmt == "markdown":
        return rendered_text(text)
    if fmt == "html":
        text = re.sub(r"<script.*?</script>", " ", text, flags=re.S)
        text = re.sub(r"<[^>]+>", " ", text).replace("&nbsp;", " ")
    return " ".join(text.split())


def test_one_account_of_the_bytes_in_every_format():
    """72.0 MiB (36 blocks), 76.0 MiB of fsdp.unsharded_param at the peak and "saves 62.0 MiB"
    were three figures with nothing relating them; each format now says how they relate."""
    d = buggy()
    f = next(x for x in d.findings if x.rule == RULE)
    dev = d.devices[0]
    at_peak = dev.categories_at_peak["fsdp.unsharded_param"]
    assert at_peak > f.bytes > f.saving_bytes  # the three differ on this run
    expect = [f"{human(f.bytes)} is the most these {f.blocks} blocks hold at once",
              f"fsdp.unsharded_param totals {human(at_peak)}",
              f"{human(at_peak - f.bytes)} of other fsdp.unsharded_param blocks",
              f"the fix saves {human(f.saving_bytes)}, less than {human(f.bytes)}",
              f"still peaks at {human(f.predicted_peak_bytes)}"]
    for fmt in ("terminal", "markdown", "html"):
        text = _visible(fmt, render_text(d, fmt))
        missing = [x for x in expect if x not in text]
        assert not missing, (fmt, missing)


def test_cpu_recording_says_the_same_about_the_allocator_everywhere():
    """HTML said "segments reserved 148.0 MiB" where Markdown said "no caching allocator"."""
    d = buggy()
    assert d.format["backend"] == "cpu"
    alive = human(d.devices[0].segments["allocated_bytes"])
    for fmt in ("markdown", "html"):
        text = _visible(fmt, render_text(d, fmt))
        assert "segments reserved" not in text, fmt
        assert f"{alive} alive at dump (no caching allocator on CPU" in text, fmt


def test_the_anomalous_category_is_among_the_stacks_shown_at_the_peak():
    """fsdp.unsharded_param ties optimizer_state as the largest category at the peak, but is
    spread over one stack per FSDP unit: the Markdown's three stacks left it out."""
    d = buggy()
    cats = d.devices[0].categories_at_peak
    top2 = sorted(cats, key=lambda c: -cats[c])[:2]
    assert "fsdp.unsharded_param" in top2
    md = render_text(d, "markdown")
    shown = re.findall(r"<details><summary>[^<]* blocks \(([\w.]+)\)</summary>",
                       md.split("## Findings")[0])
    assert len(shown) == 3 and set(top2) <= set(shown), shown
    html = render_text(d, "html")
    section = html.split("Top allocating stacks alive at the peak")[1].split("</section>")[0]
    first = re.findall(r"blocks \(([\w.]+)\)</summary>", section)[:3]
    assert set(top2) <= set(first), first


def _lab(color: str) -> tuple[float, float, float]:
    """sRGB hex -> CIE L*a*b* (D65), the textbook formulas."""
    def lin(c: float) -> float:
        return ((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92

    r, g, b = (lin(int(color[i:i + 2], 16) / 255) for i in (1, 3, 5))
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def test_category_colours_are_told_apart():
    """Every pair of built-in category colours at least 20 apart in CIE76 (about where two
    flat areas stop reading as one hue; the old teal pair sharded_grad / reduce_scatter_buffer
    was 14.9, unsharded_grad / activation 13.0)."""
    import itertools

    from snapforensics.report.plot import CATEGORY_COLORS

    close = [(a, b, round(dist, 1)) for (a, ca), (b, cb) in
             itertools.combinations(CATEGORY_COLORS.items(), 2)
             if (dist := sum((p - q) ** 2 for p, q in zip(_lab(ca), _lab(cb))) ** 0.5) < 20]
    assert not close, close


def test_html_plot_has_its_key_labels_and_ticks():
    """The phase shading has a key, iteration lines and the predicted peak after the fix are
    labelled, the time axis has enough ticks to read (it had two)."""
    d = buggy()
    s = d.devices[0].plot
    html = render_text(d, "html")
    svg = html.split('<div class="sf-plot">')[1].split("</svg>")[0]
    ticks = re.findall(r'<text [^>]*text-anchor="middle" font-size="12" [^>]*>([\d.]+)</text>',
                       svg)
    assert len(ticks) >= 5 and ticks[0] == "0", ticks
    after = human(int(s.predicted.max()))
    assert f">after the fix {after}</text>" in svg and after == human(
        next(f for f in d.findings if f.rule == RULE).predicted_peak_bytes)
    assert [f"iter {i}" for i, _ in s.iterations] == re.findall(r">(iter \d+)</text>", svg)
    legend = html.split('<div class="legend">')[1].split("</div></div>")[0]
    phases = dict.fromkeys(p for _, _, p in s.phase_runs())
    assert "background: the phase" in legend
    for p in phases:
        assert re.search(rf'class="sw" style="background:[^;]+;opacity:[\d.]+"></span>{p}<',
                         legend), p
    assert "iteration start" in legend


# --------------------------------------------------------------- compare of two run folders

def _cli(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "snapforensics", *args, "-q"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def test_compare_of_folders_has_gate_prediction_and_plot_in_every_format(tmp_path):
    """The CI view: the gate's banner, A's predicted peak against B's measured one and a
    before/after plot in the terminal (piped), Markdown and HTML (the check was JSON-only, the
    HTML had no banner and no plot, the piped table broke rule names mid-word)."""
    import json
    import shutil

    from snapforensics.report.mermaid import BARS

    for run, f in (("a", BUGGY), ("b", REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz")):
        (tmp_path / run).mkdir()
        shutil.copy(f, tmp_path / run / "rank0.pickle.gz")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    gate = ("--fail-on", "regression=5%", "--fail-on", "new-anomaly")
    d = buggy()
    pred = human(next(f for f in d.findings if f.rule == RULE).predicted_peak_bytes)

    term = _cli("compare", a, b, *gate)
    assert term.returncode == 0, term.stderr
    lines = term.stdout.splitlines()
    assert next(x for x in lines if x.startswith("GATE")).startswith("GATE PASSED")
    assert all(len(x) <= 100 for x in lines)
    assert any(f"anomaly gone {RULE}" in x for x in lines)  # the rule id whole on one line
    assert f"{pred} (+0.0%)" in term.stdout  # predicted 194.8 MiB, measured the same
    spark = [x for x in lines if x[:2] in ("A ", "B ") and "peak" in x]
    assert [x.split()[-2] + " " + x.split()[-1] for x in spark] == ["256.8 MiB", f"{pred}"]

    md = _cli("compare", a, b, *gate, "--format", "markdown").stdout
    assert "> **GATE PASSED" in md and f"{pred} (+0.0%)" in md
    block = md.split("```mermaid\n")[1].split("```")[0]
    bars = json.loads(re.search(r"^\s+bar (\[.*\])$", block, re.M)[1])
    line = json.loads(re.search(r"^\s+line (\[.*\])$", block, re.M)[1])
    assert len(bars) == len(line) == BARS and max(bars) == 256.8 and f"{max(line)} MiB" == pred

    back = tmp_path / "back.html"
    r = _cli("compare", b, a, *gate, "-o", str(back))
    assert r.returncode == 1
    page = back.read_text()
    assert re.search(r"<p class='banner fail'[^>]*>GATE FAILED \(2\)", page)
    svg = page.split("<h2>Before/after")[1]
    assert "A (baseline) peak 194.8 MiB</text>" in svg and "B peak 256.8 MiB</text>" in svg
    assert "plot" not in json.loads(_cli("compare", a, b, "--format", "json").stdout)


def test_a_one_rank_folder_reads_as_one_run(tmp_path):
    """`diagnose OUT` after `record` (one rank): the run's report with its fix, predicted peak
    and plot, not a "fleet" of one with a 0.0% spread."""
    import shutil

    (tmp_path / "out").mkdir()
    shutil.copy(BUGGY, tmp_path / "out" / "rank0.pickle.gz")
    r = _cli("diagnose", str(tmp_path / "out"), "--format", "markdown")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# snapforensics diagnosis: ") and "fleet" not in r.stdout
    assert "set_reshard_after_backward(True)" in r.stdout and "```mermaid" in r.stdout
    assert "predicted peak after it 194.8 MiB" in r.stdout


def test_files_of_different_runs_are_runs_not_ranks(tmp_path):
    """rank0 of run a and rank0 of run b are two runs: no spread verdict between them (it said
    "2 ranks, spread 27.5% (IMBALANCED)"), and the report says how to compare them."""
    import json
    import shutil

    for run, f in (("a", BUGGY), ("b", REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz")):
        (tmp_path / run).mkdir()
        shutil.copy(f, tmp_path / run / "rank0.pickle.gz")
    files = [str(tmp_path / x / "rank0.pickle.gz") for x in "ab"]
    r = _cli("diagnose", *files)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "2 separate runs, not ranks of one run" in text and "IMBALANCED" not in text
    assert f"snapforensics compare {files[0]} {files[1]}" in text
    assert json.loads(_cli("diagnose", *files, "--format", "json").stdout)["mode"] == "runs"
    # and it points to the worst one's own report, which has the fix, prediction and plot
    assert f"snapforensics diagnose {files[0]} -o report.html" in text
