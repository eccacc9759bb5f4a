"""Tracing: torch.fx symbolic tracing or torch.export, both normalised into one ``_Traced`` graph whose single
placeholder is the stage-0 input object, and the GraphModules that run (parts of) it on the model's own modules."""

from __future__ import annotations

import inspect
import operator
import sys
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from .functions import forget_calls, kept_call, kept_functions

_ROOT = "_hcv_model"  # attribute path, inside a stage, of the live view of the model's top-level buffers


def _get_path(root: Any, path: str) -> Any:
    obj = root
    for item in path.split("."):
        obj = getattr(obj, item)
    return obj


@dataclass
class _Traced:
    """A model's graph, normalised: one placeholder (the stage-0 input object), get_attr nodes for every parameter,
    buffer and constant, call_module nodes for leaf modules, one output."""

    graph: fx.Graph
    attrs: dict[str, Any]  # target -> object, for every get_attr and call_module target
    method: str  # "fx" or "export"
    out_spec: pytree.TreeSpec | None = None  # export: rebuilds the output structure from the flat output tuple


class _Tracer(fx.Tracer):
    """fx's tracer, but it also traces into torch.nn modules that hold repeated blocks (nn.TransformerEncoder),
    so their layers become separate call_module nodes that can be cut between."""

    proxy_buffer_attributes = True  # self.mask[:, :, :T, :T] with a traced T needs the buffer as a graph value

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InPlaceProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if any(isinstance(c, (nn.ModuleList, nn.Sequential)) for c in m.children()):
            return False
        return super().is_leaf_module(m, module_qualified_name)


class _InPlaceProxy(fx.Proxy):
    """fx's proxy has no ``__iadd__``, so ``out += identity`` traced as ``out = out + identity``: a new tensor where
    eager adds in place (one more activation per residual block). Recorded as ``operator.iadd``, it runs as the
    model runs it, and the cut rules see the write (values.py)."""

    def __iadd__(self, other: object) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.iadd, (self, other), {})


@contextmanager
def _sharding_hooks_off(model: nn.Module) -> Iterator[None]:
    """The model's own forward without FSDP2's forward hooks, while its stages are traced and checked.

    An applied schedule traces its stages inside the training call, where FSDP2's root pre-forward hook has already
    put the gathered (``param_dtype``) parameters in place. Fired again inside ``torch.export``, the hooks would
    all-gather under fake tensors and mark the root's forward as ended midway. Nested FSDP2 modules (one per layer)
    are gathered here instead, as :class:`~.build.GraphStage` gathers them at each call.

    Raises:
        TypeError: outside the model's own FSDP2 forward (``hcv.wrap``, ``hcv.profile``, or the model itself not
            ``fully_shard``-ed): no FSDP2 hook would gather its parameters or reduce-scatter the gradients.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded by it
    sharded = [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)] if fsdp is not None else []
    if not sharded:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    def theirs(hook: Any) -> bool:  # FSDP2 registers bound methods of its per-module state
        return isinstance(getattr(hook, "__self__", None), FSDPState)

    kept = [(m, m._forward_pre_hooks, m._forward_hooks) for m in sharded]
    for m, pre, post in kept:  # filtered copies; the dicts themselves are put back as they were
        m.__dict__["_forward_pre_hooks"] = OrderedDict((k, h) for k, h in pre.items() if not theirs(h))
        m.__dict__["_forward_hooks"] = OrderedDict((k, h) for k, h in post.items() if not theirs(h))
    try:
        # Only inside the model's own FSDP2 forward (hcv.apply's training call) are its parameters gathered, and its
        # backward ends with FSDP2's reduce-scatter of every gradient: anywhere else the stages would train copies
        state = model._get_fsdp_state() if isinstance(model, fsdp.FSDPModule) else None
        if state is None or state._training_state != TrainingState.FORWARD:
            raise TypeError(
                "the model is sharded by FSDP2 (fully_shard) and this is not its training call: its stages are traced "
                "inside the training call of hcv.apply, where FSDP2 gathers the parameters. Call fully_shard on the "
                "model itself (after its layers), then hcv.apply(model, schedule) with a schedule profiled on an "
                "unsharded copy")
        for m in sharded:
            if m is not model:
                m.unshard()
        yield
    finally:
        for m, pre, post in kept:
            m.__dict__["_forward_pre_hooks"], m.__dict__["_forward_hooks"] = pre, post


def _accessor(x: fx.Node, keys: tuple, graph: fx.Graph) -> fx.Node:
    node = x
    for key in keys:
        node = graph.call_function(operator.getitem, (node, key))
    return node


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict, single: bool) -> _Traced:
    sig = inspect.signature(model.forward)
    params = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TypeError("forward takes *args/**kwargs, which symbolic tracing cannot bind")
    bound = sig.bind(*args, **kwargs)
    concrete: dict[str, Any] = {}
    keys: dict[str, tuple] = {}
    for index, p in enumerate(params):
        if p.name in bound.arguments:
            value = bound.arguments[p.name]
            if isinstance(value, torch.Tensor):
                keys[p.name] = () if single else ((index,) if p.name not in kwargs else (p.name,))
            elif any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)):
                raise TypeError(f"input {p.name!r} nests tensors inside a {type(value).__name__}")
            else:
                concrete[p.name] = value
        else:
            concrete[p.name] = p.default

    before = set(vars(model))
    tracer = _Tracer()
    try:
        with kept_functions("fx"):
            graph = tracer.trace(model, concrete_args=concrete or None)
    finally:
        # fx stores tensor constants met while tracing as attributes of the model itself: take them back out.
        added = {name: vars(model)[name] for name in set(vars(model)) - before}
        for name in added:
            delattr(model, name)

    g = fx.Graph()
    x = g.placeholder("x")
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for p, node in zip(params, placeholders):
        env[node] = _accessor(x, keys[p.name], g) if p.name in keys else concrete[p.name]
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            attrs[node.target] = added[node.target] if node.target in added else _get_path(model, node.target)
        elif node.op == "call_module":
            attrs[node.target] = model.get_submodule(node.target)
        env[node] = g.node_copy(node, lambda n: env[n])
    return _Traced(g, attrs, "fx")


@contextmanager
def _masks_as_in_eager(kwargs: dict) -> Iterator[None]:
    """Let Hugging Face build attention masks under torch.export as it does in eager mode.

    Without a padding mask, eager transformers skips the causal mask and calls SDPA with ``is_causal=True`` (and
    ``enable_gqa`` for grouped-query attention); under ``torch.export`` it builds an explicit mask instead (and
    repeats k and v per query head), for two reasons that do not hold for our stages:

    - an exported program may later run on other shapes, where ``is_causal`` would be wrong: our stages are
      specialised to the sample input's shapes anyway (``is_torchdynamo_exporting`` is answered False);
    - whether the position ids pack several sequences in a row is a question about their *values*: when the call
      passes no ``position_ids``, the model makes them with ``arange`` (one sequence per row), so we answer "not
      packed" as eager does after looking (``find_packed_sequence_indices`` returns None).

    The gradients then are eager's, bitwise, instead of 1e-8 apart (Mistral, Qwen2/3, Phi3, Gemma, Mixtral, LLaMA).
    A padding mask (or position ids) in the call keeps the explicit mask: eager decides on its values, which a
    shape-specialised stage cannot. See docs/models.md.
    """
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    patches = {}
    if masking is not None and hasattr(masking, "is_torchdynamo_exporting"):
        patches["is_torchdynamo_exporting"] = lambda: False
        if "position_ids" not in kwargs and hasattr(masking, "find_packed_sequence_indices"):
            patches["find_packed_sequence_indices"] = lambda position_ids: None
    originals = {name: getattr(masking, name) for name in patches}
    for name, value in patches.items():
        setattr(masking, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(masking, name, value)


def _trace_export(model: nn.Module, args: tuple, kwargs: dict, single: bool) -> _Traced:
    from torch.export.graph_signature import InputKind, OutputKind

    forget_calls()
    with kept_functions("export"), _masks_as_in_eager(kwargs):
        ep = torch.export.export(model, args, kwargs, strict=False)
    in_spec, out_spec = ep.call_spec.in_spec, ep.call_spec.out_spec
    # The flat user inputs in export's order, each with its key path from the stage-0 input object.
    kw_spec = in_spec.children()[1] if hasattr(in_spec, "children") else in_spec.children_specs[1]
    kw_order = kw_spec.context or list(kwargs)
    call = (args, {k: kwargs[k] for k in kw_order})
    leaves = pytree.tree_flatten_with_path(call)[0]

    def keys_of(path: tuple) -> tuple:
        out = []
        for k in path[1:] if not single else path[2:]:
            if isinstance(k, pytree.SequenceKey):
                out.append(k.idx)
            elif isinstance(k, pytree.MappingKey):
                out.append(k.key)
            else:
                raise TypeError(f"unsupported input structure at {pytree.keystr(path)}")
        return tuple(out)

    g = fx.Graph()
    x = g.placeholder("x")
    env: dict[fx.Node, Any] = {}
    attrs: dict[str, Any] = {}
    specs = ep.graph_signature.input_specs
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user = iter(leaves)
    for spec, node in zip(specs, placeholders):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            attrs[spec.target] = _get_path(model, spec.target)
            env[node] = g.get_attr(spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            target = "_hcv_const_" + spec.target.replace(".", "_")
            attrs[target] = ep.constants[spec.target]
            env[node] = g.get_attr(target)
        elif spec.kind == InputKind.USER_INPUT:
            path, value = next(user)
            env[node] = _accessor(x, keys_of(path), g) if isinstance(value, torch.Tensor) else value
        else:
            raise TypeError(f"unsupported exported input kind {spec.kind.name}")
    outputs: list[Any] = []
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    for node in ep.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        kept = kept_call(node)  # a custom autograd Function: one node that calls it (functions.py)
        if kept is not None:
            env[node] = g.call_function(kept, tuple(env[n] for n in node.args[1]))
        else:
            env[node] = g.node_copy(node, lambda n: env[n])
        env[node].meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
    for spec, value in zip(ep.graph_signature.output_specs, output_node.args[0]):
        value = env[value] if isinstance(value, fx.Node) else value
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(value)
        elif spec.kind == OutputKind.BUFFER_MUTATION:  # functionalised buffer update: write it back in place
            g.call_function(torch.Tensor.copy_, (g.get_attr(spec.target), value))
            attrs[spec.target] = _get_path(model, spec.target)
        else:
            raise TypeError(f"unsupported exported output kind {spec.kind.name}")
    g.output(tuple(outputs))
    return _Traced(g, attrs, "export", out_spec)


def _module_from_graph(graph: fx.Graph, attrs: dict[str, Any], model: nn.Module, name: str) -> fx.GraphModule:
    """An fx.GraphModule over ``graph`` whose attribute paths lead to the model's own submodules (shared)."""
    targets = {n.target for n in graph.nodes if n.op in ("get_attr", "call_module")}
    gm = fx.GraphModule({t: attrs[t] for t in targets}, graph, class_name=name)
    # GraphModule builds fresh intermediate modules and copies tensor references. Put the model's own owner
    # modules at those paths instead: attribute reads then see the live module, so a buffer replaced later (by
    # model.to(device), for instance) is still the one the stage uses.
    owners = set()
    for n in graph.nodes:
        if n.op == "call_module":
            owners.add(n.target)
        elif n.op == "get_attr" and "." in n.target:
            owners.add(n.target.rsplit(".", 1)[0])
    for path in sorted(owners, key=lambda p: p.count(".")):
        if any(path.startswith(o + ".") for o in owners if o != path and len(o) < len(path)):
            continue
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = gm.get_submodule(parent_path) if parent_path else gm
        setattr(parent, leaf, module)
    if any(t.startswith(_ROOT + ".") for t in targets):
        setattr(gm, _ROOT, _ModelView(model))
    _read_directly(gm, targets, owners)
    return gm


def _read_directly(gm: fx.GraphModule, targets: set[str], owners: set[str]) -> None:
    """Let the generated code's ``self.a.b.c`` reach each submodule without ``nn.Module.__getattr__``.

    Modules hold their children in ``_modules``, so every step of such a path is a Python call; densenet121's
    sub-layer stages made four per submodule, 3000 a training step (about 2 ms of a 32 px step). The containers that
    GraphModule made on the way (``gm`` and the plain ``nn.Module`` between it and the model's own modules) are
    ours: each also gets its children as plain attributes, which Python finds first. The model's modules are left as
    they are. ``setattr`` on a container still replaces both (``nn.Module.__setattr__`` drops the plain one); a deep
    copy rebuilds the containers without them, which is slower and as right."""
    for target in targets:
        parts = target.split(".")
        container: nn.Module = gm
        for k, name in enumerate(parts[:-1] if target not in owners else parts):
            child = container._modules.get(name)
            if child is None or not (container is gm or type(container) is nn.Module):
                break
            object.__setattr__(container, name, child)
            if ".".join(parts[:k + 1]) in owners:
                break  # the model's own module from here on
            container = child


class _ModelView(nn.Module):
    """Reads the model's top-level buffers live, registering none of them: ``model.to(...)`` replaces buffers by
    new tensors in the model's buffer dict, which this view holds (nested buffers are reached through their live
    owner modules). It holds the dict, not the model, so the extraction cache keyed by the model can let go."""

    def __init__(self, model: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hcv_buffers", model._buffers)

    def __getattr__(self, name: str) -> Any:
        buffers = self.__dict__["_hcv_buffers"]
        if name in buffers:
            return buffers[name]
        return super().__getattr__(name)


def _route_root_buffers(traced: _Traced, model: nn.Module) -> _Traced:
    """Point get_attr nodes of the model's top-level buffers at the live view (see _ModelView)."""
    for n in traced.graph.nodes:
        if n.op == "get_attr" and "." not in n.target and n.target in model._buffers:
            new = f"{_ROOT}.{n.target}"
            traced.attrs[new] = traced.attrs[n.target]
            n.target = new
    return traced
