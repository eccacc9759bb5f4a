"""Measure one real training step of any module: peak memory and step time (what the simulator predicts).

``measure(module, x, loss_fn)`` runs ``loss_fn(module(x)).backward()`` — on a plain model, or on one wrapped by a
schedule — and reports its peak memory in the simulator's terms (design.md §3): the input x_0 plus everything allocated
during the step above the level before it. Parameters, their gradients and buffers are constant across strategies and
stay out of the peak: gradients are allocated (zero) before the step, so accumulating into them costs nothing new.

Also home of the project-wide loss convention: ``loss_fn(output) -> scalar tensor`` with targets closed over, and
:func:`default_loss` when none is given.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.units import format_bytes, format_time
from ..errors import HChainError, ProfileError
from .memtrack import MemoryMeter, map_tensors, nbytes, tensors
from .snapshot import buffer_snapshot

__all__ = ["measure", "Measurement", "default_loss"]

LossFn = Callable[[Any], torch.Tensor]


def default_loss(output: Any) -> torch.Tensor:
    """The loss used when none is given: the model's own loss when its output carries one (a Hugging Face model
    called with ``labels`` returns ``output.loss``), else the mean of squares (in float32) of every floating tensor
    in ``output``.

    The mean of squares' gradient ``2 * output / numel`` is a real tensor the size of the output, as a real loss's
    is (``out.sum()`` would give an expanded scalar of 0 bytes and hide the output gradient's memory).
    """
    own = output.get("loss") if isinstance(output, Mapping) else None  # HF ModelOutput is an OrderedDict
    if isinstance(own, torch.Tensor) and own.numel() == 1:
        return own
    outs = [t for t in tensors(output) if t.is_floating_point() or t.is_complex()]
    if not outs:
        raise ProfileError(
            "the model's output holds no floating-point tensor, so the default loss cannot be used; pass "
            "loss_fn=lambda out: ... returning a scalar tensor"
        )
    return sum((t.float().abs() ** 2).mean() if t.is_complex() else (t.float() ** 2).mean() for t in outs)


@dataclass(frozen=True)
class Measurement:
    """One real forward+loss+backward step, measured.

    - ``peak_bytes``: the input x_0 plus the peak allocated above the pre-step level — comparable to
      ``simulate(chain, schedule).peak_memory``.
    - ``step_time``: median seconds of a step; ``step_times``: every timed step.
    - ``input_bytes``: x_0. ``baseline_bytes``: what was resident before the step (parameters, gradients, buffers,
      the input; on CUDA, everything the allocator holds for tensors on the device).
    - ``device_peak``: everything resident at the step's peak — parameters, gradients, optimizer state, buffers, the
      input and the activations (docs/design.md §7); comparable to ``hcv.device_peak(simulate(chain, schedule))``.
      With an optimizer the step includes ``optimizer.step()`` and ``zero_grad()``.
    """

    peak_bytes: int
    step_time: float
    step_times: tuple[float, ...]
    input_bytes: int
    baseline_bytes: int
    device: str
    device_peak: int | None = None

    def __repr__(self) -> str:
        return (f"Measurement(peak {format_bytes(self.peak_bytes)}, step {format_time(self.step_time)} "
                f"(median of {len(self.step_times)}), on {self.device})")


def measure(module: nn.Module, sample_input: Any, loss_fn: LossFn | None = None, *,
            device: str | torch.device | None = None, repeats: int = 3,
            optimizer: torch.optim.Optimizer | None = None) -> Measurement:
    """Measure the peak memory and median time of ``loss_fn(module(sample_input)).backward()``.

    ``sample_input`` is passed as one argument (a tuple stays one tuple, as in ``nn.Sequential``), except a dict
    whose keys ``module.forward`` takes as keywords (a Hugging Face batch): ``module(**batch)``, as :func:`profile`
    and :func:`checkpoint` call it; ``loss_fn`` then defaults to ``output.loss``. Each step gets a fresh copy, so a
    module that writes into its input never changes yours. One untimed warm-up step runs first, then
    ``repeats`` timed steps; on the CPU the memory comes from one more step under an :class:`AllocationLog` (the
    allocator's own record of allocations and frees, through PyTorch's profiler; it slows ops, so it is never
    timed), on CUDA from the allocator's statistics of the timed steps. Neither changes what the module runs: a
    compiled module (``torch.compile``) is measured compiled and stays compiled.

    ``optimizer``: measure a whole training step — forward, backward, ``optimizer.step()``, ``optimizer.zero_grad()``
    — in the steady state (the warm-up step creates the optimizer's state; gradients start each step freed, as
    ``zero_grad()`` leaves them). The parameters' values and the optimizer's state are restored afterwards.

    The module is left as found: parameters are never updated (without an optimizer nothing updates them; with one
    they are put back), and the buffers (BatchNorm statistics), every parameter's ``.grad`` and the global RNG state
    (CPU and CUDA) are restored afterwards.
    """
    if not isinstance(module, nn.Module):
        raise ProfileError(f"measure() needs an nn.Module, got {type(module).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats must be a positive integer, got {repeats!r}")
    dev = resolve_device([module], sample_input, device)
    sample_input = to_device(sample_input, dev)
    loss_fn = default_loss if loss_fn is None else loss_fn
    input_bytes = nbytes(sample_input)
    keywords = _as_keywords(module, sample_input)
    if optimizer is not None:
        from .fixed import check_optimizer

        check_optimizer(optimizer, list(module.parameters()))

    def step(x: Any) -> None:
        with user_code(lambda e: f"the {type(module).__name__} failed on the sample input ({type(e).__name__}: "
                                 f"{e}); check the input's shape, dtype and device against the model"):
            out = module(**x) if keywords else module(x)
        loss = loss_of(loss_fn, out)
        loss.backward()
        if optimizer is not None:  # `out` and `loss` are still held, as in a training loop
            optimizer.step()
            optimizer.zero_grad()

    def zero_grads() -> None:
        for p in params:
            if p.grad is not None:
                p.grad.zero_()

    times: list[float] = []
    from .fixed import optimizer_state_tensors, training_state

    # training_state first: it keeps the user's .grad, not the zeros preserved_state puts there (on CUDA a device
    # copy of every gradient, held to the end, would add to the measured device peak once zero_grad() drops them)
    with training_state(list(module.parameters()), optimizer), preserved_state([module], dev):
        params = [p for p in module.parameters() if p.requires_grad]
        step(fresh_copy(sample_input))  # warm-up (lazy initialisation, caches, optimizer state); not measured
        held = [*module.parameters(), *(p.grad for p in params if p.grad is not None), *module.buffers()]
        if optimizer is not None:
            held += optimizer_state_tensors(optimizer, dev)
        baseline = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else nbytes(held) + input_bytes
        peak = device_peak = 0
        for _ in range(repeats):
            zero_grads()
            x = fresh_copy(sample_input)  # made before the meter starts: x_0 is counted once, as input_bytes
            if dev.type == "cuda":  # allocator statistics cost nothing: measure every timed step
                torch.cuda.synchronize(dev)
                before = torch.cuda.memory_allocated(dev)
                with MemoryMeter(dev) as meter:
                    times.append(timed(lambda x=x: step(x), dev))
                peak = max(peak, meter.peak)
                # everything allocated at the peak, less the fresh copy of the input (the caller's is counted)
                device_peak = max(device_peak, before - input_bytes + meter.peak)
            else:
                times.append(timed(lambda x=x: step(x), dev))
            del x
        if dev.type != "cuda":  # logging allocations slows every op: one more step, untimed
            zero_grads()
            x = fresh_copy(sample_input)
            with MemoryMeter(dev) as meter:
                step(x)
            peak = meter.peak
            device_peak = baseline + peak
    return Measurement(peak_bytes=input_bytes + peak, step_time=statistics.median(times), step_times=tuple(times),
                       input_bytes=input_bytes, baseline_bytes=baseline, device=str(dev), device_peak=device_peak)


# ---------------------------------------------------------------------------------------------- shared helpers
def _as_keywords(module: nn.Module, sample_input: Any) -> bool:
    """Whether ``module`` is called with the dict ``sample_input`` unpacked: its forward names every key, or takes
    ``**kwargs``. A module of one argument (``nn.Sequential``, ``hcv.wrap``'s) takes the dict itself."""
    if not isinstance(sample_input, Mapping) or not sample_input:
        return False
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return True
    return all(isinstance(k, str) and k in params and params[k].kind is not inspect.Parameter.POSITIONAL_ONLY
               for k in sample_input)


def timed(fn: Callable[[], Any], dev: torch.device) -> float:
    """Seconds ``fn`` takes: CUDA events around it on a GPU, ``perf_counter`` elsewhere."""
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@contextlib.contextmanager
def user_code(describe: Callable[[Exception], str]) -> Iterator[None]:
    """Run the user's model, stage or loss: its own exceptions become a ProfileError with ``describe(e)`` (what to
    check); our errors and out-of-memory pass through unchanged, since blaming the input would mislead."""
    try:
        yield
    except (HChainError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as e:
        raise ProfileError(describe(e)) from e


def loss_of(loss_fn: LossFn, output: Any) -> torch.Tensor:
    """``loss_fn(output)``, checked by :func:`check_loss`; an exception inside ``loss_fn`` becomes a ProfileError."""
    with user_code(lambda e: f"loss_fn(output) failed ({type(e).__name__}: {e}); it must take the model's output "
                             f"(here {_shapes(output)}) and return a scalar tensor, with any targets closed over"):
        loss = loss_fn(output)
    check_loss(loss)
    return loss


def _shapes(obj: Any) -> Any:
    """The shapes of the tensors in ``obj``, for messages: ``[8, 10]`` for one tensor, a list of them otherwise."""
    if isinstance(obj, torch.Tensor):
        return list(obj.shape)
    return [_shapes(t) for t in tensors(obj)]


def check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ProfileError(f"loss_fn(output) must return a scalar tensor, got {what}")
    if not loss.requires_grad:
        raise ProfileError("loss_fn(output) does not depend on anything that requires grad; the model's output must "
                           "flow into the loss (and the model needs parameters or an input that requires grad)")


def fresh_copy(obj: Any) -> Any:
    """A copy of the tensors in ``obj`` (same requires_grad), so in-place ops never touch the caller's input."""
    return map_tensors(obj, lambda t: t.detach().clone().requires_grad_(t.requires_grad))


def to_device(obj: Any, dev: torch.device) -> Any:
    """``obj`` with its tensors on ``dev`` (tensors already there are returned as they are)."""
    return map_tensors(obj, lambda t: t if _same_device(t.device, dev) else t.to(dev))


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        cur = torch.cuda.current_device()
        return (cur if a.index is None else a.index) == (cur if b.index is None else b.index)
    return True


def resolve_device(modules: list[nn.Module], sample_input: Any, device: str | torch.device | None) -> torch.device:
    """The device to run on: ``device`` if given, else the model's, else the input's, else the CPU.

    Raises :class:`ProfileError` when the model spans several devices, when the model and the input (or ``device``)
    disagree, for meta tensors, and for CUDA without a GPU. The input is moved to ``device`` when that is given.
    """
    model_devs: list[torch.device] = []
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if not any(_same_device(t.device, d) for d in model_devs):
                model_devs.append(t.device)
    if len(model_devs) > 1:
        raise ProfileError(f"the model's parameters and buffers are spread over {', '.join(map(str, model_devs))}; "
                           f"put the whole model on one device first (model.to(device))")
    input_devs = [t.device for t in tensors(sample_input)]
    if not input_devs:
        raise ProfileError(f"the sample input holds no tensor (got {type(sample_input).__name__}); pass a tensor, "
                           f"or a tuple / list / dict of tensors")
    model_dev = model_devs[0] if model_devs else None
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ProfileError(f"device={device!r} is not a device: {e}") from None
        if model_dev is not None and not _same_device(model_dev, dev):
            raise ProfileError(f"the model is on {model_dev} but device={str(dev)!r}; move it first with "
                               f"model.to({str(dev)!r})")
    else:
        dev = model_dev if model_dev is not None else input_devs[0]
        for d in input_devs:
            if not _same_device(d, dev):
                raise ProfileError(f"the sample input is on {d} but the model is on {dev}; move the input with "
                                   f"x.to({str(dev)!r}) (or pass device=...)")
    if dev.type == "meta":
        raise ProfileError("meta tensors hold no data, so nothing can be timed or measured; materialise the model "
                           "and input on a real device (e.g. model.to_empty(device='cpu') and initialise it)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(f"device {dev} was asked for but CUDA is not available here; use device='cpu'")
    return dev


class preserved_state:
    """Context manager: on exit, every module's buffers, each parameter's ``.grad`` and the global RNG state
    (CPU, and CUDA on ``dev``) are as they were on entry. Inside, parameters that require grad have a zero
    ``.grad`` of their own (allocated before any measurement, as after a first training step)."""

    def __init__(self, modules: list[nn.Module], dev: torch.device):
        self.modules = modules
        self.dev = dev

    def __enter__(self) -> preserved_state:
        self._restore_buffers = buffer_snapshot(self.modules, host=True)  # not measured as device memory
        params = {id(p): p for m in self.modules for p in m.parameters()}.values()
        self._grads = [(p, p.grad) for p in params]
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        devices = [self.dev.index if self.dev.index is not None else torch.cuda.current_device()] \
            if self.dev.type == "cuda" else []
        self._rng = torch.random.fork_rng(devices=devices)
        self._rng.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._rng.__exit__(*exc)
        self._restore_buffers()
        for p, g in self._grads:
            p.grad = g
