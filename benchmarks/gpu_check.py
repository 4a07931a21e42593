"""The prepared GPU check (issue 16): one script, one GPU, at most ~10 minutes.

    python benchmarks/gpu_check.py [--out DIR] [--keep-fixtures DIR] [--only NAME,...]
    python benchmarks/gpu_check.py --dry-run     # no GPU: the CPU-side parts, CUDA ones skipped

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

6. names: a tiny model trained 2 steps (Adam): every parameter's block (the last one allocated
   at its storage's data pointer, which the script reads at its end) carries its
   ``named_parameters()`` name, kind ``parameter`` and shape; its ``.grad`` and ``.exp_avg``
   blocks theirs (the script writes the truth).
7. graph_pools: two ``torch.cuda.CUDAGraph`` captures without ``pool=``, each with a 64 MiB
   intermediate: the snapshot has segments whose ``segment_pool_id`` is each graph's
   ``g.pool()``, the analyzer lists them as CUDA graph private pools apart from the regular one
   (``allocator.private_pool`` anomalous, saving >= 40 MiB; explorer ``segments`` pools), then
   the same two captures sharing ``torch.cuda.graph_pool_handle()``: one user pool, info.
8. device_memory: ``--steps 1:3`` on CUDA (recording starts and stops inside optimizer step
   hooks): exit 0, the recorder's ``device_memory`` samples at start, steps 2 and 3, end, each
   with the device's used bytes >= the allocator's reserved bytes, and the finding
   ``runtime.memory_outside_allocator`` (issue 29 item 5: sampled at step boundaries with
   ``torch.cuda.mem_get_info``; NVML is not read, ``cudaMemGetInfo`` already gives the whole
   device).

9. compiled: the bundled example (2 blocks of dim 128, 3 steps) with each block's mlp
   ``torch.compile``-d by Inductor (Triton on CUDA) and its eager twin, on the GPU: the CUDA
   allocator's ``compile_context`` names the regions, every compiled backward (2 blocks x 3
   steps, run by the autograd engine with no region open) is tied to its forward's region
   (issue 29 item 3, ``analysis/compiled.py``), every compiled forward block names its
   Inductor buffer and a line of ``MLP.forward`` (the recorder's map of the generated code,
   joined by the allocating line CUDA's frames carry), and the compiled run gets the eager
   run's anomalous rules and predicted peaks within 5%.

``--keep-fixtures DIR`` copies the small CUDA recordings there (to commit as fixtures).
``--dry-run`` runs what needs no GPU (checks 6 and 8 recorded on the CPU, their verification
code included; the analyzer side of 7 on a torch-format file with two graph pools; 9 with
aot_eager on the CPU) and marks
the CUDA-only checks SKIP: it proves the script imports and its checking code runs. A table of
every check ends the output; exit 1 when any failed.
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
results: list[tuple[str, bool | None, str]] = []  # None: skipped


def say(name: str, ok: bool | None, detail: str) -> None:
    results.append((name, ok, detail))
    print(f"{_word(ok)} {name}: {detail}", flush=True)


def _word(ok: bool | None) -> str:
    return "SKIP" if ok is None else "PASS" if ok else "FAIL"


def table() -> str:
    w = max([len(n) for n, _, _ in results] + [5])
    lines = [f"{'check':<{w}}  result  detail", f"{'-' * w}  ------  ------"]
    lines += [f"{n:<{w}}  {_word(ok):<6}  {d[:160]}" for n, ok, d in results]
    return "\n".join(lines)


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
    import pandas as pd

    for _, row in f.iterrows():
        if pd.notna(row.get("predicted_peak_bytes")):  # None, NaN or pandas' NA: no prediction
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


NAMES = """
    import json, sys, torch
    dev = sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 32, device=dev)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    truth = []
    for n, p in model.named_parameters():
        truth.append([n, "parameter", p.untyped_storage().data_ptr(), list(p.shape)])
        truth.append([n + ".grad", "gradient", p.grad.untyped_storage().data_ptr(),
                      list(p.shape)])
        st = opt.state[p]["exp_avg"]
        truth.append([n + ".exp_avg", "optimizer_state", st.untyped_storage().data_ptr(),
                      list(p.shape)])
    json.dump(truth, open(sys.argv[1], "w"))
"""


def names(work: Path, device: str = "cuda") -> None:
    """The recorder's tensor names against the running model's own named_parameters()."""
    import json

    s = script(work, "names", NAMES)
    out, truth = work / f"names-{device}", work / f"names-{device}.truth.json"
    p = record(out, [str(s), str(truth), device], device=device)
    if p.returncode or not truth.is_file():
        say(f"names[{device}]", False, f"exit {p.returncode}: {p.stderr.strip()[-300:]}")
        return
    sys.path.insert(0, str(REPO))
    import snapforensics

    b = snapforensics.diagnose(str(out / "rank0.pickle")).blocks
    wrong = []
    rows = json.loads(truth.read_text())
    for name, kind, ptr, shape in rows:
        # the storage lives at the script's end: the last block allocated at its address
        at = b[b.address == ptr].sort_values("alloc_row").tail(1)
        got = [(r.tensor, r.tensor_kind, list(r.shape) if r.shape is not None else None)
               for r in at.itertuples()]
        if (name, kind, shape) not in got:
            wrong.append(f"{name}: {got[:2]}")
    say(f"names[{device}]", not wrong,
        f"{len(rows) - len(wrong)}/{len(rows)} parameters, grads, exp_avg named as "
        f"named_parameters(){'; wrong: ' + '; '.join(wrong[:3]) if wrong else ''}")


GRAPHS = """
    import json, sys, torch
    shared = sys.argv[2] == "shared"
    model = torch.nn.Linear(256, 256, device="cuda")
    x = torch.randn(64, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up before capture, as torch's docs do
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle() if shared else None
    graphs, outs = [], []
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            tmp = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB scratch
            tmp.fill_(1)
            y = model(x) + tmp[:1].float()
            del tmp
        graphs.append(g)
        outs.append(y)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    json.dump({"pools": [list(g.pool()) for g in graphs]}, open(sys.argv[1], "w"))
"""


def graph_pools(work: Path) -> None:
    """Blocks of two CUDA graph captures land in their own pools, shown apart, with the rule."""
    import json
    import pickle

    sys.path.insert(0, str(REPO))
    import snapforensics
    from snapforensics.explore import queries

    s = script(work, "graphs", GRAPHS)
    for mode, verdict in (("own", "anomalous"), ("shared", "info")):
        out, truth = work / f"graphs-{mode}", work / f"graphs-{mode}.json"
        p = record(out, [str(s), str(truth), mode])
        if p.returncode or not truth.is_file():
            say(f"graph_pools[{mode}]", False, f"exit {p.returncode}: {p.stderr.strip()[-300:]}")
            continue
        want = {tuple(x) for x in json.loads(truth.read_text())["pools"]}
        raw = pickle.loads((out / "rank0.pickle").read_bytes())
        seen = {tuple(sg.get("segment_pool_id", (0, 0))) for sg in raw["segments"]} - {(0, 0)}
        rep = snapforensics.diagnose(str(out / "rank0.pickle"))
        f = rep.findings
        row = f[f["rule"] == "allocator.private_pool"]
        api = {tuple(x["pool"]) for x in queries.segments(rep, 0)["pools"]} - {(0, 0)}
        got = row.iloc[0]["verdict"] if len(row) else None
        saving = int(row.iloc[0]["saving_bytes"]) if len(row) and \
            row.iloc[0]["saving_bytes"] == row.iloc[0]["saving_bytes"] else 0
        owners = {x["owner"].split(" (")[0] for x in queries.segments(rep, 0)["pools"]}
        ok = seen == want and api == want and got == verdict and (
            verdict != "anomalous" or saving >= 40 << 20)
        say(f"graph_pools[{mode}]", ok,
            f"g.pool() {sorted(want)}, snapshot segments' pools {sorted(seen)}, explorer "
            f"{sorted(api)} {sorted(owners)}; allocator.private_pool {got} "
            f"(want {verdict}), saving {saving >> 20} MiB")


def graph_pools_dry() -> None:
    """No GPU: the analyzer side of check 7 on a torch-format file with two graphs' pools."""
    import pickle

    sys.path.insert(0, str(REPO))
    import snapforensics
    from snapforensics.explore import queries

    mib = 1 << 20
    segs, trace = [], []
    for k, pid in enumerate([(1, 0), (2, 0), (0, 0)]):
        addr = 0x7F0000000000 + k * (1 << 30)
        segs.append({"device": 0, "address": addr, "total_size": 64 * mib,
                     "allocated_size": 64 * mib, "active_size": 64 * mib,
                     "requested_size": 64 * mib, "stream": 0, "segment_type": "large",
                     "segment_pool_id": pid, "is_expandable": False, "frames": [],
                     "blocks": [{"address": addr, "size": 64 * mib, "requested_size": 64 * mib,
                                 "state": "active_allocated", "frames": []}]})
        trace += [{"action": "segment_alloc", "addr": addr, "size": 64 * mib, "stream": 0,
                   "time_us": 1.0 + k, "frames": []},
                  {"action": "alloc", "addr": addr, "size": 64 * mib, "stream": 0,
                   "time_us": 1.5 + k, "frames": []}]
    path = Path(tempfile.mkdtemp(prefix="gpu-check-dry-")) / "graphs.pickle"
    path.write_bytes(pickle.dumps({"segments": segs, "device_traces": [trace]}, protocol=4))
    rep = snapforensics.diagnose(str(path))
    f = rep.findings
    row = f[f["rule"] == "allocator.private_pool"]
    pools = queries.segments(rep, 0)["pools"]
    ok = len(row) == 1 and row.iloc[0]["verdict"] == "anomalous" and \
        [tuple(x["pool"]) for x in pools] == [(0, 0), (1, 0), (2, 0)]
    say("graph_pools[analyzer only]", ok, f"pools {[x['pool'] for x in pools]}, verdict "
        f"{row.iloc[0]['verdict'] if len(row) else None}")


STEPS = """
    import torch, sys
    dev = sys.argv[1]
    model = torch.nn.Linear(64, 64).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        model(torch.randn(8, 64, device=dev)).sum().backward()
        opt.step()
"""


def device_memory(work: Path, device: str = "cuda") -> None:
    """``--steps 1:3``: recording starts and stops inside step hooks; device memory samples."""
    import pickle

    s = script(work, "steps", STEPS)
    out = work / f"steps-{device}"
    p = record(out, ["--steps", "1:3", str(s), device], device=device)
    if p.returncode or not (out / "rank0.pickle").is_file():
        say(f"device_memory[{device}]", False, f"exit {p.returncode}: {p.stderr.strip()[-300:]}")
        return
    snap = pickle.loads((out / "rank0.pickle").read_bytes())
    if device == "cpu":  # no device beside the allocator: the window alone
        say("device_memory[cpu]", "device_memory" not in snap.get("snapforensics", {}),
            "--steps 1:3 recorded on the CPU, exit 0 (no device memory there)")
        return
    dm = snap["snapforensics"].get("device_memory") or {}
    steps = [x["step"] for x in dm.get("samples", [])]
    sane = all(x["used_bytes"] >= x["reserved_bytes"] for x in dm.get("samples", []))
    sys.path.insert(0, str(REPO))
    import snapforensics

    f = snapforensics.diagnose(str(out / "rank0.pickle")).findings
    has = "runtime.memory_outside_allocator" in set(f["rule"])
    say("device_memory[cuda]", steps == ["start", 2, 3, "end"] and sane and has
        and dm.get("error") is None,
        f"samples at {steps}, used >= reserved: {sane}, error {dm.get('error')}, "
        f"runtime.memory_outside_allocator: {has}")


COMPILED = ["-m", "snapforensics.examples.fsdp_ckpt", "--", "--steps", "3", "--variant", "buggy",
            "--layers", "2", "--dim", "128"]


def compiled(work: Path, device: str = "cuda", keep: Path | None = None) -> None:
    """torch.compile on the device: regions named, compiled backward tied, eager's verdicts."""
    backend = "inductor" if device == "cuda" else "aot_eager"
    runs = {}
    for b in ("none", backend):
        out = work / f"compiled-{b}-{device}"
        p = record(out, [*COMPILED, "--compile", b], device=device, timeout=420)
        if p.returncode or not (out / "rank0.pickle").is_file():
            say(f"compiled[{device}]", False, f"{b}: exit {p.returncode}: "
                f"{p.stderr.strip()[-300:]}")
            return
        runs[b] = out / "rank0.pickle"
    sys.path.insert(0, str(REPO))
    import snapforensics

    rep = snapforensics.diagnose(str(runs[backend]))
    c = rep.diagnosis.devices[0].compiled or {}
    calls, tied = c.get("backward_calls"), c.get("backward_calls_attributed")
    regions = [r["region"] for r in c.get("regions", [])]
    ae, pe = summary(runs["none"])
    ac, pc = summary(runs[backend])
    worst = max([abs(pc[r][0] - pe[r][0]) / pe[r][0] for r in set(pe) & set(pc)] + [0.0])
    named = True
    detail = ""
    if backend == "inductor":  # the recorder's map of the generated code: exact lines on CUDA
        import inspect

        from snapforensics.examples import fsdp_ckpt

        src, first = inspect.getsourcelines(fsdp_ckpt.MLP.forward)
        mlp_lines = {str(first + i) for i in range(len(src))}
        b = rep.blocks
        fw = b[b.compiled_pass == "forward"]
        got = fw.compiled_line.dropna().astype(str).str.extract(r"fsdp_ckpt\.py:(\d+)")[0]
        # what Triton's runtime autotuning allocates on a kernel's first run (clones of its
        # arguments, under triton_heuristics) is the region's but no generated line's: 80% of
        # the forward's bytes named, not all
        share = float(fw["size"][fw.compiled_buffer.notna()].sum()) / max(fw["size"].sum(), 1)
        named = len(got) > 0 and got.notna().all() and set(got) <= mlp_lines and share >= 0.8
        detail = (f", forward buffers named {int(fw.compiled_buffer.notna().sum())}/{len(fw)}"
                  f" ({share:.0%} of bytes), model lines {sorted(set(got.dropna()))} "
                  f"(MLP.forward: {sorted(mlp_lines)})")
    say(f"compiled[{device}]", bool(regions) and calls == tied == 2 * 3 and ae == ac
        and worst <= 0.05 and named, f"{backend}: regions {regions}, compiled backward calls "
        f"tied {tied}/{calls} (truth 6), anomalous eager {sorted(ae)} compiled {sorted(ac)}, "
        f"predictions differ by {worst:.1%} at most{detail}")
    if keep and device == "cuda":
        shutil.copy(runs[backend], keep / "fsdp2_ckpt_buggy_inductor_cuda_rank0.pickle")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep-fixtures", type=Path, default=None)
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: run the CPU-side parts, skip the CUDA checks")
    a = ap.parse_args()
    work = a.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.keep_fixtures:
        a.keep_fixtures.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    keep = a.keep_fixtures
    cuda = {"nccl_vs_cpu": lambda: nccl_vs_cpu(work, keep), "oom": lambda: oom(work, keep),
            "own_history": lambda: own_history(work),
            "visible_devices": lambda: visible_devices(work),
            "stacks_all": lambda: stacks_all(work), "names": lambda: names(work),
            "graph_pools": lambda: graph_pools(work),
            "device_memory": lambda: device_memory(work),
            "compiled": lambda: compiled(work, keep=keep)}
    dry = {"names": lambda: names(work, "cpu"), "graph_pools": graph_pools_dry,
           "device_memory": lambda: device_memory(work, "cpu"),
           "compiled": lambda: compiled(work, "cpu")}
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    if only - set(cuda):
        ap.error(f"unknown check(s) {sorted(only - set(cuda))}; known: {sorted(cuda)}")
    for name, check in cuda.items():
        if only and name not in only:
            continue
        if a.dry_run:
            if name not in dry:
                say(name, None, "needs CUDA (--dry-run)")
                continue
            check = dry[name]
        try:
            check()
        except Exception as e:  # one broken check does not hide the others
            say(name, False, f"{type(e).__name__}: {e}")
    print(table())
    failed = sum(ok is False for _, ok, _ in results)
    skipped = sum(ok is None for _, ok, _ in results)
    print(f"gpu_check: {len(results) - failed - skipped} passed, {failed} failed, "
          f"{skipped} skipped in "
          f"{time.time() - t0:.0f} s ({work})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
