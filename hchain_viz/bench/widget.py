"""Benchmark: server-side time of one explorer budget change (``python -m hchain_viz bench widget``).

One change re-reads the DP table and rebuilds the op list (``solution.schedule``), simulates it, reads the trace into
arrays, updates the four figures and serialises the changed ones for the page (the explorer's
FigureBoard). Measured on ``Chain.random(L)`` with the explorer's
(strategy, budget) cache cleared before every change, over budgets spread from the least feasible one to store-all,
after one warm-up change. Goals: median <= 30 ms at L=50 and <= 100 ms at L=200. No browser is attached, so the
time is what the kernel spends; the frontend's redraw comes on top.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from . import positive_int, print_table

GOALS_MS = {50: 30.0, 200: 100.0}


def run(args: list[str]) -> None:
    """Print one row per chain length: cold start, op count, and the budget-change times (median, p90, max)."""
    p = argparse.ArgumentParser(prog="python -m hchain_viz bench widget", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="50,200", help="comma-separated chain lengths (default 50,200)")
    p.add_argument("--changes", type=positive_int, default=30, help="budget changes measured per length (default 30)")
    p.add_argument("--slots", type=positive_int, default=500, help="DP memory resolution (default 500)")
    p.add_argument("--baselines", action="store_true",
                   help="draw the baselines' frontiers too (static, not redrawn on a budget change; slow to "
                        "compute at L=200)")
    opts = p.parse_args(args)

    from ..core.chain import Chain
    from ..core.simulate import simulate
    from ..core.solver import solve
    from ..viz.explorer import Explorer
    from ..viz.trace_view import TraceView

    head = ("L", "solve", "explorer", "ops", "schedule", "simulate+view", "change median", "p90", "max", "goal", "ok")
    rows = []
    for L in [int(s) for s in opts.lengths.split(",") if s.strip()]:
        chain = Chain.random(L, seed=0)
        t0 = time.perf_counter()
        sol = solve(chain, slots=opts.slots)
        t_solve = time.perf_counter() - t0
        t0 = time.perf_counter()
        ex = Explorer(chain, solution=sol, baselines=None if opts.baselines else False)
        t_build = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        budgets = rng.permutation(np.linspace(sol.min_budget, sol.store_all_peak, opts.changes).astype(np.int64))
        ex.budget = int(budgets[-1])  # warm-up: first kernel call loads the compiled rebuild
        totals, sched_t, sim_t, ops = [], [], [], []
        for b in budgets.tolist():
            ex._cache.clear()  # measure the full path, not a cache hit
            t0 = time.perf_counter()
            ex.budget = b
            totals.append(time.perf_counter() - t0)
            ops.append(len(ex.schedule))
            # the data half of the change, alone
            t0 = time.perf_counter()
            s = sol.schedule(b)
            t1 = time.perf_counter()
            TraceView.of(simulate(chain, s))
            t2 = time.perf_counter()
            sched_t.append(t1 - t0)
            sim_t.append(t2 - t1)
        ms = 1e3 * np.asarray(totals)
        med = float(np.median(ms))
        goal = GOALS_MS.get(L)
        rows.append((str(L), f"{t_solve:.2f} s", f"{t_build:.2f} s", f"{int(np.median(ops))}",
                     f"{1e3 * np.median(sched_t):.1f} ms", f"{1e3 * np.median(sim_t):.1f} ms", f"{med:.1f} ms",
                     f"{np.percentile(ms, 90):.1f} ms", f"{ms.max():.1f} ms",
                     "-" if goal is None else f"<= {goal:.0f} ms", "-" if goal is None else
                     ("yes" if med <= goal else "NO")))
    print(f"widget: server-side time of one explorer budget change ({opts.changes} changes per length, "
          f"{opts.slots} slots, baselines {'on' if opts.baselines else 'off'})")
    print_table(head, rows)
