"""Benchmarks behind ``python -m hchain_viz bench NAME``: each module here prints one table.

- ``solver``: DP table build time and memory, schedule rebuild, cold start (issue: core solver).
- ``profile``: profiling wall time, predicted vs measured peak and step time on the demo models.
- ``train``: optimal schedules vs PyTorch's checkpoint_sequential at equal measured memory.
- ``widget``: server-side time of one explorer budget change.
- ``models``: automatic chain extraction on real architectures.
- ``fit``: whole-step peaks and largest batch sizes, predicted vs measured (will it fit, docs/design.md §7).
- ``compile``: compiled stages under the optimal schedule against torch.compile's activation_memory_budget.
- ``transformers``: transformer chains at module and sub-layer granularity vs per-layer and selective recomputation.
- ``offload``: remat-only vs remat+offload makespans at three links, in simulation (GPU-like times).
- ``trainer``: an applied store-all schedule against the plain model in Hugging Face Trainer steps (GPT-2).
- ``pipeline``: pipeline plans against a time-balanced partition, predicted and measured on gloo ranks.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.chain import Chain
    from ..core.schedule import Schedule

BENCHMARKS = ("solver", "profile", "train", "widget", "models", "fit", "gpu", "compile", "transformers",
              "offload", "trainer", "pipeline")


def print_table(head: Sequence[object], rows: Sequence[Sequence[object]], *, left: int = 0, rule: bool = False) -> None:
    """Print ``rows`` under ``head`` in aligned columns (the CLI's and every benchmark's tables): the first ``left``
    columns left-aligned, the rest right-aligned; ``rule`` draws a line of dashes under the head."""
    lines = [[str(c) for c in r] for r in [head, *rows]]
    widths = [max(len(r[c]) for r in lines) for c in range(len(lines[0]))]
    if rule:
        lines.insert(1, ["-" * w for w in widths])
    for r in lines:
        print("  ".join(s.ljust(w) if c < left else s.rjust(w) for c, (s, w) in enumerate(zip(r, widths))).rstrip())


def run(name: str, args: list[str]) -> None:
    """Run benchmark ``name`` with its own command-line ``args``."""
    from ..errors import HChainError

    if name not in BENCHMARKS:
        raise HChainError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    importlib.import_module(f".{name}", __name__).run(list(args))


def pareto_efficient(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For each ``(memory, time)`` point: False when another point uses as much memory or less and is faster.

    The rule by which the benchmarks count ``checkpoint_sequential``'s segment counts: a count that saves no memory
    over a faster one is a configuration nobody would pick, and a gain measured against it says nothing.
    """
    return [not any(mq <= mp and tq < tp for mq, tq in points) for mp, tp in points]


def positive_int(text: str) -> int:
    """argparse type for counts (rounds, repeats, changes): a whole number of at least 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small; give 1 or more")
    return value


def optimal_at(chain: Chain, budget: int) -> Schedule:
    """The optimal schedule for one budget, solved at that budget's own resolution (a slot is 1/20000 of it).

    Read from one table up to store-all instead, a budget that is exactly a baseline's peak loses up to a slot per
    held value to rounding: often enough to miss that very baseline, and the comparison at equal memory is unfair.
    (Even at this resolution the rounding can cost a few KiB: see ``bench transformers``.)"""
    from ..core.solver import optimal_schedule

    return optimal_schedule(chain, budget, slots=20000)


def keep_heap() -> bool:
    """Ask glibc to keep freed memory (``mallopt``: no trimming, no mmap below 32 MiB), as
    ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296`` does from the
    start. Otherwise it hands large blocks back to the system and the next step page-faults them in again (tens of
    thousands of faults, tens of ms a CPU step, more for the schedules that allocate more), which no GPU allocator
    does. True when glibc took both settings."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20))
    except (OSError, AttributeError):  # not glibc
        return False
