"""hchain_viz: optimal activation checkpointing for heterogeneous chains, made visible.

    import hchain_viz as hcv
    chain = hcv.profile(model, x)            # per-stage times and sizes
    sol = hcv.solve(chain)                   # the optimal DP, for every budget at once
    # hcv.solve_offload(chain.with_bandwidth("pcie5")): recompute or offload to host memory
    schedule = sol.schedule(budget_bytes)    # a list of Fck/Fn/Fall/Loss/B ops
    # hcv.device_schedule(sol, "24GiB"): the fastest whole step (fixed part + activations) that fits a device
    trace = hcv.simulate(chain, schedule)    # predicted time and memory, op by op
    wrapped = hcv.wrap(model, schedule)      # train with it: same gradients, less memory
    hcv.apply(model, schedule)               # or in place: the model itself trains by it (HF Trainer, Lightning)
    hcv.checkpoint(model, batch, budget="6GiB")  # profile, solve and apply in one line
    hcv.explore(model, x)                    # the interactive explorer in a notebook

The core (Chain, Schedule, simulate, solve, strategies) imports no torch or plotly; the runtime and viz parts are
imported lazily on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .core import strategies
from .core.batch import at_batch
from .core.chain import BANDWIDTH_PRESETS, Chain
from .core.device import device_peak, device_schedule
from .core.offload import OffloadSolution, solve_offload
from .core.schedule import Op, Schedule
from .core.simulate import Trace, simulate
from .core.solver import Solution, optimal_schedule, solve
from .core.units import format_bytes, format_time, parse_bytes
from .errors import (
    AlreadyApplied,
    DependencyError,
    DoesNotFit,
    DoubleCheckpointing,
    HChainError,
    InfeasibleBudget,
    InputMismatch,
    InvalidChain,
    InvalidPipeline,
    InvalidSchedule,
    NotNative,
    NotSequentialError,
    PipelineDoesNotFit,
    ProfileError,
    ScheduleMismatch,
    TimingWarning,
)

__version__ = "0.1.0"

# Heavy parts (torch, plotly, ipywidgets) load on first attribute access, keeping `import hchain_viz` light.
_LAZY = {
    "profile": ("runtime.profile", "profile"),
    "profile_batches": ("runtime.batch", "profile_batches"),
    "measure": ("runtime.measure", "measure"),
    "Measurement": ("runtime.measure", "Measurement"),
    "sequentialize": ("runtime.stages", "sequentialize"),
    "wrap": ("runtime.train.wrap", "wrap"),
    "apply": ("runtime.train.inplace", "apply"),
    "remove": ("runtime.train.inplace", "remove"),
    "checkpoint": ("runtime.train.auto", "checkpoint"),
    "models": ("runtime.models", None),
    "Explorer": ("viz.explorer", "Explorer"),
    "explore": ("viz.explorer", "explore"),
    "to_html": ("viz.html", "to_html"),
    "figures": ("viz.figures", None),
    "plan_pipeline": ("core.pipeline", "plan_pipeline"),
    "fit_pipeline": ("core.pipeline", "fit_pipeline"),
    "PipelinePlan": ("core.pipeline", "PipelinePlan"),
    "pipeline": ("runtime.pipeline", "pipeline"),
}

__all__ = [
    "Chain", "Schedule", "Op", "Trace", "Solution", "OffloadSolution", "BANDWIDTH_PRESETS", "simulate", "solve",
    "optimal_schedule", "strategies", "solve_offload", "device_schedule", "device_peak", "at_batch",
    "format_bytes", "format_time", "parse_bytes",
    "HChainError", "InvalidChain", "InvalidSchedule", "InfeasibleBudget", "NotSequentialError", "ProfileError",
    "TimingWarning", "DependencyError", "DoesNotFit", "AlreadyApplied", "ScheduleMismatch", "InputMismatch",
    "DoubleCheckpointing", "NotNative", "InvalidPipeline", "PipelineDoesNotFit", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(f".{module_name}", __name__)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hchain_viz' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
