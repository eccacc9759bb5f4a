"""Benchmark ``models``: automatic chain extraction (runtime/graph.py) on real architectures, on the CPU.

For each model (a ResNet with skip connections in ``forward``, a nanoGPT-style decoder, and, when installed,
Hugging Face GPT-2 and torchvision resnet18 / densenet121, all with random weights at a small input size):

- the number of stages :func:`~hchain_viz.runtime.graph.extract_stages` finds, the tracer that worked, and the
  extraction wall time (tracing, analysis, and the check that the stages reproduce the model);
- the throughput gain of the optimal schedule over PyTorch's ``checkpoint_sequential`` on the same stage list (an
  ``nn.Sequential``) at equal MEASURED memory: for each segment count n, the fastest optimal schedule whose
  measured peak is the same or lower, its step rate over checkpoint_sequential's, averaged over the
  Pareto-efficient n (a segment count that uses as much measured memory as another and is slower is left out), with
  the average over every n (the old rule) beside it, and the best n.

    python -m hchain_viz bench models [--models resnet_skip,nanogpt,gpt2,resnet18,densenet121] [--rounds 3]
                                      [--budgets 4] [--no-train] [--threads 0]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from . import pareto_efficient, positive_int, print_table

ALL = ("resnet_skip", "nanogpt", "gpt2", "resnet18", "densenet121")


def run(args: list[str]) -> None:
    """Print one row per model: stages, tracer, extraction time, gain over checkpoint_sequential."""
    parser = argparse.ArgumentParser(prog="hchain_viz bench models", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ALL), help="comma-separated, from: " + ", ".join(ALL))
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved timing rounds (median taken)")
    parser.add_argument("--budgets", type=positive_int, default=4, help="evenly spaced optimal budgets besides the "
                                                               "checkpoint_sequential peaks")
    parser.add_argument("--no-train", action="store_true", help="extraction only (skip the training comparison)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    opts = parser.parse_args(args)
    if opts.threads:
        torch.set_num_threads(opts.threads)

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
    gains, efficient, n_points = _gains(stages, x, loss_fn, opts)
    kept = [g for g, e in zip(gains, efficient) if e]
    avg = f"{100 * statistics.mean(kept):+.1f}%" if kept else "n/a"
    old = f"{100 * statistics.mean(gains):+.1f}%" if gains else "n/a"
    best = f"{100 * max(kept):+.1f}%" if kept else "n/a"
    return (name, shape, method, str(len(stages)), f"{seconds:.2f} s", f"{len(kept)}/{len(gains)} of {n_points}",
            avg, old, best)


def _gains(stages: list[tuple[str, nn.Module]], x: Any, loss_fn: Callable,
           opts: Any) -> tuple[list[float], list[bool], int]:
    """Gain of the optimal schedule over checkpoint_sequential(n) at equal measured peak, for each n that some
    optimal schedule matches; whether that n is Pareto-efficient among all n (measured peak, step time); L."""
    from ..core.simulate import simulate
    from ..core.solver import solve
    from ..core.strategies import periodic
    from ..runtime.measure import fresh_copy, measure
    from ..runtime.profile import profile
    from ..runtime.wrap import wrap
    from . import optimal_at
    from .train import _CheckpointSequential, _interleaved_times

    seq = nn.Sequential(*[m for _, m in stages])  # what checkpoint_sequential runs; wrap() takes its children
    chain = profile([(n, m) for n, m in stages], x, loss_fn, progress=False)
    sol = solve(chain)
    L = chain.length
    ckpt = [(_CheckpointSequential(seq, n), simulate(chain, periodic(chain, n)).peak_memory) for n in range(1, L + 1)]
    ckpt_peaks = [measure(m, x, loss_fn, repeats=1).peak_bytes for m, _ in ckpt]
    lo, hi = sol.min_budget, sol.store_all_peak
    budgets = {lo + (hi - lo) * k // max(1, opts.budgets - 1) for k in range(opts.budgets)}
    # each count's predicted and measured peak: PyTorch's checkpoint_sequential can measure below our prediction of it
    budgets |= {p for (_, predicted), measured in zip(ckpt, ckpt_peaks) for p in (predicted, measured) if lo <= p <= hi}
    optimal = [wrap(seq, optimal_at(chain, b)) for b in sorted(budgets)]
    modules = [m for m, _ in ckpt] + optimal
    peaks = ckpt_peaks + [measure(m, x, loss_fn, repeats=1).peak_bytes for m in optimal]
    times = _interleaved_times(modules, x, loss_fn, opts.rounds, fresh_copy)
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


def _cross_entropy(target: torch.Tensor) -> Callable[[Any], torch.Tensor]:
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
    return model, inp, _cross_entropy(target), "8x128 tokens"


def _torchvision(name: str) -> Callable[[], tuple]:
    def build() -> tuple:
        try:
            import torchvision
        except Exception as exc:  # PyPI's torchvision may not import beside a CPU-only torch build
            raise _Unavailable(f"torchvision ({type(exc).__name__})") from None
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None, num_classes=10)
        x, target = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
        return model, x, _cross_entropy(target), "8x3x64x64"

    return build


BUILDERS: dict[str, Callable[[], tuple]] = {
    "resnet_skip": _resnet_skip,
    "nanogpt": _nanogpt,
    "gpt2": _gpt2,
    "resnet18": _torchvision("resnet18"),
    "densenet121": _torchvision("densenet121"),
}

