"""Copies of a model's buffers, put back after a trial run: profiling, measuring and extraction's check run the
model without leaving their steps in its running statistics."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def buffer_snapshot(modules: list[nn.Module], host: bool = False) -> Callable[[], None]:
    """Copy every buffer of ``modules`` now (to host memory with ``host``); the returned function puts the values
    (and the tensors) back."""
    subs = {id(s): s for m in modules for s in m.modules()}.values()
    keep = (lambda b: b.detach().to("cpu", copy=True)) if host else (lambda b: b.detach().clone())
    saved = [(s, name, b, keep(b)) for s in subs for name, b in s._buffers.items() if b is not None]

    def restore() -> None:
        with torch.no_grad():
            for s, name, b, copy in saved:
                b.copy_(copy)
                s._buffers[name] = b

    return restore
