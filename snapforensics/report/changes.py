"""The words a comparison's reports share (report/compare.py, report/compare_runs.py): signed
sizes, percentages, one change, an input's name, the CI gate's lines."""

from __future__ import annotations

from typing import Any

from snapforensics.report.common import human

PEAK_NAMES = (("overall_bytes", "overall peak"), ("forward_bytes", "forward peak"),
              ("backward_bytes", "backward peak"))


def signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + human(abs(n))


def pct(p: float | None) -> str:
    return "n/a" if p is None else f"{p:+.1f}%"


def change(ch: dict[str, Any]) -> str:
    """`-60.5 MiB (-24.1%)` for one {before, after, delta_bytes, delta_pct}."""
    if not ch["before"] and not ch["after"]:
        return "-"
    if not ch["before"]:
        return f"{signed(ch['delta_bytes'])} (new)"
    return f"{signed(ch['delta_bytes'])} ({pct(ch['delta_pct'])})"


def who(inp: dict[str, Any]) -> str:
    return inp["label"] + (f" (rank {inp['rank']})" if inp.get("rank") is not None else "")


def gate_lines(doc) -> list[str]:
    """The CI gate's verdict, when one was asked (`--fail-on`)."""
    if doc.gate is None:
        return []
    return [f"FAIL: {x}" for x in doc.gate] or ["gate passed"]
