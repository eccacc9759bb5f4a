"""Benchmark of recompute-or-offload (DESIGN §9), in simulation.

``python -m hchain_viz bench offload [--gpu H100] [--grid N]`` prints, for resnet_chain, nanogpt and a synthetic
chain, at three links (PCIe 4.0 x16, PCIe 5.0 x16, NVLink-C2C) and four budgets each: the remat-only optimal makespan,
the remat+offload makespan (``solve(chain, offload=True)``), both as overhead over store-all, and the share of the
remat-only overhead that offloading removes. The remat-only reference is the DP's answer or, when faster, a
schedule of a larger budget's breakpoint that still fits once simulated (the DP rounds sizes up to its slots), so
that rounding is not credited to offloading. Then, per link, that share averaged over the budgets where remat-only
costs at least 10% (goal at PCIe 5.0: at least 1/3), whether offloading was ever slower (goal: never), and the time
of one budget change at L = 50 (goal: 100 ms).

Stage times must be GPU-like (CPU compute is so slow that any link hides every copy): the demo models are profiled
on the CPU for their sizes with times from a roofline **estimate** for ``--gpu`` (``profile(estimate_for=...)``);
the synthetic chain is ``Chain.random(50, scale=16 MiB)`` with times divided by 10. The four budgets of each chain
are added to the offload solver's precomputed grid (its answer between grid budgets is the one at the grid budget
below), and "solve" is the time of that whole precomputation. "act. rate" is the chain's
activation bytes (all x̄) over its store-all time: offloading pays when the link is a fair share of it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from ..core.chain import BANDWIDTH_LABELS, Chain
from ..core.offload import _grid, default_grid_size, remat_refined, solve_offload
from ..core.simulate import simulate
from ..core.solver import solve
from ..core.units import format_bytes, format_time
from . import positive_int, print_table

BUDGET_FRACTIONS = (0.05, 0.2, 0.4, 0.6)  # of the way from the remat-only least budget to the store-all peak
GOAL_SHARE = 1 / 3  # at PCIe 5.0, averaged over budgets where remat-only costs >= 10%
GOAL_CHANGE = 0.100  # seconds per budget change at L = 50


def synthetic() -> Chain:
    c = Chain.random(50, seed=0, scale=16 * 2**20)
    return Chain(fwd_time=[t / 10 for t in c.fwd_time], bwd_time=[t / 10 for t in c.bwd_time], x=c.x, xbar=c.xbar,
                 fwd_tmp=c.fwd_tmp, bwd_tmp=c.bwd_tmp, names=c.names, meta={"times": "synthetic"})


def demo_chain(name: str, gpu: str) -> Chain:
    from ..runtime.models import demo_model
    from ..runtime.profile import profile

    model, x, loss = demo_model(name)
    return profile(model, x, loss, estimate_for=gpu, warmup=0, repeats=1, progress=False)


def run(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m hchain_viz bench offload", description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="H100", help="GPU of the roofline estimate for the demo models")
    ap.add_argument("--grid", type=positive_int, default=None,
                    help="budgets precomputed by the offload solver (default: its own, 48)")
    ap.add_argument("--changes", type=positive_int, default=20, help="budget changes timed at L = 50")
    args = ap.parse_args(argv)

    chains = {"resnet_chain": demo_chain("resnet_chain", args.gpu), "nanogpt": demo_chain("nanogpt", args.gpu),
              "synthetic": synthetic()}
    rows, shares, worse, change = [], {k: [] for k in BANDWIDTH_LABELS}, 0, {}
    for name, chain in chains.items():
        rate = sum(chain.xbar) / chain.store_all_time
        remat = solve(chain)
        lo, hi = remat.min_budget, remat.store_all_peak
        budgets = [int(lo + f * (hi - lo)) for f in BUDGET_FRACTIONS]
        base = chain.store_all_time
        for link in BANDWIDTH_LABELS:
            c = chain.with_bandwidth(link)
            t0 = time.perf_counter()
            # the default grid, plus the budgets of the table (a budget change reads the grid; it never solves)
            grid = _grid(remat, remat.store_all_peak, args.grid or default_grid_size(c)) + budgets
            sol = solve_offload(c, grid=grid, remat=remat)
            built = time.perf_counter() - t0
            for b in budgets:
                r, o = remat_refined(chain, remat, b)[0], sol.makespan(b)
                trace = simulate(c, sol.schedule(b))
                assert trace.peak_memory <= b and math.isclose(trace.makespan, o, rel_tol=1e-9)  # simulated
                worse += o > r * (1 + 1e-12)
                removed = max(0.0, (r - o) / (r - base)) if r > base else 0.0  # 0 when equal up to float noise
                if r / base - 1 >= 0.10:
                    shares[link].append(removed)
                rows.append((name, BANDWIDTH_LABELS[link], format_bytes(b), format_time(r),
                             f"{100 * (r / base - 1):+.1f}%", format_time(o), f"{100 * (o / base - 1):+.1f}%",
                             f"{100 * removed:.0f}%",
                             trace.n_transfers, format_time(trace.idle_time), f"{built:.2f}s"))
            if chain.length >= 50:
                times = []
                for k in range(args.changes):
                    b = int(lo + (hi - lo) * k / max(1, args.changes - 1))
                    t0 = time.perf_counter()
                    simulate(c, sol.schedule(b))
                    times.append(time.perf_counter() - t0)
                change[link] = (statistics.median(times), max(times))
        print(f"{name}: {chain.length} stages, store-all {format_time(base)}, activations "
              f"{format_bytes(sum(chain.xbar))}, act. rate {format_bytes(rate)}/s, times: "
              f"{chain.meta.get('times', 'measured')}")
    print()
    print_table(("chain", "link", "budget", "remat-only", "ovh", "remat+offload", "ovh", "removed", "transfers",
                 "idle", "solve"), rows, left=2, rule=True)
    print()
    for link, label in BANDWIDTH_LABELS.items():
        s = shares[link]
        mean = statistics.mean(s) if s else float("nan")
        goal = f" (goal >= {100 * GOAL_SHARE:.0f}%: {'met' if mean >= GOAL_SHARE else 'NOT met'})" \
            if link == "pcie5" else ""
        med, worst = change.get(link, (float("nan"),) * 2)
        print(f"{label}: overhead removed {100 * mean:.0f}% on average over {len(s)} budgets with remat-only "
              f">= 10%{goal}; budget change at L=50 (schedule + simulate) median {1e3 * med:.1f} ms, "
              f"max {1e3 * worst:.1f} ms (goal {1e3 * GOAL_CHANGE:.0f} ms)")
    print(f"remat+offload slower than remat-only: {worse} times (goal: never)")
