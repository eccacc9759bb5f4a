"""Command line: ``python -m hchain_viz {demo,profile,solve,fit,bench}``.

- ``demo``: profile the default demo model, print a summary table, write a standalone HTML explorer.
- ``profile MODEL``: profile a built-in model (``resnet_chain``) or ``module:function`` and write a Chain JSON.
- ``solve CHAIN.json``: print the time-vs-memory frontier and write the optimal schedule JSON for ``--budget``.
- ``fit MODEL --device-memory 24GiB``: will a training step fit? The largest batch per strategy on that device.
- ``bench NAME``: run a benchmark (solver, profile, train, widget, models, fit, gpu, compile, transformers,
  offload) and print its table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from .bench import print_table
from .core.fixed import OPTIMIZERS, PRECISIONS
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


DEMO_BASELINES = ("periodic", "chen_greedy", "revolve")
# One short line per term the demo prints (the chain table's columns only appear with --full).
TERMS = (
    ("budget", "memory allowed for activations in a step (weights and optimizer state come on top)"),
    ("store-all", "plain training: keep every activation; the fastest step and the most memory"),
    ("step time", "predicted time of one forward + backward (the explorer calls it the makespan)"),
    ("recompute", "run a forward again during the backward, so its activations need not be kept"),
    ("optimal", "the fastest schedule within the budget (never behind a baseline that fits)"),
    ("periodic", "PyTorch's checkpoint_sequential: equal segments, the best segment count that fits"),
    ("chen_greedy", "Chen et al.'s greedy segmentation by activation size"),
    ("revolve", "binomial checkpointing (Griewank): best when every stage costs the same"),
)
CHAIN_TERMS = (
    ("fwd / bwd", "time of the stage's forward / backward"),
    ("x", "bytes of the activation entering the stage"),
    ("xbar", "bytes a normal forward of the stage keeps for its backward (its output + saved tensors)"),
    ("fwd_tmp", "temporary bytes during the stage's forward (bwd_tmp: during its backward)"),
)


def _print_terms(terms: tuple[tuple[str, str], ...]) -> None:
    width = max(len(t) for t, _ in terms)
    for term, meaning in terms:
        print(f"  {term:<{width}}  {meaning}")


def _demo_comparison(chain, solution) -> tuple[list[tuple[str, ...]], list[str], list[float]]:
    """At three budgets across the feasible range: the optimal step time, each demo baseline's (with how much slower
    it is), and the best of every baseline that fits (any family, any setting: what a user could run in that memory).
    Returns the table rows, notes on baselines that keep one schedule, and per budget how much slower the best
    baseline that fits is than the optimum (never negative: docs/design.md §10)."""
    from .core import strategies
    from .core.simulate import simulate
    from .core.units import format_bytes, format_time
    from .errors import InfeasibleBudget

    low, high = solution.min_budget, solution.store_all_peak
    budgets = [int(low + f * (high - low)) for f in (0.1, 0.35, 0.65)]
    rows, seen, gains = [], {n: [] for n in DEMO_BASELINES}, []
    front = strategies.baseline_frontier(chain)
    for budget in budgets:
        best = simulate(chain, solution.schedule(budget)).makespan
        row = [format_bytes(budget), format_time(best)]
        for name in DEMO_BASELINES:
            try:
                sched = strategies.STRATEGIES[name](chain, budget)
            except InfeasibleBudget:
                row.append("does not fit")
                continue
            t = simulate(chain, sched).makespan
            seen[name].append(sched.ops)
            row.append(f"{format_time(t)} ({100 * (t / best - 1):+.0f}%)")
        fits = [c for c in front if c[0] <= budget]
        if fits:
            _, t, label, _ = fits[-1]
            gains.append(t / best - 1)
            row.append(f"{label} {format_time(t)} ({100 * (t / best - 1):+.1f}%)")
        else:
            row.append("none fits")
        rows.append(tuple(row))
    notes = [f"{name}: the same schedule at all three budgets (few settings; no faster one fits in "
             f"{format_bytes(budgets[-1])})" for name, ops in seen.items()
             if len(ops) == len(budgets) and all(o == ops[0] for o in ops)]
    return rows, notes, gains


def _print_frontier(solution, rows: int = 25, raw_bytes: bool = True) -> None:
    """The optimal frontier: about ``rows`` evenly spaced breakpoints (every one when ``rows`` is 0)."""
    from .core.units import format_bytes, format_time

    base = solution.chain.store_all_time
    points = solution.frontier()
    if rows and len(points) > rows:  # keep the terminal readable: evenly spaced breakpoints and the last one
        step = len(points) / rows
        points = [points[int(k * step)] for k in range(rows)] + [points[-1]]
    if raw_bytes:
        table = [(format_bytes(b), str(b), format_time(t), f"{100 * (t / base - 1):+.1f}%") for b, t in points]
        print_table(("budget", "bytes", "makespan", "overhead"), table, rule=True)
    else:
        table = [(format_bytes(b), format_time(t), f"{100 * (t / base - 1):+.1f}%") for b, t in points]
        print_table(("budget", "step time", "vs store-all"), table, rule=True)


def cmd_demo(args: argparse.Namespace) -> None:
    import warnings

    from . import profile, solve, to_html
    from .core.units import format_bytes, format_time
    from .errors import TimingWarning
    from .runtime import models

    name = args.model or models.DEFAULT_DEMO
    model, x, loss_fn = models.demo_model(args.model)
    print(f"Profiling the demo model {name!r} on CPU ...")
    with warnings.catch_warnings():  # the timing spread is reported below, in the demo's words
        warnings.simplefilter("ignore", TimingWarning)
        chain = profile(model, x, loss_fn, progress=not args.quiet)
    solution = solve(chain, slots=args.slots)
    rows, notes, gains = _demo_comparison(chain, solution)
    print()
    if gains:  # at equal memory, against the best baseline that fits: the least and the most of the rows below
        lo, hi = 100 * min(gains), 100 * max(gains)
        gain = f"{lo:.1f}%" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}-{hi:.1f}%"
        print(f"Headline: within the same memory budget, the optimal schedule's training step is {gain} faster\n"
              f"than the best baseline that fits it (any family, any setting; three budgets below).\n")
    spread = chain.time_spread
    print(f"{name}: {chain.length} stages. Plain training (store-all) takes {format_time(chain.store_all_time)} per "
          f"step and keeps\nup to {format_bytes(solution.store_all_peak)} of activations; the least any schedule "
          f"needs is {format_bytes(solution.min_budget)}.")
    note = chain.timing_note()  # one line: identical layers sharing one cost (docs/design.md §10), the rest's spread
    if note is not None:
        print("Timing: " + note.replace("; ", ";\n        ") + ".")
        if spread is not None and spread > 0.10:
            print("        A busy machine: profile again when it is quiet.")
    print("\nStep time at three budgets (in brackets: how much slower than optimal):")
    print_table(("budget", "optimal", *DEMO_BASELINES, "best baseline that fits"), rows, rule=True)
    for note in notes:
        print(f"  {note}")
    print("\nTerms:")
    _print_terms(TERMS)
    print("\nOptimal step time by budget" + ("" if args.full else " (--full: every breakpoint, and the chain)") + ":")
    _print_frontier(solution, rows=0 if args.full else 6, raw_bytes=args.full)
    if args.full:
        print()
        print(chain)
        _print_terms(CHAIN_TERMS)
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    path = to_html(solution, out)
    print(f"\nWrote the interactive explorer to {path}\n(open it in a browser; it works offline).")


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


def _make_batch(spec: str):
    """``make_batch(b) -> (input, loss_fn)`` for a built-in model name or ``module:function`` taking ``batch=``."""
    if ":" not in spec:
        from .runtime import models

        return lambda b: models.demo_model(spec, batch=b)[1:]

    def make(b: int):
        out = _load_model_with(spec, batch=b)
        return out[1], out[2]
    return make


def _load_model_with(spec: str, **kwargs: Any) -> tuple[Any, Any, Any]:
    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise HChainError(f"cannot import {spec!r}: {e}; give 'package.module:function'") from None
    try:
        result = fn(**kwargs)
    except TypeError as e:
        raise HChainError(f"{spec} must accept {', '.join(kwargs)}= for this command ({e})") from None
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise HChainError(f"{spec} must return (model, sample_input) or (model, sample_input, loss_fn)")
    return result if len(result) == 3 else (*result, None)


def fit_rows(chain, device_memory: Any, margin: float) -> list[tuple[str, ...]]:
    """One row per strategy: the largest batch that fits, its step time, throughput and whole-step peak."""
    from .core import device
    from .core.batch import at_batch
    from .core.simulate import simulate
    from .core.units import format_bytes, format_time

    rows = []
    for name in device.BATCH_STRATEGIES:
        p = device.largest_batch(chain, device_memory, name, margin)
        if p is None:
            rows.append((name, "none", "", "", "", ""))
            continue
        n = simulate(at_batch(chain, p.batch), p.schedule).n_recomputed
        segments = p.schedule.meta.get("segments")
        detail = (f"{segments} segments, " if segments else "") + (f"{n} recomputed" if n else "no recomputation")
        rows.append((name, str(p.batch), format_time(p.makespan), f"{p.throughput:,.0f}", format_bytes(p.device_peak),
                     detail))
    return rows


def _in_precision(name: str, model: Any, make: Any, device: str | None) -> tuple[Any, Any, Any]:
    """(model, make_batch, context to profile in) for a training step in precision ``name`` (core.fixed.PRECISIONS):
    16-bit weights cast the model and the batches' floating tensors; autocast precisions profile under autocast."""
    import contextlib

    import torch

    from .core.fixed import precision
    from .runtime.memtrack import map_tensors

    p = precision(name)
    dtype = torch.bfloat16 if name.startswith("bf16") else torch.float16 if name.startswith("fp16") else None
    dev = torch.device(device) if device else next((q.device for q in model.parameters()), torch.device("cpu"))
    if dtype is torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise HChainError(f"--precision {name}: the GPU {torch.cuda.get_device_name(dev)} has no native bfloat16; "
                          f"choose fp16-mixed")
    if dtype is None:
        return model, make, contextlib.nullcontext()
    if p.autocast:
        return model, make, torch.autocast(dev.type, dtype=dtype)
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return model.to(dtype), lambda b: tuple(map_tensors(v, cast) for v in make(b)), contextlib.nullcontext()


def cmd_fit(args: argparse.Namespace) -> None:
    import torch

    from .core import device
    from .core.fixed import precision
    from .core.units import format_bytes, parse_bytes
    from .runtime import models
    from .runtime.batch import profile_batches
    from .runtime.fixed import make_optimizer

    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise HChainError(f"--batches must be comma-separated whole numbers like 8,16, got {args.batches!r}") from None
    usable = device.usable_memory(args.device_memory, args.margin)  # checks both before the long part
    precision(args.precision)
    make = _make_batch(args.model)
    model = (_load_model_with(args.model, batch=batches[0]) if ":" in args.model else
             models.demo_model(args.model))[0]
    if args.device:
        model = model.to(args.device)
        inner = make
        make = lambda b: tuple(v.to(args.device) if isinstance(v, torch.Tensor) else v for v in inner(b))  # noqa: E731
    model, make, context = _in_precision(args.precision, model, make, args.device)
    opt = make_optimizer(args.optimizer, model.parameters())
    print(f"Profiling {args.model} at batch sizes {', '.join(map(str, batches))} with {type(opt).__name__} in "
          f"{args.precision} ...")
    with context:
        chain = profile_batches(model, make, batches, check=args.check, optimizer=opt, world_size=args.world_size,
                                repeats=args.repeats, progress=not args.quiet)
    if chain.fixed.precision != args.precision:  # bf16-master: the optimizer steps fp32 copies of the bf16 weights
        chain = device.in_precision(chain, args.precision)
    if args.out:
        chain.to_json(args.out)
    check = chain.meta.get("batch_fit_check")
    if check:
        print(f"fit checked at batch {check['batch']} (not used for the fit): store-all activation peak "
              f"{100 * check['store_all_peak']:+.1f}%, step time {100 * check['store_all_time']:+.1f}%, largest "
              f"single-size error {100 * check['size_max']:.1f}%")
    print(f"fixed part per rank: {chain.fixed.describe()}; optimizer step transient "
          f"{format_bytes(chain.fixed.step_tmp_per_rank)}")
    print(f"device {format_bytes(parse_bytes(args.device_memory))}, margin {100 * args.margin:g}% "
          f"({format_bytes(usable)} usable), world size {args.world_size}\n")
    print_table(("strategy", "largest batch", "step time", "samples/s", "device peak", "schedule"),
                fit_rows(chain, args.device_memory, args.margin), left=1, rule=True)
    if args.out:
        print(f"\nwrote the fitted chain to {args.out}")


def cmd_bench(args: argparse.Namespace) -> None:
    from . import bench

    bench.run(args.name, args.rest)


def build_parser() -> argparse.ArgumentParser:
    from .bench import BENCHMARKS

    p = _Parser(prog="python -m hchain_viz", description="Optimal activation checkpointing, made visible.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    d = sub.add_parser("demo", help="profile the demo model, print a summary, write a standalone HTML explorer")
    d.add_argument("--model", default=None, help="built-in model name (default: the demo CNN)")
    d.add_argument("--out", default=os.path.join("out", "hchain_demo.html"),
                   help="HTML file to write (default: %(default)s; out/ is git-ignored)")
    d.add_argument("--full", action="store_true", help="every frontier breakpoint and the profiled chain")
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
    f = sub.add_parser("fit", help="will a training step fit a device: the largest batch per strategy")
    f.add_argument("model", help="built-in model name or package.module:function taking batch= and returning "
                                 "(model, input[, loss_fn])")
    f.add_argument("--device-memory", required=True, help="device memory, like 24GiB or 80GiB (GB = 10^9 bytes)")
    f.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="optimizer (default: %(default)s)")
    f.add_argument("--precision", default="fp32", help=f"how the step keeps its numbers, one of {', '.join(PRECISIONS)}"
                                                       f" (docs/fit.md; default: %(default)s)")
    f.add_argument("--world-size", type=int, default=1, help="ranks sharding parameters, gradients and optimizer "
                                                             "state, FSDP-style (default: %(default)s)")
    f.add_argument("--margin", type=float, default=0.05, help="fraction of the device kept free for the allocator "
                                                             "(default: %(default)s)")
    f.add_argument("--batches", default="8,16", help="batch sizes to profile and fit (default: %(default)s)")
    f.add_argument("--check", type=int, default=None, help="held-out batch size checking the fit (default: the "
                                                          "largest plus the smallest; 0: none)")
    f.add_argument("--device", default=None, help="cpu or cuda (default: where the model is)")
    f.add_argument("--repeats", type=int, default=3, help="timed repeats per stage (default: %(default)s)")
    f.add_argument("--out", default=None, help="also write the fitted Chain JSON here")
    f.add_argument("--quiet", action="store_true", help="no progress bars")
    f.set_defaults(func=cmd_fit)
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
