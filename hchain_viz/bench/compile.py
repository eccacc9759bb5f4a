"""Benchmark ``compile``: compiled stages under the optimal schedule against torch.compile's activation_memory_budget.

    python -m hchain_viz bench compile [--models resnet_chain,nanogpt] [--rounds 5] [--threads 1] [--small]
                                       [--budgets 1.0,0.7,0.5,0.3,0.1,0.0]

What it measures and how: NOTE [what bench compile measures] below; the runs: docs/benchmarks.md, docs/compile.md.
"""

# NOTE [what bench compile measures]
# For each demo model, all in one process, CPU, measured (never predicted) peaks and step times:
#
# - ``torch.compile(model)`` with ``torch._functorch.config.activation_memory_budget`` at each budget (1.0 .. 0.0),
#   bound to its compiled graph by a backend that sets the budget while AOTAutograd partitions;
# - the compiled-stage optimal schedule: ``profile(model, x, compile=True)``, solved, wrapped with ``compile=True``;
#   for each compile budget, the fastest of a few candidate schedules whose MEASURED peak is at most compile's;
# - the eager optimal schedule at the same peak, for reference;
# - gradients of one seeded step (dropout on, where the model has it): compile at each budget against its own budget
#   1.0 graph (same random stream), the compiled-stage schedule against the same compiled stages run without a
#   schedule, and both against eager.
#
# Step times are medians of interleaved rounds (shuffled order each round, so load on a shared machine hits every
# configuration alike), with the spread (max - min over rounds, relative to the median); a speedup is the median over
# rounds of the ratio of the two steps run in the same round.
#
# ``--native``: instead (models resnet_chain and nanoGPT cut by module, Hugging Face's GPT-2 at sub-layer
# granularity, as ``NATIVE_CUT`` says or ``--granularity``; sizes from ``NATIVE``, changed with ``--set gpt2.seq=128``),
# the schedule applied in its native form (``hcv.apply(model, schedule, native=True)``: non-reentrant checkpoint
# regions) and the whole model compiled by ``torch.compile`` (inductor), against ``torch.compile``'s
# ``activation_memory_budget`` at equal measured memory (the allocator-event meter sees compiled code). Candidates are
# the single-level optimum's schedules (``solve(chain, single_level=True)``: each stage recomputed at most once, the
# schedules torch.compile runs as scheduled, ``core/regions.py``, NOTE [compiled memory]) at ``--candidates``
# budgets spread from its least to store-all, solved on the chain profiled with compiled stages (``--chain compiled``,
# the default: its saved tensors are inductor's, fewer than eager's), each applied to its own copy of the model and
# compiled once; per compile budget, the fastest whose measured peak is at most compile's. ``--forms`` (default
# ``plain,selective``): candidates in each stage form, the selective ones (``apply(..., selective=...)``: stages
# outside the regions save only their matrix products' and convolutions' outputs) solved on the chain profiled with
# ``selective=True`` and predicted by ``selective_chain``. ``meas/pred`` is the measured peak over ``compiled_peak``
# (the simulator's peak of that form plus the parameter gradients the compiled backward holds). ``--device cuda`` runs
# it on a GPU (``bench gpu``'s native section).
# Compiled graphs are cached on disk (``TORCHINDUCTOR_CACHE_DIR``, default ``~/.cache/hchain_viz/inductor``; FX graph
# and AOTAutograd caches on), so a rerun compiles little.

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any, NamedTuple

import torch
from torch import nn

from . import positive_int, print_table

SIZES = {  # CPU-sized demos (compiling is the slow part on a small machine)
    "resnet_chain": dict(batch=8, image=32, width=16, blocks=(1, 1, 1, 1)),
    "nanogpt": dict(batch=4, seq=64, dim=64, heads=4, layers=4, vocab=128, dropout=0.1),
    "transformer_chain": dict(batch=4, seq=64, dim=64, layers=4, dropout=0.1),
}
# --native: sizes where one eager step takes >= 100 ms on one CPU thread, deep enough (6-8 blocks) that a schedule
# has room below compile's own knob, narrow enough to compile in minutes on a small machine
NATIVE = {
    "resnet_chain": dict(batch=16, image=64, width=16, blocks=(3, 3)),
    "nanogpt": dict(batch=8, seq=128, dim=64, heads=4, layers=8, vocab=256, dropout=0.1),
    "gpt2": dict(batch=8, seq=128, hidden=64, heads=4, layers=8, vocab=256),
}
# --native: how each model is cut (default: by module); --granularity overrides
NATIVE_CUT = {"gpt2": "sublayer"}
SMALL = {
    "gpt2": dict(batch=2, seq=16, hidden=32, heads=2, layers=2, vocab=64),
    "resnet_chain": dict(batch=2, image=16, width=8, blocks=(1, 1)),
    "nanogpt": dict(batch=2, seq=16, dim=32, heads=2, layers=2, vocab=64, dropout=0.1),
    "transformer_chain": dict(batch=2, seq=16, dim=32, layers=2, dropout=0.1),
}


def run(args: list[str]) -> None:
    """Print, per demo model, the comparison table and a summary line."""
    import torch._dynamo

    parser = argparse.ArgumentParser(prog="hchain_viz bench compile", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet_chain,nanogpt", help="comma-separated demo names")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved timing rounds (median taken)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--budgets", default="1.0,0.7,0.5,0.3,0.1,0.0", help="activation_memory_budget values")
    parser.add_argument("--small", action="store_true", help="tiny models, 2 rounds (a quick check)")
    parser.add_argument("--stage-budgets", default=None, metavar="B,B,...",
                        help="instead: per-stage partitioner budgets (compile={'activation_memory_budget': b}), each "
                             "profiled: what the compiled stages save and their times")
    parser.add_argument("--native", action="store_true",
                        help="the schedule in its native form compiled whole, against activation_memory_budget")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE",
                        help="--native: change a model's size, e.g. --set gpt2.seq=128 (repeatable)")
    parser.add_argument("--chain", choices=("compiled", "eager"), default="compiled",
                        help="--native: the chain the schedules are solved on and predicted by: profiled with "
                             "compiled stages (what inductor saves) or eager")
    parser.add_argument("--granularity", choices=("module", "sublayer"), default=None,
                        help="--native: how every model is cut (default: NATIVE_CUT, GPT-2 at sublayer, the demos "
                             "by module)")
    parser.add_argument("--candidates", type=positive_int, default=6,
                        help="--native: DP schedules compiled (least budget to store-all), per form")
    parser.add_argument("--forms", default="plain,selective",
                        help="--native: the stage forms whose schedules are candidates: plain (each stage saves what "
                             "its compiled graph saves) and selective (only matrix products' and convolutions' "
                             "outputs, the rest recomputed in its backward: apply(..., selective=True))")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="--native: where the models run (cuda: peaks from the CUDA allocator, steps "
                             "synchronized; pass --threads 0 and GPU-sized --set values)")
    opts = parser.parse_args(args)
    if opts.device == "cuda" and not (opts.native and torch.cuda.is_available()):
        raise SystemExit("--device cuda: only with --native, on a machine where torch sees a CUDA GPU")
    if opts.native:
        _cache_on_disk()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    budgets = [float(b) for b in opts.budgets.split(",")]
    rounds = 2 if opts.small else opts.rounds
    # Every compiled configuration of a model shares the code objects of its modules: let Dynamo keep them all.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    print(f"compile benchmark: torch {torch.__version__}, {opts.device}, {torch.get_num_threads()} thread(s), "
          f"median of {rounds} interleaved rounds (spread: max-min over rounds / median); peaks measured by "
          f"hchain_viz.measure (allocator: activations + input); the machine may be shared")
    if opts.stage_budgets:
        for name in [n.strip() for n in opts.models.split(",")]:
            _stage_budgets(name, (SMALL if opts.small else SIZES).get(name, {}),
                           [float(b) for b in opts.stage_budgets.split(",")])
        return
    summary = []
    native_sizes = _sizes(NATIVE, opts.set)
    for name in [n.strip() for n in opts.models.split(",")]:
        sizes = (SMALL if opts.small else native_sizes if opts.native else SIZES).get(name, {})
        summary.append(_native(name, sizes, budgets, rounds, opts.candidates, opts.chain, opts.granularity,
                               opts.device, _forms(opts.forms))
                       if opts.native
                       else _one_model(name, sizes, budgets, rounds))
    print()
    for line in summary:
        print(line)


def _forms(text: str) -> tuple[bool, ...]:
    """``--forms``: per form, whether its stages are selective."""
    known = {"plain": False, "selective": True}
    names = [f.strip() for f in text.split(",") if f.strip()]
    if not names or any(f not in known for f in names):
        raise SystemExit(f"--forms {text!r}: choose from plain, selective (comma-separated)")
    return tuple(known[f] for f in dict.fromkeys(names))


def _cache_on_disk() -> None:
    """Compiled graphs cached on disk across runs (inductor's FX graph cache and AOTAutograd's cache)."""
    import os

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/hchain_viz/inductor"))
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True


def _sizes(base: dict, changes: list[str]) -> dict:
    """``base`` with ``MODEL.KEY=VALUE`` changes (integers, floats or a tuple of integers such as ``1,1``)."""
    out = {k: dict(v) for k, v in base.items()}
    for change in changes:
        try:
            target, value = change.split("=", 1)
            name, key = target.split(".", 1)
        except ValueError:
            raise SystemExit(f"--set {change!r}: write MODEL.KEY=VALUE, e.g. gpt2.seq=128") from None
        parsed: Any = tuple(int(v) for v in value.split(",")) if "," in value else (
            float(value) if "." in value else int(value))
        out.setdefault(name, {})[key] = parsed
    return out


def _load(name: str, sizes: dict, device: str = "cpu") -> tuple[nn.Module, Any, Any, Any]:
    """(model, input, loss_fn, caller) on ``device``: a demo model, or ``gpt2`` (Hugging Face, called by keywords:
    ``caller(m)`` is a module that calls ``m(**batch)``)."""
    import warnings

    from ..runtime import models
    from ..runtime.measure import to_device

    if name == "gpt2":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, x, loss_fn = models.hf_model("gpt2", attn_implementation="eager", **sizes)
        model.config.use_cache = False
        return model.to(device), to_device(x, torch.device(device)), loss_fn, _Keywords
    return (*models.demo_model(name, device=device, **sizes), lambda m: m)


class _Keywords(nn.Module):
    """Calls a Hugging Face model (or its compiled form) as Hugging Face code does: ``model(**batch)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> Any:
        return self.model(**batch)


def _one_model(name: str, sizes: dict, budgets: list[float], rounds: int) -> str:
    from ..core.solver import solve
    from ..core.units import format_bytes, format_time
    from ..runtime import models
    from ..runtime.compiled import budget_backend, compile_options, compile_stage
    from ..runtime.measure import measure
    from ..runtime.profile import profile
    from ..runtime.stages import sequentialize
    from ..runtime.train.wrap import wrap

    model, x, loss_fn = models.demo_model(name, **sizes)
    t0 = time.perf_counter()
    # torch.compile at each budget
    compiled = {b: torch.compile(model, backend=budget_backend(b)) for b in budgets}
    c_peak = {b: measure(m, x, loss_fn, repeats=1).peak_bytes for b, m in compiled.items()}
    # compiled stages and eager, profiled and solved
    options = compile_options(True)
    chains = {"compiled": profile(model, x, loss_fn, compile=True, progress=False),
              "eager": profile(model, x, loss_fn, progress=False)}
    sols = {k: solve(c) for k, c in chains.items()}
    # candidate schedules per kind: the optimum at each compile peak and a little below (measured may exceed
    # predicted), and the least-memory one; measured once each
    cands: dict[str, dict[tuple, tuple[Any, int, Any]]] = {"compiled": {}, "eager": {}}
    for kind, sol in sols.items():
        targets = [f * p for p in c_peak.values() for f in (1.0, 0.95, 0.9, 0.8)] + [sol.min_budget]
        for t in sorted(set(int(t) for t in targets if t >= sol.min_budget)):
            s = sol.schedule(t)
            if s.ops in cands[kind]:
                continue
            w = wrap(model, s, compile=True if kind == "compiled" else False)
            cands[kind][s.ops] = (w, measure(w, x, loss_fn, repeats=1).peak_bytes, s)
    setup = time.perf_counter() - t0

    modules = [model, *compiled.values()] + [w for k in cands for w, _, _ in cands[k].values()]
    stats = _interleaved(modules, x, loss_fn, rounds)
    t_of = {id(m): st for m, st in zip(modules, stats)}

    # gradients with dropout: compile vs its own budget 1.0; compiled stages scheduled vs unscheduled; vs eager
    ref_eager = _grads(model, model, x, loss_fn)
    stages = [s for _, s in sequentialize(model, x)]
    plain_compiled = _Chained([compile_stage(s, options, len(stages)) for s in stages])
    ref_stages = _grads(model, plain_compiled, x, loss_fn)
    ref_c1 = _grads(model, compiled[1.0], x, loss_fn) if 1.0 in compiled else None

    def best(kind: str, limit: int) -> tuple[Any, int, Any] | None:
        fits = [c for c in cands[kind].values() if c[1] <= limit]
        return min(fits, key=lambda c: t_of[id(c[0])][0]) if fits else None

    eager_t = t_of[id(model)]
    head = ("budget", "compile peak", "compile time", "grad vs c@1.0", "grad vs eager", "ours peak", "meas/pred",
            "ours time", "speedup", "grad vs unsched.", "grad vs eager", "eager-opt peak", "eager-opt time")
    rows, speedups, ratios = [], [], []
    for b in budgets:
        m = compiled[b]
        ct = t_of[id(m)]
        g = _grads(model, m, x, loss_fn)
        row = [f"{b:.1f}", format_bytes(c_peak[b]), _fmt_t(ct, format_time),
               "-" if ref_c1 is None else _err(g, ref_c1), _err(g, ref_eager)]
        ours = best("compiled", c_peak[b])
        if ours is None:
            row += ["(none fits)", "", "", "", "", ""]
        else:
            w, peak, s = ours
            pred = _predicted(chains["compiled"], s)
            ot = t_of[id(w)]
            speedups.append(_speedup(ct, ot))
            ratios.append(peak / pred)
            gw = _grads(model, w, x, loss_fn)
            row += [format_bytes(peak), f"{peak / pred:.3f}", _fmt_t(ot, format_time), f"{speedups[-1]:.2f}x",
                    _err(gw, ref_stages), _err(gw, ref_eager)]
        eo = best("eager", c_peak[b])
        row += ["(none fits)", ""] if eo is None else [format_bytes(eo[1]), _fmt_t(t_of[id(eo[0])], format_time)]
        rows.append(row)
    low = min(cands["compiled"].values(), key=lambda c: c[1])
    print()
    print(f"{name} {sizes}: {chains['compiled'].length} stages; eager step {_fmt_t(eager_t, format_time)}; "
          f"setup (compiling, profiling, measuring) {setup:.0f} s")
    print_table(head, rows, left=1)
    print(f"  lowest compiled-stage schedule: {format_bytes(low[1])} measured in "
          f"{_fmt_t(t_of[id(low[0])], format_time)} (compile's lowest: {format_bytes(min(c_peak.values()))}); "
          f"store-all compiled stages predicted {format_bytes(sols['compiled'].store_all_peak)} vs eager "
          f"{format_bytes(sols['eager'].store_all_peak)}")
    if not speedups:
        return f"{name}: no compiled-stage schedule fits under any compile peak"
    return (f"{name}: compiled-stage optimum vs torch.compile budget at equal measured memory: mean speedup "
            f"{statistics.mean(speedups):.2f}x (min {min(speedups):.2f}x, max {max(speedups):.2f}x, "
            f"{len(speedups)} points); measured/predicted peak {min(ratios):.3f}..{max(ratios):.3f}")


def _native(name: str, sizes: dict, budgets: list[float], rounds: int, n_candidates: int,
            chain_kind: str = "compiled", cut: str | None = None, device: str = "cpu",
            forms: tuple[bool, ...] = (False, True)) -> str:
    """The native form compiled whole (inductor) against torch.compile's activation_memory_budget, measured.
    ``cut``: ``"module"`` or ``"sublayer"`` (None: as ``NATIVE_CUT`` says); ``forms``: per stage form, whether
    selective (``apply(..., selective=True)``), each profiled and solved on its own chain."""
    import copy

    from ..core.regions import compiled_peak, compiled_schedule, selective_chain
    from ..core.simulate import simulate
    from ..core.solver import solve
    from ..core.units import format_bytes, format_time
    from ..runtime.compiled import budget_backend
    from ..runtime.measure import measure
    from ..runtime.profile import profile
    from ..runtime.stages import sequentialize
    from ..runtime.train.inplace import apply
    from ..runtime.train.native import grad_bytes

    model, x, loss_fn, caller = _load(name, sizes, device)
    granularity = {None: NATIVE_CUT.get(name), "module": None}.get(cut, cut)
    t0 = time.perf_counter()
    compiled = {b: caller(torch.compile(model, backend=budget_backend(b))) for b in budgets}
    c_peak = {b: measure(m, x, loss_fn, repeats=1).peak_bytes for b, m in compiled.items()}
    t_knob = time.perf_counter() - t0
    _progress(f"{name}: {len(budgets)} knob graphs compiled and measured in {t_knob:.0f} s")
    # Compiled whole, each stage saves what inductor's partitioner keeps (less than eager: fused pointwise ops,
    # boolean dropout masks); the chain profiled with compiled stages says so, and solves for compiled speed.
    grads = grad_bytes([m for _, m in sequentialize(model, x, granularity=granularity)])
    chain = profile(model, x, loss_fn, granularity=granularity, compile=chain_kind == "compiled", progress=False)
    cands: dict[tuple, _Candidate] = {}
    for selective in forms:
        # the selective form: its stages outside regions selective, predicted by the mix of both profiles
        picked = profile(model, x, loss_fn, granularity=granularity, compile=True, selective=True,
                         progress=False) if selective else None
        sol = solve(picked or chain, single_level=True)  # what torch.compile runs as scheduled (core/regions.py)
        form = "selective" if selective else "plain"
        _progress(f"{name}: {form} stages profiled ({chain.length}) and solved at {time.perf_counter() - t0:.0f} s")
        lo, hi = sol.min_budget, sol.store_all_peak
        for k in range(n_candidates):
            s = compiled_schedule(sol.schedule(lo + (hi - lo) * k // max(1, n_candidates - 1)))
            if (selective, s.ops) in cands:
                continue
            twin = copy.deepcopy(model)
            sequentialize(twin, x, granularity=granularity)  # the copy's own cut (a Sequential's may not be children)
            apply(twin, s, chain=chain, native=True, selective=picked or False)
            cm = caller(torch.compile(twin))
            cands[selective, s.ops] = _Candidate(cm, measure(cm, x, loss_fn, repeats=1).peak_bytes, s, twin,
                                                 compiled_peak(chain, s, grads, picked),
                                                 selective_chain(chain, picked, s), form)
            _progress(f"{name}: {form} candidate {k + 1}/{n_candidates} compiled and measured at "
                      f"{time.perf_counter() - t0:.0f} s")
    setup = time.perf_counter() - t0
    eager = caller(model)
    modules = [eager, *compiled.values()] + [c.module for c in cands.values()]
    stats = _interleaved(modules, x, loss_fn, rounds)
    t_of = {id(m): st for m, st in zip(modules, stats)}
    ref_c1 = _grads(model, compiled[1.0], x, loss_fn) if 1.0 in compiled else None
    head = ("budget", "compile peak", "compile time", "native peak", "meas/pred", "stages", "recomputed",
            "native time", "speedup", "grad vs c@1.0")
    rows, speedups = [], []
    for b in budgets:
        ct = t_of[id(compiled[b])]
        row = [f"{b:.1f}", format_bytes(c_peak[b]), _fmt_t(ct, format_time)]
        fits = [c for c in cands.values() if c.peak <= c_peak[b]]
        if not fits:
            rows.append(row + ["(none fits)", "", "", "", "", "", ""])
            continue
        c = min(fits, key=lambda c: t_of[id(c.module)][0])
        ot = t_of[id(c.module)]
        speedups.append(_speedup(ct, ot))
        g = _grads(c.twin, c.module, x, loss_fn)
        rows.append(row + [format_bytes(c.peak), f"{c.peak / c.predicted:.3f}", c.form,
                           str(c.schedule.n_recomputed), _fmt_t(ot, format_time), f"{speedups[-1]:.2f}x",
                           "-" if ref_c1 is None else _err(g, ref_c1)])
    low = min(cands.values(), key=lambda c: c.peak)
    ratios = [c.peak / c.predicted for c in cands.values()]
    print()
    print(f"{name} {sizes}: {chain.length} stages ({chain_kind} chain); eager step "
          f"{_fmt_t(t_of[id(eager)], format_time)}; setup "
          f"(compiling {len(cands) + len(budgets)} graphs, profiling, measuring) {setup:.0f} s "
          f"(the {len(budgets)} knob graphs {t_knob:.0f} s)")
    print_table(head, rows, left=1)
    print("  candidates (compiled form): " + "; ".join(
        f"{c.form}, {c.schedule.n_recomputed} recomputed: {format_bytes(c.peak)} measured / "
        f"{format_bytes(c.predicted)} predicted (without held gradients "
        f"{format_bytes(simulate(c.chain, c.schedule).peak_memory)}) in {format_time(t_of[id(c.module)][0])}"
        for c in sorted(cands.values(), key=lambda c: c.peak)))
    print(f"  parameter gradients held by the compiled backward: {format_bytes(sum(grads))}")
    least = low.peak / min(c_peak.values())
    if not speedups:
        return f"{name} native: no native schedule fits under any compile peak; least peak {least:.2f}x its lowest"
    slower = sum(v < 1 / 1.03 for v in speedups)
    return (f"{name} native: vs torch.compile budget at equal measured memory: mean speedup "
            f"{statistics.mean(speedups):.2f}x (min {min(speedups):.2f}x, max {max(speedups):.2f}x, "
            f"{len(speedups)} points, {slower} more than 3% slower); least peak {least:.2f}x compile's lowest; "
            f"measured/predicted peak {min(ratios):.3f}..{max(ratios):.3f}")


class _Candidate(NamedTuple):
    """A native schedule compiled whole: the compiled module, its measured peak, the schedule (compiled form), the
    model copy it trains, its predicted compiled peak, the chain it runs (a selective form's mix of two profiles)
    and its stage form."""

    module: Any
    peak: int
    schedule: Any
    twin: nn.Module
    predicted: int
    chain: Any
    form: str


def _stage_budgets(name: str, sizes: dict, budgets: list[float]) -> None:
    """Per-stage variants, measured: the compiled stages profiled with each stage's graph partitioned under each
    budget; what they save (x̄) and their forward and backward times, against budget 1.0."""
    from ..core.units import format_bytes, format_time
    from ..runtime import models
    from ..runtime.profile import profile

    model, x, loss_fn = models.demo_model(name, **sizes)
    chains = {b: profile(model, x, loss_fn, compile={"activation_memory_budget": b}, repeats=7, progress=False)
              for b in budgets}
    ref = chains[budgets[0]]
    print(f"\n{name} {sizes}: {ref.length} compiled stages, each partitioned under a stage budget")
    rows = [(f"{b:g}", format_bytes(sum(c.xbar)), format_time(sum(c.fwd_time)), format_time(sum(c.bwd_time)),
             " ".join(f"{a / z:.2f}" if z else "-" for a, z in zip(c.xbar, ref.xbar))) for b, c in chains.items()]
    print_table(("stage budget", "sum of x̄", "forward", "backward", f"x̄ per stage / at {budgets[0]:g}"), rows)


class _Chained(nn.Module):
    """Compiled stages run one after another with autograd: the compiled model without a schedule."""

    def __init__(self, runners: list[Any]):
        super().__init__()
        self.runners = runners

    def forward(self, x: Any) -> Any:
        for r in self.runners:
            x = r(x)
        return x


def _grads(model: nn.Module, module: Any, x: Any, loss_fn: Any, seed: int = 1) -> list[torch.Tensor]:
    """The parameter gradients of one step of ``module`` (which trains ``model``'s parameters) from RNG ``seed``,
    buffers restored afterwards."""
    from ..runtime.measure import fresh_copy
    from ..runtime.snapshot import buffer_snapshot

    restore = buffer_snapshot([model])
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss_fn(module(fresh_copy(x))).backward()
    grads = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    restore()
    return grads


def _err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> str:
    """'bitwise' when every gradient is identical, else the largest relative error (norm of the difference over
    the norm of the reference) over the parameters."""
    if all(torch.equal(a, b) for a, b in zip(got, ref)):
        return "bitwise"
    return f"{max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got, ref)):.1e}"


def _predicted(chain: Any, schedule: Any) -> int:
    from ..core.simulate import simulate

    return simulate(chain, schedule).peak_memory


def _fmt_t(stat: tuple[float, float], format_time: Any) -> str:
    return f"{format_time(stat[0])} ±{100 * stat[1]:.0f}%"


def _interleaved(modules: list[Any], x: Any, loss_fn: Any, rounds: int) -> list[tuple[float, float, list[float]]]:
    """(median step time, spread, the time of each round) of each module: one step of each per round, in a shuffled
    order, after a warm-up round; spread = (max - min) / median / 2 over the rounds."""
    from ..runtime.measure import fresh_copy

    params = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values()
    for p in params:
        p.grad = torch.zeros_like(p)
    samples: list[list[float]] = [[] for _ in modules]
    order = list(range(len(modules)))
    shuffle = random.Random(0).shuffle
    with torch.random.fork_rng(devices=[]):
        for r in range(rounds + 1):
            shuffle(order)
            for k in order:
                xs = fresh_copy(x)
                _sync()
                t0 = time.perf_counter()
                loss_fn(modules[k](xs)).backward()
                _sync()
                dt = time.perf_counter() - t0
                for p in params:
                    p.grad.zero_()
                if r:
                    samples[k].append(dt)
    for p in params:
        p.grad = None
    out = []
    for s in samples:
        med = statistics.median(s)
        out.append((med, (max(s) - min(s)) / med / 2, s))
    return out


def _progress(line: str) -> None:
    """A progress line for the minutes of compiling, on stderr (the tables go to stdout)."""
    import sys

    print(f"[bench compile] {line}", file=sys.stderr, flush=True)


def _sync() -> None:
    """Wait for the GPU (when this process has used one), so that a step's wall time is its whole time."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _speedup(base: tuple, other: tuple) -> float:
    """How much faster ``other`` ran than ``base`` (stats of :func:`_interleaved`): the median over rounds of the
    ratio of their steps in the same round, so a slow spell of the machine hits both sides of each ratio."""
    return statistics.median(b / o for b, o in zip(base[2], other[2]))
