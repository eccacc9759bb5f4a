"""Recompute or offload: schedules that mix recomputation with copies to host memory (docs/design.md §9.2).

``solve_offload(chain)`` (``hcv.solve_offload``) returns an :class:`OffloadSolution`: for each budget, the
fastest schedule found among remat-only optima, those optima with ``Off``/``Pre`` pairs added, and remat optima of
chains whose offloaded x̄ are discounted. It is a heuristic judged by the simulator, never slower than remat-only
(NOTE [offload heuristic]). Budgets are answered from a precomputed grid (``grid`` budgets from half the remat-only
least budget to the store-all peak, denser near the least): the answer at ``b`` is the better of the remat-only
optimum at ``b`` and the grid answer at the largest grid budget ``<= b``. Measured: docs/benchmarks.md (Recompute
or offload).
"""

# NOTE [offload heuristic]. The exact problem is NP-hard (Beaumont, Eyraud-Dubois, Shilova 2021); their DP is exact
# only on a coarse time/memory grid and cubic in memory, too slow for a budget slider (100 ms at L = 50). For a
# budget B:
# 1. Candidates are remat-only optima at budgets B' >= B (the remat frontier's breakpoints: the nearest densely,
#    farther ones at geometric distances, a few dozen at most, fastest first): each is faster than the optimum at B
#    but may peak above it. Between the fastest candidate that fits by offload and the next faster one tried, the
#    breakpoints are bisected (fitting gets harder as B' grows, so the best start is usually near that boundary).
# 2. Fit by offload: the excess of each op over B is covered greedily. A value (x̄_{i+1} left by Fall(i), or a
#    checkpoint x_i kept by Fck(i)) idle between two of its uses can go to the host in between: Off(i) right after
#    the first use, Pre(i) as late as the link lets it arrive before the second (copy time bytes / bandwidth, against
#    the simulated compute times). The op with the largest remaining excess is covered first, by the largest value
#    idle across it whose copies hide behind compute (a copy that makes compute wait is a last resort).
# 3. The simulator judges: the fitted schedule is replayed (transfer channels, idle waits, frees at copy completion);
#    while its peak exceeds B the cover is repeated on the replayed trace, a few rounds at most, from the replay's own
#    excess and from when each chosen Off really completed (on a slow link offloads queue behind one another, and a
#    value frees its bytes only when its copy is done).
# 4. Offload-discounted remat (the one step that changes recomputation to make room for transfers): stages are
#    ranked by the compute between the two uses of their x̄_{i+1} (store-all times) per byte, where a copy hides best;
#    for each prefix S of that ranking whose volume is a share (1/4, 1/2, 3/4, 1, 3/2) of what the link moves during
#    one forward, the remat-only DP is solved once, at precompute, on a chain where each x̄_{i+1} of S costs only
#    x_{i+1} (so the DP stores those stages). At a budget, each such solution's breakpoints faster than the best so
#    far get Off(i) for S after the forward that last reads x_{i+1} and Pre(i) as late as lets it arrive before the
#    backward (placed from the last back, one channel); the largest breakpoint whose replay fits is bisected for.
# 5. The answer is the fastest simulated candidate within B, or the remat-only optimum at B when nothing beats it.
# What it cannot do: step 4's discount is all or nothing on a fixed ranking and forgets that a prefetched value is
# back on the device some time before its backward, so near the remat-only least budget its candidates do not fit
# and the answer comes from steps 1-3, which only add transfers to remat-only optima (a segment whose x̄ are all
# needed again within one copy time stays uncoverable). Checked against the exhaustive search of tests/oracles.py
# (docs/design.md §9.2, tests/test_offload.py).

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import HChainError, InfeasibleBudget
from .chain import Chain
from .schedule import Op, Schedule
from .simulate import Trace, simulate
from .solver import Solution, _check_chain, _read_bytes, solve
from .units import format_bytes, format_time

__all__ = ["OffloadSolution", "solve_offload", "fit_by_offload", "default_grid_size", "grid_budgets", "remat_refined"]

_ROUNDS = 4  # cover-and-replay rounds per candidate before giving up on it
_NEAR, _RATIO = 8, 1.25  # remat-only schedules tried per budget: the 8 nearest breakpoints above it, then sparser
_SHARES = (0.25, 0.5, 0.75, 1.0, 1.5)  # volumes of the discounted sets, in what the link moves during one forward


def fit_by_offload(chain: Chain, schedule: Schedule, budget: int) -> Schedule | None:
    """``schedule`` (remat-only) with ``Off``/``Pre`` pairs added so that its simulated peak is at most ``budget``
    bytes, or None when the greedy cover finds none. Needs ``chain.bandwidth``."""
    base = [op for op in schedule.ops if not op.is_transfer]
    trace = simulate(chain, Schedule(tuple(base)))
    if trace.peak_memory <= budget:
        return schedule
    chosen: list[tuple[int, int, Op, Op]] = []  # (off position, pre position, Off op, Pre op) in base indices
    for _ in range(_ROUNDS):
        picks = _cover(chain, base, trace, budget, chosen)
        if picks is None or picks == chosen:
            return None
        chosen = picks
        candidate = _merge(base, chosen, schedule.meta)
        trace = simulate(chain, candidate)
        if trace.peak_memory <= budget:
            return candidate
    return None


def _uses(base: list[Op]) -> dict[tuple[str, int], list[list[int]]]:
    """For each offloadable value, the op indices that use it, one list per lifetime: x̄_{i+1} (key ``xbar``, i) is
    used by its ``Fall(i)``, by forwards and the backward of stage i+1 (they read x_{i+1} inside it) and by ``B(i)``;
    a checkpoint x_i (key ``x``, i), from the ``Fck(i)`` that keeps it, by forwards of stage i and ``B(i)``."""
    live: dict[tuple[str, int], list[int]] = {}
    out: dict[tuple[str, int], list[list[int]]] = {}
    for k, (kind, i) in enumerate(base):
        if kind == "Loss":
            continue
        if ("xbar", i - 1) in live:  # stage i reads x_i inside x̄_i
            live[("xbar", i - 1)].append(k)
        elif kind != "B":
            if ("x", i) in live:
                live[("x", i)].append(k)
            elif kind == "Fck" and i > 0:  # keeps x_i as a checkpoint until B(i)
                live[("x", i)] = [k]
        if kind == "Fall":
            live[("xbar", i)] = [k]
        if kind == "B":
            for key in (("xbar", i), ("x", i)):
                if key in live:
                    uses = live.pop(key)
                    if uses[-1] != k:
                        uses.append(k)
                    out.setdefault(key, []).append(uses)
    return out


def _cover(chain: Chain, base: list[Op], trace: Trace, budget: int,
           chosen: list[tuple[int, int, Op, Op]]) -> list[tuple[int, int, Op, Op]] | None:
    """Greedy cover of the excess of ``trace`` over ``budget`` by Off/Pre pairs (positions in base indices): new
    pairs, or already chosen ones whose Pre moves later. Returns the new list of pairs, or None when some op's excess
    cannot be covered."""
    compute = [e for e in trace.events if not e.is_transfer]  # one per base op, in order
    start = np.array([e.start for e in compute])
    end = np.array([e.end for e in compute])
    excess = np.array([e.mem_peak - budget for e in compute], np.int64)
    bw = chain.bandwidth
    # One entry per gap between two uses of a value: [size, copy time, Off position, next use b, first op covered
    # (starts after the Off can have completed), latest Pre position that still hides the copy, chosen Pre or 0, stage]
    gaps: list[list] = []
    for key, lifetimes in _uses(base).items():
        kind, i = key
        size = chain.xbar[i] if kind == "xbar" else chain.x[i]
        if kind == "xbar" and i == chain.length - 1:
            size -= chain.x[-1]  # the held output stays on the device
        if size <= 0:
            continue
        copy = size / bw
        for uses in lifetimes:
            for a, b in zip(uses, uses[1:]):
                if b - a < 2 or (kind == "x" and base[a].kind == "Fall"):
                    continue  # nothing in between; or x̄_{i+1} is resident too, and Off(i) would move that
                first = max(a + 1, int(np.searchsorted(start, end[a] + copy, side="left")))
                q = b  # Pre before base op q starts when op q - 1 ends: as late as still arrives before b starts
                while q - 1 > a and end[q - 1] + copy > start[b]:
                    q -= 1
                if first < b:
                    gaps.append([size, copy, a + 1, b, first, q, 0, i])
    # actual Off completion times of the chosen pairs in the replayed trace (the channel queues them)
    done: dict[tuple[int, int], float] = {}
    n = 0
    for e in trace.events:
        if not e.is_transfer:
            n += 1
        elif e.op.kind == "Off":
            done[(n, e.op.stage)] = e.end
    for lo, hi, off, _ in chosen:  # pairs from earlier rounds: the same gaps, already chosen
        for g in gaps:
            if g[2] == lo and g[7] == off.stage and g[3] >= hi:
                if (lo, off.stage) in done:
                    g[4] = max(g[4], int(np.searchsorted(start, done[(lo, off.stage)], side="left")))
                g[6] = hi  # the replayed trace's peaks already count it on the host
    while (excess > 0).any():
        k = int(np.argmax(excess))
        best, best_score = None, None
        for g in gaps:
            size, copy, lo, b, first, q_hide, q, i = g
            if not first <= k < b or q > k:
                continue
            if not q and any(h[6] and h[7] == i and h[2] < b and lo < h[6] for h in gaps):
                continue  # one value of a stage on the host at a time
            new_q = max(q_hide, k + 1)
            idle = max(0.0, end[new_q - 1] + copy - start[b])
            score = (idle, -size)
            if best_score is None or score < best_score:
                best, best_score = g, score
        if best is None:
            return None
        new_q = max(best[5], k + 1)
        excess[max(best[4], best[6]):new_q] -= best[0]
        best[6] = new_q
    return [(g[2], g[6], Op("Off", g[7]), Op("Pre", g[7])) for g in gaps if g[6]]


def _merge(base: list[Op], chosen: list[tuple[int, int, Op, Op]], meta: dict) -> Schedule:
    """The base ops with each Off inserted before base op ``lo`` and each Pre before base op ``hi``."""
    inserts: dict[int, list[Op]] = {}
    for lo, hi, off, pre in sorted(chosen, key=lambda c: (c[0], c[1])):
        inserts.setdefault(lo, []).append(off)
        inserts.setdefault(hi, []).append(pre)
    ops: list[Op] = []
    for k, op in enumerate(base):
        extra = inserts.get(k, [])
        ops += [o for o in extra if o.kind == "Pre"] + [o for o in extra if o.kind == "Off"]
        ops.append(op)
    return Schedule(tuple(ops), dict(meta))


# ------------------------------------------------------------------------------------------------------------------
# Offload-discounted remat: recomputation chosen knowing which x̄ will live on the host
# ------------------------------------------------------------------------------------------------------------------
def _discounted(chain: Chain, remat: Any, slots: int) -> list[tuple[tuple[int, ...], Any]]:
    """Remat-only solutions of chains in which the x̄_{i+1} of a set S of stages costs only x_{i+1} (it will sit on
    the host from the next forward to its backward), one per set: S is the prefix, of volume at most
    ``_SHARES`` times what the link moves during one forward, of the stages ranked by the compute between the two
    uses of their x̄ (store-all times) per byte, i.e. where a copy hides best."""
    L, f = chain.length, np.asarray(chain.fwd_time, float)
    tail = np.append(np.cumsum((f + np.asarray(chain.bwd_time, float))[::-1])[::-1], 0.0)
    order = sorted((i for i in range(L - 1) if chain.xbar[i] > 0 and tail[i + 2] > 0),
                   key=lambda i: -tail[i + 2] / chain.xbar[i])
    out: list[tuple[tuple[int, ...], Any]] = []
    for share in _SHARES:
        S, volume = [], 0
        for i in order:
            volume += chain.xbar[i]
            if volume > share * chain.bandwidth * f.sum():
                break
            S.append(i)
        if S and (not out or len(S) > len(out[-1][0])):
            xbar = list(chain.xbar)
            for i in S:
                xbar[i] = chain.x[i + 1]
            light = dataclasses.replace(chain, xbar=tuple(xbar), bandwidth=None)
            out.append((tuple(S), solve(light, remat.max_budget, slots)))
    return out


def _with_offloads(chain: Chain, schedule: Schedule, stages: Sequence[int]) -> Schedule:
    """``schedule`` (remat-only) with x̄_{i+1} of each stage in ``stages`` sent to the host over its longest idle
    stretch: ``Off(i)`` right after the use before it, ``Pre(i)`` as late as lets it arrive in time, the prefetches
    placed from the last one back, each finishing before the next one starts (one channel), by the remat-only
    compute times."""
    base = [op for op in schedule.ops if not op.is_transfer]
    dur = np.array([chain.bwd_time[i] if k == "B" else 0.0 if k == "Loss" else chain.fwd_time[i] for k, i in base])
    end = np.cumsum(dur)
    start = end - dur
    gaps = []
    for (kind, i), lifetimes in _uses(base).items():
        if kind == "xbar" and i in stages and i < chain.length - 1:
            for uses in lifetimes:
                a, b = max(zip(uses, uses[1:]), key=lambda p: start[p[1]] - end[p[0]])
                if b - a >= 2:
                    gaps.append((b, a, i))
    pairs, free = [], math.inf  # free: when the prefetch channel is next needed by a later Pre
    for b, a, i in sorted(gaps, reverse=True):
        latest = min(start[b], free) - chain.xbar[i] / chain.bandwidth
        q = b  # the Pre goes before base op q, so starts when op q - 1 ends
        while q - 1 > a + 1 and end[q - 1] > latest:
            q -= 1
        free = end[q - 1]
        pairs.append((a + 1, q, Op("Off", i), Op("Pre", i)))
    return _merge(base, pairs, schedule.meta)


def _best_discounted(chain: Chain, discounted: list, budget: int, best_t: float) -> tuple[float, Schedule | None]:
    """The fastest schedule within ``budget`` among the discounted solutions' breakpoints with their sets offloaded
    (:func:`_with_offloads`), if faster than ``best_t``: per set, the largest breakpoint that still fits, by
    bisection (a larger budget stores more, which fits less), among those faster than ``best_t``."""
    best = None
    for stages, sol in discounted:
        front = [b for b, t in sol.frontier() if t < best_t * (1 - 1e-12)]
        lo, hi = -1, len(front)  # front[lo] fits once offloaded (-1: none tried yet), front[hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2 if lo >= 0 else 0  # the slowest first: when it does not fit, none is tried
            s = _with_offloads(chain, sol.schedule(front[mid]), stages)
            trace = simulate(chain, s)
            if trace.peak_memory > budget:
                hi = mid
                continue
            lo = mid
            if trace.makespan < best_t:
                best_t, best = trace.makespan, s
    return best_t, best


# ------------------------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------------------------
class OffloadSolution:
    """The fastest schedule found mixing recomputation and offloading, for every budget (docs/design.md §9).

    Attributes: ``chain`` (with its ``bandwidth``), ``remat`` (the remat-only :class:`~hchain_viz.Solution` it builds
    on), ``grid`` (the precomputed budgets, bytes, increasing), ``min_budget`` (least budget with an answer),
    ``max_budget``, ``store_all_peak``. ``makespan(b)`` / ``schedule(b)`` answer any budget from the grid and the
    remat-only table (no solving); ``frontier()`` gives the remat+offload curve beside ``remat.frontier()``.
    """

    def __init__(self, chain: Chain, remat: Any, grid: list[int], answers: list[tuple[float, Schedule] | None]):
        self.chain = chain
        self.remat = remat
        self.max_budget = remat.max_budget
        self.store_all_peak = remat.store_all_peak
        self._grid = np.asarray(grid, np.int64)
        self._answers = answers
        mins = [g for g, a in zip(grid, answers) if a is not None]
        cands = [b for b in (mins[0] if mins else None, remat.min_budget) if b is not None]
        self.min_budget: int | None = min(cands) if cands else None

    @property
    def grid(self) -> list[int]:
        return self._grid.tolist()

    def _grid_answer(self, budget: int) -> tuple[float, Schedule] | None:
        k = int(np.searchsorted(self._grid, budget, side="right")) - 1
        best = None
        for j in range(k, -1, -1):  # the grid answer at g <= budget fits in budget; later grid points are faster
            a = self._answers[j]
            if a is not None:
                best = a
                break
        return best

    def makespan(self, budget: int | str) -> float:
        """Least makespan found (seconds, simulated) within ``budget`` bytes; ``inf`` when nothing fits."""
        b = _read_bytes(budget)
        remat = self.remat.makespan(b)
        a = self._grid_answer(b)
        return min(remat, a[0]) if a is not None else remat

    def schedule(self, budget: int | str) -> Schedule:
        """The fastest schedule found within ``budget`` bytes (remat-only when offloading does not help there).
        Raises :class:`InfeasibleBudget` when none fits."""
        b = _read_bytes(budget)
        a = self._grid_answer(b)
        remat_t = self.remat.makespan(b)
        if a is not None and a[0] < remat_t:
            s = a[1]
            return Schedule(s.ops, {**s.meta, "strategy": "optimal+offload", "budget": b,
                                    "bandwidth": self.chain.bandwidth, "predicted_makespan": a[0]})
        if math.isinf(remat_t):
            least = self.min_budget
            raise InfeasibleBudget(
                f"no schedule found within {b} B ({format_bytes(b)}), even with offloading at "
                f"{format_bytes(self.chain.bandwidth)}/s; the least budget with an answer is "
                f"{least} B ({format_bytes(least or 0)})", min_budget=least, budget=b)
        s = self.remat.schedule(b)
        return Schedule(s.ops, {**s.meta, "strategy": "optimal+offload", "offloads": 0})

    def frontier(self) -> list[tuple[int, float]]:
        """Breakpoints ``(budget, makespan)`` of the remat+offload curve (budgets increasing, makespans strictly
        decreasing), over the grid and the remat-only breakpoints."""
        budgets = sorted(set(self.grid) | {b for b, _ in self.remat.frontier()})
        points, last = [], math.inf
        for b in budgets:
            t = self.makespan(b)
            if t < last * (1 - 1e-12):
                points.append((int(b), float(t)))
                last = t
        return points

    def __repr__(self) -> str:
        rows = []
        for b, t in self.frontier()[:: max(1, len(self.frontier()) // 12)]:
            r = self.remat.makespan(b)
            remat = format_time(r) if r < math.inf else "-"
            rows.append(f"{format_bytes(b):>12}  {format_time(t):>10}  remat-only {remat:>10}")
        return (f"OffloadSolution: {self.chain.length} stages, link {format_bytes(self.chain.bandwidth)}/s each way, "
                f"{len(self._grid)} grid budgets, least {format_bytes(self.min_budget or 0)}\n" + "\n".join(rows))


def default_grid_size(chain: Chain) -> int:
    """Budgets precomputed by default (each costs a few simulated fits, beside the five discounted DPs of step 4;
    ~3–15 s in all at L = 12..64 on 2 busy cores)."""
    return 48


def grid_budgets(remat: Solution, top: int, n: int) -> list[int]:
    """The budgets :func:`solve_offload` precomputes by default on ``remat`` (the remat-only Solution): ``n`` budgets
    up to ``top``, two below the remat-only least budget (offloading may reach them), the rest from it to ``top``,
    denser near it, where recomputation costs most and offloading has the most to win."""
    least = remat.min_budget or top
    u = np.linspace(0.0, 1.0, max(n - 2, 2))
    budgets = [least // 2, (3 * least) // 4] + (least + (top - least) * u ** 1.5).astype(np.int64).tolist()
    return sorted({max(1, int(b)) for b in budgets})


def _candidates(above: list[tuple[float, int]]) -> list[int]:
    """Indices into ``above`` (the remat-only frontier breakpoints above the budget, budgets increasing) to start
    from, fastest first: the nearest ones densely (they need the least offloading), farther ones at geometrically
    growing distances (the k-th nearest for k < 8, then every ~25% farther), and store-all's (offloading alone may
    fit it)."""
    picks, k = list(range(min(_NEAR, len(above)))), float(_NEAR)
    while k < len(above):
        picks.append(int(k))
        k *= _RATIO
    picks.append(len(above) - 1)
    return sorted({i for i in picks if i >= 0}, reverse=True)


def remat_refined(chain: Chain, remat: Any, budget: int, n: int = 16) -> tuple[float, Schedule | None]:
    """The remat-only answer at ``budget``: the DP's makespan, or a faster schedule among the ``n`` nearest larger
    breakpoints that still fits once simulated (the DP rounds sizes up to whole slots). ``(makespan, schedule)``;
    the schedule is None when the DP's own answer is the best."""
    best_t, best = remat.makespan(budget), None
    for b, t in [p for p in remat.frontier() if p[0] > budget][:n]:
        if t < best_t:
            s = remat.schedule(b)
            if simulate(chain, s).peak_memory <= budget:
                best_t, best = t, s
    return best_t, best


def _best_at(chain: Chain, remat: Any, budget: int, discounted: list = ()) -> tuple[float, Schedule] | None:
    """The fastest simulated offload schedule within ``budget`` found from the candidates, if it beats remat-only.

    The sparse candidates (:func:`_candidates`) are tried fastest first; then the breakpoints between the fastest
    one that fitted and the next faster one tried (which did not fit, or fitted slower) are bisected: fitting gets
    harder as the starting budget grows, so the best start is usually near that boundary. Then the discounted
    solutions (``discounted``, from :func:`_discounted`; none: steps 1-3 only) through :func:`_best_discounted`."""
    best_t, best = remat_refined(chain, remat, budget)
    above = [(t, b) for b, t in remat.frontier() if b > budget]  # budgets increasing, makespans decreasing
    tried: dict[int, float] = {}  # index into above -> simulated makespan of its fit (inf: none within budget)

    def attempt(j: int) -> float:
        nonlocal best_t, best
        if j not in tried:
            fitted = fit_by_offload(chain, remat.schedule(above[j][1]), budget)
            tried[j] = math.inf
            if fitted is not None:
                tr = simulate(chain, fitted)
                if tr.peak_memory <= budget:
                    tried[j] = tr.makespan
                    if tr.makespan < best_t:
                        best_t, best = tr.makespan, fitted
        return tried[j]

    for j in _candidates(above):
        if above[j][0] >= best_t * (1 - 1e-12):
            break  # offloading never makes a schedule faster than its remat-only time
        attempt(j)
    good = [j for j, t in tried.items() if t == best_t]
    if good:
        lo = good[0]
        faster = [j for j in tried if j > lo]
        hi = min(faster) if faster else lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if above[mid][0] >= best_t * (1 - 1e-12):
                break
            if attempt(mid) <= best_t:
                lo = mid
            else:
                hi = mid
    t, found = _best_discounted(chain, discounted, budget, best_t)
    if found is not None:
        best_t, best = t, found
    if best is not None and best.n_transfers == 0:  # a remat-only schedule: report its simulated time
        best_t = simulate(chain, best).makespan
    if best is None:
        return None
    return best_t, Schedule(best.ops, {"strategy": "optimal+offload", "solved_budget": int(budget)})


def solve_offload(chain: Chain, max_budget: int | str | None = None, slots: int = 500,
                  grid: int | Sequence[int] | None = None, remat: Solution | None = None) -> OffloadSolution:
    """Solve ``chain`` for recomputation and offloading to host memory, for every budget at once:
    ``hcv.solve_offload(chain.with_bandwidth("pcie5"))`` (the algorithm: the module docstring, docs/design.md §9.2).

    Args:
        max_budget, slots: as for :func:`~hchain_viz.core.solver.solve`, for the remat-only solution it builds on.
        grid: how many budgets to precompute (see :func:`grid_budgets`; each costs a few fits, ~0.1-0.5 s at L = 50;
            default 48), or the budgets themselves (bytes). Besides, up to five remat-only DPs of discounted chains
            are solved (step 4; ~1 s each at L = 64).
        remat: a remat-only Solution of this chain to build on (default: ``solve(chain, max_budget, slots)``).

    Raises:
        HChainError: the chain has no ``bandwidth``, or ``grid`` is neither a count >= 2 nor a list of budgets.
    """
    chain = _check_chain(chain)
    if chain.bandwidth is None:
        raise HChainError("offloading needs the device-host bandwidth: use chain.with_bandwidth('pcie5') (presets: "
                          "pcie4, pcie5, nvlink-c2c) or a number of bytes/s")
    if remat is None:
        remat = solve(chain, max_budget, slots)
    top = min(remat.store_all_peak, remat.max_budget)
    if grid is None:
        grid = default_grid_size(chain)
    if isinstance(grid, (int, np.integer)) and not isinstance(grid, bool) and grid >= 2:
        budgets = grid_budgets(remat, top, int(grid))
    elif isinstance(grid, Sequence) and grid and all(isinstance(b, (int, np.integer)) and b > 0 for b in grid):
        budgets = sorted({int(b) for b in grid})
    else:
        raise HChainError(f"grid must be an integer >= 2 (how many budgets to precompute) or a list of budgets in "
                          f"bytes, got {grid!r}")
    discounted = _discounted(chain, remat, slots)
    answers = [_best_at(chain, remat, b, discounted) for b in budgets]
    return OffloadSolution(chain, remat, budgets, answers)
