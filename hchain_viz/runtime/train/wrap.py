"""The functional form (docs/design.md §5.1): ``wrap(model, schedule)`` returns a module that trains by the schedule.

    wrapped = hcv.wrap(model, schedule)
    out = wrapped(x); loss = loss_fn(out); loss.backward(); opt.step()   # an ordinary training loop

Owns :func:`wrap` and :class:`ScheduledModule`: the ``nn.Module`` around the model (plain model in ``eval()`` and
under ``torch.no_grad()``, the plain model's ``state_dict`` keys, the precision warning); the training step itself
is the :class:`~hchain_viz.runtime.train.executor.Executor`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...core.schedule import Schedule
from ...errors import NotSequentialError
from ..compiled import check_not_compiled, compile_options
from ..precision import describe as describe_precision
from ..precision import precision_of, warn_other_precision
from ..stages import Stage
from .executor import Executor, as_schedule

__all__ = ["wrap", "ScheduledModule"]


def wrap(model: nn.Module, schedule: Schedule | str, *, preserve_rng_state: bool = True,
         compile: bool | Mapping[str, Any] = False) -> ScheduledModule:
    """An ``nn.Module`` that trains ``model`` by ``schedule`` (same results as eager, the schedule's memory).

    Args:
        schedule: a :class:`~hchain_viz.Schedule` (or its text, ``"Fck0 Fn1 Fall2 Loss B2 ..."``) for the stages
            ``hcv.sequentialize(model)`` finds, e.g. ``hcv.solve(hcv.profile(model, x)).schedule(budget)``.
        preserve_rng_state: replay recomputed stages with the random numbers of their first run, as
            ``torch.utils.checkpoint`` does; turn it off only for stages that draw none.
        compile: ``True`` compiles each stage with ``torch.compile`` (regional compilation; ``runtime/compiled.py``)
            while the executor stays eager; a dict gives ``torch.compile`` arguments. Profile with the same setting.
            The wrapped module itself must not be passed to ``torch.compile``.

    The returned module keeps ``model`` as a submodule, but ``state_dict()`` and ``load_state_dict()`` use the plain
    model's keys. In ``eval()`` mode or under ``torch.no_grad()`` it calls ``model``.
    """
    return ScheduledModule(model, schedule, preserve_rng_state=preserve_rng_state, compile=compile)


class ScheduledModule(nn.Module):
    """``model`` trained by ``schedule``; build it with :func:`wrap`.

    Attributes: ``model`` (the plain model), ``schedule``, ``executor`` (the :class:`Executor` that runs the steps),
    ``stages`` (the ``(name, module)`` chain, once known: at construction for structured models, else after the
    first training call).
    """

    def __init__(self, model: nn.Module, schedule: Schedule | str, *, preserve_rng_state: bool = True,
                 compile: bool | Mapping[str, Any] = False):
        super().__init__()
        if isinstance(model, ScheduledModule):
            raise NotSequentialError("the model is already wrapped by a schedule; wrap its .model instead")
        if not isinstance(model, nn.Module):
            raise NotSequentialError(
                f"wrap() needs an nn.Module, got {type(model).__name__}; put a list of stages into an "
                f"nn.Sequential first"
            )
        self.model = model
        self.schedule = as_schedule(schedule)
        self.preserve_rng_state = bool(preserve_rng_state)
        self.compile_options = compile_options(compile)
        # A plain object, not a submodule: its stages are model's own submodules (or parameter-free wrappers of
        # them), which registered again would duplicate state_dict keys.
        self.executor = Executor(model, self.schedule, preserve_rng_state=self.preserve_rng_state,
                                 compile_options=self.compile_options)
        self.length = self.executor.length
        self._warned_precisions: set[str] = set()  # the precisions other than the profiled one, warned about
        # Checkpoints carry the plain model's keys (no "model." prefix), in both directions, nested or not.
        self.register_state_dict_post_hook(_strip_model_prefix)
        self.register_load_state_dict_pre_hook(_add_model_prefix)

    @property
    def stages(self) -> list[Stage] | None:
        return self.executor.stages

    @torch.compiler.disable(recursive=False)  # never traced: the check below must run (see runtime/compiled.py)
    def forward(self, x: Any) -> Any:
        """Train by the schedule; in eval mode or without grad, run the plain model."""
        check_not_compiled()
        if not (self.training and torch.is_grad_enabled()):
            return self._plain(x)
        self._check_precision()
        return self.executor.train_step(x)

    def _plain(self, x: Any) -> Any:
        """The plain model on ``x``, called as its stages were found: a Sequential takes ``x`` itself, any other model
        the parts of a tuple or dict (``model(*x)``, ``model(**x)``)."""
        if isinstance(self.model, nn.Sequential):
            return self.model(x)
        from ..graph import _as_call

        args, kwargs = _as_call(x)
        return self.model(*args, **kwargs)

    def _check_precision(self) -> None:
        """Warn, once per precision, at a step run in another precision than the schedule's profiled one (its
        ``meta["precision"]``, set by ``hcv.checkpoint``; hcv.apply also reads the chain's)."""
        profiled = self.schedule.meta.get("precision")
        now = describe_precision(precision_of(self.model)) if profiled is not None else None
        if now is not None and now != profiled and now not in self._warned_precisions:
            self._warned_precisions.add(now)
            warn_other_precision(now, profiled, stacklevel=4)

    def train(self, mode: bool = True) -> ScheduledModule:
        super().train(mode)
        self.executor.forget_draws()
        for m in self.executor.stage_modules:  # wrappers made by sequentialize (not registered) follow the model's
            m.training = mode
        return self

    def extra_repr(self) -> str:
        return self.executor.describe()


# ---------------------------------------------------------------------------------------------- state_dict keys
_PREFIX = "model."


def _strip_model_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    inner = prefix + _PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    for key in [k for k in getattr(state_dict, "_metadata", {}) if k.startswith(inner) or k == prefix + "model"]:
        tail = key[len(inner):] if key.startswith(inner) else ""
        state_dict._metadata[prefix + tail if tail else prefix.rstrip(".")] = state_dict._metadata.pop(key)


def _add_model_prefix(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    # Every key under this module belongs to the plain model (the wrapper has no state of its own).
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)  # per-module versions (BatchNorm reads its own)
    if metadata is not None:
        own = prefix[:-1]
        for key in [k for k in metadata if k == own or k.startswith(prefix)]:
            metadata.setdefault(prefix + "model" + (f".{key[len(prefix):]}" if key != own else ""), metadata[key])
