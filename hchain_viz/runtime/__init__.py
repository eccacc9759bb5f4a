"""The parts that touch a real model: stages, profiler, executor, measurements (PyTorch)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..core import solver

try:
    import torch
except ImportError:  # the torch-free helpers in this package (progress bars) still import
    torch = None


@contextlib.contextmanager
def _torch_threads_kept() -> Iterator[None]:
    """Keep PyTorch's intra-op thread count across a parallel solve (see ``solver.PARALLEL_GUARDS``)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


if torch is not None:  # only then can a solve change torch's threads
    solver.PARALLEL_GUARDS.append(_torch_threads_kept)
