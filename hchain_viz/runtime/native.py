"""The native form of a schedule: PyTorch's own nested non-reentrant ``torch.utils.checkpoint`` regions.

A persistent schedule (DESIGN §3, what the DP returns) is a tree of segments. Read from its ops:

- ``Fall(i)`` ... ``B(i)``: stage i runs recording autograd (it stores its activations) - a plain call;
- ``Fck(i) Fn(i+1) .. Fn(j-1)``, then the ops of ``[j..l]``, then those of ``[i..j-1]``: stages ``i..j-1`` run without
  autograd from the kept checkpoint x_i and are recomputed, by their own sub-schedule, after ``[j..l]`` is done -
  a non-reentrant checkpoint region over ``i..j-1`` whose body is that sub-schedule (regions nest).

``torch.utils.checkpoint`` (non-reentrant) runs exactly that: the forward of a region saves its input only; the
backward, when it first needs a tensor of the region, reruns the region's body, whose plain stages store and whose
inner regions save their input again, then back-propagates it. So the memory and the recomputations are the
schedule's, and ``torch.compile(model)`` compiles the whole step as one graph with the regions inside (Dynamo
turns each region into its ``checkpoint`` higher-order op; the partitioner recomputes what it covers).

Schedules that are not such a tree (hand-written ones that recompute a stage a different way, offloading ops) are
refused with :class:`NotNative`, naming the op where the tree stops; :func:`segment_tree` gives the tree.

Guarantees, as the executor's (DESIGN §5):

- dropout: a recomputed region replays the random numbers of its first run (``preserve_rng_state=True``, the
  default), and the global RNG is forked for the replay, never rewound;
- BatchNorm running statistics: ``torch.utils.checkpoint`` reruns a region's forward in train mode, which would
  update them a second time. In eager mode each region's recomputation runs with the statistics of its norm layers
  swapped for copies that are thrown away (``context_fn``). Under ``torch.compile`` the buffer updates are part of
  the compiled forward and the backward's recomputation does not repeat them (tested with ``aot_eager``: losses,
  gradients, statistics and the RNG bitwise like the eager plain model). Dynamo's ``backend="eager"`` (no
  AOTAutograd) is the exception: a region that updates statistics fails in the backward with autograd's in-place
  error (loudly, never a wrong number); use inductor or ``aot_eager``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..core.schedule import Schedule
from ..errors import InvalidSchedule
from .stages import sequentialize

__all__ = ["NativeSchedule", "NotNative", "segment_tree", "tree_ops", "Region"]


class NotNative(InvalidSchedule):
    """The schedule is not a tree of segments (nested checkpoint regions); it can still run by the executor."""


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
    losses = [i for kind, i in ops if kind == "Loss"]
    if len(losses) != 1:
        raise NotNative(f"a schedule has exactly one Loss op; this one has {len(losses)}")
    L = losses[0]
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


class NativeSchedule:
    """Runs a schedule's segment tree with ``torch.utils.checkpoint``; the native executor of ``hcv.apply(...,
    native=True)``. Same interface as the executor's training path (``_ensure_stages``, ``_train_step``)."""

    def __init__(self, model: nn.Module, schedule: Schedule, *, preserve_rng_state: bool = True):
        self.model = model
        self.schedule = schedule
        self.tree = segment_tree(schedule)
        self.length = next(op.stage for op in schedule.ops if op.kind == "Loss")
        self.preserve_rng_state = bool(preserve_rng_state)
        self.stages: list[tuple[str, nn.Module]] | None = None
        self._modules: list[nn.Module] = []
        try:
            stages = sequentialize(model)
        except Exception:  # a custom forward: traced at the first training call
            stages = None
        if stages is not None and len(stages) == self.length:
            self._set_stages(stages)
        elif stages is not None and len(stages) != self.length:
            raise InvalidSchedule(f"the schedule is for a chain of {self.length} stages but {type(model).__name__} "
                                  f"has {len(stages)}; solve a chain profiled on this model")

    def _set_stages(self, stages: list[tuple[str, nn.Module]]) -> None:
        self.stages = list(stages)
        self._modules = [m for _, m in stages]

    def _ensure_stages(self, x: Any) -> None:
        if self.stages is None:
            stages = sequentialize(self.model, x)
            if len(stages) != self.length:
                raise InvalidSchedule(f"the schedule is for a chain of {self.length} stages but "
                                      f"{type(self.model).__name__} has {len(stages)}; solve a chain profiled on "
                                      f"this model")
            self._set_stages(stages)

    def _forget_draws(self) -> None:  # nothing learned across steps: torch.utils.checkpoint stashes RNG per region
        return None

    def _train_step(self, x: Any) -> Any:
        return self._run(self.tree, x)

    def _run(self, nodes: tuple, x: Any) -> Any:
        for node in nodes:
            if isinstance(node, int):
                x = self._modules[node](x)
            else:
                x = self._region(node, x)
        return x

    def _region(self, region: Region, x: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        kwargs: dict[str, Any] = {}
        norms = [m for k in range(region.start, region.end + 1) for m in self._modules[k].modules()
                 if isinstance(m, _NormBase) and m.track_running_stats and m.training]
        if norms and not torch.compiler.is_compiling():
            kwargs["context_fn"] = lambda: (contextlib.nullcontext(), _stats_kept(norms))
        return checkpoint(self._run, region.body, x, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)


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
