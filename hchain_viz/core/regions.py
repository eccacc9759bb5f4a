"""A schedule as nested checkpoint regions, and its memory compiled whole (docs/design.md §5.3). Torch-free.

Owns the planning of the native form: :func:`segment_tree` (a schedule as nested regions, or :class:`NotNative`),
:func:`compiled_schedule` and :func:`compiled_peak` (what ``torch.compile`` runs and how high it peaks, see
NOTE [compiled memory]), :func:`selective_chain` (the chain of the form with selective stages) and
:func:`for_compile` (the fastest schedule whose compiled form fits a budget). Also :func:`stage_count`, the stage
count of a schedule. Running the regions is ``runtime/train/native.py``'s.
"""

# NOTE [compiled memory]. torch.compile(model) does not run every tree as the schedule says (measured op by op on
# the partitioned backward graph, `bench compile --native`); both differences are predicted here:
# - a compiled backward is one graph in which each forward node is recomputed at most once and what it recomputes
#   stays until its last use: nested regions collapse into their top-level regions, each recomputed once storing
#   everything (compiled_tree). Single-level trees run as the schedule says;
# - the parameter gradients are outputs of that one backward graph: each is held from its stage's B until the whole
#   backward ends (eagerly each is added into .grad and freed at once).

from __future__ import annotations

import dataclasses

from ..errors import InvalidSchedule, NotNative
from .chain import Chain
from .schedule import Op, Schedule
from .simulate import Trace, simulate
from .solver import Solution, solve

__all__ = ["Region", "segment_tree", "tree_ops", "compiled_tree", "compiled_schedule", "compiled_peak",
           "selective_chain", "held_peak", "for_compile", "stage_count"]


@dataclasses.dataclass(frozen=True)
class Region:
    """Stages ``start..end`` (inclusive) as one checkpoint region, recomputed by ``body`` (a list of ``int`` stages,
    run plainly, and inner ``Region``\\ s)."""

    start: int
    end: int
    body: tuple


def stage_count(schedule: Schedule) -> int:
    """The number of stages L a schedule is for: the stage of its one ``Loss`` op.

    Raises:
        InvalidSchedule: the schedule has no ``Loss`` op or several, or none of its stages comes before it.
    """
    losses = [op.stage for op in schedule.ops if op.kind == "Loss"]
    if len(losses) != 1:
        raise InvalidSchedule(f"a schedule has exactly one Loss op; this one has {len(losses)} ({schedule!r})")
    if losses[0] < 1:
        raise InvalidSchedule("the schedule has no forward op before its Loss; it is for a chain of no stages")
    return losses[0]


def segment_tree(schedule: Schedule) -> tuple:
    """The schedule as nested regions: a tuple of top-level nodes, each a stage index (a plain call) or a
    :class:`Region`. ``Fall(i) .. B(i)`` is a plain call; ``Fck(i) Fn(i+1) .. Fn(j-1)``, then the ops of ``[j..l]``,
    then those of ``[i..j-1]`` is a region over ``i..j-1`` whose body is that sub-schedule.

    Raises:
        NotNative: the ops are not of that shape (offloading, another recomputation order).
    """
    ops = [(op.kind, op.stage) for op in schedule.ops]
    if any(kind in ("Off", "Pre") for kind, _ in ops):
        raise NotNative("the schedule offloads activations (Off/Pre ops); the native form has no transfers. Run it "
                        "by the executor (hcv.apply(model, schedule) without native=True)")
    L = stage_count(schedule)
    pos = 0

    def expect(kind: str, i: int) -> None:
        nonlocal pos
        if pos >= len(ops) or ops[pos] != (kind, i):
            got = f"{ops[pos][0]}{ops[pos][1]}" if pos < len(ops) else "the end"
            raise NotNative(f"op {pos} is {got} where the segment tree needs {kind}{i}; this schedule is not a tree "
                            f"of nested checkpoint regions (it recomputes in another order). Run it by the executor "
                            f"(hcv.apply(model, schedule) without native=True)", index=pos)
        pos += 1

    def parse(i: int, last: int, top: bool) -> list:
        nonlocal pos
        if i > last:
            if top:
                expect("Loss", L)
            return []
        kind = ops[pos][0] if pos < len(ops) and ops[pos][1] == i else None
        if kind == "Fall":
            pos += 1
            rest = parse(i + 1, last, top)
            expect("B", i)
            return [i, *rest]
        expect("Fck", i)
        j = i + 1
        while j <= last and pos < len(ops) and ops[pos] == ("Fn", j):
            pos += 1
            j += 1
        rest = parse(j, last, top)
        body = parse(i, j - 1, False)
        return [Region(i, j - 1, tuple(body)), *rest]

    tree = tuple(parse(0, L - 1, True))
    if pos != len(ops):
        raise NotNative(f"ops after position {pos} ({ops[pos][0]}{ops[pos][1]}) are not part of the segment tree")
    return tree


def tree_ops(tree: tuple, L: int) -> list[tuple[str, int]]:
    """The ops a segment tree runs (the inverse of :func:`segment_tree`)."""

    def ops(nodes: tuple, top: bool) -> list[tuple[str, int]]:
        if not nodes:
            return [("Loss", L)] if top else []
        node, rest = nodes[0], nodes[1:]
        if isinstance(node, int):
            return [("Fall", node), *ops(rest, top), ("B", node)]
        return ([("Fck", node.start)] + [("Fn", k) for k in range(node.start + 1, node.end + 1)] + ops(rest, top)
                + ops(node.body, False))

    return ops(tree, True)


def compiled_tree(tree: tuple) -> tuple:
    """What ``torch.compile`` runs for a segment tree: each top-level region recomputed once, storing everything
    (see NOTE [compiled memory])."""
    return tuple(n if isinstance(n, int) else Region(n.start, n.end, tuple(range(n.start, n.end + 1))) for n in tree)


def compiled_schedule(schedule: Schedule) -> Schedule:
    """The schedule ``torch.compile`` runs for ``schedule`` in the native form (itself when it is single-level)."""
    tree = segment_tree(schedule)
    flat = compiled_tree(tree)
    if flat == tree:
        return schedule
    return Schedule(tuple(Op(kind, i) for kind, i in tree_ops(flat, stage_count(schedule))),
                    meta={**schedule.meta, "compiled_form_of": schedule.meta.get("strategy", "schedule")})


def compiled_peak(chain: Chain, schedule: Schedule, grads: list[int], selective: Chain | None = None) -> int:
    """Predicted peak of ``schedule`` in the native form compiled whole: the simulator's peak of
    :func:`compiled_schedule`, each stage's parameter gradients (``grads``: bytes per stage, the runtime's
    ``grad_bytes``) held from its ``B`` to the end of the step. ``selective``: the profile of the form with selective
    stages (:func:`selective_chain`)."""
    form = compiled_schedule(schedule)
    return held_peak(simulate(selective_chain(chain, selective, form), form), grads)


def selective_chain(plain: Chain, selective: Chain | None, schedule: Schedule) -> Chain:
    """The chain ``schedule`` runs in the native form with selective stages: a stage outside every checkpoint region
    (forwarded once, by ``Fall``) has ``selective``'s times and sizes, a stage inside one ``plain``'s (its stages run
    plain). ``selective``: the same model profiled with ``profile(..., selective=True)``; None (the plain form):
    ``plain`` itself.

    Raises:
        InvalidSchedule: ``selective`` is not a selective profile of ``plain``'s stages.
    """
    if selective is None:
        return plain
    if selective.names != plain.names or not (selective.meta or {}).get("selective"):
        raise InvalidSchedule("selective= takes the same model's chain profiled with profile(..., compile=True, "
                              "selective=True)")
    in_region = {op.stage for op in schedule.ops if op.kind in ("Fck", "Fn")}
    mix = lambda ours, theirs: [p if i in in_region else q for i, (p, q) in enumerate(zip(ours, theirs))]  # noqa: E731
    return dataclasses.replace(plain, fwd_time=mix(plain.fwd_time, selective.fwd_time),
                               bwd_time=mix(plain.bwd_time, selective.bwd_time), xbar=mix(plain.xbar, selective.xbar),
                               fwd_tmp=mix(plain.fwd_tmp, selective.fwd_tmp),
                               bwd_tmp=mix(plain.bwd_tmp, selective.bwd_tmp))


def held_peak(trace: Trace, grads: list[int]) -> int:
    """The peak of a trace (of a compiled form) with each stage's parameter gradients held from its ``B`` on."""
    held = peak = 0
    for e in trace.events:
        peak = max(peak, e.mem_peak + held)
        if e.op.kind == "B":
            held += grads[e.op.stage]
    return peak


def for_compile(solution: Solution, budget: int, grads: list[int], selective: Chain | None = None) -> Schedule:
    """The fastest single-level schedule whose compiled native form fits ``budget`` (:func:`compiled_peak`).

    Candidates, each checked by the simulator: the single-level optimum (``solve(chain, single_level=True)`` at
    ``solution``'s resolution; ``solution`` itself when single-level) at budgets from ``budget`` down to its least,
    and the compiled forms of ``solution``'s own schedules there.

    Args:
        solution: a :class:`~hchain_viz.Solution` of the plain chain.
        grads: bytes of parameter gradients per stage, held to the end of the backward (the runtime's ``grad_bytes``).
        selective: this model's chain profiled with ``selective=True``: its single-level optimum is a source of
            candidates too, and every candidate is judged on :func:`selective_chain`.

    Raises:
        InvalidSchedule: no candidate fits.
    """
    chain = solution.chain
    one = solution if solution.single_level else solve(chain, solution.max_budget, solution.slots, single_level=True)
    sources = {id(one): one, id(solution): solution}
    if selective is not None:
        sel = solve(selective, solution.max_budget, solution.slots, single_level=True)
        sources[id(sel)] = sel
    best, seen = None, set()
    for source in sources.values():
        lo = source.min_budget
        if lo is None or lo > budget:
            continue
        for k in range(33):  # budgets from `budget` down to the least: the table's schedules there, in compiled form
            b = budget - (budget - lo) * k // 32
            try:
                s = compiled_schedule(source.schedule(b))
            except NotNative:  # a baseline that is no tree (never the DP's own schedules)
                continue
            if s.ops in seen:
                continue
            seen.add(s.ops)
            # s is its own compiled form: one replay gives both the peak and the time
            trace = simulate(selective_chain(chain, selective, s), s)
            if held_peak(trace, grads) <= budget and (best is None or trace.makespan < best[0]):
                best = (trace.makespan, s)
    if best is None:
        raise InvalidSchedule(f"no schedule of this chain fits {budget} bytes when compiled whole (the parameter "
                              f"gradients alone are {sum(grads)} bytes until the backward ends); raise the budget or "
                              f"run the schedule by the executor")
    return Schedule(best[1].ops, meta={**best[1].meta, "strategy": "for_compile", "budget": budget})
