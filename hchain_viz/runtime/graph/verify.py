"""Verification: the stages run in sequence must reproduce the model on the sample input, leaving no trace (RNG
and buffers restored)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..memtrack import cuda_devices
from ..stages import buffer_snapshot


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Run test forwards without leaving a trace: RNG states and buffers (BatchNorm statistics) are restored."""
    restore = buffer_snapshot([model])
    with torch.random.fork_rng(devices=cuda_devices(list(model.parameters()))), torch.no_grad():
        try:
            yield
        finally:
            restore()


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
