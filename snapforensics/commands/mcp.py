"""`snapforensics mcp SNAPSHOT...`: an MCP server over stdio (explore/mcp_server.py)."""

from __future__ import annotations

import sys

import click

from snapforensics.errors import SnapError


@click.command("mcp", short_help="Serve the explorer's queries to a coding assistant (MCP).")
@click.argument("snapshots", nargs=-1, required=True)
def mcp_command(snapshots: tuple[str, ...]) -> int:
    """An MCP server on stdio with the tools diagnose, findings, blocks, block_stack and
    compare over the given snapshots (0 = the first). Needs Python >= 3.10 and
    snapforensics[mcp]; else exit 2 with one line."""
    if sys.version_info < (3, 10):
        raise SnapError("snapforensics mcp needs Python >= 3.10 (the MCP SDK does)")
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise SnapError("mcp needs its extra: pip install 'snapforensics[mcp]'") from None
    from snapforensics.explore.mcp_server import server
    from snapforensics.parallel import expand

    server(expand(snapshots)).run("stdio")
    return 0
