"""`snapforensics demo`: record the bundled example buggy and fixed, diagnose both, compare."""

from __future__ import annotations

import time
from pathlib import Path

import click

from snapforensics.errors import EXIT_RECORD_FAILED, SnapError

EXAMPLE = "snapforensics.examples.fsdp_ckpt"


@click.command("demo")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder for the recordings (default snapforensics-out/demo-TIME).")
@click.option("--device", type=click.Choice(["auto", "cuda", "npu", "cpu"]), default="auto",
              show_default=True)
@click.option("--nproc-per-node", type=int, default=None,
              help="Ranks to launch (default 2 on CPU, 1 on an accelerator).")
@click.option("--steps", type=int, default=3, show_default=True)
def demo_command(out: Path | None, device: str, nproc_per_node: int | None, steps: int) -> int:
    """Record the FSDP + checkpoint example twice (bug, fix) and show what the fix changed."""
    from rich.console import Console

    from snapforensics.analysis import diagnose
    from snapforensics.record import record
    from snapforensics.report import terminal
    from snapforensics.report.common import human
    from snapforensics.snapshot import load

    console = Console()
    out = out or Path("snapforensics-out") / time.strftime("demo-%Y%m%d-%H%M%S")
    nproc = nproc_per_node or (2 if device == "cpu" or not _has_accelerator() else 1)
    results = {}
    for variant in ("buggy", "fixed"):
        console.rule(f"recording the {variant} configuration ({nproc} rank(s), device {device})")
        res = record(EXAMPLE, ["--variant", variant, "--steps", str(steps)], module=True,
                     out=out / variant, nproc_per_node=nproc, device=device)
        if res.exit_code != 0 or not res.snapshots:
            raise SnapError(f"the {variant} example run failed (exit {res.exit_code})",
                            EXIT_RECORD_FAILED)
        snap = sorted(res.snapshots)[0]
        d = diagnose(load(snap))
        results[variant] = d
        console.rule(f"diagnosis of {snap}")
        terminal.render(d, console)
    bug, fix = results["buggy"], results["fixed"]
    console.rule("what the fix changed")
    for name, key in (("forward peak", "forward_bytes"), ("backward peak", "backward_bytes"),
                      ("overall peak", "overall_bytes")):
        a, b = bug.peaks[key], fix.peaks[key]
        console.print(f"{name:14} {human(a):>10} -> {human(b):>10}  "
                      f"({100 * (b - a) / a:+.0f}%)" if a else f"{name:14} n/a")
    pred = [f.predicted_peak_bytes for f in bug.anomalies if f.predicted_peak_bytes]
    if pred and fix.peaks["overall_bytes"]:
        measured = fix.peaks["overall_bytes"]
        console.print(f"predicted peak after the fix {human(pred[0])}, measured {human(measured)}"
                      f" (error {100 * (pred[0] - measured) / measured:+.1f}%)")
    console.print(f"anomalies: buggy {len(bug.anomalies)}, fixed {len(fix.anomalies)}; "
                  f"recordings in {out}")
    return 0


def _has_accelerator() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
