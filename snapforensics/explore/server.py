"""The explorer's HTTP JSON API (Starlette) over the queries of queries.py, and the page.

Bound to 127.0.0.1 by the command; every request must carry the random token the command
prints (`?token=`, or the `X-Token` header the page sends), else 403. No endpoint takes a
path: the server reads only the snapshots the command was given (`queries.Sources`, by index:
`snapshot=`, default 0), each diagnosed on first use.

    GET /                      the page (static/index.html)
    GET /api/overview          source, peaks, devices (rows, blocks, categories), findings,
                               `snapshots` (index, source) and `mode` (one, compare, fleet)
    GET /api/window?device=&lo=&hi=&width=[&axis=time&x0=&x1=][&category=&finding=&unit=
                               &min_size=&text=]   blocks, bands (the filtered-out rest grey),
                               live bytes, phases, iterations and the peak in a window
    GET /api/block/{id}        one block: size, address, rows, times, phase, iteration,
                               category and the frame that decided it, unit, stack, findings
    GET /api/finding/{index}?width=   its block ids and the predicted-after-fix curve
    GET /api/segments?device=[&row=]   the allocator's segments with their blocks and free
                               gaps, at dump or right after `row` (a statement on CPU
                               recordings)
    GET /api/compare?a=&b=&axis=&x0=&x1=&width=   B against A and both timelines overlaid
    GET /api/fleet             a fleet's strip: every rank's peak and the snapshot to open
Every endpoint but /api/fleet takes `snapshot=` (/api/compare: `a=` and `b=`).
"""

from __future__ import annotations

import secrets
from importlib import resources
from typing import Any

from snapforensics.api import Report
from snapforensics.errors import SnapError
from snapforensics.explore import queries


def app(sources: Report | queries.Sources, fleet: dict[str, Any] | None = None,
        token: str | None = None) -> Any:
    """The app over one Report or the Sources given; `fleet`: the strip `queries.fleet` made
    of them (a run folder)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    srcs = sources if isinstance(sources, queries.Sources) else queries.Sources([sources])
    mode = "fleet" if fleet is not None else "compare" if len(srcs) == 2 else "one"
    token = token or secrets.token_urlsafe(24)
    page = resources.files("snapforensics.explore").joinpath("static/index.html").read_text(
        "utf-8")

    class Guard:
        """403 unless the request carries the token (compared in constant time)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http":
                req = Request(scope)
                got = req.query_params.get("token") or req.headers.get("x-token") or ""
                if not secrets.compare_digest(got.encode(), token.encode()):
                    await PlainTextResponse("token required", 403)(scope, receive, send)
                    return
            await self.inner(scope, receive, send)

    def ints(req: Request, *names: str, **defaults: int) -> dict[str, int]:
        out = {}
        for n in names + tuple(defaults):
            v = req.query_params.get(n)
            out[n] = int(v) if v not in (None, "") else defaults[n]
        return out

    def floats(req: Request, *names: str) -> dict[str, float | None]:
        return {n: float(req.query_params[n]) if req.query_params.get(n) else None
                for n in names}

    def report(req: Request) -> Report:
        return srcs[ints(req, snapshot=0)["snapshot"]]

    def first_device(rep: Report) -> int:
        return rep.analyses[0].device if rep.analyses else 0

    async def index(req: Request) -> Response:
        return HTMLResponse(page, headers=_HEADERS)

    async def overview(req: Request) -> Response:
        snaps = [{"index": i, "source": queries._text(srcs.source(i))} for i in range(len(srcs))]
        return JSONResponse(queries.overview(report(req)) | {"snapshots": snaps, "mode": mode},
                            headers=_HEADERS)

    async def window(req: Request) -> Response:
        rep = report(req)
        dev = ints(req, device=first_device(rep))["device"]
        d, _ = queries._device(rep, dev)
        a = ints(req, lo=0, hi=d.lt.rows, width=800, min_size=0)
        q = req.query_params
        fi = q.get("finding")
        keep = queries.keep_mask(rep, dev, category=q.get("category") or None,
                                 finding_index=int(fi) if fi not in (None, "") else None,
                                 unit=q.get("unit") or None, min_size=a["min_size"],
                                 text=q.get("text") or None)
        x = floats(req, "x0", "x1")
        return JSONResponse(queries.window(rep, dev, a["lo"], a["hi"], a["width"], keep,
                                           q.get("axis") or "row", x["x0"], x["x1"]),
                            headers=_HEADERS)

    async def block(req: Request) -> Response:
        return JSONResponse(queries.block(report(req), int(req.path_params["id"])),
                            headers=_HEADERS)

    async def finding(req: Request) -> Response:
        rep = report(req)
        i = int(req.path_params["index"])
        if not 0 <= i < len(rep.diagnosis.findings):
            raise KeyError(i)
        return JSONResponse(queries.finding(rep, i, ints(req, width=800)["width"]),
                            headers=_HEADERS)

    async def segments(req: Request) -> Response:
        rep = report(req)
        a = ints(req, device=first_device(rep))
        row = req.query_params.get("row")
        return JSONResponse(queries.segments(rep, a["device"], int(row) if row else None),
                            headers=_HEADERS)

    async def compare(req: Request) -> Response:
        a = ints(req, a=0, b=1 if len(srcs) > 1 else 0, width=800)
        x = floats(req, "x0", "x1")
        return JSONResponse(queries.compare(srcs[a["a"]], srcs[a["b"]],
                                            req.query_params.get("axis") or "fraction",
                                            x["x0"], x["x1"], a["width"]), headers=_HEADERS)

    async def fleet_strip(req: Request) -> Response:
        if fleet is None:
            raise KeyError("not a fleet: the command was given one snapshot or two")
        return JSONResponse(fleet, headers=_HEADERS)

    async def bad(req: Request, exc: Exception) -> Response:
        return JSONResponse({"error": str(exc)[:200]}, 404 if isinstance(exc, KeyError)
                            else 400)

    routes = [Route("/", index), Route("/api/overview", overview), Route("/api/window", window),
              Route("/api/block/{id:int}", block), Route("/api/finding/{index:int}", finding),
              Route("/api/segments", segments), Route("/api/compare", compare),
              Route("/api/fleet", fleet_strip)]
    web = Starlette(routes=routes, middleware=[Middleware(Guard)],
                    exception_handlers={KeyError: bad, ValueError: bad, IndexError: bad,
                                        SnapError: bad})
    web.state.token = token
    return web


# the page runs no script but its own and loads nothing from elsewhere
_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
            "style-src 'unsafe-inline'; connect-src 'self'", "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-store"}
