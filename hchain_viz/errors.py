"""Every error a user can cause, as one family: ``except hcv.HChainError`` catches them all.

Each message says what went wrong with the user's own values and what to do about it.
"""

from __future__ import annotations


class HChainError(Exception):
    """Base class of all errors raised by hchain_viz for bad input."""


class InvalidChain(HChainError, ValueError):
    """A Chain's fields are inconsistent (lengths, negative or NaN values, xbar[i] < x[i+1])."""


class InvalidSchedule(HChainError, ValueError):
    """A schedule breaks the operation grammar or the memory model (docs/design.md §3); names the first bad op."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


class InfeasibleBudget(HChainError, ValueError):
    """No schedule fits the budget; ``min_budget`` is the least budget (bytes) that works."""

    def __init__(self, message: str, min_budget: int | None = None, budget: int | None = None):
        super().__init__(message)
        self.min_budget = min_budget
        self.budget = budget


class NotSequentialError(HChainError, TypeError):
    """The model cannot be turned into a chain of stages automatically."""


class ProfileError(HChainError, RuntimeError):
    """Profiling or measuring a model failed because of its input (device, dtype, shapes, emptiness)."""


class DependencyError(HChainError, ImportError):
    """An optional dependency (torch, plotly, ipywidgets, torchvision, ...) is missing."""


class DoesNotFit(InfeasibleBudget):
    """A training step does not fit a device's memory whatever the schedule; ``min_budget`` is the least device
    memory (bytes, margin included) that fits (docs/design.md §7)."""


class AlreadyApplied(HChainError, ValueError):
    """``apply`` on a model that already trains by a schedule."""


class ScheduleMismatch(HChainError, ValueError):
    """The schedule (or the chain it was solved for) is not for this model as it is now: another model, other input
    shapes, or a model whose modules or parameters changed after profiling or applying."""


class InputMismatch(HChainError, ValueError):
    """A training call whose inputs differ in structure from the inputs the schedule was profiled with."""


class DoubleCheckpointing(HChainError, RuntimeError):
    """Hugging Face's own activation checkpointing met a model that trains by a schedule: both would recompute."""


class NotNative(InvalidSchedule):
    """The schedule is not a tree of segments (nested checkpoint regions); it can still run by the executor."""


class InvalidPipeline(HChainError, ValueError):
    """A pipeline request that cannot be planned or run: more stages than layers, an unknown pipeline schedule, a
    world size that is not the plan's number of stages (docs/design.md §12)."""


class PipelineDoesNotFit(InfeasibleBudget):
    """No pipeline plan fits the per-device memory; ``min_budget`` is the least per-device memory (bytes) for this
    number of devices and microbatches."""


class TimingWarning(UserWarning):
    """Measured times varied a lot across repeats (a busy machine): predictions are uncertain by as much."""
