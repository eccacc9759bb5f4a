"""Benchmark ``fit``: does "will it fit" predict real training steps? (docs/design.md §7)

For each demo model and optimizer: profile at two batch sizes with the optimizer (``profile_batches``), then at
batch sizes NOT used for the fit,

1. **whole-step peak**: the predicted ``device_peak(simulate(at_batch(chain, b), schedule))`` against the
   measured one (``measure(wrap(model, schedule), x, loss, optimizer=opt)``: forward, backward, ``opt.step()``,
   ``zero_grad()``) for store-all and the optimal schedule at two activation budgets (a third and two thirds of the
   way from the least feasible budget to the store-all peak). Goal: within 5%.
2. **largest batch**: on a device sized so that store-all runs out mid-grid, the largest batch of the grid that each
   strategy (optimal, store-all, checkpoint_sequential) fits, predicted (``core.device.largest_batch``) against
   measured (the same strategy's schedule at each grid size, measured, walking the grid from the predicted size
   to where the measured peak stops fitting).
   Goal: equal, or one grid step apart.

    python -m hchain_viz bench fit [--models resnet_chain,mlp_chain,nanogpt] [--optimizers sgd-momentum,adamw]
                                   [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

#: per model: the batch sizes fitted, the held-out sizes for the peak check, the grid for the largest batch.
SIZES = {
    "resnet_chain": ((4, 8), (6, 12, 16), (4, 6, 8, 10, 12, 14, 16, 20, 24, 28)),
    "mlp_chain": ((128, 256), (384, 768, 1024), (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)),
    "nanogpt": ((2, 4), (3, 6, 8), (2, 3, 4, 5, 6, 8, 10, 12, 16, 20)),
}


def run(args: list[str]) -> None:
    """Print the two tables: predicted vs measured whole-step peaks, and predicted vs measured largest batches."""
    import torch

    from ..core.fixed import OPTIMIZERS
    from . import print_table

    parser = argparse.ArgumentParser(prog="hchain_viz bench fit", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SIZES), help="comma-separated demo names (of: "
                                                                  f"{', '.join(SIZES)})")
    parser.add_argument("--optimizers", default="sgd-momentum,adamw", help=f"of: {', '.join(OPTIMIZERS)}")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats when profiling")
    opts = parser.parse_args(args)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    names = [n.strip() for n in opts.models.split(",")]
    optims = [o.strip() for o in opts.optimizers.split(",")]
    unknown = [n for n in names if n not in SIZES] + [o for o in optims if o not in OPTIMIZERS]
    if unknown:
        parser.error(f"unknown model or optimizer: {', '.join(unknown)}")

    print(f"fit benchmark: torch {torch.__version__}, device {opts.device}, {torch.get_num_threads()} threads; "
          f"fitted at two batch sizes, checked at others (rows print as they are measured, tables at the end)")
    peak_rows, batch_rows = [], []
    t0 = time.perf_counter()
    for name in names:
        for oname in optims:
            p, b = _one(name, oname, opts.device, opts.repeats)
            peak_rows += p
            batch_rows += b
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    print("\nWhole-step peak (parameters, gradients, optimizer state, buffers, activations), predicted vs measured "
          "(ratio = predicted / measured; goal within 5%):")
    print_table(("model / optimizer", "batch", "schedule", "predicted", "measured", "ratio"), peak_rows, left=3,
                rule=True)
    ratios = [float(r[-1]) for r in peak_rows]
    print(f"worst |ratio - 1| = {100 * max(abs(r - 1) for r in ratios):.1f}% over {len(ratios)} cases; within 5%: "
          f"{sum(abs(r - 1) <= 0.05 for r in ratios)}/{len(ratios)}")
    print("\nLargest batch on the grid that fits the device (margin 0), predicted vs measured (goal: equal or one "
          "grid step apart):")
    print_table(("model / optimizer", "device", "strategy", "predicted", "measured", "grid steps apart"),
                batch_rows, left=3, rule=True)
    steps = [None if r[-1] == "n/a" else int(r[-1]) for r in batch_rows]
    print(f"equal: {sum(a == 0 for a in steps)}/{len(steps)}, within one grid step: "
          f"{sum(a is not None and a <= 1 for a in steps)}/{len(steps)}")


def _one(name: str, oname: str, dev_name: str, repeats: int) -> tuple[list, list]:
    """The rows of one model with one optimizer."""
    from ..core import device, strategies
    from ..core.batch import at_batch
    from ..core.simulate import simulate
    from ..core.solver import solve
    from ..core.units import format_bytes
    from ..runtime import models
    from ..runtime.batch import profile_batches
    from ..runtime.fixed import make_optimizer
    from ..runtime.measure import measure
    from ..runtime.train.wrap import wrap

    fit_sizes, held_out, grid = SIZES[name]
    model = models.demo_model(name, device=dev_name)[0]
    opt = make_optimizer(oname, model.parameters())

    def make(b: int):
        return models.demo_model(name, batch=b, device=dev_name)[1:]

    def measured_peak(schedule, b: int) -> int:
        x, loss = make(b)
        return measure(wrap(model, schedule), x, loss, optimizer=opt, repeats=1).device_peak

    chain = profile_batches(model, make, fit_sizes, optimizer=opt, repeats=repeats, progress=False)
    label = f"{name} {oname}"
    peak_rows, batch_rows = [], []
    # 1. whole-step peak at held-out batch sizes
    for b in held_out:
        cb = at_batch(chain, b)
        sol = solve(cb)
        lo, hi = sol.min_budget, sol.store_all_peak
        cases = [("store_all", strategies.store_all(cb))]
        cases += [(f"optimal @{k}/3", sol.schedule(lo + k * (hi - lo) // 3)) for k in (1, 2)]
        for what, schedule in cases:
            pred = device.device_peak(simulate(cb, schedule))
            meas = measured_peak(schedule, b)
            peak_rows.append((label, str(b), what, format_bytes(pred), format_bytes(meas), f"{pred / meas:.3f}"))
            print("  peak:", *peak_rows[-1], flush=True)
    # 2. largest batch on a device where store-all runs out a third of the way up the grid
    mid = grid[len(grid) // 3]
    at_mid = at_batch(chain, mid)
    dev = device.device_peak(simulate(at_mid, strategies.store_all(at_mid))) + 1
    for s in device.BATCH_STRATEGIES:
        def fits(b: int, s: str = s) -> bool:
            cb = at_batch(chain, b)
            p = device.fit_point(cb, s, dev, margin=0.0)
            return measured_peak(p.schedule if p.fits else _smallest(cb, s), b) <= dev

        predicted = device.largest_batch(chain, dev, s, margin=0.0, batches=list(grid))
        pred_b = predicted.batch if predicted else None
        measured_b = _measured_largest(grid, pred_b, fits)
        apart = (abs(grid.index(pred_b) - grid.index(measured_b))
                 if pred_b is not None and measured_b is not None else None)
        batch_rows.append((label, format_bytes(dev), s, str(pred_b), str(measured_b),
                           "n/a" if apart is None else str(apart)))
        print("  largest batch:", *batch_rows[-1], flush=True)
    return peak_rows, batch_rows


def _measured_largest(grid: tuple[int, ...], start: int | None, fits) -> int | None:
    """The largest grid size whose measured step fits, walking from the predicted one (memory grows with the batch
    size, so the answer is where ``fits`` turns from True to False)."""
    i = grid.index(start) if start is not None else 0
    if fits(grid[i]):
        while i + 1 < len(grid) and fits(grid[i + 1]):
            i += 1
        return grid[i]
    while i > 0:
        i -= 1
        if fits(grid[i]):
            return grid[i]
    return None


def _smallest(chain, strategy: str):
    """The strategy's least-memory schedule (what is measured at a batch size where nothing is predicted to fit)."""
    from ..core import strategies
    from ..core.simulate import simulate
    from ..core.solver import solve

    if strategy == "store_all":
        return strategies.store_all(chain)
    if strategy == "checkpoint_sequential":
        return min((strategies.periodic(chain, n) for n in range(1, chain.length + 1)),
                   key=lambda s: simulate(chain, s).peak_memory)
    sol = solve(chain)
    return sol.schedule(sol.min_budget)
