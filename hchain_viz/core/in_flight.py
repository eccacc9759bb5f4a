"""The fastest schedule of one pipeline stage with k microbatches in flight (docs/design.md §12.3).

A pipeline stage with k microbatches in flight needs ``(k - 1) · stored + working`` activation bytes (§12.1): the
other microbatches' stored bytes beside one microbatch's working peak. The fastest schedule for a working budget
(``solve``'s frontier) may store far more than a slower one that needs as little, so the frontier alone misses the
optimum. :class:`InFlight` finds it: what a microbatch stores is what the DP's spine keeps until the loss, so a spine
that must leave at least ``floor`` slots at the loss stores at most ``budget - floor``; one table of such answers
over every (floor, budget) pair, solved once per stage, gives for each k the fastest schedule within each
need ``k · budget - (k - 1) · floor`` (slots; the simulator then gives the exact bytes).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .chain import Chain
from .schedule import Schedule
from .solver import _kernels, _rebuild_ops, _slot_sizes, _Table


def most_memory(chain: Chain) -> int:
    """More than any schedule's peak: every value, saved set and gradient resident at once, with the largest
    temporary. Above the store-all peak a schedule can still be worth its working memory, when it stores less for
    the other microbatches in flight."""
    return (sum(chain.x) + sum(chain.xbar) + sum(chain.delta_bytes)
            + max(max(chain.fwd_tmp, default=0), max(chain.bwd_tmp, default=0)))


class InFlight:
    """Answers for one stage's chain at ``slots`` slots of :func:`most_memory`, for any microbatches in flight.

    ``times[f, b]``: the least time (seconds) of a schedule within ``b`` slots (its input included) whose spine
    leaves at least ``f`` slots at the loss, so that it stores at most ``b - f`` (rows below δ_L's size are that row).
    """

    def __init__(self, chain: Chain, slots: int = 200) -> None:
        self.chain = chain
        self.max_budget = max(most_memory(chain), 1)
        self.slots = min(slots, self.max_budget)
        L, S1 = chain.length, self.slots + 1
        self.sizes = _slot_sizes(chain, self.max_budget, self.slots)
        arr, z = chain.arrays(), self.sizes
        self._args = (z["x"], z["xs"], z["xbar"], z["tr"], z["co"], z["fwd_tmp"], z["nograd_tmp"], z["bwd_tmp"],
                      arr["fwd_time"], arr["bwd_time"], chain.backward_call)
        choice = np.int16 if L < 2**15 - 1 else np.int32
        self._C = np.empty((L * (L + 1) // 2, S1), np.float64)
        self._Cch = np.empty((L * (L + 1) // 2, S1), choice)
        D, Dch = np.empty((L + 1, S1)), np.empty((L + 1, S1), choice)
        _kernels()["fill"](*self._args, self._C, self._Cch, D, Dch, 1)
        self.x0, self.delta_L = int(z["x0"][0]), int(z["x"][L])
        self.times = np.full((S1, S1), math.inf)
        self._schedules: dict[tuple[int, int], Schedule] = {}
        for f in range(min(self.delta_L, S1), S1):
            self.times[f] = self._at_loss(f, D, Dch)

    def _at_loss(self, floor: int, D: np.ndarray, Dch: np.ndarray) -> np.ndarray:
        """Fill the spine (D, Dch) for ``floor`` and return its answers per budget (slots, x_0 included)."""
        _kernels()["spine"](*self._args, self._C, D, Dch, floor)
        out = np.full(D.shape[1], math.inf)
        if self.x0 < D.shape[1]:
            out[self.x0:] = D[0, : D.shape[1] - self.x0] + self.chain.backward_call
        return out

    def frontier(self, k: int) -> list[tuple[int, float, Schedule]]:
        """For ``k`` microbatches in flight, ``(need, time, schedule)`` at each need (bytes, an upper bound: slots
        are charged rounded up) where the fastest schedule changes, need ascending and time descending."""
        f, b = np.nonzero(np.isfinite(self.times))
        need = k * b - (k - 1) * f
        t = self.times[f, b]
        order = np.lexsort((t, need))
        out, best = [], math.inf
        for n in order:
            if t[n] < best * (1 - 1e-12):
                best = t[n]
                out.append((int(need[n]), int(f[n]), int(b[n])))
        unit = self.max_budget / self.slots
        self._rebuild([(fl, bb) for _, fl, bb in out])
        return [(math.ceil(need * unit), float(self.times[fl, bb]), self._schedules[fl, bb]) for need, fl, bb in out]

    def schedule(self, floor: int, budget: int) -> Schedule:
        """The schedule of ``times[floor, budget]`` (which must be finite)."""
        self._rebuild([(floor, budget)])
        return self._schedules[floor, budget]

    def _rebuild(self, pairs: list[tuple[int, int]]) -> None:
        """Rebuild the schedules of the ``(floor, budget)`` pairs not kept yet, the spine filled once per floor (the
        frontiers of several k share their schedules)."""
        L, S1 = self.chain.length, self.slots + 1
        D, Dch = np.empty((L + 1, S1)), np.empty((L + 1, S1), self._Cch.dtype)
        for floor, group in itertools.groupby(sorted({p for p in pairs if p not in self._schedules}), lambda p: p[0]):
            self._at_loss(max(floor, self.delta_L), D, Dch)
            table = _Table(self.max_budget, self.slots, self.sizes, self._Cch, Dch, np.empty(0))
            for _, budget in group:
                self._schedules[floor, budget] = Schedule(_rebuild_ops(table, budget),
                                                          {"strategy": "optimal", "source": "in-flight"})
