"""Benchmark ``train``: optimal schedules (wrapped) against PyTorch's ``checkpoint_sequential`` at equal memory.

For each demo model: profile it, solve, then measure real training steps (peak memory with ``measure``, step time
as the median of interleaved rounds, so load on a shared machine hits every configuration alike) of

- plain eager PyTorch and the store-all schedule run by our executor (its overhead should be within a few percent),
- ``torch.utils.checkpoint.checkpoint_sequential(stages, n, x, use_reentrant=False)`` for every segment count n,
- the optimal schedule at every breakpoint of the solved time-memory frontier (every distinct optimal schedule,
  from the least feasible budget to the store-all peak).

Then, for each checkpoint_sequential point, the fastest optimal schedule whose MEASURED peak is the same or lower,
and the throughput gain (its step rate over checkpoint_sequential's), averaged over the Pareto-efficient points: a
segment count that uses as much measured memory as another and is slower is left out of the average (it is printed,
marked, and the average over every point, the old rule, is printed beside the new one).

    python -m hchain_viz bench train [--models resnet_chain,transformer_chain,mlp_chain] [--rounds 9]
                                     [--threads 0] [--small] [--device cpu]

On CUDA, step times come from CUDA events (``measure``'s timer) and peaks from the allocator's statistics.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from . import pareto_efficient, positive_int, print_table


def run(args: list[str], sizes: dict[str, dict[str, Any]] | None = None) -> None:
    """Print, per demo model, a table of every configuration and the comparison with checkpoint_sequential.

    ``sizes`` (for callers such as ``bench gpu``): demo-model options per model name, instead of the defaults."""
    from ..core import strategies
    from ..core.simulate import simulate
    from ..core.solver import solve
    from ..core.units import format_bytes, format_time
    from ..runtime import models
    from ..runtime.measure import fresh_copy, measure
    from ..runtime.profile import profile
    from ..runtime.stages import sequentialize
    from ..runtime.train.wrap import wrap

    parser = argparse.ArgumentParser(prog="hchain_viz bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet_chain,transformer_chain,mlp_chain",
                        help="comma-separated demo names")
    parser.add_argument("--rounds", type=positive_int, default=9, help="interleaved timing rounds (median taken)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--small", action="store_true", help="smaller models, fewer rounds (a quick check)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    opts = parser.parse_args(args)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    small = {"resnet_chain": dict(batch=4, image=32, width=8), "transformer_chain": dict(batch=4, seq=32, dim=64),
             "mlp_chain": dict(batch=64)}
    if sizes is None:
        sizes = small if opts.small else {}
    rounds = 3 if opts.small else opts.rounds

    print(f"train benchmark: torch {torch.__version__}, {opts.device}, {torch.get_num_threads()} threads, median of "
          f"{rounds} interleaved rounds; peaks measured with hchain_viz.measure (activations + input)")
    gains_all: list[float] = []  # Pareto-efficient checkpoint_sequential points only
    every_all: list[float] = []  # every point (the old rule)
    sim_all: list[float] = []
    for name in opts.models.split(","):
        name = name.strip()
        model, x, loss_fn = models.demo_model(name, device=opts.device, **sizes.get(name, {}))
        chain = profile(model, x, loss_fn, progress=False)
        sol = solve(chain)
        stages = nn.Sequential(*[m for _, m in sequentialize(model, x)])
        L = chain.length

        # Configurations: (label, kind, module, simulated Trace or None).
        configs: list[tuple[str, str, Any, Any]] = [("eager", "eager", model, None)]
        store = strategies.store_all(chain)
        configs.append(("store_all (wrapped)", "store_all", wrap(model, store), simulate(chain, store)))
        for n in range(1, L + 1):  # strategies.periodic is exactly what checkpoint_sequential does
            trace = simulate(chain, strategies.periodic(chain, n))
            configs.append((f"checkpoint_sequential n={n}", "ckpt", CheckpointSequential(stages, n), trace))
        peaks = [measure(m, x, loss_fn, repeats=1).peak_bytes for _, _, m, _ in configs]
        # Every distinct optimal schedule: one per breakpoint of the solution's time-memory frontier (any budget's
        # schedule is the one of the breakpoint at or below it).
        lo, hi = sol.min_budget, sol.store_all_peak
        for b, _ in sol.frontier():
            s = sol.schedule(b)
            m = wrap(model, s)
            configs.append((f"optimal @ {format_bytes(b)}", "optimal", m, simulate(chain, s)))
            peaks.append(measure(m, x, loss_fn, repeats=1).peak_bytes)
        times = interleaved_times([m for _, _, m, _ in configs], x, loss_fn, rounds, fresh_copy)

        head = ("configuration", "pred peak", "meas peak", "meas/pred", "pred time", "step time")
        rows = [(label, "" if tr is None else format_bytes(tr.peak_memory), format_bytes(mp),
                 "" if tr is None else f"{mp / tr.peak_memory:.3f}", "" if tr is None else format_time(tr.makespan),
                 format_time(t))
                for (label, _, _, tr), mp, t in zip(configs, peaks, times)]
        print()
        print(f"{name}: {L} stages, least feasible budget {format_bytes(lo)}, store-all peak {format_bytes(hi)}")
        print_table(head, rows, left=1)

        opt = [(mp, t, label) for (label, kind, _, _), mp, t in zip(configs, peaks, times) if kind == "optimal"]
        time_of = {m.schedule.ops: t for (_, kind, m, _), t in zip(configs, times) if kind == "optimal"}
        head = ("checkpoint_sequential", "meas peak", "step time", "Pareto", "best optimal at <= peak", "its peak",
                "its time", "throughput gain", "gain at equal simulated peak")
        rows, gains, every, sim_gains = [], [], [], []
        ckpt = [(mp, t) for (_, kind, _, _), mp, t in zip(configs, peaks, times) if kind == "ckpt"]
        efficient = iter(pareto_efficient(ckpt))
        for (label, kind, _, tr), mp, t in zip(configs, peaks, times):
            if kind != "ckpt":
                continue
            keep = next(efficient)
            mark = "yes" if keep else "no"  # another segment count is as small and faster
            # Secondary: the optimal schedule for the budget of checkpoint_sequential's simulated peak.
            same_sim = time_of.get(sol.schedule(tr.peak_memory).ops) if tr.peak_memory >= lo else None
            sim_gain = "" if same_sim is None else f"{100 * (t / same_sim - 1):+.1f}%"
            if same_sim is not None and keep:
                sim_gains.append(t / same_sim - 1)
            fits = [o for o in opt if o[0] <= mp]
            if not fits:
                rows.append((label.split()[-1], format_bytes(mp), format_time(t), mark, "(none fits)", "", "", "",
                             sim_gain))
                continue
            o_peak, o_time, o_label = min(fits, key=lambda o: o[1])
            gain = t / o_time - 1.0
            every.append(gain)
            if keep:
                gains.append(gain)
            rows.append((label.split()[-1], format_bytes(mp), format_time(t), mark, o_label.split("@ ")[-1],
                         format_bytes(o_peak), format_time(o_time), f"{100 * gain:+.1f}%", sim_gain))
        print()
        print_table(head, rows, left=1)
        eager_t, store_t = times[0], times[1]
        avg = statistics.mean(gains) if gains else float("nan")
        old = statistics.mean(every) if every else float("nan")
        gains_all += gains
        every_all += every
        sim_all += sim_gains
        print(f"{name}: average throughput gain over checkpoint_sequential at equal measured memory "
              f"{100 * avg:+.1f}% over its {len(gains)} Pareto-efficient points (old rule, all {len(every)} points: "
              f"{100 * old:+.1f}%; at equal simulated peak "
              f"{100 * statistics.mean(sim_gains) if sim_gains else float('nan'):+.1f}%); store-all executor vs "
              f"eager step time {100 * (store_t / eager_t - 1):+.1f}%; worst meas/pred peak "
              f"{max(mp / tr.peak_memory for (_, _, _, tr), mp in zip(configs, peaks) if tr):.3f}")
    if gains_all:
        print()
        print(f"all models: average throughput gain at equal measured memory {100 * statistics.mean(gains_all):+.1f}%"
              f" over {len(gains_all)} Pareto-efficient checkpoint_sequential points (old rule, all "
              f"{len(every_all)} points: {100 * statistics.mean(every_all):+.1f}%; at equal simulated peak "
              f"{100 * statistics.mean(sim_all) if sim_all else float('nan'):+.1f}%)")


class CheckpointSequential(nn.Module):
    """PyTorch's own segment checkpointing: ``checkpoint_sequential(stages, segments, x, use_reentrant=False)``."""

    def __init__(self, stages: nn.Sequential, segments: int):
        super().__init__()
        self.stages = stages
        self.segments = segments

    def forward(self, x: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.stages(x)
        return checkpoint_sequential(self.stages, self.segments, x, use_reentrant=False)


def interleaved_times(modules: list[Any], x: Any, loss_fn: Any, rounds: int, fresh_copy: Any,
                      samples: bool = False) -> list[Any]:
    """Median step time of each module (or, with ``samples``, every step time), timing one step of each per round in
    a shuffled order (a warm-up round first). Timed as ``measure`` times: CUDA events on a GPU (kernels run
    asynchronously: a wall clock around the calls would see only their launches), ``perf_counter`` elsewhere."""
    times = [t for (t,) in grouped_times([[m] for m in modules], x, loss_fn, rounds, fresh_copy)]
    return times if samples else [statistics.median(t) for t in times]


def grouped_times(groups: list[list[Any]], x: Any, loss_fn: Any, rounds: int,
                  fresh_copy: Any) -> list[list[list[float]]]:
    """Every step time of each module of each group (``[group][module][round]``): per round (a warm-up round first)
    the groups run in a shuffled order, and a group's modules one after the other, also shuffled. Ratios within a
    group are then read from steps run back to back: a shared machine changes speed over seconds, and one step of a
    CNN varies by +-12% on its own, so steps timed far apart add both to a ratio's noise."""
    from ..runtime.measure import timed
    from ..runtime.memtrack import tensors

    dev = tensors(x)[0].device
    params = {id(p): p for g in groups for m in g for p in m.parameters() if p.requires_grad}.values()
    for p in params:  # gradients exist before timing, as in a training loop after its first step
        if p.grad is None:
            p.grad = p.detach().new_zeros(p.shape)
    times: list[list[list[float]]] = [[[] for _ in g] for g in groups]
    shuffle = random.Random(0).shuffle
    order = list(range(len(groups)))
    inner = [list(range(len(g))) for g in groups]
    for r in range(rounds + 1):
        shuffle(order)  # no configuration always runs right after the same other one
        for gi in order:
            shuffle(inner[gi])
            for k in inner[gi]:
                m = groups[gi][k]
                xs = fresh_copy(x)
                dt = timed(lambda m=m, xs=xs: loss_fn(m(xs)).backward(), dev)
                for p in params:
                    p.grad.zero_()
                if r:
                    times[gi][k].append(dt)
    return times

