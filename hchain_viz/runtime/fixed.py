"""Measure a model's fixed memory with its real optimizer (docs/design.md §7): parameters, gradients, optimizer state,
buffers, the optimizer step's transient peak, on CUDA cuBLAS's workspace, and under ``torch.autocast`` its cache of
weight copies, as a :class:`~hchain_viz.core.fixed.FixedMemory` in the precision that runs (docs/design.md §11).

The optimizer state is not guessed from the optimizer's name: two real ``optimizer.step()`` calls run on zero
gradients (the first creates the state lazily, as SGD with momentum and Adam do; the second is measured for its
transient), and the state's tensors are counted, each storage once. This works for any ``torch.optim`` optimizer.
:class:`training_state` puts the parameters, their ``.grad`` and the optimizer's state back afterwards, so the
user's model and optimizer are left as found. :func:`make_optimizer` builds the optimizers the command line names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.fixed import OPTIMIZERS, FixedMemory
from ..errors import HChainError, ProfileError
from .memtrack import MemoryMeter, map_tensors, nbytes, storage_of, tensors

__all__ = ["fixed_memory", "training_state", "optimizer_state_tensors", "check_optimizer", "make_optimizer",
           "autocast_cache", "step_precision"]

_AUTOCAST_NAMES = {torch.bfloat16: "bf16-mixed", torch.float16: "fp16-mixed"}
_WEIGHT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """The optimizer called ``name`` in :data:`~hchain_viz.core.fixed.OPTIMIZERS` on ``params``.

    Raises:
        HChainError: ``name`` is not in the table; the message lists the names.
    """
    if name not in OPTIMIZERS:
        raise HChainError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[name]
    return getattr(torch.optim, cls)(params, **kwargs)


def check_optimizer(optimizer: Any, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``optimizer`` if it is a torch optimizer over at least one of ``params``, else a ProfileError."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ProfileError(f"optimizer must be a torch.optim.Optimizer built on the model's parameters (e.g. "
                           f"torch.optim.AdamW(model.parameters())), got {type(optimizer).__name__}")
    own = {id(p) for p in params}
    if not any(id(p) in own for g in optimizer.param_groups for p in g["params"]):
        raise ProfileError(f"the {type(optimizer).__name__} holds none of the model's parameters; build it on this "
                           f"model: {type(optimizer).__name__}(model.parameters(), ...)")
    return optimizer


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, device: torch.device | None = None) -> list:
    """The tensors of the optimizer's state (on ``device`` when given: Adam keeps its ``step`` counters on the CPU)."""
    out = [t for st in optimizer.state.values() for t in tensors(dict(st))]
    return [t for t in out if device is None or t.device.type == device.type]


class training_state:
    """Context manager: on exit the parameters' values and ``.grad`` and the optimizer's state are as on entry.

    Parameter values and optimizer state are saved to host memory (so a GPU is not asked for a second copy) and
    copied back in place.
    """

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None):
        self.params = list({id(p): p for p in params}.values())
        self.optimizer = optimizer

    def __enter__(self) -> training_state:
        to_host = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
        self._values = [to_host(p) for p in self.params]
        self._grads = [p.grad for p in self.params]
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            self._opt = {"state": map_tensors(sd["state"], to_host),
                         "param_groups": [dict(g) for g in sd["param_groups"]]}
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for p, v, g in zip(self.params, self._values, self._grads):
                p.copy_(v)
                p.grad = g
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._opt)
            if not self._opt["state"]:  # load_state_dict keeps the keys it is given: none here, as before
                self.optimizer.state.clear()


def fixed_memory(model_params: list[torch.Tensor], stages: list[nn.Module], buffers: list[torch.Tensor],
                 optimizer: Any, device: torch.device, world_size: int = 1, *, sample_input: Any = None,
                 autocast: torch.dtype | None = None) -> FixedMemory:
    """The fixed part of a training step of the model made of ``stages`` with ``optimizer``.

    Args:
        model_params: every parameter of the model.
        stages: the chain's stages in order (a parameter used by several stages has its gradient created by the
            last one's backward, which runs first).
        buffers: the model's buffers.
        sample_input: the first stage's input. Under autocast, one forward on it without autograd measures the
            cache of weight copies stage by stage (:func:`autocast_cache`); without it, every trainable fp32 weight
            is counted as cast by the first stage using it (an upper bound: norms and embeddings are not cast).
        autocast: the 16-bit dtype the step's forward autocasts to; None: the autocast active on ``device`` now.

    Runs two optimizer steps on zero gradients and restores everything (see :class:`training_state`).
    The precision recorded is :func:`step_precision`'s.
    """
    optimizer = check_optimizer(optimizer, model_params)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ProfileError(f"world_size must be a positive integer (ranks sharding the model), got {world_size!r}")
    if autocast is None and torch.is_autocast_enabled(device.type):
        autocast = torch.get_autocast_dtype(device.type)
    if autocast is not None and autocast not in _AUTOCAST_NAMES:
        raise ProfileError(f"autocast to {autocast} is not a precision hchain_viz accounts for; autocast to "
                           f"torch.bfloat16 or torch.float16")
    seen: set[int] = set()
    stage_grads = [0] * len(stages)
    trained: list[torch.Tensor] = []
    for i in reversed(range(len(stages))):
        mine = [p for p in stages[i].parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in mine)
        stage_grads[i] = nbytes(mine)
        trained += mine
    users: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i, m in enumerate(stages):
        for p in m.parameters():
            if p.requires_grad and i not in users.setdefault(id(p), (p, []))[1]:
                users[id(p)][1].append(i)
    tied: dict[tuple[int, ...], int] = {}
    for p, used in users.values():
        if len(used) > 1:
            tied[tuple(used)] = tied.get(tuple(used), 0) + nbytes([p])
    casts: list[int] = []
    if autocast is not None and sample_input is not None:
        casts = autocast_cache(stages, sample_input, buffers, device, autocast)
    elif autocast is not None:  # every trainable fp32 weight, at its first stage (upper bound)
        first: dict[int, int] = {}
        for i, m in enumerate(stages):
            for p in m.parameters():
                if p.requires_grad and p.dtype == torch.float32:
                    first.setdefault(id(p), i)
        casts = [0] * len(stages)
        for p in trained:
            if id(p) in first:
                casts[first[id(p)]] += p.numel() * torch.finfo(autocast).bits // 8
    with training_state(model_params, optimizer):
        for p in model_params:
            p.grad = None
        for p in trained:
            p.grad = torch.zeros_like(p)
        try:
            optimizer.step()  # creates the state (lazily, in most optimizers)
            state = nbytes(optimizer_state_tensors(optimizer, device))
            with MemoryMeter(device) as meter:
                optimizer.step()
            step_tmp = max(0, meter.peak)
        except Exception as e:
            raise ProfileError(f"{type(optimizer).__name__}.step() failed on zero gradients ({type(e).__name__}: "
                               f"{e}); profile with an optimizer that can step on this model") from e
    return FixedMemory(params=nbytes(model_params), stage_grads=stage_grads, optimizer_state=state,
                       buffers=nbytes(buffers), step_tmp=step_tmp, optimizer=type(optimizer).__name__,
                       world_size=world_size, workspace=library_workspace(device),
                       precision=step_precision(trained, autocast), stage_casts=casts,
                       tied_grads=list(tied.items()))


def step_precision(params: list[torch.Tensor], autocast: torch.dtype | None) -> str:
    """The name in :data:`~hchain_viz.core.fixed.PRECISIONS` of a step whose trainable ``params`` are stepped as
    they are, under ``autocast`` (a 16-bit dtype, or None): the dtype holding most of their bytes decides."""
    by_dtype: dict[torch.dtype, int] = {}
    for p in params:
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
    dtype = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else torch.float32
    if dtype == torch.float32 and autocast is not None:
        return _AUTOCAST_NAMES[autocast]
    if dtype not in _WEIGHT_NAMES:
        raise ProfileError(f"the model's trainable weights are {dtype}; hchain_viz accounts for float32, bfloat16 "
                           f"and float16 weights")
    return _WEIGHT_NAMES[dtype]


def autocast_cache(stages: list[nn.Module], sample_input: Any, buffers: list[torch.Tensor], device: torch.device,
                   dtype: torch.dtype) -> list[int]:
    """Per stage, the bytes autocast's weight cache gains during that stage's forward under
    ``torch.autocast(device.type, dtype)``: the 16-bit copies of the fp32 weights it casts first (docs/design.md
    §11). One forward on ``sample_input``, stage by stage, without autograd (the cache fills all the same).

    Buffers (BatchNorm statistics) and the RNG are put back, and the cache is emptied before and after (autocast
    refills it at the next forward).
    """
    kept = [b.detach().clone() for b in buffers]
    devices = [device] if device.type == "cuda" else []
    made: list[int] = []  # per stage: bytes of its output made in the forward, alive at the stage's end
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), torch.autocast(device.type, dtype=dtype):
            torch.clear_autocast_cache()
            given = [storage_of(t) for t in tensors(sample_input)]
            with MemoryMeter(device) as meter:
                h = sample_input
                for stage in stages:
                    h = stage(h)
                    made.append(nbytes(h, exclude=[g for g in given if g is not None]))
                    meter.mark()  # the spans end with the stages' outputs alive
                del h
            torch.clear_autocast_cache()
    except HChainError:
        raise
    except Exception as e:
        raise ProfileError(f"a forward under torch.autocast({device.type!r}, dtype={dtype}) failed "
                           f"({type(e).__name__}: {e}); the model must run in the precision it is profiled in") from e
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, kept):
                b.copy_(v)
    # the level at a stage's end is the cache so far plus that stage's output
    held = [span.end - out for span, out in zip(meter.spans, made)]
    return [max(0, now - before) for before, now in zip([0, *held], held)]


def library_workspace(device: torch.device) -> int:
    """Bytes cuBLAS's workspaces hold in PyTorch's caching allocator on ``device`` (0 off CUDA): allocated at the
    first matrix product on each stream and kept, so resident through every later step. Measured by releasing them
    (the next product allocates them again)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if device.type != "cuda" or clear is None:
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    clear()
    return max(0, before - torch.cuda.memory_allocated(device))
