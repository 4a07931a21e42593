"""`snapforensics mcp` driven by the MCP SDK's own stdio client: list the tools, ask for the
findings and one block's stack, compare them with the Python API."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import snapforensics as sf

pytest.importorskip("mcp")
REPO = Path(__file__).resolve().parents[1]
BUGGY = REPO / "fixtures" / "fsdp2_ckpt_buggy_rank0.pickle.gz"
FIXED = REPO / "fixtures" / "fsdp2_ckpt_fixed_rank0.pickle.gz"


def test_the_sdk_client_lists_tools_and_reads_findings_and_a_stack():
    import anyio
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    rep = sf.diagnose(BUGGY)
    b = rep.blocks
    big = int(b[b.category == "fsdp.unsharded_param"].sort_values("size", kind="stable")
              .index[-1])

    async def run():
        params = StdioServerParameters(command=sys.executable, args=[
            "-m", "snapforensics", "mcp", str(BUGGY), str(FIXED)])
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            tools = {t.name for t in (await s.list_tools()).tools}
            found = await s.call_tool("findings", {})
            stack = await s.call_tool("block_stack", {"block_id": big})
            cmp = await s.call_tool("compare", {"before": 0, "after": 1})
            return tools, found, stack, cmp

    tools, found, stack, cmp = anyio.run(run)
    assert tools == {"diagnose", "findings", "blocks", "block_stack", "compare"}
    got = json.loads(found.content[0].text)
    assert [(f["rule"], f["bytes"], f["blocks"]) for f in got] == \
        [(f.rule, f.bytes, f.blocks) for f in rep.diagnosis.findings]
    blk = json.loads(stack.content[0].text)
    assert blk["size"] == int(b["size"][big]) and blk["fsdp_unit"] == str(b["fsdp_unit"][big])
    frames = rep.stack(int(b.stack_id[big]))
    assert len(blk["stack"]) + len(blk["native_frames"]) == len(frames)
    got = json.loads(cmp.content[0].text)
    assert got["comparison"] == json.loads(json.dumps(
        sf.compare(str(BUGGY), str(FIXED)).to_dict(), default=str))
    # the overlay is the HTTP API's (the same query), at the tool's default width
    from starlette.testclient import TestClient

    from snapforensics.explore.queries import Sources
    from snapforensics.explore.server import app

    web = app(Sources([rep, sf.diagnose(FIXED)]))
    api = TestClient(web).get("/api/compare?width=200", headers={"X-Token": web.state.token})
    assert got["overlay"] == api.json()["overlay"]
    assert max(got["overlay"]["live_a"]) == rep.peaks["overall_bytes"]
