"""Benchmark of pipeline plans (docs/design.md §12): the plan against its two baselines, over memory limits.

``python -m hchain_viz bench pipeline [--model gpt2|llama|toy] [--layers 8] [--micro N] [--microbatches 8] [--schedule
1F1B|interleaved] [--chunks 2] [--rounds 3] [--measure-p 2 4] [--fractions F ...] [--no-measure] [--no-analytic]`` plans
every table for ``--schedule`` (1F1B, or interleaved 1F1B with ``--chunks`` v per device, default 2). It first predicts
step times on a GPT-2-small-like analytic chain (P = 4, 8; not with ``--no-analytic``), then profiles ``--model`` at the
microbatch size with AdamW: a tiny random Hugging Face GPT-2 (the default) or LLaMA (hidden 128, 4 heads, seq 128, vocab
2048, eager attention, no dropout), or the toy ``transformer_chain``. For P = 2 and 4 and per-device limits from the
least that fits to where nothing gets faster (``--fractions`` of that range) it prints the predicted step time and peaks
of the plan (``plan_pipeline``), of baseline (i) ``balanced+uniform`` (the time-balanced partition, store-all on every
stage where that fits everywhere, else full per-layer recomputation) and of (ii) ``balanced+per-stage`` (that partition,
each stage its fastest schedule that fits), and splits the gain: (i)/(ii) from per-stage schedules, (ii)/plan from the
partition. Each P in ``--measure-p`` (unless ``--no-measure``) then runs on P gloo CPU ranks (``hcv.pipeline``):
``--rounds`` interleaved rounds after a warm-up (plan, (i), (ii), plan, ...; the median step, ``opt.step()`` included;
noise = half the range over the median), then one step of each plan under ``MemoryMeter``: each rank's measured peak
beside its prediction (``metered_peak``), and the gain split measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..core.chain import Chain
from ..core.fixed import FixedMemory
from ..core.pipeline import Pipeline, PipelinePlan
from ..core.units import format_bytes, format_time
from ..errors import HChainError, InvalidPipeline, PipelineDoesNotFit
from . import positive_int, print_table

FRACTIONS = (0.0, 0.1, 0.25, 0.5, 1.0)  # of the way from the least per-device memory to where nothing gets faster
KINDS = ("optimal", "balanced+uniform", "balanced+per-stage")
MODELS = ("gpt2", "llama", "toy")
HF_VOCAB, TOY_VOCAB, HEADS = 2048, 256, 4


@dataclasses.dataclass(frozen=True)
class Setup:
    """The benchmarked model, which every rank builds alike (same seed): ``model`` one of :data:`MODELS`, its
    ``layers`` blocks ``hidden`` wide on ``seq`` tokens, ``micro`` samples per microbatch, ``M`` microbatches."""

    model: str
    layers: int
    hidden: int
    seq: int
    micro: int
    M: int
    schedule: str = "1F1B"
    chunks: int = 1

    def pipe(self, chain: Chain, P: int) -> Pipeline:
        """The planner for ``chain`` on ``P`` devices under this setup's pipeline schedule."""
        return Pipeline(chain, P, self.schedule, chunks=self.chunks if self.schedule == "interleaved" else None)

    def build(self, batch: int) -> tuple[Any, Any, Any]:
        """``(model, token ids, target)`` for ``batch`` samples (an HF decoder's target is its input ids)."""
        from ..runtime.models import hf_model, transformer_chain

        if self.model == "toy":
            model, x, loss_fn = transformer_chain(batch=batch, seq=self.seq, dim=self.hidden, heads=HEADS,
                                                  layers=self.layers, vocab=TOY_VOCAB, dropout=0.0)
            return model, x, loss_fn.target
        no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if self.model == "gpt2" else {}
        model, inputs, _ = hf_model(self.model, batch=batch, seq=self.seq, layers=self.layers, hidden=self.hidden,
                                    heads=HEADS, vocab=HF_VOCAB, attn_implementation="eager", **no_dropout)
        return model, inputs["input_ids"], inputs["input_ids"]

    def stages(self, model: Any, microbatch: Any) -> list:
        """The chain's ``(name, module)`` stages: an HF model's from its graph, as ``profile`` cut it."""
        from ..runtime.stages import sequentialize

        return sequentialize(model) if self.model == "toy" else sequentialize(model, microbatch)

    def describe(self) -> str:
        name = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "toy": "transformer_chain"}[self.model]
        vocab = TOY_VOCAB if self.model == "toy" else HF_VOCAB
        return (f"{name} ({self.layers} layers, hidden {self.hidden}, {HEADS} heads, seq {self.seq}, vocab {vocab}, "
                f"random weights, no dropout), microbatch {self.micro}, M = {self.M}, {self.schedule_name()}, AdamW")

    def schedule_name(self) -> str:
        return f"interleaved 1F1B, v = {self.chunks}" if self.schedule == "interleaved" else self.schedule


def _xent(out: Any, target: Any) -> Any:
    """Cross-entropy of the logits (an HF output's, when profiling the whole model) against ``target``'s ids."""
    import torch

    logits = out["logits"] if isinstance(out, Mapping) else out
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten())


def _chain(setup: Setup) -> Chain:
    """The model profiled on one microbatch, with AdamW."""
    import torch

    from ..runtime.profile import profile

    model, x, target = setup.build(setup.micro)
    opt = torch.optim.AdamW(model.parameters())
    return profile(model, x, lambda out: _xent(out, target), optimizer=opt, progress=False)


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


def _worker(rank: int, world: int, init_file: str, out_dir: str, setup: Setup, chain_json: str, limits: list[int],
            rounds: int) -> None:
    """One rank: at each limit, every plan that fits timed in interleaved rounds, then one metered step each. One
    model (and its AdamW) serves every plan: ``hcv.pipeline`` wraps its modules without changing them."""
    import torch
    import torch.distributed as dist

    from ..runtime.memtrack import MemoryMeter
    from ..runtime.pipeline import metered_peak, pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        pipe = setup.pipe(Chain.from_json(chain_json), world)
        model, x, target = setup.build(setup.micro * setup.M)
        stages = setup.stages(model, x.chunk(setup.M)[0])
        opt = torch.optim.AdamW(model.parameters())
        record: dict[int, dict[str, Any]] = {}
        for limit in limits:
            runs = {kind: (pipeline(model, plan, _xent, stages=stages), plan)
                    for kind, plan in _plans(pipe, setup.M, limit).items() if plan is not None}

            def step(run: Any) -> None:
                run.step(x if run.is_first else None, target=target if run.is_last else None)

            times: dict[str, list[float]] = {k: [] for k in runs}
            for r in range(rounds + 1):  # round 0 warms up (torch's first step also infers shapes)
                for kind, (run, _) in runs.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    step(run)
                    opt.step()
                    opt.zero_grad()
                    dist.barrier()
                    if r:
                        times[kind].append(time.perf_counter() - t0)
            peaks = {}
            for kind, (run, plan) in runs.items():
                with MemoryMeter("cpu") as meter:
                    step(run)
                opt.step()
                opt.zero_grad()
                peaks[kind] = (meter.peak, metered_peak(plan, rank))
            record[limit] = {"times": times, "peaks": peaks}
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(setup: Setup, chain_json: str, limits: list[int], world: int, rounds: int) -> dict[int, dict[str, Any]]:
    """Run every fitting plan at each limit on ``world`` gloo ranks: per limit, ``times`` (rank 0's step times per
    plan kind) and ``peaks`` (per kind, each rank's ``(measured, predicted)`` bytes)."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), d, setup, chain_json, limits, rounds), nprocs=world)
        ranks = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
    return {limit: {"times": ranks[0][limit]["times"],
                    "peaks": {k: [r[limit]["peaks"][k] for r in ranks] for k in ranks[0][limit]["peaks"]}}
            for limit in limits}


def _gain(slow: float | None, fast: float | None) -> str:
    return f"{slow / fast:.3f}x" if slow and fast else "-"


def _split(plan: PipelinePlan | None) -> str:
    """The chain stages per pipeline stage, ``4+6`` (interleaved: v·P of them, chunk c of device r the
    ``c·P + r``-th)."""
    return "+".join(str(st.end - st.first) for st in plan.stages) if plan else "-"


def _table(pipe: Pipeline, M: int, fractions: tuple[float, ...] = FRACTIONS,
           measure: Callable[[list[int]], dict[int, dict[str, Any]]] | None = None) -> None:
    """Print the predicted step times and peaks of ``pipe``'s plan and both baselines over ``fractions`` of the
    memory range (interleaved: beside them, the 1F1B plan's at the same limit); ``measure(limits)`` (optional) gives
    the measured times and peaks per limit (see :func:`measure`)."""
    P = pipe.devices
    what = f" (interleaved, v = {pipe.chunks})" if pipe.kind == "interleaved" else ""
    t0 = time.perf_counter()
    least = pipe.least_memory(M)
    top = max(pipe.plan(M, 2**60).peak, least)
    balanced = pipe.least_memory(M, bounds=pipe.baselines(M, 2**60)["balanced+per-stage"].bounds)
    solve_time = time.perf_counter() - t0
    limits = sorted({int(least + f * (top - least)) for f in fractions})
    one_f1b = Pipeline(pipe.chain, P, bandwidth=pipe.bandwidth) if what else None
    rows, predicted = [], {}
    for limit in limits:
        plans = predicted[limit] = _plans(pipe, M, limit)
        t = {k: (v.step_time if v else None) for k, v in plans.items()}
        u, s, o = t["balanced+uniform"], t["balanced+per-stage"], t["optimal"]
        beside = []
        if one_f1b is not None:
            try:
                beside = [format_time(one_f1b.plan(M, limit).step_time)]
            except PipelineDoesNotFit:
                beside = ["does not fit"]
        rows.append((format_bytes(limit), f"{(limit - least) / max(top - least, 1):.2f}", format_time(o), *beside,
                     format_time(u) if u else "does not fit", format_time(s) if s else "does not fit", _gain(u, s),
                     _gain(s, o), f"{_split(plans['optimal'])} / {_split(plans['balanced+per-stage'])}",
                     " | ".join(format_bytes(x) for x in plans["optimal"].peaks)))
    print(f"\nP = {P}{what}, M = {M}: least per-device memory {format_bytes(least)} (the balanced partition: "
          f"{format_bytes(balanced)}), nothing faster above {format_bytes(top)} (candidates and searches "
          f"{solve_time:.1f} s); predicted step times")
    print_table(("limit", "frac", "plan", *(["1F1B plan"] if what else []), "(i) balanced+uniform",
                 "(ii) balanced+per-stage", "per-stage gain (i)/(ii)", "partition gain (ii)/plan",
                 "stages per chunk plan / balanced" if what else "stages per device plan / balanced",
                 "plan peaks per device"), rows)
    if measure is None:
        return
    t0 = time.perf_counter()
    data = measure(limits)
    wall = time.perf_counter() - t0
    rows, gains = [], []
    for limit in limits:
        med = {}
        for kind, ts in data[limit]["times"].items():
            plan = predicted[limit][kind]
            med[kind] = statistics.median(ts)
            peaks = data[limit]["peaks"][kind]
            rows.append((format_bytes(limit), kind, format_time(plan.step_time), format_time(med[kind]),
                         f"{med[kind] / plan.step_time:.2f}", f"±{100 * (max(ts) - min(ts)) / 2 / med[kind]:.0f}%",
                         " | ".join(format_bytes(p) for _, p in peaks), " | ".join(format_bytes(m) for m, _ in peaks),
                         " | ".join(f"{m / p:.3f}{'!' if m > p else ''}" for m, p in peaks)))
        t = {k: (v.step_time if v else None) for k, v in predicted[limit].items()}
        gains.append((format_bytes(limit), _gain(t["balanced+uniform"], t["balanced+per-stage"]),
                      _gain(med.get("balanced+uniform"), med.get("balanced+per-stage")),
                      _gain(t["balanced+per-stage"], t["optimal"]),
                      _gain(med.get("balanced+per-stage"), med.get("optimal")),
                      _gain(t["balanced+uniform"] or t["balanced+per-stage"], t["optimal"]),
                      _gain(med.get("balanced+uniform") or med.get("balanced+per-stage"), med.get("optimal"))))
    print(f"\nP = {P}{what} measured on {P} gloo CPU ranks ({wall:.0f} s): step times, interleaved rounds (median; "
          f"noise = half the range over the median; opt.step() included, not predicted); each rank's peak over one "
          f"step above its weights and AdamW state, predicted (metered_peak) and measured (MemoryMeter; ! marks one "
          f"above its prediction)")
    print_table(("limit", "plan", "predicted", "measured", "measured/predicted", "noise", "predicted peaks",
                 "measured peaks", "measured/predicted peaks"), rows, left=2)
    print(f"\nP = {P}{what}: the gain split, predicted and measured (medians); 'total' is over (i), or over (ii) "
          f"where (i) does not fit")
    print_table(("limit", "per-stage (i)/(ii) predicted", "measured", "partition (ii)/plan predicted", "measured",
                 "total predicted", "measured"), gains)


def run(args: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m hchain_viz bench pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="gpt2",
                   help="gpt2 or llama (a tiny random Hugging Face decoder; needs transformers) or toy "
                        "(transformer_chain); default gpt2")
    p.add_argument("--layers", type=positive_int, default=8, help="decoder blocks (default 8)")
    p.add_argument("--hidden", type=positive_int, help="hidden size (default 128; toy 64)")
    p.add_argument("--seq", type=positive_int, help="tokens per sample (default 128; toy 64)")
    p.add_argument("--micro", type=positive_int, help="samples per microbatch (default 1; toy 2)")
    p.add_argument("--microbatches", type=positive_int, default=8, help="M, microbatches per step (default 8)")
    p.add_argument("--schedule", choices=("1F1B", "interleaved"), default="1F1B",
                   help="the pipeline schedule: 1F1B (torch's Schedule1F1B, the default) or interleaved "
                        "(ScheduleInterleaved1F1B, --chunks per device)")
    p.add_argument("--chunks", type=positive_int, help="interleaved: model chunks per device, v (default 2)")
    p.add_argument("--rounds", type=positive_int, default=3, help="measured rounds per plan (default 3)")
    p.add_argument("--measure-p", type=int, nargs="+", choices=(2, 4), default=[2],
                   help="the stage counts P to measure on P gloo CPU ranks (default 2)")
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS),
                   help="limits as fractions of the way from the least memory to where nothing gets faster "
                        f"(default {' '.join(map(str, FRACTIONS))})")
    p.add_argument("--no-measure", action="store_true", help="predictions only (no gloo runs)")
    p.add_argument("--no-analytic", action="store_true", help="skip the analytic GPT-2-small tables")
    a = p.parse_args(args)
    if any(not 0.0 <= f <= 1.0 for f in a.fractions):
        p.error("--fractions are between 0 (the least memory) and 1 (where nothing gets faster)")
    if a.chunks is not None and a.schedule != "interleaved":
        p.error("--chunks (model chunks per device) needs --schedule interleaved")
    if a.chunks == 1:
        p.error("--chunks is at least 2 (one chunk per device is --schedule 1F1B)")
    toy = a.model == "toy"
    if not toy:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise HChainError(f"--model {a.model} needs transformers (pip install transformers), or use --model "
                              f"toy") from None
    setup = Setup(a.model, a.layers, a.hidden or (64 if toy else 128), a.seq or (64 if toy else 128),
                  a.micro or (2 if toy else 1), a.microbatches, a.schedule,
                  (a.chunks or 2) if a.schedule == "interleaved" else 1)
    if not a.no_analytic:
        print(f"bench pipeline: GPT-2-small-like analytic chain ({gpt2_chain().meta['model']}), "
              f"{setup.schedule_name()}, fp32 weights with AdamW, times from a roofline estimate")
        for P, M in ((4, 16), (8, 16)):
            try:
                pipe = setup.pipe(gpt2_chain(), P)
            except InvalidPipeline as e:  # more stages (devices x chunks) than layers
                print(f"\nP = {P}: {e}")
                continue
            _table(pipe, M)
    chain = _chain(setup)
    print(f"\nbench pipeline: {setup.describe()}; fixed {format_bytes(chain.fixed.total_per_rank)} in all; stage "
          f"times profiled on this CPU ({chain.length} stages)")
    for P in (2, 4):
        try:
            pipe = setup.pipe(chain, P)
        except InvalidPipeline as e:  # more stages (devices x chunks) than layers
            print(f"\nP = {P}: {e}")
            continue
        meas = None
        if P in a.measure_p and not a.no_measure:
            def meas(limits: list[int], P: int = P) -> dict[int, dict[str, Any]]:
                return measure(setup, chain.to_json(), limits, P, a.rounds)
        _table(pipe, setup.M, tuple(a.fractions), meas)
