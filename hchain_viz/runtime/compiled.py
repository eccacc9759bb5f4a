"""Compiled stages: each stage of a chain compiled on its own by ``torch.compile`` (regional compilation).

``wrap(model, schedule, compile=True)`` and ``profile(model, x, compile=True)`` run every stage through
:func:`compile_stage`; the executor around the stages stays eager, so it runs any schedule across them:

- ``Fall`` calls the compiled stage with autograd recording: AOTAutograd's compiled forward, whose saved tensors are
  the stage's x̄ (what its partitioner chose to save), and ``B`` runs its compiled backward;
- ``Fck`` / ``Fn`` call it without autograd: Dynamo guards on the grad mode and compiles an inference graph.

Stages are compiled with ``fullgraph=True`` (a graph break inside a stage is an error, never a silent eager piece).
Identical layers share one compiled graph: Dynamo caches graphs per code object, and with its default
``inline_inbuilt_nn_modules`` parameters are graph inputs, so a second instance of the same block reuses the graph
of the first (a new graph only where shapes or grad modes differ). On inductor, ``fallback_random`` is on: random
ops call ATen's generators, so a recomputed stage replayed from the saved RNG state draws exactly the numbers of its
first run, whichever graph (training or inference) ran first.

A wrapped module cannot itself run under ``torch.compile``: Dynamo would trace the executor into one graph whose
partitioner decides what is saved, losing the schedule's memory (and it breaks the graph at every autograd.Function
of the executor). :func:`check_not_compiled` detects it and says to use ``compile=True``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import HChainError

__all__ = ["compile_options", "compile_stage", "check_not_compiled", "describe", "budget_backend"]

_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")


def compile_options(compile: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The keyword arguments for ``torch.compile`` that ``compile=`` asks for; None when nothing is compiled.

    ``True``: the defaults (inductor, ``fullgraph=True``, ``fallback_random``); a mapping: ``torch.compile`` keyword
    arguments over those defaults (e.g. ``{"backend": "aot_eager"}`` or ``{"mode": "max-autotune"}``), plus one key of
    ours, ``"activation_memory_budget"`` (0 to 1): each stage's graph is partitioned under that budget of
    ``torch._functorch.config`` (what it saves for backward shrinks, cheap ops are recomputed inside its backward),
    while the schedule decides across stages. On the demo models a budget of 0.1 halves what the compiled stages
    save at a small backward cost (README, compile benchmark).
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        given: dict[str, Any] = {}
    elif isinstance(compile, Mapping):
        given = dict(compile)
    else:
        raise HChainError(f"compile= takes True, False or a dict of torch.compile arguments, got "
                          f"{type(compile).__name__}")
    options = {"fullgraph": True, **given}
    if "activation_memory_budget" in options:
        budget = options.pop("activation_memory_budget")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
            raise HChainError(f"activation_memory_budget must be a number from 0 to 1 (1: save what the "
                              f"partitioner saves by default), got {budget!r}")
        if options.get("backend", "inductor") != "inductor":
            raise HChainError("activation_memory_budget works with the inductor backend only; drop 'backend' or "
                              "the budget")
        patches = {"fallback_random": True, **dict(options.pop("options", None) or {})}
        options["backend"] = budget_backend(float(budget), patches)
        return options
    if options.get("backend", "inductor") == "inductor":
        options["options"] = {"fallback_random": True, **dict(options.get("options") or {})}
    return options


class budget_backend:  # noqa: N801 - a backend is called like a function, torch.compile(backend=...)
    """Inductor with ``activation_memory_budget`` set while a graph is partitioned (AOTAutograd partitions at compile
    time, so each compiled graph keeps its own budget) and inductor ``config_patches``."""

    def __init__(self, budget: float, config_patches: dict[str, Any] | None = None):
        self.budget, self.config_patches = budget, dict(config_patches or {})

    def __call__(self, gm: Any, example_inputs: list) -> Any:
        import torch._functorch.config
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return compile_fx(gm, example_inputs, config_patches=self.config_patches)

    def __repr__(self) -> str:
        return f"inductor(activation_memory_budget={self.budget})"


def describe(options: dict[str, Any]) -> str:
    """A short text of the compile settings, for ``Chain.meta`` and reprs."""
    return ", ".join(f"{k}={v!r}" for k, v in options.items())


def compile_stage(module: Any, options: dict[str, Any], n_stages: int) -> Callable[[Any], Any]:
    """``module`` compiled with ``options``, as a callable of one argument.

    Dynamo allows 8 graphs per code object by default; the stages of one chain often share code objects (every
    ``nn.Sequential`` runs ``Sequential.forward``), each in up to three modes (recording, no-grad, input without
    grad), so the limit is raised for these calls only, never for the user's other compiled code.
    """
    import torch
    import torch._dynamo

    compiled = torch.compile(module, **options)
    # Added to the limit, not a floor: graphs this code object already has (the same stages compiled earlier, or with
    # another compile=, such as another activation_memory_budget) count against it too.
    limit = torch._dynamo.config.recompile_limit + 4 * n_stages

    def run(x: Any) -> Any:
        with torch._dynamo.config.patch(recompile_limit=limit):
            return compiled(x)

    return run


def check_not_compiled(native_hint: bool = False) -> None:
    """Raise when the caller runs inside code compiled by ``torch.compile`` (a ``compile_wrapper`` frame of Dynamo
    is on the stack). The caller must be excluded from tracing (``torch.compiler.disable``), so that this runs."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename.endswith(_EVAL_FRAME):
            if native_hint:  # a schedule applied in place (hcv.apply)
                raise HChainError(
                    "a model with a schedule applied by the executor is running under torch.compile; Dynamo would "
                    "trace the executor and its partitioner, not the schedule, would decide what is kept. Apply the "
                    "schedule in its native form, which compiles whole with the schedule inside: hcv.remove(model); "
                    "hcv.apply(model, schedule, native=True); torch.compile(model) (or compile each stage: "
                    "hcv.apply(model, schedule, compile=True) without torch.compile)"
                )
            raise HChainError(
                "a module wrapped by a schedule is running under torch.compile; Dynamo would trace the executor and "
                "its partitioner, not the schedule, would decide what is kept (the schedule's memory is lost). Wrap "
                "the plain model with compile=True instead: hcv.wrap(model, schedule, compile=True) compiles each "
                "stage and runs the schedule across them"
            )
        frame = frame.f_back
