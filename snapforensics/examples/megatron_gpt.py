"""A Megatron-Core GPT trained a few steps on the CPU (gloo), for ground truth on Megatron's own
buffers: tensor parallelism (``--tp``, ``--sp`` for its sequence parallelism), Megatron's DDP
with its contiguous param/grad buffers and the distributed optimizer (bf16 parameters with fp32
main-parameter shards), micro-batches through its pipeline schedule's no-pipelining path, and
``--recompute`` for its activation checkpointing (``recompute_granularity="full"``).

Megatron-Core's own Python code runs unchanged; what it asks of CUDA is answered by the CPU: the
current device (``torch.cuda.current_device``), the RNG state its tracker forks (Megatron's
``_get_cuda_rng_state`` / ``_set_cuda_rng_state``), ``Tensor.cuda`` and the tensor type names
its optimizer checks (``torch.cuda.BFloat16Tensor``), ``torch.cuda.synchronize`` (its p2p waits
on gloo's requests first), and the few factory calls that name
``device="cuda"`` (the causal mask, the schedule's token count, the optimizer's overflow flag):
torch's factory functions map that device to the CPU. The norms are torch's LayerNorm with
their parameters marked ``sequence_parallel``, as apex's FusedLayerNorm (a CUDA extension) does.

The truth (``--truth DIR``, per rank): the buffers' and main parameters' storages (address and
bytes) read from the running DDP wrapper and optimizer, every tensor the stage received from its
pipeline neighbours (``--pp``), the parallel degrees and the sizes.
Needs ``megatron-core`` (the ``test`` extra pins it).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from snapforensics.examples.common import parser, write_truth

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand",
              "randn", "randint", "eye", "empty_like", "zeros_like", "ones_like", "full_like")


def _on_cpu(make):
    def made_on_cpu(*args, **kwargs):
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return make(*args, **kwargs)
    return made_on_cpu


def _cuda_is_cpu() -> None:
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.Tensor.cuda = lambda self, *a, **k: self
    name = torch.Tensor.type

    def cuda_type(self, *a, **k):
        r = name(self, *a, **k)
        if not a and not k and r.startswith("torch.") and not r.startswith("torch.cuda."):
            return "torch.cuda." + r[len("torch."):]
        return r

    torch.Tensor.type = cuda_type
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def norm(cls, config, hidden_size, eps=1e-5, **_):
        # what apex's FusedLayerNorm (a CUDA extension) does under sequence parallelism: a
        # LayerNorm over the sequence shard, its parameters marked for Megatron's grad all-reduce
        m = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        for w in m.parameters():
            w.sequence_parallel = config.sequence_parallel
        return m

    WrappedTorchNorm.__new__ = norm


def _record_receives(received: list) -> None:
    """Every tensor a pipeline stage receives (Megatron's P2PCommunicator._communicate returns
    them), by storage, into ``received``."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    communicate = P2PCommunicator._communicate

    def recording(self, *args, **kwargs):
        prev, nxt, reqs = communicate(self, *args, **kwargs)
        received.extend(_storage(t) for t in (prev, nxt) if isinstance(t, torch.Tensor))
        return prev, nxt, reqs

    P2PCommunicator._communicate = recording


def _storage(t: torch.Tensor) -> dict:
    s = t.untyped_storage()
    return {"addr": s.data_ptr(), "bytes": s.nbytes()}


def main(argv: list[str] | None = None) -> None:
    p = parser(layers=2, dim=64, batch=4, seq=64, steps=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (Megatron's 1F1B)")
    p.add_argument("--sp", action="store_true", help="Megatron's sequence parallelism")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--recompute", action="store_true", help="recompute_granularity='full'")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--no-distributed-optimizer", dest="dist_opt", action="store_false",
                   help="Megatron's non-distributed mixed-precision optimizer: every data-"
                        "parallel rank keeps fp32 main parameters and Adam's states whole")
    a = p.parse_args(argv)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's SP check reads it
    dist.init_process_group("gloo")
    _cuda_is_cpu()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp,
                                             pipeline_model_parallel_size=a.pp)
    model_parallel_cuda_manual_seed(0)
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1) if a.recompute else {}
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.dim, num_attention_heads=a.heads,
                            tensor_model_parallel_size=a.tp, sequence_parallel=a.sp,
                            pipeline_model_parallel_size=a.pp,
                            use_cpu_initialization=True, bf16=True,
                            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                            hidden_dropout=0.0, attention_dropout=0.0, **recompute)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=a.vocab, max_sequence_length=a.seq,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    model = Float16Module(cfg, model)  # as megatron.training's get_model wraps a bf16 model
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=a.dist_opt), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True,
                                                 use_distributed_optimizer=a.dist_opt), [model])
    step_fn = get_forward_backward_func()
    g = torch.Generator().manual_seed(0)

    def batches():
        while True:
            t = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
            yield t, torch.arange(a.seq).repeat(a.batch, 1)

    def forward_step(it, m):
        tokens, pos = next(it)
        out = m(tokens, pos, None, labels=tokens)

        def loss(o):
            v = o.float().mean()
            return v, {"lm loss": v}
        return out, loss

    it = batches()
    received: list[dict] = []
    _record_receives(received)
    for _ in range(a.steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        step_fn(forward_step_func=forward_step, data_iterator=it, model=[model],
                num_microbatches=a.micro_batches, seq_length=a.seq, micro_batch_size=a.batch,
                forward_only=False)
        opt.step()
    bufs = [b for b in model.buffers + model.expert_parallel_buffers]
    inner = getattr(opt, "chained_optimizers", [opt])
    # the fp32 main parameters: the distributed optimizer's shards, or the whole copies of the
    # non-distributed one (Float16OptimizerWithFloat16Params); and Adam's states of them
    mains = [t for o in inner for grp in (getattr(o, "shard_fp32_from_float16_groups", None) or
                                          getattr(o, "fp32_from_float16_groups", []))
             for t in grp]
    states = [v for o in inner for st in o.optimizer.state.values() for v in st.values()
              if isinstance(v, torch.Tensor) and v.numel() > 1]
    write_truth(a.truth, dist.get_rank(), {
        "tp": parallel_state.get_tensor_model_parallel_world_size(), "sp": a.sp,
        "dp": parallel_state.get_data_parallel_world_size(), "recompute": a.recompute,
        "micro_batches": a.micro_batches, "layers": a.layers, "dim": a.dim, "seq": a.seq,
        "batch": a.batch,
        "param_buffers": [_storage(b.param_data) for b in bufs if b.param_data is not None],
        "grad_buffers": [_storage(b.grad_data) for b in bufs],
        "main_params": [_storage(t) for t in mains], "pp": a.pp,
        "distributed_optimizer": a.dist_opt, "optimizer_states": [_storage(t) for t in states],
        "stage": parallel_state.get_pipeline_model_parallel_rank(), "received": received})
    with contextlib.suppress(Exception):
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
