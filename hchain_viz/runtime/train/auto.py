"""``hcv.checkpoint(model, batch, budget)``: profile, solve, apply and (``verify=True``) measure in one call.

    hcv.checkpoint(model, batch, budget="6GiB")   # prints what it chose; the model then trains by it in place

The one-line entry point, as easy as Hugging Face's ``gradient_checkpointing_enable()`` (docs/design.md §1.1).
Owns :func:`checkpoint` and its verify loop (:func:`_verified`: measure the applied step, re-apply for the budget
scaled by the overshoot). Applying is ``train/inplace.py``'s; the compiled form's planning ``core/regions.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from ...core.chain import Chain
from ...core.device import device_schedule
from ...core.regions import for_compile, selective_chain
from ...core.schedule import Schedule
from ...core.simulate import simulate
from ...core.solver import solve
from ...core.strategies import store_all
from ...core.units import format_bytes, format_time, parse_bytes
from ...errors import AlreadyApplied, HChainError, InfeasibleBudget
from ..measure import measure
from ..precision import running
from ..profile import profile
from ..stages import sequentialize
from .inplace import applied_state, apply, is_applied, remove
from .native import grad_bytes

__all__ = ["checkpoint"]


def checkpoint(model: nn.Module, batch: Any, budget: int | str | None = None, *,
               device_memory: int | str | None = None, loss_fn: Any = None,
               optimizer: torch.optim.Optimizer | None = None, granularity: str | int | None = None,
               native: bool = False, selective: bool = False, verify: bool = False, progress: bool = True,
               verbose: bool = True, autocast: torch.dtype | None = None) -> nn.Module:
    """Profile ``model`` on ``batch``, solve, and apply the fastest schedule that fits; returns ``model``.

    Args:
        batch: a training batch as the model is called with it (a dict for ``model(**batch)``, a tensor, a tuple);
            later training calls must have its structure and shapes.
        budget: activation memory (bytes or ``"6GiB"``); or ``device_memory``: the whole device, the fixed part
            counted (docs/design.md §7; needs ``optimizer``). Neither: the CUDA device's memory, else no limit.
        loss_fn, granularity: the last stage's loss (default: ``output.loss`` if any); how finely to cut the model.
        native, selective: see :func:`apply`; the schedule then fits compiled whole too (§5.3); ``selective``
            profiles twice with compiled stages, plain and selective.
        verify: measure a step (compiled whole when ``native``) and re-apply for the budget scaled by budget /
            measured, until one measures within or four steps are measured (docs/compile.md).
        verbose, progress: print the budget, predicted peak, overhead and measured peaks; progress bars.
        autocast: profile, trace and verify under ``torch.autocast(device, dtype=autocast)`` (§11).

    Raises:
        AlreadyApplied: the model already trains by a schedule (``hcv.remove`` it first).
        HChainError: arguments that contradict or lack each other; and what profiling, solving and applying raise.
        InfeasibleBudget: ``verify`` measured no schedule within the budget; the model is left plain.
    """
    if is_applied(model):
        raise AlreadyApplied(f"this {type(model).__name__} already trains by a schedule; call hcv.remove(model) first")
    if autocast is not None:  # all of it in the precision the training step will run in
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        with running(autocast, dev):
            return checkpoint(model, batch, budget, device_memory=device_memory, loss_fn=loss_fn,
                              optimizer=optimizer, granularity=granularity, native=native, selective=selective,
                              verify=verify, progress=progress, verbose=verbose)
    if device_memory is not None and budget is not None:
        raise HChainError("give either budget (activation bytes) or device_memory (the whole device), not both")
    if budget is None and device_memory is None:
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        if dev.type == "cuda":
            device_memory = torch.cuda.get_device_properties(dev).total_memory
    if device_memory is not None and optimizer is None:
        raise HChainError("a budget as device memory counts the optimizer's state: pass optimizer= (the training "
                          "step's optimizer), or give budget= (activation memory) instead")
    if selective and not native:
        raise HChainError("selective=True is a form of the native schedule: pass native=True as well")
    # with selective stages, two profiles of compiled stages: the plain one (for the regions) and the selective one
    chain = profile(model, batch, loss_fn, optimizer=optimizer, granularity=granularity, progress=progress,
                    compile=bool(selective))
    picked = profile(model, batch, loss_fn, granularity=granularity, progress=progress, compile=True,
                     selective=True) if selective else None
    if native:  # one compiled graph: no group of stages runs a backward call of its own
        chain = dataclasses.replace(chain, backward_call=0.0)
    sol = solve(chain)
    if device_memory is not None:
        schedule = device_schedule(sol, device_memory)
        asked = f"device memory {format_bytes(_bytes(device_memory))}"
    elif budget is not None:
        schedule = sol.refined(budget)  # one budget: worth a second more of solving
        asked = f"activation budget {format_bytes(_bytes(budget))}"
    else:
        schedule = store_all(chain)
        asked = "no budget (CPU model, no device memory given): store-all"
    limit = _bytes(schedule.meta["budget"]) if "budget" in schedule.meta else None  # activation bytes
    fitting = _with_precision(sol.schedule, chain)  # the schedule for an activation budget
    if native and limit is not None:  # the fastest schedule whose compiled form fits (core/regions.py)
        grads = grad_bytes([m for _, m in sequentialize(model, batch, granularity=granularity)])
        # The budget as given, not capped at the store-all peak: compiled, the gradients held add to every peak
        fitting = _with_precision(functools.partial(for_compile, sol, grads=grads, selective=picked), chain)
        schedule = fitting(limit)
    schedule.meta["precision"] = chain.meta["precision"]
    put = functools.partial(apply, model, chain=chain, sample=batch, native=native, selective=picked or False)
    put(schedule)
    measured = None
    if verify:
        schedule, measured = _verified(model, batch, loss_fn, limit, fitting, put, verbose)
    if verbose:
        trace, base = simulate(selective_chain(chain, picked, schedule), schedule), simulate(chain, store_all(chain))
        overhead = trace.makespan / base.makespan - 1 if base.makespan > 0 else 0.0
        print(f"hchain_viz: {type(model).__name__} in {chain.length} stages, {asked}: "
              f"{schedule.n_recomputed} recomputed forwards, predicted activation peak "
              f"{format_bytes(trace.peak_memory)} (store-all {format_bytes(base.peak_memory)})"
              + ("" if measured is None else f", measured {format_bytes(measured)}")
              + f", predicted step {format_time(trace.makespan)} ({overhead:+.1%} vs store-all)")
    return model


def _with_precision(fitting: Any, chain: Chain) -> Any:
    """``fitting`` whose schedules carry the chain's profiled precision in their meta."""
    def fit(*args: Any, **kwargs: Any) -> Schedule:
        schedule = fitting(*args, **kwargs)
        schedule.meta["precision"] = chain.meta["precision"]
        return schedule
    return fit


_VERIFY_TRIES = 4  # measured steps at most: the overshoot of inductor's scheduling is not the same at each budget


def _verified(model: nn.Module, batch: Any, loss_fn: Any, limit: int | None, fitting: Any, put: Any,
              verbose: bool) -> tuple[Schedule, int]:
    """Measure the applied model's step on ``batch`` (compiled whole in the native form), then apply (``put``) the
    schedule ``fitting`` gives for the budget scaled by ``limit`` over what was measured (lower when the step is
    above ``limit``, higher when below), until a schedule comes back or four steps are measured. Leaves applied, and
    returns with its measured peak, the schedule for the highest budget that measured within ``limit`` (the fastest,
    by the chain)."""
    state = applied_state(model)
    schedule, target = state.schedule, limit
    tried: set[tuple] = set()
    best: tuple[int, Schedule, int] | None = None  # (budget chosen for, schedule, measured) that measured within
    why = ""
    while True:
        state.warned = True  # the compiled-memory warning says to measure: done here
        runner = _BatchCall(torch.compile(model) if state.native else model, state.structure)
        measured = measure(runner, batch, loss_fn, repeats=1).peak_bytes
        tried.add(schedule.ops)
        fits = limit is None or measured <= limit
        if verbose:
            print(f"hchain_viz: measured {'compiled ' if state.native else ''}step peak {format_bytes(measured)} "
                  f"with {schedule.n_recomputed} recomputed forwards"
                  + ("" if limit is None else f" ({'within' if fits else 'above'} {format_bytes(limit)})"))
        if limit is None:
            return schedule, measured
        if fits and (best is None or target > best[0]):
            best = (target, schedule, measured)
        if len(tried) == _VERIFY_TRIES:
            break
        following = schedule
        while following.ops == schedule.ops:  # the budget scaled by the overshoot (or the room left) until it changes
            target = target * limit // measured
            try:
                following = fitting(target)
            except HChainError as e:  # nothing fits the lowered budget
                why = f"; nothing fits {format_bytes(target)} ({e})"
                break
            if fits:  # raised: the same schedule again is as fast as this budget allows
                break
        if why or following.ops in tried:
            break
        remove(model)
        put(following)
        state, schedule = applied_state(model), following
    if best is None:
        remove(model)
        raise InfeasibleBudget(
            f"no schedule measured within the budget of {format_bytes(limit)}: the last of {len(tried)} measured "
            f"{format_bytes(measured)} with {schedule.n_recomputed} recomputed forwards{why}. The model is left as it "
            f"was; give a larger budget or a smaller batch"
            + (", or run the schedule by the executor (native=False), whose peaks are at most its predictions"
               if state.native else ""), budget=limit)
    if best[1] is not schedule:
        remove(model)
        put(best[1])
    return best[1], best[2]


class _BatchCall(nn.Module):
    """Calls a model with a batch in the form it was profiled in (``model(**batch)`` for a dict), as
    :func:`~hchain_viz.measure` passes its sample as one argument."""

    def __init__(self, model: nn.Module, structure: Any):
        super().__init__()
        self.model, self.structure = model, structure

    def forward(self, batch: Any) -> Any:
        args, kwargs = self.structure.as_call(batch)
        return self.model(*args, **kwargs)


def _bytes(value: int | str) -> int:
    return value if isinstance(value, int) else parse_bytes(value)
