"""Benchmarks behind ``python -m hchain_viz bench NAME``: each module here prints one table.

- ``solver``: DP table build time and memory, schedule rebuild, cold start (issue: core solver).
- ``profile``: profiling wall time, predicted vs measured peak and step time on the demo models.
- ``train``: optimal schedules vs PyTorch's checkpoint_sequential at equal measured memory.
- ``widget``: server-side time of one explorer budget change.
- ``models``: automatic chain extraction on real architectures.
"""

from __future__ import annotations

import importlib

BENCHMARKS = ("solver", "profile", "train", "widget", "models")


def run(name: str, args: list[str]) -> None:
    """Run benchmark ``name`` with its own command-line ``args``."""
    from ..errors import HChainError

    if name not in BENCHMARKS:
        raise HChainError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    importlib.import_module(f".{name}", __name__).run(list(args))
