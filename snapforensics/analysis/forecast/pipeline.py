"""Pipeline forecast: each stage's peak at another pipeline degree, micro-batch count and
schedule, from recordings of the stages (one file per stage, or one stage standing for all).

The model. A pipeline step on one stage is a sequence of operations, `F k` (micro-batch k's
forward: its `Forward k` range to the next one's) and `B k` (its `Backward k` range), between
what was alive when the step began (parameters, optimizer state, the batch) and what runs after
its last backward (the optimizer). The schedule only chooses their order on stage s of S with M
micro-batches: GPipe runs every F before any B; 1F1B runs min(M, S - s) F first, then one B
before each further F (torch's `Schedule1F1B._step_microbatches`). So the recorded step is cut
into its operations and the trace rebuilt in the new order, each block keeping its offset in
the operation that made it and in the one that frees it:

- a block made in `F k` and freed in `B k` (what micro-batch k saved for its backward) is made
  and freed by the same micro-batch's operations in the new order; one made in an operation and
  freed in a later one of the same kind moves with that distance (a send waited on at the next
  forward);
- what ScheduleGPipe keeps referenced until the step returns (its lists of send works: freed
  after the last backward, before the optimizer) is freed where 1F1B drops it: a forward's
  output at its micro-batch's backward (the stage's forward cache), a backward's gradient send
  after the next backward, where it is waited on; a forward send GPipe waits on after the last
  forward is waited on after the next forward;
- a block alive from before the step or freed after it (parameters, their gradients, made in
  the first backward and accumulated in place) keeps its place.

Sizes. Another micro-batch count with the same global batch scales what the operations make
(activations, sends, receive buffers) by M / M'; the parameters' gradients (made in a backward,
alive into the optimizer) do not. Another pipeline degree S' puts L / S' of the model's L layers
on a stage, and (L / S') / (layers recorded on the stage) scales what belongs to the layers: the
parameters of numbered layers, their gradients and optimizer state, and what a forward saves
for its micro-batch's backward; of that, the layers' outputs by (L' - 1) / (L - 1) (a stage of
L layers saves the outputs of L - 1, the last one's is its send: `_forward_sends`). What lives
and dies inside one operation does not (one layer's temporaries: their maximum does not grow
with the layers), nor what crosses the stage's boundary (sends, receive buffers, the outputs
kept for the step), nor parameters outside the numbered layers (embeddings, the head). The
layer count is read from the recorder's tensor names (`layers.3.mlp.w1.weight` -> layer
`layers.3`); L is the recorded stages' sum when every stage's
file is given, else one stage's times S (an even split); a file without names forecasts other
micro-batch counts and schedules but refuses another degree. Stage s' of S' is forecast from
the recorded stage in the same position: the first from the first, the last from the last, a
middle one from a recorded middle stage, else from the last (it receives activations as a
middle stage does) without what the last stage does beyond its layers: its norm, head and loss
(`_head`, told by the recorder's names of saved tensors), what it keeps for the step's return,
the head's parameters and state; it sends each forward's output on instead and receives
gradients as the first stage does. On the last stage, what the head saves does not scale with
the layers, and its layers' outputs are told by its last layer's output's path.

The operations are delimited by ScheduleGPipe's own `Forward i` / `Backward i` ranges, or, for
any schedule, by the ranges `snapforensics record` opens around each stage's
`forward_one_chunk` / `backward_one_chunk` (the recorder wraps them as the script imports
pipelining); an operation runs from its mark to the next one's.
FSDP sharding the stages (FSDP + PP): which operations gather depends on the order (torch's
pipelining keeps what a backward gathers until the next forward reshards it or the step's
REDUCE_GRAD does), so FSDP's unsharded parameters and all-gather buffers are replayed per unit
(`Gathers`) rather than copied, and the parameters' unsharded gradients stay to the REDUCE_GRAD.

An interleaved schedule as the scenario (ScheduleInterleaved1F1B, V stages per rank): torch's
order on each rank (`order`); each of a rank's stages rebuilt from the recorded stage in that
stage's position at its share of the layers, the operations of all laid out in the rank's order
(`_interleaved_peak`); torch's looped runtime waits on every send as the step returns, so what a
send holds stays to the step's end.

Another FSDP world size (the ranks FSDP shards a stage over) or TP degree with those changes:
each block's size scaled first as the world-size and TP forecasts scale it (forecast/scaling.py,
`StageSource.sizes`), the step then rebuilt from those sizes.

An interleaved recording as the source (a rank running several stages, the recorder's marks
naming each): each of the rank's stages is a source of its own, its operations those its marks
delimit, its layers the rank's named layers split in order (torchtitan keeps the whole model's
layer names on each stage), the parameters and gathers of the rank's other stages left out, its
share of the rank's receive buffers, and the sends held to the step's end (the looped runtime).

What is not modelled, and refused or noted: a zero-bubble recording or scenario (weight
gradients computed apart from the backward), a trace without either kind of range, layers that
do not split evenly, an interleaved recording whose stages name their layers alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from snapforensics.analysis.context import DeviceAnalysis
from snapforensics.analysis.forecast.documents import Scenario
from snapforensics.analysis.forecast.scaling import scaled_sizes, scaling, tp_shares
from snapforensics.analysis.frameworks.detect import DEEPSPEED_PIPE
from snapforensics.analysis.fsdp import ranges as fsdp_ranges
from snapforensics.analysis.fsdp.units import ROOT
from snapforensics.analysis.identity import layer_of
from snapforensics.analysis.vocab import FSDP_CATEGORIES, Category, Phase
from snapforensics.snapshot.tensors import KINDS

SCHEMA = "snapforensics.pipeline_forecast/1"
GPIPE, ONE_F_ONE_B, INTERLEAVED = "gpipe", "1f1b", "interleaved_1f1b"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED)
MAX_VIRTUAL = 64  # stages per rank of an interleaved schedule (Megatron's runs use 2 to 8)
# the rebuilt step's rows (its live bytes are dense arrays over them: 2^25 rows, 256 MiB each)
MAX_ROWS = 1 << 25
# bounds of a scenario: each new micro-batch rebuilds its operations' blocks once more, so the
# work grows with M' (the largest pipelines run tens of stages, a few hundred micro-batches)
MAX_STAGES = MAX_MICROBATCHES = 1024
MAX_WORLD = 1 << 20  # an FSDP world size (the world-size forecast's bound)


@dataclass(frozen=True)
class PipeScenario:
    stages: int  # ranks of the pipeline (stages per rank: `virtual`)
    microbatches: int
    schedule: str
    virtual: int = 1  # stages each rank runs (interleaved: its model chunks)
    world_size: int | None = None  # ranks FSDP shards a stage over (dp_shard); None: recorded
    tp: int | None = None  # tensor-parallel degree; None: as recorded


def parse_schedule(text: str) -> tuple[str, int]:
    """`gpipe`, `1f1b`, `interleaved[:V]` / `interleaved_1f1b[:V]` (V stages per rank, 2 when
    not given) -> (schedule, V); ValueError otherwise."""
    name, _, v = text.strip().lower().partition(":")
    if name == "interleaved":
        name = INTERLEAVED
    if name not in SCHEDULES or (v and name != INTERLEAVED):
        raise ValueError(text)
    virtual = int(v) if v else (2 if name == INTERLEAVED else 1)
    if name == INTERLEAVED and not 2 <= virtual <= MAX_VIRTUAL:
        raise ValueError(text)
    return name, virtual


@dataclass
class StageSource:
    """One recorded stage, cut into its step's operations."""

    d: DeviceAnalysis
    stage: int | None
    stages: int | None
    microbatches: int
    schedule: str
    layers: int | None  # numbered layers whose parameters this stage holds
    ops: dict[tuple[str, int], tuple[int, int]]  # (F|B, k) -> rows [r0, r1)
    start: int  # the step's first row
    end: int  # the row after its last backward
    stop: int  # where the step's rows end (the next step's start, or the trace's end)
    layer_params: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    # a rank running several stages (an interleaved recording): how many, the layers of all,
    # the blocks of the other stages' layers, this stage's share of the receive buffers
    virtual: int = 1
    rank_layers: int | None = None
    others: np.ndarray | None = None
    p2p_share: float = 1.0
    regular: bool = True  # its rank ran ScheduleInterleaved1F1B's order (what the pairs ran)
    # its rank ran every forward, on every stage, before any backward (ScheduleLoopedBFS)
    looped_bfs: bool = False
    # (world, tp) -> `sizes`, shared by the sources of one recording (they scale alike)
    _sizes: dict = field(default_factory=dict, repr=False)
    _paths: dict = field(default_factory=dict, repr=False)  # stack -> `path`

    @cached_property
    def head_cuts(self) -> tuple[np.ndarray, np.ndarray] | None:
        """`_head_cuts`, found once."""
        return _head_cuts(self)

    @cached_property
    def gathered(self) -> Gathers | None:
        """FSDP's gathers on this stage (`gathers`), None when FSDP does not shard it or its
        ranges do not place them."""
        return gathers(self)

    @cached_property
    def param_grads(self) -> np.ndarray:
        return _param_grads(self.d)

    @cached_property
    def born_dies(self) -> tuple[np.ndarray, np.ndarray]:
        """Each block's operation (its index in `ops`) that made it and that freed it, -1 for
        none (before the step, between operations, after the last backward)."""
        lt = self.d.lt
        op_of = np.full(lt.rows + 1, -1, np.int64)
        for i, (r0, r1) in enumerate(self.ops.values()):
            op_of[r0:r1] = i
        a, f = lt.alloc_row, lt.free_row
        return (np.where((a >= 0) & (a < lt.rows), op_of[np.clip(a, 0, lt.rows)], -1),
                np.where(f < lt.rows, op_of[np.clip(f, 0, lt.rows)], -1))

    @cached_property
    def sends(self) -> np.ndarray:
        """Blocks a forward makes that its stage sends on (`_forward_sends`)."""
        return _forward_sends(self)[0]

    def path(self, stack: int) -> tuple:
        """The code path of `stack` inside the stage: its frames below the recorder's mark or
        its `marked` wrapper, the layer modules' instances set aside (`Block_3` read as
        `Block`); () outside the marks."""
        paths = self._paths
        if stack not in paths:
            snap = self.d.snapshot
            ids = snap.stacks[stack] if 0 <= stack < len(snap.stacks) else ()
            frames = [snap.frames[f] for f in ids]
            cut = next((i for i, f in enumerate(frames) if MARK.match(f.name) or (
                f.name == "marked" and f.filename.endswith("snapforensics/record/_bootstrap.py"))),
                0)
            paths[stack] = tuple((f.filename, f.line, _INSTANCE.sub("", f.name)
                                  if f.filename == "<nn.Module>" else f.name)
                                 for f in frames[:cut])
        return paths[stack]

    @cached_property
    def deepspeed(self) -> bool:
        """DeepSpeed's PipelineEngine ran the stage: one receive buffer per kind, reused by
        every micro-batch (`pipe_recv_buf`, `grad_layer`), not one per micro-batch as torch's
        stages keep."""
        return any(f.filename.endswith(DEEPSPEED_PIPE) for f in self.d.snapshot.frames)

    @cached_property
    def rings(self) -> tuple[np.ndarray, np.ndarray]:
        """DeepSpeed's pipe buffers (`pipe_buffers`, made in the step), and which of them are
        the last stage's outputs: a ring of slots per kind (`TrainSchedule.num_pipe_buffers`),
        each micro-batch's entry kept until a later one takes its slot, past the step for the
        last ones: what `_exec_recv_activations` and `_exec_load_micro_batch` put there
        (received activations, loaded batches and labels), and on the last stage the outputs
        (its `_exec_backward_pass` returns before clearing them)."""
        lt = self.d.lt
        ring, outputs = np.zeros(len(lt), bool), np.zeros(len(lt), bool)
        if not self.deepspeed:
            return ring, outputs
        born, dies = self.born_dies
        keys = list(self.ops)
        fills = {int(x) for x in np.unique(lt.stack[born >= 0]).tolist() if x >= 0 and any(
            f.name in _DEEPSPEED_FILLS for f in self.d.snapshot.stack_frames(int(x)))}
        last = self.stage is not None and self.stage == (self.stages or 0) - 1
        for b in np.flatnonzero(born >= 0).tolist():
            kind, k = keys[born[b]]
            if int(lt.stack[b]) in fills:
                ring[b] = True
            elif last and kind == "F" and (dies[b] < 0 or keys[dies[b]][1] != k) and \
                    not self.param_grads[b] and lt.free_row[b] >= self.ops[(kind, k)][1]:
                ring[b] = outputs[b] = True
        return ring, outputs

    @cached_property
    def head(self) -> np.ndarray:
        """What the pipeline's last stage does beyond its layers (`_head`)."""
        return _head(self)

    @cached_property
    def layer_outputs(self) -> np.ndarray:
        """Blocks a forward saves that are a layer's output (`_forward_sends`)."""
        return _forward_sends(self)[1]

    @cached_property
    def _scaling(self) -> tuple[int | None, np.ndarray, tuple]:
        w0 = self.d.fsdp.world.size
        cls = scaling(self.d, w0)
        return w0, cls, tp_shares(self.d, cls)

    @property
    def world_size(self) -> int | None:
        """The ranks FSDP shards this stage over (its dp_shard degree), None without FSDP."""
        return self.d.fsdp.world.size if self.d.mask(*FSDP_CATEGORIES).any() else None

    @property
    def tp(self) -> int | None:
        """The recorded TP degree (the most ways the recorder saw TP split a tensor, as
        `tp_shares` reads it), None when none is named."""
        names = self.d.names
        return int(names.tp.max()) if names is not None and (names.tp > 1).any() else None

    def sizes(self, world: int | None, tp: int | None) -> np.ndarray:
        """Every block's size at FSDP world size `world` and TP degree `tp` (None: as
        recorded), scaled as the world-size and TP forecasts scale it (forecast/scaling.py):
        shards by w0 / w, what TP splits by tp0 / tp."""
        key = (world, tp)
        if key not in self._sizes:
            if (world is None or world == self.world_size) and (tp is None or tp == self.tp):
                self._sizes[key] = self.d.lt.size.astype(np.float64)
                return self._sizes[key]
            w0, cls, shares = self._scaling
            sc = Scenario(world or w0 or 1, tp=tp or shares[0])
            self._sizes[key] = scaled_sizes(self.d, cls, w0, sc, shares).astype(np.float64)
        return self._sizes[key]

    def refusal(self, world: int | None, tp: int | None) -> str | None:
        """Why this stage cannot be forecast at `world` / `tp`, None when it can."""
        if world is not None and world != self.world_size:
            if self.world_size is None:
                return ("no FSDP on this stage (or its world size is unknown): nothing in it "
                        "scales with the data-parallel degree")
        if tp is not None and tp != self.tp and self.tp is None:
            return ("no tensor split by tensor parallelism is named in this recording (the "
                    "recorder names DTensors on a mesh dim called 'tp'): the TP degree cannot "
                    "change")
        return None

    @cached_property
    def param_state(self) -> np.ndarray:
        """Parameters and what the optimizer keeps of them (the recorder's names)."""
        return _named(self.d, ("parameter", "gradient", "optimizer_state"))


@dataclass
class StagePrediction:
    stage: int
    source_stage: int | None
    layers: int | None
    held: int  # micro-batches whose activations the stage holds at most
    predicted_peak_bytes: int | None = None
    refused: str | None = None

    def to_dict(self) -> dict:
        return {"stage": self.stage, "source_stage": self.source_stage, "layers": self.layers,
                "held_microbatches": self.held, "predicted_peak_bytes": self.predicted_peak_bytes,
                "refused": self.refused}


def _layer_params(d: DeviceAnalysis) -> tuple[int | None, np.ndarray]:
    """Numbered layers among the stage's parameters (tensor names), and which blocks are
    parameters of one (or their gradients and optimizer state: they scale with the layers).

    An optimizer's parameter the model does not name (the recorder's `param_groups.G.params.J`:
    ZeRO's flat partition, every layer's parameters in one buffer) is no layer; where it holds
    them all, the layers are counted by the numbered modules that saved activations."""
    mask = np.zeros(len(d.lt), bool)
    names = d.names
    if names is None:
        return None, mask
    layers, saved = set(), set()
    flat = False
    for b in np.flatnonzero(names.ident >= 0).tolist():
        ident = names.identity(b)
        if ident is None:
            continue
        layer = layer_of(ident.module)
        if not any(s.isdigit() for s in layer.split(".")):
            continue
        if ident.kind == "saved_for_backward":
            saved.add(layer)
        elif ident.kind in ("parameter", "gradient", "optimizer_state"):
            mask[b] = True
            if ident.kind == "parameter":
                if layer.startswith("param_groups."):
                    flat = True
                else:
                    layers.add(layer)
    return (len(layers or (saved if flat else ())) or None), mask


def _named(d: DeviceAnalysis, kinds: tuple[str, ...]) -> np.ndarray:
    """Blocks the recorder's names give one of `kinds`."""
    if d.names is None:
        return np.zeros(len(d.lt), bool)
    hit = np.array([i.kind in kinds for i in d.names.table.identities] + [False], bool)
    return hit[d.names.ident]  # -1 (unnamed) takes the last: False


def _param_grads(d: DeviceAnalysis) -> np.ndarray:
    """Blocks holding a parameter's gradient (the recorder's names; FSDP's unsharded gradient
    by its category): kept from the first backward, not sent on like an input's gradient."""
    return d.mask(Category.UNSHARDED_GRAD) | _named(d, ("gradient", "unsharded_gradient"))


def _forward_sends(src: StageSource) -> tuple[np.ndarray, np.ndarray]:
    """What each forward of a stage before the last sends on, and what it saves that is a
    layer's output. Both are found by their code path inside the stage (the frames below the
    recorder's mark or its `marked` wrapper, the layer modules' instances set aside: `Block_3`
    read as `Block`; a GPU trace has no module frames, and the path is the same for every
    layer). The path is that of what the last forward made and left to the step's end (the
    schedule's send of the stage's output; 1F1B's last `fwd_sends`), the layers' parameters and
    state aside. The stage's output is its last layer's, so in each forward the last block on
    that path is the send; the others freed by their micro-batch's backward are earlier layers'
    outputs, saved by the next layer (a stage of L layers saves L - 1). Under 1F1B the sends too
    are freed with their micro-batch's backward, so only this tells them apart. The last stage
    sends nothing: its path is that of what each forward makes last before the rest (`_head`:
    its last layer's output), and the others on it are its layers' outputs."""
    lt = src.d.lt
    sends, outputs = np.zeros(len(lt), bool), np.zeros(len(lt), bool)
    last = ("F", src.microbatches - 1)
    if last not in src.ops or src.stage is None or src.stages is None:
        return sends, outputs
    path = src.path
    a, f = lt.alloc_row, lt.free_row
    keys = list(src.ops)
    born_in, dies_in = src.born_dies
    others = src.others if src.others is not None else np.zeros(len(lt), bool)
    forward = np.array([k[0] == "F" for k in keys] + [False])  # (-1: no operation)
    made = np.flatnonzero((a >= src.start) & (a < src.end) & ~src.layer_params & ~others &
                          forward[born_in])
    made = made[np.argsort(a[made], kind="stable")]  # in allocation order
    # one path per distinct stack, not per block
    stacks, inv = np.unique(lt.stack[made], return_inverse=True)
    key = [path(int(x)) for x in stacks.tolist()]
    r0, r1 = src.ops[last]
    in_last = (a[made] >= r0) & (a[made] < r1)
    final = src.stage == src.stages - 1
    if final:
        # the last stage sends nothing: its last layer's output is what each forward makes
        # last before the rest (`_head`: the norm, head, loss), on its layers' outputs' path
        cuts = src.head_cuts
        if cuts is None:
            return sends, outputs
        layers = a[made] < cuts[0][born_in[made]]
        before = np.flatnonzero(in_last & layers)
        if not before.size:
            return sends, outputs
        sent = {key[inv[before[-1]]]} - {()}
        made, inv = made[layers], inv[layers]
    else:
        held = in_last & (f[made] >= src.end) & (f[made] < src.stop)
        sent = {key[i] for i in np.unique(inv[held]).tolist()} - {()}
    on = made[np.array([k in sent for k in key] + [False])[inv]] if made.size else made
    if not on.size:
        return sends, outputs
    # in each forward, the last block on the path is the send; the others its micro-batch's
    # backward frees are earlier layers' outputs
    op = born_in[on]
    order = np.argsort(op, kind="stable")  # group by forward, allocation order kept
    on, op = on[order], op[order]
    last_of = np.r_[op[1:] != op[:-1], True]
    if not final:
        sends[on[last_of]] = True
    index = {k: i for i, k in enumerate(keys)}
    own_b = np.array([index.get(("B", k[1]), -2) for k in keys])
    rest = on[~last_of]
    outputs[rest[dies_in[rest] == own_b[born_in[rest]]]] = True
    return sends, outputs


_INSTANCE = re.compile(r"_\d+$")


def _head(src: StageSource) -> np.ndarray:
    """On the pipeline's last stage, what its operations make beyond the numbered layers: the
    final norm, the head, the loss and their backward. Told by the recorder's names of saved
    tensors: a forward runs its layers, then the rest, so from the first tensor it saves outside
    a numbered layer (the norm's input, the head's, the loss's) everything it makes is the rest;
    a backward runs the rest first, so until it frees the last of those its forward saved,
    everything it makes is (the layers' parameters' gradients aside). A middle stage rebuilt
    from this stage leaves these out. Nothing on another stage or a recording without names."""
    cuts = src.head_cuts
    out = np.zeros(len(src.d.lt), bool)
    if cuts is None:
        return out
    cut_f, cut_b = cuts
    a, born_in = src.d.lt.alloc_row, src.born_dies[0]
    n = len(src.ops)
    forward = np.array([k[0] == "F" for k in src.ops] + [False])
    op = np.where(born_in >= 0, born_in, n)
    f = src.d.lt.free_row
    out[:] = np.where(forward[op], a >= cut_f[op], (born_in >= 0) & (f <= cut_b[op]))
    return out & ~src.layer_params


def _head_unnamed(src: StageSource) -> bool:
    """The pipeline's last stage, with parameters outside the numbered layers (a norm, a head)
    named and no saved tensor named: `_head` cannot find them."""
    names = src.d.names
    if names is None or src.stages is None or src.stage != src.stages - 1 or \
            (names.saver >= 0).any():
        return False
    return bool(((names.kinds == KINDS.index("parameter")) & ~src.layer_params).any())


def _head_cuts(src: StageSource) -> tuple[np.ndarray, np.ndarray] | None:
    """`_head`'s rows per operation (index in `ops`; one more for none): in a forward, the
    first that makes a tensor saved outside the numbered layers (none: the int64 maximum); in
    a backward, the last that frees one its forward saved (none: -1). None when the stage is not
    the last or its recording names no such tensor."""
    d, lt = src.d, src.d.lt
    names = d.names
    if names is None or src.stage is None or src.stages is None or \
            src.stage != src.stages - 1 or not src.ops:
        return None
    a, f = lt.alloc_row, lt.free_row
    born_in, dies_in = src.born_dies
    keys = list(src.ops)
    forward = np.array([k[0] == "F" for k in keys] + [False])
    index = {k: i for i, k in enumerate(keys)}
    own_b = np.array([index.get(("B", k[1]), -2) for k in keys] + [-2])
    saved = np.flatnonzero((names.saver >= 0) & forward[born_in])
    ids = names.table.identities
    outside = np.array([not any(p.isdigit() for p in layer_of(
        ids[int(names.saver[b])].module).split(".")) for b in saved.tolist()], bool)
    if not outside.any():
        return None
    # what a layer makes and the rest saves (the last layer's output, the norm's input) is
    # the layers': it is made where the layers make what the next layer saves
    layer_paths = {src.path(int(x)) for x in np.unique(lt.stack[saved[~outside]]).tolist()}
    saved = saved[outside]
    saved = saved[np.array([src.path(int(lt.stack[b])) not in layer_paths
                            for b in saved.tolist()], bool)]
    if not saved.size:
        return None
    n = len(keys)
    cut_f = np.full(n + 1, np.iinfo(np.int64).max)
    np.minimum.at(cut_f, born_in[saved], a[saved])
    mine = saved[dies_in[saved] == own_b[born_in[saved]]]  # freed by its own backward
    cut_b = np.full(n + 1, -1)
    np.maximum.at(cut_b, dies_in[mine], f[mine])
    return cut_f, cut_b


# DeepSpeed's PipelineEngine instructions that fill a slot of its pipe buffers
_DEEPSPEED_FILLS = frozenset({"_exec_recv_activations", "_exec_load_micro_batch"})

# ScheduleGPipe's own ranges around each micro-batch (torch/distributed/pipelining/schedules.py)
RANGE = re.compile(r"^(Forward|Backward) (\d{1,9})$")
Span = tuple[int, int]


def _spans(d: DeviceAnalysis, pattern: re.Pattern) -> list[tuple[int, tuple, int]]:
    """Each closed range of `d`'s device whose name matches `pattern`: (start row, the name's
    groups, end row), in start order."""
    opened: dict[tuple, int] = {}
    out = []
    for a in d.snapshot.annotations:
        m = pattern.match(a.name) if a.device == d.device else None
        if not m:
            continue
        if a.stage == "START":
            opened[m.groups()] = a.row
        elif m.groups() in opened:
            out.append((opened.pop(m.groups()), m.groups(), a.row))
    out.sort()
    return out


def gpipe_ranges(d: DeviceAnalysis) -> list[dict[tuple[str, int], Span]]:
    """Per step (a run of ranges from `Forward 0`), each (kind, micro-batch) range's rows."""
    steps: list[dict[tuple[str, int], Span]] = []
    for r0, (kind, mb), r1 in _spans(d, RANGE):
        if (kind, mb) == ("Forward", "0") or not steps:
            steps.append({})
        steps[-1][(kind, int(mb))] = (r0, r1)
    return steps


def all_forward_first(step: dict[tuple[str, int], Span]) -> int:
    """M when the step ran M >= 2 forwards, each before its first backward, and M backwards;
    else 0 (not GPipe's order)."""
    fwd = sorted(mb for kind, mb in step if kind == "Forward")
    bwd = sorted(mb for kind, mb in step if kind == "Backward")
    m = len(fwd)
    if m < 2 or fwd != list(range(m)) or bwd != fwd:
        return 0
    first_b = min(step[("Backward", j)][0] for j in bwd)
    return m if max(step[("Forward", i)][0] for i in fwd) < first_b else 0


def made_in_forward(step: dict[tuple[str, int], Span], k: int, m: int) -> Span:
    """Rows of micro-batch k's forward: its `Forward k` to the next one's (the loss a last stage
    computes after the range belongs to it), the last one's to the first `Backward`."""
    end = step[("Forward", k + 1)][0] if k + 1 < m else step[("Backward", 0)][0]
    return step[("Forward", k)][0], end


Ops = dict[tuple[str, int], tuple[int, int]]
# the recorder's marks around each micro-batch's forward and backward (record/_bootstrap.py)
MARK = re.compile(r"^snapforensics\.pp (forward|backward) (-?\d{1,9}) (\d{1,9})$")


def _gpipe_steps(d: DeviceAnalysis) -> list[Ops]:
    """Steps cut from ScheduleGPipe's own ranges: `F k` from its `Forward k` to the next one's
    (the loss a last stage computes after the range belongs to it), the last to the first
    `Backward`; `B k` from its `Backward k` to the next one's."""
    out = []
    for step in gpipe_ranges(d):
        m = all_forward_first(step)
        if not m:
            continue
        ops = {}
        for k in range(m):
            ops[("F", k)] = made_in_forward(step, k, m)
            nxt = step[("Backward", k + 1)][0] if k + 1 < m else step[("Backward", k)][1]
            ops[("B", k)] = (step[("Backward", k)][0], nxt)
        out.append(ops)
    return out


def marked_stages(d: DeviceAnalysis, spans: list | None = None) -> set[int]:
    """The stage indices the recorder's marks show on `d`'s device: more than one when a rank
    runs several stages (an interleaved or zero-bubble schedule)."""
    return {int(st) for _, (_, st, _), _ in (_spans(d, MARK) if spans is None else spans)}


def _marked_steps(d: DeviceAnalysis) -> list[dict[int | None, Ops]]:
    """Steps cut from the recorder's marks (any schedule): each operation from its mark to the
    next one's (the receives and sends the schedule runs between them go with the operation
    before), the step's last to its own end; per stage the rank runs (its index in the marks:
    several under an interleaved schedule), that stage's operations; a step starts at
    micro-batch 0's forward of the rank's first stage."""
    spans = _spans(d, MARK)
    first = min(marked_stages(d, spans), default=0)
    steps: list[list[tuple[int, str, int, int, int]]] = []
    for r0, (kind, st, mb), r1 in spans:
        op = ("F" if kind == "forward" else "B", int(mb))
        if (op == ("F", 0) and int(st) == first) or not steps:
            steps.append([])
        steps[-1].append((r0, *op, int(st), r1))
    out = []
    for step in steps:
        by: dict[int | None, Ops] = {}
        for i, (r0, kind, k, st, r1) in enumerate(step):
            by.setdefault(st, {})[(kind, k)] = (r0, step[i + 1][0] if i + 1 < len(step) else r1)
        whole = True
        for ops in by.values():
            fwd = sorted(k for kind, k in ops if kind == "F")
            bwd = sorted(k for kind, k in ops if kind == "B")
            # a step the marks do not cover whole (cut by the recording's window)
            whole &= len(fwd) >= 2 and fwd == list(range(len(fwd))) and bwd == fwd and \
                len(fwd) == len(next(iter(by.values()))) // 2
        if whole:
            out.append(by)
    return out


def _schedule_of(ops: Ops) -> str:
    first_b = min(r0 for (kind, _), (r0, _) in ops.items() if kind == "B")
    return GPIPE if all(r0 < first_b for (kind, _), (r0, _) in ops.items() if kind == "F") \
        else ONE_F_ONE_B


def _span(ops: Ops) -> tuple[int, int]:
    return min(r0 for r0, _ in ops.values()), max(r1 for _, r1 in ops.values())


def _chunk_layers(d: DeviceAnalysis, v: int) -> list[tuple[int, np.ndarray]] | str:
    """The rank's numbered layers split over its `v` stages in order (torchtitan splits a model
    by deleting the layers another stage runs: a stage keeps the whole model's names, so the
    rank's first stage holds its lowest-numbered layers), as (layers, blocks of their
    parameters, gradients and optimizer state) per stage; or why they cannot be."""
    names = d.names
    if names is None:
        return ("the recording names no layers (record with `snapforensics record`): which of "
                "the rank's stages holds which parameters is unknown")
    layer: dict[int, str] = {}
    params: dict[int, list[int]] = {}  # identity -> its parameter blocks
    for b in np.flatnonzero(names.ident >= 0).tolist():
        ident = names.identity(b)
        if ident is None or ident.kind not in ("parameter", "gradient", "optimizer_state"):
            continue
        name = layer_of(ident.module)
        if any(x.isdigit() for x in name.split(".")):
            layer[b] = name
            if ident.kind == "parameter":
                params.setdefault(int(names.ident[b]), []).append(b)
    lt = d.lt
    for bs in params.values():  # one name, two parameters alive at once: names of one stage
        live = sorted((int(lt.alloc_row[b]), int(lt.free_row[b])) for b in bs)
        if any(b0[1] > b1[0] for b0, b1 in zip(live, live[1:])):
            return ("two of the rank's stages name their parameters alike (a stage that keeps "
                    "the whole model's layer names, as torchtitan's splitting does, tells them "
                    "apart)")
    numbered = sorted({layer[bs[0]] for bs in params.values()}, key=_natural_key)
    if not numbered:
        return ("the recording names none of the rank's layers (the recorder names the "
                "parameters an optimizer or FSDP holds): which stage holds which is unknown")
    if len(numbered) % v:
        return f"{len(numbered)} named layers do not split over the rank's {v} stages"
    # FSDP's unsharded parameters and all-gather buffers: a unit's by its module (a looped
    # runtime gathers a stage's units ahead of its first forward, inside another stage's rows)
    for b in np.flatnonzero(d.mask(Category.UNSHARDED_PARAM, Category.ALL_GATHER)).tolist():
        name = layer_of(d.module_of(b))
        if name in numbered:
            layer.setdefault(b, name)
    n = len(numbered) // v
    out = []
    for j in range(v):
        mine = set(numbered[j * n:(j + 1) * n])
        mask = np.zeros(len(lt), bool)
        mask[[b for b, name in layer.items() if name in mine]] = True
        out.append((n, mask))
    return out


def _natural_key(name: str) -> list:
    """`layers.10` after `layers.9`: a run of ASCII digits by its length, then its text (never
    int(): a name from a snapshot may hold any digits, and as many as it likes)."""
    return [(0, len(x.lstrip("0")), x.lstrip("0")) if x.isascii() and x.isdigit() else (1, 0, x)
            for x in name.split(".")]


def zero_bubble(snapshot) -> bool:
    """Did a stage compute weight gradients apart from its backward (the zero-bubble schedules'
    `backward_weight_one_chunk`, which the recorder's marks do not delimit)?"""
    return any(f.name == "backward_weight_one_chunk" for f in snapshot.frames)


def stage_steps(d: DeviceAnalysis) -> list[StageSource] | str:
    """Every step of the stage recorded in `d` its ranges delimit, cut into operations (one
    source per stage the rank runs, the same step's sharing its rows); or why none can be."""
    if zero_bubble(d.snapshot):
        return ("a zero-bubble schedule (its stages compute weight gradients apart from the "
                "backward, `backward_weight_one_chunk`): not modelled")
    steps: list[dict[int | None, Ops]] = [{None: o} for o in _gpipe_steps(d)]
    if not steps:
        steps = _marked_steps(d)
    if not steps:
        return ("the trace does not delimit the micro-batches' forwards and backwards (record "
                "with `snapforensics record`, which marks them, or use ScheduleGPipe, whose "
                "ranges do)")
    layout = d.layout
    stage, stages = layout.index("pp"), layout.degree("pp")
    stage = stage if type(stage) is int else None
    stages = stages if type(stages) is int else None
    layers, lp = _layer_params(d)
    v = max(len(s) for s in steps)
    chunks = _chunk_layers(d, v) if v > 1 else None
    if isinstance(chunks, str):
        return chunks
    spans = [(min(_span(o)[0] for o in st.values()), max(_span(o)[1] for o in st.values()))
             for st in steps]
    out = []
    sized: dict = {}  # every source of `d` scales its blocks alike: one `sizes` cache
    for step, (start, end) in zip(steps, spans):
        stop = min([s for s, _ in spans if s > end], default=d.lt.rows)
        if chunks is None:
            ops = next(iter(step.values()))
            out.append(StageSource(d, stage, stages, len(ops) // 2, _schedule_of(ops), layers,
                                   ops, start, end, stop, lp, _sizes=sized))
            continue
        if len(step) != v:
            continue
        total = stages * v if stages else None
        gs = sorted(g for g in step if g is not None)
        m = len(step[gs[0]]) // 2
        ran = [(kind, gs.index(g) * m + k) for _, kind, k, g in
               sorted((r0, kind, k, g) for g in gs for (kind, k), (r0, _) in step[g].items())]
        regular = stage is not None and stages is not None and \
            ran == order(INTERLEAVED, stage, stages, m, v)
        bfs = ran[m * v - 1][0] == "F" and ran[m * v][0] == "B"
        # each stage's receive buffers (one per micro-batch for activations unless it is the
        # pipeline's first, one for gradients unless its last): its share of the rank's
        want = [(g > 0) + (total is None or g < total - 1) for g in gs]
        for j, g in enumerate(gs):
            ops = step[g]
            others = np.zeros(len(d.lt), bool)
            for i, (_, mask) in enumerate(chunks):
                if i != j:
                    others |= mask
            out.append(StageSource(d, g, total, len(ops) // 2, INTERLEAVED, chunks[j][0], ops,
                                   start, end, stop, chunks[j][1], virtual=v,
                                   rank_layers=layers, others=others,
                                   p2p_share=want[j] / max(sum(want), 1), regular=regular,
                                   looped_bfs=bfs,
                                   _sizes=sized))
    return out


def source(d: DeviceAnalysis) -> StageSource | str:
    """The step of `d` a forecast starts from: the one holding the peak, else the last (its
    first stage, where the rank runs several: `sources`)."""
    srcs = sources(d)
    return srcs if isinstance(srcs, str) else srcs[0]


def sources(d: DeviceAnalysis) -> list[StageSource] | str:
    """The step of `d` a forecast starts from (the one holding the peak, else the last), one
    source per stage the rank runs."""
    steps = stage_steps(d)
    if isinstance(steps, str):
        return steps
    if not steps:
        return "no step whose every stage the marks cover whole"
    at = next((s for s in steps if s.start <= d.peak_row <= s.end), steps[-1]).start
    return [s for s in steps if s.start == at]


def order(schedule: str, stage: int, stages: int, m: int, virtual: int = 1
          ) -> list[tuple[str, int]]:
    """The operations of stage `stage` of `stages` over `m` micro-batches, in run order; under
    an interleaved schedule, of rank `stage` running `virtual` stages, micro-batch k of its
    j-th stage numbered j * m + k."""
    if schedule == GPIPE:
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    if schedule == INTERLEAVED:
        return _interleaved(stage, stages, m, virtual)
    w = min(m, stages - stage)
    out = [("F", k) for k in range(w)]
    for k in range(m):
        out.append(("B", k))
        if w + k < m:
            out.append(("F", w + k))
    return out


def interleaved_refusal(stages: int, m: int) -> str | None:
    rounds = max(1, m // stages)
    if m % rounds:
        return (f"ScheduleInterleaved1F1B needs the micro-batches ({m}) a multiple of its "
                f"rounds ({rounds} = max(1, {m} // {stages} stages))")
    return None


def _interleaved(rank: int, stages: int, m: int, v: int) -> list[tuple[str, int]]:
    """torch's ScheduleInterleaved1F1B on one rank (`_get_warmup_ops`, `_get_1f1b_rank_ops`
    in pipelining/schedules.py, without the idle slots): warm-up forwards, then a forward and a
    backward each, then the remaining backwards; forwards go through the rank's stages a round
    of micro-batches at a time, backwards through them in reverse."""
    per_round = m // max(1, m // stages)
    warmup = min((v - 1) * per_round + 2 * (stages - 1 - rank), m * v)
    steady = m * v - warmup
    fwd = [0] * v
    bwd = [0] * v
    out = []

    def forward(op: int) -> None:
        j = (op // per_round) % v
        out.append(("F", j * m + fwd[j]))
        fwd[j] += 1

    def backward(op: int) -> None:
        j = v - 1 - ((op - warmup) // per_round) % v
        out.append(("B", j * m + bwd[j]))
        bwd[j] += 1

    for op in range(warmup + steady + warmup):
        if op < warmup:
            forward(op)
        elif op < warmup + steady:
            forward(op)
            backward(op)
        else:
            backward(op)
    return out


def held(seq: list[tuple[str, int]], m: int) -> int:
    """The most micro-batches one stage of the rank has run the forward of and not the
    backward (what it holds activations for), over `seq` (`order`)."""
    now: dict[int, int] = {}
    most = 0
    for kind, i in seq:
        now[i // m] = now.get(i // m, 0) + (1 if kind == "F" else -1)
        most = max(most, now[i // m])
    return most


def _template(k: int, m_new: int, m_rec: int) -> int:
    """The recorded micro-batch standing for new micro-batch k: itself, the last for the last
    (its backward is the step's last), a middle one for those beyond the recorded count."""
    if k == m_new - 1:
        return m_rec - 1
    return min(k, max(m_rec - 2, 0))


@dataclass
class Gathers:
    """FSDP2's gathers on a stage it shards, recorded once per unit and kind of operation, to be
    replayed as the new order needs them.

    torch's pipelining runs every backward but the step's REDUCE_GRAD with
    `set_reshard_after_backward(False)` and `set_requires_gradient_sync(False)`
    (pipelining/stage.py: `backward_maybe_with_nosync`, `perform_reduce_grad`): a backward gathers
    a unit's parameters only when they are not already gathered and keeps them; a forward gathers
    only when they are not, and reshards them at its post-forward (reshard_after_forward); the
    REDUCE_GRAD after the last backward reshards what is still gathered. Whether an operation
    gathers thus depends on the one before it, which the schedule changes: GPipe's backwards after
    the first gather nothing, 1F1B's gather again after each forward. So the unsharded parameters
    and all-gather buffers are not copied from the operation that made them but replayed per unit
    from the first recorded gather of each kind of operation (`package`), moved into the new
    operation by FSDP's own ranges (`marks`, `move`), freed at the new operation's post-forward
    or where the step's REDUCE_GRAD freed them."""

    blocks: np.ndarray  # the gathered blocks the replay makes (the rebuild copies the rest)
    marks: dict[tuple[str, int], dict[tuple, int]]  # op -> FSDP range (kind, unit) -> its row
    # (kind, unit) -> the operation gathering it, its parameters (block, alloc row) and
    # all-gather buffers (block, alloc row, free row)
    package: dict[tuple[str, str], tuple[tuple[str, int], list, list]]
    # unit -> the first forward resharding it and its parameters' free rows there (absent: its
    # forward keeps them, reshard_after_forward=False)
    reshard: dict[str, tuple[tuple[str, int], list[int]]]
    end_frees: dict[str, list[int]]  # unit -> the REDUCE_GRAD's frees of its parameters
    end: int  # the row after the last backward (the REDUCE_GRAD's)
    tables: dict = field(default_factory=dict)  # (ref, op) -> `move`'s interpolation table

    def move(self, ref: tuple[str, int], op: tuple[str, int], row: int) -> int:
        """`row` of operation `ref` moved into operation `op` (rows of the recording): linearly
        between the ranges both opened, in order in both (an operation that gathers nothing
        runs its units' ranges closer together: the gather's rows are spread between them)."""
        table = self.tables.get((ref, op))
        if table is None:
            here, there = self.marks[ref], self.marks[op]
            xs: list[int] = []
            ys: list[int] = []
            for k, r in sorted(here.items(), key=lambda x: x[1]):
                if k not in there:
                    continue
                if not xs or (r > xs[-1] and there[k] > ys[-1]):
                    xs.append(r)
                    ys.append(there[k])
            table = self.tables[(ref, op)] = (xs, ys)
        return int(round(float(np.interp(row, *table))))

    def runs(self, op: tuple[str, int], unit: str) -> bool:
        return ("pre_forward" if op[0] == "F" else "pre_backward", unit) in self.marks[op]

    def order(self, unit: str) -> int:
        """Where the unit runs in the step's first forward (forward order)."""
        first = min(op for op in self.marks if op[0] == "F")
        return self.start(first, unit) if self.runs(first, unit) else 0

    def start(self, op: tuple[str, int], unit: str) -> int:
        """Where the unit's parameters are gathered in `op` when they are not already: the
        earliest of its ranges there that gather (a backward prefetches the next unit's from
        the one before)."""
        return min(r for (kind, u), r in self.marks[op].items()
                   if u == unit and kind in _GATHER[op[0]])

    def span(self, op: tuple[str, int], unit: str) -> int:
        """Rows from the unit's start in `op` to the next unit's (or the operation's end)."""
        at = self.start(op, unit)
        later = [self.start(op, u) for (kind, u) in self.marks[op]
                 if kind == "pre_" + ("forward" if op[0] == "F" else "backward")]
        later = [r for r in later if r > at] + [self.marks[op][("end", "")]]
        return min(later) - at


_GATHER = {"F": ("all_gather", "pre_forward"),
           "B": ("all_gather", "backward_prefetch", "pre_backward")}


def gathers(src: StageSource) -> Gathers | None:
    """The stage's gathers (`Gathers`), or None when FSDP does not shard it."""
    d, lt = src.d, src.d.lt
    a, f = lt.alloc_row, lt.free_row
    in_ops = np.zeros(lt.rows + 1, bool)  # this stage's operations (a rank may run several)
    for r0, r1 in src.ops.values():
        in_ops[r0:r1] = True
    inside = (a >= src.start) & (a < src.end) & (
        in_ops[np.clip(a, 0, lt.rows)] | (src.layer_params if src.virtual > 1 else False))
    if src.virtual > 1:  # the looped runtime's UNSHARD, before the rank's first mark: FSDP's
        # own blocks (a backend thread's copy, gloo's, lives through the mark or not by timing)
        backend = np.array([i.backend for i in d.infos], bool)[d.info] if d.infos else \
            np.zeros(len(lt), bool)
        gathered = d.mask(Category.UNSHARDED_PARAM, Category.ALL_GATHER) & ~backend
        inside |= (a < src.start) & (f > src.start) & gathered
        if src.stage not in (0, (src.stages or 0) - 1):  # a unit outside the numbered layers
            for b in np.flatnonzero(inside & gathered).tolist():  # (an embedding, a head) is
                inside[b] = any(p.isdigit() for p in str(d.module_of(b) or "").split("."))
                # an end stage's, wherever the rank's runtime gathered it
    if src.others is not None:
        inside &= ~src.others
    params = d.mask(Category.UNSHARDED_PARAM) & inside
    buffers = d.mask(Category.ALL_GATHER) & inside
    if not params.any():
        return None
    bounds = sorted((r0, r1, op) for op, (r0, r1) in src.ops.items())
    starts = [r0 for r0, _, _ in bounds]
    marks: dict[tuple[str, int], dict[tuple, int]] = {
        op: {("start", ""): r0, ("end", ""): r1} for r0, r1, op in bounds}
    for row, name in d.annotation_rows(fsdp_ranges.RANGE):
        r = fsdp_ranges.parse(name)
        i = int(np.searchsorted(starts, row, "right")) - 1
        if r is not None and i >= 0 and row < bounds[i][1]:
            marks[bounds[i][2]].setdefault((r.kind, r.fqn or ROOT), row)
    # FSDP2 names a unit's blocks and ranges by its module (the root's ranges by none)
    unit = {b: d.module_of(b) or ROOT for b in np.flatnonzero(params | buffers).tolist()}
    born: dict[tuple[tuple[str, int], str], list[int]] = {}
    for b, u in sorted(unit.items(), key=lambda x: int(a[x[0]])):
        i = int(np.searchsorted(starts, a[b], "right")) - 1
        if i < 0 or a[b] >= bounds[i][1]:  # before its operation (a looped runtime's UNSHARD)
            i = min(i + 1, len(bounds) - 1)
        born.setdefault((bounds[i][2], str(u)), []).append(b)
    for at, u in born:  # every gather in an operation that opened the unit's range
        if ("pre_forward" if at[0] == "F" else "pre_backward", u) not in marks[at]:
            return None  # one no range places: the copies stand, and the band says so
    package: dict[tuple[str, str], tuple[tuple[str, int], list, list]] = {}
    reshard: dict[str, tuple[tuple[str, int], list[int]]] = {}
    end_frees: dict[str, list[int]] = {}
    for u in sorted({str(u) for u in unit.values()}):
        for kind in ("F", "B"):
            op = next((op for _, _, op in bounds if op[0] == kind and (op, u) in born), None)
            if op is None:
                continue
            bs = born[(op, u)]
            package[(kind, u)] = (op, [(b, int(a[b])) for b in bs if params[b]],
                                  [(b, int(a[b]), int(f[b])) for b in bs if buffers[b]])
            mine = [b for b in bs if params[b]]
            if kind == "F" and mine and all(f[b] < src.ops[op][1] for b in mine):
                reshard[u] = (op, [int(f[b]) for b in mine])
        ended = [b for b, v in unit.items() if v == u and params[b] and src.end <= f[b] < src.stop]
        end_frees[u] = [int(f[b]) for b in sorted(ended, key=lambda b: int(a[b]))]
    return Gathers(np.flatnonzero(params | buffers), marks, package, reshard, end_frees, src.end)


@dataclass
class Rebuilt:
    """The rebuilt step: one row per block instance (a block of a micro-batch's operation once
    per new micro-batch it stands for), its source block, rows and size; -1 = alive from the
    start."""

    rows: int
    block: np.ndarray
    alloc: np.ndarray
    free: np.ndarray
    size: np.ndarray

    def live(self) -> np.ndarray:
        n = self.rows + 1
        delta = np.bincount(np.maximum(self.alloc, 0), self.size, n) - \
            np.bincount(np.minimum(self.free, self.rows), self.size, n)
        return np.cumsum(delta[:self.rows])

    def peak(self) -> tuple[int, int]:
        live = self.live()
        if not self.rows:
            return int(round(float(self.size[self.alloc < 0].sum()))), -1
        row = int(np.argmax(live))
        return int(round(float(live[row]))), row


def rebuild(src: StageSource, sc: PipeScenario, stage: int, layer_ratio: float,
            chunk: int | None = None, timeline: dict[tuple[str, int], int] | None = None,
            edge: bool | None = None) -> Rebuilt:
    """The step of stage `stage` under `sc`, rebuilt from the recorded one (module docstring),
    with what runs after its last backward until the next step. Under an interleaved schedule,
    what the rank's stage `chunk` makes (`layer_ratio` its layers' ratio), its operations placed
    at `timeline` (each operation's first row in the rank's step, every stage's operations
    laid out: `_timeline`): its layers' parameters and receive buffers; the parameters outside
    the layers (embeddings, a head) when it is the pipeline's first or last stage (`edge`; by
    default, whether `stage` is); the rest the step holds (the batch) with the rank's stage 0.
    A middle stage rebuilt from the last stage's recording leaves out what that stage does
    beyond its layers (`_head`: the norm, head and loss, the outputs it keeps for the step's
    return) and sends each forward's output on instead: the size of a received activation
    (what the layers take in, they give out), held as the schedule holds a send."""
    d, lt = src.d, src.d.lt
    if edge is None:
        edge = stage in (0, sc.stages * sc.virtual - 1)
    # from an end stage: what is not the layers' (its embedding or head, their state) stays there
    from_end = not edge and src.stage is not None and src.stages is not None and \
        src.stage in (0, src.stages - 1) and src.stages > 1
    from_last = from_end and src.stage == (src.stages or 0) - 1
    # a middle stage rebuilt from a recording that holds more than a middle stage's: an end
    # stage's, or a rank of an interleaved recording (its other stages' head or embedding)
    foreign = not edge and (from_end or src.virtual > 1)
    seq = order(sc.schedule, stage, sc.stages, sc.microbatches, sc.virtual)
    # each new operation's recorded template and the offset of its rows in the new trace
    tmpl = {x: (x[0], _template(x[1] % sc.microbatches, sc.microbatches, src.microbatches))
            for x in seq}
    if timeline is None:
        timeline = _timeline(seq, {x: src for x in seq}, tmpl)
    if chunk is not None:
        seq = [x for x in seq if x[1] // sc.microbatches == chunk]
    offsets = {x: timeline[x] - src.ops[tmpl[x]][0] for x in seq}
    pos = timeline[("end", -1)]
    tail = pos - src.end  # rows after the last backward keep their distance from it
    rows = pos + (src.stop - src.end)
    whole = not chunk  # what is not the layers' comes once per rank
    keys = list(src.ops)
    born_in, dies_in = src.born_dies
    a, f, size = lt.alloc_row, lt.free_row, src.sizes(sc.world_size, sc.tp)
    scale_mb = src.microbatches / sc.microbatches
    freed_phase = d.tl.phase[np.clip(f, 0, max(lt.rows - 1, 0))]
    blocks: list[int] = []
    allocs: list[int] = []
    frees: list[int] = []
    sizes: list[float] = []

    def add(b: int, ar: int, fr: int, sz: float) -> None:
        blocks.append(b)
        allocs.append(ar)
        frees.append(max(fr, ar + 1))
        sizes.append(sz)

    def after(b: int) -> int:  # a free after the last backward: its place after the step
        return int(f[b]) + tail if f[b] < src.stop else rows

    runs_of: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for x in seq:
        runs_of.setdefault(tmpl[x], []).append(x)
    len_of = {x: src.ops[tmpl[x]][1] - src.ops[tmpl[x]][0] for x in seq}
    # each recorded backward -> the new one that runs at its place among the stage's backwards
    # (the i-th to run, the last for the last: `_template` over run positions)
    ran_b = [op for op in sorted(src.ops, key=lambda op: src.ops[op][0]) if op[0] == "B"]
    new_b = [x for x in seq if x[0] == "B"]
    last_b = ran_b[-1] if ran_b else None  # where FSDP's REDUCE_GRAD ran: B M-1 in order
    backward_at: dict[tuple[str, int], tuple[str, int]] = {}
    for q in range(len(new_b) - 1, -1, -1):  # the first new one standing for each
        pos = _template(q, len(new_b), len(ran_b))
        if pos < len(ran_b):
            backward_at[ran_b[pos]] = new_b[q]

    def runs_of_first(key: tuple[str, int]) -> tuple[str, int] | None:
        return runs_of[key][0] if key in runs_of else None

    # alive when the step begins: parameters and their state scale with the layers; what is
    # freed inside the step (the batch's chunks) goes where its operation now runs
    p2p = d.mask(Category.PP_P2P)
    state = src.param_state
    others = src.others if src.others is not None else np.zeros(len(size), bool)
    replayed = np.zeros(len(size), bool)
    if src.gathered is not None:
        replayed[src.gathered.blocks] = True
    drop_state = foreign or not edge and chunk is not None
    for b in np.flatnonzero((a < src.start) & (f > src.start) & ~others & ~replayed).tolist():
        if drop_state and state[b] and not src.layer_params[b]:
            continue  # an embedding, a head and their state: an end stage's
        if chunk is not None and not (src.layer_params[b] or p2p[b] or state[b] or whole):
            continue
        sz = size[b] * (layer_ratio if src.layer_params[b] else
                        src.p2p_share * (scale_mb if src.deepspeed else 1.0) if p2p[b] else 1.0)
        if f[b] >= src.end:
            add(b, -1, after(b), sz)
            continue
        runs = runs_of_first(keys[dies_in[b]]) if dies_in[b] >= 0 else None
        add(b, -1, int(f[b]) + offsets[runs] if runs else rows, sz)
    # made inside the step, once per new operation its own stands for
    m_new, last = sc.microbatches, src.microbatches - 1
    # a stage before the last sends its outputs on; the last keeps them for the step's return
    sends = src.stage is None or src.stages is None or src.stage < src.stages - 1
    gpipe = src.schedule == GPIPE
    # what the source's runtime waits on only as the step returns: GPipe's lists of works, the
    # looped runtime's every send (an interleaved recording)
    held_sends = src.schedule in (GPIPE, INTERLEAVED)
    one_f = sc.schedule != GPIPE
    # torch's runtime for looped schedules (`_PipelineScheduleRuntime._step_microbatches`)
    # waits on every send as the step returns: what a send holds (a forward's output, a
    # backward's input gradient) stays to the step's end, as under GPipe's lists of works
    looped = sc.schedule == INTERLEAVED
    crossing = ~src.layer_params  # what may cross micro-batches (not the layers' state)
    g = src.gathered
    made = (born_in >= 0) & ~others  # (another stage's gathers a looped runtime ran here)
    if g is not None:
        made[g.blocks] = False  # replayed below
    grads = src.param_grads
    rings, ring_outputs = src.rings
    # DeepSpeed ZeRO's gradient bucket: `reduce_bucket_size` elements, whatever the micro-batch
    # and the layers (its first backward's hook makes it, the step's reduction frees it)
    fixed = d.mask(Category.DEEPSPEED_REDUCE_BUCKET)
    # a stage of L layers saves the outputs of L - 1 (the last one's is sent)
    outputs_ratio = (layer_ratio * src.layers - 1) / (src.layers - 1) \
        if src.layers and src.layers > 1 else layer_ratio
    lone_layer = src.layers == 1 and layer_ratio > 1

    def outputs_freed(inst: tuple[str, int]) -> list[int]:
        """A stage of one layer shows no layer's output: each of the L' - 1 layers before the
        last saves one, the size of the send, freed as the backward of the layer after it
        ends (the new backward's rows in L' equal parts)."""
        own = ("B", inst[1])
        if inst[0] != "F" or own not in offsets:
            return []
        r0t, r1t = src.ops[tmpl[own]]
        n = int(round(layer_ratio))
        return [offsets[own] + r0t + (r1t - r0t) * j // n for j in range(1, n)]

    for b in np.flatnonzero(made).tolist():
        kind, k = keys[born_in[b]]
        freed = keys[dies_in[b]] if dies_in[b] >= 0 else None
        # a parameter's gradient: made in a backward, kept into the optimizer (or, unsharded,
        # to the REDUCE_GRAD that reduce-scatters it after the last backward)
        # (the looped runtime's REDUCE_GRAD runs inside a stage's last backward)
        bucket = kind == "B" and bool(fixed[b])  # made once, as a gradient is
        to_optimizer = bucket or kind == "B" and (freed is None or freed == last_b) and (
            f[b] >= src.stop or freed_phase[b] == Phase.OPTIMIZER or bool(grads[b])) and \
            not rings[b]
        if to_optimizer and drop_state and state[b] and not src.layer_params[b]:
            continue  # a head's or an embedding's gradient: not on a middle stage
        if from_last and (src.head[b] or (kind == "F" and freed is None and not to_optimizer)
                          or ring_outputs[b]):
            continue  # the norm, head and loss, the outputs kept for the step's return
        # what ScheduleGPipe keeps referenced longer than 1F1B would: the forward sends it
        # waits on after the last forward (made in one forward, freed in the last), and the
        # sends its lists of works hold until the step returns (freed after the last backward,
        # before the optimizer): a forward's output (1F1B frees it when its micro-batch's
        # backward drops the stage's forward cache; the last stage keeps its outputs for the
        # step's return under both) and a backward's gradient send (1F1B waits on it at the
        # next backward)
        phase_wait = gpipe and kind == "F" and freed == ("F", last) and k < last
        step_wait = held_sends and freed is None and not to_optimizer and f[b] < src.stop
        # Schedule1F1B drops a backward's sends at the next backward (its `bwd_sends` list is
        # replaced then): the one before the last backward is freed past the last mark, where
        # it would read as held to the step's end
        next_wait = not held_sends and kind == "B" and k == last - 1 and freed is None and \
            not to_optimizer and f[b] < src.stop
        # made for one micro-batch, freed by another's operation: what the schedule's sends
        # hold (the send's work keeps its tensor until the peer receives it)
        crosses = not to_optimizer and (
            (freed is not None and freed[1] != k and bool(crossing[b])) or bool(src.sends[b]))
        # per layer of the stage: what a forward saves for its micro-batch's backward and the
        # parameters' gradients (one per parameter, not per micro-batch); not: what lives and
        # dies inside one operation (one layer's temporaries: their maximum does not grow with
        # the layers), what crosses the stage's boundary (sends, receive buffers, outputs) and
        # what the last stage saves beyond its layers (the norm's, the head's, the loss's)
        per_layer = to_optimizer or (kind == "F" and freed == ("B", k) and not src.sends[b]
                                     and not src.head[b])
        sz = size[b] * (outputs_ratio if src.layer_outputs[b] else layer_ratio if per_layer
                        else 1.0) * (1.0 if to_optimizer else scale_mb) if not bucket else size[b]
        # (a parameter's gradient is made once, by the backward that runs in the new order
        # where the one that made it ran among the stage's backwards, at its offset there:
        # the first ran B 0 in order, B M-1 under ScheduleLoopedBFS, whose backwards run in
        # reverse; the last, where FSDP reduce-scatters)
        insts = runs_of.get((kind, k), ())
        if to_optimizer:
            inst = backward_at.get((kind, k))
            insts = [inst] if inst is not None and insts else []
        for inst in insts:
            ar = int(a[b]) + offsets[inst]
            if to_optimizer:
                ar = timeline[inst] + min(int(a[b]) - src.ops[(kind, k)][0], len_of[inst] - 1)
            if lone_layer and src.sends[b]:
                for fr in outputs_freed(inst):
                    add(b, ar, fr, sz * (layer_ratio - 1) / max(round(layer_ratio) - 1, 1))
            nxt = (kind, inst[1] + 1)
            own = ("B", inst[1])
            if looped and (phase_wait or step_wait or next_wait or crosses):
                fr = tail + src.end  # a send: the looped runtime waits on them as it returns
            elif one_f and phase_wait and nxt in offsets:
                fr = src.ops[tmpl[nxt]][1] + offsets[nxt]  # waited on after the next forward
            elif one_f and step_wait and kind == "F" and sends and \
                    own in offsets:
                fr = src.ops[tmpl[own]][1] + offsets[own]  # dropped by its own backward
            elif one_f and step_wait and kind == "B" and nxt in offsets:
                fr = src.ops[tmpl[nxt]][1] + offsets[nxt]  # waited on at the next backward
            elif one_f and next_wait and nxt in offsets:  # as recorded, after the next one
                fr = src.ops[tmpl[nxt]][1] + offsets[nxt] + int(f[b]) - src.end
            elif phase_wait:  # after the last forward, where it was
                fr = int(f[b]) + offsets[("F", m_new - 1)]
            elif freed is not None:
                target = (freed[0], inst[1] + freed[1] - k)
                if to_optimizer:  # the REDUCE_GRAD in its stage's last backward
                    target = ("B", inst[1] - inst[1] % m_new + m_new - 1)
                if target in offsets:  # the same distance in the new order
                    r0t, r1t = src.ops[tmpl[target]]
                    fr = offsets[target] + min(r0t + int(f[b]) - src.ops[freed][0], r1t)
                else:  # its freeing operation has no instance: freed where its own op ends
                    fr = src.ops[(kind, k)][1] + offsets[inst]
            else:
                fr = after(b)
            add(b, ar, fr, sz)
    if from_last:  # each forward's output sent on, the size of a received activation
        recv = np.flatnonzero(p2p & (a < src.start) & (f >= src.end) & ~others)
        for x in (x for x in seq if x[0] == "F") if recv.size else ():
            b = int(recv[np.argmax(size[recv])])
            own = ("B", x[1])
            fr = src.ops[tmpl[own]][1] + offsets[own] if one_f and not looped and \
                own in offsets else tail + src.end
            add(b, src.ops[tmpl[x]][1] - 1 + offsets[x], fr, size[b] * scale_mb)
    if g is not None:
        _replay_gathers(g, seq, tmpl, offsets, lambda row: row + tail, layer_ratio, size, add,
                        drop_state)
    # made after the last backward: the optimizer's temporaries, its state of the layers and
    # FSDP's sharded gradients scale with the layers; what the optimizer phase makes that
    # outlives the step and is not the layers' (the next step's batch, made after `step()`)
    # does not
    # (the rank's: a stage of an interleaved recording takes its layers' share of the unnamed)
    # FSDP's sharded gradients, and under DeepSpeed's engine a gradient made after the last
    # backward that is gone by the next step: its flat all-reduce bucket of the stage's gradients
    # (`allreduce_bucket`), which scales with the layers as they do
    sharded = d.mask(Category.SHARDED_GRAD)
    if src.deepspeed:
        sharded = sharded | (d.mask(Category.GRADIENT) & (f < src.stop))
    share = (src.layers or 1) / src.rank_layers if src.rank_layers else 1.0
    for b in np.flatnonzero((a >= src.end) & (a < src.stop) & ~others).tolist():
        optimizer = d.tl.phase[a[b]] == Phase.OPTIMIZER
        if foreign and (chunk is None or from_last) and not optimizer and not sharded[b] \
                and not fixed[b]:  # (ZeRO's bucket: every stage's)
            continue  # the last stage's step return (its outputs merged, the losses)
        per_layer = bool(sharded[b]) or optimizer and (
            bool(src.layer_params[b]) or f[b] < src.stop)
        if whole or per_layer:
            r = (layer_ratio if src.layer_params[b] else layer_ratio * share) if per_layer \
                and not fixed[b] else 1.0
            add(b, int(a[b]) + tail, after(b), size[b] * r)
    if rings.any():  # each slot's entry freed as the micro-batch that many later takes it
        slots = max(2, min(sc.stages * sc.virtual - stage, sc.microbatches))
        _turn_rings(lt.stack, rings, slots, blocks, allocs, frees)
    return Rebuilt(rows, np.array(blocks, np.int64), np.array(allocs, np.int64),
                   np.array(frees, np.int64), np.array(sizes, np.float64))


def _turn_rings(stack: np.ndarray, rings: np.ndarray, slots: int, blocks: list[int],
                allocs: list[int], frees: list[int]) -> None:
    """DeepSpeed's pipe buffers in the rebuilt step: the entries one instruction puts in its
    ring (the instances of one stack, in the order they are made: one per micro-batch) each
    freed as the entry `slots` later is made in its slot (`TrainSchedule.num_pipe_buffers`:
    max(2, min(stages - stage, micro-batches))); the last `slots` keep what the rebuild gave
    them (the step's end: the next step takes their slots)."""
    by: dict[int, list[int]] = {}
    for i, b in enumerate(blocks):
        if rings[b] and allocs[i] >= 0:
            by.setdefault(int(stack[b]), []).append(i)
    for entries in by.values():
        entries.sort(key=lambda i: allocs[i])
        for i, j in zip(entries, entries[slots:]):
            frees[i] = max(allocs[j] + 1, allocs[i] + 1)


def _unit_copies(units: list[str], ratio: float) -> list[tuple[str, float, float, float]]:
    """The units a stage of `ratio` times the recorded layers runs, as (recorded unit, fraction
    of its span it is shifted by, fraction it takes, scale on its sizes). Units of numbered
    layers (`layers.3`, FSDP wrapping each alike): the last k when the stage holds k of them
    (its backward gathers the last first and prefetches the one before it during that one's
    backward, where a stage's backward peaks: every m-th unit left the prefetch out there, -5.8%
    on 1F1B's last stages), each m times in its span when m times as many, else each once at
    `ratio` times its size;
    the others (the root's embeddings, a norm and head) once, as recorded. With no numbered unit
    (FSDP wrapping the whole stage) every unit holds the layers: each at `ratio`."""
    layered = [u for u in units if any(p.isdigit() for p in u.split("."))] or units
    out = [(u, 0.0, 1.0, 1.0) for u in units if u not in layered]
    n = len(layered)
    k = n * ratio
    if n and abs(k - round(k)) < 1e-9 and round(k) >= 1:
        k = int(round(k))
        if k <= n and n % k == 0:
            return out + [(u, 0.0, 1.0, 1.0) for u in layered[n - k:]]
        if k % n == 0:
            m = k // n
            return out + [(u, j / m, 1 / m, 1.0) for u in layered for j in range(m)]
    return out + [(u, 0.0, 1.0, ratio) for u in layered]


def _timeline(seq: list[tuple[str, int]], srcs: dict[tuple[str, int], StageSource],
              tmpl: dict[tuple[str, int], tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Each operation's first row in the rebuilt step (its recorded template's rows laid end to
    end, each from its stage's source), and ("end", -1): the row after the last."""
    out = {}
    pos = 0
    for x in seq:
        r0, r1 = srcs[x].ops[tmpl[x]]
        out[x] = pos
        pos += r1 - r0
    if pos > MAX_ROWS:
        from snapforensics.errors import SnapError

        raise SnapError(f"pipeline forecast: the rebuilt step would run {pos:,} rows (more "
                        f"than {MAX_ROWS:,}): forecast fewer micro-batches or stages per rank")
    out[("end", -1)] = pos
    return out


def _replay_gathers(g: Gathers, seq, tmpl, offsets, after_step, ratio: float, size, add,
                    layers_only: bool = False) -> None:
    """Each unit's gathers in the new order (`Gathers`): gathered in an operation that runs it
    when not already, freed at a forward's post-forward or by the step's REDUCE_GRAD; only the
    layers' units when `layers_only` (a middle stage rebuilt from an end stage's recording)."""
    for u, frac, width, scale in _unit_copies(sorted({u for _, u in g.package}, key=g.order),
                                              ratio):
        if layers_only and not any(p.isdigit() for p in u.split(".")):
            continue
        held: list[tuple[int, int]] | None = None  # (block, alloc row) of its gathered params
        for x in seq:
            t, off = tmpl[x], offsets[x]
            if not g.runs(t, u):
                continue
            span = g.span(t, u)
            off += int(frac * span)
            # a copy's buffers are gone when the next copy gathers (FSDP's prefetch chain)
            cap = g.start(t, u) + off + int(width * span) if width < 1 else None
            if held is None:
                pkg = g.package.get((x[0], u)) or g.package.get(("B" if x[0] == "F" else "F", u))
                if pkg is None:
                    continue
                ref, ps, bufs = pkg
                for b, ar, fr in bufs:
                    fr = g.move(ref, t, fr) + off
                    add(b, g.move(ref, t, ar) + off, fr if cap is None else min(fr, cap),
                        size[b] * scale)
                held = [(b, g.move(ref, t, ar) + off) for b, ar in ps]
            if x[0] == "F" and u in g.reshard:
                ref, frees = g.reshard[u]
                for i, (b, ar) in enumerate(held):
                    fr = g.move(ref, t, frees[min(i, len(frees) - 1)]) + off
                    add(b, ar, fr, size[b] * scale)
                held = None
        for i, (b, ar) in enumerate(held or ()):  # to the REDUCE_GRAD
            ends = g.end_frees.get(u) or [g.end]
            add(b, ar, after_step(ends[min(i, len(ends) - 1)]), size[b] * scale)


def _no_layers(src: StageSource, what: str) -> str:
    """Why `what` is refused on a stage whose layers are not counted."""
    if src.d.names is None:
        return (f"the recording names no layers (record with `snapforensics record` for tensor "
                f"names): {what} is refused")
    return (f"the recorder's names show no numbered layer's parameters (an optimizer's flat "
            f"buffer holds them, as ZeRO's does): {what} is refused")


def predict(srcs: list[StageSource], sc: PipeScenario) -> list[StagePrediction]:
    """Each stage of `sc` forecast from the recorded stage in its position."""
    by_stage = {s.stage: s for s in srcs if s.stage is not None}
    rec_stages = srcs[0].stages
    # the model's layers: every recorded stage's when all are here, else an even split assumed
    whole = rec_stages is not None and len(by_stage) == rec_stages and \
        all(s.layers for s in by_stage.values())
    total_stages = sc.stages * sc.virtual
    # another FSDP world size or TP degree: every stage's blocks scaled as forecast/scaling.py
    # scales them (the same classes as the world-size and TP forecasts)
    mesh_refusal = next((r for s in srcs if (r := s.refusal(sc.world_size, sc.tp))), None)

    def pick(st: int) -> StageSource:
        """The recorded stage in the position of stage `st` (of all the pipeline's)."""
        if not (by_stage and rec_stages):
            return srcs[0]
        if st == 0:
            got = by_stage.get(0)
        elif st == total_stages - 1:
            got = by_stage.get(rec_stages - 1)
        else:
            got = next((by_stage[i] for i in range(1, rec_stages - 1) if i in by_stage),
                       by_stage.get(rec_stages - 1))
        return got or srcs[0]

    out = []
    for st in range(sc.stages):
        src = pick(st)
        p = StagePrediction(st, src.stage, None, held(
            order(sc.schedule, st, sc.stages, sc.microbatches, sc.virtual), sc.microbatches))
        ratio = 1.0
        if sc.stages != (src.stages or sc.stages):
            total = sum(s.layers or 0 for s in by_stage.values()) if whole else \
                (src.layers or 0) * (src.stages or 0)
            if not src.layers:
                p.refused = _no_layers(src, "another pipeline degree")
            elif total % (sc.stages * sc.virtual):
                p.refused = (f"{total} layers do not split evenly over "
                             f"{sc.stages * sc.virtual} stages")
            else:
                p.layers = total // sc.stages
                ratio = p.layers / src.layers
        else:
            p.layers = src.layers
            if sc.virtual > 1 and src.layers and src.layers % sc.virtual:
                p.refused = (f"{src.layers} layers do not split evenly over "
                             f"{sc.virtual} stages per rank")
            elif sc.virtual > 1 and not src.layers:
                p.refused = _no_layers(src, "an interleaved schedule")
        if sc.schedule == INTERLEAVED and p.refused is None:
            p.refused = interleaved_refusal(sc.stages, sc.microbatches)
        if p.refused is None:
            p.refused = mesh_refusal
        if p.refused is None and sc.virtual > 1:
            p.predicted_peak_bytes = _interleaved_peak(sc, st, pick, (p.layers or 0) //
                                                       sc.virtual)
        elif p.refused is None:
            parts = [rebuild(src, sc, st, ratio)]
            parts += _gradient_receives(sc, st, src, pick(0))
            p.predicted_peak_bytes = joined(parts).peak()[0]
        out.append(p)
    return out


def _gradient_receives(sc: PipeScenario, g: int, src: StageSource,
                       first: StageSource) -> list[Rebuilt]:
    """A middle stage (global stage `g`) receives both the activations (as the last stage
    does) and the gradients (as the first): torch's stage keeps a receive buffer per
    micro-batch for each. Rebuilt from the last stage's recording, it takes the first's
    gradient receive buffers, alive throughout."""
    if not (0 < g < sc.stages * sc.virtual - 1) or src is first or src.stage is None or \
            src.stages is None or src.stage != src.stages - 1:
        return []
    lt = first.d.lt
    recv = np.flatnonzero(first.d.mask(Category.PP_P2P) & (lt.alloc_row < first.start) &
                          (lt.free_row >= first.end))
    return [Rebuilt(0, recv, np.full(recv.size, -1, np.int64),
                    np.full(recv.size, 1 << 62, np.int64),
                    first.sizes(sc.world_size, sc.tp)[recv] * first.p2p_share)]


def joined(parts: list[Rebuilt]) -> Rebuilt:
    rows = max(r.rows for r in parts)
    return Rebuilt(rows, *(np.concatenate([getattr(r, k) for r in parts])
                           for k in ("block", "alloc", "free", "size")))


def _interleaved_peak(sc: PipeScenario, rank: int, pick, layers: int) -> int:
    """The rank's peak under an interleaved schedule (`interleaved`)."""
    return joined(interleaved(sc, rank, pick, layers)).peak()[0]


def interleaved(sc: PipeScenario, rank: int, pick, layers: int) -> list[Rebuilt]:
    """The rank's step under an interleaved schedule: each of its stages (global stage
    j * S + rank) rebuilt from the recorded stage in that stage's position (`pick`) at its
    share of the layers, the operations of all laid out in the rank's order."""
    seq = order(sc.schedule, rank, sc.stages, sc.microbatches, sc.virtual)
    by_chunk = {j: pick(j * sc.stages + rank) for j in range(sc.virtual)}
    srcs = {x: by_chunk[x[1] // sc.microbatches] for x in seq}
    tmpl = {x: (x[0], _template(x[1] % sc.microbatches, sc.microbatches,
                                srcs[x].microbatches)) for x in seq}
    timeline = _timeline(seq, srcs, tmpl)
    last = sc.stages * sc.virtual - 1
    parts = [rebuild(src, sc, rank, layers / (src.layers or layers), j, timeline,
                     j * sc.stages + rank in (0, last)) for j, src in by_chunk.items()]
    for j, src in by_chunk.items():
        parts += _gradient_receives(sc, j * sc.stages + rank, src, pick(0))
    return parts


# The error band: each stage's forecast against the run recorded in that layout, from
# tests/test_forecast.py::test_pipeline_layout_forecast (the bundled pipeline example, 8 layers
# of dim 256, batch 32 x 64 tokens, recorded on CPU with gloo; each recording forecast to each
# other layout, every stage): (source, target, lowest error, highest error over stages).
PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8 gpipe", "S=2 M=8 1f1b", -0.0059, 0.0000),
    ("S=2 M=8 gpipe", "S=2 M=4 gpipe", 0.0000, 0.0000),
    ("S=2 M=8 gpipe", "S=2 M=4 1f1b", 0.0081, 0.0220),
    ("S=2 M=8 gpipe", "S=4 M=8 gpipe", 0.0000, 0.0050),
    ("S=2 M=8 gpipe", "S=4 M=8 1f1b", -0.0073, 0.0000),
    ("S=2 M=8 gpipe", "S=4 M=4 gpipe", 0.0098, 0.0196),
    ("S=2 M=8 gpipe", "S=4 M=4 1f1b", 0.0102, 0.0351),
    ("S=2 M=8 1f1b", "S=2 M=8 gpipe", 0.0000, 0.0000),
    ("S=2 M=8 1f1b", "S=2 M=4 gpipe", -0.0056, 0.0000),
    ("S=2 M=8 1f1b", "S=2 M=4 1f1b", 0.0081, 0.0220),
    ("S=2 M=8 1f1b", "S=4 M=8 gpipe", 0.0000, 0.0050),
    ("S=2 M=8 1f1b", "S=4 M=8 1f1b", 0.0000, 0.0000),
    ("S=2 M=8 1f1b", "S=4 M=4 gpipe", 0.0000, 0.0196),
    ("S=2 M=8 1f1b", "S=4 M=4 1f1b", 0.0000, 0.0351),
    ("S=2 M=4 gpipe", "S=2 M=8 gpipe", 0.0000, 0.0000),
    ("S=2 M=4 gpipe", "S=2 M=8 1f1b", -0.0177, -0.0142),
    ("S=2 M=4 gpipe", "S=2 M=4 1f1b", -0.0081, 0.0000),
    ("S=2 M=4 gpipe", "S=4 M=8 gpipe", 0.0000, 0.0048),
    ("S=2 M=4 gpipe", "S=4 M=8 1f1b", -0.0220, -0.0156),
    ("S=2 M=4 gpipe", "S=4 M=4 gpipe", 0.0098, 0.0196),
    ("S=2 M=4 gpipe", "S=4 M=4 1f1b", 0.0000, 0.0107),
    ("S=2 M=4 1f1b", "S=2 M=8 gpipe", 0.0000, 0.0000),
    ("S=2 M=4 1f1b", "S=2 M=8 1f1b", -0.0142, -0.0118),
    ("S=2 M=4 1f1b", "S=2 M=4 gpipe", 0.0000, 0.0000),
    ("S=2 M=4 1f1b", "S=4 M=8 gpipe", 0.0000, 0.0048),
    ("S=2 M=4 1f1b", "S=4 M=8 1f1b", -0.0220, -0.0146),
    ("S=2 M=4 1f1b", "S=4 M=4 gpipe", 0.0098, 0.0196),
    ("S=2 M=4 1f1b", "S=4 M=4 1f1b", 0.0000, 0.0107),
    ("S=4 M=8 gpipe", "S=2 M=8 gpipe", 0.0111, 0.0113),
    ("S=4 M=8 gpipe", "S=2 M=8 1f1b", -0.0059, 0.0000),
    ("S=4 M=8 gpipe", "S=2 M=4 gpipe", 0.0110, 0.0112),
    ("S=4 M=8 gpipe", "S=2 M=4 1f1b", 0.0081, 0.0220),
    ("S=4 M=8 gpipe", "S=4 M=8 1f1b", -0.0091, 0.0000),
    ("S=4 M=8 gpipe", "S=4 M=4 gpipe", 0.0000, 0.0000),
    ("S=4 M=8 gpipe", "S=4 M=4 1f1b", 0.0000, 0.0351),
    ("S=4 M=8 1f1b", "S=2 M=8 gpipe", 0.0111, 0.0113),
    ("S=4 M=8 1f1b", "S=2 M=8 1f1b", 0.0000, 0.0000),
    ("S=4 M=8 1f1b", "S=2 M=4 gpipe", 0.0056, 0.0110),
    ("S=4 M=8 1f1b", "S=2 M=4 1f1b", 0.0000, 0.0220),
    ("S=4 M=8 1f1b", "S=4 M=8 gpipe", -0.0001, 0.0000),
    ("S=4 M=8 1f1b", "S=4 M=4 gpipe", -0.0102, 0.0000),
    ("S=4 M=8 1f1b", "S=4 M=4 1f1b", -0.0102, 0.0351),
    ("S=4 M=4 gpipe", "S=2 M=8 gpipe", 0.0111, 0.0113),
    ("S=4 M=4 gpipe", "S=2 M=8 1f1b", -0.0177, -0.0142),
    ("S=4 M=4 gpipe", "S=2 M=4 gpipe", 0.0110, 0.0112),
    ("S=4 M=4 gpipe", "S=2 M=4 1f1b", -0.0081, 0.0000),
    ("S=4 M=4 gpipe", "S=4 M=8 gpipe", -0.0001, 0.0000),
    ("S=4 M=4 gpipe", "S=4 M=8 1f1b", -0.0273, -0.0219),
    ("S=4 M=4 gpipe", "S=4 M=4 1f1b", -0.0132, 0.0000),
    ("S=4 M=4 1f1b", "S=2 M=8 gpipe", 0.0111, 0.0113),
    ("S=4 M=4 1f1b", "S=2 M=8 1f1b", -0.0177, -0.0142),
    ("S=4 M=4 1f1b", "S=2 M=4 gpipe", 0.0110, 0.0112),
    ("S=4 M=4 1f1b", "S=2 M=4 1f1b", -0.0081, 0.0000),
    ("S=4 M=4 1f1b", "S=4 M=8 gpipe", -0.0001, 0.0000),
    ("S=4 M=4 1f1b", "S=4 M=8 1f1b", -0.0273, -0.0219),
    ("S=4 M=4 1f1b", "S=4 M=4 gpipe", 0.0000, 0.0000),
)
# FSDP2 sharding each stage (FSDP + PP on a 2-D mesh, torchtitan's way; `Gathers` replays its
# gathers): the same 8 layouts recorded with examples/pipeline.py --dp 2 (4 and 8 ranks), each
# forecast to the 7 others, every stage against the worst of its dp ranks, from
# tests/test_forecast.py::test_pipeline_fsdp_layout_forecast.
FSDP_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8 gpipe", "S=2 M=8 1f1b", 0.0177, 0.0214),
    ("S=2 M=8 gpipe", "S=2 M=4 gpipe", 0.0000, 0.0000),
    ("S=2 M=8 gpipe", "S=2 M=4 1f1b", 0.0081, 0.0219),
    ("S=2 M=8 gpipe", "S=4 M=8 gpipe", 0.0000, 0.0048),
    ("S=2 M=8 gpipe", "S=4 M=8 1f1b", 0.0253, 0.0370),
    ("S=2 M=8 gpipe", "S=4 M=4 gpipe", 0.0094, 0.0189),
    ("S=2 M=8 gpipe", "S=4 M=4 1f1b", 0.0098, 0.0327),
    ("S=2 M=8 1f1b", "S=2 M=8 gpipe", 0.0000, 0.0000),
    ("S=2 M=8 1f1b", "S=2 M=4 gpipe", -0.0056, 0.0000),
    ("S=2 M=8 1f1b", "S=2 M=4 1f1b", 0.0081, 0.0220),
    ("S=2 M=8 1f1b", "S=4 M=8 gpipe", 0.0000, 0.0048),
    ("S=2 M=8 1f1b", "S=4 M=8 1f1b", 0.0000, 0.0000),
    ("S=2 M=8 1f1b", "S=4 M=4 gpipe", 0.0000, 0.0189),
    ("S=2 M=8 1f1b", "S=4 M=4 1f1b", 0.0000, 0.0328),
    ("S=2 M=4 gpipe", "S=2 M=8 gpipe", 0.0000, 0.0000),
    ("S=2 M=4 gpipe", "S=2 M=8 1f1b", 0.0059, 0.0072),
    ("S=2 M=4 gpipe", "S=2 M=4 1f1b", -0.0081, 0.0000),
    ("S=2 M=4 gpipe", "S=4 M=8 gpipe", 0.0000, 0.0047),
    ("S=2 M=4 gpipe", "S=4 M=8 1f1b", 0.0115, 0.0202),
    ("S=2 M=4 gpipe", "S=4 M=4 gpipe", 0.0094, 0.0189),
    ("S=2 M=4 gpipe", "S=4 M=4 1f1b", 0.0001, 0.0104),
    ("S=2 M=4 1f1b", "S=2 M=8 gpipe", 0.0000, 0.0000),
    ("S=2 M=4 1f1b", "S=2 M=8 1f1b", 0.0000, 0.0000),
    ("S=2 M=4 1f1b", "S=2 M=4 gpipe", 0.0000, 0.0000),
    ("S=2 M=4 1f1b", "S=4 M=8 gpipe", 0.0000, 0.0047),
    ("S=2 M=4 1f1b", "S=4 M=8 1f1b", 0.0000, 0.0000),
    ("S=2 M=4 1f1b", "S=4 M=4 gpipe", 0.0094, 0.0189),
    ("S=2 M=4 1f1b", "S=4 M=4 1f1b", 0.0000, 0.0103),
    ("S=4 M=8 gpipe", "S=2 M=8 gpipe", 0.0080, 0.0081),
    ("S=4 M=8 gpipe", "S=2 M=8 1f1b", -0.0001, 0.0413),
    ("S=4 M=8 gpipe", "S=2 M=4 gpipe", 0.0330, 0.0337),
    ("S=4 M=8 gpipe", "S=2 M=4 1f1b", 0.0219, 0.0407),
    ("S=4 M=8 gpipe", "S=4 M=8 1f1b", -0.0085, 0.0000),
    ("S=4 M=8 gpipe", "S=4 M=4 gpipe", 0.0000, 0.0000),
    ("S=4 M=8 gpipe", "S=4 M=4 1f1b", 0.0000, 0.0327),
    ("S=4 M=8 1f1b", "S=2 M=8 gpipe", 0.0080, 0.0081),
    ("S=4 M=8 1f1b", "S=2 M=8 1f1b", 0.0473, 0.0568),
    ("S=4 M=8 1f1b", "S=2 M=4 gpipe", 0.0280, 0.0330),
    ("S=4 M=8 1f1b", "S=2 M=4 1f1b", 0.0326, 0.0660),
    ("S=4 M=8 1f1b", "S=4 M=8 gpipe", 0.0000, 0.0000),
    ("S=4 M=8 1f1b", "S=4 M=4 gpipe", -0.0098, 0.0000),
    ("S=4 M=8 1f1b", "S=4 M=4 1f1b", -0.0098, 0.0328),
    ("S=4 M=4 gpipe", "S=2 M=8 gpipe", 0.0080, 0.0081),
    ("S=4 M=4 gpipe", "S=2 M=8 1f1b", -0.0143, 0.0294),
    ("S=4 M=4 gpipe", "S=2 M=4 gpipe", 0.0330, 0.0337),
    ("S=4 M=4 gpipe", "S=2 M=4 1f1b", 0.0000, 0.0244),
    ("S=4 M=4 gpipe", "S=4 M=8 gpipe", 0.0000, 0.0000),
    ("S=4 M=4 gpipe", "S=4 M=8 1f1b", -0.0085, 0.0000),
    ("S=4 M=4 gpipe", "S=4 M=4 1f1b", -0.0125, 0.0000),
    ("S=4 M=4 1f1b", "S=2 M=8 gpipe", 0.0080, 0.0081),
    ("S=4 M=4 1f1b", "S=2 M=8 1f1b", 0.0294, 0.0568),
    ("S=4 M=4 1f1b", "S=2 M=4 gpipe", 0.0330, 0.0337),
    ("S=4 M=4 1f1b", "S=2 M=4 1f1b", 0.0244, 0.0440),
    ("S=4 M=4 1f1b", "S=4 M=8 gpipe", 0.0000, 0.0000),
    ("S=4 M=4 1f1b", "S=4 M=8 1f1b", -0.0085, 0.0000),
    ("S=4 M=4 1f1b", "S=4 M=4 gpipe", 0.0000, 0.0000),
)
# An interleaved schedule (ScheduleInterleaved1F1B, 2 stages per rank) forecast from the
# GPipe and 1F1B recordings above, against the example recorded with --schedule interleaved,
# each pair whose stages (ranks x 2) are 1/2x..2x the recorded ones
# (tests/test_forecast.py::test_pipeline_interleaved_forecast).
INTERLEAVED_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8 gpipe", "S=2x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=2 M=8 gpipe", "S=2x2 M=4 interleaved", 0.0131, 0.0163),
    ("S=2 M=8 1f1b", "S=2x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=2 M=8 1f1b", "S=2x2 M=4 interleaved", 0.0131, 0.0163),
    ("S=2 M=4 gpipe", "S=2x2 M=8 interleaved", -0.0104, -0.0091),
    ("S=2 M=4 gpipe", "S=2x2 M=4 interleaved", 0.0000, 0.0000),
    ("S=2 M=4 1f1b", "S=2x2 M=8 interleaved", -0.0104, -0.0091),
    ("S=2 M=4 1f1b", "S=2x2 M=4 interleaved", 0.0000, 0.0000),
    ("S=4 M=8 gpipe", "S=2x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=4 M=8 gpipe", "S=2x2 M=4 interleaved", 0.0131, 0.0163),
    ("S=4 M=8 gpipe", "S=4x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=4 M=8 gpipe", "S=4x2 M=4 interleaved", 0.0091, 0.0222),
    ("S=4 M=8 1f1b", "S=2x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=4 M=8 1f1b", "S=2x2 M=4 interleaved", 0.0131, 0.0163),
    ("S=4 M=8 1f1b", "S=4x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=4 M=8 1f1b", "S=4x2 M=4 interleaved", 0.0091, 0.0222),
    ("S=4 M=4 gpipe", "S=2x2 M=8 interleaved", -0.0104, -0.0091),
    ("S=4 M=4 gpipe", "S=2x2 M=4 interleaved", 0.0000, 0.0000),
    ("S=4 M=4 gpipe", "S=4x2 M=8 interleaved", -0.0135, -0.0106),
    ("S=4 M=4 gpipe", "S=4x2 M=4 interleaved", 0.0000, 0.0094),
    ("S=4 M=4 1f1b", "S=2x2 M=8 interleaved", -0.0104, -0.0091),
    ("S=4 M=4 1f1b", "S=2x2 M=4 interleaved", 0.0000, 0.0000),
    ("S=4 M=4 1f1b", "S=4x2 M=8 interleaved", -0.0135, -0.0106),
    ("S=4 M=4 1f1b", "S=4x2 M=4 interleaved", 0.0000, 0.0094),
)
# The same with FSDP2 sharding each stage (--dp 2; each of a rank's stages its own FSDP root,
# its gathers replayed within its own operations): the FSDP recordings forecast to the example
# recorded with --schedule interleaved --dp 2, every stage against the worst of its dp ranks
# (tests/test_forecast.py::test_pipeline_fsdp_layout_forecast).
FSDP_INTERLEAVED_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8 gpipe", "S=2x2 M=8 interleaved", 0.0089, 0.0175),
    ("S=2 M=8 gpipe", "S=2x2 M=4 interleaved", -0.0064, 0.0152),
    ("S=2 M=8 1f1b", "S=2x2 M=8 interleaved", 0.0000, 0.0264),
    ("S=2 M=8 1f1b", "S=2x2 M=4 interleaved", 0.0129, 0.0153),
    ("S=2 M=4 gpipe", "S=2x2 M=8 interleaved", 0.0089, 0.0096),
    ("S=2 M=4 gpipe", "S=2x2 M=4 interleaved", -0.0064, 0.0001),
    ("S=2 M=4 1f1b", "S=2x2 M=8 interleaved", 0.0000, 0.0264),
    ("S=2 M=4 1f1b", "S=2x2 M=4 interleaved", 0.0000, 0.0129),
    ("S=4 M=8 gpipe", "S=2x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=4 M=8 gpipe", "S=2x2 M=4 interleaved", 0.0000, 0.0152),
    ("S=4 M=8 gpipe", "S=4x2 M=8 interleaved", 0.0000, 0.0512),
    ("S=4 M=8 1f1b", "S=2x2 M=8 interleaved", 0.0000, 0.0264),
    ("S=4 M=8 1f1b", "S=2x2 M=4 interleaved", 0.0129, 0.0153),
    ("S=4 M=8 1f1b", "S=4x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=4 M=4 gpipe", "S=2x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=4 M=4 gpipe", "S=2x2 M=4 interleaved", 0.0000, 0.0000),
    ("S=4 M=4 gpipe", "S=4x2 M=8 interleaved", 0.0000, 0.0384),
    ("S=4 M=4 1f1b", "S=2x2 M=8 interleaved", 0.0000, 0.0264),
    ("S=4 M=4 1f1b", "S=2x2 M=4 interleaved", 0.0000, 0.0129),
    ("S=4 M=4 1f1b", "S=4x2 M=8 interleaved", 0.0000, 0.0339),
)
# Another FSDP world size with the pipeline's changes (FSDP + PP): the --dp 2 layouts and the
# example recorded with --dp 4 at 2 stages (8 ranks), each forecast to the other's layouts,
# every stage against the worst of its dp ranks
# (tests/test_forecast.py::test_pipeline_fsdp_world_layout_forecast).
FSDP_WORLD_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8 gpipe dp=2", "S=2 M=8 gpipe dp=4", 0.0000, 0.0000),
    ("S=2 M=8 gpipe dp=2", "S=2 M=8 1f1b dp=4", 0.0186, 0.0227),
    ("S=2 M=8 gpipe dp=2", "S=2 M=4 gpipe dp=4", 0.0000, 0.0000),
    ("S=2 M=8 gpipe dp=2", "S=2 M=4 1f1b dp=4", 0.0084, 0.0229),
    ("S=2 M=8 1f1b dp=2", "S=2 M=8 gpipe dp=4", 0.0000, 0.0000),
    ("S=2 M=8 1f1b dp=2", "S=2 M=8 1f1b dp=4", 0.0000, 0.0000),
    ("S=2 M=8 1f1b dp=2", "S=2 M=4 gpipe dp=4", -0.0057, 0.0000),
    ("S=2 M=8 1f1b dp=2", "S=2 M=4 1f1b dp=4", 0.0084, 0.0230),
    ("S=2 M=4 gpipe dp=2", "S=2 M=8 gpipe dp=4", 0.0000, 0.0000),
    ("S=2 M=4 gpipe dp=2", "S=2 M=8 1f1b dp=4", 0.0062, 0.0077),
    ("S=2 M=4 gpipe dp=2", "S=2 M=4 gpipe dp=4", 0.0000, 0.0000),
    ("S=2 M=4 gpipe dp=2", "S=2 M=4 1f1b dp=4", -0.0084, 0.0000),
    ("S=2 M=4 1f1b dp=2", "S=2 M=8 gpipe dp=4", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=2", "S=2 M=8 1f1b dp=4", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=2", "S=2 M=4 gpipe dp=4", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=2", "S=2 M=4 1f1b dp=4", 0.0000, 0.0000),
    ("S=4 M=8 gpipe dp=2", "S=2 M=8 gpipe dp=4", 0.0082, 0.0083),
    ("S=4 M=8 gpipe dp=2", "S=2 M=8 1f1b dp=4", -0.0001, 0.0433),
    ("S=4 M=8 gpipe dp=2", "S=2 M=4 gpipe dp=4", 0.0338, 0.0344),
    ("S=4 M=8 gpipe dp=2", "S=2 M=4 1f1b dp=4", 0.0229, 0.0421),
    ("S=4 M=8 1f1b dp=2", "S=2 M=8 gpipe dp=4", 0.0082, 0.0083),
    ("S=4 M=8 1f1b dp=2", "S=2 M=8 1f1b dp=4", 0.0496, 0.0602),
    ("S=4 M=8 1f1b dp=2", "S=2 M=4 gpipe dp=4", 0.0287, 0.0338),
    ("S=4 M=8 1f1b dp=2", "S=2 M=4 1f1b dp=4", 0.0337, 0.0690),
    ("S=4 M=4 gpipe dp=2", "S=2 M=8 gpipe dp=4", 0.0082, 0.0083),
    ("S=4 M=4 gpipe dp=2", "S=2 M=8 1f1b dp=4", -0.0152, 0.0309),
    ("S=4 M=4 gpipe dp=2", "S=2 M=4 gpipe dp=4", 0.0338, 0.0344),
    ("S=4 M=4 gpipe dp=2", "S=2 M=4 1f1b dp=4", 0.0000, 0.0253),
    ("S=4 M=4 1f1b dp=2", "S=2 M=8 gpipe dp=4", 0.0082, 0.0083),
    ("S=4 M=4 1f1b dp=2", "S=2 M=8 1f1b dp=4", 0.0309, 0.0602),
    ("S=4 M=4 1f1b dp=2", "S=2 M=4 gpipe dp=4", 0.0338, 0.0344),
    ("S=4 M=4 1f1b dp=2", "S=2 M=4 1f1b dp=4", 0.0253, 0.0461),
    ("S=2 M=8 gpipe dp=4", "S=2 M=8 gpipe dp=2", 0.0000, 0.0000),
    ("S=2 M=8 gpipe dp=4", "S=2 M=8 1f1b dp=2", 0.0177, 0.0214),
    ("S=2 M=8 gpipe dp=4", "S=2 M=4 gpipe dp=2", 0.0000, 0.0000),
    ("S=2 M=8 gpipe dp=4", "S=2 M=4 1f1b dp=2", 0.0081, 0.0219),
    ("S=2 M=8 gpipe dp=4", "S=4 M=8 gpipe dp=2", 0.0000, 0.0048),
    ("S=2 M=8 gpipe dp=4", "S=4 M=8 1f1b dp=2", 0.0253, 0.0370),
    ("S=2 M=8 gpipe dp=4", "S=4 M=4 gpipe dp=2", 0.0094, 0.0189),
    ("S=2 M=8 gpipe dp=4", "S=4 M=4 1f1b dp=2", 0.0098, 0.0327),
    ("S=2 M=8 1f1b dp=4", "S=2 M=8 gpipe dp=2", 0.0000, 0.0000),
    ("S=2 M=8 1f1b dp=4", "S=2 M=8 1f1b dp=2", 0.0000, 0.0000),
    ("S=2 M=8 1f1b dp=4", "S=2 M=4 gpipe dp=2", -0.0056, 0.0000),
    ("S=2 M=8 1f1b dp=4", "S=2 M=4 1f1b dp=2", 0.0081, 0.0220),
    ("S=2 M=8 1f1b dp=4", "S=4 M=8 gpipe dp=2", 0.0000, 0.0048),
    ("S=2 M=8 1f1b dp=4", "S=4 M=8 1f1b dp=2", 0.0000, 0.0000),
    ("S=2 M=8 1f1b dp=4", "S=4 M=4 gpipe dp=2", 0.0000, 0.0189),
    ("S=2 M=8 1f1b dp=4", "S=4 M=4 1f1b dp=2", 0.0000, 0.0328),
    ("S=2 M=4 gpipe dp=4", "S=2 M=8 gpipe dp=2", 0.0000, 0.0000),
    ("S=2 M=4 gpipe dp=4", "S=2 M=8 1f1b dp=2", 0.0059, 0.0072),
    ("S=2 M=4 gpipe dp=4", "S=2 M=4 gpipe dp=2", 0.0000, 0.0000),
    ("S=2 M=4 gpipe dp=4", "S=2 M=4 1f1b dp=2", -0.0081, 0.0000),
    ("S=2 M=4 gpipe dp=4", "S=4 M=8 gpipe dp=2", 0.0000, 0.0047),
    ("S=2 M=4 gpipe dp=4", "S=4 M=8 1f1b dp=2", 0.0115, 0.0202),
    ("S=2 M=4 gpipe dp=4", "S=4 M=4 gpipe dp=2", 0.0094, 0.0189),
    ("S=2 M=4 gpipe dp=4", "S=4 M=4 1f1b dp=2", 0.0001, 0.0104),
    ("S=2 M=4 1f1b dp=4", "S=2 M=8 gpipe dp=2", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=4", "S=2 M=8 1f1b dp=2", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=4", "S=2 M=4 gpipe dp=2", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=4", "S=2 M=4 1f1b dp=2", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=4", "S=4 M=8 gpipe dp=2", 0.0000, 0.0047),
    ("S=2 M=4 1f1b dp=4", "S=4 M=8 1f1b dp=2", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=4", "S=4 M=4 gpipe dp=2", 0.0094, 0.0189),
    ("S=2 M=4 1f1b dp=4", "S=4 M=4 1f1b dp=2", 0.0000, 0.0103),
)
# and to ScheduleInterleaved1F1B recorded at the other world size (2 x 2 stages, 8 and 4
# micro-batches), from the same test
FSDP_WORLD_INTERLEAVED_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8 gpipe dp=2", "S=2x2 M=8 interleaved dp=4", 0.0092, 0.0182),
    ("S=2 M=8 gpipe dp=2", "S=2x2 M=4 interleaved dp=4", -0.0066, 0.0157),
    ("S=2 M=8 1f1b dp=2", "S=2x2 M=8 interleaved dp=4", 0.0000, 0.0273),
    ("S=2 M=8 1f1b dp=2", "S=2x2 M=4 interleaved dp=4", 0.0132, 0.0158),
    ("S=2 M=4 gpipe dp=2", "S=2x2 M=8 interleaved dp=4", 0.0092, 0.0099),
    ("S=2 M=4 gpipe dp=2", "S=2x2 M=4 interleaved dp=4", -0.0066, 0.0001),
    ("S=2 M=4 1f1b dp=2", "S=2x2 M=8 interleaved dp=4", 0.0000, 0.0273),
    ("S=2 M=4 1f1b dp=2", "S=2x2 M=4 interleaved dp=4", 0.0000, 0.0132),
    ("S=4 M=8 gpipe dp=2", "S=2x2 M=8 interleaved dp=4", 0.0000, 0.0000),
    ("S=4 M=8 gpipe dp=2", "S=2x2 M=4 interleaved dp=4", 0.0000, 0.0157),
    ("S=4 M=8 1f1b dp=2", "S=2x2 M=8 interleaved dp=4", 0.0000, 0.0273),
    ("S=4 M=8 1f1b dp=2", "S=2x2 M=4 interleaved dp=4", 0.0132, 0.0158),
    ("S=4 M=4 gpipe dp=2", "S=2x2 M=8 interleaved dp=4", 0.0000, 0.0000),
    ("S=4 M=4 gpipe dp=2", "S=2x2 M=4 interleaved dp=4", 0.0000, 0.0000),
    ("S=4 M=4 1f1b dp=2", "S=2x2 M=8 interleaved dp=4", 0.0000, 0.0273),
    ("S=4 M=4 1f1b dp=2", "S=2x2 M=4 interleaved dp=4", 0.0000, 0.0132),
    ("S=2 M=8 gpipe dp=4", "S=2x2 M=8 interleaved dp=2", 0.0089, 0.0175),
    ("S=2 M=8 gpipe dp=4", "S=2x2 M=4 interleaved dp=2", -0.0064, 0.0152),
    ("S=2 M=8 1f1b dp=4", "S=2x2 M=8 interleaved dp=2", 0.0000, 0.0264),
    ("S=2 M=8 1f1b dp=4", "S=2x2 M=4 interleaved dp=2", 0.0129, 0.0153),
    ("S=2 M=4 gpipe dp=4", "S=2x2 M=8 interleaved dp=2", 0.0089, 0.0096),
    ("S=2 M=4 gpipe dp=4", "S=2x2 M=4 interleaved dp=2", -0.0064, 0.0001),
    ("S=2 M=4 1f1b dp=4", "S=2x2 M=8 interleaved dp=2", 0.0000, 0.0264),
    ("S=2 M=4 1f1b dp=4", "S=2x2 M=4 interleaved dp=2", 0.0000, 0.0129),
)
WORLD_RATIOS = (0.5, 2.0)  # the FSDP world sizes the pairs change (new / recorded)
# An interleaved recording as the source (each of a rank's stages its own source, in its
# position): examples/pipeline.py --schedule interleaved at 2 and 4 ranks x 2 stages, 4 and 8
# micro-batches, forecast to the 8 GPipe / 1F1B layouts and the other interleaved ones whose
# stages are 1/2x..2x its own (tests/test_forecast.py::test_pipeline_from_interleaved_forecast).
FROM_INTERLEAVED_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2x2 M=8 interleaved", "S=2 M=8 gpipe", 0.0111, 0.0113),
    ("S=2x2 M=8 interleaved", "S=2 M=8 1f1b", -0.0059, 0.0000),
    ("S=2x2 M=8 interleaved", "S=2 M=4 gpipe", 0.0110, 0.0112),
    ("S=2x2 M=8 interleaved", "S=2 M=4 1f1b", 0.0081, 0.0220),
    ("S=2x2 M=8 interleaved", "S=4 M=8 gpipe", 0.0000, 0.0000),
    ("S=2x2 M=8 interleaved", "S=4 M=8 1f1b", -0.0091, 0.0000),
    ("S=2x2 M=8 interleaved", "S=4 M=4 gpipe", 0.0000, 0.0000),
    ("S=2x2 M=8 interleaved", "S=4 M=4 1f1b", 0.0000, 0.0351),
    ("S=2x2 M=8 interleaved", "S=2x2 M=4 interleaved", 0.0131, 0.0163),
    ("S=2x2 M=8 interleaved", "S=4x2 M=8 interleaved", 0.0000, 0.0000),
    ("S=2x2 M=8 interleaved", "S=4x2 M=4 interleaved", 0.0091, 0.0222),
    ("S=2x2 M=4 interleaved", "S=2 M=8 gpipe", 0.0111, 0.0113),
    ("S=2x2 M=4 interleaved", "S=2 M=8 1f1b", -0.0177, -0.0142),
    ("S=2x2 M=4 interleaved", "S=2 M=4 gpipe", 0.0110, 0.0112),
    ("S=2x2 M=4 interleaved", "S=2 M=4 1f1b", -0.0081, 0.0000),
    ("S=2x2 M=4 interleaved", "S=4 M=8 gpipe", -0.0001, 0.0000),
    ("S=2x2 M=4 interleaved", "S=4 M=8 1f1b", -0.0273, -0.0219),
    ("S=2x2 M=4 interleaved", "S=4 M=4 gpipe", 0.0000, 0.0000),
    ("S=2x2 M=4 interleaved", "S=4 M=4 1f1b", -0.0132, 0.0000),
    ("S=2x2 M=4 interleaved", "S=2x2 M=8 interleaved", -0.0104, -0.0091),
    ("S=2x2 M=4 interleaved", "S=4x2 M=8 interleaved", -0.0135, -0.0106),
    ("S=2x2 M=4 interleaved", "S=4x2 M=4 interleaved", 0.0000, 0.0094),
    ("S=4x2 M=8 interleaved", "S=4 M=8 gpipe", -0.0200, 0.0207),
    ("S=4x2 M=8 interleaved", "S=4 M=8 1f1b", -0.0110, -0.0073),
    ("S=4x2 M=8 interleaved", "S=4 M=4 gpipe", -0.0196, 0.0204),
    ("S=4x2 M=8 interleaved", "S=4 M=4 1f1b", 0.0132, 0.0215),
    ("S=4x2 M=8 interleaved", "S=2x2 M=8 interleaved", -0.0052, 0.0000),
    ("S=4x2 M=8 interleaved", "S=2x2 M=4 interleaved", 0.0081, 0.0131),
    ("S=4x2 M=8 interleaved", "S=4x2 M=4 interleaved", 0.0000, 0.0222),
    ("S=4x2 M=4 interleaved", "S=4 M=8 gpipe", -0.0200, 0.0207),
    ("S=4x2 M=4 interleaved", "S=4 M=8 1f1b", -0.0330, -0.0219),
    ("S=4x2 M=4 interleaved", "S=4 M=4 gpipe", -0.0196, 0.0204),
    ("S=4x2 M=4 interleaved", "S=4 M=4 1f1b", -0.0175, 0.0204),
    ("S=4x2 M=4 interleaved", "S=2x2 M=8 interleaved", -0.0155, -0.0091),
    ("S=4x2 M=4 interleaved", "S=2x2 M=4 interleaved", -0.0081, 0.0000),
    ("S=4x2 M=4 interleaved", "S=4x2 M=8 interleaved", -0.0135, -0.0106),
)
# the same with FSDP2 sharding each stage (--dp 2), the looped runtime's UNSHARD gathers replayed
# ScheduleLoopedBFS recorded, ScheduleInterleaved1F1B at the same layout (its fix) against the
# twin recorded so (tests/rules/test_pipeline_schedule.py::test_looped_bfs_is_anomalous_and_
# the_replay_predicts_the_interleaved_twin: 2 ranks x 2 stages, 8 micro-batches, every rank)
FROM_LOOPED_BFS_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2x2 M=8 looped_bfs (example)", "S=2x2 M=8 interleaved", -0.0104, 0.0000),
    ("S=2x2 M=8 looped_bfs (gpt)", "S=2x2 M=8 interleaved", 0.0000, 0.0000),
)
# the same with FSDP2 sharding each stage over 2 ranks (4 ranks): measured as the rule's replay
# of each rank against the same rank of the twin (the layout `last_b` was mended on, not held
# out); the test holds the forecast of each stage to 5% of the twin's worst rank of that stage
FSDP_FROM_LOOPED_BFS_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2x2 M=8 looped_bfs dp=2", "S=2x2 M=8 interleaved dp=2", -0.0130, 0.0177),
)
FSDP_FROM_INTERLEAVED_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2x2 M=8 interleaved", "S=2 M=8 gpipe", 0.0080, 0.0081),
    ("S=2x2 M=8 interleaved", "S=2 M=8 1f1b", 0.0414, 0.0568),
    ("S=2x2 M=8 interleaved", "S=2 M=4 gpipe", 0.0330, 0.0337),
    ("S=2x2 M=8 interleaved", "S=2 M=4 1f1b", 0.0407, 0.0660),
    ("S=2x2 M=8 interleaved", "S=4 M=8 gpipe", 0.0000, 0.0000),
    ("S=2x2 M=8 interleaved", "S=4 M=8 1f1b", -0.0085, 0.0000),
    ("S=2x2 M=8 interleaved", "S=4 M=4 gpipe", 0.0000, 0.0000),
    ("S=2x2 M=8 interleaved", "S=4 M=4 1f1b", 0.0000, 0.0328),
    ("S=2x2 M=8 interleaved", "S=2x2 M=4 interleaved", -0.0065, 0.0153),
    ("S=2x2 M=8 interleaved", "S=4x2 M=8 interleaved", -0.0416, 0.0000),
    ("S=2x2 M=4 interleaved", "S=2 M=8 gpipe", 0.0080, 0.0081),
    ("S=2x2 M=4 interleaved", "S=2 M=8 1f1b", 0.0294, 0.0568),
    ("S=2x2 M=4 interleaved", "S=2 M=4 gpipe", 0.0330, 0.0337),
    ("S=2x2 M=4 interleaved", "S=2 M=4 1f1b", 0.0244, 0.0440),
    ("S=2x2 M=4 interleaved", "S=4 M=8 gpipe", 0.0000, 0.0000),
    ("S=2x2 M=4 interleaved", "S=4 M=8 1f1b", -0.0085, 0.0000),
    ("S=2x2 M=4 interleaved", "S=4 M=4 gpipe", 0.0000, 0.0000),
    ("S=2x2 M=4 interleaved", "S=4 M=4 1f1b", -0.0125, 0.0000),
    ("S=2x2 M=4 interleaved", "S=2x2 M=8 interleaved", -0.0351, 0.0000),
    ("S=2x2 M=4 interleaved", "S=4x2 M=8 interleaved", -0.0407, 0.0339),
    ("S=4x2 M=8 interleaved", "S=4 M=8 gpipe", -0.0142, 0.0549),
    ("S=4x2 M=8 interleaved", "S=4 M=8 1f1b", -0.0605, 0.0593),
    ("S=4x2 M=8 interleaved", "S=4 M=4 gpipe", -0.0565, 0.0491),
    ("S=4x2 M=8 interleaved", "S=4 M=4 1f1b", -0.0493, 0.0626),
    ("S=4x2 M=8 interleaved", "S=2x2 M=8 interleaved", 0.0000, 0.0143),
    ("S=4x2 M=8 interleaved", "S=2x2 M=4 interleaved", 0.0077, 0.0192),
)
# Another TP degree with the pipeline's changes (TP inside the stages: examples/pipeline.py --tp,
# each block's MLP ColwiseParallel / RowwiseParallel): the 8 layouts at tp 2 (4 and 8 ranks) and
# the 4 at 2 stages with tp 4 (8 ranks), each forecast to every layout at the other degree and to
# ScheduleInterleaved1F1B there (2 x 2 stages), every stage against the worst of its tp ranks
# (tests/test_forecast.py::test_pipeline_tp_layout_forecast).
TP_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8 gpipe tp=2", "S=2 M=8 gpipe tp=4", 0.0000, 0.0000),
    ("S=2 M=8 gpipe tp=2", "S=2 M=8 1f1b tp=4", -0.0149, 0.0000),
    ("S=2 M=8 gpipe tp=2", "S=2 M=4 gpipe tp=4", 0.0000, 0.0000),
    ("S=2 M=8 gpipe tp=2", "S=2 M=4 1f1b tp=4", -0.0107, 0.0000),
    ("S=2 M=8 gpipe tp=2", "S=2x2 M=8 interleaved tp=4", 0.0000, 0.0000),
    ("S=2 M=8 gpipe tp=2", "S=2x2 M=4 interleaved tp=4", 0.0000, 0.0078),
    ("S=2 M=8 1f1b tp=2", "S=2 M=8 gpipe tp=4", 0.0000, 0.0000),
    ("S=2 M=8 1f1b tp=2", "S=2 M=8 1f1b tp=4", 0.0000, 0.0000),
    ("S=2 M=8 1f1b tp=2", "S=2 M=4 gpipe tp=4", -0.0153, 0.0000),
    ("S=2 M=8 1f1b tp=2", "S=2 M=4 1f1b tp=4", -0.0107, 0.0000),
    ("S=2 M=8 1f1b tp=2", "S=2x2 M=8 interleaved tp=4", 0.0000, 0.0000),
    ("S=2 M=8 1f1b tp=2", "S=2x2 M=4 interleaved tp=4", 0.0000, 0.0078),
    ("S=2 M=4 gpipe tp=2", "S=2 M=8 gpipe tp=4", 0.0000, 0.0000),
    ("S=2 M=4 gpipe tp=2", "S=2 M=8 1f1b tp=4", -0.0149, 0.0000),
    ("S=2 M=4 gpipe tp=2", "S=2 M=4 gpipe tp=4", 0.0000, 0.0000),
    ("S=2 M=4 gpipe tp=2", "S=2 M=4 1f1b tp=4", -0.0107, 0.0000),
    ("S=2 M=4 gpipe tp=2", "S=2x2 M=8 interleaved tp=4", 0.0000, 0.0000),
    ("S=2 M=4 gpipe tp=2", "S=2x2 M=4 interleaved tp=4", 0.0000, 0.0077),
    ("S=2 M=4 1f1b tp=2", "S=2 M=8 gpipe tp=4", 0.0000, 0.0000),
    ("S=2 M=4 1f1b tp=2", "S=2 M=8 1f1b tp=4", 0.0000, 0.0000),
    ("S=2 M=4 1f1b tp=2", "S=2 M=4 gpipe tp=4", 0.0000, 0.0000),
    ("S=2 M=4 1f1b tp=2", "S=2 M=4 1f1b tp=4", 0.0000, 0.0107),
    ("S=2 M=4 1f1b tp=2", "S=2x2 M=8 interleaved tp=4", 0.0000, 0.0000),
    ("S=2 M=4 1f1b tp=2", "S=2x2 M=4 interleaved tp=4", 0.0000, 0.0077),
    ("S=4 M=8 gpipe tp=2", "S=2 M=8 gpipe tp=4", 0.0000, 0.0076),
    ("S=4 M=8 gpipe tp=2", "S=2 M=8 1f1b tp=4", -0.0149, 0.0000),
    ("S=4 M=8 gpipe tp=2", "S=2 M=4 gpipe tp=4", 0.0000, 0.0077),
    ("S=4 M=8 gpipe tp=2", "S=2 M=4 1f1b tp=4", -0.0107, 0.0000),
    ("S=4 M=8 gpipe tp=2", "S=2x2 M=8 interleaved tp=4", 0.0000, 0.0000),
    ("S=4 M=8 gpipe tp=2", "S=2x2 M=4 interleaved tp=4", 0.0000, 0.0078),
    ("S=4 M=8 1f1b tp=2", "S=2 M=8 gpipe tp=4", 0.0000, 0.0153),
    ("S=4 M=8 1f1b tp=2", "S=2 M=8 1f1b tp=4", 0.0000, 0.0000),
    ("S=4 M=8 1f1b tp=2", "S=2 M=4 gpipe tp=4", -0.0076, 0.0000),
    ("S=4 M=8 1f1b tp=2", "S=2 M=4 1f1b tp=4", -0.0323, 0.0000),
    ("S=4 M=8 1f1b tp=2", "S=2x2 M=8 interleaved tp=4", 0.0000, 0.0000),
    ("S=4 M=8 1f1b tp=2", "S=2x2 M=4 interleaved tp=4", 0.0000, 0.0000),
    ("S=4 M=4 gpipe tp=2", "S=2 M=8 gpipe tp=4", 0.0000, 0.0076),
    ("S=4 M=4 gpipe tp=2", "S=2 M=8 1f1b tp=4", -0.0149, 0.0000),
    ("S=4 M=4 gpipe tp=2", "S=2 M=4 gpipe tp=4", 0.0000, 0.0077),
    ("S=4 M=4 gpipe tp=2", "S=2 M=4 1f1b tp=4", -0.0107, 0.0000),
    ("S=4 M=4 gpipe tp=2", "S=2x2 M=8 interleaved tp=4", 0.0000, 0.0000),
    ("S=4 M=4 gpipe tp=2", "S=2x2 M=4 interleaved tp=4", 0.0000, 0.0077),
    ("S=4 M=4 1f1b tp=2", "S=2 M=8 gpipe tp=4", 0.0000, 0.0076),
    ("S=4 M=4 1f1b tp=2", "S=2 M=8 1f1b tp=4", -0.0149, 0.0000),
    ("S=4 M=4 1f1b tp=2", "S=2 M=4 gpipe tp=4", 0.0000, 0.0077),
    ("S=4 M=4 1f1b tp=2", "S=2 M=4 1f1b tp=4", -0.0107, 0.0000),
    ("S=4 M=4 1f1b tp=2", "S=2x2 M=8 interleaved tp=4", 0.0000, 0.0000),
    ("S=4 M=4 1f1b tp=2", "S=2x2 M=4 interleaved tp=4", 0.0000, 0.0077),
    ("S=2 M=8 gpipe tp=4", "S=2 M=8 gpipe tp=2", 0.0000, 0.0000),
    ("S=2 M=8 gpipe tp=4", "S=2 M=8 1f1b tp=2", -0.0297, 0.0000),
    ("S=2 M=8 gpipe tp=4", "S=2 M=4 gpipe tp=2", 0.0000, 0.0000),
    ("S=2 M=8 gpipe tp=4", "S=2 M=4 1f1b tp=2", -0.0277, 0.0000),
    ("S=2 M=8 gpipe tp=4", "S=4 M=8 gpipe tp=2", -0.0029, 0.0000),
    ("S=2 M=8 gpipe tp=4", "S=4 M=8 1f1b tp=2", -0.0353, -0.0173),
    ("S=2 M=8 gpipe tp=4", "S=4 M=4 gpipe tp=2", -0.0085, 0.0079),
    ("S=2 M=8 gpipe tp=4", "S=4 M=4 1f1b tp=2", -0.0204, 0.0000),
    ("S=2 M=8 gpipe tp=4", "S=2x2 M=8 interleaved tp=2", -0.0140, 0.0000),
    ("S=2 M=8 gpipe tp=4", "S=2x2 M=4 interleaved tp=2", -0.0106, 0.0000),
    ("S=2 M=8 1f1b tp=4", "S=2 M=8 gpipe tp=2", 0.0000, 0.0000),
    ("S=2 M=8 1f1b tp=4", "S=2 M=8 1f1b tp=2", -0.0198, 0.0000),
    ("S=2 M=8 1f1b tp=4", "S=2 M=4 gpipe tp=2", -0.0097, 0.0000),
    ("S=2 M=8 1f1b tp=4", "S=2 M=4 1f1b tp=2", -0.0277, 0.0000),
    ("S=2 M=8 1f1b tp=4", "S=4 M=8 gpipe tp=2", -0.0029, 0.0000),
    ("S=2 M=8 1f1b tp=4", "S=4 M=8 1f1b tp=2", -0.0270, -0.0173),
    ("S=2 M=8 1f1b tp=4", "S=4 M=4 gpipe tp=2", -0.0254, 0.0079),
    ("S=2 M=8 1f1b tp=4", "S=4 M=4 1f1b tp=2", -0.0254, 0.0000),
    ("S=2 M=8 1f1b tp=4", "S=2x2 M=8 interleaved tp=2", -0.0140, 0.0000),
    ("S=2 M=8 1f1b tp=4", "S=2x2 M=4 interleaved tp=2", -0.0106, 0.0000),
    ("S=2 M=4 gpipe tp=4", "S=2 M=8 gpipe tp=2", -0.0049, 0.0000),
    ("S=2 M=4 gpipe tp=4", "S=2 M=8 1f1b tp=2", -0.0297, 0.0000),
    ("S=2 M=4 gpipe tp=4", "S=2 M=4 gpipe tp=2", -0.0097, 0.0000),
    ("S=2 M=4 gpipe tp=4", "S=2 M=4 1f1b tp=2", -0.0278, 0.0000),
    ("S=2 M=4 gpipe tp=4", "S=4 M=8 gpipe tp=2", -0.0115, 0.0000),
    ("S=2 M=4 gpipe tp=4", "S=4 M=8 1f1b tp=2", -0.0353, -0.0173),
    ("S=2 M=4 gpipe tp=4", "S=4 M=4 gpipe tp=2", -0.0254, 0.0000),
    ("S=2 M=4 gpipe tp=4", "S=4 M=4 1f1b tp=2", -0.0254, 0.0000),
    ("S=2 M=4 gpipe tp=4", "S=2x2 M=8 interleaved tp=2", -0.0140, 0.0000),
    ("S=2 M=4 gpipe tp=4", "S=2x2 M=4 interleaved tp=2", -0.0106, 0.0000),
    ("S=2 M=4 1f1b tp=4", "S=2 M=8 gpipe tp=2", -0.0049, 0.0000),
    ("S=2 M=4 1f1b tp=4", "S=2 M=8 1f1b tp=2", -0.0198, 0.0000),
    ("S=2 M=4 1f1b tp=4", "S=2 M=4 gpipe tp=2", -0.0097, 0.0000),
    ("S=2 M=4 1f1b tp=4", "S=2 M=4 1f1b tp=2", -0.0139, 0.0000),
    ("S=2 M=4 1f1b tp=4", "S=4 M=8 gpipe tp=2", -0.0115, 0.0000),
    ("S=2 M=4 1f1b tp=4", "S=4 M=8 1f1b tp=2", -0.0270, -0.0173),
    ("S=2 M=4 1f1b tp=4", "S=4 M=4 gpipe tp=2", -0.0254, 0.0000),
    ("S=2 M=4 1f1b tp=4", "S=4 M=4 1f1b tp=2", -0.0254, 0.0000),
    ("S=2 M=4 1f1b tp=4", "S=2x2 M=8 interleaved tp=2", -0.0140, 0.0000),
    ("S=2 M=4 1f1b tp=4", "S=2x2 M=4 interleaved tp=2", -0.0106, 0.0000),
)
TP_RATIOS = (0.5, 2.0)  # the TP degrees the pairs change (new / recorded)
# Another TP degree where FSDP2 shards the stages (examples/pipeline.py --dp 2 --tp 2: a (pp,
# dp_shard, tp) mesh of 8 ranks, as torchtitan composes the three), forecast without TP (tp 1),
# alone and with the dp_shard degree 2 -> 4 at once (the same 8 ranks: TP traded for FSDP), every
# stage against the worst of its dp ranks (tests/test_forecast.py::
# test_pipeline_fsdp_tp_layout_forecast). TP 4 under FSDP would take 16 ranks: not recorded.
FSDP_TP_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2 M=8 gpipe dp=2 tp=1", 0.0000, 0.0000),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2 M=4 gpipe dp=2 tp=1", 0.0000, 0.0000),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2 M=8 1f1b dp=2 tp=1", 0.0177, 0.0214),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2 M=4 1f1b dp=2 tp=1", 0.0081, 0.0219),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=4 M=8 gpipe dp=2 tp=1", 0.0000, 0.0048),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=4 M=8 1f1b dp=2 tp=1", 0.0253, 0.0370),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=4 M=4 1f1b dp=2 tp=1", 0.0098, 0.0327),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2x2 M=8 interleaved dp=2 tp=1", 0.0089, 0.0175),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2x2 M=4 interleaved dp=2 tp=1", 0.0000, 0.0152),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2 M=8 gpipe dp=4 tp=1", 0.0000, 0.0000),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2 M=8 1f1b dp=4 tp=1", 0.0186, 0.0227),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2 M=4 1f1b dp=4 tp=1", 0.0084, 0.0229),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2x2 M=8 interleaved dp=4 tp=1", 0.0092, 0.0182),
    ("S=2 M=8 gpipe dp=2 tp=2", "S=2x2 M=4 interleaved dp=4 tp=1", 0.0000, 0.0157),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2 M=8 gpipe dp=2 tp=1", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2 M=4 gpipe dp=2 tp=1", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2 M=8 1f1b dp=2 tp=1", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2 M=4 1f1b dp=2 tp=1", -0.0110, -0.0081),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=4 M=8 gpipe dp=2 tp=1", 0.0000, 0.0047),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=4 M=8 1f1b dp=2 tp=1", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=4 M=4 1f1b dp=2 tp=1", 0.0000, 0.0103),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2x2 M=8 interleaved dp=2 tp=1", 0.0000, 0.0264),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2x2 M=4 interleaved dp=2 tp=1", 0.0000, 0.0129),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2 M=8 gpipe dp=4 tp=1", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2 M=8 1f1b dp=4 tp=1", 0.0000, 0.0000),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2 M=4 1f1b dp=4 tp=1", -0.0115, -0.0084),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2x2 M=8 interleaved dp=4 tp=1", 0.0000, 0.0273),
    ("S=2 M=4 1f1b dp=2 tp=2", "S=2x2 M=4 interleaved dp=4 tp=1", 0.0000, 0.0132),
)
FSDP_TP_RATIOS = (0.5, 0.5)  # the TP degree those pairs change (new / recorded)
# DeepSpeed's PipelineEngine (its 1F1B TrainSchedule; tests/ds_pipe.py, 8 residual MLP blocks
# of dim 256, 32 rows a step, deepspeed 0.19.8 on CPU): every layout forecast to the others,
# every stage against the same stage of the run recorded in that layout; its receive buffers
# one per kind (scaled with the micro-batch), its pipe buffers rings of slots. Held out (dim
# 160, S=2 M=8 <-> S=4 M=4): -1.1%..+4.9%
DEEPSPEED_PAIRS: tuple[tuple[str, str, float, float], ...] = (
    ("S=2 M=8", "S=2 M=4", 0.0217, 0.0272),
    ("S=2 M=8", "S=4 M=8", 0.0050, 0.0265),
    ("S=2 M=8", "S=4 M=4", -0.0135, 0.0506),
    ("S=2 M=4", "S=2 M=8", 0.0000, 0.0000),
    ("S=2 M=4", "S=4 M=8", -0.0261, 0.0265),
    ("S=2 M=4", "S=4 M=4", -0.0090, 0.0379),
    ("S=4 M=8", "S=2 M=8", 0.0110, 0.0188),
    ("S=4 M=8", "S=2 M=4", 0.0304, 0.0408),
    ("S=4 M=8", "S=4 M=4", 0.0202, 0.0384),
    ("S=4 M=4", "S=2 M=8", 0.0187, 0.0276),
    ("S=4 M=4", "S=2 M=4", 0.0174, 0.0204),
    ("S=4 M=4", "S=4 M=8", -0.0177, 0.0261),
)
# what the pairs span: stage-count and micro-batch-count ratios (new / recorded)
STAGE_RATIOS = (0.5, 2.0)
MICROBATCH_RATIOS = (0.5, 2.0)
SOURCE = ("tests/test_forecast.py::test_pipeline_layout_forecast, "
          "test_pipeline_fsdp_layout_forecast, test_pipeline_fsdp_world_layout_forecast and "
          "test_pipeline_interleaved_layout_forecast: the bundled pipeline example recorded on "
          "CPU (gloo) at 2 and 4 stages, 4 and 8 micro-batches, GPipe and 1F1B, without and "
          "with FSDP2 sharding each stage over 2 ranks (and over 4 at 2 stages), each layout "
          "forecast to the others and to ScheduleInterleaved1F1B's")

DEEPSPEED_SOURCE = ("tests/test_deepspeed_pipe.py::test_deepspeed_pipeline_forecast: DeepSpeed's "
                    "PipelineEngine (tests/ds_pipe.py) recorded on CPU (gloo) at 2 and 4 stages, "
                    "4 and 8 micro-batches, each layout forecast to the others (and with each "
                    "stage data parallel over 2 ranks, without ZeRO and under ZeRO-1)")


def band(sc: PipeScenario, src: StageSource, srcs: list[StageSource] | None = None) -> dict:
    """The lowest and highest error measured on the pairs (one band: every pair changes the
    schedule, the stage count or the micro-batch count, several at once; FSDP's pairs when FSDP
    shards the stage), what lies outside them; the recorded layout itself is the recording
    replayed (exact)."""
    world = sc.world_size is not None and sc.world_size != src.world_size
    tp = sc.tp is not None and sc.tp != src.tp
    if (sc.stages * sc.virtual, sc.microbatches, sc.schedule, sc.virtual, world, tp) == \
            (src.stages, src.microbatches, src.schedule, src.virtual, False, False) and \
            src.regular:  # (a rank of a looped schedule in another order runs a new one)
        return {"low": 0.0, "high": 0.0, "pairs": 0, "validated": True, "not_validated": [],
                "exact": True}
    fsdp = bool(src.d.mask(*FSDP_CATEGORIES).any())
    pairs = {(False, False, False): PAIRS, (True, False, False): FSDP_PAIRS,
             (False, True, False): INTERLEAVED_PAIRS,
             (True, True, False): FSDP_INTERLEAVED_PAIRS,
             (True, False, True): FSDP_WORLD_PAIRS,
             (True, True, True): FSDP_WORLD_INTERLEAVED_PAIRS,
             }.get((fsdp, sc.schedule == INTERLEAVED, world), ())
    why = []
    if src.deepspeed:  # its engine's TrainSchedule: its own pairs, no FSDP, TP or other schedule
        pairs = DEEPSPEED_PAIRS
        if sc.schedule != ONE_F_ONE_B:
            why.append("DeepSpeed's PipelineEngine runs its own 1F1B TrainSchedule: another "
                       "schedule is torch.distributed.pipelining's (no recorded pair)")
        if world or tp:
            why.append("another data-parallel or TP degree under DeepSpeed's pipeline engine "
                       "(no recorded pair)")
    if src.virtual > 1:  # an interleaved recording: each of its stages a source
        pairs = FSDP_FROM_INTERLEAVED_PAIRS if fsdp else FROM_INTERLEAVED_PAIRS
        if src.virtual > 2:
            why.append(f"a recording of {src.virtual} stages per rank (the pairs ran 2"
                       + ("; the looped runtime's RESHARD of a stage no longer among the next "
                          "3 to run is not modelled)" if fsdp else ")"))
        if world or tp:
            why.append("another FSDP world size or TP degree from an interleaved recording (no "
                       "recorded pair)")
        fix = src.looped_bfs and sc.schedule == INTERLEAVED and not (world or tp) and \
            (sc.stages * sc.virtual, sc.microbatches, sc.virtual) == \
            (src.stages, src.microbatches, src.virtual)
        if fix:  # ScheduleLoopedBFS's own fix (pipeline.all_forward_before_backward)
            pairs = FSDP_FROM_LOOPED_BFS_PAIRS if fsdp else FROM_LOOPED_BFS_PAIRS
        elif not src.regular:
            why.append("the rank's stages ran in an order other than ScheduleInterleaved1F1B's "
                       "(another looped schedule, or a rank whose place is unknown): the pairs "
                       "ran that one")
    if world:
        r = (sc.world_size or 0) / (src.world_size or 1)
        if not WORLD_RATIOS[0] <= r <= WORLD_RATIOS[1]:
            why.append(f"FSDP world size {sc.world_size} is {r:g}x the recorded "
                       f"{src.world_size} (pairs: {WORLD_RATIOS[0]:g}x..{WORLD_RATIOS[1]:g}x)")
    if tp and not src.deepspeed:
        pairs, (lo, hi) = (FSDP_TP_PAIRS, FSDP_TP_RATIOS) if fsdp else (TP_PAIRS, TP_RATIOS)
        r = (sc.tp or 0) / (src.tp or 1)
        if not lo <= r <= hi:
            why.append(f"TP {sc.tp} is {r:g}x the recorded {src.tp} (pairs"
                       f"{' with FSDP' if fsdp else ''}: {lo:g}x..{hi:g}x)")
    if not pairs:
        why.append("no recorded pair for this change")
    lo = min((p[2] for p in pairs), default=0.0)
    hi = max((p[3] for p in pairs), default=0.0)
    total = sc.stages * sc.virtual  # what scales the layers: every stage of the pipeline
    if total != src.stages and src.stages:
        r = total / src.stages
        if not STAGE_RATIOS[0] <= r <= STAGE_RATIOS[1]:
            what = f"{sc.stages} ranks x {sc.virtual}" if sc.virtual > 1 else ""
            why.append(f"{total} stages{f' ({what})' if what else ''} is {r:g}x the recorded "
                       f"{src.stages} (pairs: {STAGE_RATIOS[0]:g}x..{STAGE_RATIOS[1]:g}x)")
    if sc.virtual > 2:
        why.append(f"{sc.virtual} stages per rank (the interleaved pairs run 2)")
    r = sc.microbatches / src.microbatches
    if not MICROBATCH_RATIOS[0] <= r <= MICROBATCH_RATIOS[1]:
        why.append(f"{sc.microbatches} micro-batches is {r:g}x the recorded "
                   f"{src.microbatches} (pairs: {MICROBATCH_RATIOS[0]:g}x.."
                   f"{MICROBATCH_RATIOS[1]:g}x)")
    if src.d.snapshot.kind.caching_allocator:
        why.append("the pairs are CPU recordings (no caching allocator, no NCCL buffers)")
    every = srcs or [src]
    if total > 2 and not any(0 < (s.stage or 0) < (s.stages or 0) - 1 for s in every) and \
            any(_head_unnamed(s) for s in every):
        why.append("the last stage's recording names its parameters but no tensor it saved (the "
                   "script's own saved-tensor hooks shadowed the recorder's): its norm, head and "
                   "loss cannot be told from its layers, so a middle stage rebuilt from it keeps "
                   "them")
    if any(s.d.mask(*FSDP_CATEGORIES).any() and s.gathered is None for s in every):
        why.append("FSDP shards a stage whose gathers cannot be replayed (none inside the step, "
                   "or one outside FSDP2's `FSDP::pre_forward (unit)` / `pre_backward` ranges): "
                   "they are copied as recorded (-12%..+37% measured that way)")
    return {"low": lo, "high": hi, "pairs": len(pairs), "validated": not why,
            "not_validated": why, "exact": False}


@dataclass
class PipelineForecast:
    source: str
    recorded: dict
    scenarios: list[dict]
    notes: list[str]

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "source": self.source, "recorded": self.recorded,
                "notes": self.notes, "scenarios": self.scenarios}

    def to_frame(self):
        """One row per scenario and stage (pandas DataFrame), the worst stage flagged."""
        import pandas as pd

        rows = []
        for sc in self.scenarios:
            band = sc["error_band"]
            for p in sc["per_stage"]:
                rows.append({"stages": sc["stages"], "microbatches": sc["microbatches"],
                             "schedule": sc["schedule"],
                             "virtual_stages": sc["virtual_stages"],
                             "world_size": sc["world_size"], "tp": sc["tp"], **p,
                             "worst": p["stage"] == sc["worst_stage"],
                             "error_low": band["low"], "error_high": band["high"],
                             "validated": band["validated"]})
        return pd.DataFrame(rows)


def pipeline_forecast(analyses: list[DeviceAnalysis], stages=(), microbatches=(),
                      schedules=(), source_name: str = "", world_sizes=(),
                      tps=()) -> PipelineForecast:
    """Each stage's peak under every combination of pipeline degree, micro-batch count,
    schedule, FSDP world size (the ranks FSDP shards a stage over) and TP degree (empty = as
    recorded), from the recorded stages; the worst stage named."""
    from snapforensics.errors import SnapError
    from snapforensics.snapshot.tensors import MAX_TP

    if any(not 1 <= int(x) <= MAX_STAGES for x in stages) or \
            any(not 1 <= int(x) <= MAX_MICROBATCHES for x in microbatches):
        raise SnapError(f"pipeline forecast: stages and micro-batches from 1 to {MAX_STAGES} "
                        "(the largest pipelines run tens of stages and a few hundred "
                        "micro-batches)")
    if any(not 1 <= int(x) <= MAX_WORLD for x in world_sizes) or \
            any(not 1 <= int(x) <= MAX_TP for x in tps):
        raise SnapError(f"pipeline forecast: world sizes from 1 to {MAX_WORLD}, TP degrees from "
                        f"1 to {MAX_TP}")
    srcs: list[StageSource] = []
    why: list[str] = []
    for d in analyses:
        got = sources(d)
        if isinstance(got, str):
            why.append(got)
        else:
            srcs.extend(got)
    if not srcs:
        raise SnapError(f"cannot forecast the pipeline: {why[0] if why else 'no stage'}")
    # the run's schedule: a stage whose warm-up covers every micro-batch (1F1B's first stage
    # when M <= S) runs them in GPipe's order, but with 1F1B's waits
    if any(s.schedule == ONE_F_ONE_B for s in srcs):
        for s in srcs:
            s.schedule = ONE_F_ONE_B
    first = srcs[0]
    if any((s.stages, s.virtual) != (first.stages, first.virtual) for s in srcs):
        raise SnapError("cannot forecast the pipeline: the files are of different pipeline "
                        "layouts (their stage counts differ)")
    notes = []
    if first.stages is None:
        notes.append("the files do not say their stage (no pipeline group in the recorder's "
                     "provenance, and the world is not the pipeline's alone: the blocks show "
                     "another dimension beside it, or groups made without a name split it): "
                     "each is taken for every stage")
    by = {s.stage: s for s in srcs}
    if first.stages is not None and len(by.keys() - {None}) < first.stages:
        have = ", ".join(str(k) for k in sorted(k for k in by if k is not None))
        notes.append(f"only stage(s) {have} of {first.stages} recorded here: the others are "
                     "forecast from these files' blocks, so a first stage's embedding or a last "
                     "stage's head and loss that are not in them are missing from their rows, "
                     "and the worst stage is named among what these files show; give the "
                     "folder of every rank's file to forecast each stage from its own")
    ranks = first.stages // first.virtual if first.stages else None
    recorded = {"stages": ranks, "virtual_stages": first.virtual,
                "microbatches": first.microbatches,
                "schedule": "looped_bfs" if first.looped_bfs else first.schedule,
                "layers": first.layers,
                "world_size": first.world_size, "tp": first.tp,
                "stage_files": sorted(k for k in by if k is not None),
                "peaks": {str(s.stage): s.d.peak_bytes for s in srcs}}  # a rank's, per stage
    if first.deepspeed:  # its band is its own pairs' (DEEPSPEED_SOURCE)
        recorded["runtime"] = "deepspeed"
    try:
        kinds = [parse_schedule(str(k)) for k in schedules] or [(first.schedule, first.virtual)]
    except ValueError as e:
        raise SnapError(f"pipeline forecast: schedule {str(e)[:40]!r}: expected gpipe, 1f1b or "
                        f"interleaved[:V] (V stages per rank, 2 to {MAX_VIRTUAL})") from None
    scen = [PipeScenario(int(p), int(m), k, v, None if w is None else int(w),
                         None if t is None else int(t))
            for w in (world_sizes or [None])
            for t in (tps or [None])
            for p in (stages or [ranks or 1])
            for m in (microbatches or [first.microbatches])
            for k, v in kinds]
    out = []
    for sc in scen:
        preds = predict(srcs, sc)
        ok = [p for p in preds if p.predicted_peak_bytes is not None]
        worst = max(ok, key=lambda p: p.predicted_peak_bytes or 0) if ok else None
        out.append({"stages": sc.stages, "microbatches": sc.microbatches,
                    "schedule": sc.schedule, "virtual_stages": sc.virtual,
                    "world_size": sc.world_size or first.world_size, "tp": sc.tp or first.tp,
                    "worst_stage": worst.stage if worst else None,
                    "worst_peak_bytes": worst.predicted_peak_bytes if worst else None,
                    "error_band": band(sc, first, srcs),
                    "per_stage": [p.to_dict() for p in preds]})
    return PipelineForecast(source_name, recorded, out, notes)
