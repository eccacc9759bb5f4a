"""The chains shipped in ``hchain_viz/data`` (real models profiled once; lesson 8 and the explorer guide use them):
they load without torch, replay ``checkpoint_sequential`` over the model's children, and the optimum is never
slower than that at its peak. ``tests/test_torchvision.py`` checks them against a fresh profile."""

from __future__ import annotations

import pytest

import hchain_viz as hcv
from hchain_viz import examples
from hchain_viz.core import strategies


@pytest.mark.parametrize("name", examples.NAMES)
def test_an_example_loads_and_its_checkpoint_sequential_replays(name):
    chain = examples.load(name)
    assert chain.length >= 20 and "torchvision densenet121" in chain.meta["source"]
    counts = examples.segment_counts(chain)
    assert counts == list(range(1, len(chain.meta["checkpoint_sequential"]["children"]) + 1))
    solution = hcv.solve(chain)
    peaks = set()
    for n in counts:
        schedule = examples.checkpoint_sequential(chain, n)
        assert schedule.meta == {"strategy": "checkpoint_sequential", "segments": n}
        trace = hcv.simulate(chain, schedule)
        peaks.add(trace.peak_memory)
        assert (trace.n_recomputed == 0) == (n == 1)  # one segment is store-all; more recompute
        # the optimum at the baseline's own simulated peak is never slower (issue 24's rule)
        assert solution.makespan(trace.peak_memory) <= trace.makespan * (1 + 1e-9), n
    assert len(peaks) > 3  # the counts differ in memory


def test_the_sublayer_chain_cuts_inside_the_dense_blocks():
    module, sub = examples.load("densenet121-module"), examples.load("densenet121-sublayer")
    assert "features.denseblock1" in module.names
    assert "denseblock1.denselayer6.conv1" in sub.names and sub.length > 5 * module.length
    # the maps of a dense block are shared: the block input and each layer's new channels, held once
    block = next(g for g in sub.groups if g[0] == "denseblock1")
    inside = [s for s in sub.shared if block[1] <= s[0] and s[1] <= block[2]]
    assert len(inside) == 6
    assert hcv.solve(sub).min_budget * 2 < hcv.solve(module).min_budget


def test_segments_replays_checkpoint_sequential_from_any_starts_and_refuses_bad_ones():
    chain = hcv.Chain.random(10, seed=3)
    assert strategies.segments(chain, [0, 5]).ops == strategies.periodic(chain, 2).ops
    assert strategies.segments(chain, (0,)).ops == strategies.store_all(chain).ops
    for bad in ([], [1, 5], [0, 5, 5], [0, 10], [0, 2.0]):
        with pytest.raises(hcv.HChainError, match="segment starts"):
            strategies.segments(chain, bad)


def test_bad_names_and_chains_without_recorded_segments_say_what_to_do():
    with pytest.raises(hcv.HChainError, match="densenet121-sublayer"):
        examples.load("resnet50")
    with pytest.raises(hcv.HChainError, match="segments must be one of"):
        examples.checkpoint_sequential(examples.load("densenet121-module"), 99)
    with pytest.raises(hcv.HChainError, match="does not record"):
        examples.checkpoint_sequential(hcv.Chain.random(5, seed=0), 2)
