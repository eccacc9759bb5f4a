"""Benchmark of pipeline plans (docs/design.md §12): the plan against its two baselines, over memory limits.

``python -m hchain_viz bench pipeline [--layers 8] [--microbatches 8] [--rounds 3] [--measure-p 2 4]
[--no-measure]`` profiles a GPT-style decoder (``transformer_chain``: embed, ``--layers`` blocks, head; AdamW) at the
microbatch size, then for P = 2 and 4 and per-device memory limits from the least that fits to where nothing gets
faster prints the predicted step time of

- the plan (``plan_pipeline``: partition and per-stage schedules chosen together),
- baseline (i) ``balanced+uniform``: the time-balanced partition with store-all on every stage where that fits on
  every stage, else full per-layer recomputation on every stage,
- baseline (ii) ``balanced+per-stage``: the same partition, each stage with its fastest schedule that fits,

and splits the gain: (i)/(ii) is what per-stage schedules win, (ii)/plan what the partition wins. Then, unless
``--no-measure``, it runs each fitting plan on P gloo ranks on the CPU (P = 2 unless ``--measure-p`` says 4 or both)
for ``--rounds`` interleaved rounds (plan, (i), (ii), plan, ...; one warm-up step each) and prints the measured step
time (median over rounds; the noise is half the range over the median) beside the prediction. Peaks per rank are
predicted only (the CPU ranks' memory is not measured here).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import tempfile
import time
from typing import Any

from ..core.chain import Chain
from ..core.fixed import FixedMemory
from ..core.pipeline import Pipeline, PipelinePlan
from ..core.units import format_bytes, format_time
from . import positive_int, print_table

FRACTIONS = (0.0, 0.1, 0.25, 0.5, 1.0)  # of the way from the least per-device memory to where nothing gets faster
KINDS = ("optimal", "balanced+uniform", "balanced+per-stage")


def _model(layers: int, batch: int):
    from ..runtime.models import transformer_chain

    return transformer_chain(batch=batch, seq=64, dim=64, heads=4, layers=layers, vocab=256, dropout=0.0)


def _chain(layers: int, micro: int):
    import torch

    from ..runtime.profile import profile

    model, x, loss_fn = _model(layers, micro)
    opt = torch.optim.AdamW(model.parameters())
    return profile(model, x, loss_fn, optimizer=opt, progress=False)


def gpt2_chain(layers: int = 12, micro: int = 1) -> Chain:
    """A GPT-2-small-like decoder (hidden 768, 12 heads, seq 1024, vocab 50257) from ``Chain.transformer``'s
    analytic model at microbatch ``micro``: activations in 2 bytes, times from a 1e13 FLOP/s, 1e12 B/s roofline,
    fp32 parameters and gradients with AdamW's two moments, each stage owning its own weights (the LM head is not
    tied to the embedding: it lives on the last device)."""
    H, V, T = 768, 50257, 1024
    c = Chain.transformer(layers=layers, batch=micro, seq=T, hidden=H, heads=12, vocab=V, dtype_bytes=2, flops=1e13,
                          bandwidth=1e12)
    per_layer = {"ln_qkv": 3 * H * H + 5 * H, "attn.scores": 0, "attn.pv": 0, "attn.out": H * H + H,
                 "mlp.up": 4 * H * H + 4 * H + 2 * H, "mlp.down": 4 * H * H + H}
    params = [4 * ((V + T) * H if n == "embed" else V * H + 2 * H if n == "head" else per_layer[n.split(".", 2)[2]])
              for n in c.names]
    fixed = FixedMemory(params=sum(params), stage_grads=params, optimizer_state=2 * sum(params), optimizer="AdamW")
    return dataclasses.replace(c, fixed=fixed, meta={**c.meta, "times": "roofline estimate"})


def _plans(pipe: Pipeline, M: int, limit: int) -> dict[str, PipelinePlan | None]:
    base = pipe.baselines(M, limit)
    return {"optimal": pipe.plan(M, limit), **base}


def _worker(rank: int, world: int, init_file: str, out_dir: str, chain_json: str, layers: int, micro: int, M: int,
            limit: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from ..core.chain import Chain
    from ..runtime.pipeline import pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        pipe = Pipeline(Chain.from_json(chain_json), world)
        runs = {}
        for kind, plan in _plans(pipe, M, limit).items():
            if plan is None:
                continue
            model, x, loss_fn = _model(layers, micro * M)
            opt = torch.optim.AdamW(model.parameters())

            def loss(out, target):
                return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())

            run = pipeline(model, plan, loss)
            runs[kind] = (run, opt, x, loss_fn.target)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(rounds + 1):  # round 0 warms up
            for kind, (run, opt, x, target) in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                run.step(x if run.is_first else None, target=target if run.is_last else None)
                opt.step()
                opt.zero_grad()
                dist.barrier()
                if r:
                    times[kind].append(time.perf_counter() - t0)
        if rank == 0:
            torch.save(times, os.path.join(out_dir, "times.pt"))
    finally:
        dist.destroy_process_group()


def _measure(chain_json: str, layers: int, micro: int, M: int, limit: int, rounds: int,
             world: int) -> dict[str, list[float]]:
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), d, chain_json, layers, micro, M, limit, rounds),
                 nprocs=world)
        return torch.load(os.path.join(d, "times.pt"))


def _table(chain: Chain, P: int, M: int, measure: Any = None) -> None:
    """Print the predicted step times of the plan and both baselines over :data:`FRACTIONS` of the memory range;
    ``measure(limit)`` (optional) returns measured step times per plan kind at a limit."""
    pipe = Pipeline(chain, P)
    t0 = time.perf_counter()
    least = pipe.least_memory(M)
    top = max(pipe.plan(M, 2**60).peak, least)
    balanced = pipe.least_memory(M, bounds=pipe.baselines(M, 2**60)["balanced+per-stage"].bounds)
    solve_time = time.perf_counter() - t0
    rows, measured_rows = [], []
    for f in FRACTIONS:
        limit = int(least + f * (top - least))
        plans = _plans(pipe, M, limit)
        t = {k: (v.step_time if v else None) for k, v in plans.items()}
        u, s, o = t["balanced+uniform"], t["balanced+per-stage"], t["optimal"]
        rows.append((format_bytes(limit), f"{f:.2f}", format_time(o), format_time(u) if u else "does not fit",
                     format_time(s) if s else "does not fit", f"{u / s:.3f}x" if u and s else "-",
                     f"{s / o:.3f}x" if s else "-", " | ".join(format_bytes(x) for x in plans["optimal"].peaks)))
        for k, ts in (measure(limit) if measure else {}).items():
            med = statistics.median(ts)
            measured_rows.append((format_bytes(limit), k, format_time(t[k]), format_time(med), f"{med / t[k]:.2f}",
                                  f"±{100 * (max(ts) - min(ts)) / 2 / med:.0f}%"))
    print(f"\nP = {P}, M = {M}: least per-device memory {format_bytes(least)} (the balanced partition: "
          f"{format_bytes(balanced)}), nothing faster above {format_bytes(top)} (candidates and searches "
          f"{solve_time:.1f} s); predicted step times")
    print_table(("limit", "frac", "plan", "(i) balanced+uniform", "(ii) balanced+per-stage",
                 "per-stage gain (i)/(ii)", "partition gain (ii)/plan", "plan peaks per device"), rows)
    if measured_rows:
        print(f"\nP = {P} measured on {P} gloo CPU ranks, interleaved rounds (median; noise = half the range over "
              f"the median)")
        print_table(("limit", "plan", "predicted", "measured", "measured/predicted", "noise"), measured_rows, left=2)


def run(args: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m hchain_viz bench pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive_int, default=8, help="decoder blocks (default 8)")
    p.add_argument("--micro", type=positive_int, default=2, help="samples per microbatch (default 2)")
    p.add_argument("--microbatches", type=positive_int, default=8, help="M, microbatches per step (default 8)")
    p.add_argument("--rounds", type=positive_int, default=3, help="measured rounds per plan (default 3)")
    p.add_argument("--measure-p", type=int, nargs="+", choices=(2, 4), default=[2],
                   help="the stage counts P to measure on P gloo CPU ranks (default 2)")
    p.add_argument("--no-measure", action="store_true", help="predictions only (no gloo runs)")
    a = p.parse_args(args)
    print(f"bench pipeline: GPT-2-small-like analytic chain ({gpt2_chain().meta['model']}), 1F1B, fp32 weights "
          f"with AdamW, times from a roofline estimate")
    for P, M in ((4, 16), (8, 16)):
        _table(gpt2_chain(), P, M)
    chain = _chain(a.layers, a.micro)
    M = a.microbatches
    print(f"\nbench pipeline: transformer_chain({a.layers} blocks, dim 64, seq 64), microbatch {a.micro}, M = {M}, "
          f"1F1B, AdamW; fixed {format_bytes(chain.fixed.total_per_rank)} in all; stage times profiled on this CPU")
    for P in (2, 4):
        measure = None
        if P in a.measure_p and not a.no_measure:
            def measure(limit: int, P: int = P) -> dict[str, list[float]]:
                return _measure(chain.to_json(), a.layers, a.micro, M, limit, a.rounds, P)
        _table(chain, P, M, measure)
