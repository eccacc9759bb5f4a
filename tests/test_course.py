"""hchain_viz.course: teaching chains in abstract units, and the exercise checks (hint first, answer second)."""

from __future__ import annotations

import math
from functools import lru_cache

import pytest

import hchain_viz as hcv
from hchain_viz import course
from hchain_viz.core import strategies

LESSON4 = course.abstract(hcv.Chain(fwd_time=[2, 5, 1, 3, 1, 2], bwd_time=[4, 10, 2, 6, 2, 4],
                                    x=[1, 3, 2, 6, 1, 2, 2], xbar=[6, 5, 9, 4, 5, 4]))


def test_right_answer_says_right_and_why(capsys):
    assert course.check(18, 18, why="because", hint="h-right") is True
    out = capsys.readouterr().out
    assert out.startswith("Right: you said 18, the simulator says 18 units") and "Why: because" in out
    assert course.check(17.5, 18, why="w", hint="h-tol", tol=0.5) is True


def test_first_wrong_answer_gets_a_hint_and_the_second_the_answer(capsys):
    assert course.check(17, 18, why="because", hint="look at B1") is False
    first = capsys.readouterr().out
    assert first.startswith("Not quite: you said 17") and "Hint: look at B1" in first
    assert "18" not in first and "because" not in first  # the answer and its reason are not told yet
    assert course.check(16, 18, why="because", hint="look at B1") is False
    second = capsys.readouterr().out
    assert "the simulator says 18 units" in second and "Why: because" in second
    assert course.check(18, 18, why="because", hint="look at B1") is True
    assert capsys.readouterr().out.startswith("Right")


def test_check_before_an_answer_reminds_instead_of_judging(capsys):
    assert course.check(..., 18, why="w", hint="h-remind") is False
    assert "Write your prediction" in capsys.readouterr().out
    assert course.check("eighteen", 18, why="w", hint="h-remind") is False
    assert "should be a number" in capsys.readouterr().out


def test_abstract_chains_print_units():
    chain = course.abstract(hcv.Chain.homogeneous(3))
    assert course.is_abstract(chain) and not course.is_abstract(hcv.Chain.homogeneous(3))
    assert chain.x == hcv.Chain.homogeneous(3).x  # the numbers are unchanged
    assert course.mem(12) == "12 units" and course.time(56.0) == "56 time units"


def _peak(chain):
    return hcv.simulate(chain, strategies.store_all(chain)).peak_memory


def test_check_function_names_the_first_chain_it_gets_wrong_without_the_value(capsys):
    cases = {"a": (LESSON4,), "b": (hcv.Chain.random(5, seed=1),)}
    assert course.check_function(None, _peak, cases, why="w", hint="h-fn") is False
    assert "Write your function" in capsys.readouterr().out
    assert course.check_function(lambda c: 0, _peak, cases, why="w", hint="h-fn") is False
    out = capsys.readouterr().out
    assert "on a your function returned 0" in out and str(_peak(LESSON4)) not in out
    assert course.check_function(_peak, _peak, cases, why="w", hint="h-fn") is True
    assert capsys.readouterr().out.startswith("Right: your function agrees with the simulator on all 2 chains")


def _tables(chain, careless=False):
    """The recurrence of lesson 4, as a reader writes it (``careless``: forgets what B needs)."""
    f, b, x, xb, L = chain.fwd_time, chain.bwd_time, chain.x, chain.xbar, chain.length

    @lru_cache(None)
    def C(m, i, l):  # noqa: E741
        if m < x[l + 1] + max([x[i + 1]] + [x[k] + x[k + 1] for k in range(i + 1, l)]):
            return math.inf
        best = math.inf
        if m >= x[l + 1] + xb[i] and (careless or m >= x[i] + x[i + 1] + xb[i]):
            best = f[i] + b[i] + (0 if i == l else C(m - xb[i], i + 1, l))
        for j in range(i + 1, l + 1):
            if m >= x[j]:
                best = min(best, sum(f[i:j]) + C(m - x[j], j, l) + C(m, i, j - 1))
        return best

    @lru_cache(None)
    def D(m, i):
        if i == L:
            return 0 if m >= x[L] else math.inf
        if m < max([x[i + 1]] + [x[k] + x[k + 1] for k in range(i + 1, L)]):
            return math.inf
        best = math.inf
        if m >= xb[i] and m >= x[i] + x[i + 1] + xb[i] + (0 if i == L - 1 else x[L]):
            best = f[i] + b[i] + D(m - xb[i], i + 1)
        for j in range(i + 1, L + 1):
            if m >= x[j]:
                best = min(best, sum(f[i:j]) + D(m - x[j], j) + C(m - x[L], i, j - 1))
        return best

    return D, C


@pytest.mark.parametrize("budget", [22, 25, 31])
def test_check_table_agrees_cell_by_cell_and_rebuilds_a_schedule_that_simulates_to_the_optimum(budget, capsys):
    D, C = _tables(LESSON4)
    sched = course.check_table(D, C, LESSON4, budget, why="w", hint="h-table")
    assert capsys.readouterr().out.startswith("Right: your table agrees with hcv.solve at all")
    trace = hcv.simulate(LESSON4, sched)  # the rebuilt schedule is the solver's time, within the budget
    exact = hcv.solve(LESSON4, max_budget=40, slots=40)
    assert trace.makespan == exact.makespan(budget) and trace.peak_memory <= budget


def test_check_table_finds_a_wrong_cell_and_tells_its_value_only_at_the_second_miss(capsys):
    D, C = _tables(LESSON4, careless=True)
    assert course.check_table(D, C, LESSON4, 31, why="w", hint="h-careless") is None
    first = capsys.readouterr().out
    assert first.startswith("Not quite: your D(") and "hcv.solve says" not in first and "Hint: h-careless" in first
    assert course.check_table(D, C, LESSON4, 31, why="w", hint="h-careless") is None
    assert "hcv.solve says" in capsys.readouterr().out
    with pytest.raises(hcv.HChainError, match="no transients"):
        course.check_table(D, C, hcv.Chain.random(4, seed=0), 31, why="w", hint="h")
