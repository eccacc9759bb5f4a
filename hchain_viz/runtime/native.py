"""The native form of a schedule: nested non-reentrant ``torch.utils.checkpoint`` regions (docs/design.md §5.3).

A persistent schedule is a tree of segments (:func:`segment_tree`): ``Fall(i) .. B(i)`` is a plain call, and
``Fck(i) Fn(i+1) .. Fn(j-1)``, then the ops of ``[j..l]``, then those of ``[i..j-1]`` is a checkpoint region over
``i..j-1`` whose body is that sub-schedule. :class:`NativeSchedule` runs the tree, so ``torch.compile(model)``
compiles one graph that keeps the schedule's memory; schedules that are no such tree raise :class:`NotNative`.
Selective stages (:func:`selective_call`) save only the outputs of :data:`COSTLY_OPS` and are predicted by
:func:`selective_chain`. Compiled whole, a schedule runs as :func:`compiled_schedule` says and peaks at
:func:`compiled_peak` (NOTE [compiled memory]); :func:`for_compile` picks the fastest that fits a budget.
Measurements: docs/benchmarks.md (the native form under torch.compile).
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
#
# NOTE [compiled memory]. torch.compile(model) does not run every tree as the schedule says (measured op by op on
# the partitioned backward graph, `bench compile --native`); both differences are predicted here:
# - a compiled backward is one graph in which each forward node is recomputed at most once and what it recomputes
#   stays until its last use: nested regions collapse into their top-level regions, each recomputed once storing
#   everything (compiled_tree). Single-level trees run as the schedule says;
# - the parameter gradients are outputs of that one backward graph: each is held from its stage's B until the whole
#   backward ends (eagerly each is added into .grad and freed at once).

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..core.chain import Chain
from ..core.schedule import Op, Schedule
from ..errors import InvalidSchedule, NotNative  # noqa: F401
from .stages import find_stages, stage_count

__all__ = ["NativeSchedule", "NotNative", "segment_tree", "tree_ops", "Region", "compiled_tree", "compiled_schedule",
           "grad_bytes", "compiled_peak", "for_compile", "selective_call", "selective_chain", "COSTLY_OPS"]

# The aten ops whose outputs a selective stage saves: what costs most to recompute. Everything else is recomputed.
COSTLY_OPS = ("convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution", "mm", "addmm", "bmm",
              "baddbmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


@dataclass(frozen=True)
class Region:
    """Stages ``start..end`` (inclusive) as one checkpoint region, recomputed by ``body`` (a list of ``int`` stages,
    run plainly, and inner ``Region``\\ s)."""

    start: int
    end: int
    body: tuple


def segment_tree(schedule: Schedule) -> tuple:
    """The schedule as nested regions: a tuple of top-level nodes, each a stage index (a plain call) or a
    :class:`Region`. Raises :class:`NotNative` where the ops are not of that shape."""
    ops = [(op.kind, op.stage) for op in schedule.ops]
    if any(kind in ("Off", "Pre") for kind, _ in ops):
        raise NotNative("the schedule offloads activations (Off/Pre ops); the native form has no transfers. Run it "
                        "by the executor (hcv.apply(model, schedule) without native=True)")
    L = stage_count(schedule)
    pos = 0

    def expect(kind: str, i: int) -> None:
        nonlocal pos
        if pos >= len(ops) or ops[pos] != (kind, i):
            got = f"{ops[pos][0]}{ops[pos][1]}" if pos < len(ops) else "the end"
            raise NotNative(f"op {pos} is {got} where the segment tree needs {kind}{i}; this schedule is not a tree "
                            f"of nested checkpoint regions (it recomputes in another order). Run it by the executor "
                            f"(hcv.apply(model, schedule) without native=True)", index=pos)
        pos += 1

    def parse(i: int, last: int, top: bool) -> list:
        nonlocal pos
        if i > last:
            if top:
                expect("Loss", L)
            return []
        kind = ops[pos][0] if pos < len(ops) and ops[pos][1] == i else None
        if kind == "Fall":
            pos += 1
            rest = parse(i + 1, last, top)
            expect("B", i)
            return [i, *rest]
        expect("Fck", i)
        j = i + 1
        while j <= last and pos < len(ops) and ops[pos] == ("Fn", j):
            pos += 1
            j += 1
        rest = parse(j, last, top)
        body = parse(i, j - 1, False)
        return [Region(i, j - 1, tuple(body)), *rest]

    tree = tuple(parse(0, L - 1, True))
    if pos != len(ops):
        raise NotNative(f"ops after position {pos} ({ops[pos][0]}{ops[pos][1]}) are not part of the segment tree")
    return tree


def tree_ops(tree: tuple, L: int) -> list[tuple[str, int]]:
    """The ops a segment tree runs (the inverse of :func:`segment_tree`)."""

    def ops(nodes: tuple, top: bool) -> list[tuple[str, int]]:
        if not nodes:
            return [("Loss", L)] if top else []
        node, rest = nodes[0], nodes[1:]
        if isinstance(node, int):
            return [("Fall", node), *ops(rest, top), ("B", node)]
        return ([("Fck", node.start)] + [("Fn", k) for k in range(node.start + 1, node.end + 1)] + ops(rest, top)
                + ops(node.body, False))

    return ops(tree, True)


def compiled_tree(tree: tuple) -> tuple:
    """What ``torch.compile`` runs for a segment tree: each top-level region recomputed once, storing everything
    (see NOTE [compiled memory])."""
    return tuple(n if isinstance(n, int) else Region(n.start, n.end, tuple(range(n.start, n.end + 1))) for n in tree)


def compiled_schedule(schedule: Schedule) -> Schedule:
    """The schedule ``torch.compile`` runs for ``schedule`` in the native form (itself when it is single-level)."""
    tree = segment_tree(schedule)
    flat = compiled_tree(tree)
    if flat == tree:
        return schedule
    return Schedule(tuple(Op(kind, i) for kind, i in tree_ops(flat, stage_count(schedule))),
                    meta={**schedule.meta, "compiled_form_of": schedule.meta.get("strategy", "schedule")})


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


def compiled_peak(chain: Chain, schedule: Schedule, grads: list[int], selective: Chain | None = None) -> int:
    """Predicted peak of ``schedule`` in the native form compiled whole: the simulator's peak of
    :func:`compiled_schedule`, with each stage's parameter gradients (``grads``, from :func:`grad_bytes`) held from
    its ``B`` to the end of the step. ``selective``: the form with selective stages, whose profile this is
    (:func:`selective_chain`)."""
    from ..core.simulate import simulate

    form = compiled_schedule(schedule)
    return _held_peak(simulate(selective_chain(chain, selective, form), form), grads)


def selective_chain(plain: Chain, selective: Chain | None, schedule: Schedule) -> Chain:
    """The chain ``schedule`` runs in the native form with selective stages: a stage outside every checkpoint region
    (forwarded once, by ``Fall``) has ``selective``'s times and sizes, a stage inside one ``plain``'s (its stages run
    plain). ``selective`` is the same model profiled with ``profile(..., selective=True)``; None (the plain form):
    ``plain`` itself."""
    import dataclasses

    if selective is None:
        return plain
    if selective.names != plain.names or not (selective.meta or {}).get("selective"):
        raise InvalidSchedule("selective= takes the same model's chain profiled with profile(..., compile=True, "
                              "selective=True)")
    in_region = {op.stage for op in schedule.ops if op.kind in ("Fck", "Fn")}
    mix = lambda ours, theirs: [p if i in in_region else q for i, (p, q) in enumerate(zip(ours, theirs))]  # noqa: E731
    return dataclasses.replace(plain, fwd_time=mix(plain.fwd_time, selective.fwd_time),
                               bwd_time=mix(plain.bwd_time, selective.bwd_time), xbar=mix(plain.xbar, selective.xbar),
                               fwd_tmp=mix(plain.fwd_tmp, selective.fwd_tmp),
                               bwd_tmp=mix(plain.bwd_tmp, selective.bwd_tmp))


def _held_peak(trace: Any, grads: list[int]) -> int:
    """The peak of a trace (of a compiled form) with each stage's parameter gradients held from its ``B`` on."""
    held = peak = 0
    for e in trace.events:
        peak = max(peak, e.mem_peak + held)
        if e.op.kind == "B":
            held += grads[e.op.stage]
    return peak


def for_compile(solution: Any, budget: int, grads: list[int], selective: Chain | None = None) -> Schedule:
    """The fastest single-level schedule whose compiled native form fits ``budget`` (:func:`compiled_peak`, with the
    parameter gradients ``grads`` held to the end of the backward). Candidates, each checked by the simulator: the
    single-level optimum (``solve(chain, single_level=True)``, at ``solution``'s resolution; ``solution`` itself
    when it is single-level) at budgets from ``budget`` down to its least, and the compiled forms of ``solution``'s
    own schedules there. ``selective``: for the form with selective stages (this model's chain profiled with
    ``selective=True``): the single-level optimum on that chain is a source of candidates too, and every candidate
    is judged on :func:`selective_chain`. Raises :class:`~hchain_viz.InvalidSchedule` when none fits."""
    from ..core.simulate import simulate
    from ..core.solver import solve

    chain = solution.chain
    one = solution if solution.single_level else solve(chain, solution.max_budget, solution.slots, single_level=True)
    sources = {id(one): one, id(solution): solution}
    if selective is not None:
        sel = solve(selective, solution.max_budget, solution.slots, single_level=True)
        sources[id(sel)] = sel
    best, seen = None, set()
    for source in sources.values():
        lo = source.min_budget
        if lo is None or lo > budget:
            continue
        for k in range(33):  # budgets from `budget` down to the least: the table's schedules there, in compiled form
            b = budget - (budget - lo) * k // 32
            try:
                s = compiled_schedule(source.schedule(b))
            except NotNative:  # a baseline that is no tree (never the DP's own schedules)
                continue
            if s.ops in seen:
                continue
            seen.add(s.ops)
            # s is its own compiled form: one replay gives both the peak and the time
            trace = simulate(selective_chain(chain, selective, s), s)
            if _held_peak(trace, grads) <= budget and (best is None or trace.makespan < best[0]):
                best = (trace.makespan, s)
    if best is None:
        raise InvalidSchedule(f"no schedule of this chain fits {budget} bytes when compiled whole (the parameter "
                              f"gradients alone are {sum(grads)} bytes until the backward ends); raise the budget or "
                              f"run the schedule by the executor")
    return Schedule(best[1].ops, meta={**best[1].meta, "strategy": "for_compile", "budget": budget})


class NativeSchedule:
    """Runs a schedule's segment tree with ``torch.utils.checkpoint``; the native executor of ``hcv.apply(...,
    native=True)``. Same interface as the executor's training path (``_ensure_stages``, ``_train_step``)."""

    def __init__(self, model: nn.Module, schedule: Schedule, *, preserve_rng_state: bool = True,
                 selective: bool = False):
        self.model = model
        self.schedule = schedule
        self.selective = bool(selective)
        self.tree = segment_tree(schedule)
        self.length = stage_count(schedule)
        self.preserve_rng_state = bool(preserve_rng_state)
        self.stages: list[tuple[str, nn.Module]] | None = None
        self._modules: list[nn.Module] = []
        stages = find_stages(model, schedule)  # None: traced at the first training call
        if stages is not None:
            self._set_stages(stages)

    def _set_stages(self, stages: list[tuple[str, nn.Module]]) -> None:
        self.stages = list(stages)
        self._modules = [m for _, m in stages]

    def _ensure_stages(self, x: Any) -> None:
        if self.stages is None:
            self._set_stages(find_stages(self.model, self.schedule, x))

    def _forget_draws(self) -> None:  # nothing learned across steps: torch.utils.checkpoint stashes RNG per region
        return None

    def _train_step(self, x: Any) -> Any:
        return self._run(self.tree, x, top=True)

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
    import functools

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
