"""hchain_viz/bench: the helpers the benchmarks share."""

from __future__ import annotations

from hchain_viz.bench import pareto_efficient


def test_pareto_rule():
    """bench train / models count only checkpoint_sequential's Pareto-efficient segment counts."""
    pts = [(100, 1.0), (100, 1.2), (80, 1.5), (120, 1.1), (80, 1.5), (60, 3.0)]
    assert pareto_efficient(pts) == [True, False, True, False, True, True]
    assert pareto_efficient([]) == []
