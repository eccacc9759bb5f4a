"""Measure a model's fixed memory with its real optimizer (DESIGN §7): parameters, gradients, optimizer state,
buffers, the optimizer step's transient peak and, on CUDA, cuBLAS's workspace, as a
:class:`~hchain_viz.core.fixed.FixedMemory`.

The optimizer state is not guessed from the optimizer's name: two real ``optimizer.step()`` calls run on zero
gradients (the first creates the state lazily, as SGD with momentum and Adam do; the second is measured for its
transient), and the state's tensors are counted, each storage once. This works for any ``torch.optim`` optimizer.
:class:`training_state` puts the parameters, their ``.grad`` and the optimizer's state back afterwards, so the
user's model and optimizer are left as found.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.fixed import FixedMemory
from ..errors import ProfileError
from .memtrack import MemoryMeter, map_tensors, nbytes, tensors

__all__ = ["fixed_memory", "training_state", "optimizer_state_tensors", "check_optimizer"]


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
                 optimizer: Any, device: torch.device, world_size: int = 1) -> FixedMemory:
    """The fixed part of a training step of the model made of ``stages`` with ``optimizer``.

    ``model_params``: every parameter of the model; ``stages``: the chain's stages in order (a parameter used by
    several stages has its gradient created by the last one's backward, which runs first); ``buffers``: the model's
    buffers. Runs two optimizer steps on zero gradients and restores everything (see :class:`training_state`).
    """
    optimizer = check_optimizer(optimizer, model_params)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ProfileError(f"world_size must be a positive integer (ranks sharding the model), got {world_size!r}")
    seen: set[int] = set()
    stage_grads = [0] * len(stages)
    trained: list[torch.Tensor] = []
    for i in reversed(range(len(stages))):
        mine = [p for p in stages[i].parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in mine)
        stage_grads[i] = nbytes(mine)
        trained += mine
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
                       world_size=world_size, workspace=library_workspace(device))


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
