"""The fixed part of a training step's memory (DESIGN §7): what no checkpointing schedule changes.

A :class:`FixedMemory` records, for one model and its optimizer, the bytes of the parameters, of their gradients
(per stage, since a gradient appears during its stage's backward), of the optimizer state and of the buffers, plus
the optimizer step's own transient peak. ``world_size`` is the sharding factor (FSDP / ZeRO-3 style): it divides
parameters, gradients, optimizer state and the step's transient; buffers are replicated on every rank.

All sizes are stored unsharded (the whole model); the ``*_per_rank`` properties give what one rank holds. Sharding
rounds each part up (FSDP pads every tensor to a multiple of the world size, so a rank never holds less).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InvalidChain
from .units import finite_nonnegative, format_bytes


@dataclass(frozen=True)
class FixedMemory:
    """Memory a training step holds whatever the schedule (bytes, whole model, before sharding).

    - ``params``: the parameters (each storage once: tied weights count once).
    - ``stage_grads[i]``: bytes of the parameter gradients first created by stage i's backward ``B(i)`` (a weight
      shared by several stages belongs to the last of them, whose backward runs first). The gradients live from
      their backward to the optimizer's ``zero_grad()`` (PyTorch's default ``set_to_none=True``).
    - ``optimizer_state``: the optimizer's state tensors after a step (momentum buffers, Adam's two moments, ...).
    - ``buffers``: module buffers (BatchNorm statistics, masks); never sharded.
    - ``step_tmp``: transient bytes above the resident set during ``optimizer.step()``.
    - ``workspace``: what the device's math libraries keep allocated once a step has run (on CUDA, cuBLAS's
      workspace per stream, taken from PyTorch's caching allocator; 0 on the CPU); resident, never sharded.
    - ``optimizer``: the optimizer's class name, for display. ``world_size``: the sharding factor (1: none).
    """

    params: int
    stage_grads: tuple[int, ...]
    optimizer_state: int = 0
    buffers: int = 0
    step_tmp: int = 0
    optimizer: str = ""
    workspace: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("params", "optimizer_state", "buffers", "step_tmp", "workspace"):
            set_(self, name, _size(getattr(self, name), name))
        if isinstance(self.stage_grads, (str, bytes)) or not hasattr(self.stage_grads, "__iter__"):
            raise InvalidChain(f"fixed.stage_grads must be a list of byte counts, one per stage; got "
                               f"{self.stage_grads!r}")
        set_(self, "stage_grads", tuple(_size(v, f"stage_grads[{i}]") for i, v in enumerate(self.stage_grads)))
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise InvalidChain(f"world_size must be a positive integer (the number of ranks sharding the model), "
                               f"got {ws!r}")
        set_(self, "optimizer", str(self.optimizer))

    # ------------------------------------------------------------------ per rank
    def _shard(self, n: int) -> int:
        return -(-n // self.world_size)

    @property
    def grads(self) -> int:
        """All gradients, whole model (bytes)."""
        return sum(self.stage_grads)

    @property
    def static_per_rank(self) -> int:
        """Resident through the whole step on one rank: parameters, optimizer state, buffers and the libraries'
        workspace (not gradients)."""
        return self._shard(self.params) + self._shard(self.optimizer_state) + self.buffers + self.workspace

    def stage_grad_per_rank(self, i: int) -> int:
        return self._shard(self.stage_grads[i])

    @property
    def grads_per_rank(self) -> int:
        return sum(self._shard(g) for g in self.stage_grads)

    @property
    def step_tmp_per_rank(self) -> int:
        return self._shard(self.step_tmp)

    @property
    def total_per_rank(self) -> int:
        """Everything fixed on one rank once every gradient exists (the state during ``optimizer.step()``)."""
        return self.static_per_rank + self.grads_per_rank

    def with_world_size(self, world_size: int) -> FixedMemory:
        """The same model and optimizer sharded over ``world_size`` ranks."""
        return replace(self, world_size=world_size)

    def parts(self) -> dict[str, int]:
        """Per-rank bytes by part, for tables and messages (the workspace only where there is one)."""
        parts = {"parameters": self._shard(self.params), "gradients": self.grads_per_rank,
                 "optimizer state": self._shard(self.optimizer_state), "buffers": self.buffers}
        return parts | ({"library workspace": self.workspace} if self.workspace else {})

    def describe(self) -> str:
        """``'1.2 GiB (parameters 300 MiB, gradients 300 MiB, AdamW state 600 MiB, buffers 0 B)'``."""
        parts = ", ".join(f"{f'{self.optimizer} state' if k == 'optimizer state' and self.optimizer else k} "
                          f"{format_bytes(v)}" for k, v in self.parts().items())
        shard = f", sharded over {self.world_size} ranks" if self.world_size > 1 else ""
        return f"{format_bytes(self.total_per_rank)} ({parts}{shard})"

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "stage_grads": list(self.stage_grads), "optimizer_state": self.optimizer_state,
                "buffers": self.buffers, "step_tmp": self.step_tmp, "optimizer": self.optimizer,
                "world_size": self.world_size, "workspace": self.workspace}

    @classmethod
    def from_dict(cls, d: Any) -> FixedMemory:
        if not isinstance(d, dict) or "params" not in d or "stage_grads" not in d:
            raise InvalidChain("chain JSON field 'fixed' must be an object with at least 'params' and 'stage_grads'")
        keys = ("params", "stage_grads", "optimizer_state", "buffers", "step_tmp", "optimizer", "world_size",
                "workspace")
        return cls(**{k: d[k] for k in keys if k in d})


def _size(v: Any, name: str) -> int:
    return int(math.ceil(finite_nonnegative(v, f"fixed.{name}", "sizes", "a number of bytes")))
