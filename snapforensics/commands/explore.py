"""`snapforensics explore SNAPSHOT`: the explorer's server on 127.0.0.1 (explore/server.py)."""

from __future__ import annotations

import click

from snapforensics.errors import SnapError


@click.command("explore", short_help="Open a snapshot in a local, offline explorer.")
@click.argument("snapshots", nargs=-1, required=True, metavar="SNAPSHOT|RUN_DIR [B]")
@click.option("--port", type=int, default=0, show_default=True,
              help="Port on 127.0.0.1 (0: a random free one).")
@click.option("--no-browser", is_flag=True, help="Print the URL only.")
@click.option("--finding", type=int, default=None, metavar="N",
              help="Open with finding N (the report's numbering) chosen: its blocks highlighted.")
def explore_command(snapshots: tuple[str, ...], port: int, no_browser: bool,
                    finding: int | None) -> int:
    """Every block on the active-memory timeline, its stack, unit and findings, on a local
    server (127.0.0.1 only; every request needs the token of the printed URL). Ctrl-C stops
    it. Two snapshots A B: both timelines on one axis and B - A; a run folder: every rank's
    peak, a click opens its timeline. The page's queries are a JSON API (README: Explore).
    Needs snapforensics[explore]."""
    try:
        import uvicorn
    except ImportError:
        raise SnapError("explore needs its extra: pip install 'snapforensics[explore]'") from None
    import socket
    import webbrowser

    from snapforensics.explore.queries import open_inputs
    from snapforensics.explore.server import app

    srcs, fleet = open_inputs(snapshots)
    if fleet is None:  # the page's first question, read before any server thread runs: the
        srcs[0]  # read's memory cap then holds this process alone (no child process)
    web = app(srcs, fleet)
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/?token={web.state.token}"
    url += "" if finding is None else f"&finding={finding}"
    click.echo(f"snapforensics explore: {url}  (Ctrl-C stops it)")
    if not no_browser:
        webbrowser.open(url)
    server = uvicorn.Server(uvicorn.Config(web, log_level="warning"))
    server.run(sockets=[sock])
    return 0
