"""Verification: the stages run in sequence must reproduce the model on the sample input, forward *and* backward
(docs/design.md §5.4), leaving no trace (RNG, buffers and ``.grad`` untouched).

The backward check is what catches a tracer that changed the math without changing the values: tracing through a
custom ``torch.autograd.Function`` keeps its forward and silently replaces its backward (see functions.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..memtrack import cuda_devices
from ..precision import precision_of, resolution
from ..snapshot import buffer_snapshot

# A gradient matches when max |got - want| <= rtol * max |want| + _GRAD_ATOL, rtol the larger of _GRAD_RTOL and
# _EPS_RTOL machine epsilons of the precision that runs (runtime/precision.py). Loose enough for the rounding of ops
# reordered by tracing (1e-8 relative on GQA decoders in float32; an explicit causal mask where eager passes
# is_causal: 0.6% in bfloat16, LLaMA), tight enough for any changed derivative.
_GRAD_RTOL, _GRAD_ATOL, _EPS_RTOL = 1e-4, 1e-6, 4


@contextmanager
def _preserved(model: nn.Module, *, grad: bool = False) -> Iterator[None]:
    """Run test forwards without leaving a trace: RNG states and buffers (BatchNorm statistics) are restored. With
    ``grad``, autograd records (for one backward taken with ``torch.autograd.grad``, which leaves ``.grad`` alone)."""
    restore = buffer_snapshot([model])
    with torch.random.fork_rng(devices=cuda_devices(list(model.parameters()))), (
            nullcontext() if grad else torch.no_grad()):
        try:
            yield
        finally:
            restore()


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    """Elementwise within 1e-4 in float32; in a lower precision within ``rtol`` of the output's scale (one rounding
    step of a large element exceeds a small element's own tolerance). Non-finite values must sit at the same places."""
    if rtol <= _GRAD_RTOL:
        return torch.allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not finite.any():
        return torch.equal(finite, torch.isfinite(got))
    got, want = got[finite], want[finite]
    return (got - want).abs().max().item() <= rtol * want.abs().max().item() + _GRAD_ATOL


def _grads(output: Any, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    """The parameters' gradients of a fixed random projection of every float output that requires grad."""
    leaves = [v for v in pytree.tree_leaves(output)
              if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point()]
    if not leaves or not params:
        return [None] * len(params)
    gen = torch.Generator().manual_seed(0)  # its own generator: the global RNG stream is the model's
    loss = sum((v.float() * torch.rand(v.shape, generator=gen).to(v.device)).sum() for v in leaves)
    return list(torch.autograd.grad(loss, params, allow_unused=True))


def _verify(model: nn.Module, sample_input: Any, args: tuple, kwargs: dict,
            stages: list[tuple[str, nn.Module]]) -> None:
    """The stages in sequence must give the model's output and its parameters' gradients on the sample input
    (same RNG stream, same buffers)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    rtol = max(_GRAD_RTOL, _EPS_RTOL * resolution(precision_of(model)))  # the model compared in the same precision
    with _preserved(model, grad=torch.is_grad_enabled()):
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
        torch.manual_seed(seed)
        expected = model(*args, **kwargs)
        want_grads = _grads(expected, params) if torch.is_grad_enabled() else []
        torch.manual_seed(seed)
        value = sample_input
        for _, stage in stages:
            value = stage(value)
        got_grads = _grads(value, params) if torch.is_grad_enabled() else []
    got_leaves, got_spec = pytree.tree_flatten(value)
    want_leaves, want_spec = pytree.tree_flatten(expected)
    if len(got_leaves) != len(want_leaves):
        raise AssertionError(f"the stages return {len(got_leaves)} values, the model {len(want_leaves)}")
    for got, want in zip(got_leaves, want_leaves):
        if isinstance(want, torch.Tensor):
            if not (isinstance(got, torch.Tensor) and got.shape == want.shape
                    and _close(got.detach().float(), want.detach().float(), rtol)):
                raise AssertionError("the stages run in sequence do not reproduce the model's output")
        elif got != want:
            raise AssertionError(f"the stages return {got!r} where the model returns {want!r}")
    wrong = []
    for (name, _), got, want in zip(named, got_grads, want_grads):
        if (got is None) != (want is None):
            wrong.append(f"{name} (a gradient on one side only)")
        elif want is not None:
            err = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item()
            if not err <= rtol * scale + _GRAD_ATOL:
                wrong.append(f"{name} (max error {err:.3g}, gradient scale {scale:.3g})")
    if wrong:
        raise AssertionError(
            f"the stages reproduce the model's output but not its gradients, on {len(wrong)} parameter(s): "
            + ", ".join(wrong[:4]) + (", ..." if len(wrong) > 4 else "")
            + "; the traced graph differentiates differently from the model (an op whose backward tracing "
              "replaced, such as a custom autograd Function)")
