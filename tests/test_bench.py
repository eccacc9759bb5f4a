"""hchain_viz/bench: the helpers the benchmarks share."""

from __future__ import annotations

import pytest

from hchain_viz.bench import pareto_efficient


def test_pareto_rule():
    """bench train / models count only checkpoint_sequential's Pareto-efficient segment counts."""
    pts = [(100, 1.0), (100, 1.2), (80, 1.5), (120, 1.1), (80, 1.5), (60, 3.0)]
    assert pareto_efficient(pts) == [True, False, True, False, True, True]
    assert pareto_efficient([]) == []


def test_grouped_times_run_a_group_back_to_back():
    """bench models --cnn reads each gain from steps run back to back: per round, a group's modules run one after
    the other (in a shuffled order), every module gets one timed step per round after a warm-up round."""
    import torch
    from torch import nn

    from hchain_viz.bench.train import grouped_times
    from hchain_viz.runtime.measure import fresh_copy

    calls = []

    class Tagged(nn.Linear):
        def __init__(self, tag):
            super().__init__(3, 3)
            self.tag = tag

        def forward(self, x):
            calls.append(self.tag)
            return super().forward(x)

    groups = [[Tagged("a0"), Tagged("a1"), Tagged("a2")], [Tagged("b0"), Tagged("b1")], [Tagged("c0")]]
    times = grouped_times(groups, torch.randn(2, 3), lambda out: out.sum(), 4, fresh_copy)
    assert [[len(t) for t in g] for g in times] == [[4, 4, 4], [4, 4], [4]]
    assert all(t > 0 for g in times for m in g for t in m)
    assert len(calls) == 5 * 6
    for r in range(5):
        ran = [c[0] for c in calls[6 * r: 6 * r + 6]]
        assert sorted(ran) == ["a", "a", "a", "b", "b", "c"]
        assert sum(x != y for x, y in zip(ran, ran[1:])) == 2  # three runs of one group each


def test_keep_heap_takes_on_glibc():
    """glibc keeps freed memory for the CNN bench, as a GPU's caching allocator does (no page faults per step)."""
    import platform

    from hchain_viz.bench import keep_heap

    assert keep_heap() is (platform.libc_ver()[0] == "glibc")


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


def test_measured_measures_read_measured_points():
    """bench transformers --honest --measured: the measures come from each schedule's measured peak and median step
    time. Fed the simulator's own numbers for one chain used as both granularities, they must say so: no gain of the
    sub-layer optimum over the module one, equal least budgets, no spread, peaks as predicted."""
    import hchain_viz as hcv
    from hchain_viz.core.simulate import peak_and_makespan
    from hchain_viz.core.solver import least_budget, store_all_peak
    from hchain_viz.core.strategies import store_all

    pytest.importorskip("torch")
    from hchain_viz.bench import optimal_at
    from hchain_viz.bench.transformers import framework_schedules, measured_measures

    chain = hcv.Chain.transformer(4)
    lo, hi = least_budget(chain), store_all_peak(chain)
    optimal = [optimal_at(chain, lo + (hi - lo) * k // 9) for k in range(10)]
    framework = framework_schedules(chain)
    runs = []
    for key, family, s in ([("sub", "optimal", s) for s in optimal] + [("sub", f, s) for f, s in framework]
                           + [("module", "optimal", s) for s in optimal] + [("module", "store_all", store_all(chain))]):
        peak, t = peak_and_makespan(chain, s)
        runs.append((key, family, peak, peak, [t, t, t]))
    m = measured_measures(runs, grid=10)
    assert m["module_mean"] == 0 and m["least_ratio"] == 1 and m["spread_max"] == 0 and m["peak_ratio"] == (1, 1)
    least_fw = min(p for k, f, _, p, _ in runs if k == "sub" and f != "optimal")
    assert m["reach"] == min(p for k, f, _, p, _ in runs if f == "optimal") / least_fw < 1
    assert m["schedules"] == len(runs) and 0 <= m["hf_share"] <= 1 and m["ckpt_max"] >= m["ckpt_mean"]


@pytest.mark.parametrize("starts", [(0,), (0, 7), (0, 4, 9, 13)])
def test_native_checkpoint_sequential_is_charged_one_backward_call(starts):
    """PyTorch's non-reentrant checkpoint_sequential recomputes each segment inside one backward call; the simulator
    charges the executor's call per segment, which the bench's baseline must not pay."""
    from hchain_viz import examples
    from hchain_viz.bench.models import _native_time
    from hchain_viz.core.simulate import simulate
    from hchain_viz.core.strategies import segments

    chain = examples.load("densenet121-module")
    assert chain.backward_call > 0
    schedule = segments(chain, starts)
    executor = simulate(chain, schedule).makespan
    assert executor - _native_time(chain, schedule) == pytest.approx((len(starts) - 1) * chain.backward_call)


# ---------------------------------------------------------------------------------------------- bench pipeline
def _table_rows(out: str, title: str) -> list[list[str]]:
    """The rows (cells split on runs of 2+ spaces) of the table printed under the line starting with ``title``."""
    import re

    lines = out[out.index(title):].splitlines()[1:]
    block = lines[:lines.index("")] if "" in lines else lines
    return [re.split(r"\s{2,}", line.strip()) for line in block]


@pytest.mark.torch
def test_pipeline_bench_measures_a_tiny_gpt2_on_two_ranks(capsys):
    """bench pipeline --model gpt2 on a small setting (2 layers, P = 2, M = 3, 1 round, store-all's limit): a measured
    step time, its noise and each rank's measured peak beside its prediction for the plan and both baselines, and
    the gain split measured. Each rank's peak (GPT-2's tied embedding gradient on rank 0 included) is within
    [0.9, 1.0] of its prediction."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hchain_viz.__main__ import main

    # M > P: at M = P the first rank never holds P microbatches beside its gradients (docs/pipeline.md)
    main(["bench", "pipeline", "--model", "gpt2", "--layers", "2", "--hidden", "32", "--seq", "16", "--microbatches",
          "3", "--rounds", "1", "--fractions", "1", "--measure-p", "2", "--no-analytic"])
    out = capsys.readouterr().out
    assert "GPT2LMHeadModel (2 layers, hidden 32" in out and "analytic" not in out
    head, *rows = _table_rows(out, "P = 2 measured on 2 gloo CPU ranks")
    assert head == ["limit", "plan", "predicted", "measured", "measured/predicted", "noise", "predicted peaks",
                    "measured peaks", "measured/predicted peaks"]
    assert [r[1] for r in rows] == ["optimal", "balanced+uniform", "balanced+per-stage"]
    for r in rows:
        assert len(r) == len(head) and r[3].endswith("s") and float(r[4]) > 0 and r[5] == "±0%"  # one round
        ratios = r[8].split(" | ")
        assert len(ratios) == 2 and all(not v.endswith("!") and 0.9 <= float(v) <= 1.0 for v in ratios), r
    head, *gains = _table_rows(out, "P = 2: the gain split")
    assert head[:3] == ["limit", "per-stage (i)/(ii) predicted", "measured"] and len(gains) == 1
    assert all(v.endswith("x") for v in gains[0][1:]), gains


@pytest.mark.torch
def test_pipeline_bench_runs_interleaved_1f1b(capsys):
    """bench pipeline --schedule interleaved: the plan over v·P chunks beside the 1F1B plan at the same limit,
    measured on two ranks, each rank's peak at most its prediction; P = 4 needs more chunks than the chain has
    layers and says so."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hchain_viz.__main__ import main

    main(["bench", "pipeline", "--model", "gpt2", "--layers", "4", "--hidden", "32", "--seq", "16", "--microbatches",
          "4", "--rounds", "1", "--fractions", "1", "--measure-p", "2", "--no-analytic", "--schedule", "interleaved"])
    out = capsys.readouterr().out
    assert "interleaved 1F1B, v = 2" in out and "P = 4: 8 pipeline stages (4 devices x 2 chunks)" in out
    head, *rows = _table_rows(out, "P = 2 (interleaved, v = 2), M = 4")
    assert head[2:4] == ["plan", "1F1B plan"] and len(rows) == 1
    assert rows[0][8].split(" / ")[0].count("+") == 3  # the plan's split: four chunks
    head, *rows = _table_rows(out, "P = 2 (interleaved, v = 2) measured on 2 gloo CPU ranks")
    assert [r[1] for r in rows] == ["optimal", "balanced+uniform", "balanced+per-stage"]
    for r in rows:
        assert all(not v.endswith("!") and float(v) <= 1.0 for v in r[8].split(" | ")), r
    with pytest.raises(SystemExit):
        main(["bench", "pipeline", "--chunks", "3"])  # --chunks needs --schedule interleaved
