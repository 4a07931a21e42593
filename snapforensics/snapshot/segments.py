"""Segments and their blocks (the allocator's state at dump), validated one by one: they are few.
Torch 2.0's blocks carry their stack in a newest-first `history`."""

from __future__ import annotations

from typing import Any

from snapforensics.errors import SnapError
from snapforensics.snapshot.columns import (
    LISTS,
    MAX_BYTES,
    MAX_DEVICE,
    MAX_TOTAL,
    check_int,
    clean_str,
    short,
    tname,
)
from snapforensics.snapshot.intern import Interner
from snapforensics.snapshot.model import NO_STACK, Block, Segment

BLOCK_STATES = {"active_allocated", "active_pending_free", "active_awaiting_free", "inactive"}
_STATE_OK = {"active_allocated", "active_pending_free", "inactive"}


def read_segments(raw: Any, it: Interner, fmt: dict) -> list[Segment]:
    if type(raw) not in LISTS:
        raise SnapError(f"segments must be a list, got {tname(raw)}")
    it.budget.add(len(raw), "segments")
    it.budget.add(sum(len(b) for b in map(_blocks_of, raw) if type(b) in LISTS), "segment blocks")
    out = []
    stack = it.stack
    legacy = 0
    for si, s in enumerate(raw):
        where = f"segments[{si}]"
        if type(s) is not dict:
            raise SnapError(f"{where} is {tname(s)}, expected a dict")
        seg_addr = check_int(s.get("address", 0), where, "address")
        blocks_raw = s.get("blocks", [])
        if blocks_raw is None:
            blocks_raw = []
        if type(blocks_raw) not in LISTS:
            raise SnapError(f"{where}: blocks must be a list, got {tname(blocks_raw)}")
        blocks = []
        offset = seg_addr
        bwhere = f"{where}.blocks"
        for bi, b in enumerate(blocks_raw):
            if type(b) is not dict:
                raise SnapError(f"{where}.blocks[{bi}] is {tname(b)}, expected a dict")
            get = b.get
            bsize = get("size", 0)
            frames = get("frames")
            requested = get("requested_size")
            state = get("state")
            address = get("address")
            if "history" in b:
                legacy += 1
                hframes, real = _legacy_history(b, f"{where}.blocks[{bi}]")
                if frames is None:
                    frames = hframes
                if requested is None and state != "inactive":
                    requested = real
                if state is None:
                    state = "active_allocated" if hframes is not None or real is not None \
                        else "inactive"
            if type(state) is not str or state not in _STATE_OK:  # None, wrong type, old name
                if state is None:
                    state = "inactive"
                elif type(state) is not str or state not in BLOCK_STATES:
                    raise SnapError(f"{where}.blocks[{bi}]: unknown block state {short(state)}")
                elif state == "active_awaiting_free":
                    state = "active_pending_free"
            if requested is None:
                requested = bsize if state != "inactive" else 0
            if address is None:
                address = offset
            if not (type(bsize) is int and 0 <= bsize <= MAX_BYTES and type(requested) is int
                    and 0 <= requested <= MAX_BYTES and type(address) is int
                    and 0 <= address < (1 << 64)):
                bw = f"{where}.blocks[{bi}]"
                check_int(bsize, bw, "size", hi=MAX_BYTES)
                check_int(requested, bw, "requested_size", hi=MAX_BYTES)
                check_int(address, bw, "address")
            offset = address + bsize
            blocks.append(Block(address, bsize, requested, state,
                                NO_STACK if frames is None else stack(frames, bwhere, bi)))
        block_sum = sum(b.size for b in blocks)
        allocated = sum(b.size for b in blocks if b.state != "inactive")
        total = s.get("total_size")
        total = block_sum if total is None else check_int(total, where, "total_size", hi=MAX_BYTES)
        if blocks and block_sum != total:
            fmt["segments_not_tiled"] = fmt.get("segments_not_tiled", 0) + 1
        seg_type = s.get("segment_type", "")
        if seg_type is None:
            seg_type = ""
        if type(seg_type) is not str:
            raise SnapError(f"{where}: segment_type must be a string, got {tname(seg_type)}")
        expandable = s.get("is_expandable", False)
        if expandable is None:
            expandable = False
        if type(expandable) not in (bool, int):
            raise SnapError(f"{where}: is_expandable must be a bool, got {tname(expandable)}")
        pool = s.get("segment_pool_id", (0, 0))
        it.pool(pool, where)  # validates; the default pool maps to -1
        pool_t = (pool,) if type(pool) is int else ((0, 0) if pool is None else tuple(pool))
        out.append(Segment(
            device=check_int(s.get("device", 0), where, "device", hi=MAX_DEVICE),
            address=seg_addr,
            total_size=total,
            allocated_size=check_int(_dflt(s, "allocated_size", allocated), where, "allocated_size",
                                hi=MAX_BYTES),
            active_size=check_int(_dflt(s, "active_size", allocated), where, "active_size",
                             hi=MAX_BYTES),
            requested_size=check_int(_dflt(s, "requested_size", allocated), where, "requested_size",
                                hi=MAX_BYTES),
            stream=it.stream(s.get("stream", 0), where),
            segment_type=clean_str(seg_type),
            pool_id=pool_t,
            is_expandable=bool(expandable),
            stack=stack(s.get("frames"), where),
            blocks=blocks,
        ))
    if sum(float(s.total_size) for s in out) > MAX_TOTAL:
        raise SnapError("segments add up to more memory than any device could hold")
    if legacy:
        fmt["legacy_block_history"] = True
    return out


def _blocks_of(s: Any) -> Any:
    return s.get("blocks") if type(s) is dict else None


def _dflt(d: dict, key: str, default: Any) -> Any:
    v = d.get(key)
    return default if v is None else v



def _legacy_history(b: dict, bw: str) -> tuple[Any, int | None]:
    """torch 2.0 blocks: `history` newest first, [{addr, real_size, frames}]."""
    hist = b.get("history")
    if hist is None:
        return None, None
    if type(hist) not in LISTS:
        raise SnapError(f"{bw}: history must be a list, got {tname(hist)}")
    if not hist:
        return None, None
    h = hist[0]
    if type(h) is not dict:
        raise SnapError(f"{bw}.history[0] is {tname(h)}, expected a dict")
    real = h.get("real_size")
    if real is not None:
        real = check_int(real, f"{bw}.history[0]", "real_size", hi=MAX_BYTES)
    return h.get("frames"), real
