"""`snapforensics mcp SNAPSHOT...`: the explorer's queries as an MCP server over stdio (the
official MCP Python SDK, `mcp` 2.x `MCPServer`). Tools read only the snapshots the command was
given (by their index, 0 = the first), each diagnosed on first use."""

from __future__ import annotations

import json
from typing import Any

from snapforensics.explore import queries


def server(paths: list[str]) -> Any:
    from mcp.server.mcpserver import MCPServer

    mcp = MCPServer("snapforensics")
    report = queries.Sources(paths).__getitem__

    def text(doc: Any) -> str:
        return json.dumps(doc, default=str)

    @mcp.tool()
    def diagnose(snapshot: int = 0) -> str:
        """The diagnosis of a snapshot (the JSON contract snapforensics.diagnosis/1)."""
        return text(report(snapshot).to_dict())

    @mcp.tool()
    def findings(snapshot: int = 0) -> str:
        """The findings: index, rule, verdict, title, bytes, blocks, predicted peak."""
        return text(queries.findings(report(snapshot)))

    @mcp.tool()
    def blocks(lo: int = 0, hi: int = 1 << 62, width: int = 200, device: int | None = None,
               snapshot: int = 0) -> str:
        """Blocks alive in trace rows [lo, hi) at `width` columns: the largest drawn one by
        one (id, columns, size, category), the rest merged per category."""
        rep = report(snapshot)
        dev = rep.analyses[0].device if device is None else device
        return text(queries.window(rep, dev, lo, hi, width))

    @mcp.tool()
    def block_stack(block_id: int, snapshot: int = 0) -> str:
        """One block: size, address, rows, phase, category, FSDP unit, its full stack."""
        return text(queries.block(report(snapshot), block_id))

    @mcp.tool()
    def compare(before: int = 0, after: int = 1, axis: str = "fraction",
                x0: float | None = None, x1: float | None = None, width: int = 200) -> str:
        """Compare two of the given snapshots (before/after a fix, or two ranks): peaks,
        categories and findings of `after` against `before`, and both timelines overlaid on
        one axis (`fraction` of the trace or `time` in seconds) over [x0, x1) at `width`
        columns with the difference after - before (as /api/compare)."""
        return text(queries.compare(report(before), report(after), axis, x0, x1, width))

    return mcp
