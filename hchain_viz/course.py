"""Helpers of the course notebooks (``notebooks/course/``): teaching chains in abstract units, and exercise checks.

The lessons work on small chains whose times and sizes are plain numbers ("units"), not seconds and bytes.
:func:`abstract` marks such a chain so that :mod:`hchain_viz.figures` labels its axes in units, and :func:`mem` /
:func:`time` print numbers the same way.

The checks ask before they tell: a first wrong answer gets a hint, only a second one the answer and the reason.
:func:`check` judges a number, :func:`check_function` a function the reader wrote (run on a few chains), and
:func:`check_table` the reader's own dynamic program (lesson 4), cell by cell against :func:`hchain_viz.solve`,
rebuilding a schedule from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from .core.chain import Chain
from .core.schedule import Op, Schedule
from .core.simulate import simulate
from .errors import InvalidChain

__all__ = ["abstract", "is_abstract", "mem", "time", "check", "check_function", "check_table", "tail"]

# Wrong answers so far, per exercise (keyed by its hint): the first gets the hint, later ones the answer.
_wrong: dict[str, int] = {}


def abstract(chain: Chain) -> Chain:
    """``chain`` with ``meta["units"] = "abstract"``: figures and these helpers print its numbers as units."""
    return dataclasses.replace(chain, meta={**chain.meta, "units": "abstract"})


def is_abstract(chain: Any) -> bool:
    meta = getattr(chain, "meta", None)
    return isinstance(meta, dict) and meta.get("units") == "abstract"


def _num(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.4g}"


def mem(v: float) -> str:
    """A memory size of a teaching chain: ``'12 units'``."""
    return f"{_num(v)} units"


def time(v: float) -> str:
    """A duration of a teaching chain: ``'56 time units'``."""
    return f"{_num(v)} time units"


def _verdict(ok: bool, said: str, truth: str, *, why: str, hint: str | None) -> bool:
    """Print the verdict: right, or a hint at the first miss, or the answer and why from the second on."""
    hint = hint or "look again at the rules above."
    if ok:
        _wrong.pop(hint, None)
        print(f"Right: {said}, {truth}.\nWhy: {why}")
    elif _wrong.get(hint, 0) == 0:
        _wrong[hint] = 1
        print(f"Not quite: {said}.\nHint: {hint}\n"
              "Try again: change your answer (or move the slider) and run the cells again.")
    else:
        _wrong[hint] += 1
        print(f"Not quite: {said}; {truth}.\nWhy: {why}")
    return ok


def check(answer: Any, expected: float, *, why: str, hint: str | None = None, unit: str = "units",
          tol: float = 0.0) -> bool:
    """Print whether ``answer`` matches ``expected`` (within ``tol``, absolute); return True when it does.

    A first wrong answer is told ``hint`` only; a second one ``expected`` and ``why``. ``answer`` left as ``...``
    (or None) prints a reminder, so a notebook still runs top to bottom before the reader has answered.
    """
    if answer is ... or answer is None:
        print(f"Write your prediction in `answer` and run this cell again. (The answer is in {unit}.)")
        return False
    try:
        value = float(answer)
    except (TypeError, ValueError):
        print(f"`answer` should be a number of {unit}, got {answer!r}.")
        return False
    return _verdict(abs(value - expected) <= tol, f"you said {_num(value)}",
                    f"the simulator says {_num(expected)} {unit}", why=why, hint=hint)


def _unwritten(fn: Any) -> bool:
    return fn is None or fn is ...


def check_function(fn: Callable | None, reference: Callable, cases: dict[str, tuple], *, why: str,
                   hint: str) -> bool:
    """Run the reader's ``fn`` and ``reference`` on each case (``label -> args``); print a verdict as :func:`check`.

    At the first case where they differ the reader is told which case and what ``fn`` returned; the right value
    only at a second miss.
    """
    if _unwritten(fn):
        print("Write your function in the cell above and run this cell again.")
        return False
    for label, args in cases.items():
        try:
            got = fn(*args)
        except Exception as e:  # the reader's code: say what went wrong, as a miss
            got = f"an error ({type(e).__name__}: {e})"
        if got is None:  # the skeleton as shipped: not an answer yet
            print("Write the body of your function in the cell above (it returned None) and run this cell again.")
            return False
        want = reference(*args)
        if not (isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * max(1.0, abs(want))):
            return _verdict(False, f"on {label} your function returned {got}", f"the simulator says {_num(want)}",
                            why=why, hint=hint)
    return _verdict(True, f"your function agrees with the simulator on all {len(cases)} chains",
                    f"({', '.join(cases)})", why=why, hint=hint)


def tail(chain: Chain, i: int) -> Chain:
    """Stages ``i … L-1`` and the loss of a chain without transients, as a chain of their own."""
    return Chain(fwd_time=chain.fwd_time[i:], bwd_time=chain.bwd_time[i:], x=chain.x[i:], xbar=chain.xbar[i:],
                 meta=chain.meta)


def check_table(D: Callable | None, C: Callable | None, chain: Chain, budget: int, *, hint: str,
                why: str) -> Schedule | None:
    """Compare the reader's ``D(m, i)`` with ``hcv.solve`` at every cell, then rebuild and simulate a schedule from it.

    ``chain`` has integer sizes and no transients; the reference solves each tail ``i … L-1`` exactly (one slot per
    unit). ``C(m, i, l)`` is the reader's table of sub-chains that end before the loss, used to rebuild the
    schedule for ``budget``. Returns the rebuilt schedule when every cell agrees, else None.
    """
    from .core.solver import solve

    if any(chain.fwd_tmp) or any(chain.bwd_tmp) or chain.shared or chain.backward_call:
        raise InvalidChain("check_table's recurrence has no transients, shared tensors or call cost: give it a "
                           "chain with integer x and xbar only, like lesson 4's")
    if _unwritten(D) or _unwritten(C):
        print("Write D and C in the cell above and run this cell again.")
        return None
    top = chain.x[0] + sum(chain.xbar) + 2 * max(chain.x)
    for i in range(chain.length):
        ref = solve(tail(chain, i), max_budget=top, slots=top)
        for m in range(top - chain.x[i]):
            want, got = ref.makespan(m + chain.x[i]), D(m, i)
            if got is None:  # the skeleton as shipped: not an answer yet
                print(f"Write the bodies of D and C in the cell above (D({m}, {i}) returned None) and run this "
                      "cell again.")
                return None
            if got != want:
                _verdict(False, f"your D({m}, {i}) is {_num(got)}", f"hcv.solve says {_num(want)}",
                         why=why, hint=hint)
                return None
    if math.isinf(D(budget - chain.x[0], 0)):
        print(f"Your table agrees with hcv.solve at every cell, but nothing fits {_num(budget)} units: "
              "pass a larger budget to rebuild a schedule.")
        return None
    sched = _rebuild(D, C, chain, budget - chain.x[0])
    trace = simulate(chain, sched)
    _verdict(True, f"your table agrees with hcv.solve at all {chain.length * top} cells",
             f"and the schedule rebuilt from it for {_num(budget)} units, {sched}, simulates to "
             f"{_num(trace.makespan)} time units with a peak of {_num(trace.peak_memory)} units", why=why, hint=hint)
    return sched


def _rebuild(D: Callable, C: Callable, chain: Chain, m: int) -> Schedule:
    """Follow the reader's tables from ``(m, 0)``: at each cell take the option whose time the cell holds."""
    f, x, xbar, L = chain.fwd_time, chain.x, chain.xbar, chain.length
    ops: list[Op] = []

    def ahead(i: int, j: int) -> None:  # Fck i, Fn i+1 … j-1: reach x_j without autograd
        ops.extend([Op("Fck", i)] + [Op("Fn", k) for k in range(i + 1, j)])

    def spine(m: int, i: int) -> None:  # stages i … L-1 and the loss within m
        if i == L:
            ops.append(Op("Loss", L))
            return
        fits = m >= xbar[i] and m >= x[i] + x[i + 1] + xbar[i] + (0 if i == L - 1 else x[L])  # Fall i, then B i
        if fits and D(m, i) == f[i] + chain.bwd_time[i] + D(m - xbar[i], i + 1):
            ops.append(Op("Fall", i))
            spine(m - xbar[i], i + 1)
            ops.append(Op("B", i))
            return
        j = next(j for j in range(i + 1, L + 1) if m >= x[j]
                 and D(m, i) == sum(f[i:j]) + D(m - x[j], j) + C(m - x[L], i, j - 1))
        ahead(i, j)
        spine(m - x[j], j)
        part(m - x[L], i, j - 1)

    def part(m: int, i: int, last: int) -> None:  # stages i … last, ending where δ_{last+1} waits
        fits = m >= x[last + 1] + xbar[i] and m >= x[i] + x[i + 1] + xbar[i]  # Fall i beside δ_{last+1}, then B i
        rest = 0 if i == last else C(m - xbar[i], i + 1, last)
        if fits and C(m, i, last) == f[i] + chain.bwd_time[i] + rest:
            ops.append(Op("Fall", i))
            if i < last:
                part(m - xbar[i], i + 1, last)
            ops.append(Op("B", i))
            return
        j = next(j for j in range(i + 1, last + 1) if m >= x[j]
                 and C(m, i, last) == sum(f[i:j]) + C(m - x[j], j, last) + C(m, i, j - 1))
        ahead(i, j)
        part(m - x[j], j, last)
        part(m, i, j - 1)

    spine(m, 0)
    return Schedule(ops, {"strategy": "your table"})
