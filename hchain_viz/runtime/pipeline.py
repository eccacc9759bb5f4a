"""Run a pipeline plan on ``torch.distributed.pipelining`` (docs/design.md §12).

``hcv.pipeline(model, plan, loss_fn)`` is called on every rank of a process group of ``plan.devices`` ranks. It cuts
``model`` into the plan's stages (the chain's stages, as ``hcv.sequentialize`` finds them), wraps this rank's stages
with their checkpointing schedule (``hcv.wrap``: the executor, same gradients as eager), and returns a
:class:`PipelineRun` whose ``step`` runs one training step with torch's ``Schedule1F1B``, ``ScheduleGPipe`` or
``ScheduleInterleaved1F1B`` (an interleaved plan: rank r builds its v stages ``c * P + r``).

A rank that fails does not leave the others waiting for ever: they wait at most the process group's timeout
(``dist.init_process_group(..., timeout=...)``), then raise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.pipeline import PipelinePlan
from ..errors import InvalidPipeline
from .stages import sequentialize
from .train.wrap import wrap

__all__ = ["pipeline", "PipelineRun", "metered_peak"]


@dataclass
class PipelineRun:
    """This rank's part of a pipeline: ``module`` (its stages, trained by ``schedule``; interleaved: an
    ``nn.ModuleList`` of its chunks), torch's ``stage`` (interleaved: the list of its stages) and ``runner`` (the
    ``Schedule1F1B`` / ``ScheduleGPipe`` / ``ScheduleInterleaved1F1B``). Call :meth:`step` on every rank."""

    plan: PipelinePlan
    rank: int
    module: nn.Module
    stage: Any
    runner: Any
    group: Any = None
    tied: tuple[tuple[nn.Parameter, Any], ...] = ()  # (parameter, its ranks' process group), see _tied_parameters

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.plan.devices - 1

    def step(self, inputs: Any = None, target: Any = None) -> list[torch.Tensor] | None:
        """One training step over ``plan.microbatches`` microbatches: the first rank gives the whole batch's
        ``inputs``, the last its ``target``; the others give nothing. Returns the last rank's per-microbatch losses
        (None elsewhere). Gradients are accumulated into the parameters, scaled by 1 / M (the mean over the batch); a
        parameter that stages on several ranks share (GPT-2's tied embedding and LM head) gets the sum over them."""
        if self.is_first and inputs is None:
            raise InvalidPipeline("the first rank's step needs the batch: run.step(inputs)")
        if self.is_last and target is None:
            raise InvalidPipeline("the last rank's step needs the loss target: run.step(target=y)")
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        kwargs = {"target": target, "losses": losses} if self.is_last else {}
        self.runner.step(*args, return_outputs=False, **kwargs)  # the last stage would keep every output
        for param, ranks in self.tied:  # the ranks that use it sum their parts, in the same order on each
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad, group=ranks)
            param.grad = grad
        return losses if self.is_last else None


def pipeline(model: nn.Module, plan: PipelinePlan, loss_fn: Any, *, group: Any = None,
             device: torch.device | str = "cpu", stages: list[tuple[str, nn.Module]] | None = None) -> PipelineRun:
    """This rank's stage of ``plan`` on ``torch.distributed.pipelining``, each stage trained by its schedule.

    Args:
        model: the whole model (every rank builds it alike; each keeps only its stages' modules in use).
        plan: from ``hcv.plan_pipeline(chain, ...)`` with the chain profiled at the microbatch size.
        loss_fn: ``loss_fn(output, target)`` per microbatch, on the last rank; a model output that is a mapping (a
            Hugging Face ``ModelOutput``) reaches it as its one tensor (the logits) or the tuple of its tensors.
        group: the process group (default the world); its size must be ``plan.devices``, rank r runs stage r
            (interleaved: stages ``c * P + r``, one per chunk c).
        stages: the ``(name, module)`` list of the chain's stages (default ``hcv.sequentialize(model)``).
    Returns:
        a :class:`PipelineRun`; call ``run.step(...)`` on every rank.
    Raises:
        InvalidPipeline when the world size is not the plan's stage count or the model's stages are not the
        chain's. See docs/design.md §12.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if not isinstance(plan, PipelinePlan):
        raise InvalidPipeline(f"pipeline() needs a PipelinePlan (hcv.plan_pipeline(...)), got {type(plan).__name__}")
    if not dist.is_initialized():
        raise InvalidPipeline("torch.distributed is not initialised; call dist.init_process_group(...) on every rank "
                              "first (with a timeout, so that a failing rank does not leave the others waiting)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != plan.devices:
        raise InvalidPipeline(f"the plan has {plan.devices} pipeline stages but the process group has {world} ranks; "
                              f"plan for {world} devices or start {plan.devices} ranks")
    stages = sequentialize(model) if stages is None else list(stages)
    names = tuple(n for n, _ in stages)
    if names != plan.chain.names:
        raise InvalidPipeline(f"the model's stages ({len(names)}: {', '.join(names[:4])}, ...) are not the plan's "
                              f"chain's ({plan.chain.length}: {', '.join(plan.chain.names[:4])}, ...); plan with the "
                              f"chain hcv.profile(model, ...) gives for this model")
    S = len(plan.stages)
    modules, torch_stages = [], []
    for j in range(rank, S, world):  # interleaved: chunk c of this rank is stage c * P + rank; else stage rank alone
        st = plan.stages[j]
        part = nn.Sequential(OrderedDict((name.replace(".", "_"), module) for name, module in stages[st.first:st.end]))
        module = wrap(part, st.schedule)
        if j == S - 1:
            module = _TensorOutput(module)
        stage = PipelineStage(module, j, S, torch.device(device), group=group)
        _keep_grads_through_inference(stage, module)
        modules.append(module)
        torch_stages.append(stage)
    if plan.kind == "interleaved":
        runner = ScheduleInterleaved1F1B(torch_stages, n_microbatches=plan.microbatches, loss_fn=loss_fn)
        return PipelineRun(plan, rank, nn.ModuleList(modules), torch_stages, runner, group,
                           _tied_parameters(stages, plan, rank, group))
    runner_cls = Schedule1F1B if plan.kind == "1F1B" else ScheduleGPipe
    runner = runner_cls(torch_stages[0], n_microbatches=plan.microbatches, loss_fn=loss_fn)
    return PipelineRun(plan, rank, modules[0], torch_stages[0], runner, group,
                       _tied_parameters(stages, plan, rank, group))


def _tied_parameters(stages: list[tuple[str, nn.Module]], plan: PipelinePlan, rank: int,
                     group: Any) -> tuple[tuple[nn.Parameter, Any], ...]:
    """The parameters this rank shares with stages on other ranks (a tied embedding and LM head), in the stages'
    order, each with a process group of the ranks that use it: each rank's backward gives only its own part of the
    gradient, which single-process training sums. Every rank builds the whole model and so finds the same list, and
    creates every group (``dist.new_group`` is collective), one per set of ranks; ranks that do not use a weight
    take no part in its sum, and hold no gradient for it."""
    groups: dict[tuple[int, ...], Any] = {}
    mine = []
    for param, used in _parameter_ranks(stages, plan):
        if len(used) < 2:
            continue
        key = tuple(sorted(used))
        if key not in groups:
            ranks = [r if group is None else dist.get_global_rank(group, r) for r in key]
            groups[key] = dist.new_group(ranks)
        if rank in used:
            mine.append((param, groups[key]))
    return tuple(mine)


def _parameter_ranks(stages: list[tuple[str, nn.Module]],
                     plan: PipelinePlan) -> list[tuple[nn.Parameter, set[int]]]:
    """Every parameter of the stages, in their order, with the ranks whose stages use it."""
    return [(param, {plan.rank_of(j) for j in used}) for param, used in _parameter_stages(stages, plan)]


def _parameter_stages(stages: list[tuple[str, nn.Module]],
                      plan: PipelinePlan) -> list[tuple[nn.Parameter, list[int]]]:
    """Every parameter of the stages, in their order, with the plan's stages that use it (ascending)."""
    used: dict[int, tuple[nn.Parameter, list[int]]] = {}
    for j, st in enumerate(plan.stages):
        for _, module in stages[st.first:st.end]:
            for param in module.parameters():
                entry = used.setdefault(id(param), (param, []))[1]
                if j not in entry:
                    entry.append(j)
    return list(used.values())


def metered_peak(plan: PipelinePlan, rank: int) -> int:
    """Rank ``rank``'s predicted peak as a ``MemoryMeter`` around ``run.step`` sees it (a step after the first, in
    which torch also infers shapes): its fixed memory and activation peak (``plan.rank_activations``) less the
    parameters and optimizer state, allocated before the step. The optimizer step, outside ``run.step``, is left
    out; its transient is in ``plan.peaks``. Interleaved: over the rank's chunks (the workspace once)."""
    sts = plan.rank_stages(rank)
    ws = plan.chain.fixed.workspace
    static = sum(st.chain.fixed.static_per_rank for st in sts) - (len(sts) - 1) * ws
    return plan.rank_fixed(rank)[0] + plan.rank_activations(rank) - static


class _TensorOutput(nn.Module):
    """The last stage's module, its output made what torch's stages accept: a mapping (a Hugging Face
    ``ModelOutput``) becomes its one tensor (the logits), or the tuple of its tensors in order."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        out = self.module(*args)
        if isinstance(out, Mapping):
            tensors = tuple(v for v in out.values() if isinstance(v, torch.Tensor))
            return tensors[0] if len(tensors) == 1 else tensors
        return out


def _keep_grads_through_inference(stage: Any, module: nn.Module) -> None:
    """Undo what the stage's first-step shape inference does to the parameters' gradients.

    torch's ``PipelineStage`` infers shapes by running the stage forward and backward on uninitialised tensors. A
    plain module's parameters are left alone (it asks for the inputs' gradients only), but the executor runs each
    ``B(i)`` as a backward of its own, which accumulates those garbage gradients into ``.grad``. The gradients are
    saved before and restored after (a no-op where torch's private hook is missing: then the first step's gradients
    would be wrong, and tests/test_pipeline_run.py says so).
    """
    infer = getattr(stage, "_backward_metadata_inference", None)
    if infer is None:
        return

    def keeping_grads(*args: Any, **kwargs: Any) -> Any:
        params = list(module.parameters())
        saved = [None if p.grad is None else p.grad.clone() for p in params]
        try:
            return infer(*args, **kwargs)
        finally:
            for p, g in zip(params, saved):
                p.grad = g

    stage._backward_metadata_inference = keeping_grads
