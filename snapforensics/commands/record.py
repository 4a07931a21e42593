"""`snapforensics record [OPTIONS] SCRIPT [ARGS]...` / `... record [OPTIONS] -m MODULE [ARGS]...`.

Runs the training script unmodified (like ``python`` / ``torchrun``) under memory recording and
writes ``OUT/rank{R}.pickle`` per rank. Exits with the script's own exit code. torch is imported
only by the processes that run the script.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from snapforensics.errors import EXIT_BAD_INPUT, SnapError
from snapforensics.record.backends import DEVICES, STACKS


@click.command("record", short_help="Record a training run: one memory snapshot per rank.",
               context_settings={"ignore_unknown_options": True,
                                           "allow_interspersed_args": False})
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for rank{R}.pickle (default: a new snapforensics-out/record-TIME).")
@click.option("--nproc-per-node", type=int, default=1, show_default=True,
              help="Ranks to launch on this machine (each with torchrun's environment).")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="auto: cuda if available, else npu (torch_npu), else the CPU allocator.")
@click.option("--stacks", type=click.Choice(STACKS), default="python", show_default=True,
              help="python: Python frames only (fast); all: C++ frames too (slow to dump).")
@click.option("--max-entries", type=int, default=1_000_000, show_default=True,
              help="Trace ring buffer size: only the last N alloc/free entries are kept.")
@click.option("-m", "--module", "module", is_flag=True,
              help="SCRIPT is a module name, run as `python -m MODULE`.")
@click.option("--steps", "steps", metavar="A:B", default=None,
              help="Record optimizer steps A to B-1 only (0-based; 'A:' to the end): the rest "
                   "runs at full speed.")
@click.option("--force", is_flag=True,
              help="Record into a non-empty --out (its earlier rank*.pickle are removed).")
@click.option("-q", "--quiet", is_flag=True,
              help="Only errors from the recorder (the script's own output is untouched).")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT|MODULE [ARGS]...")
def record_command(out: Path | None, nproc_per_node: int, device: str, stacks: str,
                   max_entries: int, module: bool, steps: str | None, force: bool, quiet: bool,
                   script_args: tuple[str, ...]) -> None:
    """Record a training run: one memory snapshot per rank.

    \b
    Examples:
      snapforensics record train.py --lr 1e-3
      snapforensics record --nproc-per-node 2 --out runs/a train.py
      snapforensics record --steps 5:7 train.py    # optimizer steps 5, 6 only
      snapforensics record -m mypkg.train -- --config x.yaml

    A `--` right after SCRIPT/MODULE is dropped. Every rank gets torchrun's environment (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT, ...), one rank included. Inside a torchrun launch (one rank
    per process) it records just this process. --out must be new or empty (or --force).
    """
    from snapforensics.record import record

    args = list(script_args)
    if not args:
        raise click.UsageError("missing SCRIPT (or -m MODULE) to record")
    target, rest = args[0], args[1:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    result = record(target, rest, module=module, out=out, nproc_per_node=nproc_per_node,
                    device=device, stacks=stacks, max_entries=max_entries, quiet=quiet,
                    force=force, steps=_parse_steps(steps))
    sys.exit(result.exit_code)


def _parse_steps(text: str | None) -> tuple[int, int | None] | None:
    """``A:B``, ``A:`` or ``:B`` -> (A, B or None)."""
    if text is None:
        return None
    first, sep, stop = text.partition(":")
    try:
        if not sep:
            raise ValueError(text)
        return (int(first) if first else 0), (int(stop) if stop else None)
    except ValueError:
        raise SnapError(f"--steps {text!r}: expected A:B (e.g. 2:4 records steps 2 and 3)",
                        exit_code=EXIT_BAD_INPUT) from None
