"""Benchmark ``transformers``: transformer chains at module and sub-layer granularity against the baselines that
transformer users run, on the CPU.

    python -m hchain_viz bench transformers [--models nanogpt,gpt2,llama,bert,bart,t5] [--layers 4] [--hidden 128]
                                            [--seq 128] [--batch 4] [--rounds 3] [--threads 0]

What it measures and how: NOTE [what bench transformers measures] below; the runs: docs/benchmarks.md.
"""

# NOTE [what bench transformers measures]
# Models (random weights, train mode): nanoGPT (``hcv.models.nanogpt``, traced by torch.fx) and Hugging Face GPT-2,
# LLaMA and BERT (and, on request, the encoder-decoders BART and T5: ``--layers`` in each stack) built from their
# default configs, shrunk to ``--layers`` layers of width ``--hidden``, with eager attention (the attention
# probabilities are materialised, as in the hand split). Per model and granularity:
#
# - stages, and the extraction wall time (tracing, analysis, the check against the model);
# - measured / predicted peak: the range over every schedule run (measured with ``hchain_viz.measure``, predicted
#   by ``simulate``);
# - the step-rate gain of the optimal schedule at equal **measured** memory (solved at each baseline's measured peak,
#   among other budgets, each solved at its own resolution) over ``checkpoint_sequential`` at layer granularity
#   (``layer_periodic``), averaged over its Pareto-efficient segment counts (``n`` that use as much measured memory
#   as another and are slower are left out), over full per-layer recomputation at its measured peak, and over
#   Megatron's selective recomputation at its measured peak, and over Megatron's full recomputation, block (any k) and
#   uniform (k >= 2), averaged over their Pareto-efficient settings ("n/a" where the optimal schedule has no point at
#   or under that peak). A schedule measured above its prediction is reported on a line of its own.
# - the same three gains in the model alone (predicted peaks, simulated times): the headroom a perfect executor would
#   measure, which says whether a small measured gain comes from the run or from the chain itself. There the optimum
#   at a baseline's peak is never slower than that baseline (the exact DP would find it; at its resolution of 1/20000
#   of the budget it can miss it by a few KiB).
#
# Every strategy is a Schedule run by the same executor (``hcv.wrap``); step times are medians of ``--rounds``
# interleaved rounds (a warm-up round first, shuffled order each round).
#
# ``--honest``: the measures of issue 24, simulated with roofline H100 times (``profile(..., estimate_for="H100")``;
# sizes measured) on GPT-2 and LLaMA at sub-layer and module granularity, ``--layers`` (default 4,8) and ``--seqs``
# (default 256,1024), hidden ``--hidden`` (use 256), over a grid of ``--grid`` (default 24) budgets from the least
# feasible to store-all. Framework baselines: store-all, per-layer (HF on), selective, ``checkpoint_sequential`` over
# layers (any n), Megatron block and uniform (any k). The optimum at each budget is ``hcv.optimal_schedule``'s answer
# for that budget alone. Per row:
#
# - reach: the least feasible budget over the least any framework baseline needs; and at 0.75x of that least, how much
#   slower the optimum is than that least-memory baseline;
# - vs HF: the gain over HF's on/off gradient checkpointing (the faster of store-all and per-layer that fits), mean
#   over the budgets where one fits, and the share of the grid where the gain is >= 15% or only the optimum fits;
# - vs ckpt_seq: mean and max gain over ``checkpoint_sequential`` over layers where it fits;
# - vs best: mean and least gain over the best framework baseline that fits (block/uniform included);
# - sub vs module: the module-granularity optimum over the sub-layer one at equal budget (mean where both fit), each
#   as its overhead over its own chain's store-all time (the roofline sums of a layer's parts and of the whole layer
#   differ: their ratio is printed), and the ratio of their least budgets.
#
# ``--honest --measured``: the same measures from runs instead of the simulator. Every schedule (the sub-layer
# optimum at ``--grid`` budgets from its least to store-all, at each framework baseline's measured peak and at 0.75x
# the least of them; every framework baseline; the module optimum at ``--grid`` budgets of its own range) is run by
# the executor on this CPU with times as profiled (identical layers tied): each point is its measured peak and median
# step time over ``--rounds`` interleaved rounds of all of them together, and the grid runs from the least measured
# peak of the optimum to store-all's. The noise columns: the median and largest spread of a schedule's step times
# (half the range over the median), and measured over predicted peaks.
#
# ``--per-layer-check``: the same per-layer schedule on the module and the sub-layer chain of one model (``--models``,
# first entry; ``--seqs``, first entry): predicted and measured peaks of both (the LLaMA seq-1024 discrepancy).

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import pareto_efficient, positive_int, print_table

DEFAULT = ("nanogpt", "gpt2", "llama", "bert")
ALL = (*DEFAULT, "bart", "t5")  # the encoder-decoders on request
GRANULARITIES = ("module", "sublayer")


def run(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hchain_viz bench transformers", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT), help="comma-separated, from: " + ", ".join(ALL))
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--hidden", type=positive_int, default=128)
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved timing rounds (median taken)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--honest", action="store_true", help="issue 24's measures, simulated (H100 roofline)")
    parser.add_argument("--measured", action="store_true",
                        help="--honest: run every schedule by the executor and measure (CPU times, not H100)")
    parser.add_argument("--per-layer-check", action="store_true", help="one per-layer schedule, both granularities")
    parser.add_argument("--seqs", default="256,1024", help="--honest: comma-separated sequence lengths")
    parser.add_argument("--layer-counts", default="4,8", help="--honest: comma-separated layer counts")
    parser.add_argument("--grid", type=positive_int, default=24, help="--honest: budgets from least to store-all")
    opts = parser.parse_args(args)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.honest:
        return _honest(opts)
    if opts.per_layer_check:
        return _per_layer_check(opts)
    print(f"transformers benchmark: torch {torch.__version__}, cpu, {torch.get_num_threads()} threads, "
          f"{opts.layers} layers of width {opts.hidden}, batch {opts.batch} x {opts.seq} tokens, eager attention; "
          f"step times: median of {opts.rounds} interleaved rounds")
    head = ("model", "granularity", "stages", "extract", "measured/predicted peak", "vs ckpt_seq (Pareto n/all)",
            "vs per-layer", "vs selective", "vs Megatron block/uniform",
            "simulated: ckpt_seq / per-layer / selective / block+uniform")
    rows = []
    for name in (n.strip() for n in opts.models.split(",") if n.strip()):
        if name not in ALL:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(ALL)}")
        for granularity in GRANULARITIES:
            model, x, loss_fn = _build(name, opts)
            rows.append((name, granularity, *_bench(model, x, loss_fn, granularity, opts)))
            print_table(head, rows[-1:], left=2)  # progress: one line per row as it is done
    print()
    print_table(head, rows, left=2)


def _build(name: str, opts: Any) -> tuple[nn.Module, Any, Any]:
    from ..runtime import models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "nanogpt":
            return models.nanogpt(batch=opts.batch, seq=opts.seq, dim=opts.hidden, heads=4, layers=opts.layers)
        return models.hf_model(name, batch=opts.batch, seq=opts.seq, layers=opts.layers, hidden=opts.hidden, heads=4,
                               vocab=256, attn_implementation="eager")


def _bench(model: nn.Module, x: Any, loss_fn: Any, granularity: str, opts: Any) -> tuple:
    from ..core.simulate import simulate
    from ..core.solver import solve
    from ..core.strategies import layer_periodic, megatron_block, megatron_uniform, per_layer, selective
    from ..runtime.graph import extract_stages
    from ..runtime.measure import fresh_copy, measure
    from ..runtime.profile import profile
    from ..runtime.train.wrap import wrap
    from . import optimal_at
    from .train import interleaved_times

    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        stages = extract_stages(model, x, granularity=granularity)
        seconds = time.perf_counter() - start
    chain = profile(stages, x, loss_fn, progress=False)
    sol = solve(chain)
    layers = len(chain.groups)
    units = chain.length - sum(b - a for _, a, b in chain.groups)
    ckpt = [layer_periodic(chain, n) for n in range(1, units + 1)]
    full, sel = per_layer(chain), selective(chain) if "attn_core" in chain.tags else None
    baselines = ckpt + [full] + ([sel] if sel is not None else [])
    k0 = len(baselines)  # then Megatron's full recomputation, block (any k) and uniform (k >= 2; k = 1 is per-layer)
    baselines += [megatron_block(chain, j) for j in range(1, layers)]
    baselines += [megatron_uniform(chain, j) for j in range(2, layers + 1)]
    seq = nn.Sequential(*[m for _, m in stages])  # wrap and checkpoint_sequential take a module
    peak_of = lambda s: measure(wrap(seq, s), x, loss_fn, repeats=1).peak_bytes  # noqa: E731
    base_peaks = [peak_of(s) for s in baselines]
    base_traces = [simulate(chain, s) for s in baselines]
    # The optimal schedule at each baseline's measured peak (the memory it really used, which its prediction bounds)
    # and at its predicted peak, beside five budgets evenly spread from the least to store-all.
    lo, hi = sol.min_budget, sol.store_all_peak
    budgets = {lo + (hi - lo) * k // 4 for k in range(5)}
    budgets |= {b for t, p in zip(base_traces, base_peaks) for b in (p, t.peak_memory) if lo <= b <= hi}
    optimal = [optimal_at(chain, b) for b in sorted(budgets)]
    schedules = baselines + optimal
    modules = [wrap(seq, s) for s in schedules]
    peaks = base_peaks + [peak_of(s) for s in optimal]
    traces = base_traces + [simulate(chain, s) for s in optimal]
    predicted = [t.peak_memory for t in traces]
    ratios = [p / q for p, q in zip(peaks, predicted)]
    for p, q, s in zip(peaks, predicted, schedules):
        if p > q:  # an under-prediction: a schedule the solver says fits would not
            print(f"  measured above predicted: {s.meta.get('strategy')} {p} B measured, {q} B predicted "
                  f"(x{p / q:.5f})")
    times = interleaved_times(modules, x, loss_fn, opts.rounds, fresh_copy)
    for p in model.parameters():
        p.grad = None
    n, k = len(ckpt), k0
    ka = len(baselines)
    pct = lambda g: "n/a" if g is None else f"{100 * g:+.1f}%"  # noqa: E731
    points = list(zip(peaks, times))
    measured = _gains(points[:k] + points[ka:], n, k)
    mega = _mega_gain(points[k:ka], points[ka:])
    # The same gains in the model alone (predicted peaks and simulated times): what a perfect executor would show.
    # The exact optimum at a baseline's predicted peak is never slower than that baseline (a schedule of the class
    # the DP searches); the DP's sizes, rounded up to slots, can miss it by a few KiB, so each baseline also counts
    # as a point of the optimum at its own peak.
    model_points = [(t.peak_memory, t.makespan) for t in traces]
    simulated = _gains(model_points[:k] + model_points[ka:] + model_points[:k], n, k)
    mega_sim = _mega_gain(model_points[k:ka], model_points[ka:] + model_points[k:ka])
    ckpt_all = f" ({measured[1]}; all n: {pct(measured[2])})" if measured[0] is not None else ""
    return (f"{chain.length} ({layers} layers)", f"{seconds:.2f} s", f"{min(ratios):.3f}-{max(ratios):.3f}",
            pct(measured[0]) + ckpt_all, pct(measured[3]), pct(measured[4]), pct(mega),
            " / ".join(pct(g) for g in (simulated[0], simulated[3], simulated[4], mega_sim)))


def _mega_gain(mega: list[tuple[float, float]], opt: list[tuple[float, float]]) -> float | None:
    """Mean gain of the fastest optimal point within each Pareto-efficient Megatron block/uniform point's peak."""
    gains = []
    for (p, t), keep in zip(mega, pareto_efficient(mega)):
        fits = [o_t for o_p, o_t in opt if o_p <= p]
        if keep and fits:
            gains.append(t / min(fits) - 1.0)
    return statistics.mean(gains) if gains else None


def _gains(points: list[tuple[float, float]], n: int, k: int) -> tuple:
    """Step-time gains of the optimal schedules (``points[k:]``, as (peak, time)) over ``checkpoint_sequential``
    (``points[:n]``: the mean over its Pareto-efficient counts, how many those are of how many have a gain, and the
    mean over all), per-layer (``points[n]``) and selective recomputation (``points[n + 1]`` when ``k > n + 1``): each
    baseline against the fastest optimal schedule within its peak; None where none fits."""
    opt = points[k:]

    def gain(peak: float, t: float) -> float | None:
        fits = [o_time for o_peak, o_time in opt if o_peak <= peak]
        return t / min(fits) - 1.0 if fits else None

    ckpt = points[:n]
    gains = [(gain(p, t), keep) for (p, t), keep in zip(ckpt, pareto_efficient(ckpt))]
    kept = [g for g, keep in gains if keep and g is not None]
    every = [g for g, _ in gains if g is not None]
    return (statistics.mean(kept) if kept else None, f"{len(kept)}/{len(every)}",
            statistics.mean(every) if every else None, gain(*points[n]), gain(*points[n + 1]) if k > n + 1 else None)


# ---------------------------------------------------------------------------------------------------- --honest
FRAMEWORK = ("store_all", "per_layer", "selective", "layer_periodic", "megatron_block", "megatron_uniform")
HF = ("store_all", "per_layer")  # Hugging Face gradient checkpointing off / on


def framework_schedules(chain: Any) -> list[tuple[str, Any]]:
    """``(family, schedule)`` for every setting of the :data:`FRAMEWORK` baselines that applies to ``chain``: store-all,
    per-layer, ``checkpoint_sequential`` over layers at every segment count, Megatron block (k = 0..layers) and
    uniform (k = 1..layers), and selective where the chain tags its core attention."""
    from ..core import strategies as S

    families = set(S.applicable(chain))
    out: list[tuple[str, Any]] = [("store_all", S.store_all(chain))]
    if "per_layer" in families:
        n = len(chain.groups)
        units = chain.length - sum(last - first for _, first, last in chain.groups)  # layers, and stages outside
        out.append(("per_layer", S.per_layer(chain)))
        out += [("layer_periodic", S.layer_periodic(chain, k)) for k in range(1, units + 1)]
        out += [("megatron_block", S.megatron_block(chain, k)) for k in range(n + 1)]
        out += [("megatron_uniform", S.megatron_uniform(chain, k)) for k in range(1, n + 1)]
    if "selective" in families:
        out.append(("selective", S.selective(chain)))
    return out


def _chain(name: str, layers: int, seq: int, granularity: str | None, opts: Any, estimate: bool = True):
    """(chain, stages, x, loss_fn) of ``name`` at ``granularity``, times a roofline H100 estimate when ``estimate``."""
    from types import SimpleNamespace

    from ..runtime.graph import extract_stages
    from ..runtime.profile import profile

    model, x, loss_fn = _build(name, SimpleNamespace(batch=opts.batch, seq=seq, hidden=opts.hidden, layers=layers))
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stages = extract_stages(model, x, granularity=granularity)
        chain = profile(stages, x, loss_fn, progress=False, warmup=0, repeats=1,
                        estimate_for="H100" if estimate else None)
    return chain, stages, x, loss_fn


def _best(points: list[tuple[int, float]], b: float) -> float:
    """The least time among ``points`` (peak, time) whose peak fits ``b``; inf where none does."""
    return min((t for p, t in points if p <= b), default=float("inf"))


def _grid_measures(opt: Any, module: Any, framework: dict[str, list[tuple[int, float]]], least: int,
                   least_module: int, top: int, times: tuple[float, float], grid: int) -> dict[str, float]:
    """Issue 24's measures over ``grid`` budgets from ``least`` to ``top``: ``opt(b)`` and ``module(b)`` are the
    sub-layer and module optimum's time within budget b (inf where nothing fits), ``framework`` the (peak, time)
    points of each framework baseline family, ``times`` the store-all time of the sub-layer and the module chain.
    Gains are ``baseline time / optimal time - 1`` at equal budget."""
    pts = lambda names: [p for n in names for p in framework.get(n, [])]  # noqa: E731
    every, hf, ckpt = pts(FRAMEWORK), pts(HF), pts(("layer_periodic",))
    least_fw = min(p for p, _ in every)
    b75 = int(0.75 * least_fw)
    at75 = opt(b75) / _best(every, least_fw) - 1 if b75 >= least else float("nan")
    out: dict[str, list[float]] = {"hf": [], "hf_ok": [], "ckpt": [], "best": [], "module": []}
    for b in (least + (top - least) * k // (grid - 1) for k in range(grid)):
        t = opt(b)
        h = _best(hf, b)
        if h != float("inf"):
            out["hf"].append(h / t - 1)
        out["hf_ok"].append(1.0 if h == float("inf") or h / t - 1 >= 0.15 else 0.0)
        for key, points in (("ckpt", ckpt), ("best", every)):
            f = _best(points, b)
            if f != float("inf"):
                out[key].append(f / t - 1)
        m = module(b)
        if m != float("inf"):  # overheads over each chain's own store-all time (their roofline sums differ)
            out["module"].append((m / times[1]) / (t / times[0]) - 1)
    mean = lambda v: statistics.mean(v) if v else float("nan")  # noqa: E731
    return {"reach": least / least_fw, "at75": at75, "hf_mean": mean(out["hf"]), "hf_share": mean(out["hf_ok"]),
            "ckpt_mean": mean(out["ckpt"]), "ckpt_max": max(out["ckpt"], default=float("nan")),
            "best_mean": mean(out["best"]), "best_min": min(out["best"], default=float("nan")),
            "module_mean": mean(out["module"]), "least_ratio": least_module / least,
            "store_all_ratio": times[1] / times[0], "grid": grid}


def honest_measures(sub: Any, module: Any, grid: int = 24) -> dict[str, float]:
    """Issue 24's measures for one model, simulated: ``sub`` and ``module`` are its chains at sub-layer and module
    granularity (see the module docstring, ``--honest``)."""
    from ..core.solver import least_budget, store_all_peak
    from ..core.strategies import frontier_points

    m = _grid_measures(_optimum(sub), _optimum(module), frontier_points(sub), least_budget(sub), least_budget(module),
                       store_all_peak(sub), (sub.store_all_time, module.store_all_time), grid)
    return {**m, "layers": len(sub.groups)}


def _optimum(chain: Any) -> Callable[[int], float]:
    """The optimum's simulated time within a budget, as the library answers for that budget alone
    (``hcv.optimal_schedule``: solved at the finest resolution that costs about a second, never behind a baseline
    that fits); inf where nothing fits. One table over the whole range instead (4000 slots) rounds sizes up by up to
    a slot each, which cost up to 2 points at low budgets (LLaMA, 8 layers, seq 256, at 0.75x of the least framework
    peak: +8.2% slower against +6.3%)."""
    from ..core.simulate import simulate
    from ..core.solver import optimal_schedule
    from ..errors import InfeasibleBudget

    @functools.cache
    def time_within(budget: int) -> float:
        try:
            return simulate(chain, optimal_schedule(chain, budget)).makespan
        except InfeasibleBudget:
            return float("inf")

    return time_within


def _measured_points(name: str, layers: int, seq: int, opts: Any) -> list[tuple]:
    """Issue 24's schedules run by the executor on the CPU (times as profiled: identical layers tied): the framework
    baselines and the optimum at ``--grid`` budgets of the sub-layer chain (and at each baseline's measured peak and
    0.75x the least of them), the optimum at ``--grid`` budgets of the module chain; measured peaks, then step times
    from ``--rounds`` interleaved rounds of all of them together.
    One row per schedule: (chain key, family or "optimal", predicted peak, measured peak, step-time samples)."""
    from ..core.simulate import peak_and_makespan
    from ..core.solver import solve
    from ..core.strategies import store_all
    from ..runtime.measure import fresh_copy, measure
    from ..runtime.train.wrap import wrap
    from .train import interleaved_times

    runs = []  # (chain key, family or "optimal", schedule, wrapped module, x, loss_fn, measured peak)
    chains = {}
    for key, granularity in (("sub", "sublayer"), ("module", None)):
        chain, stages, x, loss_fn = _chain(name, layers, seq, granularity, opts, estimate=False)
        chains[key] = chain
        seq_module = nn.Sequential(*[m for _, m in stages])

        def run(family: str, s: Any, key: str = key, x: Any = x, loss_fn: Any = loss_fn,
                seq_module: nn.Module = seq_module) -> int:
            m = wrap(seq_module, s)
            peak = measure(m, x, loss_fn, repeats=1).peak_bytes
            runs.append((key, family, s, m, x, loss_fn, peak))
            return peak

        sol = solve(chain, slots=20000)  # one table for the whole grid: a slot is 1/20000 of store-all's peak
        lo, hi = sol.min_budget, sol.store_all_peak
        budgets = {lo + (hi - lo) * k // (opts.grid - 1) for k in range(opts.grid)}
        if key == "sub":
            # The optimum also at each baseline's measured peak and at 0.75x the least of them (its prediction
            # bounds its measured peak, so it fits there): the grid alone is coarse at low budgets.
            peaks = [run(family, s) for family, s in framework_schedules(chain)]
            budgets |= {b for b in (*peaks, int(0.75 * min(peaks))) if lo <= b}
        else:  # the module chain's store-all time: its overheads are taken over it
            run("store_all", store_all(chain))
        for b in sorted(budgets):
            run("optimal", sol.schedule(b))
    samples = interleaved_times([r[3] for r in runs], runs[0][4], runs[0][5], opts.rounds, fresh_copy,
                                 samples=True)
    return [(k, f, peak_and_makespan(chains[k], s)[0], p, sam) for (k, f, s, *_, p), sam in zip(runs, samples)]


def measured_measures(runs: list[tuple], grid: int = 24) -> dict[str, float]:
    """Issue 24's measures from measured runs (rows of ``_measured_points``), each point its measured peak and median
    step time; plus the noise (the median and the largest spread, half the range over the median, of a schedule's
    step times) and the range of measured over predicted peaks."""
    def points(key: str, family: str) -> list[tuple[int, float]]:
        return [(p, statistics.median(t)) for k, f, _, p, t in runs if k == key and f == family]

    sub_opt, mod_opt = points("sub", "optimal"), points("module", "optimal")
    framework: dict[str, list[tuple[int, float]]] = {}
    for k, f, _, p, t in runs:
        if k == "sub" and f != "optimal":
            framework.setdefault(f, []).append((p, statistics.median(t)))
    store = (min(t for _, t in points("sub", "store_all")), min(t for _, t in points("module", "store_all")))
    m = _grid_measures(lambda b: _best(sub_opt, b), lambda b: _best(mod_opt, b), framework,
                       min(p for p, _ in sub_opt), min(p for p, _ in mod_opt), max(p for p, _ in sub_opt), store, grid)
    spreads = [(max(t) - min(t)) / (2 * statistics.median(t)) for *_, t in runs]
    ratios = [p / q for _, _, q, p, _ in runs]
    return {**m, "spread_median": statistics.median(spreads), "spread_max": max(spreads), "schedules": len(runs),
            "peak_ratio": (min(ratios), max(ratios))}


def _honest(opts: Any) -> None:
    names = [n.strip() for n in opts.models.split(",") if n.strip()]
    names = [n for n in names if n in ("gpt2", "llama")] or ["gpt2", "llama"]
    if opts.measured:
        print(f"Issue 24's measures, measured (executor on this CPU, {torch.get_num_threads()} threads; times as "
              f"profiled, identical layers tied): hidden {opts.hidden}, batch {opts.batch}, {opts.grid} budgets from "
              f"the least measured peak to store-all's; step times: median of {opts.rounds} interleaved rounds")
    else:
        print(f"Issue 24's measures, simulated (roofline H100 times, sizes measured on the CPU): hidden {opts.hidden}, "
              f"batch {opts.batch}, {opts.grid} budgets from the least feasible to store-all; gains are "
              f"baseline time / optimal time - 1 at equal budget")
    head = ("model", "layers", "seq", "reach", "@0.75x", "vs HF mean", ">=15% share", "vs ckpt_seq mean/max",
            "vs best mean/min", "sub vs module", "least module/sub", "store-all module/sub")
    if opts.measured:
        head += ("schedules", "spread median/max", "measured/predicted peak")
    rows = []
    for name in names:
        for layers in (int(v) for v in opts.layer_counts.split(",")):
            for seq in (int(v) for v in opts.seqs.split(",")):
                if opts.measured:
                    m = measured_measures(_measured_points(name, layers, seq, opts), opts.grid)
                else:
                    m = honest_measures(_chain(name, layers, seq, "sublayer", opts)[0],
                                        _chain(name, layers, seq, None, opts)[0], opts.grid)
                p = lambda v: "n/a" if math.isnan(v) else f"{100 * v:+.1f}%"  # noqa: E731
                row = (name, str(layers), str(seq), f"{m['reach']:.2f}x", p(m["at75"]), p(m["hf_mean"]),
                       f"{100 * m['hf_share']:.0f}%", f"{p(m['ckpt_mean'])} / {p(m['ckpt_max'])}",
                       f"{p(m['best_mean'])} / {p(m['best_min'])}", p(m["module_mean"]),
                       f"{m['least_ratio']:.2f}x", f"{m['store_all_ratio']:.3f}")
                if opts.measured:
                    row += (str(m["schedules"]), f"±{100 * m['spread_median']:.0f}% / ±{100 * m['spread_max']:.0f}%",
                            "{:.3f}-{:.3f}".format(*m["peak_ratio"]))
                rows.append(row)
                print_table(head, rows[-1:], left=2)
    print()
    print_table(head, rows, left=2)


def _per_layer_check(opts: Any) -> None:
    """The per-layer schedule on the module and the sub-layer chain of one model: predicted and measured peaks."""
    from ..core.simulate import simulate
    from ..core.strategies import per_layer, store_all
    from ..core.units import format_bytes
    from ..runtime.measure import measure
    from ..runtime.train.wrap import wrap

    name = opts.models.split(",")[0].strip()
    layers = int(opts.layer_counts.split(",")[0])
    seq = int(opts.seqs.split(",")[0])
    rows = []
    for granularity in ("module", "sublayer"):
        chain, stages, x, loss_fn = _chain(name, layers, seq, None if granularity == "module" else granularity,
                                           opts, estimate=False)
        seq_model = nn.Sequential(*[m for _, m in stages])
        for label, s in (("per_layer", per_layer(chain)), ("store_all", store_all(chain))):
            tr = simulate(chain, s)
            got = measure(wrap(seq_model, s), x, loss_fn, repeats=1).peak_bytes
            rows.append((granularity, label, str(chain.length), format_bytes(tr.peak_memory), format_bytes(got),
                         f"{got / tr.peak_memory:.4f}"))
    print(f"{name}, {layers} layers, seq {seq}, hidden {opts.hidden}, batch {opts.batch}: one schedule, two chains")
    print_table(("granularity", "schedule", "stages", "predicted peak", "measured peak", "measured/predicted"), rows,
                left=2)
