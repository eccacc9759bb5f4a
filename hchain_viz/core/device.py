"""Will it fit: a training step's whole device memory, device sizes as budgets, and the largest batch (design.md §7).

The DP and the simulator work on activation memory (§3); a device also holds the chain's fixed part
(:class:`~hchain_viz.core.fixed.FixedMemory`: parameters, gradients, optimizer state, buffers).
:func:`device_peak` is the largest whole-step memory over one step, per rank, phase by phase: the forward, each
backward ``B(i)`` and ``optimizer.step()`` (what each phase holds: docs/design.md §7.1). :func:`device_schedule` turns
a device size into a safe activation budget (the margin, ``static`` and *all* gradients subtracted) and tries
store-all first with its exact whole-step peak, then the solution's faster schedules down to that budget (§7.2).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, NamedTuple

from ..errors import DoesNotFit, HChainError, InfeasibleBudget
from .batch import at_batch
from .chain import Chain
from .schedule import Schedule
from .simulate import Trace, simulate
from .solver import Solution, least_budget, solve
from .strategies import periodic, store_all
from .units import format_bytes, parse_bytes

#: Common accelerator memory sizes (label -> bytes). Cards are sized in binary units: a "24 GB" card has 24 GiB.
#: The margin (default 5%) covers what the CUDA context and the allocator's fragmentation take.
DEVICE_PRESETS: dict[str, int] = {
    "16 GiB (V100, T4)": 16 * 2**30,
    "24 GiB (RTX 4090, L4, A10)": 24 * 2**30,
    "40 GiB (A100 40GB)": 40 * 2**30,
    "48 GiB (L40S, A6000)": 48 * 2**30,
    "80 GiB (A100 80GB, H100)": 80 * 2**30,
    "141 GiB (H200)": 141 * 2**30,
}
DEFAULT_MARGIN = 0.05

#: The strategies compared by batch size: the optimal DP, keeping everything, and PyTorch's checkpoint_sequential.
BATCH_STRATEGIES = ("optimal", "store_all", "checkpoint_sequential")


def usable_memory(device_memory: int | str, margin: float = DEFAULT_MARGIN) -> int:
    """Bytes of ``device_memory`` (bytes or text like ``"24GiB"``) left after the allocator ``margin`` (a fraction
    of the device, 0 <= margin < 1)."""
    try:
        device = parse_bytes(device_memory)
    except HChainError:
        raise HChainError(f"cannot read the device memory {device_memory!r}; give bytes or text like '24GiB' "
                          f"(a card sold as '24 GB' has 24 GiB)") from None
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise HChainError(f"margin must be a fraction of the device memory from 0 to below 1 (e.g. 0.05 for 5%), "
                          f"got {margin!r}")
    return int(device * (1.0 - margin))


def in_precision(chain: Chain, precision: str) -> Chain:
    """``chain`` with its fixed part kept in ``precision`` (a name of :data:`~hchain_viz.core.fixed.PRECISIONS`;
    see :meth:`~hchain_viz.core.fixed.FixedMemory.in_precision`, docs/design.md §11). The activations stay as
    profiled.

    Raises:
        HChainError: the chain has no fixed part, the name is unknown, or the precision cannot be derived from the
            one profiled (another activation width, or autocast from a profile not run under it).
    """
    return replace(chain, fixed=_fixed_of(chain).in_precision(precision))


def _fixed_of(chain: Chain):
    if chain.fixed is None:
        raise HChainError("this chain does not know its fixed memory (parameters, gradients, optimizer state); "
                          "profile it with the optimizer: hcv.profile(model, x, loss_fn, optimizer=opt)")
    return chain.fixed


def device_peak(trace: Trace) -> int | None:
    """The whole step's peak device memory on one rank (bytes): the chain's fixed part (parameters, gradients as their
    backwards create them, optimizer state, buffers) plus the activations of ``trace``, and the optimizer step's
    transient (docs/design.md §7.1). None when the chain has no fixed part: ``hcv.device_peak(trace)``."""
    fixed = trace.chain.fixed
    if fixed is None:
        return None
    static = fixed.at_step_per_rank
    grads = 0
    casts: dict[int, int] = {}  # autocast's weight copies alive: a stage's from its first forward to its backward
    peak = static + trace.initial_memory
    for e in trace.events:
        if e.op.is_forward and e.op.stage < trace.chain.length:
            casts.setdefault(e.op.stage, fixed.stage_cast(e.op.stage))
        if e.op.kind == "B":
            # The stage's parameter gradients appear during its backward. The profile measured bwd_tmp with the
            # gradients already allocated, where each weight gradient is a temporary added into .grad; after
            # zero_grad() autograd keeps that same tensor as .grad. So the backward's transient and its new
            # gradients overlap: the op peaks at the larger of the two, and the gradients stay.
            # Under autocast, the stage's own weight copies are freed inside its backward, which needs them for the
            # input gradient before it makes the weight gradients: they overlap the transient too.
            g = fixed.stage_grad_per_rank(e.op.stage)
            tmp = trace.chain.bwd_tmp[e.op.stage]
            own = casts.pop(e.op.stage, 0)
            peak = max(peak, static + sum(casts.values()) + grads + e.mem_peak - tmp + max(tmp, g, own))
            grads += g
            continue
        peak = max(peak, static + sum(casts.values()) + grads + e.mem_peak)
    # what the last compute op leaves (the input, the held output, the input gradient); offloads only lower it
    end = next((e.mem_after for e in reversed(trace.events) if not e.op.is_transfer), trace.initial_memory)
    return max(peak, fixed.step_total_per_rank + end + fixed.step_tmp_per_rank)


def optimizer_step_peak(chain: Chain) -> int:
    """Device memory during ``optimizer.step()``: independent of the schedule (every schedule ends in the same
    state: the input, the held output and the input gradient)."""
    fixed = _fixed_of(chain)
    end = simulate(chain, store_all(chain)).events[-1].mem_after  # store-all ends with its backward B0
    return fixed.step_total_per_rank + end + fixed.step_tmp_per_rank


def least_device_memory(chain: Chain, margin: float = DEFAULT_MARGIN, solution: Solution | None = None) -> int:
    """A device memory (bytes, margin included) in which :func:`device_schedule` surely finds a schedule (at the
    resolution of ``solution`` when given, else at the exact least activation budget): the least one when every
    gradient is counted as resident through the backward; a slightly smaller device may still fit."""
    fixed = _fixed_of(chain)
    sa = device_peak(simulate(chain, store_all(chain)))
    act = least_budget(chain) if solution is None or solution.min_budget is None else solution.min_budget
    need = min(sa, max(fixed.total_per_rank + act, optimizer_step_peak(chain)))
    least = math.ceil(need / (1.0 - margin))
    while usable_memory(least, margin) < need:  # float rounding in usable_memory
        least += 1
    return least


def activation_budget(chain: Chain, device_memory: int | str, margin: float = DEFAULT_MARGIN,
                      solution: Solution | None = None) -> int:
    """The activation budget (bytes, design.md §3) a device of ``device_memory`` leaves: usable memory minus the fixed
    part with every gradient resident. Raises :class:`DoesNotFit` when the fixed part or the optimizer step alone
    exceeds the device."""
    fixed = _fixed_of(chain)
    usable = usable_memory(device_memory, margin)
    if optimizer_step_peak(chain) > usable:
        raise _does_not_fit(chain, device_memory, margin, "the optimizer step alone", solution)
    return usable - fixed.total_per_rank


def device_schedule(solution: Solution, device_memory: int | str, margin: float = DEFAULT_MARGIN) -> Schedule:
    """The fastest schedule of ``solution`` whose whole training step (the chain's fixed part plus activations) fits
    a device: ``hcv.device_schedule(hcv.solve(chain), "24GiB")``. See the module docstring for how the device size
    becomes an activation budget.

    Args:
        solution: what :func:`~hchain_viz.core.solver.solve` returns for a chain with its fixed part.
        device_memory: bytes, or text like ``"24GiB"``.
        margin: the fraction of the device left to the CUDA context and the allocator.

    Raises:
        DoesNotFit: nothing fits; the message and ``.min_budget`` name the least device memory that works.
        HChainError: the chain has no fixed part, or ``device_memory`` / ``margin`` cannot be read.
    """
    chain = solution.chain
    _fixed_of(chain)
    usable = usable_memory(device_memory, margin)
    meta = {"device_memory": parse_bytes(device_memory), "margin": margin}
    if device_peak(simulate(chain, store_all(chain))) <= usable:  # store-all is the fastest there is
        s = solution.schedule(max(solution.store_all_peak, solution.max_budget))
        return Schedule(s.ops, {**s.meta, **meta})
    lo = activation_budget(chain, device_memory, margin, solution)  # safe: all gradients resident throughout
    hi = min(usable - chain.fixed.at_step_per_rank, solution.max_budget)  # no activation peak above this can fit
    # The gradients appear stage by stage during the backward, so schedules above the safe budget ``lo`` may still
    # fit: walk the DP's frontier from the fastest budget below ``hi`` down to ``lo``, and take the first whose exact
    # whole-step peak fits (at ``lo`` and below every schedule fits, so the walk stops there).
    best = None
    candidates = [b for b, _ in solution.frontier() if lo < b <= hi][::-1] + [lo]
    for budget in candidates:
        try:
            s = solution.schedule(budget)
        except InfeasibleBudget:
            continue
        if device_peak(simulate(chain, s)) <= usable:
            best = s
            break
    if best is None:
        raise _does_not_fit(chain, device_memory, margin, "the smallest schedule", solution)
    return Schedule(best.ops, {**best.meta, **meta})


def _does_not_fit(chain: Chain, device_memory: Any, margin: float, culprit: str,
                  solution: Solution | None = None) -> DoesNotFit:
    fixed = _fixed_of(chain)
    least = least_device_memory(chain, margin, solution)
    usable = usable_memory(device_memory, margin)
    dev = parse_bytes(device_memory)
    batch = f" at batch {chain.batch}" if chain.batch is not None else ""
    return DoesNotFit(
        f"nothing fits{batch} in {format_bytes(dev)} with a {100 * margin:g}% margin ({format_bytes(usable)} usable): "
        f"the fixed part takes {fixed.describe()}, {culprit} needs more (the least activation memory of any schedule "
        f"is {format_bytes(least_budget(chain))}, the optimizer step's transient "
        f"{format_bytes(fixed.step_tmp_per_rank)}). A device of {format_bytes(least)} "
        f"({least} B) fits; use a larger device, a smaller "
        f"batch (hcv.at_batch(chain, b)), or shard the model (chain.with_world_size(n))",
        min_budget=least, budget=dev)


# ---------------------------------------------------------------------------------------------- batch size
class FitPoint(NamedTuple):
    """One strategy at one batch size on one device: the fastest schedule that fits, or ``fits`` False."""

    strategy: str
    batch: int
    fits: bool
    makespan: float  # seconds per step (inf when nothing fits)
    device_peak: int  # whole-step peak of the chosen schedule (0 when nothing fits)
    schedule: Schedule | None

    @property
    def throughput(self) -> float:
        """Samples per second (0 when nothing fits)."""
        return self.batch / self.makespan if self.fits and self.makespan > 0 else 0.0


def fit_point(chain: Chain, strategy: str, device_memory: int | str, margin: float = DEFAULT_MARGIN, *,
              slots: int = 200) -> FitPoint:
    """The fastest schedule of ``strategy`` (one of :data:`BATCH_STRATEGIES`) whose whole step fits the device.

    ``checkpoint_sequential`` tries every segment count; ``optimal`` solves the DP for this chain at the device's
    activation budget (``slots``: its resolution).
    """
    _fixed_of(chain)
    usable = usable_memory(device_memory, margin)
    batch = chain.batch or 0
    candidates: list[Schedule] = []
    if strategy == "store_all":
        candidates = [store_all(chain)]
    elif strategy == "checkpoint_sequential":
        candidates = [periodic(chain, n) for n in range(1, chain.length + 1)]
    elif strategy == "optimal":
        try:
            budget = activation_budget(chain, device_memory, margin)
        except DoesNotFit:
            budget = None
        sa = store_all(chain)
        if device_peak(simulate(chain, sa)) <= usable:
            candidates = [sa]
        elif budget is not None and budget > 0:
            hi = usable - chain.fixed.at_step_per_rank
            try:
                candidates = [device_schedule(solve(chain, max_budget=hi, slots=slots), device_memory, margin)]
            except DoesNotFit:
                candidates = []
    else:
        raise HChainError(f"unknown strategy {strategy!r}; choose one of {', '.join(BATCH_STRATEGIES)}")
    best = FitPoint(strategy, batch, False, math.inf, 0, None)
    for s in candidates:
        t = simulate(chain, s)
        peak = device_peak(t)
        if peak <= usable and t.makespan < best.makespan:
            best = FitPoint(strategy, batch, True, t.makespan, peak, s)
    return best


def batch_sweep(chain: Chain, device_memory: int | str, batches: list[int], margin: float = DEFAULT_MARGIN,
                strategies: tuple[str, ...] = BATCH_STRATEGIES, *, slots: int = 200) -> dict[str, list[FitPoint]]:
    """For each strategy, its :class:`FitPoint` at every batch size in ``batches`` (the chain from
    :func:`~hchain_viz.core.batch.at_batch`)."""
    chains = [at_batch(chain, b) for b in batches]
    return {s: [fit_point(c, s, device_memory, margin, slots=slots) for c in chains] for s in strategies}


def largest_batch(chain: Chain, device_memory: int | str, strategy: str = "optimal", margin: float = DEFAULT_MARGIN,
                  *, batches: list[int] | None = None, limit: int = 2**24, slots: int = 200) -> FitPoint | None:
    """The largest batch size at which ``strategy`` fits the device, with its point; None when not even batch 1
    (or the smallest of ``batches``) fits.

    With ``batches`` (a grid) the answer is the largest grid size that fits; without, the exact largest integer up to
    ``limit``, by doubling then bisection (memory grows with the batch size, so fitting is monotone).
    """
    def at(b: int) -> FitPoint:
        return fit_point(at_batch(chain, b), strategy, device_memory, margin, slots=slots)

    if batches is not None:
        fitting = [p for p in (at(b) for b in sorted(batches)) if p.fits]
        return fitting[-1] if fitting else None
    lo = at(1)
    if not lo.fits:
        return None
    hi = 2
    while hi <= limit and (p := at(hi)).fits:
        lo, hi = p, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo.batch > 1:
        mid = (lo.batch + hi) // 2
        p = at(mid)
        if p.fits:
            lo = p
        else:
            hi = mid
    return lo
