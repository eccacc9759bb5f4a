"""The fixed part of a training step's memory (docs/design.md §7): what no checkpointing schedule changes.

A :class:`FixedMemory` records, for one model and its optimizer, the bytes of the parameters, of their gradients
(per stage, since a gradient appears during its stage's backward), of the optimizer state and of the buffers, plus
the optimizer step's own transient peak. ``world_size`` is the sharding factor (FSDP / ZeRO-3 style): it divides
parameters, gradients, optimizer state and the step's transient; buffers are replicated on every rank.

All sizes are stored unsharded (the whole model); the ``*_per_rank`` properties give what one rank holds. Sharding
rounds each part up (FSDP pads every tensor to a multiple of the world size, so a rank never holds less).

``precision`` names how the step keeps its numbers (:data:`PRECISIONS`, docs/design.md §11): fp32 throughout, autocast
over fp32 weights (``bf16-mixed``, ``fp16-mixed``: plus autocast's cache of low-precision weight copies), 16-bit
weights with fp32 master weights and optimizer state (``bf16-master``), or 16-bit everything (``bf16``, ``fp16``).
:meth:`FixedMemory.in_precision` derives one from another measured with the same activation width.
:data:`OPTIMIZERS` is the one table of optimizers the command line and the benchmarks offer by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..errors import HChainError, InvalidChain
from .units import finite_nonnegative, format_bytes

#: Optimizers by name for the command line and the benchmarks: name -> (``torch.optim`` class, keyword arguments).
#: Default hyperparameters: the memory does not depend on them. ``runtime.fixed.make_optimizer`` builds one.
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.01}),
    "sgd-momentum": ("SGD", {"lr": 0.01, "momentum": 0.9}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
}


@dataclass(frozen=True)
class Precision:
    """How a training step keeps its numbers, in bytes per element (docs/design.md §11)."""

    name: str
    weights: int  # the model's parameters and their gradients
    state: int  # the optimizer's state (the dtype of the tensors it steps)
    master: bool  # the optimizer steps an fp32 copy of the trainable weights (4 bytes per element, resident)
    autocast: bool  # the forward runs under torch.autocast, which caches a 16-bit copy of each fp32 weight it casts
    compute: int  # the activations' floating-point width (16-bit compute: 2)
    means: str  # what trains this way


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", 4, 4, False, False, 4, "float32 throughout"),
    Precision("bf16-mixed", 4, 4, False, True, 2, "torch.autocast to bfloat16 over float32 weights: "
              "Trainer(bf16=True), accelerate mixed_precision='bf16', Lightning precision='bf16-mixed'"),
    Precision("fp16-mixed", 4, 4, False, True, 2, "torch.autocast to float16 over float32 weights, with a "
              "GradScaler: Trainer(fp16=True), Lightning precision='16-mixed'"),
    Precision("bf16-master", 2, 4, True, False, 2, "bfloat16 weights and gradients, float32 master weights and "
              "optimizer state (DeepSpeed bf16, Megatron)"),
    Precision("bf16", 2, 2, False, False, 2, "bfloat16 weights, gradients and optimizer state: "
              "model.to(torch.bfloat16), Lightning precision='bf16-true'"),
    Precision("fp16", 2, 2, False, False, 2, "float16 weights, gradients and optimizer state: "
              "model.to(torch.float16), Lightning precision='16-true'"),
)}


def precision(name: Any) -> Precision:
    """The :class:`Precision` called ``name`` (one of :data:`PRECISIONS`).

    Raises:
        HChainError: ``name`` is not one of them; the message lists them.
    """
    if isinstance(name, Precision):
        return name
    if not isinstance(name, str) or name not in PRECISIONS:
        raise HChainError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)} "
                          f"(docs/fit.md says which trainer setting each is)")
    return PRECISIONS[name]


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
    - ``precision``: a name of :data:`PRECISIONS`. ``master_weights``: the fp32 copy of the trainable weights that
      the optimizer steps (``bf16-master``); resident, sharded.
    - ``stage_casts[i]``: under autocast, bytes of the 16-bit weight copies first made by stage i's forward (empty:
      none). Autocast caches them until its region exits, and the backward holds the ones it saved until their
      stage's backward, so a stage's copies are counted from its first forward to its backward ``B(i)``
      (``core.device.device_peak``); never during ``optimizer.step()``; not sharded (each rank casts the weights it
      computes with).
    - ``tied_grads``: per set of stages that use the same weights (a tied embedding and LM head), those stages
      (ascending) and the weights' gradient bytes. ``stage_grads`` counts them once, on the last stage; a pipeline
      device that runs another of these stages holds a copy of the weights, their gradient and optimizer state
      (``core.pipeline.stage_fixed``).
    """

    params: int
    stage_grads: tuple[int, ...]
    optimizer_state: int = 0
    buffers: int = 0
    step_tmp: int = 0
    optimizer: str = ""
    workspace: int = 0
    world_size: int = 1
    precision: str = "fp32"
    master_weights: int = 0
    stage_casts: tuple[int, ...] = ()
    tied_grads: tuple[tuple[tuple[int, ...], int], ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("params", "optimizer_state", "buffers", "step_tmp", "workspace", "master_weights"):
            set_(self, name, _size(getattr(self, name), name))
        if isinstance(self.stage_grads, (str, bytes)) or not hasattr(self.stage_grads, "__iter__"):
            raise InvalidChain(f"fixed.stage_grads must be a list of byte counts, one per stage; got "
                               f"{self.stage_grads!r}")
        set_(self, "stage_grads", tuple(_size(v, f"stage_grads[{i}]") for i, v in enumerate(self.stage_grads)))
        if isinstance(self.stage_casts, (str, bytes)) or not hasattr(self.stage_casts, "__iter__"):
            raise InvalidChain(f"fixed.stage_casts must be a list of byte counts, one per stage; got "
                               f"{self.stage_casts!r}")
        set_(self, "stage_casts", tuple(_size(v, f"stage_casts[{i}]") for i, v in enumerate(self.stage_casts)))
        if self.stage_casts and len(self.stage_casts) != len(self.stage_grads):
            raise InvalidChain(f"fixed.stage_casts has {len(self.stage_casts)} entries for "
                               f"{len(self.stage_grads)} stages; give one per stage (or none)")
        set_(self, "tied_grads", _tied_grads(self.tied_grads, len(self.stage_grads)))
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise InvalidChain(f"world_size must be a positive integer (the number of ranks sharding the model), "
                               f"got {ws!r}")
        set_(self, "optimizer", str(self.optimizer))
        try:
            precision(self.precision)
        except HChainError as e:
            raise InvalidChain(f"fixed.precision: {e}") from None

    # ------------------------------------------------------------------ per rank
    def _shard(self, n: int) -> int:
        return -(-n // self.world_size)

    @property
    def grads(self) -> int:
        """All gradients, whole model (bytes)."""
        return sum(self.stage_grads)

    @property
    def cast_cache(self) -> int:
        """All of autocast's weight copies (bytes; 0 outside autocast)."""
        return sum(self.stage_casts)

    def stage_cast(self, i: int) -> int:
        """Bytes of the weight copies stage i's forward makes under autocast (0 outside autocast)."""
        return self.stage_casts[i] if self.stage_casts else 0

    @property
    def static_per_rank(self) -> int:
        """Resident through forward and backward on one rank: parameters, master weights, optimizer state, buffers,
        the libraries' workspace and autocast's weight copies (not gradients)."""
        return self.at_step_per_rank + self.cast_cache

    @property
    def at_step_per_rank(self) -> int:
        """Resident on one rank during ``optimizer.step()``, gradients aside: the static part without autocast's
        weight copies (the autocast region has exited and the backward has freed the copies it needed)."""
        return (self._shard(self.params) + self._shard(self.master_weights) + self._shard(self.optimizer_state)
                + self.buffers + self.workspace)

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
        """Everything fixed on one rank once every gradient exists, autocast's weight copies included (the most
        the backward can hold besides activations)."""
        return self.static_per_rank + self.grads_per_rank

    @property
    def step_total_per_rank(self) -> int:
        """Everything fixed on one rank during ``optimizer.step()`` (every gradient, no autocast copies)."""
        return self.at_step_per_rank + self.grads_per_rank

    def precisions(self) -> list[str]:
        """The names :meth:`in_precision` derives from this record (its own first): those computing in the width it
        was profiled in, the autocast ones only if it was measured under autocast. For a device panel's choices."""
        at = precision(self.precision)
        return [self.precision] + [p.name for p in PRECISIONS.values() if p.name != at.name and
                                   p.compute == at.compute and (at.autocast or not p.autocast)]

    def in_precision(self, name: str) -> FixedMemory:
        """The same model and optimizer kept in precision ``name`` (one of :data:`PRECISIONS`).

        Parameters and gradients scale with the weights' width, optimizer state and its step's transient with the
        state's; master weights are 4 bytes per trainable element; buffers stay as measured. Activations are not
        rescaled, so only precisions that compute in the width the chain was profiled in are offered.

        Raises:
            HChainError: ``name`` is unknown; it computes in another width than ``self.precision``; or it
                autocasts and this record was not measured under autocast (its weight-cast cache is unknown).
        """
        to, at = precision(name), precision(self.precision)
        if to.compute != at.compute:
            raise HChainError(f"precision {to.name!r} computes in {8 * to.compute}-bit floats but this chain was "
                              f"profiled in {at.name!r} ({8 * at.compute}-bit activations); profile the model in "
                              f"{to.name} instead")
        if to.autocast and not at.autocast:
            raise HChainError(f"precision {to.name!r} runs under torch.autocast, whose cache of weight copies is "
                              f"measured by profiling under it; this chain was profiled in {at.name!r}: profile "
                              f"inside torch.autocast(...) instead")
        w = lambda n: -(-n * to.weights // at.weights)  # noqa: E731
        s = lambda n: -(-n * to.state // at.state)  # noqa: E731
        trainable = self.grads // at.weights  # elements
        return replace(self, precision=to.name, params=w(self.params), stage_grads=tuple(map(w, self.stage_grads)),
                       optimizer_state=s(self.optimizer_state), step_tmp=s(self.step_tmp),
                       master_weights=4 * trainable if to.master else 0,
                       stage_casts=self.stage_casts if to.autocast else (),
                       tied_grads=tuple((users, w(n)) for users, n in self.tied_grads))

    def with_world_size(self, world_size: int) -> FixedMemory:
        """The same model and optimizer sharded over ``world_size`` ranks."""
        return replace(self, world_size=world_size)

    def parts(self) -> dict[str, int]:
        """Per-rank bytes by part, for tables and messages (the workspace only where there is one)."""
        parts = {"parameters": self._shard(self.params), "gradients": self.grads_per_rank}
        parts |= {"master weights": self._shard(self.master_weights)} if self.master_weights else {}
        parts |= {"optimizer state": self._shard(self.optimizer_state), "buffers": self.buffers}
        parts |= {"library workspace": self.workspace} if self.workspace else {}
        return parts | ({"autocast weight copies": self.cast_cache} if self.cast_cache else {})

    def describe(self) -> str:
        """``'1.2 GiB (parameters 300 MiB, gradients 300 MiB, AdamW state 600 MiB, buffers 0 B)'``, the precision
        first when it is not fp32 (``'bf16-mixed: ...'``)."""
        parts = ", ".join(f"{f'{self.optimizer} state' if k == 'optimizer state' and self.optimizer else k} "
                          f"{format_bytes(v)}" for k, v in self.parts().items())
        shard = f", sharded over {self.world_size} ranks" if self.world_size > 1 else ""
        head = f"{self.precision}: " if self.precision != "fp32" else ""
        return f"{format_bytes(self.total_per_rank)} ({head}{parts}{shard})"

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "stage_grads": list(self.stage_grads), "optimizer_state": self.optimizer_state,
                "buffers": self.buffers, "step_tmp": self.step_tmp, "optimizer": self.optimizer,
                "world_size": self.world_size, "workspace": self.workspace, "precision": self.precision,
                "master_weights": self.master_weights, "stage_casts": list(self.stage_casts)} \
            | ({"tied_grads": [[list(users), n] for users, n in self.tied_grads]} if self.tied_grads else {})

    @classmethod
    def from_dict(cls, d: Any) -> FixedMemory:
        if not isinstance(d, dict) or "params" not in d or "stage_grads" not in d:
            raise InvalidChain("chain JSON field 'fixed' must be an object with at least 'params' and 'stage_grads'")
        keys = ("params", "stage_grads", "optimizer_state", "buffers", "step_tmp", "optimizer", "world_size",
                "workspace", "precision", "master_weights", "stage_casts", "tied_grads")
        return cls(**{k: d[k] for k in keys if k in d})


def _tied_grads(tied: Any, stages: int) -> tuple[tuple[tuple[int, ...], int], ...]:
    out = []
    for entry in tied or ():
        try:
            users, nbytes = entry
            users = tuple(int(u) for u in users)
        except (TypeError, ValueError):
            raise InvalidChain(f"fixed.tied_grads must be a list of [stages, bytes] pairs, got {entry!r}") from None
        if len(set(users)) < 2 or list(users) != sorted(set(users)) or not 0 <= users[0] <= users[-1] < stages:
            raise InvalidChain(f"each fixed.tied_grads entry names two or more distinct stages in ascending order, "
                               f"from 0 to {stages - 1}; got {list(users)!r}")
        out.append((users, _size(nbytes, "tied_grads bytes")))
    return tuple(out)


def _size(v: Any, name: str) -> int:
    return int(math.ceil(finite_nonnegative(v, f"fixed.{name}", "sizes", "a number of bytes")))
