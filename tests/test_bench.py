"""hchain_viz/bench: the helpers the benchmarks share."""

from __future__ import annotations

import pytest

from hchain_viz.bench import pareto_efficient


def test_pareto_rule():
    """bench train / models count only checkpoint_sequential's Pareto-efficient segment counts."""
    pts = [(100, 1.0), (100, 1.2), (80, 1.5), (120, 1.1), (80, 1.5), (60, 3.0)]
    assert pareto_efficient(pts) == [True, False, True, False, True, True]
    assert pareto_efficient([]) == []


# ---------------------------------------------------------------------------------------------- bench offload
def test_llama_chain_from_analytic_counts():
    """bench offload's LLaMA-7B-like chain: sizes from the formulas of its docstring, times from the profiler's
    roofline (compute-bound at this width), labelled as an estimate."""
    from hchain_viz.bench.offload import llama_chain
    from hchain_viz.runtime.roofline import COMPUTE_EFFICIENCY, GPUS

    c = llama_chain(layers=2)
    T, d, f = 4096, 4096, 11008
    a, m = 2 * T * d, 2 * T * f
    assert c.length == 4 and c.x == (a,) * 5 and [g[1:] for g in c.groups] == [(0, 1), (2, 3)]
    assert c.xbar[0] == a + 5 * a + 4 * T + 32 * 4096 * 4 and c.xbar[1] == 2 * a + 4 * m + 4 * T
    rate = GPUS["H100"].tensor16 * COMPUTE_EFFICIENCY
    assert c.fwd_time[1] == 6 * T * d * f / rate and c.bwd_time[1] == 2 * c.fwd_time[1]
    assert c.fwd_time[0] == (8 * T * d * d + 2 * 4096 * 4096 * d) / rate
    assert "estimate" in c.meta["times"]
    rate = sum(llama_chain().xbar) / llama_chain().store_all_time
    assert 50 * 2**30 < rate < 80 * 2**30  # activations at about the rate of a PCIe 5.0 link


# ---------------------------------------------------------------------------------------------- bench transformers
def test_transformers_bench_runs_on_a_tiny_nanogpt(capsys):
    """The table has a row per granularity with every column filled, the simulated headroom beside the measured
    gains, and no schedule measured above its prediction."""
    import pytest

    pytest.importorskip("torch")
    from hchain_viz.__main__ import main

    main(["bench", "transformers", "--models", "nanogpt", "--layers", "2", "--hidden", "32", "--seq", "16",
          "--batch", "2", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "simulated: ckpt_seq / per-layer / selective" in out and "measured above predicted" not in out
    table = out[out.rindex("model "):].splitlines()
    rows = [line.split() for line in table[1:] if line.strip()]
    assert [r[:2] for r in rows] == [["nanogpt", "module"], ["nanogpt", "sublayer"]]
    # the last column: simulated gains over ckpt_seq / per-layer / selective / Megatron block+uniform; selective needs
    # sub-layer stages
    assert rows[0][-3] == "n/a" and rows[1][-3].endswith("%")
    assert "vs Megatron block/uniform" in out and all(r[-1].endswith("%") for r in rows)


def test_demo_rows_never_show_optimal_behind_a_baseline():
    """The demo's headline is the gain over the best baseline that fits, at equal memory; no row contradicts it."""
    import hchain_viz as hcv
    from hchain_viz import __main__ as cli

    for seed in range(4):
        chain = hcv.Chain.random(10, seed=seed)
        rows, _, gains = cli._demo_comparison(chain, hcv.solve(chain, slots=120))
        assert len(gains) == 3 and min(gains) >= 0
        for row in rows:
            pct = [float(c.rsplit("(", 1)[1].rstrip("%)")) for c in row[2:] if "(" in c]
            assert pct and min(pct) >= 0, row


def test_honest_measures_on_a_model_transformer():
    """bench transformers --honest: the optimum never behind the best framework baseline that fits on the grid, and
    the measures agree with their definitions on a chain whose answers are known (the same chain twice: sub-layer vs
    module is 0, least budgets 1x)."""
    import hchain_viz as hcv
    from hchain_viz.core.solver import least_budget
    from hchain_viz.core.strategies import frontier_points

    pytest.importorskip("torch")
    from hchain_viz.bench.transformers import FRAMEWORK, honest_measures

    chain = hcv.Chain.transformer(4)
    m = honest_measures(chain, chain, grid=20)
    assert m["grid"] == 20 and m["layers"] == 4
    assert m["best_min"] >= 0 and m["best_mean"] >= m["best_min"]
    assert m["module_mean"] == 0 and m["least_ratio"] == 1
    least_fw = min(p for n in FRAMEWORK for p, _ in frontier_points(chain).get(n, []))
    assert m["reach"] == least_budget(chain) / least_fw < 1
    assert m["ckpt_max"] >= m["ckpt_mean"] >= 0 and 0 <= m["hf_share"] <= 1
