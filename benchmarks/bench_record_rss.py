"""Peak RSS of a CPU-recorded run against the same run unrecorded (issue 16, item 10).

    python benchmarks/bench_record_rss.py [--layers 4] [--steps 3] [--hidden 256]
    python benchmarks/bench_record_rss.py --nproc 4     # FSDP2 HSDP (2 x 2 mesh), 4 CPU ranks

The run: a tiny ``transformers`` Llama built from a config (no download), trained for a few
steps on random tokens, recorded whole (``snapforensics record --device cpu``); with
``--nproc N`` (even) the same under FSDP2 HSDP on a (2, N/2) mesh over gloo, every decoder
layer and the model ``fully_shard``-ed, N ranks (the case issue 29 item 0 reports: 6-7 GB a rank
and a 902 s profiler stop with traced imports), unrecorded through ``torch.distributed.run``.
Only the untraced recorder runs there (``--before`` adds the traced one: minutes, GBs). Needs
``transformers`` importable (install it pinned in your own environment). Prints the peak RSS of
the largest process of each run (``ru_maxrss`` of the waited children: for the recorded run,
the rank) and their ratio. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys, torch
def main():
    from transformers import LlamaConfig, LlamaForCausalLM  # inside main(), as many scripts do
    layers, steps, hidden = (int(a) for a in sys.argv[1:4])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # FSDP2 HSDP over gloo
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
        w = dist.get_world_size()
        mesh = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (2, 128))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("params", sum(p.numel() for p in model.parameters()))
main()
"""


def peak_rss(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """(peak RSS of the largest waited descendant in GB, seconds, stderr tail) of ``cmd`` run in
    a fresh child that reports its own children's ru_maxrss."""
    probe = ("import resource, subprocess, sys, time;"
             "t = time.time(); p = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
             "r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss;"
             "print(r, time.time() - t, p.returncode);"
             "sys.stderr.write(p.stderr[-2000:])")
    proc = subprocess.run([sys.executable, "-c", probe, *cmd], env=env, capture_output=True,
                          text=True, check=False)
    kb, secs, code = proc.stdout.split()[-3:]
    if int(code):
        raise SystemExit(f"{' '.join(cmd[:4])}... exited {code}: {proc.stderr[-1500:]}")
    return int(kb) / 1e6, float(secs), proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--nproc", type=int, default=1, help="ranks (even: FSDP2 HSDP over 2 x N/2)")
    ap.add_argument("--before", action="store_true",
                    help="with --nproc > 1, also the recorder tracing imports (slow, GBs)")
    a = ap.parse_args()
    if a.nproc < 1 or (a.nproc > 1 and a.nproc % 2):
        ap.error("--nproc: 1, or an even number of ranks")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "hf_llama.py"
        script.write_text(textwrap.dedent(SCRIPT))
        args = [str(a.layers), str(a.steps), str(a.hidden)]
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc-per-node={a.nproc}"] if a.nproc > 1 else [sys.executable]
        plain, t_plain, _ = peak_rss([*launch, str(script), *args], env)
        rows = []
        variants = [("imports traced (before)", "1"), ("imports untraced", "0")]
        if a.nproc > 1 and not a.before:
            variants = variants[1:]
        for label, trace in variants:
            out = Path(d) / f"out{trace}"
            rec, t_rec, err = peak_rss([sys.executable, "-m", "snapforensics", "record",
                                        "--device", "cpu", "--nproc-per-node", str(a.nproc),
                                        "--out", str(out), str(script), *args],
                                       {**env, "SNAPFORENSICS_TRACE_IMPORTS": trace})
            size = sum(p.stat().st_size for p in out.glob("rank*.pickle")) / 1e6
            rows.append((label, rec, t_rec, size))
    how = f"FSDP2 HSDP on {a.nproc} CPU ranks (2 x {a.nproc // 2})" if a.nproc > 1 else "1 rank"
    print(f"tiny Llama, {a.layers} layers, hidden {a.hidden}, {a.steps} steps, {how}, recorded "
          "whole, transformers imported inside main(); peak RSS of the largest process")
    print(f"unrecorded: peak RSS {plain:.2f} GB in {t_plain:.1f} s")
    for label, rec, t_rec, size in rows:
        print(f"recorded, {label}: peak RSS {rec:.2f} GB ({rec / plain:.2f}x) in {t_rec:.1f} s "
              f"(+{t_rec - t_plain:.1f} s), snapshot {size:.1f} MB")
    for line in err.splitlines():
        if "rank " in line and "written in" in line:
            print(line.strip())


if __name__ == "__main__":
    main()
