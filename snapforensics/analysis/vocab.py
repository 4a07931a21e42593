"""The analysis's vocabulary: phases, block categories and finding verdicts.

Values are the ones the JSON contract carries (categories, verdicts) and the codes the per-row and
per-block int8 arrays hold (phases, category codes), so neither ever changes when a member is
added at the end.
"""

from __future__ import annotations

from enum import IntEnum

from snapforensics._compat import StrEnum


class Phase(IntEnum):
    """A row's phase; also the phase hint a stack shows (UNKNOWN: none)."""

    INIT = 0
    FORWARD = 1
    BACKWARD = 2
    RECOMPUTE = 3  # activation-checkpoint recompute, inside backward
    OPTIMIZER = 4
    UNKNOWN = 5

    @property
    def label(self) -> str:
        """The name the JSON and the reports use ("forward")."""
        return self.name.lower()


PHASE_LABELS = tuple(p.label for p in Phase)  # by code, for the int8 phase arrays

# Phases of backward: recompute runs inside it.
BACKWARD_PHASES = (Phase.BACKWARD, Phase.RECOMPUTE)


class Category(StrEnum):
    """What made a block (stable ids, used in JSON). A block's code is its index in CATEGORIES."""

    ALL_GATHER = "fsdp.all_gather_buffer"
    UNSHARDED_PARAM = "fsdp.unsharded_param"
    REDUCE_SCATTER = "fsdp.reduce_scatter_buffer"
    SHARDED_GRAD = "fsdp.sharded_grad"
    UNSHARDED_GRAD = "fsdp.unsharded_grad"
    SHARDED_PARAM = "fsdp.sharded_param"
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENT = "gradient"
    ACTIVATION = "activation"
    RECOMPUTE_ACTIVATION = "recompute_activation"
    PARAMETER = "parameter"
    OTHER = "other"
    UNTRACED = "untraced"  # alive before the first trace entry: what made it is not in the file
    # DDP (`torch.nn.parallel.DistributedDataParallel`, and `replicate` which wraps it)
    DDP_BUCKET = "ddp.bucket"  # the Reducer's flat gradient buckets (and its per-param maps)
    DDP_GRAD_COPY = "ddp.grad_copy"  # a `.grad` kept beside its bucket slice (not a view of it)
    # Mixture of experts under expert parallelism: what the token dispatcher makes on the way to
    # the experts' ranks (permuted tokens, the all-to-all's send and receive buffers) and back
    MOE_DISPATCH = "moe.dispatch_buffer"
    MOE_COMBINE = "moe.combine_buffer"
    # Tensor parallelism: DTensor's redistribute (`torch/distributed/tensor/placement_types.py`),
    # called by the parallel styles' hooks and by DTensor ops, forward and backward
    TP_ALL_GATHER = "tp.all_gather"  # Shard -> Replicate (SequenceParallel's gathered sequence)
    TP_REDUCE_SCATTER = "tp.reduce_scatter"  # Partial -> Shard (RowwiseParallel output, SP on)
    TP_ALL_REDUCE = "tp.all_reduce"  # Partial -> Replicate (RowwiseParallel output, SP off)
    # Pipeline parallelism: what a stage receives from its neighbours (the previous stage's
    # activations for each micro-batch, held to its backward; the next stage's input grads)
    PP_P2P = "pp.p2p_buffer"
    # Megatron-Core (`megatron/core/`): its DDP's contiguous buffers, the distributed optimizer's
    # fp32 main parameters, what the buffers' param all-gather / grad reduce-scatter allocate
    MEGATRON_BUFFER = "megatron.param_grad_buffer"
    MEGATRON_MAIN_PARAM = "megatron.main_param"
    MEGATRON_BUCKET_COMM = "megatron.bucket_comm"
    # DeepSpeed ZeRO: its gradient reduction bucket (`reduce_bucket_size` elements)
    DEEPSPEED_REDUCE_BUCKET = "deepspeed.reduce_bucket"
    # DeepSpeed ZeRO-3: the flat buffers its parameter all-gathers fill (a module's parameters
    # for its forward or backward, the persistent ones kept gathered)
    DEEPSPEED_GATHERED_PARAM = "deepspeed.gathered_param"


CATEGORIES = tuple(Category)
CAT_CODE = {c: i for i, c in enumerate(CATEGORIES)}
FSDP_CATEGORIES = frozenset({Category.ALL_GATHER, Category.UNSHARDED_PARAM,
                             Category.REDUCE_SCATTER, Category.SHARDED_GRAD,
                             Category.UNSHARDED_GRAD, Category.SHARDED_PARAM})
DDP_CATEGORIES = frozenset({Category.DDP_BUCKET, Category.DDP_GRAD_COPY})
MOE_CATEGORIES = frozenset({Category.MOE_DISPATCH, Category.MOE_COMBINE})
TP_CATEGORIES = frozenset({Category.TP_ALL_GATHER, Category.TP_REDUCE_SCATTER,
                           Category.TP_ALL_REDUCE})


class Verdict(StrEnum):
    ANOMALOUS = "anomalous"  # a defect: fixing it lowers the peak
    EXPECTED = "expected"  # what a setting is designed to cost
    INFO = "info"  # advice or context, no defect
