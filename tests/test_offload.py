"""Tests of the remat + offload solver (hchain_viz/core/offload.py), judged by the simulator and compared with an
exhaustive search over the extended op set (tests/oracles.py::brute_offload).

- every answer replays in ``simulate`` within its budget, to the reported makespan;
- it is never slower than the remat-only optimum at the same budget, and faster where a fast link has room to work;
- a link slower than the chain makes activations (copies queue): the fit still covers the budget;
- a LLaMA-like slice at PCIe 5.0: offloading removes a fair share of the recomputation overhead;
- on small integer chains, against every remat-only schedule with up to one (L = 3) or two (L = 2) Off/Pre pairs at
  every pair of positions: how often it is optimal and how far off at worst (the numbers in the notes of issue 15);
- errors: no bandwidth, bad grid, infeasible budgets.
"""

from __future__ import annotations

import math

import numpy as np
import oracles
import pytest
from test_solver import random_int_chain

import hchain_viz as hcv
from hchain_viz.core.offload import OffloadSolution, fit_by_offload, solve_offload
from hchain_viz.errors import HChainError, InfeasibleBudget


def gpu_like(L: int, seed: int, bandwidth: float | str = "pcie5") -> hcv.Chain:
    """A random chain with stage times of GPU magnitude (tens of µs for MiB activations)."""
    c = hcv.Chain.random(L, seed=seed)
    return hcv.Chain(fwd_time=[t / 20 for t in c.fwd_time], bwd_time=[t / 20 for t in c.bwd_time], x=c.x,
                     xbar=c.xbar, fwd_tmp=c.fwd_tmp, bwd_tmp=c.bwd_tmp, bandwidth=c.with_bandwidth(bandwidth).bandwidth)


@pytest.mark.parametrize("bandwidth", ["pcie4", "nvlink-c2c"])
def test_answers_simulate_within_budget_and_never_lose_to_remat(bandwidth):
    chain = gpu_like(14, seed=3, bandwidth=bandwidth)
    sol = hcv.solve_offload(chain, grid=12)
    assert isinstance(sol, OffloadSolution)
    budgets = sol.grid + np.linspace(sol.remat.min_budget, sol.store_all_peak, 7).astype(int).tolist()
    wins = 0
    for b in budgets:
        t = sol.makespan(b)
        assert t <= sol.remat.makespan(b)
        if math.isinf(t):
            continue
        s = sol.schedule(b)
        trace = hcv.simulate(chain, s)
        assert trace.peak_memory <= b and math.isclose(trace.makespan, t, rel_tol=1e-12)
        assert s.meta["strategy"] == "optimal+offload"
        wins += t < sol.remat.makespan(b) * (1 - 1e-9)
    assert wins >= 3  # offloading pays somewhere on this chain
    front = sol.frontier()
    assert [b for b, _ in front] == sorted(b for b, _ in front)
    assert all(t1 > t2 for (_, t1), (_, t2) in zip(front, front[1:]))
    assert sol.min_budget <= sol.remat.min_budget
    assert "OffloadSolution" in repr(sol)


def test_infeasible_budget_names_the_least():
    chain = gpu_like(10, seed=1, bandwidth="nvlink-c2c")
    sol = hcv.solve_offload(chain, grid=6)
    assert math.isinf(sol.makespan(sol.min_budget - 1))
    with pytest.raises(InfeasibleBudget) as err:
        sol.schedule(sol.min_budget - 1)
    assert err.value.min_budget == sol.min_budget


def test_a_slow_link_leaves_remat_only():
    chain = gpu_like(8, seed=2, bandwidth=1e3)  # 1 kB/s: every copy would stall the step
    sol = hcv.solve_offload(chain, grid=8)
    for b in sol.grid:  # (it may still beat the table by a slot: a schedule solved for more slots that fits b)
        assert sol.makespan(b) == math.inf or sol.schedule(b).n_transfers == 0


def test_fit_by_offload_by_hand():
    """Store-all of a 4-stage chain peaks at B3 (43 B); offloading x̄_1 brings it to 34 B at no time cost."""
    ch = hcv.Chain(fwd_time=[1.0] * 4, bwd_time=[1.0] * 4, x=[1] * 5, xbar=[10] * 4, bandwidth=100.0)
    s = hcv.strategies.store_all(ch)
    assert fit_by_offload(ch, s, 43) is s
    fitted = fit_by_offload(ch, s, 34)
    trace = hcv.simulate(ch, fitted)
    assert trace.peak_memory <= 34 and trace.makespan == 8.0 and fitted.n_transfers >= 2


def test_fit_by_offload_on_a_queued_link():
    """A link slower than the chain makes activations: the offloads queue, so a value frees its bytes only when its
    copy is done. The first cover assumes each copy starts at once and falls short; the next round must start from
    the replayed peaks and copy completions (not count the chosen pairs twice) and offload more."""
    ch = hcv.Chain(fwd_time=[1.0] * 6, bwd_time=[2.0] * 6, x=[1] * 7, xbar=[10] * 6, bandwidth=5.0)
    s = hcv.strategies.store_all(ch)
    assert hcv.simulate(ch, s).peak_memory == 63
    fitted = fit_by_offload(ch, s, 52)
    assert fitted is not None
    trace = hcv.simulate(ch, fitted)
    assert trace.peak_memory <= 52 and trace.makespan == ch.store_all_time and trace.n_transfers >= 4


def test_more_offload_pays_where_the_link_keeps_up():
    """A LLaMA-like slice (bench offload's chain, 4 layers): at PCIe 5.0 offloading removes a fair share of the
    recomputation overhead at a mid budget, and never loses."""
    from hchain_viz.bench.offload import llama_chain

    chain = llama_chain(layers=4).with_bandwidth("pcie5")
    remat = hcv.solve(chain.with_bandwidth(None))
    b = int(remat.min_budget + 0.3 * (remat.store_all_peak - remat.min_budget))
    sol = solve_offload(chain, grid=[b], remat=remat)
    r, o, base = sol.remat.makespan(b), sol.makespan(b), chain.store_all_time
    assert r > 1.05 * base and o <= r
    assert (r - o) / (r - base) >= 0.2
    trace = hcv.simulate(chain, sol.schedule(b))
    assert trace.peak_memory <= b and math.isclose(trace.makespan, o, rel_tol=1e-12)


def test_discounted_remat_recomputes_less_and_beats_offloading_remat_optima():
    """Offload-discounted remat (core/offload.py, step 4): on a LLaMA-like slice of 8 layers at PCIe 5.0, a remat
    schedule solved on a chain whose early x̄ cost only their output, with those x̄ sent to the host, is faster than
    the best that adding Off/Pre pairs to remat-only optima finds (the candidates without the discounted sets), and
    it recomputes less; checked by the simulator."""
    from hchain_viz.bench.offload import llama_chain
    from hchain_viz.core.offload import _best_at

    chain = llama_chain(layers=8).with_bandwidth("pcie5")
    remat = hcv.solve(chain.with_bandwidth(None))
    b = int(remat.min_budget + 0.4 * (remat.store_all_peak - remat.min_budget))
    old_t, old = _best_at(chain, remat, b)  # no discounted sets: remat-only optima with pairs added
    assert hcv.simulate(chain, old).peak_memory <= b
    sol = solve_offload(chain, grid=[b], remat=remat)
    s, o = sol.schedule(b), sol.makespan(b)
    trace = hcv.simulate(chain, s)
    assert trace.peak_memory <= b and math.isclose(trace.makespan, o, rel_tol=1e-12)
    assert o < 0.99 * old_t
    r, base = remat.makespan(b), chain.store_all_time
    assert (r - o) / (r - base) >= 0.4
    forwards = [sum(op.is_forward for op in x.ops) for x in (s, old)]
    assert forwards[0] < forwards[1] and ("Off", 0) in s.ops


def _compare(seeds, bandwidths=(0.5, 2.0, 8.0)):
    ratios = []
    for seed in seeds:
        base = random_int_chain(seed, max_len=3, zeros=False)
        for bw in bandwidths:
            chain = base.with_bandwidth(bw)
            found = oracles.brute_offload(chain, 2 if chain.length <= 2 else 1)
            budgets = sorted({p for p, _, _ in found})
            sol = hcv.solve_offload(chain, slots=10**9, grid=budgets)
            for b in budgets:
                want = oracles.best_within(found, b)
                got = sol.makespan(b)
                assert got <= sol.remat.makespan(b)
                if not math.isinf(got):
                    assert hcv.simulate(chain, sol.schedule(b)).peak_memory <= b
                if not math.isinf(want):
                    ratios.append(got / want)
    return np.asarray(ratios)


def test_against_exhaustive_search_on_small_chains():
    """Seeds 0, 1 and 4 (4 holds the worst case seen over seeds 0..49, 1.143; over seeds 0..29, 370 of 373 pairs
    optimal, mean ratio 1.0007, as core/offload.py's docstring says): mostly optimal, never more than 15% off the
    best schedule of the exhaustive search."""
    r = _compare((0, 1, 4))
    assert len(r) >= 30
    assert (r <= 1 + 1e-9).mean() >= 0.95
    assert r.max() <= 1.15


def test_errors():
    chain = hcv.Chain.random(5, seed=1)
    with pytest.raises(HChainError, match="with_bandwidth"):
        hcv.solve_offload(chain)
    for bad in (1, "x", [], [0, 5]):
        with pytest.raises(HChainError, match="grid"):
            hcv.solve_offload(chain.with_bandwidth("pcie5"), grid=bad)
