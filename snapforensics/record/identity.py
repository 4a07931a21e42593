"""Tensor identity while recording (issue 29, item 1): which tensor each storage is.

``TensorNames`` watches a run and notes, each time it sees a tensor, its storage's data
pointer, the tensor's byte offset and size in it, the time (epoch microseconds, the trace's own
clock) and an identity: the tensor's name, kind, owning module, shape and dtype.

- parameters, their gradients and optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``, ...):
  at every optimizer step (torch's global step pre/post hooks), named by the model's own
  ``named_parameters()`` (``layers.3.mlp.w1.weight``, ``layers.3.mlp.w1.weight.grad``,
  ``layers.3.mlp.w1.weight.exp_avg``). The model is the root of the modules the run calls (a
  global forward pre hook sees each module called with no module around it), or the one given.
- FSDP2 (``fully_shard``): the unsharded parameter's storage (what FSDP's all-gather copy-out
  fills, ``kind`` ``unsharded_parameter``) after each unshard, the flat all-gather output
  (``all_gather_buffer``, named by the unit) before its copy-out, and the unsharded gradients
  before their reduce-scatter (``unsharded_gradient``), through ``FSDPParamGroup``'s own
  ``wait_for_unshard`` / ``post_backward`` (wrapped while recording). The sharded parameter is
  the DTensor's local tensor, named as a parameter.
- FSDP1 (``FullyShardedDataParallel``): the padded unsharded flat parameter (the all-gather
  output, ``unsharded_parameter`` named ``<unit>._flat_param``, its module the unit: the module
  path of the handle's ``_fully_sharded_module``) each time ``FlatParamHandle.
  _use_unsharded_flat_param`` switches to it, after its all-gather. A CUDA trace has no module
  frames: these names are what gives its FSDP1 units (``analysis/fsdp/units.py``).
- tensors saved for backward: a ``saved_tensors_hooks`` pair on the recording thread (its pack
  hook returns ``t.detach()``: returning ``t`` itself would keep an op's saved output alive in
  a reference cycle until the garbage collector runs, and so move the run's peak), each owned
  by the innermost module running its forward (global forward hooks; thread-local stack).
  A hook pair the script pushes itself (activation checkpointing's, ``save_on_cpu``) shadows
  ours inside its region, as torch stacks them: what those regions save is theirs.

``data()`` is what the recorder writes under the snapshot's top-level ``snapforensics_tensors``
key (torch's ``_memory_viz`` reads only ``segments`` and ``device_traces``): columns of plain
ints/floats and one table of identities. The reader is ``snapshot/tensors.py``; the join to
blocks (by storage address and the trace row at the observation's time, so that a reused
address is not misnamed) is ``analysis/identity.py``.

``names(model, optimizer)`` is the same as a context manager for a user's own script, without
``snapforensics record``: with ``path`` it dumps the device's snapshot there on exit, names
included. ``SNAPFORENSICS_NAMES=0`` turns the recorder's off.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

FORMAT = "snapforensics.tensors/2"  # /2: identities gain their TP split (/1: 6 items)
KEY = "snapforensics_tensors"
KINDS = ("parameter", "gradient", "optimizer_state", "unsharded_parameter", "unsharded_gradient",
         "all_gather_buffer", "saved_for_backward")
K = {k: i for i, k in enumerate(KINDS)}
MAX_OBSERVATIONS = 1_000_000  # the last ones are kept (a trace keeps its last entries too)
MAX_IDENTITIES = 200_000


def enabled() -> bool:
    return os.environ.get("SNAPFORENSICS_NAMES", "1").strip() != "0"


def _local(t: Any) -> Any:
    """A DTensor's local shard; any other tensor itself."""
    return getattr(t, "_local_tensor", t)


TP_DIM = "tp"  # the mesh dimension tensor parallelism runs on (torchtitan's name; analysis/mesh.py)


def tp_split(t: Any) -> int:
    """How many ways tensor parallelism splits the DTensor ``t``: the size of its mesh's ``tp``
    dimension when its placement there shards a dim (``Shard``, ``_StridedShard``), 1 when it
    replicates or is partial there, 0 when ``t`` is no DTensor on a mesh with a ``tp`` dim."""
    spec = getattr(t, "_spec", None)
    mesh = getattr(spec, "mesh", None)
    names = getattr(mesh, "mesh_dim_names", None)
    if not names or TP_DIM not in names:
        return 0
    i = list(names).index(TP_DIM)
    return int(mesh.size(i)) if type(getattr(spec.placements[i], "dim", None)) is int else 1


def _tp_module(module: Any) -> bool:
    """A Linear or Embedding whose weight tensor parallelism splits."""
    if not isinstance(module, _TP_MODULES):
        return False
    try:
        return tp_split(module._parameters.get("weight")) > 1
    except Exception:
        return False


def _tp_output(module: Any, output: Any) -> int:
    """The TP degree when ``module``'s output leaves it split along its features: a Linear or an
    Embedding (the only modules torch's ``ColwiseParallel``/``RowwiseParallel`` take) whose
    weight TP shards along the output features (Linear's dim 0, Embedding's dim 1: the
    column-wise style) and whose output's last dim is that local size, not the full one (a
    ``ColwiseParallel(output_layouts=Replicate())`` gathers it). 0 otherwise (a row-wise
    module's output is whole, partial-summed or sequence-sharded)."""
    import torch.nn as nn

    w = getattr(module, "_parameters", {}).get("weight")
    n = tp_split(w) if w is not None else 0
    if n <= 1:
        return 0
    feat = 0 if isinstance(module, nn.Linear) else 1 if isinstance(module, nn.Embedding) else -1
    spec = w._spec
    dim = spec.placements[list(spec.mesh.mesh_dim_names).index(TP_DIM)].dim
    if feat < 0 or dim % w.dim() != feat:
        return 0
    out = output[0] if isinstance(output, (tuple, list)) and output else output
    out = _local(out)
    try:
        last = out.shape[-1]
    except Exception:
        return 0
    full, local = w.shape[feat], _local(w).shape[feat]
    return n if last == local != full else 0


class TensorNames:
    """``start()`` / ``stop()``; ``data()`` the columns to write (see the module docstring)."""

    def __init__(self, model: Any = None, optimizer: Any = None) -> None:
        self.roots: weakref.WeakSet = weakref.WeakSet()
        self.optimizers: weakref.WeakSet | None = None
        if model is not None:
            self.roots.add(model)
        if optimizer is not None:
            self.optimizers = weakref.WeakSet([optimizer])
        self.module_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._tp_hooked: weakref.WeakSet = weakref.WeakSet()
        self.ids: dict[tuple, int] = {}
        self.table: list[list] = []
        self.obs: deque = deque(maxlen=MAX_OBSERVATIONS)
        self.seen = 0  # observations made (more than kept when the deque wrapped)
        self.dropped_identities = 0
        self.errors: list[str] = []
        self.gen = 0  # forward passes of a root: a tensor saved twice in one pass is noted once
        self._saved_seen: set = set()
        self._tls = threading.local()
        self._handles: list = []
        self._patched: list[tuple[Any, str, Any]] = []
        self._hooks_pushed = False
        self._thread: int | None = None
        self._want_step_hooks = False
        self.active = False
        self.cost_ns = 0  # time spent in the hooks (measured around the step hooks only)
        for root in list(self.roots):
            self._add_root(root)

    # -- lifecycle
    def start(self) -> None:
        import torch
        from torch.nn.modules import module as nn_module

        _resolve()
        self._handles.append(nn_module.register_module_forward_pre_hook(self._pre_forward))
        self._handles.append(nn_module.register_module_forward_hook(self._post_forward,
                                                                    always_call=True))
        # the optimizer step hooks are registered at the next forward: start() may run inside
        # one (`record --steps A:B` starts in a step post hook), where adding to torch's hook
        # dict would break its iteration ("OrderedDict mutated during iteration")
        self._want_step_hooks = True
        self.active = True
        self._patch_fsdp2()
        self._patch_fsdp1()
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, _unpack)
        self._hooks_pushed = True
        self._thread = threading.get_ident()

    def stop(self) -> None:
        import torch

        self.active = False  # the step hooks stay registered, inert (see _StepHooks)
        for h in self._handles:
            h.remove()
        self._handles = []
        self._tp_hooked = weakref.WeakSet()
        for owner, name, orig in self._patched:
            setattr(owner, name, orig)
        self._patched = []
        if self._hooks_pushed:
            self._hooks_pushed = False
            if threading.get_ident() == self._thread:  # the stack is the thread's own
                try:
                    torch._C._autograd._pop_saved_tensors_default_hooks()
                except RuntimeError as e:
                    self.errors.append(f"saved tensors hooks: {e}")

    # -- identities and observations
    def _identity(self, tensor_name: str | None, kind: str, module: str | None, t: Any,
                  split: int) -> int:
        try:
            shape = list(t.shape)
        except Exception:
            shape = []
        dev = t.device
        key = (tensor_name, kind, module, tuple(shape), str(t.dtype), dev.type, dev.index, split)
        i = self.ids.get(key)
        if i is None:
            if len(self.table) >= MAX_IDENTITIES:
                self.dropped_identities += 1
                return -1
            i = self.ids[key] = len(self.table)
            self.table.append([tensor_name, kind, module, shape, str(t.dtype).replace(
                "torch.", ""), dev.index if dev.index is not None else 0, split])
        return i

    def _note(self, t: Any, tensor_name: str | None, kind: str, module: str | None,
              split: int | None = None) -> None:
        """Note ``t`` (its local shard when a DTensor) under this identity; ``split``: how many
        ways TP splits it, when the caller knows better than ``t``'s own placements."""
        try:
            if split is None:
                split = tp_split(t)
            t = _local(t)
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if not ptr:
                return  # freed (FSDP's resized-to-0 storage) or meta
            i = self._identity(tensor_name, kind, module, t, split)
            if i < 0:
                return
            self.obs.append((ptr, t.data_ptr() - ptr, t.numel() * t.element_size(),
                             time.time_ns() / 1000.0, i))
            self.seen += 1
        except Exception as e:  # a tensor subclass without storage, a fake tensor: unnamed
            if len(self.errors) < 5:
                self.errors.append(f"{kind} {tensor_name}: {type(e).__name__}: {e}")

    # -- modules
    def _add_root(self, root: Any) -> None:
        self.roots.add(root)
        try:
            for name, m in root.named_modules(remove_duplicate=False):
                self.module_names[m] = name or f"<{type(root).__name__}>"
                if m is not root:
                    self.roots.discard(m)  # called alone before: its names were partial
        except Exception as e:
            self.errors.append(f"named_modules: {type(e).__name__}: {e}")

    def _stack(self) -> list:
        s = getattr(self._tls, "stack", None)
        if s is None:
            s = self._tls.stack = []
        return s

    def _pre_forward(self, module: Any, args: Any) -> None:
        if _compiling():  # Dynamo tracing a module (module hooks are inlined into the graph)
            return
        if self._want_step_hooks:
            self._want_step_hooks = False
            _StepHooks.register(self)
        stack = self._stack()
        if not stack:
            if module not in self.module_names:
                self._add_root(module)
            self.gen += 1
            self._saved_seen.clear()
            self._tls.tp_open = None
        stack.append(module)
        try:
            if module not in self._tp_hooked and _tp_module(module):
                # its own forward hook, after the style's (``parallelize_module`` registered
                # those first): it sees the output the style hands on, after redistribution
                self._tp_hooked.add(module)
                self._handles.append(module.register_forward_hook(self._tp_post,
                                                                  always_call=True))
        except Exception:  # never the run's failure: the region is then not tracked here
            pass

    def _tp_post(self, module: Any, args: Any, output: Any) -> None:
        """A column-wise module opens the TP-split region (its output, split along the
        features, up to the row-wise module that takes it, inside the module that called it);
        any other TP module closes it."""
        if _compiling():
            return
        try:
            n = _tp_output(module, output)
        except Exception:
            n = 0
        stack = self._stack()  # the global post hook ran first: the caller's chain
        self._tls.tp_open = (n, len(stack), stack[-1]) if n and stack else None

    def _tp_region(self, stack: list) -> int:
        """The TP degree of the open region, 0 when none is open here: the module that called
        the column-wise one must still be running (a model whose last projection is column-wise
        leaves no region over the loss computed after it)."""
        r = getattr(self._tls, "tp_open", None)
        if not r:
            return 0
        n, depth, parent = r
        return n if len(stack) >= depth and stack[depth - 1] is parent else 0

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:
        if _compiling():
            return
        stack = self._stack()
        while stack:  # always_call: also after a forward that raised
            if stack.pop() is module:
                break

    def _module_name(self, module: Any) -> str:
        name = self.module_names.get(module)
        return name if name is not None else f"<{type(module).__name__}>"

    def _pack(self, t: Any) -> Any:
        try:
            stack = self._stack()
            owner = self._module_name(stack[-1]) if stack else None
            local = _local(t)
            key = (local.data_ptr(), owner, self.gen)
            if key not in self._saved_seen:
                self._saved_seen.add(key)
                # a DTensor says its placement; a plain tensor saved between a column-wise
                # module's output and the row-wise module that takes it is split with them
                split = tp_split(t) if local is not t else self._tp_region(stack)
                self._note(local, None, "saved_for_backward", owner, split)
        except Exception:
            pass
        return t.detach()

    # -- parameters, gradients, optimizer state
    def _param_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for root in list(self.roots):
            try:
                for name, p in root.named_parameters(remove_duplicate=False):
                    if len(name) > len(names.get(id(p), "")):  # the full path from the root
                        names[id(p)] = name
            except Exception:
                continue
        return names

    def _wanted(self, optimizer: Any) -> bool:
        return self.optimizers is None or optimizer in self.optimizers

    def _params_of(self, optimizer: Any) -> Iterator[tuple[str, Any]]:
        names = self._param_names()
        for g, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group.get("params", ())):
                yield names.get(id(p)) or f"param_groups.{g}.params.{j}", p

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._wanted(optimizer):
            return
        t0 = time.perf_counter_ns()
        for name, p in self._params_of(optimizer):
            module = name.rpartition(".")[0] or None
            self._note(p, name, "parameter", module)
            if p.grad is not None:
                self._note(p.grad, name + ".grad", "gradient", module)
        self.cost_ns += time.perf_counter_ns() - t0

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._wanted(optimizer):
            return
        t0 = time.perf_counter_ns()
        import torch

        state = optimizer.state
        for name, p in self._params_of(optimizer):
            st = state.get(p)
            if not st:
                continue
            module = name.rpartition(".")[0] or None
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    self._note(v, f"{name}.{k}", "optimizer_state", module)
        self.cost_ns += time.perf_counter_ns() - t0

    # -- FSDP2
    def _patch_fsdp2(self) -> None:
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        except Exception:
            return
        names = self

        def wrap(attr: str, before: Any, after: Any) -> None:
            orig = getattr(FSDPParamGroup, attr, None)
            if orig is None:
                return

            def method(group: Any, *args: Any, **kwargs: Any) -> Any:
                if before is not None:
                    try:
                        before(group)
                    except Exception:
                        pass
                out = orig(group, *args, **kwargs)
                if after is not None:
                    try:
                        after(group)
                    except Exception:
                        pass
                return out

            method.__wrapped__ = orig  # type: ignore[attr-defined]
            self._patched.append((FSDPParamGroup, attr, orig))
            setattr(FSDPParamGroup, attr, method)

        def gather_buffer(group: Any) -> None:
            result = getattr(group, "_all_gather_result", None)
            out = getattr(result, "all_gather_output", None)
            if out is not None and out.numel():
                unit = getattr(group, "_module_fqn", None) or ""
                names._note(out, f"FSDP all-gather output ({unit or 'root'})",
                            "all_gather_buffer", unit or None)

        def unsharded(group: Any) -> None:
            for fp in getattr(group, "fsdp_params", ()):
                fqn = getattr(fp, "_param_fqn", None) or ""
                module = fqn.rpartition(".")[0] or None
                # the unsharded parameter is TP's local shard when TP splits it (2-D mesh)
                split = tp_split(getattr(fp, "_unsharded_param", None))
                for t in getattr(fp, "all_gather_outputs", ()) or ():
                    if t.untyped_storage().size():
                        names._note(t.view(getattr(fp, "_orig_size", t.shape))
                                    if t.numel() == _numel(getattr(fp, "_orig_size", None))
                                    else t, fqn, "unsharded_parameter", module, split)

        def unsharded_grads(group: Any) -> None:
            for fp in getattr(group, "fsdp_params", ()):
                fqn = getattr(fp, "_param_fqn", None) or ""
                param = getattr(fp, "_unsharded_param", None)
                g = getattr(param, "grad", None) if param is not None else None
                if g is None:
                    g = getattr(fp, "_unsharded_accumulated_grad", None)
                if g is not None:
                    names._note(g, fqn + ".grad", "unsharded_gradient",
                                fqn.rpartition(".")[0] or None)

        wrap("wait_for_unshard", gather_buffer, unsharded)
        wrap("post_backward", unsharded_grads, None)

    # -- FSDP1
    def _patch_fsdp1(self) -> None:
        try:
            from torch.distributed.fsdp._flat_param import FlatParamHandle
        except Exception:
            return
        orig = getattr(FlatParamHandle, "_use_unsharded_flat_param", None)
        if orig is None:
            return
        names = self

        def _use_unsharded_flat_param(handle: Any, padded: Any, *args: Any, **kw: Any) -> Any:
            out = orig(handle, padded, *args, **kw)
            try:
                module = getattr(handle, "_fully_sharded_module", None)
                unit = names.module_names.get(module) if module is not None else None
                if unit is not None:
                    names._note(padded, f"{unit}._flat_param", "unsharded_parameter", unit)
            except Exception:
                pass
            return out

        _use_unsharded_flat_param.__wrapped__ = orig  # type: ignore[attr-defined]
        self._patched.append((FlatParamHandle, "_use_unsharded_flat_param", orig))
        FlatParamHandle._use_unsharded_flat_param = _use_unsharded_flat_param  # type: ignore

    # -- output
    def data(self) -> dict:
        cols: dict[str, list] = {"ptr": [], "offset": [], "nbytes": [], "time_us": [],
                                 "identity": []}
        for ptr, off, nb, t, i in self.obs:
            cols["ptr"].append(ptr)
            cols["offset"].append(off)
            cols["nbytes"].append(nb)
            cols["time_us"].append(t)
            cols["identity"].append(i)
        return {"format": FORMAT, "clock": "epoch_us", "kinds": list(KINDS),
                "identities": [list(e) for e in self.table], **cols,
                "observations_made": self.seen, "identities_dropped": self.dropped_identities,
                "step_hooks_s": round(self.cost_ns / 1e9, 4), "errors": list(self.errors)}


class _StepHooks:
    """Torch's global optimizer step pre/post hooks for one tracker, through a weak reference:
    never removed (removing them inside a step hook, where `--steps` stops recording, would
    break torch's iteration over its hook dict); inert once the tracker stopped or is gone."""

    def __init__(self, tracker: TensorNames) -> None:
        self.tracker = weakref.ref(tracker)

    @classmethod
    def register(cls, tracker: TensorNames) -> None:
        try:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )
        except ImportError as e:  # torch < 2.0
            tracker.errors.append(f"no optimizer step hooks: {e}")
            return
        hooks = cls(tracker)
        register_optimizer_step_pre_hook(hooks.before)
        register_optimizer_step_post_hook(hooks.after)

    def _live(self) -> TensorNames | None:
        t = self.tracker()
        return t if t is not None and t.active else None

    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        t = self._live()
        if t is not None:
            t._before_step(optimizer, args, kwargs)

    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        t = self._live()
        if t is not None:
            t._after_step(optimizer, args, kwargs)


def _compiling() -> bool:
    """Whether Dynamo is tracing this call: the recorder's module hooks then do nothing, as
    Dynamo inlines global module hooks into the graph it builds, where their bookkeeping (the
    module stack, a WeakKeyDictionary keyed by the module) made `torch.compile(model)` fail
    (`... is already tracked for mutation`); the compiled forward still runs the saved-tensor
    pack hook, and the graph-code map names what Inductor made. Resolved once (`_resolve`, at
    start): the hooks run on every module call."""
    return _IS_COMPILING()


def _never() -> bool:
    return False


_IS_COMPILING: Any = _never
_TP_MODULES: tuple = ()  # nn.Linear, nn.Embedding: what torch's column/row-wise styles take


def _resolve() -> None:
    global _IS_COMPILING, _TP_MODULES
    import torch.nn as nn

    _TP_MODULES = (nn.Linear, nn.Embedding)
    try:
        import torch.compiler

        _IS_COMPILING = torch.compiler.is_compiling
    except (ImportError, AttributeError):  # torch < 2.3
        try:
            import torch._dynamo

            _IS_COMPILING = torch._dynamo.is_compiling
        except Exception:
            _IS_COMPILING = _never


def _numel(shape: Any) -> int:
    n = 1
    try:
        for s in shape:
            n *= int(s)
    except TypeError:
        return -1
    return n


def _unpack(t: Any) -> Any:
    return t


def attach(snap: dict, names: TensorNames | None) -> dict:
    """``snap`` with the names under ``KEY``, and Inductor's generated code mapped to the
    model's source when the run compiled with it (``graph_code.py``): what the recorder's
    backends call at the dump, and ``names(...)``'s ``attach`` / ``path``."""
    from snapforensics.record import graph_code

    if names is not None:
        try:
            snap[KEY] = names.data()
        except Exception as e:  # never the recording's failure
            snap[KEY] = {"format": FORMAT, "errors": [f"{type(e).__name__}: {e}"]}
    return graph_code.attach(snap)


@contextlib.contextmanager
def names(model: Any = None, optimizer: Any = None, path: str | os.PathLike | None = None,
          device: str | None = None) -> Iterator[TensorNames]:
    """Name the tensors of ``model`` and ``optimizer`` in a memory snapshot of this process::

        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        with snapforensics.record.names(model, optimizer, path="snap.pickle"):
            train()

    On exit, with ``path``: the device's snapshot (``torch.cuda``, or ``torch.npu`` when
    ``device="npu"``) is dumped there with the names under its ``snapforensics_tensors`` key
    (torch's ``_memory_viz`` opens it as any dump). Without ``path``, ``n.attach(snapshot_dict)``
    adds them to a snapshot taken with ``torch.cuda.memory._snapshot()`` before it is pickled.
    """
    tracker = TensorNames(model, optimizer)
    tracker.start()
    try:
        yield tracker
    finally:
        tracker.stop()
        if path is not None:
            snap = _device_snapshot(device)
            attach(snap, tracker)
            with open(path, "wb") as f:
                pickle.dump(snap, f, protocol=4)


def _device_snapshot(device: str | None) -> dict:
    if device == "npu":
        import torch_npu  # type: ignore[import-not-found]

        snap = torch_npu.npu.memory._snapshot()
    else:
        import torch

        snap = torch.cuda.memory._snapshot()
    return snap if isinstance(snap, dict) else {"segments": list(snap), "device_traces": []}


TensorNames.attach = lambda self, snap: attach(snap, self)  # type: ignore[attr-defined]
