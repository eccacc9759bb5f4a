"""Stages: :class:`GraphStage`, and building one from a range of the plan's ops (``_Building``, a mixin of
``_Plan``): the ops themselves, the constants they read (recomputed), the literals that cross (specialised)."""

from __future__ import annotations

import operator
import sys
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import NotSequentialError
from ..precision import Precision, describe, precision_of
from .tracing import _module_from_graph


class GraphStage(nn.Module):
    """One stage of an extracted chain: an ``fx.GraphModule`` over a slice of the model's traced graph.

    ``self.gm`` holds the model's own submodules (not copies) at their original paths, so ``parameters()`` yields
    the model's ``nn.Parameter`` objects. ``out_spec`` (last stage of a ``torch.export`` extraction only) rebuilds
    the model's output structure (e.g. a Hugging Face ``ModelOutput``) from the flat outputs. ``baked_training``
    (``torch.export`` only) is the train/eval mode the stage's dropout and batch norm ops were traced in,
    ``precision`` (``torch.export`` only) the autocast and parameter dtype its dtype casts are fixed to
    (runtime/precision.py).
    """

    def __init__(self, gm: fx.GraphModule, name: str, *, out_spec: pytree.TreeSpec | None = None,
                 method: str = "fx", baked_training: bool | None = None, probe: nn.Module | None = None,
                 precision: Precision | None = None):
        super().__init__()
        self.gm = gm
        self.stage_name = name
        self.method = method
        self.baked_training = baked_training
        self.precision = precision
        self._out_spec = out_spec
        self.group: str | None = None  # the block (layer) this stage belongs to; set by extract_stages
        self.tag = ""  # "attn_core" on the stages of the core attention
        # The model, whose train/eval mode we compare with: weakly held (the extraction cache is keyed by it).
        object.__setattr__(self, "_probe", weakref.ref(probe) if probe is not None else None)
        # FSDP2 modules below the model whose parameters the stage reads (see _nested_sharded), for the class of
        # model they were found for
        self._sharded: list[nn.Module] = []
        self._sharded_for: type | None = None

    def forward(self, x: Any) -> Any:
        probe = self._probe() if self._probe is not None else None
        if self.baked_training is not None and probe is not None and probe.training != self.baked_training:
            mode = "train" if self.baked_training else "eval"
            raise NotSequentialError(
                f"stage {self.stage_name!r} was extracted with torch.export with the model in {mode} mode, which "
                f"fixes dropout and batch norm behaviour; the model is now in the other mode. Extract the stages "
                f"again after model.{'eval' if self.baked_training else 'train'}()")
        if (self.precision is not None and probe is not None and not torch.compiler.is_compiling()
                and (now := precision_of(probe)) != self.precision):
            raise NotSequentialError(
                f"stage {self.stage_name!r} was traced with torch.export in {describe(self.precision)}, which fixes "
                f"its dtype casts; it now runs in {describe(now)}. Extract the stages again in this precision "
                f"(hcv.apply and hcv.wrap do so by themselves at the first training step in it)")
        if probe is not None and self._sharded_for is not type(probe) and not torch.compiler.is_compiling():
            # found again when the model's class changes, as fully_shard(model) changes it
            self._sharded, self._sharded_for = _nested_sharded(probe, self.gm), type(probe)
        for m in self._sharded:
            m.unshard()  # a no-op once gathered
        out = self.gm(x)
        if self._sharded:
            _reshard_after(self._sharded, x, out)
        if self._out_spec is not None:
            out = pytree.tree_unflatten(list(out), self._out_spec)
        return out

    @property
    def code(self) -> str:
        """The Python source fx generated for this stage (for reading, debugging)."""
        return self.gm.code

    def extra_repr(self) -> str:
        return f"name={self.stage_name!r}, method={self.method!r}"


def _nested_sharded(model: nn.Module, gm: fx.GraphModule) -> list[nn.Module]:
    """The FSDP2 (``fully_shard``) modules strictly below ``model`` that hold modules the stage reads.

    FSDP2 gathers a module's parameters in its forward pre-hook, which never fires for them: the stage runs their
    ops, not their forward. So the stage gathers them itself (``unshard()``, a no-op once gathered) and reshards them
    after (:func:`_reshard_after`); the root's final callback reduce-scatters their gradients when the backward ends
    (FSDP2 runs the post-backward of every group its backward hooks did not reach). The root's own parameters are
    gathered by its hooks, around the training call."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded by it
    if fsdp is None or not isinstance(model, fsdp.FSDPModule):
        return []
    read = {id(m) for m in gm.modules()}
    return [m for m in model.modules() if m is not model and isinstance(m, fsdp.FSDPModule)
            and any(id(s) in read for s in m.modules())]


# Per nested FSDP2 module: how many stages that read it are in their backward now (see _reshard_after).
_IN_BACKWARD: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def _reshard_after(sharded: list[nn.Module], x: Any, out: Any) -> None:
    """Reshard the nested FSDP2 modules a stage read once its forward is done, as FSDP2 does after a module's
    forward, unless another stage that reads them is in its backward; gathered again before the stage's backward (a
    hook on its outputs' gradients: FSDP2 gathers into the same storage, which the saved tensors still view) and
    resharded after it (a hook on its inputs' gradients). Their gradients stay on the gathered parameters until the
    backward ends, where the root's final callback reduce-scatters them (FSDP2's post-backward, as before)."""
    if torch.is_grad_enabled():
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        ins = [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, lambda _: _enter_backward(sharded), mode="any")
            if ins:
                torch.autograd.graph.register_multi_grad_hook(ins, lambda _: _leave_backward(sharded), mode="all")
    for m in sharded:
        if not _IN_BACKWARD.get(m):
            m.reshard()


def _enter_backward(sharded: list[nn.Module]) -> None:
    if not _IN_BACKWARD:  # the first window of this backward call: all closed when it ends (inputs without grad)
        torch.autograd.Variable._execution_engine.queue_callback(_IN_BACKWARD.clear)
    for m in sharded:
        _IN_BACKWARD[m] = _IN_BACKWARD.get(m, 0) + 1
        m.unshard()


def _leave_backward(sharded: list[nn.Module]) -> None:
    for m in sharded:
        _IN_BACKWARD[m] = _IN_BACKWARD.get(m, 1) - 1
        if _IN_BACKWARD[m] <= 0:
            del _IN_BACKWARD[m]
            m.reshard()


class _Building:
    """Turning a range of ops into a GraphStage (a mixin of ``_Plan``)."""

    def build_stage(self, a: int, b: int, name: str) -> GraphStage:
        g = fx.Graph()
        x = g.placeholder("x")
        env: dict[fx.Node, Any] = {}
        inputs = [self.x] if a == 0 else self.crossing[a - 1]
        if len(inputs) == 1:
            env[inputs[0]] = x
        else:
            for k, v in enumerate(inputs):
                env[v] = g.call_function(operator.getitem, (x, k))

        def need(n: fx.Node) -> Any:
            if n not in env:
                if n in self.const:
                    for m in n.all_input_nodes:
                        need(m)
                    env[n] = g.node_copy(n, lambda m: env[m])
                elif n in self.literal:
                    env[n] = self.info.literal[n]  # a size read in an earlier stage: specialised to its value
                else:
                    raise AssertionError(f"value {n.name} used by stage {name!r} is not available there")
            return env[n]

        for n in self.order[a: b + 1]:
            for m in n.all_input_nodes:
                need(m)
            env[n] = g.node_copy(n, lambda m: env[m])
        last = b == len(self.order) - 1
        if last:
            for m in self.output.all_input_nodes:
                need(m)
            g.output(fx.node.map_arg(self.output.args[0], lambda m: env[m]))
        else:
            outs = [env[v] for v in self.crossing[b]]
            g.output(outs[0] if len(outs) == 1 else tuple(outs))
        g.lint()
        gm = _module_from_graph(g, self.traced.attrs, self.model, "Stage")
        spec = self.traced.out_spec if last else None
        export = self.traced.method == "export"
        return GraphStage(gm, name, out_spec=spec, method=self.traced.method,
                          baked_training=self.model.training if export else None, probe=self.model,
                          precision=precision_of(self.model) if export else None)
