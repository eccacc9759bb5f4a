"""Profile a real PyTorch model into a :class:`~hchain_viz.core.chain.Chain` (DESIGN §2): per-stage times and sizes.

The model is cut into stages by :func:`~hchain_viz.runtime.stages.sequentialize`; then each stage is profiled on its
own, in order, on the real output of the stage before (only one stage's autograd graph is alive at a time):

- ``fwd_time`` / ``bwd_time``: medians of ``repeats`` runs after ``warmup`` runs — a forward with autograd recording,
  then the backward from the output gradient (CUDA events on a GPU, ``perf_counter`` on the CPU). The last stage's
  output gradient is the real loss gradient; the others get a dense tensor of ones of the right size.
- ``x[i]``: bytes of stage i's input (``x[L]``: the network output), each storage counted once.
- ``xbar[i]``: the output plus what autograd saves for the backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks``: each storage once, only storages the forward created (parameters,
  buffers, the stage input and constants are resident anyway).
- ``fwd_tmp[i]``: peak bytes above the resident set during the forward, beyond what the forward leaves (largest of
  the recording forward and a no-grad one); ``bwd_tmp[i]``: the same for the backward, beyond the input gradient.
  Measured by :class:`~hchain_viz.runtime.memtrack.MemoryMeter` (CUDA statistics, or allocation tracking on the CPU).

Profiling leaves the model exactly as found: parameters, buffers (BatchNorm statistics), ``.grad``, training flags
and the global RNG state are the same afterwards. During profiling every parameter has a zero gradient of its own,
as in training after the first step, so accumulating into it is measured as a transient, never as a new resident.
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..core.chain import Chain
from ..errors import NotSequentialError, ProfileError
from . import roofline
from .fixed import check_optimizer, fixed_memory
from .measure import (
    LossFn,
    _shapes,
    _timed,
    default_loss,
    loss_of,
    preserved_state,
    resolve_device,
    to_device,
    user_code,
)
from .memtrack import AllocationTracker, MemoryMeter, map_tensors, nbytes, storage_of, storages, tensors
from .progress import progress_bar
from .stages import sequentialize

__all__ = ["profile"]


def profile(model: Any, sample_input: Any, loss_fn: LossFn | None = None, *,
            device: str | torch.device | None = None, warmup: int = 2, repeats: int = 5,
            progress: bool = True, optimizer: torch.optim.Optimizer | None = None, world_size: int = 1,
            estimate_for: str | None = None) -> Chain:
    """Measure ``model`` stage by stage on ``sample_input`` and return its :class:`Chain`.

    ``model``: an ``nn.Sequential`` (nested ones flattened), a list of modules or ``(name, module)`` pairs, or any
    model :func:`sequentialize` understands. Stages are called with one argument, as in ``nn.Sequential``.
    ``loss_fn(output) -> scalar`` gives the last stage its real output gradient; by default
    :func:`~hchain_viz.runtime.measure.default_loss` (mean of squares, whose gradient is a tensor the size of the
    output). ``device``: where to run (default: the model's device); the model must already be there.
    ``progress``: show a progress bar while profiling takes more than a moment (in a notebook, a widget that leaves a
    line of text behind).

    ``estimate_for="H100"`` (or ``"A100"``, ``"H200"``): replace the measured times by a roofline *estimate* for that
    GPU from each stage's FLOP and byte counts (:mod:`~hchain_viz.runtime.roofline`); sizes stay measured.
    ``meta["times"]`` says "estimate" and ``meta["measured_fwd_time"]`` / ``["measured_bwd_time"]`` keep the real ones.

    ``optimizer``: the training step's real optimizer, built on ``model``'s parameters. With it, ``Chain.fixed``
    records the memory no schedule changes — parameters, their gradients, the optimizer's state and its step's
    transient (measured by two real steps on zero gradients, undone afterwards), buffers — so that
    ``simulate(...).device_peak`` and ``solution.schedule(device_memory=...)`` answer for the whole step (DESIGN §7).
    ``world_size``: the number of ranks sharding parameters, gradients and optimizer state (FSDP / ZeRO-3).

    ``Chain.meta`` records the device, dtype, ``param_bytes`` (parameters plus their gradients, reported beside the
    budget, not in it), model class, input shape, torch version and the profiling settings.
    """
    if not isinstance(warmup, int) or warmup < 0:
        raise ProfileError(f"warmup must be a non-negative integer, got {warmup!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats must be a positive integer, got {repeats!r}")
    gpu = None if estimate_for is None else roofline.gpu_of(estimate_for)
    modules = [model] if isinstance(model, nn.Module) else [m for _, m in sequentialize(model)]
    if optimizer is not None:  # before the long part: a wrong optimizer fails fast
        check_optimizer(optimizer, [p for m in modules for p in m.parameters()])
    dev = resolve_device(modules, sample_input, device)
    sample_input = to_device(sample_input, dev)
    stages = sequentialize(model, sample_input)
    if not stages:
        raise NotSequentialError(f"the {type(model).__name__} has no stages to profile")
    loss_fn = default_loss if loss_fn is None else loss_fn

    L = len(stages)
    fwd, bwd, xs, xbar, ftmp, btmp = [0.0] * L, [0.0] * L, [nbytes(sample_input)] + [0] * L, [0] * L, [0] * L, [0] * L
    counts: list[tuple[int, int, int, int]] = []  # per stage, for estimate_for: fwd/bwd FLOPs and bytes
    bar = progress_bar(L, "profiling", "stage", enabled=progress)  # in a notebook, text once done
    with preserved_state(modules + [m for _, m in stages], dev), bar:
        h = _leaves(sample_input)
        for i, (name, stage) in enumerate(stages):
            bar.set_postfix_str(name, refresh=False)
            r = _StageProfile(name, stage, h, dev, loss_fn if i == L - 1 else None)
            r.run(warmup, repeats)
            fwd[i], bwd[i], xs[i + 1], xbar[i], ftmp[i], btmp[i] = (r.fwd_time, r.bwd_time, r.out_bytes, r.xbar,
                                                                   r.fwd_tmp, r.bwd_tmp)
            if gpu is not None:
                counts.append(r.counts())
            h = r.next_input
            bar.update(1)
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    meta = {
        "device": str(dev),
        "dtype": _dtype_name(params, sample_input),
        "param_bytes": nbytes(params) + nbytes([p for p in params if p.requires_grad]),
        "buffer_bytes": nbytes([b for m in modules for b in m.buffers()]),
        "model": type(model).__name__,
        "input_shape": _shapes(sample_input),
        "torch": torch.__version__,
        "warmup": warmup,
        "repeats": repeats,
        "timer": "cuda events" if dev.type == "cuda" else "perf_counter",
        "memory": "cuda memory stats" if dev.type == "cuda" else "allocation tracker",
        "loss": "default (mean of squares)" if loss_fn is default_loss else repr(loss_fn),
    }
    if gpu is not None:
        meta.update(measured_fwd_time=fwd, measured_bwd_time=bwd, estimate_for=gpu.name,
                    times=f"estimate: roofline for {gpu.name} from FLOP and byte counts (not measured)",
                    flops=[[f, b] for f, b, _, _ in counts])
        fwd = [roofline.estimate_time(gpu, meta["dtype"], f, n) for f, _, n, _ in counts]
        bwd = [roofline.estimate_time(gpu, meta["dtype"], b, n) for _, b, _, n in counts]
    fixed = None
    if optimizer is not None:
        fixed = fixed_memory(params, [m for _, m in stages], [b for m in modules for b in m.buffers()], optimizer,
                             dev, world_size)
    return Chain(fwd_time=fwd, bwd_time=bwd, x=xs, xbar=xbar, fwd_tmp=ftmp, bwd_tmp=btmp,
                 names=[n for n, _ in stages], meta=meta, fixed=fixed)


class _StageProfile:
    """Times and sizes of one stage, given its input ``h`` (tensors detached from any graph)."""

    def __init__(self, name: str, stage: nn.Module, h: Any, dev: torch.device, loss_fn: LossFn | None):
        self.name, self.stage, self.h, self.dev, self.loss_fn = name, stage, h, dev, loss_fn
        self.in_bytes = nbytes(h)

    def _input(self) -> Any:
        """A copy of the input, as a stage inside the chain receives it: a non-leaf when it requires grad, so
        in-place first ops are legal and the input gradient flows back to ``self.h``."""
        return map_tensors(self.h, lambda t: t.clone() if t.requires_grad else t.detach().clone())

    def _forward(self, inp: Any) -> Any:
        with user_code(lambda e: f"stage {self.name!r} failed on its input {_shapes(inp)}: {type(e).__name__}: {e}"):
            out = self.stage(inp)
        if not tensors(out):
            raise ProfileError(f"stage {self.name!r} returned {type(out).__name__}, which holds no tensor; every "
                               f"stage must return a tensor or a tuple of tensors")
        return out

    def _clear_input_grads(self) -> None:
        for t in tensors(self.h):
            t.grad = None

    def run(self, warmup: int, repeats: int) -> None:
        self._probe()
        ft, bt = [], []
        for k in range(warmup + repeats):
            f, b = self._timed_once()
            if k >= warmup:
                ft.append(f)
                bt.append(b)
        self.fwd_time, self.bwd_time = statistics.median(ft), statistics.median(bt)
        self._memory()

    def counts(self) -> tuple[int, int, int, int]:
        """Forward FLOPs, backward FLOPs, and the bytes each must at least move (for the roofline estimate): the
        forward reads its input and parameters and writes what it leaves (x̄); the backward reads x̄, its input, the
        output gradient and the parameters, and writes the input and parameter gradients."""
        inp = self._input()
        box: list[Any] = []
        f = roofline.count_flops(lambda: box.append(self._forward(inp)))
        diff = [t for t in tensors(box[0]) if t.requires_grad]
        b = roofline.count_flops(lambda: torch.autograd.backward(diff, self.grads)) if diff else 0
        self._clear_input_grads()
        params = nbytes(list(self.stage.parameters()))
        return (f, b, self.in_bytes + params + self.xbar,
                self.xbar + 2 * self.in_bytes + self.out_bytes + 2 * params)

    def _timed_once(self) -> tuple[float, float]:
        """Seconds of one recording forward and of its backward (the graph and copies die on return)."""
        inp = self._input()
        box: list[Any] = []
        f = _timed(lambda: box.append(self._forward(inp)), self.dev)
        diff = [t for t in tensors(box[0]) if t.requires_grad]
        b = _timed(lambda: torch.autograd.backward(diff, self.grads), self.dev) if diff else 0.0
        self._clear_input_grads()
        return f, b

    def _probe(self) -> None:
        """One forward: the output (next stage's input), its size, and the gradient the backward will get."""
        out = self._forward(self._input())
        self.out_bytes = nbytes(out)
        self.next_input = _leaves(out)
        diff = [t for t in tensors(out) if t.requires_grad]
        if self.loss_fn is not None:
            loss = loss_of(self.loss_fn, out)  # raises when nothing requires grad
            grads = torch.autograd.grad(loss, diff, allow_unused=True) if diff else ()
            self.grads = [torch.zeros_like(t) if g is None else g.detach() for g, t in zip(grads, diff)]
        else:
            self.grads = [torch.ones_like(t) for t in diff]

    def _memory(self) -> None:
        """xbar, fwd_tmp, bwd_tmp from one recording forward + backward and one no-grad forward."""
        inp = self._input()
        saved: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = storage_of(t)
            if st is not None:
                saved[id(st)] = st
            return t

        with MemoryMeter(self.dev) as meter:
            # which storages this forward creates (on the CPU the meter's own tracker knows: never nest it twice)
            with nullcontext(meter.tracker) if meter.tracker else AllocationTracker() as created:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = self._forward(inp)
            fwd_peak = meter.peak
            out_storages = storages(out)
            kept = [st for k, st in saved.items() if k not in out_storages and created.created(st)]
            self.xbar = self.out_bytes + sum(st.nbytes() for st in kept)
            saved.clear()
            del kept
            diff = [t for t in tensors(out) if t.requires_grad]
            meter.reset_peak()
            before = meter.current
            if diff:
                torch.autograd.backward(diff, self.grads)
            bwd_peak = meter.peak - before
            del out, diff
        self._clear_input_grads()
        del inp

        inp = self._input()
        with torch.no_grad(), MemoryMeter(self.dev) as meter:
            out = self._forward(inp)
            nograd_peak = meter.peak
        del out, inp
        self.fwd_tmp = max(0, fwd_peak - self.xbar, nograd_peak - self.out_bytes)
        self.bwd_tmp = max(0, bwd_peak - self.in_bytes)


# ---------------------------------------------------------------------------------------------- helpers
def _leaves(obj: Any) -> Any:
    """Detached tensors sharing storage with ``obj``'s, requiring grad where the originals did (new leaves)."""
    return map_tensors(obj, lambda t: t.detach().requires_grad_(t.requires_grad))


def _dtype_name(params: list[torch.Tensor], sample_input: Any) -> str:
    for t in [*params, *tensors(sample_input)]:
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"
