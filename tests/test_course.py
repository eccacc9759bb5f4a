"""hchain_viz.course: teaching chains in abstract units, and the exercise check."""

from __future__ import annotations

import hchain_viz as hcv
from hchain_viz import course


def test_check_says_right_or_not_and_why(capsys):
    assert course.check(18, 18, why="because") is True
    out = capsys.readouterr().out
    assert out.startswith("Right: you said 18") and "Why: because" in out
    assert course.check(17, 18, why="because") is False
    assert capsys.readouterr().out.startswith("Not quite: you said 17, the simulator says 18 units")
    assert course.check(17.5, 18, why="w", tol=0.5) is True


def test_check_before_an_answer_reminds_instead_of_judging(capsys):
    assert course.check(..., 18, why="w") is False
    assert "Write your prediction" in capsys.readouterr().out
    assert course.check("eighteen", 18, why="w") is False
    assert "should be a number" in capsys.readouterr().out


def test_abstract_chains_print_units():
    chain = course.abstract(hcv.Chain.homogeneous(3))
    assert course.is_abstract(chain) and not course.is_abstract(hcv.Chain.homogeneous(3))
    assert chain.x == hcv.Chain.homogeneous(3).x  # the numbers are unchanged
    assert course.mem(12) == "12 units" and course.time(56.0) == "56 time units"
