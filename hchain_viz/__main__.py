"""Command line: ``python -m hchain_viz {demo,profile,solve,bench}``.

- ``demo``: profile the default demo model, print a summary table, write a standalone HTML explorer.
- ``profile MODEL``: profile a built-in model (``resnet_chain``) or ``module:function`` and write a Chain JSON.
- ``solve CHAIN.json``: print the time-vs-memory frontier and write the optimal schedule JSON for ``--budget``.
- ``bench NAME``: run a benchmark (solver, profile, train, widget, models, offload) and print its table.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from .bench import print_table
from .errors import HChainError


class _Parser(argparse.ArgumentParser):
    """Bad arguments give one line and exit code 2, not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _load_model(spec: str) -> tuple[Any, Any, Any]:
    """A built-in demo model name, or ``package.module:function`` returning (model, input[, loss_fn])."""
    from .runtime import models

    if ":" not in spec:
        return models.demo_model(spec)
    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise HChainError(f"cannot import {spec!r}: {e}; give 'package.module:function'") from None
    result = fn()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise HChainError(f"{spec} must return (model, sample_input) or (model, sample_input, loss_fn)")
    return result if len(result) == 3 else (*result, None)


def _summary_rows(chain, solution) -> list[tuple[str, ...]]:
    """At a few budgets across the feasible range: each budget-driven baseline next to the optimal schedule."""
    from .core import strategies
    from .core.simulate import simulate
    from .core.units import format_bytes, format_time
    from .errors import InfeasibleBudget

    base = chain.store_all_time
    low, high = solution.min_budget, solution.store_all_peak
    rows = []
    for fraction in (0.1, 0.35, 0.65):
        budget = int(low + fraction * (high - low))
        best = solution.makespan(budget)
        for name in ("periodic", "chen_greedy", "revolve"):
            try:
                trace = simulate(chain, strategies.STRATEGIES[name](chain, budget))
            except InfeasibleBudget:
                rows.append((format_bytes(budget), name, "does not fit", "", "", format_time(best), ""))
                continue
            rows.append((format_bytes(budget), name, format_bytes(trace.peak_memory), format_time(trace.makespan),
                         f"{100 * (trace.makespan / base - 1):+.1f}%", format_time(best),
                         f"{100 * (trace.makespan / best - 1):+.1f}%"))
    return rows


def _print_frontier(solution) -> None:
    from .core.units import format_bytes, format_time

    base = solution.chain.store_all_time
    points = solution.frontier()
    if len(points) > 25:  # keep the terminal readable: about 25 evenly spaced breakpoints
        step = len(points) / 25
        points = [points[int(k * step)] for k in range(25)] + [points[-1]]
    rows = [(format_bytes(b), str(b), format_time(t), f"{100 * (t / base - 1):+.1f}%") for b, t in points]
    print_table(("budget", "bytes", "makespan", "overhead"), rows, rule=True)


def cmd_demo(args: argparse.Namespace) -> None:
    from . import profile, solve, to_html
    from .core.units import format_bytes
    from .runtime import models

    model, x, loss_fn = models.demo_model(args.model)
    print(f"Profiling the demo model {args.model or models.DEFAULT_DEMO!r} on CPU ...")
    chain = profile(model, x, loss_fn, progress=not args.quiet)
    print(chain)
    solution = solve(chain, slots=args.slots)
    print(f"\nleast feasible budget {format_bytes(solution.min_budget)} ({solution.min_budget} B); store-all peak "
          f"{format_bytes(solution.store_all_peak)} ({solution.store_all_peak} B)\n")
    print("At three budgets, each baseline (its peak, step time, overhead over store-all) and the optimal step time;"
          " 'slower' is how much longer the baseline's step takes:")
    print_table(("budget", "strategy", "peak", "makespan", "overhead", "optimal", "slower"),
                _summary_rows(chain, solution), rule=True)
    print("\nOptimal frontier:")
    _print_frontier(solution)
    path = to_html(solution, args.out)
    print(f"\nwrote the interactive explorer to {path} (open it in any browser; works offline)")


def cmd_profile(args: argparse.Namespace) -> None:
    from . import profile

    model, x, loss_fn = _load_model(args.model)
    chain = profile(model, x, loss_fn, device=args.device, repeats=args.repeats, progress=not args.quiet)
    chain.to_json(args.out)
    print(chain)
    print(f"\nwrote {args.out}")


def cmd_solve(args: argparse.Namespace) -> None:
    from .core.chain import Chain
    from .core.simulate import simulate
    from .core.solver import solve
    from .core.units import format_bytes, format_time, parse_bytes

    chain = Chain.from_json(args.chain)
    solution = solve(chain, slots=args.slots)
    _print_frontier(solution)
    if args.budget is not None:
        budget = parse_bytes(args.budget)
        schedule = solution.schedule(budget)
        trace = simulate(chain, schedule)
        schedule.to_json(args.out)
        print(f"\nbudget {format_bytes(budget)}: makespan {format_time(trace.makespan)} "
              f"({100 * trace.overhead:+.1f}% over store-all), peak {format_bytes(trace.peak_memory)}, "
              f"{trace.n_recomputed} recomputed forwards\n{schedule}\nwrote {args.out}")


def cmd_bench(args: argparse.Namespace) -> None:
    from . import bench

    bench.run(args.name, args.rest)


def build_parser() -> argparse.ArgumentParser:
    from .bench import BENCHMARKS

    p = _Parser(prog="python -m hchain_viz", description="Optimal activation checkpointing, made visible.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    d = sub.add_parser("demo", help="profile the demo model, print a summary, write a standalone HTML explorer")
    d.add_argument("--model", default=None, help="built-in model name (default: the demo CNN)")
    d.add_argument("--out", default="hchain_demo.html", help="HTML file to write (default: %(default)s)")
    d.add_argument("--slots", type=int, default=500, help="DP memory resolution (default: %(default)s)")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_demo)
    pr = sub.add_parser("profile", help="profile a model and write its Chain JSON")
    pr.add_argument("model", help="built-in model name (resnet_chain, transformer_chain, mlp_chain, resnet_skip) "
                                  "or package.module:function returning (model, input[, loss_fn])")
    pr.add_argument("--out", default="chain.json", help="Chain JSON to write (default: %(default)s)")
    pr.add_argument("--device", default=None, help="cpu or cuda (default: where the model is)")
    pr.add_argument("--repeats", type=int, default=5, help="timed repeats per stage (default: %(default)s)")
    pr.add_argument("--quiet", action="store_true", help="no progress bars")
    pr.set_defaults(func=cmd_profile)
    s = sub.add_parser("solve", help="print the frontier of a Chain JSON; write the schedule for --budget")
    s.add_argument("chain", help="Chain JSON file (from `profile`)")
    s.add_argument("--budget", default=None, help="memory budget, like 300MiB or 1.5GiB or bytes")
    s.add_argument("--slots", type=int, default=500, help="DP memory resolution (default: %(default)s)")
    s.add_argument("--out", default="schedule.json", help="schedule JSON to write (default: %(default)s)")
    s.set_defaults(func=cmd_solve)
    b = sub.add_parser("bench", help="run a benchmark and print its table")
    b.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except HChainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
