"""A drop-and-pad MoE token dispatch (capacity factor cf, every expert's slot in the all-to-all
padded to `capacity = ceil(cf * tokens * k / experts)` rows) exchanges `experts * capacity` rows
whatever the routing: `cf * tokens * k` where the tokens routed are `tokens * k`, so a fraction
`1 - 1/cf` of the dispatch and combine buffers, and of every activation the experts compute on
them, holds no token (Switch / GShard; Megatron's `--moe-expert-capacity-factor` with
`--moe-pad-expert-input-to-capacity`). cf = 1.0 pads only to the next multiple of the experts
(and drops what an over-full expert cannot take); a dropless dispatch (ragged splits) exchanges
exactly the routed rows.

Seen from the token dispatcher's blocks (`moe.dispatch_buffer`), one MoE call at a time (a run of
dispatch blocks, the experts' blocks, then `moe.combine_buffer` blocks, in forward): the padded
buffers are the call's largest dispatch blocks, made twice or more at one size (the zero-filled
send buffer and the received one: a static shape both ways; a dropless call receives one ragged
buffer), and the routed rows are the permuted tokens, the call's first token-row block (at least
a quarter of the padded size, so cf up to 4: the int64 index tensors made before it, 8 bytes a
routed row, are 8 / (dim * itemsize) of a token buffer) that no zero-fill op made (a zero-filled
block is a buffer to be filled: the op frames of a CPU recording or of `stacks="all"` say so).
A dispatch written inline in the MoE layer's `forward` names only its exchanges (no dispatcher
function): the call is read with the layer's own forward blocks made right before its first
exchange and right after its last (the same module instance), the zero-filled send buffer
among them; without op frames that buffer reads as the routed rows and the call is not claimed.
GShard's einsum dispatch (DeepSpeed's MOELayer before 0.19, fairscale) has no routed-rows tensor
at all: its layer's output holds the tokens, and its gating function's name the routes each
takes (`_einsum_call`).
The routed rows have a static shape (tokens x k): where the size read for them moves between the
calls of one padded size, it is the rows some routing kept (a dispatch that gathers the kept
rows only), r is not seen and those calls are left unsaid.
Their ratio r = routed / padded is 1/cf up to the capacity's rounding; r < 1 is padding (at
cf = 1.0 with E dividing tokens * k the buffers are the permuted tokens' size: nothing beyond
the routed rows). A dispatcher that pads
while it permutes (Megatron's fused `permute(..., drop_and_pad=True)`) shows no unpadded tensor:
r is not seen and the rule is silent. DeepSpeed's MOELayer (0.19's `_sparse_encode`) gathers each
slot's token straight from the layer's input, so its dispatch holds no routed-rows tensor: the
combine's (`_sparse_decode` gathers each route's row back out of the padded buffer, appending
one zero row to it) is read instead, the larger of the two.

The replay is cf = 1.0: every padded-size dispatch and combine block of the call and every block
made between the call's last dispatch block and its first combine block (the experts' work on
the padded rows) shrinks by r, and so does every backward gradient at one of those sizes (the
gradients of the padded tensors: autograd makes them at their shapes; not a size some forward
block that is not padded has too), and, where the backward's exchanges show (an autograd
Function whose backward calls itself: DeepSpeed's `_AllToAll`), every gradient made between a
call's two (the experts' backward). The threshold is the mechanism: the padding rows hold zeros
the experts compute on and the combine throws away, so whatever the replay takes off the peak is
the saving (the project's 2 % floor, `evidence.MIN_PEAK_SAVING`, for what re-recording moves); a
lower cf drops the tokens an over-full expert gets beyond its capacity, which a dropless
dispatch does not, hence the fix names both. Info when the padding is not alive
at the peak.
"""

from __future__ import annotations

import re

import numpy as np

from snapforensics.analysis.classify import moe_layer_frame
from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.diagnosis import Finding, Replay
from snapforensics.analysis.evidence import human, lowers_peak, top_stacks
from snapforensics.analysis.rule import Family, Rule
from snapforensics.analysis.stacks import python_frames
from snapforensics.analysis.vocab import BACKWARD_PHASES, CAT_CODE, Category, Phase, Verdict

FIX = """\
# the MoE dispatch pads every expert's all-to-all slot to capacity = ceil(cf * tokens * k / E):
# about {cf:.2f}x the routed rows; at cf = 1.0 only the remainder of tokens * k / E is padding
capacity_factor = 1.0  # was {cf:.2f}; an over-full expert then drops the tokens beyond capacity
# or a dropless (ragged) dispatch: all_to_all_single with the per-rank token counts as splits,
# exchanged first (no padding, no dropped tokens)
# Megatron-LM: --moe-expert-capacity-factor 1.0 (with --moe-pad-expert-input-to-capacity), or
#   leave --moe-expert-capacity-factor unset for the dropless dispatcher
# torchtitan: its AllToAllTokenDispatcher is dropless (no capacity factor); the HybridEP
#   dispatcher's non_blocking_capacity_factor sizes its output buffer the same way
# DeepSpeed: deepspeed.moe.layer.MoE(..., capacity_factor=1.0, eval_capacity_factor=1.0)
#   (drop_tokens=False pads every expert to the fullest one's count instead)
"""


# a zero-fill op among a stack's frames: the CPU recorder's `aten::zeros` / `new_zeros` /
# `zeros_like` pseudo frames, torch's C++ frames (`stacks="all"`) `at::_ops::zeros::call`...
_ZEROS_OP = re.compile(r"^(?:aten::|at::_ops::)(?:new_)?zeros(?:_like)?(?:$|::)")


def _zero_filled(d: DeviceAnalysis, b: int) -> bool:
    s = int(d.lt.stack[b])
    return s >= 0 and any(_ZEROS_OP.match(f.name) for f in d.snapshot.stack_frames(s))


_MOE_CODES = (CAT_CODE[Category.MOE_DISPATCH], CAT_CODE[Category.MOE_COMBINE])


def _calls(d: DeviceAnalysis) -> list[tuple[np.ndarray, np.ndarray]]:
    """(dispatch blocks, combine blocks) per MoE call in forward, in trace order."""
    lt = d.lt
    disp, comb = CAT_CODE[Category.MOE_DISPATCH], CAT_CODE[Category.MOE_COMBINE]
    moe = np.flatnonzero(((d.category == disp) | (d.category == comb)) &
                         (d.phase == Phase.FORWARD) & (lt.alloc_row >= 0))
    moe = moe[np.argsort(lt.alloc_row[moe], kind="stable")]
    is_disp = d.category[moe] == disp
    calls, start = [], 0
    for i in range(1, len(moe) + 1):
        if i == len(moe) or (is_disp[i] and not is_disp[i - 1]):
            blocks = moe[start:i]
            calls.append((blocks[is_disp[start:i]], blocks[~is_disp[start:i]]))
            start = i
    return [c for c in calls if len(c[0]) and len(c[1])]


def _layer_run(d: DeviceAnalysis, fwd: np.ndarray, disp: np.ndarray,
               comb: np.ndarray) -> tuple[list[int], list[int]]:
    """The MoE layer's own forward blocks around a call, in trace order: those made under the
    same MoE layer frame (the recorder's module frame names the instance) right before its
    first dispatch block and right after its last combine block, up to the first block of
    another layer or another call."""
    lt, snap = d.lt, d.snapshot

    def python(b: int) -> list:
        return python_frames(snap.stack_frames(int(lt.stack[b])))

    frames = python(int(disp[0]))
    layer = moe_layer_frame(frames)
    if layer is None:
        return [], []
    if layer.filename != "<nn.Module>":  # an MoE file's frame: the module instance inside it
        layer = next((f for f in frames if f.filename == "<nn.Module>"), layer)
    key, mine = (layer.filename, layer.name), {}

    def ours(b: int) -> bool:
        s = int(lt.stack[b])
        if s not in mine:
            mine[s] = any((f.filename, f.name) == key for f in python(b))
        return mine[s] and int(d.category[b]) not in _MOE_CODES

    rows = lt.alloc_row[fwd]
    i = int(np.searchsorted(rows, lt.alloc_row[disp].min())) - 1
    before = []
    while i >= 0 and ours(int(fwd[i])):
        before.append(int(fwd[i]))
        i -= 1
    j = int(np.searchsorted(rows, lt.alloc_row[comb].max(), side="right"))
    after = []
    while j < len(fwd) and ours(int(fwd[j])):
        after.append(int(fwd[j]))
        j += 1
    return before[::-1], after


def _with_layer_blocks(d: DeviceAnalysis, run: tuple[list[int], list[int]], disp: np.ndarray,
                       comb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A call whose exchanges alone are named (a dispatch written inline in the MoE layer's
    forward: no dispatcher function, so no word in the stack) with the layer's own forward
    blocks around them (`run`: `_layer_run`), none larger than the exchange."""
    before, after = run
    # none larger than the exchange: the padded buffer is what it exchanges (an einsum
    # dispatch's [tokens, experts, capacity] masks are larger: `_einsum_call`)
    cap = int(d.lt.size[disp].max())
    before = [b for b in before if d.lt.size[b] <= cap]
    after = [b for b in after if d.lt.size[b] <= cap]
    return (np.concatenate([np.array(before, np.int64), disp]),
            np.concatenate([comb, np.array(after, np.int64)]))


# GShard's gating functions, as DeepSpeed (before 0.19) and fairscale name them: the routes a
# token takes (k)
_GATINGS = {"top1gating": 1, "top2gating": 2}


def _einsum_call(d: DeviceAnalysis, run: tuple[list[int], list[int]],
                 big: int) -> tuple[float, list[int]] | None:
    """GShard's einsum dispatch (DeepSpeed's MOELayer before 0.19, fairscale's): the gating
    (`top1gating` / `top2gating`, k routes a token) makes [tokens, experts, capacity] combine
    weights and dispatch mask, `einsum("sec,sm->ecm")` the padded [experts, capacity, dim]
    buffer the all-to-all sends, and `einsum("sec,ecm->sm")` after the exchange back the
    layer's [tokens, dim] output. No tensor holds the routed rows, but the output holds the
    tokens: r = k x output / padded (tokens x k / (experts x capacity)), the output the last
    block after the exchange back whose r lies in 1/4..1. With the r, the gating's and the
    combine's blocks larger than the exchange (the [tokens, experts, capacity] tensors,
    capacity-sized too). None where the call is not such a dispatch (no gating frame with its
    k, no einsum making the padded buffer). `run`: the layer's blocks around the call
    (`_layer_run`)."""
    lt, snap = d.lt, d.snapshot
    before, after = run
    if not before or not after:
        return None
    k, einsum = None, False
    for b in before:
        names = {f.name for f in snap.stack_frames(int(lt.stack[b]))}
        k = next((_GATINGS[n] for n in names & _GATINGS.keys()), k)
        einsum = einsum or (int(lt.size[b]) == big and bool(names & {"einsum", "aten::einsum"}))
    # the output: the last block of a token-row size (cf up to 4, as the routed rows above; an
    # auxiliary loss or a count made after it is not)
    if k is None or not einsum:
        return None
    out = [int(lt.size[b]) for b in after if big / 4 <= k * int(lt.size[b]) <= big]
    if not out:
        return None
    return k * out[-1] / big, [b for b in before + after if lt.size[b] > big]


def _padding(d: DeviceAnalysis) -> tuple[list[tuple[int, int, int]], list[int], list[float]]:
    """The replay's (alloc, free, -bytes) intervals, the padded blocks, each padded call's r."""
    lt = d.lt
    extra, padded, ratios = [], [], []
    ratio_of: list[float] = []
    exchanged: dict[int, float] = {}  # each padded exchange's size: its call's r
    order: list[np.ndarray] = []  # the forward's blocks in trace order, once a call needs them

    def layer_run(disp: np.ndarray, comb: np.ndarray) -> tuple[list[int], list[int]]:
        if not order:
            rows = np.flatnonzero((d.phase == Phase.FORWARD) & (lt.alloc_row >= 0))
            order.append(rows[np.argsort(lt.alloc_row[rows], kind="stable")])
        return _layer_run(d, order[0], disp, comb)

    reads = []  # per call: (dispatch, combine, layer run, padded size, its blocks, routed)
    for disp, comb in _calls(d):
        run = None  # the layer's own blocks around the call, read once if it needs them
        if int((lt.size[disp] == lt.size[disp].max()).sum()) < 2:
            run = layer_run(disp, comb)
            disp, comb = _with_layer_blocks(d, run, disp, comb)
        sizes = lt.size[disp]
        big = int(sizes.max())
        # the exchange: two blocks or more at the largest size (a send buffer and the received
        # one: a static shape both ways; a dropless call receives one ragged buffer); the routed
        # rows: the call's first token-row block, the permuted tokens (>= big / 4: cf up to 4;
        # the int64 index tensors before it, 8 bytes a routed row, are 8 / (dim * itemsize) of
        # a token buffer)
        if int((sizes == big).sum()) < 2:
            continue
        call = np.concatenate([disp, comb])
        # the padded buffer, and what holds it with one zero row more (a decoder that gathers
        # each route's row out of it appends the row a dropped route reads: DeepSpeed's
        # `_sparse_decode`); one row is under 1 % of experts x capacity rows (>= 100: the
        # rounding this rule reads cf through is coarser below that)
        big_like = (lt.size[call] >= big) & (lt.size[call] <= big * 1.01)
        # the routed rows: the dispatch's permuted tokens, or, where the dispatch gathers each
        # slot's token straight from the layer's input (DeepSpeed's `_sparse_encode`: that
        # input, one zero row more, is the first block at least a quarter of `big`), the
        # combine's rows gathered back per route (not its exchange back, the first block of
        # the padded size, nor that one row more): the larger of the two
        cs = lt.size[comb]
        back = int(np.argmax(cs == big)) if (cs == big).any() else -1
        rest = [int(x) for i, x in enumerate(cs.tolist())
                if i != back and not big < x <= big * 1.01]
        # (a zero-filled block is a buffer to be filled, not the tokens: an inline dispatch
        # makes its send buffer first; without the op frames that say so it reads as the
        # routed rows, r = 1, and the call is left unsaid)
        wide = np.flatnonzero(sizes >= big / 4)
        first = next((int(sizes[i]) for i in wide.tolist()
                      if not _zero_filled(d, int(disp[i]))), big)
        reads.append((disp, comb, run, big, call, big_like, max([first, *rest])))
    # the routed rows have a static shape (tokens x k): a size that moves between the calls of
    # one padded size is the rows some routing kept (a dispatch that gathers the kept rows
    # only, and a combine that adds them back: at cf 1.0 with dropped tokens they read as
    # padding); r is not seen there, and those calls are left unsaid
    seen: dict[int, set[int]] = {}
    for *_, big, _, _, routed in reads:
        if routed < big:
            seen.setdefault(big, set()).add(routed)
    for disp, comb, run, big, call, big_like, routed in reads:
        if routed < big and len(seen[big]) > 1:
            continue
        r, gating = routed / big, list[int]()
        if r >= 1:  # no routed rows: an einsum dispatch's are its output's tokens x k
            einsum = _einsum_call(d, run or layer_run(disp, comb), big)
            if einsum is None or einsum[0] >= 1:
                continue
            r, gating = einsum
        shrink = call[big_like].tolist() + gating
        first, last = int(lt.alloc_row[disp].max()), int(lt.alloc_row[comb].min())
        made = (lt.alloc_row > first) & (lt.alloc_row < last)
        made &= d.category == CAT_CODE[Category.ACTIVATION]
        shrink += np.flatnonzero(made).tolist()
        for b in shrink:
            cut = int(lt.size[b]) - int(round(int(lt.size[b]) * r))
            if cut > 0:
                extra.append((int(lt.alloc_row[b]), int(lt.free_row[b]), -cut))
                padded.append(b)
                ratio_of.append(r)
        ratios.append(r)
        exchanged[big] = r
    if ratios:  # backward: the gradients of the padded tensors, at their sizes (a size that
        # some forward block not padded has too could be its gradient's: left as it is)
        sizes = {int(lt.size[b]): r for b, r in zip(padded, ratio_of)}
        fwd = (d.phase == Phase.FORWARD) & (lt.alloc_row >= 0)
        fwd[np.array(padded, np.int64)] = False
        for s in np.intersect1d(lt.size[fwd], np.fromiter(sizes, np.int64)).tolist():
            sizes.pop(int(s))
        grads = np.flatnonzero(np.isin(d.phase, BACKWARD_PHASES) & (lt.alloc_row >= 0) &
                               (d.category == CAT_CODE[Category.GRADIENT]) &
                               np.isin(lt.size, np.fromiter(sizes, np.int64, len(sizes))))
        shrunk = {b: sizes[int(lt.size[b])] for b in grads.tolist()}  # block: r
        # the experts' backward, where the backward's exchanges show (an MoE file's autograd
        # Function whose backward calls it again: DeepSpeed's `_AllToAll`): in each pair, the
        # gradient sent back through the combine's all-to-all, then the dispatch's, both of
        # the padded size; every gradient made between them is the padded rows' (a size a
        # block outside the MoE layer has too included)
        moe = np.flatnonzero(np.isin(d.phase, BACKWARD_PHASES) & (lt.alloc_row >= 0) &
                             np.isin(d.category, (CAT_CODE[Category.MOE_DISPATCH],
                                                  CAT_CODE[Category.MOE_COMBINE])) &
                             np.isin(lt.size, np.fromiter(exchanged, np.int64)))
        moe = moe[np.argsort(lt.alloc_row[moe], kind="stable")]
        if len(moe) % 2 == 0:
            grad = d.category == CAT_CODE[Category.GRADIENT]
            for x, y in zip(moe[::2].tolist(), moe[1::2].tolist()):
                r = exchanged[int(lt.size[x])]
                between = (lt.alloc_row > lt.alloc_row[x]) & (lt.alloc_row < lt.alloc_row[y])
                for b in [x, y, *np.flatnonzero(between & grad).tolist()]:
                    shrunk.setdefault(b, r)
        for b, r in sorted(shrunk.items()):
            cut = int(lt.size[b]) - int(round(int(lt.size[b]) * r))
            if cut > 0:
                extra.append((int(lt.alloc_row[b]), int(lt.free_row[b]), -cut))
                padded.append(b)
    return extra, padded, ratios


def check(d: DeviceAnalysis) -> list[Finding]:
    if d.peak_row < 0 or not d.mask(Category.MOE_DISPATCH).any():
        return []
    extra, padded, ratios = _padding(d)
    if not ratios:
        return []
    lt, p = d.lt, d.peak_row
    members = np.array(sorted(set(padded)), np.int64)
    alive = members[lt.alive_at(p)[members]]
    pad_at_peak = sum(-n for a, e, n in extra if a <= p < e)
    predicted = max(int(lt.replay(extra=extra).max()), lt.baseline)
    saving = d.peak_bytes - predicted
    anomalous = lowers_peak(d, saving)
    cf = 1 / min(ratios)
    padded_bytes = int(lt.size[alive].sum())
    evidence = {"capacity_factor_seen": round(cf, 3), "calls_padded": len(ratios),
                "padded_blocks_at_peak": int(len(alive)), "padding_bytes_at_peak": pad_at_peak,
                "padded_bytes_at_peak": padded_bytes,
                "stacks": top_stacks(d, alive if len(alive) else members, 1)}
    cause = (f"{len(ratios)} MoE call(s) exchange about {cf:.2f}x the routed token rows: each "
             "expert's all-to-all slot is padded to its capacity, and the experts compute on "
             f"the padding too. At the peak {human(pad_at_peak)} of "
             f"{human(padded_bytes)} in those buffers hold no token.")
    if not anomalous:
        cause += " The padding does not raise this run's peak: a lower capacity would not lower it."
    return [Finding.replayed(
        anomalous, rule=RULE.id,
        title=f"MoE buffers padded to capacity (capacity factor about {cf:.2f})", cause=cause,
        bytes=pad_at_peak, blocks=int(len(alive)), device=d.device,
        fix=FIX.format(cf=cf), predicted=predicted, saving=saving, evidence=evidence,
        replay=Replay(extra=tuple(extra)), members=members)]


RULE = Rule(
    id="moe.capacity_padding", check=check, family=Family.PARALLELISM,
    verdicts=frozenset({Verdict.ANOMALOUS, Verdict.INFO}), fix=FIX.format(cf=1.25))
