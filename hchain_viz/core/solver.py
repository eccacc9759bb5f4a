"""PLACEHOLDER — being written by the solver helper. The public API it will provide:

solve(chain, max_budget=None, slots=500) -> Solution
optimal_schedule(chain, budget, slots=500) -> Schedule
Solution: .chain, .max_budget, .slots, .unit, .min_budget (bytes), .makespan(budget) (inf if infeasible),
          .schedule(budget) -> Schedule (raises InfeasibleBudget with .min_budget), .frontier() -> list[(budget, makespan)]
"""

from __future__ import annotations


class Solution:  # placeholder
    pass


def solve(chain, max_budget=None, slots=500):  # placeholder
    raise NotImplementedError("solver not written yet")


def optimal_schedule(chain, budget, slots=500):  # placeholder
    raise NotImplementedError("solver not written yet")
