"""A tiny Hugging Face Llama under transformers' own tensor parallelism
(`from_pretrained(..., tp_plan="auto")`: the model's `base_model_tp_plan`, column- and row-wise
attention and MLP projections on the mesh transformers builds), a few AdamW steps, for the
tests of a run no script of ours parallelizes: rank 0 saves a random model (vocabulary 3000,
4 layers of hidden 96, 8 heads) into a temporary folder, every rank loads it from there.

    snapforensics record --nproc-per-node 2 --device cpu tests/hf_tp.py
"""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="hf-tp-") if rank == 0 else None]
    if rank == 0:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=3000, hidden_size=96, intermediate_size=288,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                          max_position_embeddings=256)
        LlamaForCausalLM(cfg).save_pretrained(folder[0])
    dist.broadcast_object_list(folder, src=0)
    model = LlamaForCausalLM.from_pretrained(folder[0], tp_plan="auto", dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 3000, (8, 96), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
