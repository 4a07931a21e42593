"""The scenario matrix's ground truth: FSDP's own state read during a run (`Probe`: unsharded
parameter and gradient bytes alive, all-gathers issued and used in backward), and the bytes a set
of tensors holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn


class Probe:
    """FSDP's own state, read during the run (``--check``)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.in_backward = False
        self.gathers: dict[str, int] = {}
        self.used: dict[str, int] = {}
        self.pending_at_finalize = 0
        self.fsdp = "none"
        self._undo: list[Callable] = []
        self._fsdp2_groups = []
        self._fsdp1_handles = []
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for name, m in model.named_modules():
            if isinstance(m, FSDPModule):
                self.fsdp = "fsdp2"
                for g in m._get_fsdp_state()._fsdp_param_groups:
                    self._fsdp2_groups.append((name or "(root)", m is model, g))
            elif isinstance(m, FSDP) and m._handle is not None:
                self.fsdp = "fsdp1"
                self._fsdp1_handles.append((name or "(root)", m is model, m._handle))
        self._patch()

    # -- counting all-gathers (patched on the classes for the duration of one layout)
    def _patch(self) -> None:
        probe = self
        if self.fsdp == "fsdp2":
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

            names = {id(g): n for n, _, g in self._fsdp2_groups}
            orig_unshard, orig_wait = FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard
            orig_final = FSDPParamGroup.finalize_backward

            def unshard(self, *a, **k):
                before = self._all_gather_result
                out = orig_unshard(self, *a, **k)
                if probe.in_backward and before is None and self._all_gather_result is not None:
                    n = names.get(id(self), "?")
                    probe.gathers[n] = probe.gathers.get(n, 0) + 1
                return out

            def wait_for_unshard(self, *a, **k):
                if probe.in_backward and self._all_gather_result is not None:
                    n = names.get(id(self), "?")
                    probe.used[n] = probe.used.get(n, 0) + 1
                return orig_wait(self, *a, **k)

            def finalize_backward(self, *a, **k):
                if self._all_gather_result is not None:
                    probe.pending_at_finalize += 1
                return orig_final(self, *a, **k)

            FSDPParamGroup.unshard = unshard
            FSDPParamGroup.wait_for_unshard = wait_for_unshard
            FSDPParamGroup.finalize_backward = finalize_backward

            def undo():
                FSDPParamGroup.unshard = orig_unshard
                FSDPParamGroup.wait_for_unshard = orig_wait
                FSDPParamGroup.finalize_backward = orig_final
            self._undo.append(undo)
        elif self.fsdp == "fsdp1":
            from torch.distributed.fsdp._flat_param import FlatParamHandle

            names = {id(h): n for n, _, h in self._fsdp1_handles}
            orig = FlatParamHandle._all_gather_flat_param

            def all_gather(self, *a, **k):
                if probe.in_backward:
                    n = names.get(id(self), "?")
                    probe.gathers[n] = probe.gathers.get(n, 0) + 1
                    probe.used[n] = probe.used.get(n, 0) + 1  # FSDP1 uses what it gathers
                return orig(self, *a, **k)

            FlatParamHandle._all_gather_flat_param = all_gather
            self._undo.append(lambda: setattr(FlatParamHandle, "_all_gather_flat_param", orig))

    def close(self) -> None:
        for u in self._undo:
            u()
        self._undo.clear()

    # -- bytes of FSDP state alive now
    def unsharded(self) -> dict[str, int]:
        root = other = grads = 0
        seen: set[int] = set()
        for _, is_root, g in self._fsdp2_groups:
            for p in g.fsdp_params:
                for t in p.all_gather_outputs:
                    s = t.untyped_storage()
                    if s.data_ptr() in seen or not s.size():
                        continue
                    seen.add(s.data_ptr())
                    if is_root:
                        root += s.size()
                    else:
                        other += s.size()
                for gr in (getattr(p, "unsharded_accumulated_grad", None),
                           getattr(getattr(p, "_unsharded_param", None), "grad", None)):
                    if gr is not None:
                        grads += gr.untyped_storage().size()
        for _, is_root, h in self._fsdp1_handles:
            fp = h.flat_param
            for attr in ("_full_param_padded", "_full_prec_full_param_padded"):
                t = getattr(fp, attr, None)
                if t is None or not t.untyped_storage().size():
                    continue
                n = t.untyped_storage().size()
                if not h.uses_sharded_strategy:
                    continue
                if is_root:
                    root += n
                else:
                    other += n
            if fp.grad is not None and h.uses_sharded_strategy and \
                    fp.grad.numel() == fp._unpadded_unsharded_size.numel():
                grads += fp.grad.untyped_storage().size()
        return {"root": root, "nonroot": other, "grads": grads}

    def take_backward(self) -> dict:
        out = {"gathers": dict(self.gathers), "used": dict(self.used),
               "pending_at_finalize": self.pending_at_finalize}
        self.gathers.clear()
        self.used.clear()
        self.pending_at_finalize = 0
        return out


def tensor_bytes(obj) -> int:
    seen: set[int] = set()
    total = 0
    for t in obj:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.size()
    return total
