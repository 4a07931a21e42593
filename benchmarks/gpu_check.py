"""The prepared GPU check (issue 16): one script, one GPU, at most ~10 minutes.

    python benchmarks/gpu_check.py [--out DIR] [--keep-fixtures DIR]

Runs ``snapforensics record`` for real on CUDA and prints what it finds, one line per check,
then ``gpu_check: N passed, M failed`` (exit 1 when any failed). Nothing here has run on a GPU
in this repository's history until a line saying so is committed with its output.

1. nccl_vs_cpu: the bundled example (``-m snapforensics.examples.fsdp_ckpt``, which picks NCCL
   when CUDA is visible), buggy and fixed, one rank on the GPU and one rank on the CPU (gloo):
   the anomalous rules must agree, and each rule's predicted peak on CUDA within 25% of the CPU
   one relative to its measured peak (CUDA rounds blocks to 512 B and adds NCCL/cuBLAS buffers).
2. oom: a script that catches an OOM three times: exit 0, ``rank0.oom.pickle`` with the
   first request's size, one oom entry in it.
3. own_history: a script that calls ``_record_memory_history(max_entries=100000)`` and later
   ``enabled=None``: the snapshot keeps its allocations, the one-line warning is printed.
4. visible_devices: a script that hides every GPU with ``CUDA_VISIBLE_DEVICES`` before touching
   CUDA: torch agrees (the recorder did not initialize CUDA first), and the recorder says in one
   line that the script never used CUDA.
5. stacks_all: the fixed run with ``--stacks all``: finishes within 120 s (fast symbolization,
   TORCH_SYMBOLIZE_MODE=fast), C++ frames present, same anomalous rules as ``--stacks python``.

``--keep-fixtures DIR`` copies the small CUDA recordings there (to commit as fixtures).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = ["-m", "snapforensics.examples.fsdp_ckpt", "--", "--steps", "3"]
results: list[tuple[str, bool, str]] = []


def say(name: str, ok: bool, detail: str) -> None:
    results.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def record(out: Path, args: list[str], device: str = "cuda", stacks: str = "python",
           env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    cmd = [sys.executable, "-m", "snapforensics", "record", "-q", "--force", "--device", device,
           "--stacks", stacks, "--out", str(out), *args]
    t0 = time.time()
    proc = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout,
                          check=False)
    proc.seconds = time.time() - t0  # type: ignore[attr-defined]
    return proc


def summary(path: Path) -> tuple[set[str], dict[str, tuple[int, int]]]:
    """Anomalous rules, and rule -> (predicted peak, measured peak) of each prediction."""
    sys.path.insert(0, str(REPO))
    import snapforensics

    d = snapforensics.diagnose(str(path))
    f = d.findings
    anomalous = set(f[f["verdict"] == "anomalous"]["rule"])
    preds = {}
    for _, row in f.iterrows():
        if row.get("predicted_peak_bytes") is not None and row["predicted_peak_bytes"] == \
                row["predicted_peak_bytes"]:
            preds[row["rule"]] = (int(row["predicted_peak_bytes"]), int(d.peaks["overall_bytes"]))
    return anomalous, preds


def nccl_vs_cpu(work: Path, keep: Path | None) -> None:
    for variant in ("buggy", "fixed"):
        args = [*EXAMPLE, "--variant", variant]
        gpu, cpu = work / f"{variant}-cuda", work / f"{variant}-cpu"
        pg = record(gpu, args)
        pc = record(cpu, args, device="cpu")
        if pg.returncode or pc.returncode:
            say(f"nccl_vs_cpu[{variant}]", False, f"exit {pg.returncode}/{pc.returncode}: "
                f"{(pg.stderr or pc.stderr).strip().splitlines()[-1:]}")
            continue
        ag, preds_g = summary(gpu / "rank0.pickle")
        ac, preds_c = summary(cpu / "rank0.pickle")
        worst = 0.0
        for rule in set(preds_g) & set(preds_c):
            (pg_, mg), (pc_, mc) = preds_g[rule], preds_c[rule]
            worst = max(worst, abs(pg_ / mg - pc_ / mc))
        say(f"nccl_vs_cpu[{variant}]", ag == ac and worst <= 0.25,
            f"anomalous cuda {sorted(ag)} cpu {sorted(ac)}; predicted/measured differ by "
            f"{worst:.1%} at most ({pg.seconds:.0f} s on CUDA)")
        if keep:
            shutil.copy(gpu / "rank0.pickle", keep / f"fsdp2_ckpt_{variant}_cuda_rank0.pickle")


def script(work: Path, name: str, body: str) -> Path:
    p = work / f"{name}.py"
    p.write_text(textwrap.dedent(body))
    return p


def oom(work: Path, keep: Path | None) -> None:
    s = script(work, "oom", """
        import torch
        x = torch.ones(1 << 20, device="cuda")
        free, total = torch.cuda.mem_get_info()
        for _ in range(3):
            try:
                torch.empty(total * 2, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                pass
    """)
    out = work / "oom"
    p = record(out, [str(s)])
    oomf = out / "rank0.oom.pickle"
    ok = p.returncode == 0 and oomf.is_file()
    detail = f"exit {p.returncode}"
    if ok:
        import pickle

        snap = pickle.loads(oomf.read_bytes())
        ooms = [e for t in snap["device_traces"] for e in t if e["action"] == "oom"]
        prov = snap["snapforensics"]["oom"]
        ok = len(ooms) == 1 and "device_total_or_allowed_max_bytes" in prov
        detail += f", {len(ooms)} oom entry in the OOM file, requested {prov['requested_bytes']}"
        if keep:
            shutil.copy(oomf, keep / "oom_cuda_rank0.oom.pickle")
    say("oom", ok, detail)


def own_history(work: Path) -> None:
    s = script(work, "own", """
        import torch
        torch.cuda.memory._record_memory_history(max_entries=100000)
        keep = [torch.ones(1 << 20, device="cuda") for _ in range(5)]
        torch.cuda.memory._record_memory_history(enabled=None)
        more = torch.ones(1 << 22, device="cuda")
    """)
    out = work / "own"
    p = record(out, [str(s)])
    import pickle

    ok = p.returncode == 0 and (out / "rank0.pickle").is_file()
    n = 0
    if ok:
        snap = pickle.loads((out / "rank0.pickle").read_bytes())
        n = sum(e["action"] == "alloc" for t in snap["device_traces"] for e in t)
        ok = n >= 6 and "the script called _record_memory_history" in p.stderr
    say("own_history", ok, f"exit {p.returncode}, {n} allocs kept")


def visible_devices(work: Path) -> None:
    """The script hides every GPU itself: torch must agree (the recorder did not initialize
    CUDA first), and the recorder says in one line that nothing was recorded."""
    s = script(work, "visible", """
        import os
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        import torch
        assert not torch.cuda.is_available(), "CUDA was initialized before the script"
    """)
    out = work / "visible"
    p = record(out, [str(s)])
    ok = p.returncode == 0 and "never used CUDA" in p.stderr
    say("visible_devices", ok,
        f"exit {p.returncode} {p.stderr.strip().splitlines()[-1:] if not ok else ''}")


def stacks_all(work: Path) -> None:
    args = [*EXAMPLE, "--variant", "buggy"]
    py, al = work / "st-python", work / "st-all"
    p1 = record(py, args)
    p2 = record(al, args, stacks="all", timeout=300)
    if p1.returncode or p2.returncode:
        say("stacks_all", False, f"exit {p1.returncode}/{p2.returncode}")
        return
    import pickle

    snap = pickle.loads((al / "rank0.pickle").read_bytes())
    cpp = any(f.get("filename", "").endswith((".cpp", ".h", ".so")) or "::" in f.get("name", "")
              for t in snap["device_traces"] for e in t[:2000] for f in e.get("frames", []))
    a1, _ = summary(py / "rank0.pickle")
    a2, _ = summary(al / "rank0.pickle")
    say("stacks_all", p2.seconds < 120 and cpp and a1 == a2,
        f"{p2.seconds:.0f} s with C++ frames={cpp}; anomalous python {sorted(a1)} "
        f"all {sorted(a2)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep-fixtures", type=Path, default=None)
    a = ap.parse_args()
    work = a.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.keep_fixtures:
        a.keep_fixtures.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for check in (lambda: nccl_vs_cpu(work, a.keep_fixtures), lambda: oom(work, a.keep_fixtures),
                  lambda: own_history(work), lambda: visible_devices(work),
                  lambda: stacks_all(work)):
        try:
            check()
        except Exception as e:  # one broken check does not hide the others
            say(getattr(check, "__name__", "check"), False, f"{type(e).__name__}: {e}")
    failed = sum(not ok for _, ok, _ in results)
    print(f"gpu_check: {len(results) - failed} passed, {failed} failed in "
          f"{time.time() - t0:.0f} s ({work})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
