"""Benchmark ``models``: automatic chain extraction (runtime/graph/) on real architectures, on the CPU.

    python -m hchain_viz bench models [--models resnet_skip,nanogpt,gpt2,resnet18,densenet121] [--rounds 3]
                                      [--budgets 4] [--no-train] [--threads 0]

What it measures and how: NOTE [what bench models measures] below; the runs: docs/benchmarks.md.
"""

# NOTE [what bench models measures]
# For each model (a ResNet with skip connections in ``forward``, a nanoGPT-style decoder, and, when installed,
# Hugging Face GPT-2 and torchvision resnet18 / densenet121, all with random weights at a small input size):
#
# - the number of stages :func:`~hchain_viz.runtime.graph.extract_stages` finds, the tracer that worked, and the
#   extraction wall time (tracing, analysis, and the check that the stages reproduce the model);
# - the throughput gain of the optimal schedule over PyTorch's ``checkpoint_sequential`` on the same stage list (an
#   ``nn.Sequential``) at equal MEASURED memory: for each segment count n, the fastest optimal schedule whose
#   measured peak is the same or lower, its step rate over checkpoint_sequential's, averaged over the
#   Pareto-efficient n (a segment count that uses as much measured memory as another and is slower is left out), with
#   the average over every n (the old rule) beside it, and the best n.
#
# With ``--cnn`` (issue #26) it benches real torchvision CNNs instead (``--cnn-models resnet50,densenet121,
# inception_v3``, batch 4 at 128-160 px) at ``module`` and ``sublayer`` granularity. The baseline is what users run:
# ``checkpoint_sequential`` over the model's top-level children (``model.features``' children for a DenseNet), each
# Pareto-efficient segment count n (measured peak, step time). At n's measured peak the optimum is solved on the
# granular chain; per granularity the table gives the stages, the least feasible budget (the solver's, and its ratio
# to module granularity's), and the mean gain over the Pareto-efficient n, measured and simulated (the optimum's
# predicted step time against checkpoint_sequential's on a profile of the user's chain, run natively: one backward
# call for the step, where the executor starts one per segment). Measured: per round, the
# baseline and each granularity's optimum at its peak run back to back (a step of a CNN varies by about +-12% on
# its own, and a shared machine changes speed over seconds), each gain the median over rounds of that round's ratio;
# the rounds shuffle these groups. glibc is asked to keep freed memory (``keep_heap``), as a GPU's caching allocator
# does: otherwise the schedules that free and allocate more page-fault more. It also gives the
# least budget with every transient zero, store-all through the executor over eager in the same rounds, and, per row,
# the op of the least schedule that sets its least budget (what is resident before it and what it adds).
# ``docs/benchmarks.md`` (CNNs cut inside their blocks) has the runs and what they show.

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from . import keep_heap, pareto_efficient, positive_int, print_table

ALL = ("resnet_skip", "nanogpt", "gpt2", "resnet18", "densenet121")


def run(args: list[str]) -> None:
    """Print one row per model: stages, tracer, extraction time, gain over checkpoint_sequential."""
    parser = argparse.ArgumentParser(prog="hchain_viz bench models", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ALL), help="comma-separated, from: " + ", ".join(ALL))
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help=f"interleaved timing rounds (median taken; default 3, {CNN_ROUNDS} with --cnn: a CNN "
                             f"step varies by about +-12%% on its own, so a gain read to a point needs many)")
    parser.add_argument("--budgets", type=positive_int, default=4, help="evenly spaced optimal budgets besides the "
                                                               "checkpoint_sequential peaks")
    parser.add_argument("--no-train", action="store_true", help="extraction only (skip the training comparison)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--cnn", action="store_true", help="bench real torchvision CNNs at module and sublayer "
                                                           "granularity against checkpoint_sequential (issue #26)")
    parser.add_argument("--cnn-models", default=",".join(CNN), help="with --cnn: from " + ", ".join(CNN))
    parser.add_argument("--image", type=positive_int, default=0, help="with --cnn: image side (0: 128, 160 for "
                                                                      "inception_v3)")
    parser.add_argument("--batch", type=positive_int, default=4, help="with --cnn: batch size")
    opts = parser.parse_args(args)
    if opts.rounds is None:
        opts.rounds = CNN_ROUNDS if opts.cnn else 3
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.cnn:
        _run_cnn(opts)
        return

    print(f"models benchmark: torch {torch.__version__}, cpu, {torch.get_num_threads()} threads"
          + ("" if opts.no_train else f", step times: median of {opts.rounds} interleaved rounds, peaks measured "
                                      f"with hchain_viz.measure"))
    head = ("model", "input", "tracer", "stages", "extract", "ckpt_seq points (Pareto/all)", "avg gain",
            "avg gain (all n, old)", "best gain")
    rows = []
    for name in (n.strip() for n in opts.models.split(",") if n.strip()):
        if name not in BUILDERS:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(ALL)}")
        try:
            model, x, loss_fn, shape = BUILDERS[name]()
        except _Unavailable as exc:
            rows.append((name, "", f"skipped: {exc}", "", "", "", "", "", ""))
            continue
        row = _bench_model(name, model, x, loss_fn, shape, opts)
        rows.append(row)
    print()
    print_table(head, rows, left=3)


def _bench_model(name: str, model: nn.Module, x: Any, loss_fn: Callable, shape: str, opts: Any) -> tuple:
    from ..runtime.graph import extract_stages

    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        stages = extract_stages(model, x)
        seconds = time.perf_counter() - start
    method = stages[0][1].method
    if opts.no_train:
        return (name, shape, method, str(len(stages)), f"{seconds:.2f} s", "", "", "", "")
    gains, efficient, n_points = optimal_gains(stages, x, loss_fn, opts)
    kept = [g for g, e in zip(gains, efficient) if e]
    avg = f"{100 * statistics.mean(kept):+.1f}%" if kept else "n/a"
    old = f"{100 * statistics.mean(gains):+.1f}%" if gains else "n/a"
    best = f"{100 * max(kept):+.1f}%" if kept else "n/a"
    return (name, shape, method, str(len(stages)), f"{seconds:.2f} s", f"{len(kept)}/{len(gains)} of {n_points}",
            avg, old, best)


def optimal_gains(stages: list[tuple[str, nn.Module]], x: Any, loss_fn: Callable,
                  opts: Any) -> tuple[list[float], list[bool], int]:
    """Gain of the optimal schedule over checkpoint_sequential(n) at equal measured peak, for each n that some
    optimal schedule matches; whether that n is Pareto-efficient among all n (measured peak, step time); L."""
    from ..core.simulate import simulate
    from ..core.solver import solve
    from ..core.strategies import periodic
    from ..runtime.measure import fresh_copy, measure
    from ..runtime.profile import profile
    from ..runtime.train.wrap import wrap
    from . import optimal_at
    from .train import CheckpointSequential, interleaved_times

    seq = nn.Sequential(*[m for _, m in stages])  # what checkpoint_sequential runs; wrap() takes its children
    chain = profile([(n, m) for n, m in stages], x, loss_fn, progress=False)
    sol = solve(chain)
    L = chain.length
    ckpt = [(CheckpointSequential(seq, n), simulate(chain, periodic(chain, n)).peak_memory) for n in range(1, L + 1)]
    ckpt_peaks = [measure(m, x, loss_fn, repeats=1).peak_bytes for m, _ in ckpt]
    lo, hi = sol.min_budget, sol.store_all_peak
    budgets = {lo + (hi - lo) * k // max(1, opts.budgets - 1) for k in range(opts.budgets)}
    # each count's predicted and measured peak: PyTorch's checkpoint_sequential can measure below our prediction of it
    budgets |= {p for (_, predicted), measured in zip(ckpt, ckpt_peaks) for p in (predicted, measured) if lo <= p <= hi}
    optimal = [wrap(seq, optimal_at(chain, b)) for b in sorted(budgets)]
    modules = [m for m, _ in ckpt] + optimal
    peaks = ckpt_peaks + [measure(m, x, loss_fn, repeats=1).peak_bytes for m in optimal]
    times = interleaved_times(modules, x, loss_fn, opts.rounds, fresh_copy)
    for p in seq.parameters():
        p.grad = None
    opt = list(zip(peaks[L:], times[L:]))
    gains, efficient = [], []
    for (peak, t), keep in zip(zip(peaks[:L], times[:L]), pareto_efficient(list(zip(peaks[:L], times[:L])))):
        fits = [o_time for o_peak, o_time in opt if o_peak <= peak]
        if fits:
            gains.append(t / min(fits) - 1.0)
            efficient.append(keep)
    return gains, efficient, L


# ---------------------------------------------------------------------------------------------- models
class _Unavailable(Exception):
    """An optional package is missing or cannot be imported here."""


def cross_entropy(target: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """A loss function for ``profile``/``measure``: cross-entropy of the output's logits (``out.logits`` for a Hugging
    Face output, else ``out``) against ``target``, flattened over every position."""
    def loss(out: Any) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return loss


def _resnet_skip() -> tuple:
    from ..runtime.models import resnet_skip

    model, x, loss_fn = resnet_skip(batch=8, image=32, width=16, blocks=(2, 2, 2, 2))
    return model, x, loss_fn, "8x3x32x32"


def _nanogpt() -> tuple:
    from ..runtime.models import nanogpt

    model, idx, loss_fn = nanogpt(batch=8, seq=128, vocab=256, dim=128, heads=4, layers=6)
    return model, idx, loss_fn, "8x128 tokens"


def _gpt2() -> tuple:
    try:
        import transformers
    except Exception as exc:
        raise _Unavailable(f"transformers ({type(exc).__name__})") from None
    config = transformers.GPT2Config(n_layer=6, n_embd=128, n_head=4, vocab_size=256, n_positions=128,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids, target = torch.randint(0, 256, (8, 128)), torch.randint(0, 256, (8, 128))
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, inp, cross_entropy(target), "8x128 tokens"


def _torchvision(name: str) -> Callable[[], tuple]:
    def build() -> tuple:
        try:
            import torchvision
        except Exception as exc:  # PyPI's torchvision may not import beside a CPU-only torch build
            raise _Unavailable(f"torchvision ({type(exc).__name__})") from None
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None, num_classes=10)
        x, target = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
        return model, x, cross_entropy(target), "8x3x64x64"

    return build


BUILDERS: dict[str, Callable[[], tuple]] = {
    "resnet_skip": _resnet_skip,
    "nanogpt": _nanogpt,
    "gpt2": _gpt2,
    "resnet18": _torchvision("resnet18"),
    "densenet121": _torchvision("densenet121"),
}



# ---------------------------------------------------------------------------------------------- --cnn (issue #26)
CNN = ("resnet50", "densenet121", "inception_v3")
CNN_ROUNDS = 40  # run I in docs/benchmarks.md: what a measured/simulated reading to 0.9-1.1 needs on 2 CPU cores
GRANULARITIES = ("module", "sublayer")


def _run_cnn(opts: Any) -> None:
    heap = "glibc keeps freed memory" if keep_heap() else "the allocator as it is"
    print(f"CNN benchmark: torch {torch.__version__}, cpu, {torch.get_num_threads()} threads, batch {opts.batch}, "
          f"{heap}; gains: median over {opts.rounds} interleaved rounds of the ratio of two steps run back to back; "
          f"peaks measured with hchain_viz.measure; baseline: checkpoint_sequential over the top-level children")
    head = ("model", "input", "granularity", "stages", "least budget", "vs module", "least, no transients",
            "ckpt_seq Pareto n", "measured gain", "simulated gain", "measured / simulated", "ceiling (store-all)",
            "store-all: executor / eager")
    rows, floors, points = [], [], []
    for name in (n.strip() for n in opts.cnn_models.split(",") if n.strip()):
        if name not in CNN:
            raise SystemExit(f"unknown CNN {name!r}; choose from {', '.join(CNN)}")
        try:
            got, (why, per_point) = _bench_cnn(name, opts)
            rows += got
            floors += why
            points += per_point
        except _Unavailable as exc:
            rows.append((name, "", f"skipped: {exc}", *[""] * (len(head) - 3)))
    print()
    print_table(head, rows, left=3)
    print("\nWhat sets each least budget (the simulated peak of the least schedule: the op, what is resident "
          "before it, and what the op adds):")
    for line in floors:
        print("  " + line)
    print("\nPer point (checkpoint_sequential's n and measured peak): simulated gain, measured gain as the median over "
          "rounds [least, most]:")
    for line in points:
        print("  " + line)


def _floor(chain: Any) -> tuple[int, str]:
    """The least budget with every transient (forward, no-grad, backward) set to zero, and a line saying which op of
    the least schedule reaches its peak: what is resident before that op and what the op adds."""
    import dataclasses

    from ..core.simulate import simulate
    from ..core.solver import solve

    L = len(chain.names)
    zero = (0,) * L
    bare = solve_least(dataclasses.replace(chain, fwd_tmp=zero, bwd_tmp=zero, nograd_tmp=zero))
    sol = solve(chain)
    trace = simulate(chain, sol.schedule(sol.min_budget))
    k = trace.peak_index
    event = trace.events[k]
    name = lambda i: chain.names[min(i, L - 1)]  # noqa: E731
    before = trace.events[k - 1].resident if k else ()
    held = ", ".join(f"{it.kind}[{it.stage if it.kind == 'x' else name(it.stage)}] {_mib(it.size)}"
                     for it in before if it.size)
    op = event.op
    adds = (f"δ_{op.stage} {_mib(chain.delta_bytes[op.stage])} + bwd_tmp {_mib(chain.bwd_tmp[op.stage])}"
            if op.kind == "B" else f"{_mib(event.mem_peak - event.mem_before)}")
    return bare, (f"{op} ({name(op.stage)}): peak {_mib(event.mem_peak)} = {_mib(event.mem_before)} resident ({held}) "
                  f"+ {adds}")


def user_stages(name: str, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """What users hand ``checkpoint_sequential``: the top-level children in forward order, with the forward's
    functional bits as modules (flatten; DenseNet's final ReLU and pooling); a DenseNet's ``features`` is opened
    (``checkpoint_sequential(model.features, n, x)`` is how it is checkpointed by hand). A child that overwrites its
    input (ResNet's ``relu``, ReLU(inplace=True)) joins the one before it: at a segment boundary it would overwrite a
    checkpoint, and backward fails (the fix a user makes after that error)."""
    from ..runtime.stages import fuse

    if name.startswith("densenet"):
        stages = [*model.features.named_children(), ("relu", nn.ReLU()), ("pool", nn.AdaptiveAvgPool2d(1)),
                  ("flatten", nn.Flatten(1)), ("classifier", model.classifier)]
    else:
        kids = [(n, m) for n, m in model.named_children() if n not in ("fc", "AuxLogits")]
        stages = [*kids, ("flatten", nn.Flatten(1)), ("fc", model.fc)]
    out: list[tuple[str, nn.Module]] = []
    for stage in stages:
        if getattr(stage[1], "inplace", False) is True and out:  # ReLU(inplace=True) and the like say so
            out[-1] = fuse([out[-1], stage])
        else:
            out.append(stage)
    return out


def _bench_cnn(name: str, opts: Any) -> tuple[list[tuple], tuple[list[str], list[str]]]:
    """The table's rows for one model (one per granularity), and its lines: what sets each least budget, and each
    point's gains."""
    from ..core.simulate import simulate
    from ..core.strategies import segments, store_all
    from ..runtime.measure import fresh_copy, measure
    from ..runtime.profile import profile
    from ..runtime.stages import sequentialize
    from ..runtime.train.wrap import wrap
    from . import optimal_at
    from .train import CheckpointSequential, grouped_times, interleaved_times

    try:
        import torchvision
    except Exception as exc:
        raise _Unavailable(f"torchvision ({type(exc).__name__})") from None
    side = opts.image or (160 if name == "inception_v3" else 128)
    torch.manual_seed(0)
    extra = {"aux_logits": False, "init_weights": False} if name == "inception_v3" else {}
    model = getattr(torchvision.models, name)(weights=None, num_classes=10, **extra).train()
    x, target = torch.randn(opts.batch, 3, side, side), torch.randint(0, 10, (opts.batch,))
    loss_fn = cross_entropy(target)
    shape = f"{opts.batch}x3x{side}x{side}"

    user = user_stages(name, model)
    seq = nn.Sequential(*[m for _, m in user])
    with torch.random.fork_rng():
        model.eval()
        torch.manual_seed(0)
        want = model(x)
        torch.manual_seed(0)
        got = seq(x)
        model.train()
    if not torch.allclose(want, got, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{name}: the top-level children in order do not reproduce the model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L = len(seq)
        ckpt = [CheckpointSequential(seq, n) for n in range(1, L + 1)]
        ckpt_peaks = [measure(m, x, loss_fn, repeats=1).peak_bytes for m in ckpt]
        per_g = []  # (granularity, stages, chain, least budget, {budget: (module, predicted time)}, ckpt predicted)
        stage_lists = []
        for g in GRANULARITIES:
            stages = sequentialize(model, x) if g == "module" else sequentialize(model, x, granularity=g)
            stage_lists.append(stages)
            chain = profile(stages, x, loss_fn, progress=False)
            least = solve_least(chain)
            g_seq = nn.Sequential(*[m for _, m in stages])
            runs = {}
            for b in sorted(set(ckpt_peaks)):
                if b >= least:
                    schedule = optimal_at(chain, b)
                    runs[b] = (wrap(g_seq, schedule), simulate(chain, schedule).makespan)
            # checkpoint_sequential over the top-level children, replayed on this very profile (two profiles of a
            # busy machine differ by more than the gains): its segments start where those children start
            ckpt_sim = [_native_time(chain, segments(chain, segment_starts(user, chain.names, n)))
                        for n in range(1, L + 1)]
            per_g.append((g, len(stages), chain, least, runs, ckpt_sim))
    # checkpoint_sequential's Pareto-efficient n, from a few rounds of its own
    keep = pareto_efficient(list(zip(ckpt_peaks, interleaved_times(ckpt, x, loss_fn, 3, fresh_copy))))
    points = [n for n in range(L) if keep[n]]
    # Then the gains, each read per round from steps run back to back (the baseline and the optimum of each
    # granularity at its peak), as the median over rounds; store-all through the executor beside eager, the same way.
    groups = [[ckpt[n], *(runs[ckpt_peaks[n]][0] for *_, runs, _ in per_g if ckpt_peaks[n] in runs)] for n in points]
    plain = [model] + [wrap(nn.Sequential(*[m for _, m in st]), store_all(entry[2]))
                       for st, entry in zip(stage_lists, per_g)]
    samples = grouped_times([*groups, plain], x, loss_fn, opts.rounds, fresh_copy)
    for p in model.parameters():
        p.grad = None

    def paired(a: list[float], b: list[float]) -> float:
        return statistics.median(p / q for p, q in zip(a, b))

    eager_samples, executor_samples = samples[-1][0], samples[-1][1:]
    rows, floors, lines = [], [], []
    module_least = per_g[0][3]
    for gi, ((g, n_stages, chain, least, runs, ckpt_sim), executor) in enumerate(zip(per_g, executor_samples)):
        bare, why = _floor(chain)
        floors.append(f"{name} {g}: {why}")
        opt_peaks = {b: measure(m, x, loss_fn, repeats=1).peak_bytes for b, (m, _) in runs.items()}
        measured, simulated, ceiling = [], [], []
        store_all_time = simulate(chain, store_all(chain)).makespan  # no schedule is faster (nothing recomputed)
        for n, group in zip(points, samples):
            b = ckpt_peaks[n]
            if b not in runs:
                continue  # below this chain's least budget: the optimum cannot run there
            assert opt_peaks[b] <= b, (name, g, n + 1)  # measured within the baseline's measured peak
            k = 1 + sum(ckpt_peaks[n] in entry[4] for entry in per_g[:gi])  # this granularity's place in the group
            per_round = [p / q - 1.0 for p, q in zip(group[0], group[k])]
            measured.append(statistics.median(per_round))
            simulated.append(ckpt_sim[n] / runs[b][1] - 1.0)
            lines.append(f"{name} {g} n={n + 1} at {_mib(b)}: simulated {100 * simulated[-1]:+.1f}%, measured "
                         f"{100 * measured[-1]:+.1f}% [{100 * min(per_round):+.1f}%, {100 * max(per_round):+.1f}%]")
            ceiling.append(ckpt_sim[n] / store_all_time - 1.0)
        mean = lambda v: statistics.mean(v) if v else float("nan")  # noqa: E731
        m_gain, s_gain = mean(measured), mean(simulated)
        rows.append((name, shape, g, str(n_stages), _mib(least), f"{module_least / least:.2f}x",
                     f"{_mib(bare)} ({module_least / bare:.2f}x)", f"{len(measured)}/{len(points)}",
                     f"{100 * m_gain:+.1f}%", f"{100 * s_gain:+.1f}%",
                     f"{m_gain / s_gain:.2f}" if s_gain else "n/a", f"{100 * mean(ceiling):+.1f}%",
                     f"{paired(executor, eager_samples):.2f}"))
    return rows, (floors, lines)


def _native_time(chain: Any, schedule: Any) -> float:
    """The simulated time of ``schedule`` run by PyTorch's non-reentrant checkpointing: one backward call for the
    whole step, each segment recomputed inside it (from saved-tensor hooks). The executor, and so the simulator,
    starts a backward call per segment, ``chain.backward_call`` each."""
    from ..core.simulate import simulate

    no_calls = dataclasses.replace(chain, backward_call=0.0)
    return simulate(no_calls, schedule).makespan + chain.backward_call


def segment_starts(user: list[tuple[str, nn.Module]], names: tuple[str, ...], segments: int) -> tuple[int, ...]:
    """The first stage of each of ``checkpoint_sequential(children, segments)``'s segments in a finer chain whose
    stages are named after the children (``layer1``, ``layer1.0``, ``layer1.0.conv2``; ``stem`` and ``head`` hold
    the children before the first and after the last one named). A segment that would start inside the stem starts
    with the chain, one inside the head with the head (those children are small: a ReLU, a pooling, a flatten)."""
    child_names = [n.split("+")[0] for n, _ in user]  # ("bn1+relu": children joined)
    owner: list[int | None] = []
    for name in names:
        # the child the stage's path starts with, once leading containers are dropped ("features.denseblock1")
        # (a stem part holding several children, "stem.bn1..relu", is named after its first)
        path, found = name.split("+")[0].split("..")[0].split("."), None
        while path and found is None:
            found = next((k for k, c in enumerate(child_names) if path[: c.count(".") + 1] == c.split(".")), None)
            path = path[1:]
        owner.append(found)
    named = [o for o in owner if o is not None]
    first, last = (min(named), max(named)) if named else (0, len(user) - 1)
    owner = [o if o is not None else (first - 1 if j < owner.index(first) else last + 1) if named else 0
             for j, o in enumerate(owner)]
    size = len(user) // segments
    starts = {0}
    for s in range(size, size * segments, size):
        j = next((j for j, o in enumerate(owner) if o >= s), None)
        if j is not None:
            starts.add(j)
    return tuple(sorted(starts))


def solve_least(chain: Any) -> int:
    """The least budget at which the optimum exists (the solver's least, within a slot's rounding)."""
    from ..core.solver import solve

    return solve(chain).min_budget


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"
