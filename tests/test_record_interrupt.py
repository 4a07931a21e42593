"""Ctrl-C during ``snapforensics record`` (issue 18 item 6): a terminal sends SIGINT to the whole
foreground process group, here the recorder's (its ranks run in a group of their own, which the
recorder forwards to). Real runs: CPU, gloo, 2 ranks of a tiny script (~10-40 s each).

Expected: one line "interrupted: writing snapshots ...", no traceback from torch's internals nor
a KeyboardInterrupt traceback (Ctrl-C is not the script's failure), exit 130, the snapshots
written mid-training, and no empty --out when interrupted before the script ran.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from recordings import REPO, load_strict, run_cli

INTERRUPTED = "snapforensics record: interrupted: writing snapshots ..."

TRAIN = """
import os, pathlib, sys, time
here = pathlib.Path(sys.argv[1])
(here / f"started{os.environ['RANK']}").write_text("yes")
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
keep = []
step = 0
while True:
    keep.append(torch.ones(1000))
    keep = keep[-20:]
    dist.all_reduce(keep[-1])
    step += 1
    if step == 3:
        (here / f"training{dist.get_rank()}").write_text("yes")
    time.sleep(0.01)
"""


def _start(tmp_path: Path, out: Path, script: str = TRAIN, nproc: int = 2):
    pytest.importorskip("torch")
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    err = open(tmp_path / "stderr", "w+")
    # its own session: a process group of its own, as a terminal's foreground job has
    proc = subprocess.Popen(
        [sys.executable, "-m", "snapforensics", "record", "--device", "cpu", "--nproc-per-node",
         str(nproc), "--out", str(out), str(path), str(tmp_path)], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=err,
        start_new_session=True)
    return proc, err


def _wait_for(cond, proc, what: str, limit: float = 300) -> None:
    deadline = time.time() + limit
    while not cond() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert cond(), f"{what} never happened"


def _ctrl_c(proc, err) -> tuple[int, str]:
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err.seek(0)
    return proc.returncode, err.read()


def _assert_clean(stderr: str) -> None:
    lines = stderr.splitlines()
    assert lines.count(INTERRUPTED) == 1, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "frame #" not in stderr, stderr  # torch's C++ stack traces
    assert "os._exit, or killed" not in stderr, stderr


def test_ctrl_c_mid_training_writes_every_rank_and_exits_130(tmp_path):
    out = tmp_path / "out"
    proc, err = _start(tmp_path, out)
    _wait_for(lambda: all((tmp_path / f"training{r}").exists() for r in (0, 1)), proc,
              "training on both ranks")
    code, stderr = _ctrl_c(proc, err)
    assert code == 130, stderr
    _assert_clean(stderr)
    assert sorted(p.name for p in out.iterdir()) == ["rank0.pickle", "rank1.pickle"]
    for r in (0, 1):
        prov = load_strict(out / f"rank{r}.pickle")["snapforensics"]
        assert prov["rank"] == r and prov["script_exit_code"] == 130
    assert "2 snapshot(s) written" in stderr


def test_ctrl_c_at_start_up_leaves_no_out_and_exits_130(tmp_path):
    out = tmp_path / "out"
    proc, err = _start(tmp_path, out)
    # the recorder has launched its ranks (they are importing torch): the script has not run
    _wait_for(lambda: "snapforensics record: recording" in (tmp_path / "stderr").read_text(),
              proc, "the launch")
    code, stderr = _ctrl_c(proc, err)
    assert not any(tmp_path.glob("started*")), "the script ran: not a start-up interrupt"
    assert code == 130, stderr
    _assert_clean(stderr)
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_a_keyboard_interrupt_the_script_raises_itself_keeps_its_traceback(tmp_path):
    """Only Ctrl-C's KeyboardInterrupt is silenced: one the script raises is its own failure."""
    out = tmp_path / "out"
    (tmp_path / "own.py").write_text("raise KeyboardInterrupt('the script said so')\n")
    proc = run_cli(["record", "-q", "--device", "cpu", "--out", str(out), "own.py"],
                   cwd=tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" in proc.stderr and "the script said so" in proc.stderr
    assert "interrupted: writing" not in proc.stderr


# both ranks wait to receive from each other (gloo: GIL released, no Python runs): killed, their
# main threads never run Python again, and the recorder's own threads write the snapshots and
# end the processes
BLOCKED = TRAIN.replace("    time.sleep(0.01)\n", """    time.sleep(0.01)
    if step == 3:
        dist.recv(torch.empty(4), src=1 - dist.get_rank())
""")


@pytest.mark.parametrize("script", [TRAIN, BLOCKED], ids=["training", "blocked-in-a-collective"])
def test_record_killed_its_ranks_stop_and_leave_no_lock_nor_status(tmp_path, script):
    """SIGKILL of the ``record`` process alone (a caller's timeout; issue 29): its ranks, in a
    process group of their own, get SIGTERM from the kernel (PR_SET_PDEATHSIG), write their
    snapshots and end within seconds, and remove the status and lock files nobody else will;
    also ranks whose main threads are blocked in gloo receives (each snapshot written by the
    recorder's thread, which ends the process: a clean clone's run under load left both status
    files and the lock there, the cleanup being on the main thread only)."""
    out = tmp_path / "out"
    proc, err = _start(tmp_path, out, script)
    _wait_for(lambda: all((tmp_path / f"training{r}").exists() for r in (0, 1)), proc,
              "training on both ranks")
    time.sleep(1.0)  # (BLOCKED's ranks into their receives)
    proc.kill()
    proc.wait()
    t0 = time.time()
    names = lambda: sorted(p.name for p in out.iterdir())  # noqa: E731
    while names() != ["rank0.pickle", "rank1.pickle"] and time.time() - t0 < 120:
        time.sleep(0.1)
    assert names() == ["rank0.pickle", "rank1.pickle"], names()
    for r in (0, 1):
        prov = load_strict(out / f"rank{r}.pickle")["snapforensics"]
        assert prov["script_exit_code"] == 128 + signal.SIGTERM
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                os.kill(prov["pid"], 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(prov["pid"], signal.SIGKILL)
            raise AssertionError(f"rank {r} still running 30 s after its snapshot")
