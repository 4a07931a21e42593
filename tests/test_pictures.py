"""The timeline plot in the reports: Markdown's PNG beside the file, HTML's inline SVG, and
user-given or snapshot strings passing each sink's neutralizer."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
PAYLOAD = "<script>alert(1)</script>"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(BUGGY), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def _pixels(png: bytes) -> np.ndarray:
    from matplotlib.image import imread

    return imread(io.BytesIO(png), format="png")


def _mermaid(text: str) -> dict[str, list[float]]:
    """The series of the report's Mermaid chart (its `bar` and `line` data, in its unit)."""
    block = text.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert "xychart-beta" in block
    return {m[1]: json.loads(m[2]) for m in re.finditer(r"^\s+(bar|line) (\[.*\])$", block,
                                                         re.M)}


def test_markdown_carries_its_chart_and_names_the_png_to_attach(tmp_path):
    out = tmp_path / "report.md"
    r = run("--format", "markdown", "-o", str(out), "--category", "bad $x^$=rms_norm")
    assert r.returncode == 0, r.stderr
    png = tmp_path / "report.png"
    img = _pixels(png.read_bytes())
    assert img.shape[1] >= 1000 and len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 50
    text = out.read_text()
    # a relative image link breaks once pasted into an issue: the text says to attach it
    assert "](report.png)" not in text and "`report.png`" in text and "attach it" in text
    # the picture that survives pasting: a Mermaid chart of the live bytes (bars, exact at the
    # peak to the unit's rounding) and of the replay after the fix (the line)
    series = _mermaid(text)
    assert max(series["bar"]) == 256.8 and max(series["line"]) == 194.8  # MiB, as reported
    assert "peak 256.8 MiB" in text and "predicted peak after it 194.8 MiB" in text
    # the fix comes before any stack, stacks are collapsed, the share column is there
    assert text.index("```python") < text.index("<details>")
    assert text.count("<details>") == text.count("</details>") >= 3
    assert "| share |" in text
    assert re.search(r"\| \d+% \|", text)


def test_markdown_to_stdout_says_where_the_plot_is():
    """No PNG is written for stdout: the chart is in the text and one line says how to get
    the PNG (the plot was dropped silently)."""
    r = run("--format", "markdown")
    assert r.returncode == 0 and "![" not in r.stdout
    assert max(_mermaid(r.stdout)["bar"]) == 256.8
    assert "`-o report.md`, which also writes `report.png`" in r.stdout


def test_markdown_raw_text_has_no_needless_escapes(tmp_path):
    """What people paste reads as written: `72.0 MiB`, `~62.0 MiB`, `+0.0%`, while the text
    still renders to the same words."""
    from mdtext import rendered_text

    text = run("--format", "markdown").stdout
    cmp = subprocess.run([sys.executable, "-m", "snapforensics", "compare", str(BUGGY),
                          str(BUGGY), "--format", "markdown"], capture_output=True, text=True,
                         cwd=REPO, timeout=120).stdout
    for doc in (text, cmp):
        outside = re.sub(r"```.*?```", "", doc, flags=re.S)
        assert not re.findall(r"\\[.+~\-]", outside), re.findall(r".{20}\\[.+~\-].{10}", outside)
    assert "- 72.0 MiB in 36 blocks" in text and "saves ~62.0 MiB" in text
    assert "saves ~62.0 MiB" in rendered_text(text)


def test_html_plot_draws_every_category_the_peak_and_the_prediction():
    from snapforensics.analysis import diagnose
    from snapforensics.report import render_text
    from snapforensics.report.common import human
    from snapforensics.snapshot import load

    d = diagnose(load(BUGGY))
    doc = render_text(d, "html")
    s = d.devices[0].plot
    titles = re.findall(r"<polygon [^>]*><title>([^<]*)</title>", doc)
    assert sorted(titles) == sorted(s.categories)
    assert f">peak {human(int(s.live[s.peak]))}</text>" in doc
    (data,) = re.findall(r'<script type="application/json" class="sf-data">(.*?)</script>',
                         doc, re.S)
    hover = json.loads(data)
    assert hover["predicted"] == s.predicted.tolist() and hover["reserved"] is None
    assert len(hover["x"]) == len(s.rows) and hover["cats"] == s.categories
    # the fix of the top finding is in the first card, before any device section
    assert doc.index('class="topfix"') < doc.index('id="device-')
    assert "set_reshard_after_backward(True)" in doc[:doc.index('id="device-')]


def test_user_category_names_are_neutralized(tmp_path):
    out = tmp_path / "r.html"
    r = run("--format", "html", "-o", str(out), "--category", f"{PAYLOAD}=rms_norm")
    assert r.returncode == 0, r.stderr
    doc = out.read_text()
    assert PAYLOAD not in doc and "<script>alert" not in doc
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in doc  # SVG title and legend
    assert "\\u003cscript>alert(1)\\u003c/script>" in doc  # the hover's JSON


def test_markdown_renders_as_github_does(tmp_path):
    """Parsed by CommonMark + GFM tables: each collapsed stack is an HTML block, its frames a
    fenced code block (not raw HTML), the image a real image, the share column a table."""
    from mdtext import tokens

    out = tmp_path / "my report.md"
    r = run("-o", str(out), "--category", f"{PAYLOAD}=rms_norm")
    assert r.returncode == 0, r.stderr
    toks = tokens(out.read_text())
    html_blocks = [t.content for t in toks if t.type == "html_block"]
    assert sum(b.startswith("<details><summary>") for b in html_blocks) >= 3
    assert all("<script" not in b for b in html_blocks)
    fences = [t for t in toks if t.type == "fence"]
    assert fences[0].info == "python" and "set_reshard_after_backward(True)" in fences[0].content
    assert any("torch/optim/adam.py" in t.content for t in fences[1:])  # a stack
    images = [c for t in toks if t.type == "inline" for c in t.children or []
              if c.type == "image"]
    assert images == []  # no link that breaks where the text is pasted
    assert [t.info for t in fences].count("mermaid") == 1  # GitHub and GitLab draw it
    assert (tmp_path / "my report.png").stat().st_size > 10_000
    assert any(t.type == "th_open" for t in toks)


def test_redact_paths_reaches_the_hover(tmp_path):
    from corpus import corpus_file

    src = str(corpus_file("MAGMA27_memory_snapshot.pickle"))  # Windows D:\ paths in stacks
    docs = {}
    for name, extra in (("plain", ()), ("red", ("--redact-paths",))):
        out = tmp_path / f"{name}.html"
        r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", src, "--format",
                            "html", "-o", str(out), *extra], capture_output=True, text=True,
                           cwd=REPO, timeout=120)
        assert r.returncode == 0, r.stderr
        docs[name] = re.findall(r'class="sf-data">(.*?)</script>', out.read_text(), re.S)
    assert any("D:\\\\" in x for x in docs["plain"])
    assert docs["red"] and not any("D:\\\\" in x for x in docs["red"])
