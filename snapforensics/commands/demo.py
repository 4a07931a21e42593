"""`snapforensics demo`: record the bundled example buggy and fixed, diagnose both, compare."""

from __future__ import annotations

import time
from pathlib import Path

import click

from snapforensics.errors import EXIT_RECORD_FAILED, SnapError
from snapforensics.record import DEVICES

EXAMPLE = "snapforensics.examples.fsdp_ckpt"


@click.command("demo", short_help="Record the bundled example (bug, fix) and diagnose both.",
               epilog="""\b
Examples:
  snapforensics demo                      # 2 ranks on CPU, 1 on a GPU
  snapforensics demo --steps 5 --out demo-runs""")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder for the recordings (default snapforensics-out/demo-TIME).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="auto: cuda if available, else npu (torch_npu), else the CPU allocator.")
@click.option("--nproc-per-node", type=int, default=None,
              help="Ranks to launch (default 2 on CPU, 1 on an accelerator).")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Optimizer steps each run trains, every one recorded (record's --steps A:B "
                   "instead picks a window of steps to record).")
def demo_command(out: Path | None, device: str, nproc_per_node: int | None, steps: int) -> int:
    """Record the bundled FSDP + activation checkpointing example twice, with the bug
    (parameters unsharded in backward never resharded) and with its fix, diagnose both and
    compare them: what the fix changed and how close the predicted peak was. Needs torch."""
    from snapforensics.analysis.compare import BEFORE_AFTER, compare
    from snapforensics.record import record
    from snapforensics.report.output import emit, write_stdout
    from snapforensics.runner import diagnose_paths

    out = out or Path("snapforensics-out") / time.strftime("demo-%Y%m%d-%H%M%S")
    nproc = nproc_per_node or (2 if device == "cpu" or not _has_accelerator() else 1)
    diags = []
    for variant in ("buggy", "fixed"):
        write_stdout(f"== recording the {variant} configuration ({nproc} rank(s), "
                     f"device {device})")
        res = record(EXAMPLE, ["--variant", variant, "--steps", str(steps)], module=True,
                     out=out / variant, nproc_per_node=nproc, device=device)
        if res.exit_code != 0 or not res.snapshots:
            raise SnapError(f"the {variant} example run failed (exit {res.exit_code})",
                            EXIT_RECORD_FAILED)
        snap = min(res.snapshots)
        d, = diagnose_paths([Path(snap)])
        diags.append(d)
        write_stdout(f"== diagnosis of {snap}")
        emit("diagnosis", d)
    write_stdout("== what the fix changed")
    emit("compare", compare(diags, mode=BEFORE_AFTER))
    write_stdout(f"recordings in {out}")
    return 0


def _has_accelerator() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
