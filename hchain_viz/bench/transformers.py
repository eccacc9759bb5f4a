"""Benchmark ``transformers``: transformer chains at module and sub-layer granularity against the baselines that
transformer users run, on the CPU.

Models (random weights, train mode): nanoGPT (``hcv.models.nanogpt``, traced by torch.fx) and Hugging Face GPT-2,
LLaMA and BERT (and, on request, the encoder-decoders BART and T5: ``--layers`` in each stack) built from their
default configs, shrunk to ``--layers`` layers of width ``--hidden``, with eager attention (the attention
probabilities are materialised, as in the issue's hand split). Per model and granularity:

- stages, and the extraction wall time (tracing, analysis, the check against the model);
- measured / predicted peak: the range over every schedule run (measured with ``hchain_viz.measure``, predicted
  by ``simulate``);
- the step-rate gain of the optimal schedule at equal **measured** memory (solved at each baseline's measured peak,
  among other budgets, each solved at its own resolution) over ``checkpoint_sequential`` at layer granularity
  (``layer_periodic``), averaged over its Pareto-efficient segment counts (``n`` that use as much measured memory
  as another and are slower are left out), over full per-layer recomputation at its measured peak, and over
  Megatron's selective recomputation at its measured peak ("n/a" where the optimal schedule has no point at or
  under that peak). A schedule measured above its prediction is reported on a line of its own.
- the same three gains in the model alone (predicted peaks, simulated times): the headroom a perfect executor would
  measure, which says whether a small measured gain comes from the run or from the chain itself. There the optimum
  at a baseline's peak is never slower than that baseline (the exact DP would find it; at its resolution of 1/20000
  of the budget it can miss it by a few KiB).

Every strategy is a Schedule run by the same executor (``hcv.wrap``); step times are medians of ``--rounds``
interleaved rounds (a warm-up round first, shuffled order each round).

    python -m hchain_viz bench transformers [--models nanogpt,gpt2,llama,bert,bart,t5] [--layers 4] [--hidden 128]
                                            [--seq 128] [--batch 4] [--rounds 3] [--threads 0]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
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
    opts = parser.parse_args(args)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(f"transformers benchmark: torch {torch.__version__}, cpu, {torch.get_num_threads()} threads, "
          f"{opts.layers} layers of width {opts.hidden}, batch {opts.batch} x {opts.seq} tokens, eager attention; "
          f"step times: median of {opts.rounds} interleaved rounds")
    head = ("model", "granularity", "stages", "extract", "measured/predicted peak", "vs ckpt_seq (Pareto n/all)",
            "vs per-layer", "vs selective", "simulated: ckpt_seq / per-layer / selective")
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
    from ..core.strategies import layer_periodic, per_layer, selective
    from ..runtime.graph import extract_stages
    from ..runtime.measure import fresh_copy, measure
    from ..runtime.profile import profile
    from ..runtime.wrap import wrap
    from . import optimal_at
    from .train import _interleaved_times

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
    times = _interleaved_times(modules, x, loss_fn, opts.rounds, fresh_copy)
    for p in model.parameters():
        p.grad = None
    n, k = len(ckpt), len(baselines)
    pct = lambda g: "n/a" if g is None else f"{100 * g:+.1f}%"  # noqa: E731
    measured = _gains(list(zip(peaks, times)), n, k)
    # The same gains in the model alone (predicted peaks and simulated times): what a perfect executor would show.
    # The exact optimum at a baseline's predicted peak is never slower than that baseline (a schedule of the class
    # the DP searches); the DP's sizes, rounded up to slots, can miss it by a few KiB, so each baseline also counts
    # as a point of the optimum at its own peak.
    model_points = [(t.peak_memory, t.makespan) for t in traces]
    simulated = _gains(model_points + model_points[:k], n, k)
    ckpt_all = f" ({measured[1]}; all n: {pct(measured[2])})" if measured[0] is not None else ""
    return (f"{chain.length} ({layers} layers)", f"{seconds:.2f} s", f"{min(ratios):.3f}-{max(ratios):.3f}",
            pct(measured[0]) + ckpt_all, pct(measured[3]), pct(measured[4]),
            " / ".join(pct(g) for g in (simulated[0], simulated[3], simulated[4])))


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
