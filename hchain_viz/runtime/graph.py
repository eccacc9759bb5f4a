"""Automatic chain extraction: turn any ``nn.Module`` into a list of named stages with torch.fx.

The optimal schedules need a *chain*: stages ``0..L-1`` where stage i takes exactly one value (a tensor or a tuple
of tensors) and hands exactly one value to stage i+1 (DESIGN §2). Real models are graphs: skip connections, masks
and position ids reach far ahead. This module

1. traces the model into an fx graph: ``torch.fx`` symbolic tracing first (stages stay shape-generic and keep the
   model's leaf modules, so ``train()``/``eval()`` still switch dropout and batch norm), ``torch.export`` when tracing
   fails (Hugging Face models; the stages are then specialised to the sample input's shapes and to the
   train/eval mode the model had when it was extracted);
2. finds the *cut points*: positions in the graph where one activation crosses from the prefix to the rest.
   Three kinds of value never block a cut: constants (parameter or buffer reads, and pure computations on them
   only, e.g. a causal mask built from ``arange``) are recomputed by every stage that uses them; Python numbers
   (sizes read with ``x.size(0)``) are specialised to their value on the sample input when they cross; and
   parameter-free tensors derived from the inputs (an attention mask, the input ids) travel beside the activation
   in a tuple ``(activation, side_1, ...)``;
3. groups the segments between cuts by ``granularity`` and turns each into a :class:`GraphStage` (an
   ``fx.GraphModule`` over the segment) that shares the model's parameters and buffers: no copies, so the model's
   ``state_dict`` keys and optimizer param groups keep working.

Input convention (the same for the model and for stage 0): a tensor ``x`` means ``model(x)``, a tuple or list
means ``model(*x)``, a dict means ``model(**x)`` (Hugging Face: ``{"input_ids": ids}``). Stage 0 takes that one
object; every later stage takes the previous stage's output; the last stage returns what the model returns.

Every extraction is checked before it is returned: the stages run in sequence must reproduce the model's output
on the sample input (RNG and buffers are restored afterwards, so the check leaves no trace).
"""

from __future__ import annotations

import inspect
import math
import operator
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import NotSequentialError
from .memtrack import cuda_devices
from .stages import buffer_snapshot

__all__ = ["extract_stages", "cached_stages", "GraphStage"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_ROOT = "_hcv_model"  # attribute path, inside a stage, of the live view of the model's top-level buffers
# Ops whose result depends on the global RNG: never recomputed per stage (each copy would draw other numbers).
_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential",
                 "cauchy", "geometric", "random")
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul, operator.setitem}

# The latest extraction per model and granularity, for callers that get no sample input (see cached_stages).
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[Any, list[tuple[str, nn.Module]]]] = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------------------------------------------
# public API


class GraphStage(nn.Module):
    """One stage of an extracted chain: an ``fx.GraphModule`` over a slice of the model's traced graph.

    ``self.gm`` holds the model's own submodules (not copies) at their original paths, so ``parameters()`` yields
    the model's ``nn.Parameter`` objects. ``out_spec`` (last stage of a ``torch.export`` extraction only) rebuilds
    the model's output structure (e.g. a Hugging Face ``ModelOutput``) from the flat outputs. ``baked_training``
    (``torch.export`` only) is the train/eval mode the stage's dropout and batch norm ops were traced in.
    """

    def __init__(self, gm: fx.GraphModule, name: str, *, out_spec: pytree.TreeSpec | None = None,
                 method: str = "fx", baked_training: bool | None = None, probe: nn.Module | None = None):
        super().__init__()
        self.gm = gm
        self.stage_name = name
        self.method = method
        self.baked_training = baked_training
        self._out_spec = out_spec
        self.group: str | None = None  # the block (layer) this stage belongs to; set by extract_stages
        self.tag = ""  # "attn_core" on the stages of the core attention
        # The model, whose train/eval mode we compare with: weakly held (the extraction cache is keyed by it).
        object.__setattr__(self, "_probe", weakref.ref(probe) if probe is not None else None)

    def forward(self, x: Any) -> Any:
        probe = self._probe() if self._probe is not None else None
        if self.baked_training is not None and probe is not None and probe.training != self.baked_training:
            mode = "train" if self.baked_training else "eval"
            raise NotSequentialError(
                f"stage {self.stage_name!r} was extracted with torch.export with the model in {mode} mode, which "
                f"fixes dropout and batch norm behaviour; the model is now in the other mode. Extract the stages "
                f"again after model.{'eval' if self.baked_training else 'train'}()")
        out = self.gm(x)
        if self._out_spec is not None:
            out = pytree.tree_unflatten(list(out), self._out_spec)
        return out

    @property
    def code(self) -> str:
        """The Python source fx generated for this stage (for reading, debugging)."""
        return self.gm.code

    def extra_repr(self) -> str:
        return f"name={self.stage_name!r}, method={self.method!r}"


def extract_stages(model: nn.Module, sample_input: Any, *,
                   granularity: None | str | int = None) -> list[tuple[str, nn.Module]]:
    """Cut ``model`` into a chain of named stages whose sequential run equals ``model(sample_input)``.

    Args:
        model: any ``nn.Module``; its parameters and buffers are shared with the stages, never copied.
        sample_input: a tensor (``model(x)``), a tuple/list (``model(*x)``) or a dict (``model(**x)``). Stage 0
            takes this same object.
        granularity: ``None`` or ``"module"`` (default): cut only between whole blocks (a residual block, a
            transformer layer; the layers before the first block form ``"stem"``, after the last ``"head"``). In an
            encoder-decoder (a Hugging Face config with ``is_encoder_decoder``: BART, T5; a model holding an
            ``encoder`` and a ``decoder``: ``nn.Transformer``) the encoder output crosses every cut of the decoder
            beside its activation, in a tuple;
            ``"sublayer"``: the blocks cut further inside, where a few tensors cross (the residual stream plus the
            current value): after the qkv projection (``h.3.attn.qkv``), the attention scores, the probabilities
            (``h.3.attn.probs``), probabilities times values (``h.3.attn.context``), the attention output
            (``h.3.attn.out``), the MLP's up-projection and activation (``h.3.mlp.up``), ``h.3.mlp.down``; a
            decoder's cross-attention gets the same parts under ``xattn`` (``decoder.layers.3.xattn.probs``);
            ``"finest"``: every cut point; an int ``N``: ``N`` stages balanced by the measured time of their ops.

    Returns:
        ``[(name, stage), ...]`` where ``stage`` is a :class:`GraphStage`; ``stage.group`` names the block it
        belongs to (``"h.3"``, ``None`` for the stem and head) and ``stage.tag`` is ``"attn_core"`` on the stages of
        the core attention (scores, probabilities, probabilities times values, or a fused attention op).

    Raises:
        NotSequentialError: the model could not be traced (data-dependent control flow, unsupported inputs), has
            no cut point, or ``granularity`` is not one of the accepted values. The message says what failed and
            how to pass the stages by hand.
    """
    mode = _check_granularity(granularity)
    if not isinstance(model, nn.Module):
        raise NotSequentialError(f"extract_stages needs an nn.Module; got {type(model).__name__}")
    args, kwargs = _as_call(sample_input)
    kwargs = _without_cache(model, kwargs)
    single = not isinstance(sample_input, (dict, tuple, list))  # stage 0 gets the tensor itself, not a 1-tuple
    failures: list[str] = []
    for method, tracer in (("torch.fx", _trace_fx), ("torch.export", _trace_export)):
        try:
            traced = _route_root_buffers(tracer(model, args, kwargs, single), model)
            plan = _Plan.make(traced, model, sample_input, timed=isinstance(mode, int))
            segments = plan.segments(mode)
            names = plan.names(segments, mode)
            stages = [(name, plan.build_stage(a, b, name)) for (a, b), name in zip(segments, names)]
            for (_, stage), group, tag in zip(stages, plan.groups, plan.tags):
                stage.group, stage.tag = group, tag
            _verify(model, sample_input, args, kwargs, stages)
        except _NoCut as exc:
            failures.append(f"{method}: {exc}")
            continue
        except Exception as exc:  # each tracer fails in its own ways; the message collects them all
            failures.append(f"{method}: {type(exc).__name__}: {_first_line(exc)}")
            continue
        _CACHE.setdefault(model, {})[mode] = stages
        _CACHE[model][None] = stages
        return stages
    raise NotSequentialError(
        f"could not cut {type(model).__name__} into a chain of stages automatically:\n  - "
        + "\n  - ".join(failures)
        + "\nPass the stages by hand instead: a list of (name, module) pairs or an nn.Sequential whose modules "
          "each take the previous one's output (a tensor or a tuple of tensors), keeping any `if` on tensor "
          "values inside one stage (or rewrite it with torch.where / torch.cond so that it can be traced).")


def cached_stages(model: nn.Module, granularity: None | str | int | object = ...) -> list[tuple[str, nn.Module]] | None:
    """The stages of the latest :func:`extract_stages` call on ``model`` (with this granularity if given), or None.

    For callers that have the model but no sample input (``wrap(model, schedule)`` after ``profile(model, x)``).
    """
    per_model = _CACHE.get(model)
    if per_model is None:
        return None
    key = None if granularity is ... else _check_granularity(granularity)
    return per_model.get(key)


# ----------------------------------------------------------------------------------------------------------------
# input conventions and small helpers


def _check_granularity(granularity: Any) -> str | int:
    if granularity is None or granularity == "module":
        return "module"
    if granularity in ("finest", "sublayer"):
        return granularity
    if isinstance(granularity, int) and not isinstance(granularity, bool) and granularity >= 1:
        return granularity
    raise NotSequentialError(
        f"granularity must be None or 'module' (whole blocks), 'sublayer' (blocks cut where the residual stream and "
        f"the current value cross), 'finest' (every single-value cut point) or a positive int (that many balanced "
        f"stages); got {granularity!r}")


def _as_call(sample_input: Any) -> tuple[tuple, dict]:
    """Split the sample input into (args, kwargs) by the convention of the module docstring."""
    if isinstance(sample_input, dict):
        return (), dict(sample_input)
    if isinstance(sample_input, (tuple, list)):
        return tuple(sample_input), {}
    return (sample_input,), {}


def _without_cache(model: nn.Module, kwargs: dict) -> dict:
    """The call's keyword arguments with ``use_cache=False`` added for models that keep a KV cache (Hugging Face).

    Training never reads the cache, and a cache object in the output cannot be traced. This is what HF's own
    gradient checkpointing does: it passes ``use_cache=False`` in the call and leaves ``model.config`` unchanged;
    so do we (the stages are traced with it; the user's config and input dict are not modified).
    """
    config = getattr(model, "config", None)
    takes = "use_cache" in inspect.signature(model.forward).parameters or hasattr(config, "use_cache")
    if not takes or kwargs.get("use_cache") is False:
        return kwargs
    return {**kwargs, "use_cache": False}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


# Sub-layer cuts: at most this many parameter-dependent tensors cross (residual, q, k, v after the projections).
_SUBLAYER_MAX_MAINS = 4
# Between the blocks of an encoder-decoder: the decoder's activation, the encoder output, T5's position bias.
_ENCODER_DECODER_MAINS = 3
# Ops that only reshape or retype a value: a projection "reads" the value behind them.
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "contiguous", "transpose", "permute", "t", "expand", "to",
          "type", "float", "unsqueeze", "squeeze", "_to_copy", "clone", "alias"}
_PRODUCTS = {"linear", "addmm", "matmul", "bmm", "mm", "conv1d", "conv2d", "conv3d", "convolution", "einsum",
             "baddbmm"}
_ATTN_CORE = {"core", "scores", "probs", "context"}  # the roles of attention's core parts


def _roles(parts: list[list[str]]) -> list[str]:
    """Readable roles of the parts of one transformer block, from the heavy ops each holds (see _Plan._heavy):
    attn.qkv, attn.scores, attn.probs, attn.context (or attn.core for a fused attention op), attn.out, mlp.up,
    mlp.down. A second attention (a decoder's cross-attention) gets the same roles under xattn (a third under
    xattn2, ...). A block without attention gets part0, part1, ..."""
    if len(parts) == 1:
        return [""]
    kinds = [set(k) - {""} for k in parts]
    attn = [i for i, k in enumerate(kinds) if k & {"matmul", "softmax", "fused"}]
    if not attn:
        return [f"part{i}" for i in range(len(parts))]
    runs: list[list[int]] = []  # each attention: its consecutive core parts
    for i in attn:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    prefix = ["attn", "xattn"] + [f"xattn{r}" for r in range(2, len(runs))]
    roles = []
    for i, k in enumerate(kinds):
        r = sum(run[-1] < i for run in runs)  # attentions wholly before part i
        if r < len(runs) and i >= runs[r][0]:  # a core part of attention r
            soft = next((j for j in runs[r] if "softmax" in kinds[j]), None)
            core = ("core" if "fused" in k else "probs" if "softmax" in k else
                    "scores" if soft is not None and i < soft else "context")
            roles.append(f"{prefix[r]}.{core}")
        elif r > 0 and i == runs[r - 1][-1] + 1:
            roles.append(f"{prefix[r - 1]}.out")
        elif r < len(runs):  # before attention r: its projections (numbered from the block's or the last out)
            first = runs[r - 1][-1] + 2 if r else 0
            roles.append(f"{prefix[r]}.qkv" if i == runs[r][0] - 1 else f"{prefix[r]}.in{i - first}")
        elif i == len(parts) - 1:
            roles.append("mlp.down")
        else:
            k_up = i - runs[-1][-1] - 2
            roles.append("mlp.up" if k_up == 0 else f"mlp.up{k_up + 1}")
    return roles


class _NoCut(Exception):
    """The traced graph has no point where a single activation crosses."""


def _is_literal(value: Any) -> bool:
    """Python values fx can write into generated code: specialised in place of a crossing non-tensor value."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return True
    if isinstance(value, (tuple, list, torch.Size)):
        return all(_is_literal(v) for v in value)
    return False


def _as_literal(value: Any) -> Any:
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, list):
        return [_as_literal(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_literal(v) for v in value)
    return value


def _is_tensors(value: Any) -> bool:
    """A tensor, or a (nested) tuple/list of tensors: what may cross between stages."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)) and value:
        return all(_is_tensors(v) for v in value)
    return False


def _get_path(root: Any, path: str) -> Any:
    obj = root
    for item in path.split("."):
        obj = getattr(obj, item)
    return obj


# ----------------------------------------------------------------------------------------------------------------
# tracing: both tracers produce a _Traced with the same normalised graph


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

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if any(isinstance(c, (nn.ModuleList, nn.Sequential)) for c in m.children()):
            return False
        return super().is_leaf_module(m, module_qualified_name)


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


def _trace_export(model: nn.Module, args: tuple, kwargs: dict, single: bool) -> _Traced:
    from torch.export.graph_signature import InputKind, OutputKind

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


# ----------------------------------------------------------------------------------------------------------------
# analysis: classify values, find cuts, group segments, name them, build stages


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or str(target)


def _written(node: fx.Node, attrs: dict[str, Any]) -> list[Any]:
    """The inputs the op writes into in place (x.add_(y), ReLU(inplace=True), aten ops with a mutable schema)."""
    first = node.args[:1]
    if node.op == "call_method":
        return list(first) if node.target.endswith("_") and not node.target.endswith("__") else []
    if node.op == "call_module":
        return list(first) if getattr(attrs[node.target], "inplace", False) is True else []
    if node.op != "call_function":
        return []
    schema = getattr(node.target, "_schema", None)
    if schema is not None:  # an aten op: its schema says which arguments it writes (batch_norm: the statistics)
        written = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
        return written
    name = _target_name(node)
    if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True or (
            name.endswith("_") and not name.endswith("__")):
        return list(first)
    return []


def _mutates(node: fx.Node, attrs: dict[str, Any]) -> bool:
    """Does the op write into one of its inputs (or a buffer)?"""
    return bool(_written(node, attrs))


def _random(node: fx.Node) -> bool:
    name = _target_name(node).lower()
    return any(word in name for word in _RANDOM_WORDS)


def _impure(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    try:
        return node.is_impure()
    except Exception:  # purity of exotic targets is unknown: treat as impure
        return True


@dataclass
class _Info:
    """What one run of the whole graph on the sample input taught us about each node."""

    kind: dict[fx.Node, str] = field(default_factory=dict)  # "tensors", "literal" or "other"
    literal: dict[fx.Node, Any] = field(default_factory=dict)
    seconds: dict[fx.Node, float] = field(default_factory=dict)
    storages: dict[fx.Node, dict[int, int]] = field(default_factory=dict)  # data pointer -> bytes, per value


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, info: _Info, nodes: dict[fx.Node, fx.Node]):
        super().__init__(gm)
        self.info = info
        self.nodes = nodes  # node of gm's graph -> node of the plan's graph

    def run_node(self, n: fx.Node) -> Any:
        start = time.perf_counter()
        value = super().run_node(n)
        seconds = time.perf_counter() - start
        original = self.nodes[n]
        self.info.seconds[original] = seconds
        if _is_tensors(value):
            self.info.kind[original] = "tensors"
            self.info.storages[original] = {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pytree.tree_leaves(value)}
        elif _is_literal(value):
            self.info.kind[original] = "literal"
            self.info.literal[original] = _as_literal(value)
        else:
            self.info.kind[original] = "other"
        return value


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
    return gm


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


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Run test forwards without leaving a trace: RNG states and buffers (BatchNorm statistics) are restored."""
    restore = buffer_snapshot([model])
    with torch.random.fork_rng(devices=cuda_devices(list(model.parameters()))), torch.no_grad():
        try:
            yield
        finally:
            restore()


class _Plan:
    """The analysis of one traced graph: which values are constants, literals, activations or side values,
    where the cuts are, and how to turn a range of ops into a stage."""

    def __init__(self, traced: _Traced, model: nn.Module, info: _Info):
        self.traced, self.model, self.info = traced, model, info
        # How many values that carry gradients may cross a cut between blocks: one in a chain of blocks; in an
        # encoder-decoder, the encoder output travels beside the decoder's activation (and T5's position bias, made
        # from a parameter by the first layer, beside both).
        self.max_mains = _ENCODER_DECODER_MAINS if _is_encoder_decoder(model) else 1
        graph = traced.graph
        self.x = next(n for n in graph.nodes if n.op == "placeholder")
        self.output = next(n for n in graph.nodes if n.op == "output")
        attrs = traced.attrs

        # Main values carry gradients to parameters; side values (masks, ids) are parameter-free.
        self.param: set[fx.Node] = set()
        for n in graph.nodes:
            if n.op == "get_attr":
                obj = attrs[n.target]
                if isinstance(obj, torch.Tensor) and obj.requires_grad:
                    self.param.add(n)
            elif (n.op == "call_module" and any(True for _ in attrs[n.target].parameters())) or any(
                    m in self.param for m in n.all_input_nodes):
                self.param.add(n)
        # Constants: recomputed by every stage that needs them, so they never cross a cut. In an encoder-decoder,
        # where cuts may carry several values, a value made from a trainable parameter (T5's position bias) is made
        # once and crosses instead: remade by every stage, its parameter's gradient would add the stages' parts in
        # another order than eager (equal to rounding, not bitwise).
        self.const: set[fx.Node] = set()
        for n in graph.nodes:
            if n.op == "get_attr":
                self.const.add(n)
            elif self.max_mains > 1 and n in self.param:
                continue
            elif n.op in ("call_function", "call_method") and all(m in self.const for m in n.all_input_nodes):
                if not (_mutates(n, attrs) or _random(n) or _impure(n)
                        or any(n in _written(u, attrs) for u in n.users)):
                    self.const.add(n)
        # The order of the ops that run once; literals (sizes) are specialised where they cross, so free too.
        self.order = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in self.const]
        self.pos = {n: i for i, n in enumerate(self.order)}
        self.pos[self.x] = -1
        # Numbers read from tensor *values* (x.item()) are data, not shapes: never specialised.
        data: set[fx.Node] = set()
        for n in graph.nodes:
            if _target_name(n) in ("item", "tolist", "_local_scalar_dense") or any(
                    m in data for m in n.all_input_nodes):
                data.add(n)
        self.literal = {n for n in self.order if info.kind.get(n) == "literal" and not _impure(n)
                        and not _mutates(n, attrs) and n not in data}
        # Liveness: a value crosses the cut after position p when pos <= p < last use.
        end = len(self.order)
        self.last: dict[fx.Node, int] = {}
        for n in [self.x, *self.order]:
            if n in self.literal:
                continue
            uses = [end if u is self.output else self.pos[u] for u in n.users if u not in self.const]
            self.last[n] = max(uses, default=self.pos[n])
        self.crossing: list[list[fx.Node]] = []
        live: dict[fx.Node, None] = {}
        by_end: dict[int, list[fx.Node]] = {}
        for n, last in self.last.items():
            by_end.setdefault(last, []).append(n)
        if self.last[self.x] > -1:
            live[self.x] = None
        for p, n in enumerate(self.order):
            if n in self.last and self.last[n] > p:
                live[n] = None
            for gone in by_end.get(p, ()):
                live.pop(gone, None)
            mains = [v for v in live if v in self.param]
            self.crossing.append(mains + [v for v in live if v not in self.param])
        last_write: dict[fx.Node, int] = {}
        for n in self.order:
            for v in _written(n, attrs):
                if isinstance(v, fx.Node) and v not in self.const:
                    last_write[v] = self.pos[n]
        self.written_later: dict[int, set[fx.Node]] = {}
        for v, at in last_write.items():
            for p in range(self.pos.get(v, -1), at):
                self.written_later.setdefault(p, set()).add(v)
        self.valid = [p for p in range(end - 1) if self._cuttable(p)]

    @classmethod
    def make(cls, traced: _Traced, model: nn.Module, sample_input: Any, *, timed: bool = False) -> _Plan:
        """Run the whole graph once on the sample input to learn what each node yields (and, when ``timed``,
        a second time to learn what each op costs) and analyse it."""
        info = _Info()
        gm = _module_from_graph(traced.graph, traced.attrs, model, "Whole")
        nodes = dict(zip(gm.graph.nodes, traced.graph.nodes))
        with _preserved(model):
            _Recorder(gm, info, nodes).run(sample_input)
            first = dict(info.seconds)
            if timed:
                _Recorder(gm, info, nodes).run(sample_input)  # the first run pays one-off costs (kernel selection)
        info.seconds = {n: min(t, first.get(n, t)) for n, t in info.seconds.items()}
        return cls(traced, model, info)

    def _cuttable(self, p: int) -> bool:
        values = self.crossing[p]
        if not values or sum(v in self.param for v in values) > self.max_mains:
            return False
        # No cut where a later stage would write into its input in place (a standalone ReLU(inplace=True)): the
        # op stays with the stage that made the value, so a kept checkpoint is never the one overwritten.
        return all(self.info.kind.get(v) == "tensors" and v not in self.written_later.get(p, ()) for v in values)

    # -- grouping ------------------------------------------------------------------------------------------------

    def segments(self, mode: str | int) -> list[tuple[int, int]]:
        """Inclusive ranges of ``self.order`` positions, one per stage."""
        if not self.valid:
            raise _NoCut(self._no_cut_reason())
        self._roles: list[str] = []
        if mode == "finest":
            cuts = self.valid
        elif isinstance(mode, int):
            cuts = self._balanced(mode)
        else:
            cuts = self._module_cuts()
        bounds = [-1, *cuts, len(self.order) - 1]
        segments = [(bounds[i] + 1, bounds[i + 1]) for i in range(len(bounds) - 1)]
        if mode == "sublayer":
            segments = self._sublayer(segments)
        return segments

    # -- sub-layer cuts --------------------------------------------------------------------------------------------

    def _multi_cuttable(self, p: int) -> bool:
        """A cut inside a block: a few tensors cross (the residual stream, the current value, what attention still
        needs such as v), none written in place later."""
        values = self.crossing[p]
        return (0 < sum(v in self.param for v in values) <= _SUBLAYER_MAX_MAINS + self.max_mains - 1 and all(
            self.info.kind.get(v) == "tensors" and v not in self.written_later.get(p, ()) for v in values))

    def _crossing_bytes(self, p: int) -> int:
        seen: dict[int, int] = {}
        for v in self.crossing[p]:
            seen.update(self.info.storages.get(v, {}))
        return sum(seen.values())

    def _heavy(self, n: fx.Node) -> str:
        """The kind of op that a sub-layer cut goes around: "weight" (a projection by a parameter), "qk"/"pv"
        (a product of two activations), "softmax", "fused" (a fused attention op); "" for the rest."""
        name = _target_name(n).lower()
        if "scaled_dot_product" in name or "flash_attention" in name or "flex_attention" in name:
            return "fused"
        if "softmax" in name:
            return "softmax"
        if n.op == "call_module":  # a Linear or a convolution (a weight matrix), not a norm's scale vector
            weight = getattr(self.traced.attrs[n.target], "weight", None)
            return "weight" if isinstance(weight, torch.Tensor) and weight.dim() >= 2 else ""
        if name.split(".")[0] in _PRODUCTS:
            inputs = n.all_input_nodes
            if any(m in self.const and m in self.param for m in inputs) or any(
                    m.op == "get_attr" and m in self.param for m in inputs):
                return "weight"
            if sum(m not in self.const for m in inputs) >= 2:
                return "matmul"
        return ""

    def _root(self, n: fx.Node) -> fx.Node:
        """``n``'s first activation input followed back through views (the value a projection reads)."""
        m = next((a for a in n.all_input_nodes if a not in self.const), n)
        while _target_name(m).split(".")[0] in _VIEWS and m.all_input_nodes:
            nxt = next((a for a in m.all_input_nodes if a not in self.const), None)
            if nxt is None:
                break
            m = nxt
        return m

    def _sublayer(self, segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Cut every block segment between its heavy ops, at the crossing of fewest bytes (the latest on a tie)."""
        out: list[tuple[int, int]] = []
        self._roles, self._parent, self._module_segments = [], [], segments
        for index, (a, b) in enumerate(segments):
            if not any(self._is_block(u) for u in self._units[a: b + 1] if u not in self._glue):
                out.append((a, b))
                self._roles.append("")
                self._parent.append(index)
                continue
            groups: list[tuple[str, int, int, fx.Node | None]] = []  # (kind, first, last, root read)
            for p in range(a, b + 1):
                kind = self._heavy(self.order[p])
                if not kind:
                    continue
                root = self._root(self.order[p]) if kind == "weight" else None
                if groups and kind == "weight" and groups[-1][0] == "weight" and groups[-1][3] is root:
                    groups[-1] = ("weight", groups[-1][1], p, root)  # q, k, v (or gate, up) read the same value
                else:
                    groups.append((kind, p, p, root))
            cuts = []
            for (_, _, end, _), (_, start, _, _) in zip(groups, groups[1:]):
                window = [p for p in range(end, start) if a <= p < b and self._multi_cuttable(p)]
                if window:
                    cuts.append(min(window, key=lambda p: (self._crossing_bytes(p), -p)))
            bounds = [a - 1, *sorted(set(cuts)), b]
            parts = [(bounds[i] + 1, bounds[i + 1]) for i in range(len(bounds) - 1)]
            out += parts
            self._parent += [index] * len(parts)
            self._roles += _roles([[self._heavy(n) for n in self.order[x: y + 1]] for x, y in parts])
        return out

    def _no_cut_reason(self) -> str:
        # Show the narrowest point of the graph: what crosses there.
        counts = [(sum(v in self.param for v in c), p) for p, c in enumerate(self.crossing[:-1]) if c]
        if not counts:
            return "the traced graph has no place where one activation alone crosses (no cut point)"
        _, p = min(counts)
        names = ", ".join(v.name for v in self.crossing[p] if v in self.param)
        return (f"no cut point: everywhere at least two activations cross from one part of the graph to the rest "
                f"(at best: {names})")

    def _balanced(self, n_stages: int) -> list[int]:
        valid = self.valid
        if n_stages - 1 > len(valid):
            import warnings

            warnings.warn(f"granularity={n_stages} asks for more stages than the model's {len(valid) + 1} cut "
                          f"segments; returning the finest chain", stacklevel=4)
            return valid
        if n_stages == 1:
            return []
        prefix = [0.0]
        for n in self.order:
            prefix.append(prefix[-1] + self.info.seconds.get(n, 0.0))
        bounds = [-1, *valid, len(self.order) - 1]  # candidate boundaries; segment (bounds[i], bounds[j]]
        cost = lambda i, j: prefix[bounds[j] + 1] - prefix[bounds[i] + 1]
        last = len(bounds) - 1
        # best[k][j]: least maximal stage cost for k stages covering (bounds[0], bounds[j]]
        best = [[math.inf] * len(bounds) for _ in range(n_stages + 1)]
        prev = [[0] * len(bounds) for _ in range(n_stages + 1)]
        best[0][0] = 0.0
        for k in range(1, n_stages + 1):
            for j in range(k, last + 1):
                for i in range(k - 1, j):
                    value = max(best[k - 1][i], cost(i, j))
                    if value < best[k][j]:
                        best[k][j], prev[k][j] = value, i
        cuts, j = [], last
        for k in range(n_stages, 0, -1):
            j = prev[k][j]
            cuts.append(bounds[j])
        return sorted(c for c in cuts if c >= 0)

    def owner(self, n: fx.Node) -> str:
        """The path of the deepest module whose forward created this node ('' for the root's own forward)."""
        if n.op == "call_module":
            return n.target
        stack = n.meta.get("nn_module_stack")
        if not stack:
            return ""
        path = list(stack.values())[-1][0]
        return ".".join(part.split("@")[0] for part in path.split(".")) if path else ""

    def _module(self, path: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(path)
        except AttributeError:
            return None

    def _expanded(self, module: nn.Module, depth: int, force: int, in_blocks: bool = False) -> bool:
        """Split this module's children into separate units? Yes for the model itself, for containers of blocks
        (a ModuleList of layers, resnet's ``layer2``), for wrappers holding such a container at any depth
        (GPT2Model holding ``h``; BertForSequenceClassification holding ``bert.encoder.layer``), and, when these
        units give a single stage, for every module above depth ``force``. A block of such a container
        (``in_blocks``: a transformer layer, even one holding a list of its own sub-layers) stays whole, and a
        container of single layers (``nn.Sequential(conv, bn)``) is a block itself."""
        if depth == 0 or depth < force or (isinstance(module, _CONTAINERS) and _holds_blocks(module)):
            return True
        if in_blocks:
            return False
        return any(isinstance(c, _CONTAINERS) and _holds_blocks(c) for c in module.modules() if c is not module)

    def unit(self, path: str, force: int) -> str:
        """The module a node belongs to at module granularity: the first non-expanded module on its path.
        Nodes of an expanded module's own forward (the root's flatten, a wrapper's embedding sum) get that
        module's path and are recorded as glue."""
        module, unit = self.model, []
        parts = path.split(".") if path else []
        in_blocks = False
        for depth, part in enumerate(parts):
            if not self._expanded(module, depth, force, in_blocks):
                break
            child = getattr(module, part, None)
            if not isinstance(child, nn.Module):
                break
            in_blocks = isinstance(module, _CONTAINERS) and _holds_blocks(module)
            module = child
            unit.append(part)
        else:
            if self._expanded(module, len(parts), force, in_blocks):
                self._glue.add(".".join(unit))
        return ".".join(unit)

    def _is_block(self, unit: str) -> bool:
        """A building block (layer2.1, h.3): a unit that has submodules of its own. Single layers (conv1, ln_f)
        and glue are not blocks: they are merged into the stem and the head."""
        module = self._module(unit) if unit not in self._glue else None
        return module is not None and any(True for _ in module.children())

    def _module_cuts(self) -> list[int]:
        depth = max((self.owner(n).count(".") + 1 for n in self.order if self.owner(n)), default=0)
        for force in range(depth + 1):
            self._glue: set[str] = set()
            units = [self.unit(self.owner(n), force) for n in self.order]
            cuts = self._merge([p for p in self.valid if units[p] != units[p + 1]], units)
            if cuts:
                self._units = units
                return cuts
        # No module boundary is a cut (a purely functional forward): every cut point then.
        self._glue = set()
        self._units = [self.owner(n) for n in self.order]
        return self.valid

    def _merge(self, cuts: list[int], units: list[str]) -> list[int]:
        """Keep only the cuts in front of a block and after the last one: the layers before the first block form
        the stem, those after the last the head, and glue between blocks (a mask product, a pooling layer) joins
        the block before it."""
        bounds = [-1, *cuts, len(self.order) - 1]
        blocky = [any(self._is_block(u) for u in units[bounds[i] + 1: bounds[i + 1] + 1])
                  for i in range(len(bounds) - 1)]
        if not any(blocky):
            # No blocks: every module is a stage; glue (a sum, a flatten, unpacking the inputs) joins the module
            # before it, or the first module when it leads.
            glue = [all(u in self._glue for u in units[bounds[i] + 1: bounds[i + 1] + 1])
                    for i in range(len(bounds) - 1)]
            return [cuts[i] for i in range(len(cuts)) if not glue[i + 1] and not all(glue[: i + 1])]
        last = len(blocky) - 1 - blocky[::-1].index(True)
        return [cuts[i] for i in range(len(cuts)) if blocky[i + 1] or i == last]

    # -- naming --------------------------------------------------------------------------------------------------

    def names(self, segments: list[tuple[int, int]], mode: str | int) -> list[str]:
        """One readable, unique name per segment: the module it is ("h.3", "denseblock1"), "stem"/"head" at
        module granularity, a range of modules ("wte..h.1"), or part of one module ("layer1.0[conv1..bn2]");
        at sub-layer granularity the block's name and the part's role ("h.3.attn.probs"). Sets ``self.groups``
        (the block of each segment, or None) and ``self.tags`` ("attn_core" on the core attention's parts)."""
        if mode == "sublayer":
            blocks = self.names(self._module_segments, "module")
            block_groups = self.groups
            self.groups = [block_groups[k] for k in self._parent]
            self.tags = ["attn_core" if role.split(".")[-1] in _ATTN_CORE else "" for role in self._roles]
            return [blocks[k] + (f".{role}" if role else "") for k, role in zip(self._parent, self._roles)]
        self.groups: list[str | None] = [None] * len(segments)
        self.tags = [""] * len(segments)
        owners = [self.owner(n) for n in self.order]
        if mode != "module":
            self._glue = set()
            self._units = [self.unit(o, 0) for o in owners]
        units = self._units
        full: list[tuple[str, ...]] = []  # (kind, ...) entries, turned into names by _shorten
        for a, b in segments:
            paths = owners[a: b + 1]
            if mode == "module":
                # A whole block with the single layers beside it (the decoder's embedding after the encoder's last
                # layer) is named after the block, not after the module of its ops (T5's block.0.layer).
                blocks = [u for u in dict.fromkeys(units[a: b + 1]) if u not in self._glue and self._is_block(u)]
                if len(blocks) == 1 and units.count(blocks[0]) == units[a: b + 1].count(blocks[0]):
                    full.append(("module", blocks[0]))
                    continue
            common = _common_prefix(paths)
            if common and sum(1 for o in owners if _under(o, common)) == b - a + 1:
                full.append(("module", common))  # exactly the ops of one module
                continue
            inner = [u for u in units[a: b + 1] if u not in self._glue] or units[a: b + 1]
            first, last = inner[0], inner[-1]
            if first == last and first and sum(1 for o in owners if _under(o, first)) == sum(
                    1 for o in paths if _under(o, first)):
                full.append(("module", first))  # one whole module and the glue after it
                continue
            if first != last:
                full.append(("range", first, last))
                continue
            depth = first.count(".") + 1 if first else 0
            kids = [o.split(".")[depth] for o in paths if o.count(".") >= depth and _under(o, first) and o != first]
            part = "" if not kids else f"[{kids[0]}]" if kids[0] == kids[-1] else f"[{kids[0]}..{kids[-1]}]"
            full.append(("part", first or "model", part))
        names_are_blocks = False
        if mode == "module":
            blocky = [any(self._is_block(u) for u in units[a: b + 1]) for a, b in segments]
            names_are_blocks = any(blocky)
            if any(blocky):
                first_block, last_block = blocky.index(True), len(blocky) - 1 - blocky[::-1].index(True)
                for i in range(len(full)):
                    if i < first_block:
                        full[i] = ("fixed", "stem")
                    elif i > last_block:
                        full[i] = ("fixed", "head")
        names = _shorten(full)
        if names_are_blocks:
            self.groups = [n if blocky[i] else None for i, n in enumerate(names)]
        return names

    # -- building ------------------------------------------------------------------------------------------------

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
        baked = self.model.training if self.traced.method == "export" else None
        return GraphStage(gm, name, out_spec=spec, method=self.traced.method, baked_training=baked,
                          probe=self.model)


def _is_encoder_decoder(model: nn.Module) -> bool:
    """A Hugging Face encoder-decoder (its config says so), or a model with an ``encoder`` and a ``decoder``
    (``nn.Transformer``)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        return True
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return {"encoder", "decoder"} <= names


def _holds_blocks(container: nn.Module) -> bool:
    """A container of real blocks (non-leaf modules), not just a packaged conv+bn pair."""
    return any(any(True for _ in c.children()) for c in container.children())


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def _brief(path: str, k: int = 1) -> str:
    """The last ``k`` parts of a module path, keeping a list index with its container ("h.3", not "3")."""
    parts = path.split(".")
    k = max(k, 2 if parts[-1].isdigit() and len(parts) >= 2 else 1)
    return ".".join(parts[-k:])


def _shorten(full: list[tuple[str, ...]]) -> list[str]:
    """Turn ("module", path), ("range", first, last), ("part", path, "[children]") and ("fixed", name) entries
    into names: module paths lose leading parts while they stay unique ("transformer.h.3" -> "h.3"); names still
    repeated get "#1", "#2"."""
    paths = [entry[1] for entry in full if entry[0] == "module"]
    names = []
    for kind, *rest in full:
        if kind == "range":
            names.append(f"{_brief(rest[0])}..{_brief(rest[1])}")
        elif kind == "part":
            names.append(_brief(rest[0]) + rest[1])
        elif kind == "fixed":
            names.append(rest[0])
        else:
            path = rest[0]
            for k in range(1, path.count(".") + 2):
                if all(_brief(other, k) != _brief(path, k) for other in paths if other != path):
                    break
            names.append(_brief(path, k))
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if counts[name] > 1:
            seen[name] = seen.get(name, 0) + 1
            names[i] = f"{name}#{seen[name]}"
    return names


# ----------------------------------------------------------------------------------------------------------------
# verification


def _verify(model: nn.Module, sample_input: Any, args: tuple, kwargs: dict,
            stages: list[tuple[str, nn.Module]]) -> None:
    """The stages in sequence must give the model's output on the sample input (same RNG stream, same buffers)."""
    with _preserved(model):
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
        torch.manual_seed(seed)
        expected = model(*args, **kwargs)
        torch.manual_seed(seed)
        value = sample_input
        for _, stage in stages:
            value = stage(value)
    got_leaves, got_spec = pytree.tree_flatten(value)
    want_leaves, want_spec = pytree.tree_flatten(expected)
    if len(got_leaves) != len(want_leaves):
        raise AssertionError(f"the stages return {len(got_leaves)} values, the model {len(want_leaves)}")
    for got, want in zip(got_leaves, want_leaves):
        if isinstance(want, torch.Tensor):
            if not (isinstance(got, torch.Tensor) and got.shape == want.shape
                    and torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-5, equal_nan=True)):
                raise AssertionError("the stages run in sequence do not reproduce the model's output")
        elif got != want:
            raise AssertionError(f"the stages return {got!r} where the model returns {want!r}")
