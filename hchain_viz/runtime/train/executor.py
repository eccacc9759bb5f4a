"""The executor (docs/design.md §5.1): :class:`Executor` runs a schedule's ops on a model's stages, one training step
per call, for both forms that train by it (``hcv.wrap``: ``train/wrap.py``; ``hcv.apply``: ``train/inplace.py``).

Owns the executor, what it learns across steps (:class:`Learned`), one step's op interpreter (``_Step``), the
autograd Functions that run the ops after ``Loss`` inside the backward, and the schedule checks (grammar, op roles).
The protocol every executor of an applied schedule keeps, the native form's too, is :class:`StepRunner`.

What is kept between ops follows the memory model of docs/design.md §3: ``Fck``/``Fn`` run a stage without autograd
(keeping / dropping its input), ``Fall`` runs it recording autograd from a detached alias of its input (the graph of
one stage is x̄_{i+1}), ``B(i)`` back-propagates that graph and frees it with δ_{i+1} and the checkpoint x_i.
Consecutive ``Fall``s whose backwards are adjacent share one graph and one backward call, as eager PyTorch runs them.
The guarantees (outputs and gradients equal eager's, RNG replayed, buffers updated once, in-place inputs safe) are
listed in docs/design.md §5.1, each tested in ``tests/test_wrap*.py``.
"""

# Note: [executor protocol]. An applied schedule drives its executor only through these (StepRunner):
# - ``length``: the schedule's stage count; ``stages``: the bound ``(name, module)`` stages, None until known;
# - ``bind(stages)``: run these stages from now on (what was learned about the previous ones is dropped);
# - ``ensure_stages(x)``: bind the stages traced on the training input ``x`` if none are bound (or, for the executor,
#   if they were traced in another precision than the one running now);
# - ``train_step(x)``: one training forward on x_0 = ``x``, returning x_L; the caller's ``backward()`` runs the rest;
# - ``forget_draws()``: the train/eval modes of submodules changed: relearn which stages draw random numbers.
# Nothing else of an executor is read from outside it; what it learns across steps stays in it.

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ...core.chain import Chain
from ...core.regions import stage_count
from ...core.schedule import Schedule
from ...core.simulate import simulate
from ...errors import HChainError, InvalidSchedule, NotSequentialError
from ..compiled import compile_stage, describe
from ..memtrack import (
    backward_handing_over,
    cuda_devices,
    flatten,
    made_storages,
    pointers,
    split_inputs,
    storage_of,
    unflatten,
)
from ..precision import autocast_now, precision_of, runs_in, uncached
from ..precision import describe as describe_precision
from ..snapshot import buffer_snapshot
from ..stages import Stage, find_stages, sequentialize
from ..transfer import Link, box_holder, data_holder, storage_key

__all__ = ["Executor", "StepRunner", "Learned", "as_schedule"]

_SPENT = object()  # bookkeeping placeholder: a δ or x̄ already consumed by the backward of its group
_Op = tuple[str, int, int, bool]  # (kind, stage, role, joins the previous stage's graph)

# Roles of a forward op within one step, computed once from the schedule.
_ONLY = 0  # the stage runs once per step (or this is a first run whose stage is never replayed)
_FIRST = 1  # first run of a stage that is replayed later: remember its RNG state and which buffers it updates
_REPLAY = 2  # a recomputation: same RNG as the first run, buffers left as the first run left them


class StepRunner(Protocol):
    """What an applied schedule asks of its executor (see Note: [executor protocol]); :class:`Executor` and
    :class:`~hchain_viz.runtime.train.native.NativeSchedule` keep it."""

    length: int
    stages: list[Stage] | None

    def bind(self, stages: list[Stage]) -> None: ...

    def ensure_stages(self, x: Any) -> None: ...

    def train_step(self, x: Any) -> Any: ...

    def forget_draws(self) -> None: ...


class Learned:
    """What the executor learns about its stages across steps (each None while not known yet).

    ``mutates[i]``: stage i writes into its input; ``draws[i]``: its forward draws random numbers (relearned after a
    mode change); ``grad_mask[i]``: which tensors of x_i need a gradient, learned for the parameters' requires_grad
    ``grad_mask_for``; ``frees``: what each ``Fall`` (by op number) frees of its input (:class:`_Frees`), learned in
    one step for the setting ``frees_for``, reading the made storages of the boundaries ``frees_made``.
    """

    def __init__(self, length: int):
        self.mutates: list[bool | None] = [None] * length
        self.draws: list[bool | None] = [None] * length
        self.grad_mask: list[list[bool] | None] = [None] * (length + 1)
        self.grad_mask_for: tuple[bool, ...] | None = None
        self.frees: dict[int, _Frees] | None = None
        self.frees_for: Any = None
        self.frees_made: set[int] = set()

    def forget_stages(self) -> None:
        """New stages: which cut tensors need a gradient and what each Fall frees are learned again."""
        self.grad_mask_for = None
        self.frees = None

    def forget_draws(self) -> None:
        self.draws = [None] * len(self.draws)

    def record_frees(self, frees: dict[int, _Frees], setting: Any, made: set[int]) -> None:
        """What each Fall freed in one whole step, for ``setting``; ``made``: the boundaries whose made storages
        those frees read."""
        self.frees, self.frees_for, self.frees_made = frees, setting, made


class Executor:
    """Runs ``schedule``'s ops on the stages of ``model``, one training step per :meth:`train_step`.

    Args:
        model: the model whose stages run (``find_stages``: found now, or traced at the first training input).
        schedule: a :class:`~hchain_viz.Schedule` for that many stages (its grammar is checked here).
        preserve_rng_state: replay recomputed stages with the random numbers of their first run.
        compile_options: ``torch.compile`` arguments for each stage (``runtime/compiled.py``), or None (eager).

    Raises:
        InvalidSchedule: the schedule breaks the grammar, or is for another number of stages than the model's.
    """

    def __init__(self, model: nn.Module, schedule: Schedule, *, preserve_rng_state: bool = True,
                 compile_options: dict[str, Any] | None = None):
        self.model = model
        self.schedule = schedule
        self.preserve_rng_state = bool(preserve_rng_state)
        self.compile_options = compile_options
        self.length, self.joined = _check_grammar(schedule)
        self.forward_ops, self.backward_ops, self.group_start = _op_roles(schedule, self.length, self.joined)
        self.stages: list[Stage] | None = None
        self.stage_modules: list[nn.Module] = []
        self.stage_tensors: list[_LocalTensors] = []  # per stage: its parameters and buffers, read live each step
        self.runners: list[Any] = []  # what runs stage i: its module, or its compiled version
        self.stage_buffers: list[list[tuple[nn.Module, str]]] = []
        self.stats_buffers: list[list[tuple[nn.Module, str]]] = []
        self.learned = Learned(self.length)
        stages = find_stages(model, schedule)  # None: traced from the first training input
        if stages is not None:
            self.bind(stages)

    # ------------------------------------------------------------------ the protocol
    def bind(self, stages: list[Stage]) -> None:
        """Run ``stages`` from now on (the model's own submodules, or parameter-free wrappers of them)."""
        self.stages = list(stages)
        self.stage_modules = [m for _, m in stages]
        self.stage_tensors = [_LocalTensors(m) for m in self.stage_modules]
        self.learned.forget_stages()
        params = [{id(p) for p in m.parameters() if p.requires_grad} for m in self.stage_modules]
        self.forward_ops, self.backward_ops, self.group_start = _op_roles(self.schedule, self.length, self.joined,
                                                                          params)
        options = self.compile_options
        self.runners = (self.stage_modules if options is None
                        else [compile_stage(m, options, len(stages)) for m in self.stage_modules])
        self.stage_buffers = [
            [(mod, name) for mod in m.modules() for name, b in mod._buffers.items() if b is not None]
            for m in self.stage_modules
        ]
        # Normalisation layers update their running statistics inside the kernel, without bumping the version
        # counter that reveals other in-place buffer updates: name them up front.
        self.stats_buffers = [
            [(mod, name) for mod in m.modules() if isinstance(mod, _NormBase) and mod.track_running_stats
             for name in ("running_mean", "running_var", "num_batches_tracked") if mod._buffers.get(name) is not None]
            for m in self.stage_modules
        ]

    def ensure_stages(self, x: Any) -> None:
        """Bind the stages traced on ``x`` if none are bound, or those of the precision running now."""
        if self.stages is not None:
            if runs_in(self.stages, precision_of(self.model)):
                return
            self._stages_in_precision(x)
            return
        self.bind(find_stages(self.model, self.schedule, x))

    def train_step(self, x: Any) -> Any:
        """One training forward by the schedule on x_0 = ``x``, returning x_L; its backward runs the ops after
        ``Loss``."""
        self.ensure_stages(x)
        self._learn_grad_mask(x)
        step = _Step(self, x)
        flat, _ = flatten(x)
        # The dummy makes autograd call our backward even when no input requires grad (parameters still need it).
        dummy = torch.empty(0, requires_grad=True)
        token = _RunForward.apply(step, dummy, *flat)
        outputs = _Output.apply(step, token)
        return unflatten(step.out_spec, list(outputs))

    def forget_draws(self) -> None:
        """Dropout may come and go with the train/eval mode: learn again which stages draw random numbers."""
        self.learned.forget_draws()

    def describe(self) -> str:
        """The schedule and how its stages run, in words (for ``repr``)."""
        name = self.schedule.meta.get("strategy", "schedule")
        text = f"schedule={name}: {len(self.schedule)} ops, {self.schedule.n_recomputed} recomputed forwards"
        return text + (f", compiled stages ({describe(self.compile_options)})" if self.compile_options else "")

    # ------------------------------------------------------------------ learning
    def _stages_in_precision(self, x: Any) -> None:
        """The stages (traced by torch.export in another precision) traced again in the one running now: the same
        names, at the granularity that gives them."""
        names = [n for n, _ in self.stages]
        for granularity in (None, "sublayer", "finest"):
            stages = sequentialize(self.model, x, granularity=granularity)
            if [n for n, _ in stages] == names:
                self.bind(stages)
                return
        raise NotSequentialError(
            f"the stages of this {type(self.model).__name__} were traced in another precision and come out "
            f"differently in {describe_precision(precision_of(self.model))}; wrap the model again inside the "
            f"precision it trains in")

    def _learn_grad_mask(self, x: Any) -> None:
        """Which tensors of each cut need a gradient (``learned.grad_mask``), as eager autograd decides: one forward,
        stage by stage, each graph dropped at once, with buffers, the RNG and the input left as found. Once, and
        again whenever the parameters that require grad change. A no-grad forward (Fn, Fck) cannot tell, and guessing
        "every floating-point tensor" computed gradients for attention masks and rotary tables that eager never
        computes (memory the chain does not count)."""
        learned = self.learned
        params = tuple(p.requires_grad for t in self.stage_tensors for p in t.own_parameters())
        if learned.grad_mask_for == params:
            return
        restore = buffer_snapshot(self.stage_modules)
        try:
            with torch.random.fork_rng(devices=cuda_devices(x)), torch.enable_grad():
                flat, spec = flatten(x)
                for i, stage in enumerate(self.stage_modules):  # eager: compiled stages would compile again
                    leaves = [t.detach().clone() for t in flat]  # a copy: in-place
                    leaves = [(uncached(t) if autocast_now() else t).requires_grad_(o.requires_grad)
                              for t, o in zip(leaves, flat)]
                    feed = unflatten(spec, [_Alias.apply(t) if t.requires_grad else t for t in leaves])
                    out = stage(feed)
                    flat, spec = flatten(out)
                    learned.grad_mask[i + 1] = [t.requires_grad for t in flat]
                    flat = [t.detach().requires_grad_(t.requires_grad) for t in flat]
                    del feed, leaves, out
        finally:
            restore()
        learned.grad_mask_for = params


# ---------------------------------------------------------------------------------------------- one step
class _Step:
    """What one training step holds, named as in the memory model (docs/design.md §3).

    ``x[i]``: plain activations (x_0 and checkpoints); ``xbar[i]``: (input leaves, output) of ``Fall(i)``, whose
    autograd graph is x̄_{i+1}; ``delta[i]``: δ_i as a list aligned with the tensors of x_i.
    """

    def __init__(self, executor: Executor, x0: Any):
        self.ex = executor
        self.known = known = executor.learned  # what the executor learned so far; this step adds to it
        self.L = executor.length
        self.x: dict[int, Any] = {0: x0}
        self.xbar: dict[int, tuple[list[torch.Tensor | None], Any]] = {}
        self.delta: dict[int, list[torch.Tensor | None]] = {}
        self.rng: dict[int, tuple[bytes, list[bytes]]] = {}  # per replayed stage that draws: its RNG state
        self.updated_buffers: dict[int, list[tuple[nn.Module, str]]] = {}
        self.stand_ins: dict[int, torch.Tensor] = {}  # a replay's buffer copies (by storage) -> the originals
        self.out: Any = None
        self.out_spec: Any = None
        self.group_delta: list[torch.Tensor | None] = []  # δ_k of the group being back-propagated
        # For freeing transit bytes (chain.transit): per boundary i, the data pointers of the storages of x_i that the
        # forward of stage i-1 made; per stage i, those of what its last Fall saved for its backward.
        self.made: dict[int, set[int]] = {}
        self.saved: dict[int, set[int]] = {}
        # For freeing consumed bytes (chain.consumed): per boundary i whose x_i is the output inside x̄_i, the data
        # pointers of the storages of x_i that only B(i) needs.
        self.consumed: dict[int, set[int]] = {}
        # Per boundary i whose x_i is the output inside x̄_i: the data pointers of the tensors made two stages back
        # and handed on that only B(i) needs (chain.consumed_shared).
        self.eaten: dict[int, set[int]] = {}
        self.devices = cuda_devices(x0)
        self.autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        # The transfer channel (Off/Pre, docs/design.md §9): only for schedules that have transfers.
        self.link = (Link(torch.device("cuda", self.devices[0]) if self.devices else None)
                     if executor.schedule.n_transfers else None)  # (devices are indices)
        # Which input tensors each Fall frees depends on what the stages save, fixed by their code, the cuts'
        # structure and the setting. Noting every saved tensor (saved-tensor hooks, see _packing) costs about 9 ms a
        # step on densenet121 at sub-layer granularity, so it is learned in one step (``learning``), by position in
        # the flattened input, and read in the later ones (``frees``). Not in the first step: a stage not seen yet
        # runs Fck on a copy of its input (NOTE [in-place inputs]), so what it hands on looks made by it (and it is
        # relearned if a stage is later seen writing into its input). Storages are still noted as made where a
        # learned free reads them: only what the stage before made is ever freed. With transfers, nothing is noted.
        self.setting = (known.grad_mask_for, tuple(self.autocast), tuple(known.mutates),
                        tuple((t.shape, t.dtype, t.requires_grad) for t in flatten(x0)[0]))
        noting = self.link is None
        same = noting and known.frees is not None and known.frees_for == self.setting
        self.frees: dict[int, _Frees] | None = known.frees if same else None
        self.learning: dict[int, _Frees] | None = (
            {} if noting and not same and None not in known.mutates else None)
        self.hooks = noting and not same  # note what each Fall saves (see _packing)

    # ------------------------------------------------------------------ phases
    def run_forward(self) -> None:
        for n, (kind, i, role, joined) in enumerate(self.ex.forward_ops):
            if kind in ("Off", "Pre"):
                self._transfer(kind, i)
            else:
                self._forward_op(n, kind, i, role, joined, in_backward=False)

    def run_backward(self) -> list[torch.Tensor | None]:
        if self.L not in self.delta:
            raise HChainError("the wrapped model's backward ran twice for one forward; call the model again first")
        first = len(self.ex.forward_ops)
        for n, (kind, i, role, joined) in enumerate(self.ex.backward_ops, first):
            if kind in ("Off", "Pre"):
                self._transfer(kind, i)
            elif kind == "B":
                self._backward_op(i)
            else:
                self._forward_op(n, kind, i, role, joined, in_backward=True)
        if self.learning is not None:  # a whole step: what each Fall frees is known for this setting
            ops = [*self.ex.forward_ops, *self.ex.backward_ops]  # numbered as run_forward and run_backward do
            made = ({ops[n][1] for n, f in self.learning.items() if f.transit or f.consumed}
                    | {ops[n][1] - 1 for n, f in self.learning.items() if f.eaten})
            self.known.record_frees(self.learning, self.setting, made)
        return self.delta.pop(0)

    def take_output(self) -> list[torch.Tensor]:
        """The output x_L for the caller (detached aliases: the caller holds it, we keep no extra reference)."""
        out = self.out if self.out is not None else self.xbar[self.L - 1][1]
        self.out = None
        flat, self.out_spec = flatten(out)
        return [t.detach() for t in flat]

    # ------------------------------------------------------------------ ops
    def _input(self, i: int) -> Any:
        """x_i: a plain activation, or the output inside x̄_i (what Fall(i-1) left)."""
        return self.x[i] if i in self.x else self.xbar[i - 1][1]

    def _transfer(self, kind: str, i: int) -> None:
        """Off(i) / Pre(i) (docs/design.md §9): what moves is decided as in the simulator (x̄_{i+1} if resident, else the
        checkpoint x_i); see :mod:`hchain_viz.runtime.transfer`."""
        if kind == "Pre":
            self.link.pre(i)
            return
        if i in self.xbar and self.xbar[i] is not _SPENT:
            holders = self._xbar_holders(i)
        else:
            holders = [data_holder(t) for t in flatten(self.x[i])[0]]
        self.link.off(i, holders)

    def _xbar_holders(self, i: int) -> list:
        """The tensors of x̄_{i+1}: what Fall(i) saved and its output x_{i+1}, with the later tensors that alias
        them, minus what stays resident anyway (input, parameters, buffers, the caller's output)."""
        leaves, out = self.xbar[i]
        stage = self.ex.stage_modules[i]
        inputs = leaves if leaves is not None else flatten(self._input(i))[0]
        resident = {storage_key(t) for t in [*inputs, *stage.parameters(), *stage.buffers()] if t is not None}
        boxes = [b for b in self.link.boxes.get(i, []) if storage_key(b.t) not in resident]
        outs = [t for t in flatten(out)[0] if storage_key(t) not in resident] if i + 1 < self.L else []
        moved = {storage_key(b.t) for b in boxes} | {storage_key(t) for t in outs}
        holders = [box_holder(b) for b in boxes] + [data_holder(t) for t in outs]
        nxt = self.xbar.get(i + 1)
        if nxt is not None and nxt is not _SPENT:  # the next stage's detached input and what it saved of it
            holders += [data_holder(t) for t in (nxt[0] or []) if t is not None and storage_key(t) in moved]
            holders += [box_holder(b) for b in self.link.boxes.get(i + 1, []) if storage_key(b.t) in moved]
        return holders

    def _forward_op(self, n: int, kind: str, i: int, role: int, joined: bool, *, in_backward: bool) -> None:
        """Forward op number ``n`` of the step (its place in the schedule, before or after Loss)."""
        stage = self.ex.runners[i]
        if self.link is not None:
            self.link.wait_for((i - 1, i))  # a prefetch of its input must have arrived
        x_in = self._input(i)
        flat, spec = flatten(x_in)
        in_xbar = i not in self.x  # x_i is the output inside x̄_i (what Fall(i-1) left)
        if kind == "Fall":
            if joined:
                # Fall(i) on the output of Fall(i-1), and B(i-1) will directly follow B(i): stage i extends the
                # graph of stage i-1 (no detached input), and one autograd backward serves both, as in eager mode.
                versions = [t._version for t in flat]
                with self._mode(grad=True, in_backward=in_backward), self._packing(i, role):
                    out = self._call(stage, x_in, i, role)
                self._learn_mutation(i, flat, versions)
                self.xbar[i] = (None, out)
            else:
                leaves = [self._leaf(t, i, k) for k, t in enumerate(flat)]
                # An in-place first op on a leaf that requires grad would raise; an alias node in front makes it
                # legal (and is dropped once the stage is seen not to write into its input).
                alias = self.known.mutates[i] is not False
                versions = [t._version for t in leaves]
                with self._mode(grad=True, in_backward=in_backward), self._packing(i, role):
                    feed = unflatten(spec, [_Alias.apply(t) if alias and t.requires_grad else t for t in leaves])
                    out = self._call(stage, feed, i, role)
                del feed
                self._learn_mutation(i, leaves, versions)
                self.xbar[i] = (leaves, out)
            if self.frees is not None:
                if i + 1 in self.known.frees_made:
                    self._note_made(i, [storage_key(t) for t in flat], pointers(flatten(out)[0]))
                self._free_known(self.frees[n], i, flat, joined)
            elif self.link is None:  # with transfers, no storage is noted (see _packing)
                in_keys, out_keys = [storage_key(t) for t in flat], pointers(flatten(out)[0])
                self._note_made(i, in_keys, out_keys)
                transit = self._free_transit(i, flat, in_keys, out_keys, in_xbar, joined)
                if self.learning is not None:
                    self.learning[n] = _Frees.at(in_keys, transit, self.consumed.get(i, ()), self.eaten.get(i, ()))
            return
        # NOTE [in-place inputs]: Fck keeps x_i for a later forward of stage i. A stage seen writing into its input
        # runs on a copy, so the kept checkpoint is never corrupted; so does a stage not seen yet (the first step
        # only: what each stage does is learned from its input's version counter).
        protect = kind == "Fck" and self.known.mutates[i] is not False
        feed = unflatten(spec, [t.detach().clone() for t in flat]) if protect else x_in
        fed = flatten(feed)[0] if protect else flat
        versions = [t._version for t in fed]
        with self._mode(grad=False, in_backward=in_backward):
            out = self._call(stage, feed, i, role)
        self._learn_mutation(i, fed, versions)
        del feed, fed
        if self.link is None and (self.frees is None or i + 1 in self.known.frees_made):
            self._note_made(i, [storage_key(t) for t in flat], pointers(flatten(out)[0]))
        if kind == "Fn":
            # NOTE [memory model]: Fn frees its input x_i right after the op (docs/design.md §3).
            del self.x[i]
        if i + 1 == self.L:
            self.out = out
        else:
            self.x[i + 1] = out

    def _packing(self, i: int, role: int) -> contextlib.AbstractContextManager:
        """With transfers, the saved tensors of a recording forward go into boxes that Off/Pre can move; without,
        their storages are noted while learning what each Fall frees (see _free_transit). A replay saves the
        buffers it updates as the originals, not as its stand-in copies (see _replaying)."""
        stand_in = self._original if role == _REPLAY and self.updated_buffers.get(i) else None
        if self.link is not None:
            return self.link.hooks(i, stand_in)
        if not self.hooks and stand_in is None:
            return contextlib.nullcontext()
        saved = self.saved[i] = set() if self.hooks else None

        def pack(t: torch.Tensor) -> torch.Tensor:
            if stand_in is not None:
                t = stand_in(t)
            key = storage_key(t) if saved is not None else None
            if key is not None:
                saved.add(key)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def _original(self, t: torch.Tensor) -> torch.Tensor:
        """The buffer that ``t`` stands in for during a replay, or ``t``."""
        original = self.stand_ins.get(storage_key(t))
        return original if original is not None and original.shape == t.shape else t

    def _note_made(self, i: int, in_keys: list[int | None], out_keys: set[int]) -> None:
        """Remember which storages of x_{i+1} the forward of stage i made (not handed on from its input)."""
        if i + 1 < self.L:
            self.made[i + 1] = made_storages(set(in_keys), out_keys, self.ex.stage_tensors[i])

    def _free_transit(self, i: int, inputs: list[torch.Tensor], in_keys: list[int | None], out_keys: set[int],
                      in_xbar: bool, joined: bool) -> set[int]:
        """``in_keys``: the storage keys of ``inputs``; ``out_keys``: those of the stage's output. Returns the keys of
        the storages freed now (the transit part)."""
        # NOTE [memory model]: after Fall(i), the part of x_i that no backward needs is freed (chain.transit,
        # docs/design.md §3.4): storages stage i-1 made that neither its graph (when x_i is inside x̄_i) nor stage i's
        # saved and that stage i does not hand on. Eager autograd frees them here too; we hold them in x̄_i or in a
        # checkpoint, so their memory is released in place (no backward and no later forward reads them: a forward
        # of stage i cannot run again before B(i)). The tensors stay, for their shapes (δ_i matches them).
        self.consumed.pop(i, None)  # only this Fall's input counts (an earlier one's was recomputed)
        self.eaten.pop(i, None)
        if i == 0 or i not in self.made:
            return set()
        if in_xbar:
            self._note_eaten(i, in_keys, out_keys, joined)
        before = self.saved.get(i - 1, set()) if in_xbar else set()  # what B(i-1) needs of x_i
        candidates = [key in self.made[i] and key not in before for key in in_keys]
        transit, consumed = split_inputs(inputs, candidates, self.saved[i], out_keys)
        for st in transit.values():
            st.resize_(0)
        # NOTE [memory model]: the part of x_i that only B(i) needs goes after B(i) (chain.consumed), when x_i is the
        # output inside x̄_i: held there until B(i-1), it is released in place by _backward_op. A joined stage needs
        # nothing: its input is no tensor of ours, and autograd frees it once B(i) is done with it, as in eager mode.
        if in_xbar and not joined:
            self.consumed[i] = set(consumed)
        return set(transit)

    def _free_known(self, frees: _Frees, i: int, inputs: list[torch.Tensor], joined: bool) -> None:
        """What :meth:`_free_transit` does, from what it found in the step that learned it (``frees``): of the
        tensors there, those whose storage stage i-1 made in this step (``eaten``: stage i-2)."""
        self.consumed.pop(i, None)
        self.eaten.pop(i, None)

        def made(b: int, positions: tuple[int, ...]) -> set[int]:  # their storages that stage b-1 made
            return {storage_key(inputs[k]) for k in positions} & self.made.get(b, set())

        if frees.transit:
            transit = made(i, frees.transit)
            for k in frees.transit:
                st = storage_of(inputs[k])
                if st is not None and st.data_ptr() in transit:
                    st.resize_(0)
        if frees.consumed:
            self.consumed[i] = made(i, frees.consumed)
        if frees.eaten:
            keys = made(i - 1, frees.eaten)
            if keys:
                self.eaten[i] = keys
                self._hook_eaten(i, keys, joined)

    def _backward_op(self, i: int) -> None:
        # NOTE [memory model]: B(i) frees δ_{i+1}, x̄_{i+1} (the graph and output of Fall(i)) and, when x_i is a plain
        # checkpoint, x_i itself (design.md §3). We drop every reference to δ_{i+1} and to the outputs before running
        # the backward (a _Root node hands δ_{i+1} over), so autograd frees them as soon as it is done with them, as
        # in eager mode; the graph goes with them, and the checkpoint x_i right after. Stages k..i joined into one
        # graph are back-propagated at once by B(i); B(i-1) .. B(k) then only settle the bookkeeping, in order.
        k = self.ex.group_start[i]
        if self.link is not None:
            self.link.wait_for((i - 1, i))  # x̄_{i+1} and x_i, if prefetched
            self.link.boxes.pop(i, None)
        delta_next = self.delta.pop(i + 1)
        if delta_next is not _SPENT:  # B(i) heads its group
            leaves, out = self.xbar[k][0], self.xbar[i][1]
            for j in range(k, i + 1):
                self.xbar[j] = _SPENT
            pairs = [(o, g) for o, g in zip(flatten(out)[0], delta_next) if g is not None and o.requires_grad]
            del out, delta_next
            backward_handing_over(pairs)
            self.group_delta = [t.grad if t is not None and t.requires_grad else None for t in leaves]
            del leaves
        del self.xbar[i]
        self._free_consumed(i)
        self.rng.pop(i, None)  # no replay of stage i after its backward
        if i == k:
            self.delta[i], self.group_delta = self.group_delta, []
        else:
            self.delta[i] = _SPENT
        self.x.pop(i, None)

    def _free_consumed(self, i: int) -> None:
        """After B(i): release the storages of x_i that only B(i) needed (noted at its Fall, see _free_transit), in
        the output inside x̄_i, which stays for B(i-1); the tensors stay, for their shapes."""
        keys = self.consumed.pop(i, None)
        if keys:
            _free_storages(self.xbar[i - 1][1], keys)
        keys = self.eaten.pop(i, None)
        if keys:  # wherever they are held (x̄_{i-1}'s output, x̄_{i-2}'s, a checkpoint x_{i-1}): all made before
            _free_storages([*self.x.values(), *(v[1] for v in self.xbar.values() if v is not _SPENT)], keys)

    def _note_eaten(self, i: int, in_keys: list[int | None], out_keys: set[int], joined: bool) -> None:
        """At Fall(i), x_i inside x̄_i: note the input tensors that stage i-2 made, stages i-2 and i-1 did not save
        (x_{i-1} inside x̄_{i-1}: Fall(i-2) ran in this step; a plain checkpoint x_{i-1} has no graph), stage i-1
        handed on, and stage i saves and does not hand on (chain.consumed_shared, design.md §8): B(i) frees them. When
        stage i-1 heads the joined graph of B(i), they are its input leaves, which x̄_{i-2} or a checkpoint also
        holds: freed as soon as autograd is done with them (their gradient is ready), as the model charges."""
        # NOTE [memory model]: the simulator frees them after B(i) when x_i is inside x̄_{i-1} (simulate._Shared).
        if (i - 1 not in self.x and i - 2 not in self.saved) or i - 1 not in self.made:
            return
        # what B(i-2) saved, from this x_{i-1}'s own Fall(i-2) only (an older one's addresses may be reused)
        before = self.saved[i - 2] if i - 1 not in self.x else set()
        passed = self.made[i - 1] - self.made[i] - self.saved[i - 1] - before
        keys = {key for key in in_keys if key in passed and key in self.saved[i]} - out_keys
        if not keys:
            return
        self.eaten[i] = keys
        self._hook_eaten(i, keys, joined)

    def _hook_eaten(self, i: int, keys: set[int], joined: bool) -> None:
        """When stage i-1 heads the joined graph of B(i): free its input leaves among ``keys`` once their gradient
        is ready (see _note_eaten)."""
        if joined and self.ex.group_start[i] == i - 1 and self.xbar[i - 1][0] is not None:
            for leaf in self.xbar[i - 1][0]:
                if leaf is not None and leaf.requires_grad and storage_key(leaf) in keys:
                    leaf.register_hook(partial(_release, storage_of(leaf)))

    def _leaf(self, t: torch.Tensor, i: int, k: int) -> torch.Tensor:
        """A detached alias of input tensor k of stage i, requiring grad when eager autograd would track it."""
        leaf = uncached(t.detach()) if self.autocast else t.detach()
        if t.requires_grad:
            need = True
        elif i == 0 or not (t.is_floating_point() or t.is_complex()):
            need = False  # x_0 as the caller gave it; integer tensors carry no gradient
        else:
            mask = self.known.grad_mask[i]
            need = mask[k] if mask is not None and k < len(mask) else True
        return leaf.requires_grad_() if need else leaf

    def _learn_mutation(self, i: int, inputs: list[torch.Tensor], versions: list[int]) -> None:
        if self.known.mutates[i] is not True:  # once seen writing, always treated so
            self.known.mutates[i] = [t._version for t in inputs] != versions

    def _call(self, stage: nn.Module, feed: Any, i: int, role: int) -> Any:
        if role == _ONLY:
            return stage(feed)
        if role == _FIRST:
            draws = self.known.draws[i]
            rng = self._rng_state() if self.ex.preserve_rng_state and draws is not False else None
            buffers = self.ex.stage_buffers[i]
            before = [mod._buffers[name] for mod, name in buffers]
            versions = [b._version for b in before]
            out = stage(feed)
            if rng is not None:
                if draws is None:  # learned once: a CPU generator state is 5 KB that the memory model does not count
                    draws = self.known.draws[i] = not _same_state(rng, self._rng_state())
                if draws:
                    self.rng[i] = rng  # its replays draw the same random numbers
            updated = [(mod, name) for (mod, name), b, v in zip(buffers, before, versions)
                       if mod._buffers[name] is not b or b._version != v]
            self.updated_buffers[i] = list(dict.fromkeys(updated + self.ex.stats_buffers[i]))
            return out
        with self._replaying(i):
            return stage(feed)

    def _rng_state(self) -> tuple[bytes, list[bytes]]:
        """The global RNG state now, as bytes. Only stages that draw random numbers keep one for their replays (a
        stage without randomness replays as it is), until their backward. Bytes, not tensors: the CPU generator's
        state is 5 KB, which beside a CPU model's activations the memory model would not count (a GPU's states are
        host memory anyway)."""
        return (torch.get_rng_state().numpy().tobytes(),
                [torch.cuda.get_rng_state(d).numpy().tobytes() for d in self.devices])

    @contextlib.contextmanager
    def _replaying(self, i: int) -> Iterator[None]:
        """A recomputation: buffers it updates are swapped for copies (discarded after: eager updates them once),
        and the RNG is forked and set to the state before the first run (the global RNG is left untouched)."""
        swapped = []
        try:
            for mod, name in self.updated_buffers.get(i, ()):
                original = mod._buffers[name]
                mod._buffers[name] = copy = original.clone()
                # Saved for the backward as the original (see _packing): a batch norm saves its running statistics,
                # and the copies would stay until B(i), beyond what the stage holds in its first run. In training
                # mode its backward never reads them.
                self.stand_ins[storage_key(copy)] = original
                swapped.append((mod, name, original))
            if i in self.rng:
                # Forked by hand, the state kept as bytes: torch.random.fork_rng would hold a 5 KB tensor through the
                # stage's forward, beyond its profiled transient.
                now = self._rng_state()
                self._set_rng_state(self.rng[i])
                try:
                    yield
                finally:
                    self._set_rng_state(now)
            else:
                yield
        finally:
            for mod, name, original in swapped:
                self.stand_ins.pop(storage_key(mod._buffers[name]), None)
                mod._buffers[name] = original

    def _set_rng_state(self, state: tuple[bytes, list[bytes]]) -> None:
        cpu, cuda = state
        torch.set_rng_state(_state_tensor(cpu))
        for d, st in zip(self.devices, cuda):
            torch.cuda.set_rng_state(_state_tensor(st), d)

    def _mode(self, *, grad: bool, in_backward: bool) -> contextlib.AbstractContextManager:
        """Grad mode of the op, and the caller's autocast: re-entered for recomputations during the backward; its
        weight cache bypassed for no-grad runs (older PyTorch caches casts made without autograd, which would cut
        the weights' gradients in a later recording run)."""
        if not in_backward:  # inside _RunForward.forward: grad is off, the caller's autocast is on
            if grad:
                return torch.enable_grad()
            if self.autocast and torch.is_autocast_cache_enabled():
                return _autocast_cache_off()
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
        for device, dtype in self.autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=self.autocast_cache and grad))
        return stack


class _LocalTensors:
    """A stage's parameters and buffers as plain tensors: a sharded one (FSDP2's DTensor, once the stage has
    resharded after its forward) by its local shard, whose storage is real; the DTensor itself has none.

    The stage's modules are listed once (as ``Executor.stage_buffers`` are: a stage's structure is fixed when its
    stages are bound); their tensors are read live at each call, so a parameter sharded, moved or replaced later is
    seen (walking ``module.parameters()`` at each call costs more, several times per step). A tensor two modules
    share is listed twice; callers collect them into sets."""

    def __init__(self, module: nn.Module):
        self.owners = list(module.modules())

    def own_parameters(self) -> list[torch.Tensor]:
        """The parameters themselves (sharded ones as they are)."""
        return [p for m in self.owners for p in m._parameters.values() if p is not None]

    def parameters(self) -> list[torch.Tensor]:
        return [_local(p) for p in self.own_parameters()]

    def buffers(self) -> list[torch.Tensor]:
        return [_local(b) for m in self.owners for b in m._buffers.values() if b is not None]


def _free_storages(values: Any, keys: set[int]) -> None:
    """Release in place the storages, among the tensors of ``values``, whose data pointers are in ``keys``; the
    tensors stay, for their shapes."""
    for t in flatten(values)[0]:
        st = storage_of(t)
        if st is not None and st.data_ptr() in keys:
            st.resize_(0)


def _release(st: torch.UntypedStorage, grad: torch.Tensor) -> None:
    """A gradient hook that frees ``st`` (the tensor's own storage), leaving the gradient as it is."""
    st.resize_(0)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _same_state(a: tuple[bytes, list[bytes]], b: tuple[bytes, list[bytes]]) -> bool:
    return a == b


def _state_tensor(state: bytes) -> torch.Tensor:
    """An RNG state for ``set_rng_state``, over a copy of the bytes (no allocation by torch's allocator)."""
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def _autocast_cache_off() -> Iterator[None]:
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


class _Frees(NamedTuple):
    """What one Fall frees of its input x_i, as positions in the flattened x_i: after the op (``transit``), after
    B(i) (``consumed``, from the output inside x̄_{i-1}), and after B(i) wherever held (``eaten``)."""

    transit: tuple[int, ...]
    consumed: tuple[int, ...]
    eaten: tuple[int, ...]

    @classmethod
    def at(cls, keys: list[int | None], *parts: Iterable[int]) -> _Frees:
        """Each part (a set of storage keys) as the positions of ``keys`` (the input's) that hold them."""
        sets = [set(part) for part in parts]
        return cls(*(tuple(k for k, key in enumerate(keys) if key is not None and key in held) for held in sets))


# ---------------------------------------------------------------------------------------------- autograd glue
class _RunForward(torch.autograd.Function):
    """Runs the ops before ``Loss`` in forward and the ops after it in backward; returns an empty token.

    The output goes through :class:`_Output` so that δ_L is handed over and released by B(L-1): arguments of the
    backward that runs the whole schedule stay referenced by autograd until it returns.
    """

    @staticmethod
    def forward(ctx: Any, step: _Step, dummy: torch.Tensor, *x0: torch.Tensor) -> torch.Tensor:
        step.run_forward()
        ctx.step = step
        return torch.empty(0)

    @staticmethod
    def backward(ctx: Any, _token_grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        step, ctx.step = ctx.step, None
        if step is None:
            raise HChainError("the wrapped model's backward ran twice for one forward (retain_graph is not "
                              "supported); call the model again for another backward")
        return (None, None, *step.run_backward())


class _Output(torch.autograd.Function):
    """Returns x_L to the caller; its backward stores δ_L in the step for B(L-1)."""

    @staticmethod
    def forward(ctx: Any, step: _Step, token: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.step = step
        outs = step.take_output()
        frozen = [t for t in outs if not (t.is_floating_point() or t.is_complex())]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, torch.Tensor]:
        step, ctx.step = ctx.step, None
        if step is not None:
            step.delta[step.L] = list(grads)
        return None, torch.empty(0)


class _Alias(torch.autograd.Function):
    """Identity with its own autograd node: a non-leaf alias of a leaf, which in-place ops may overwrite."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


# ---------------------------------------------------------------------------------------------- schedule checks
def as_schedule(schedule: Any) -> Schedule:
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str):
        return Schedule.parse(schedule)
    raise InvalidSchedule(f"wrap() needs a Schedule (or its text like 'Fall0 Loss B0'), got {type(schedule).__name__}")


def _check_grammar(schedule: Schedule) -> tuple[int, frozenset[int]]:
    """The schedule's stage count L (its Loss op) and the stages whose Fall joins the graph of the stage before,
    simulated on a dummy chain of that length (simulating checks the grammar)."""
    L = stage_count(schedule)
    chain = Chain.homogeneous(L).with_bandwidth(1.0) if schedule.n_transfers else Chain.homogeneous(L)
    return L, simulate(chain, schedule).joined  # raises InvalidSchedule naming the first bad op


def _op_roles(schedule: Schedule, L: int, joined: frozenset[int],
             params: list[set[int]] | None = None) -> tuple[list[_Op], list[_Op], list[int]]:
    """Split the ops at Loss; give each forward its role (_ONLY, _FIRST, _REPLAY) and say whether a Fall joins the
    graph of the stage before it. Also, per stage i, the first stage k of the group B(i) belongs to.

    ``joined``: the stages whose Fall joins, as the simulator counts backward calls (``Trace.joined``: x_i read from
    inside x̄_{i-1}, B(i-1) right after B(i), no transfer). Not when stage i shares a parameter with its would-be
    group (``params``: ids of each stage's trainable parameters, once known): one backward through two users of a
    weight (GPT-2's tied embedding and output layer) holds the first gradient until the second arrives, beyond what
    the memory model charges; apart, each is added to ``.grad`` at once (one backward call more than simulated).
    """
    runs: dict[int, int] = {}
    for op in schedule.ops:
        if op.is_forward:
            runs[op.stage] = runs.get(op.stage, 0) + 1
    joined_stages = set(joined)
    group_start = list(range(L))
    for i in range(1, L):
        if i in joined_stages and params is not None:
            if params[i] & set().union(*params[group_start[i - 1]:i]):
                joined_stages.discard(i)
        if i in joined_stages:
            group_start[i] = group_start[i - 1]
    seen: set[int] = set()
    ops: list[_Op] = []
    for op in schedule.ops:
        role = _ONLY
        if op.is_forward:
            role = _REPLAY if op.stage in seen else (_FIRST if runs[op.stage] > 1 else _ONLY)
            seen.add(op.stage)
        ops.append((op.kind, op.stage, role, op.kind == "Fall" and op.stage in joined_stages))
    k = next(n for n, op in enumerate(ops) if op[0] == "Loss")
    return ops[:k], ops[k + 1:], group_start
