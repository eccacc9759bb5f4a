"""The native form of a schedule: nested non-reentrant ``torch.utils.checkpoint`` regions (docs/design.md §5.3).

Owns :class:`NativeSchedule`, the executor of ``hcv.apply(..., native=True)``: it runs the schedule's segment tree
(``core/regions.py``, which also predicts the form's peak compiled whole), so ``torch.compile(model)`` compiles one
graph that keeps the schedule's memory. Also selective stages (:func:`selective_call`, saving only the outputs of
:data:`COSTLY_OPS`) and :func:`grad_bytes`, the parameter gradients a compiled step holds. Measurements:
docs/benchmarks.md (the native form under torch.compile).
"""

# NOTE [native guarantees]. As the executor's (docs/design.md §5.1), where torch.utils.checkpoint can keep them:
# - dropout: a recomputed region replays the random numbers of its first run (preserve_rng_state=True); the global
#   RNG is forked for the replay, never rewound;
# - BatchNorm running statistics: checkpoint reruns a region's forward in train mode, which would update them twice.
#   In eager mode each recomputation runs with its norm layers' statistics swapped for copies thrown away after
#   (context_fn, _stats_kept). Under torch.compile the buffer updates belong to the compiled forward and the
#   backward's recomputation does not repeat them (inductor, aot_eager). Dynamo's backend="eager" (no AOTAutograd)
#   is the exception: a region that updates statistics fails in the backward with autograd's in-place error,
#   loudly, never a wrong number.
# - a selective stage never runs inside a region: its policy's "save" wins over the region's "recompute", so it
#   would keep its saved outputs through the region.

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ...core.regions import Region, segment_tree, stage_count
from ...core.schedule import Schedule
from ..stages import Stage, find_stages

__all__ = ["NativeSchedule", "grad_bytes", "selective_call", "COSTLY_OPS"]

# The aten ops whose outputs a selective stage saves: what costs most to recompute. Everything else is recomputed.
COSTLY_OPS = ("convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution", "mm", "addmm", "bmm",
              "baddbmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def grad_bytes(stages: list[nn.Module]) -> list[int]:
    """Per stage, the bytes of the parameter gradients its backward creates first (a parameter shared by stages is
    counted at the last of them: the backward reaches it first)."""
    seen: set[int] = set()
    out = [0] * len(stages)
    for i in reversed(range(len(stages))):
        for p in stages[i].parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out[i] += p.numel() * p.element_size()
    return out


class NativeSchedule:
    """Runs a schedule's segment tree with ``torch.utils.checkpoint``: the executor of ``hcv.apply(...,
    native=True)``. Keeps the executor protocol (``runtime/train/executor.py``, Note: [executor protocol]).

    Raises:
        NotNative: the schedule is no tree of nested checkpoint regions.
    """

    def __init__(self, model: nn.Module, schedule: Schedule, *, preserve_rng_state: bool = True,
                 selective: bool = False):
        self.model = model
        self.schedule = schedule
        self.selective = bool(selective)
        self.tree = segment_tree(schedule)
        self.length = stage_count(schedule)
        self.preserve_rng_state = bool(preserve_rng_state)
        self.stages: list[Stage] | None = None
        self._modules: list[nn.Module] = []
        stages = find_stages(model, schedule)  # None: traced at the first training call
        if stages is not None:
            self.bind(stages)

    def bind(self, stages: list[Stage]) -> None:
        self.stages = list(stages)
        self._modules = [m for _, m in stages]

    def ensure_stages(self, x: Any) -> None:
        if self.stages is None:
            self.bind(find_stages(self.model, self.schedule, x))

    def train_step(self, x: Any) -> Any:
        return self._run(self.tree, x, top=True)

    def forget_draws(self) -> None:  # nothing learned across steps: torch.utils.checkpoint stashes RNG per region
        return None

    def _run(self, nodes: tuple, x: Any, top: bool = False) -> Any:
        for node in nodes:
            if isinstance(node, Region):
                x = self._region(node, x)
            elif top and self.selective:  # never inside a region: it would keep its saved outputs through it
                x = selective_call(self._modules[node], x, self.preserve_rng_state)
            else:
                x = self._modules[node](x)
        return x

    def _region(self, region: Region, x: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        kwargs: dict[str, Any] = {}
        norms = _norms(self._modules[region.start:region.end + 1])
        if norms and not torch.compiler.is_compiling():
            kwargs["context_fn"] = lambda: (contextlib.nullcontext(), _stats_kept(norms))
        return checkpoint(self._run, region.body, x, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)


def selective_call(stage: Any, x: Any, preserve_rng_state: bool = True) -> Any:
    """``stage(x)`` under selective activation checkpointing: the outputs of :data:`COSTLY_OPS` are saved, every
    other op is recomputed in the stage's backward (dropout with the draws of its first run). Under
    ``torch.compile`` the partitioner follows the same policy, a batch norm's statistics kept
    (:func:`_keep_costly_compiled`); in eager mode the recomputation updates copies of the running statistics,
    thrown away after, so that a step updates them once."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if torch.compiler.is_compiling():  # Dynamo takes the policy from this form
        context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_costly_compiled)
    else:
        norms = _norms([stage]) if isinstance(stage, nn.Module) else []

        def context_fn() -> tuple:
            forward, recompute = create_selective_checkpoint_contexts(_keep_costly)
            return forward, _entered(_stats_kept(norms), recompute)  # copies made outside its mode

    return checkpoint(stage, x, use_reentrant=False, preserve_rng_state=preserve_rng_state, context_fn=context_fn)


def _keep_costly(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if _op_name(op) in COSTLY_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_costly_compiled(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`_keep_costly` under ``torch.compile``, where a batch norm is left to the partitioner ("prefer save"
    binds it to nothing there; in eager mode it would save the output). Decomposed, the partitioner keeps its batch
    statistics and recomputes the normalisation inside the backward's kernels, as compile's own partition does: the
    policy sees the norm as one op and, told to recompute it, recomputes its reduction over the input too (the
    times with and without this: docs/benchmarks.md, CHANGELOG.md)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if "batch_norm" in _op_name(op):
        return CheckpointPolicy.PREFER_SAVE
    return _keep_costly(ctx, op, *args, **kwargs)


def _op_name(op: Any) -> str:
    """An aten op's name without its overload (``"convolution"``, ``"_native_batch_norm_legit"``)."""
    return getattr(getattr(op, "overloadpacket", None), "__name__", "")


def _norms(modules: list[nn.Module]) -> list[nn.Module]:
    """The norm layers among ``modules`` whose forward in train mode updates running statistics."""
    return [m for module in modules for m in module.modules()
            if isinstance(m, _NormBase) and m.track_running_stats and m.training]


@contextlib.contextmanager
def _entered(*managers: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


@contextlib.contextmanager
def _stats_kept(norms: list[nn.Module]) -> Iterator[None]:
    """A recomputation updates copies of the running statistics, thrown away after: eager updates them once."""
    swapped = []
    try:
        for m in norms:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                b = m._buffers.get(name)
                if b is not None:
                    m._buffers[name] = b.clone()
                    swapped.append((m, name, b))
        yield
    finally:
        for m, name, b in swapped:
            m._buffers[name] = b
