"""What each node of a traced graph is: its target's name, whether it writes in place, draws random numbers or
has side effects, and (from one run on the sample input, ``_Recorder``) whether it yields tensors or a literal."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

# Ops whose result depends on the global RNG: never recomputed per stage (each copy would draw other numbers).
_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential",
                 "cauchy", "geometric", "random")
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul, operator.setitem}


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
