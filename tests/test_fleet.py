"""Fleet diagnosis: a run folder's ranks in parallel processes, on a Dask cluster, through
fsspec URLs; one report that agrees with each rank's own diagnosis."""

from __future__ import annotations

import gzip
import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from corpus import corpus_files

from snapforensics import parallel
from snapforensics.analysis.fleet import WorstPlots, fleet
from snapforensics.analysis.rules import fsdp_reshard
from snapforensics.report import fleet as report

RESHARD = fsdp_reshard.RULE.id

REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
FIXED = REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snapforensics", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(REPO)})


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run folder: the fixed recording as rank 0, the buggy one as rank 1, an OOM dump."""
    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(FIXED, d / "rank0.pickle.gz")
    shutil.copy(BUGGY, d / "rank1.pickle.gz")
    shutil.copy(BUGGY, d / "rank1.oom.pickle.gz")  # a separate moment, not a rank
    (d / "notes.txt").write_text("not a snapshot")
    return d


def single(path: Path) -> dict:
    r = cli("diagnose", str(path), "--format", "json", "--no-cache")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_folder_report_agrees_with_each_rank(run_dir):
    r = cli("diagnose", str(run_dir), "-j", "2", "--format", "json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    assert f["schema"] == "snapforensics.fleet/1"
    buggy, fixed = single(run_dir / "rank1.pickle.gz"), single(run_dir / "rank0.pickle.gz")
    # worst first: the rank with the anomaly, whatever the order of the files
    assert [x["source"] for x in f["ranks"]] == [str(run_dir / "rank1.pickle.gz"),
                                                 str(run_dir / "rank0.pickle.gz")]
    assert [x["peaks"] for x in f["ranks"]] == [buggy["peaks"], fixed["peaks"]]
    peaks = [buggy["peaks"]["overall_bytes"], fixed["peaks"]["overall_bytes"]]
    assert f["spread"]["max_peak_bytes"] == max(peaks)
    assert f["spread"]["min_peak_bytes"] == min(peaks)
    by_rule = {x["rule"]: x for x in f["findings"]}
    # the reshard bug is only in the buggy rank: called out as rank-specific
    assert not by_rule[RESHARD]["on_all_ranks"] and by_rule[RESHARD]["rank_count"] == 1
    assert by_rule[RESHARD]["fix"]
    # what both recordings show is one line for all ranks
    both = ({x["rule"] for x in buggy["findings"]} & {x["rule"] for x in fixed["findings"]})
    assert both and all(by_rule[rule]["on_all_ranks"] for rule in both)
    assert f["findings"][0]["rule"] == RESHARD  # anomalies first


def test_jobs_do_not_change_the_result(run_dir):
    one = parallel.run([run_dir], jobs=1, cache=False, progress=False)
    two = parallel.run([run_dir], jobs=2, cache=False, progress=False)
    assert one == two and len(one) == 2


@pytest.mark.parametrize("fmt", ["terminal", "markdown", "html", "json"])
def test_every_format_names_ranks_and_findings(run_dir, fmt, tmp_path):
    out = tmp_path / f"fleet.{fmt}"
    r = cli("diagnose", str(run_dir / "rank*.pickle.gz"), "--format", fmt, "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert RESHARD in text.replace("\\_", "_") and "rank1.pickle.gz" in text
    if fmt == "html":  # offline: no URL, no script fetched; the worst rank's plot
        assert "http" not in text.replace("http-equiv", "") and " src=" not in text
        assert "<svg" in text


@pytest.mark.slow
def test_run_folder_of_recorded_ranks_shows_fix_predicted_peak_and_plot(tmp_path):
    """Issue 18 item 2: a run folder (two ranks of a real recorded FSDP2 run with the reshard
    bug) reads like the single-file report: the fix, the peak predicted after it and the worst
    rank's plot, in Markdown and HTML; the numbers are the worst rank's own."""
    pytest.importorskip("torch")
    from recordings import recorded

    from snapforensics.analysis.evidence import human

    ranks = recorded("buggy")
    folder = ranks[0].parent
    f = json.loads(cli("diagnose", str(folder), "--format", "json", "-q").stdout)
    worst = Path(f["ranks"][0]["source"])
    own = single(worst)
    mine = next(x for x in own["findings"] if x["rule"] == RESHARD)
    row = next(x for x in f["findings"] if x["rule"] == RESHARD)
    assert mine["predicted_peak_bytes"] < own["peaks"]["overall_bytes"]
    assert (row["predicted_peak_bytes"], row["saving_bytes"], row["fix"]) == \
        (mine["predicted_peak_bytes"], mine["saving_bytes"], mine["fix"])
    peak, after = human(own["peaks"]["overall_bytes"]), human(mine["predicted_peak_bytes"])
    fix_line = mine["fix"].splitlines()[-1].strip()
    for fmt in ("md", "html"):
        out = tmp_path / f"fleet.{fmt}"
        r = cli("diagnose", str(folder), "-o", str(out), "-q")
        assert r.returncode == 0, r.stderr
        text = out.read_text()
        assert text.count("Fix for") == 1  # each finding once
        assert f"peak predicted after it {after} from {peak}" in text.replace("\\", "")
        if fmt == "md":
            assert fix_line in text
            chart = text[text.index("```mermaid"):]
            assert "line [" in chart and "bar [" in chart  # recorded and after the fix
            png = tmp_path / "fleet.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "`fleet.png`" in text
        else:
            assert html.escape(fix_line, quote=False) in text
            svg = text[text.index("<svg"):text.index("</svg>")]
            assert f"peak {peak}" in svg and f"after the fix {after}" in svg


def test_hostile_file_name_is_neutralized(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(BUGGY, d / "rank0_<img src=x onerror=alert(1)>|x.pickle.gz")
    shutil.copy(FIXED, d / "rank1.pickle.gz")
    f = fleet(parallel.run([d], jobs=1, progress=False))
    assert "<img" not in report.html(f)
    md = report.markdown(f)
    assert "<img" not in md and not re.search(r"(?<!\\)\|x", md)  # no new table column


def test_unreadable_rank_is_listed_and_exits_2(run_dir, tmp_path):
    (run_dir / "rank2.pickle").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    out = tmp_path / "f.json"
    r = cli("diagnose", str(run_dir), "--format", "json", "-o", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    f = json.loads(out.read_text())
    assert [e["source"] for e in f["errors"]] == [str(run_dir / "rank2.pickle")]
    assert "refused" in f["errors"][0]["error"] and len(f["ranks"]) == 2


def test_fail_on_anomalous_over_the_fleet(run_dir):
    assert cli("diagnose", str(run_dir), "--fail-on", "anomalous", "-q").returncode == 1
    (run_dir / "rank1.pickle.gz").unlink()
    assert cli("diagnose", str(run_dir), "--fail-on", "anomalous", "-q").returncode == 0


def test_workers_fit_in_memory(monkeypatch, tmp_path):
    big = tmp_path / "rank0.pickle.gz"
    big.write_bytes(gzip.compress(b"\0" * (8 << 20)))  # 8 MiB unpickled, a few kB on disk
    srcs, sizes = [str(big)] * 8, [big.stat().st_size] * 8
    assert parallel.unpickled_size(str(big), sizes[0]) == 8 << 20  # the gzip trailer, not disk
    per = parallel.RSS_BASE + parallel.RSS_FACTOR * (8 << 20)
    monkeypatch.setattr(parallel, "mem_available", lambda: 3 * per + 1)
    assert parallel.workers_for(srcs, sizes, jobs=16) == 3
    monkeypatch.setattr(parallel, "mem_available", lambda: per // 2)
    assert parallel.workers_for(srcs, sizes, jobs=16) == 1  # never zero
    assert parallel.workers_for(srcs[:2], sizes[:2], jobs=16) == 1
    monkeypatch.setattr(parallel, "mem_available", lambda: 1 << 50)
    assert parallel.workers_for(srcs[:2], sizes[:2], jobs=16) == 2  # no more than inputs


def test_a_fleet_holds_only_the_plot_it_draws(tmp_path):
    """Three ranks: the buggy recording twice (tied worst) and the fixed one. Documents keep
    their plot series only while they can still be the worst rank; the fleet, its worst rank
    and the plot it draws are those of the documents that kept every series."""
    d = tmp_path / "run"
    d.mkdir()
    for rank, src in enumerate([FIXED, BUGGY, FIXED, BUGGY]):
        shutil.copy(src, d / f"rank{rank}.pickle.gz")
    full = parallel.run([d], jobs=1, cache=False, progress=False)
    lean = parallel.run([d], jobs=1, cache=False, progress=False,
                        on_doc=WorstPlots().add)
    plotted = [any(x["plot"] for x in doc["devices"]) for doc in lean]
    # the fixed rank 0 arrived first and was the worst so far; rank 1 took its place
    assert plotted == [False, True, False, True]
    assert all(any(x["plot"] for x in doc["devices"]) for doc in full)
    a, b = fleet(full), fleet(lean)
    assert a.to_dict() == b.to_dict()
    assert a.worst.source == b.worst.source == str(d / "rank1.pickle.gz")
    assert [x.plot.to_doc() for x in a.worst.devices] == [x.plot.to_doc() for x in b.worst.devices]


def test_corpus_files_as_one_fleet(tmp_path):
    files = [p for p in corpus_files() if p.stat().st_size < 1_500_000][:4]
    if len(files) < 2:
        pytest.skip("corpus not available")
    docs = parallel.run(files, jobs=2, cache=False, progress=False)
    assert [d["source"] for d in docs] == [str(p) for p in files]
    for p, d in zip(files, docs):
        if "error" in d:
            continue
        # a worker's document is the JSON plus each device's plot series (not in the JSON)
        assert all("plot" in x for x in d["devices"])
        json_part = d | {"devices": [{k: v for k, v in x.items() if k != "plot"}
                                     for x in d["devices"]]}
        assert json_part == single(p) | {"source": str(p)}


# ------------------------------------------------------------------------------- Dask, fsspec

@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=":0") as c:
        yield c


def test_dask_cluster_gives_the_local_result(cluster, run_dir):
    local = parallel.run([run_dir], jobs=1, cache=False, progress=False)
    urls = [f"file://{p}" for p in (run_dir / "rank0.pickle.gz", run_dir / "rank1.pickle.gz")]
    remote = parallel.run(urls, scheduler=cluster.scheduler_address, cache=False,
                          progress=False)
    assert [d["source"] for d in remote] == [u[len("file://"):] for u in urls]
    assert remote == local


def test_dask_reads_fsspec_urls_from_shared_storage(cluster, run_dir):
    """memory:// stands in for s3:// / gs://: listed by the client, read by the workers."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.mkdir("/job")
    for name in ("rank0.pickle.gz", "rank1.pickle.gz"):
        fs.pipe(f"/job/{name}", (run_dir / name).read_bytes())
    docs = parallel.run(["memory://job"], scheduler=cluster.scheduler_address, progress=False)
    local = parallel.run([run_dir], jobs=1, cache=False, progress=False)
    assert [d["source"] for d in docs] == ["memory:///job/rank0.pickle.gz",
                                           "memory:///job/rank1.pickle.gz"]
    for d, want in zip(docs, local):
        assert d == want | {"source": d["source"]}
    missing = parallel.run(["memory://job/rank7.pickle"], scheduler=cluster.scheduler_address,
                           progress=False)
    assert "no such file" in missing[0]["error"]
    corpus = [p for p in corpus_files() if p.stat().st_size < 700_000][:2]
    if corpus:
        got = parallel.run([f"file://{p}" for p in corpus], scheduler=cluster.scheduler_address,
                           cache=False, progress=False)
        assert got == parallel.run(corpus, jobs=1, cache=False, progress=False)


@pytest.mark.parametrize("answers", [False, True], ids=["refused", "silent"])
def test_unreachable_scheduler_is_one_line(run_dir, answers):
    """Nothing listening (refused), or a port that accepts and never answers (a scheduler that
    hangs, a blackholing proxy): both end in one line, exit 2, after the timeout (1 s here)."""
    pytest.importorskip("distributed")  # without the [fleet] extra there is no scheduler
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        if answers:
            s.listen()  # the kernel completes the handshake; nobody ever reads or writes
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "snapforensics", "diagnose", str(run_dir),
                            "--scheduler", f"tcp://127.0.0.1:{port}", "-q"],
                           capture_output=True, text=True, cwd=REPO, timeout=120,
                           env=os.environ | {"PYTHONPATH": str(REPO),
                                             "SNAPFORENSICS_SCHEDULER_TIMEOUT": "1"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Dask" in r.stderr, r.stderr


# ------------------------------------------------------------------------------- progress

def _on_a_terminal(*args: str) -> str:
    """Run the CLI with stderr on a pseudo-terminal (stdout piped); what the terminal got."""
    import pty

    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "snapforensics", *args], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=follower,
                         env=os.environ | {"PYTHONPATH": str(REPO),
                                           "SNAPFORENSICS_PROGRESS_AFTER": "0"})
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    p.wait(timeout=300)
    os.close(leader)
    return out.decode("utf-8", "replace")


def test_progress_bar_on_a_terminal_only(run_dir):
    shown = _on_a_terminal("diagnose", str(run_dir), "--format", "json", "--no-cache")
    assert "ranks" in shown and "diagnosing" in shown
    assert "ranks" not in _on_a_terminal("diagnose", str(run_dir), "--format", "json", "-q")
    piped = cli("diagnose", str(run_dir), "--format", "json", "--no-cache")
    assert piped.returncode == 0 and piped.stderr == ""


def test_url_of_a_folder_is_a_fleet_and_of_a_file_a_diagnosis(run_dir):
    f = json.loads(cli("diagnose", f"file://{run_dir}", "--format", "json", "-q").stdout)
    assert f["schema"] == "snapforensics.fleet/1" and len(f["ranks"]) == 2
    one = cli("diagnose", f"file://{run_dir / 'rank1.pickle.gz'}", "--format", "json", "-q")
    assert json.loads(one.stdout) == single(run_dir / "rank1.pickle.gz")
