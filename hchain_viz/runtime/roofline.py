"""Roofline estimates of GPU stage times from FLOP and byte counts (for ``profile(..., estimate_for="H100")``).

CPU-profiled times say nothing about offloading: CPU compute is so slow that any link hides every copy. Without a
GPU at hand, each stage's forward and backward time is estimated as ``max(flops / compute rate, bytes / memory
rate)`` on a named GPU: FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode`` on the real stage, bytes from
what the stage must at least read and write (its input, parameters and what it leaves resident for the forward; what
it saved, its output gradient, parameters and the gradients it writes for the backward). Rates are the spec sheet's
peaks times an achieved fraction (``COMPUTE_EFFICIENCY``, ``MEMORY_EFFICIENCY``). It is an *estimate*: it ignores
kernel launch overheads and elementwise traffic beyond the stage boundary, and every place that shows such a chain
says so (``chain.meta["times"]``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import ProfileError


class GPU(NamedTuple):
    """Spec-sheet peaks: dense FLOP/s per dtype family and memory bytes/s."""

    name: str
    fp32: float  # FLOP/s without tensor cores (float32 matmuls, as PyTorch runs them by default)
    tensor16: float  # dense bf16/fp16 tensor-core FLOP/s
    memory: float  # HBM bytes/s


GPUS: dict[str, GPU] = {
    "H100": GPU("H100 SXM", 67e12, 989e12, 3.35e12),
    "H200": GPU("H200 SXM", 67e12, 989e12, 4.8e12),
    "A100": GPU("A100 SXM 80GB", 19.5e12, 312e12, 2.04e12),
}

# Fractions of the peaks that well-tuned kernels reach (typical large matmuls and copies); one place to change them.
COMPUTE_EFFICIENCY = 0.6
MEMORY_EFFICIENCY = 0.8


def gpu_of(name: str) -> GPU:
    if not isinstance(name, str) or name.upper() not in GPUS:
        raise ProfileError(f"estimate_for must name a GPU with known peaks: one of {', '.join(GPUS)}; got {name!r}")
    return GPUS[name.upper()]


def estimate_time(gpu: GPU, dtype: str, flops: float, nbytes: float) -> float:
    """Seconds for ``flops`` and ``nbytes`` of traffic on ``gpu`` at ``dtype`` (roofline: the slower of the two)."""
    rate = gpu.tensor16 if dtype in ("bfloat16", "float16") else gpu.fp32
    return max(flops / (rate * COMPUTE_EFFICIENCY), nbytes / (gpu.memory * MEMORY_EFFICIENCY))


def count_flops(fn: Any) -> int:
    """FLOPs of ``fn()`` as counted by ``FlopCounterMode`` (matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
