"""Custom ``torch.autograd.Function``\\ s kept whole: traced as one opaque op, so their own backward runs.

Both tracers trace *through* ``Function.apply`` by default: the graph then holds the ops of the Function's forward,
and autograd differentiates those, silently replacing the hand-written backward (a straight-through estimator's
identity gradient becomes round's zero; Bloom's ``GeLUFunction`` loses ``bloom_gelu_back``). While a model is traced
we patch ``Function.apply`` so that each call of a Function defined outside torch becomes a single node that calls
the Function itself (``_KeptFunction``): the stage holding it runs ``Function.apply`` and autograd records the
Function's own backward.

- torch.fx: the patched ``apply`` sees fx proxies and records ``call_function(_KeptFunction(cls), args)``.
- torch.export: an opaque op must be a registered operator, so the call goes through ``hchain_viz::function_apply``
  (tensors in, tensors out; its fake kernel runs the Function's forward on fake tensors for the output shapes).
  After export, ``tracing._trace_export`` puts a ``_KeptFunction`` node in place of each such op.

A Function whose outputs are not tensors (or a tuple of tensors) cannot be kept: extraction refuses it by name
(``NotSequentialError``) rather than trace through it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ...errors import NotSequentialError

_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod itself, put back after tracing


def _ORIGINAL_APPLY(cls: type, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (stands for the saved method)
    """``cls.apply`` as torch defines it, whatever is patched in meanwhile. ``__get__`` binds it: a Python
    ``classmethod`` in some torch versions, a C ``classmethod_descriptor`` (no ``__func__``) in others (2.14)."""
    return _APPLY.__get__(None, cls)(*args, **kwargs)
# During one export: key -> (Function class, the call's args/kwargs spec with tensors taken out, output spec).
_CALLS: dict[int, list[Any]] = {}
_KEYS = itertools.count()


class _KeptFunction:
    """A node target that calls a custom autograd Function (its own backward then runs). With ``spec`` (export), it
    takes the call's tensors flat, puts them back among the recorded non-tensor arguments and returns the outputs
    flat (a list), as the exported op did; without (fx), it takes and returns what ``apply`` does."""

    def __init__(self, cls: type, spec: pytree.TreeSpec | None = None, others: list | None = None):
        self.cls, self.spec, self.others = cls, spec, others
        self.__name__ = f"{cls.__name__}_apply"  # how fx names the node and the generated code's global
        self.__qualname__ = self.__name__
        self.__module__ = cls.__module__

    def __call__(self, *tensors: Any) -> Any:
        if self.spec is None:
            return self.cls.apply(*tensors)
        args, kwargs = _rebuild(self.spec, self.others, list(tensors))
        return _flat_outputs(self.cls, _ORIGINAL_APPLY(self.cls, *args, **kwargs))

    def __repr__(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}.apply"


def _kept(cls: type) -> bool:
    """Functions of the user or a library are kept; torch's own (checkpointing, functorch) are traced as before."""
    return not (cls.__module__ or "").startswith("torch.")


def _split(args: tuple, kwargs: dict) -> tuple[pytree.TreeSpec, list, list]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    others = [None if isinstance(v, torch.Tensor) else v for v in leaves]
    return spec, others, tensors


def _rebuild(spec: pytree.TreeSpec, others: list, tensors: list) -> tuple[tuple, dict]:
    it = iter(tensors)
    leaves = [next(it) if v is None else v for v in others]
    return pytree.tree_unflatten(leaves, spec)


def _flat_outputs(cls: type, out: Any) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves(out)
    if not leaves or not all(isinstance(v, torch.Tensor) for v in leaves):
        raise NotSequentialError(
            f"custom autograd Function {cls.__module__}.{cls.__qualname__} returns "
            f"{type(out).__name__} values, not tensors: it cannot be kept whole in a stage, and tracing through it "
            f"would replace its backward. Pass the stages by hand (a list of (name, module) pairs).")
    return list(leaves)


@torch.library.custom_op("hchain_viz::function_apply", mutates_args=())
def _function_apply(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    cls, spec, others, _ = _CALLS[key]
    args, kwargs = _rebuild(spec, others, tensors)
    with torch.no_grad():
        return [t.clone() for t in _flat_outputs(cls, _ORIGINAL_APPLY(cls, *args, **kwargs))]


@_function_apply.register_fake
def _(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _CALLS[key]
    cls, spec, others, _ = entry
    args, kwargs = _rebuild(spec, others, tensors)
    with torch.no_grad():
        out = _ORIGINAL_APPLY(cls, *args, **kwargs)
    flat, entry[3] = pytree.tree_flatten(out)
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in _flat_outputs(cls, out)]


@contextmanager
def kept_functions(method: str) -> Iterator[None]:
    """While tracing with ``method`` ("fx" or "export"), custom Functions are recorded as single ops."""

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        if not _kept(cls):
            return _ORIGINAL_APPLY(cls, *args, **kwargs)
        if method == "fx":
            proxy = next((v for v in leaves if isinstance(v, fx.Proxy)), None)
            if proxy is None:
                return _ORIGINAL_APPLY(cls, *args, **kwargs)
            return proxy.tracer.create_proxy("call_function", _KeptFunction(cls), args, kwargs)
        spec, others, tensors = _split(args, kwargs)
        if not tensors:
            return _ORIGINAL_APPLY(cls, *args, **kwargs)
        key = next(_KEYS)
        _CALLS[key] = [cls, spec, others, None]
        flat = torch.ops.hchain_viz.function_apply(key, tensors)
        return pytree.tree_unflatten(list(flat), _CALLS[key][3])

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _APPLY


def kept_call(node: fx.Node) -> _KeptFunction | None:
    """For an exported ``hchain_viz::function_apply`` node: the target that calls the Function itself."""
    if node.op != "call_function" or node.target is not torch.ops.hchain_viz.function_apply.default:
        return None
    cls, spec, others, _ = _CALLS[node.args[0]]
    return _KeptFunction(cls, spec, others)


def forget_calls() -> None:
    _CALLS.clear()
