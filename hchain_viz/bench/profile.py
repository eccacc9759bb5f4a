"""Benchmark ``profile``: how long profiling takes, and how well the profiled chain predicts a real step.

For each demo model: the profiler's wall time, then the store-all schedule's simulated peak memory and makespan
against a measured plain eager step (``measure``), with their ratios (predicted / measured).

    python -m hchain_viz bench profile [--models resnet_chain,mlp_chain] [--repeats 5] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

from . import positive_int, print_table


def run(args: list[str]) -> None:
    """Print one table row per demo model."""
    import torch

    from ..core import strategies
    from ..core.simulate import simulate
    from ..core.units import format_bytes, format_time
    from ..runtime import models
    from ..runtime.measure import measure
    from ..runtime.profile import profile

    parser = argparse.ArgumentParser(prog="hchain_viz bench profile", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(models.DEMOS), help="comma-separated demo names")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed repeats, for profiling and measuring")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args(args)
    if opts.threads:
        torch.set_num_threads(opts.threads)

    head = ("model", "stages", "profile", "pred peak", "meas peak", "peak ratio", "pred step", "meas step",
            "step ratio")
    rows = []
    for name in opts.models.split(","):
        model, x, loss_fn = models.demo_model(name.strip(), device=opts.device)
        t0 = time.perf_counter()
        chain = profile(model, x, loss_fn, repeats=opts.repeats, progress=False)
        wall = time.perf_counter() - t0
        trace = simulate(chain, strategies.store_all(chain))
        real = measure(model, x, loss_fn, repeats=opts.repeats)
        rows.append((name, str(chain.length), format_time(wall), format_bytes(trace.peak_memory),
                     format_bytes(real.peak_bytes), f"{trace.peak_memory / real.peak_bytes:.3f}",
                     format_time(trace.makespan), format_time(real.step_time),
                     f"{trace.makespan / real.step_time:.3f}"))
    print(f"profile benchmark: torch {torch.__version__}, device {opts.device}, {torch.get_num_threads()} threads, "
          f"{opts.repeats} repeats; ratio = predicted / measured (store-all vs a plain eager step)")
    print_table(head, rows, left=1)
