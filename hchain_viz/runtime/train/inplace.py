"""A schedule applied in place: ``hcv.apply(model, schedule)`` makes the model itself train by the schedule.

    hcv.apply(model, schedule)        # the same object, class, forward signature, attributes and state_dict keys
    trainer = transformers.Trainer(model=model, args=TrainingArguments(...), ...)   # or accelerate, Lightning, a loop
    hcv.remove(model)                 # back to the plain model

Owns :func:`apply`, :func:`remove`, :func:`is_applied` and what an applied model holds (``_Applied``): the
instance's ``forward`` replaced by :class:`AppliedForward` (the original signature kept, so Hugging Face's Trainer
keeps its dataset columns), each training call checked against the profiled structure (``_Structure``) and run by
an executor of the schedule (``train/executor.py``, or ``train/native.py`` with ``native=True``), driven only
through its protocol (Note: [executor protocol]). ``eval()`` and ``torch.no_grad()`` run the original forward.

Calls by keywords (``model(**batch)``) and with the dict itself (``model(batch)``) are the same structure. Two
differences are accepted, each with the stages traced once more for it (same names required): the loss arguments
Hugging Face's Trainer adds (``num_items_in_batch``) and a smaller last batch. Anything else raises
:class:`InputMismatch`. An applied model pickles: its executors are left out and rebuilt at the next training call.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...core.chain import Chain
from ...core.regions import compiled_peak, selective_chain
from ...core.schedule import Schedule
from ...core.simulate import simulate
from ...core.units import format_bytes
from ...errors import AlreadyApplied, DoubleCheckpointing, HChainError, InputMismatch, ScheduleMismatch
from ..compiled import check_not_compiled, compile_options
from ..precision import Precision, fsdp_param_dtype, precision_of, runs_in, warn_other_precision
from ..precision import describe as describe_precision
from ..stages import Stage, sequentialize
from .executor import Executor, StepRunner, as_schedule
from .native import NativeSchedule, grad_bytes
from .wrap import ScheduledModule

__all__ = ["apply", "remove", "is_applied", "applied_state", "AppliedForward"]

_ATTR = "_hcv_applied"  # the instance attribute holding the applied state (outside _modules: no state_dict keys)
# Keyword arguments Hugging Face's Trainer adds to a batch for the model's loss (model_accepts_loss_kwargs).
LOSS_KWARGS = frozenset({"num_items_in_batch"})
# Methods that turn on Hugging Face's own activation checkpointing: refused while a schedule is applied.
_HF_CHECKPOINTING = ("activation_checkpointing_enable", "gradient_checkpointing_enable")


# ---------------------------------------------------------------------------------------------- public API
def apply(model: nn.Module, schedule: Schedule | str, *, chain: Chain | None = None, sample: Any = None,
          native: bool = False, preserve_rng_state: bool = True,
          compile: bool | Mapping[str, Any] = False, selective: bool | Chain = False) -> nn.Module:
    """Make ``model`` itself train by ``schedule`` and return it (docs/design.md §5.2); :func:`remove` undoes it.

    Args:
        schedule: a :class:`~hchain_viz.Schedule` for the chain of stages of ``model`` (as for :func:`hcv.wrap`).
        chain: the profiled chain it was solved for (recommended): a schedule for another model (other stage names,
            class or parameter sizes) is then refused here, and every training call must have the profiled shapes.
        sample: the profiled input (a tensor, a tuple of arguments or a dict of keyword arguments, as given to
            ``hcv.profile``): fixes the call structure now; without it, the first training call fixes it.
        native: run the schedule as nested non-reentrant ``torch.utils.checkpoint`` regions, so that
            ``torch.compile(model)`` compiles the whole step with the schedule inside (docs/design.md §5.3).
        preserve_rng_state, compile: those of :func:`hcv.wrap` (``compile``: compiled stages, eager executor).
        selective: with ``native``, stages outside the regions save only their matrix products' and convolutions'
            outputs and recompute the rest in their backward; give the chain profiled with ``profile(...,
            compile=True, selective=True)`` to predict its memory (``chain=`` stays plain); ``True``: unpredicted.

    Raises:
        AlreadyApplied, DoubleCheckpointing: a schedule, or Hugging Face's activation checkpointing, is on already.
        ScheduleMismatch, InvalidSchedule, HChainError: a schedule for another model, a bad one, bad arguments.
    """
    if not isinstance(model, nn.Module):
        raise HChainError(f"apply() needs an nn.Module, got {type(model).__name__}; put a list of stages into an "
                          f"nn.Sequential first, or use hcv.wrap")
    if is_applied(model):
        raise AlreadyApplied(
            f"this {type(model).__name__} already trains by a schedule "
            f"({model.__dict__[_ATTR].describe()}); call hcv.remove(model) first to apply another one")
    if isinstance(model, ScheduledModule):
        raise AlreadyApplied("the model is a wrapped one (hcv.wrap); apply the schedule to its .model instead")
    _refuse_hf_checkpointing(model, when="apply")
    _refuse_sharded_traced(model)
    if native and compile:
        raise HChainError("native=True is compiled whole by torch.compile(model); compile= compiles each stage under "
                          "the executor instead. Choose one")
    if selective and not native:
        raise HChainError("selective=True is a form of the native schedule (PyTorch's selective activation "
                          "checkpointing in every stage): pass native=True as well")
    state = _Applied(model, as_schedule(schedule), chain=chain, native=bool(native),
                     preserve_rng_state=preserve_rng_state, compile=compile, selective=selective)
    if sample is not None:
        state.fix_structure(sample)
    state.install()
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the model's own forward (and Hugging Face's checkpointing methods) again; returns it."""
    state = model.__dict__.get(_ATTR) if isinstance(model, nn.Module) else None
    if state is None:
        raise HChainError(f"this {type(model).__name__} has no schedule applied (hcv.apply); nothing to remove")
    state.uninstall()
    return model


def is_applied(model: Any) -> bool:
    """Whether ``model`` trains by a schedule applied with :func:`apply`."""
    return isinstance(model, nn.Module) and _ATTR in model.__dict__


def applied_state(model: nn.Module) -> _Applied:
    """What :func:`apply` keeps beside ``model`` (its schedule, chain, form and executors); ``model`` must be
    applied."""
    return model.__dict__[_ATTR]


# ---------------------------------------------------------------------------------------------- the forward
class AppliedForward:
    """What ``model.forward`` is while a schedule is applied: the original signature (``__signature__``,
    ``__wrapped__``), the schedule in training, the original forward otherwise."""

    def __init__(self, state: _Applied):
        self._state = state
        original = state.original
        functools.update_wrapper(self, original, updated=())
        self.__signature__ = state.signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self._state
        model = state.model
        if state.bypass or not (model.training and torch.is_grad_enabled()):
            return state.call_plain(args, kwargs)
        if state.native:
            ex, x0 = state.prepare(args, kwargs, torch.compiler.is_compiling())  # checked outside any graph
            return ex.train_step(x0)  # traced whole by torch.compile(model)
        return state.train_call_eager(args, kwargs)

    def __repr__(self) -> str:
        return f"<forward of {type(self._state.model).__name__} trained by {self._state.describe()}>"


class _Refusing:
    """What Hugging Face's ``gradient_checkpointing_enable`` (and its kin) is while a schedule is applied (a class,
    not a closure: an applied model pickles with ``torch.save(model)``)."""

    def __init__(self, name: str, model: nn.Module):
        self.__name__, self.model_name = name, type(model).__name__

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise DoubleCheckpointing(
            f"{self.__name__}() would turn on Hugging Face's activation checkpointing in a {self.model_name} that "
            f"already trains by an hchain_viz schedule (hcv.apply): every layer would be recomputed twice. Leave "
            f"gradient_checkpointing / activation_checkpointing off (TrainingArguments' default) - the schedule "
            f"already checkpoints - or call hcv.remove(model) first to use Hugging Face's checkpointing instead")


def _refuse_hf_checkpointing(model: nn.Module, when: str) -> None:
    on = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if on:
        what = ", ".join(n or "(the model)" for n in on[:3]) + (", ..." if len(on) > 3 else "")
        raise DoubleCheckpointing(
            f"Hugging Face's activation checkpointing is on in this {type(model).__name__} ({what}), "
            + ("and a schedule would recompute again" if when == "apply" else
               "which also trains by an hchain_viz schedule: both would recompute")
            + ". Call model.gradient_checkpointing_disable() (or leave TrainingArguments(gradient_checkpointing=...) "
              "off): the schedule already checkpoints")


def _refuse_sharded_traced(model: nn.Module) -> None:
    """FSDP2 (``fully_shard``) gathers parameters in the forward hooks of the modules it shards. Stages of an
    nn.Sequential are its modules and run those hooks; traced stages run the ops of the model's modules, not their
    forwards: only the model's own hooks fire (around the training call), and the stages gather and reshard the
    nested ones (runtime/graph/build.py). Without fully_shard on the model itself nothing would gather its own
    parameters or reduce-scatter the gradients after the backward (docs/design.md §11)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded by it
    if fsdp is None or isinstance(model, (nn.Sequential, fsdp.FSDPModule)):
        return
    if any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        raise ScheduleMismatch(
            f"parts of this {type(model).__name__} are sharded by FSDP2 (fully_shard) but not the model itself: a "
            f"schedule runs the model's traced stages, not its submodules' forwards, so only the model's own FSDP2 "
            f"hooks gather parameters and reduce-scatter gradients. Call fully_shard(model) too (after its layers), "
            f"then hcv.apply(model, schedule)")


# ---------------------------------------------------------------------------------------------- state
class _Applied:
    """Everything an applied schedule holds beside the model (kept in ``model.__dict__``, not as a submodule)."""

    def __init__(self, model: nn.Module, schedule: Schedule, *, chain: Chain | None, native: bool,
                 preserve_rng_state: bool, compile: Any, selective: bool | Chain = False):
        self.model = model
        self.schedule = schedule
        self.chain = chain
        self.native = native
        self.selective = selective is not False and selective is not None
        self.selective_chain = selective if isinstance(selective, Chain) else None
        self.bypass = False  # True while stages are traced: the model's own forward runs
        self.warned = False  # the compiled-memory warning was given (once per applied schedule)
        bound = model.forward
        self.unbound = inspect.ismethod(bound) and bound.__self__ is model
        self.original = bound.__func__ if self.unbound else bound
        self.signature = inspect.signature(bound)
        self.sequential = isinstance(model, nn.Sequential)
        self.preserve_rng_state = bool(preserve_rng_state)
        self.compile_options = compile_options(compile)
        self.replaced: dict[str, Any] = {}  # instance attributes we set, with what was there (or _MISSING)
        self.structure: _Structure | None = None  # the profiled call structure
        self.executors: dict[Any, StepRunner] = {}  # per accepted call structure: its executor (stages traced for it)
        self.first: StepRunner | None = self._executor(None)  # None after unpickling: rebuilt at the next training call
        if self.selective_chain is not None and not (self.selective_chain.meta or {}).get("selective"):
            raise ScheduleMismatch("selective= takes a chain profiled with profile(..., compile=True, selective=True) "
                                   "(or True, to run the form unpredicted)")
        if chain is not None:
            self._check_chain(chain)
        objects, self.modes, _ = _walk(model)
        self.fingerprint = _Same(objects)

    def __getstate__(self) -> dict:
        """Pickled (``torch.save(model)``, ``copy.deepcopy``) without its executors: they hold traced stages, which
        are traced again at the next training call."""
        state = dict(self.__dict__)
        state["first"], state["executors"] = None, {}
        return state

    # -------------------------------------------------------------- install / uninstall
    def install(self) -> None:
        model = self.model
        self._set("forward", AppliedForward(self))
        for name in _HF_CHECKPOINTING:
            if callable(getattr(type(model), name, None)):
                self._set(name, _Refusing(name, model))
        object.__setattr__(model, _ATTR, self)

    def uninstall(self) -> None:
        model = self.model
        for name, before in self.replaced.items():
            if before is _MISSING:
                model.__dict__.pop(name, None)
            else:
                model.__dict__[name] = before
        model.__dict__.pop(_ATTR, None)
        self.executors.clear()

    def _set(self, name: str, value: Any) -> None:
        self.replaced[name] = self.model.__dict__.get(name, _MISSING)
        object.__setattr__(self.model, name, value)  # an instance attribute, never the class's

    def describe(self) -> str:
        name = self.schedule.meta.get("strategy", "schedule")
        form = ("native checkpoint regions" + (", selective stages" if self.selective else "")) if self.native \
            else "the executor"
        return f"{name}: {len(self.schedule)} ops, {self.schedule.n_recomputed} recomputed forwards, by {form}"

    # -------------------------------------------------------------- executors
    def _executor(self, x0: Any) -> StepRunner:
        """The executor for stages traced on ``x0`` (None: the stages known now, or traced at the first call)."""
        with self._bypassed():
            ex: StepRunner
            if self.native:
                ex = NativeSchedule(self.model, self.schedule, preserve_rng_state=self.preserve_rng_state,
                                    selective=self.selective)
            else:
                ex = Executor(self.model, self.schedule, preserve_rng_state=self.preserve_rng_state,
                              compile_options=self.compile_options)
            if x0 is not None:
                ex.ensure_stages(x0)
        return ex

    def _bypassed(self) -> Any:
        state = self

        class _Bypass:
            """The model's own forward while stages are traced (torch.export reads ``model.forward.__code__``): also
            without what a library wrapped around ours since (accelerate's autocast and fp32 outputs, whose autocast
            is active around this call already; traced, it would become a region the stages cannot cut)."""

            def __enter__(self) -> None:
                self.before, state.bypass = state.bypass, True
                self.ours = state.model.__dict__.get("forward", _MISSING)
                if "forward" in state.replaced:
                    before = state.replaced["forward"]
                    if before is _MISSING:
                        state.model.__dict__.pop("forward", None)
                    else:
                        state.model.__dict__["forward"] = before

            def __exit__(self, *exc: Any) -> None:
                state.bypass = self.before
                if "forward" in state.replaced:
                    if self.ours is _MISSING:
                        state.model.__dict__.pop("forward", None)
                    else:
                        state.model.__dict__["forward"] = self.ours

        return _Bypass()

    def _check_chain(self, chain: Chain) -> None:
        """A chain profiled for another model is refused: class, stage names, parameter bytes."""
        model = self.model
        meta = chain.meta or {}
        if meta.get("model") not in (None, *(c.__name__ for c in type(model).__mro__)):  # FSDP2 subclasses it
            raise ScheduleMismatch(
                f"the chain was profiled on a {meta['model']}, not this {type(model).__name__}; profile this model "
                f"(hcv.profile(model, batch)) and solve again")
        stages = self.first.stages
        if stages is None:  # more stages than the schedule's (fewer raise in the executor), or traced later
            try:
                with self._bypassed():
                    stages = sequentialize(model)
            except HChainError:
                stages = None
        if stages is not None and tuple(n for n, _ in stages) != tuple(chain.names):
            raise ScheduleMismatch(
                f"the chain's stages ({', '.join(chain.names[:6])}, ...) are not this model's stages "
                f"({', '.join(n for n, _ in stages[:6])}, ...); profile this model and solve again")
        if meta.get("selective"):
            raise ScheduleMismatch("chain= takes the plain profile; a chain profiled with selective=True goes to "
                                   "selective= (with native=True), beside the plain one")
        if self.selective_chain is not None and self.selective_chain.names != chain.names:
            raise ScheduleMismatch("selective= and chain= are profiles of other stages; profile this model twice, "
                                   "plain and with selective=True")
        if chain.length != self.first.length:
            raise ScheduleMismatch(f"the schedule is for {self.first.length} stages but the chain has {chain.length}; "
                                   f"solve the chain again and take the schedule from it")
        params = list({id(p): p for p in model.parameters()}.values())
        gathered = fsdp_param_dtype(model)  # FSDP2's MixedPrecisionPolicy: the parameters gathered in its dtype
        held = sum(p.numel() * (gathered.itemsize if gathered is not None and p.is_floating_point()
                                else p.element_size()) * (2 if p.requires_grad else 1) for p in params)
        if "param_bytes" in meta and meta["param_bytes"] != held:
            raise ScheduleMismatch(
                f"the chain was profiled on a {meta.get('model')} with {format_bytes(meta['param_bytes'])} of "
                f"parameters and gradients; this one holds {format_bytes(held)} (another size, or parameters frozen "
                f"or added since, e.g. by PEFT). Profile the model as it is now and solve again")

    def _check_stages(self, stages: list[tuple[str, nn.Module]]) -> None:
        """The stages must be this model's: their parameters its parameters, and every trainable parameter in a stage
        (a stage traced before LoRA layers were added would silently train without them)."""
        model_params = {id(p): n for n, p in self.model.named_parameters()}
        stage_params = {id(p) for _, s in stages for p in s.parameters()}
        foreign = stage_params - set(model_params)
        missing = [n for i, n in model_params.items() if i not in stage_params
                   and self.model.get_parameter(n).requires_grad]
        if foreign or missing:
            more = ", ..." if len(missing) > 3 else ""
            what = (f"trainable parameters no stage uses ({', '.join(missing[:3])}{more})" if missing
                    else f"{len(foreign)} parameters that are no longer the model's")
            raise ScheduleMismatch(
                f"the stages of this {type(self.model).__name__} were found before the model changed: it has {what}. "
                f"Profile the model as it is now (after adding adapters, sharding or replacing layers) and apply the "
                f"new schedule")

    # -------------------------------------------------------------- calls
    def call_plain(self, args: tuple, kwargs: dict) -> Any:
        args, kwargs = self._keywords(args, kwargs)
        if self.unbound:  # the function of a forward bound to the model (a copy of the model rebinds it)
            return self.original(self.model, *args, **kwargs)
        return self.original(*args, **kwargs)

    def _keywords(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``model(batch)`` with the dict the schedule was profiled with is ``model(**batch)``."""
        if (self.structure is not None and self.structure.form == "dict" and len(args) == 1 and not kwargs
                and isinstance(args[0], Mapping)):
            return (), dict(args[0])
        return args, kwargs

    @torch.compiler.disable(recursive=False)  # never traced: the check below must run (see runtime/compiled.py)
    def train_call_eager(self, args: tuple, kwargs: dict) -> Any:
        check_not_compiled(native_hint=True)
        return self.train_call(args, kwargs)

    def train_call(self, args: tuple, kwargs: dict) -> Any:
        ex, x0 = self._prepare(args, kwargs)
        return ex.train_step(x0)

    @torch.compiler.disable  # a graph break before any compute: the checks run, the step compiles as one graph
    def prepare(self, args: tuple, kwargs: dict, compiling: bool = False) -> tuple[StepRunner, Any]:
        ex, x0 = self._prepare(args, kwargs)
        if compiling and not self.warned:
            self.warned = True
            self._warn_compiled(ex)
        return ex, x0

    def _warn_compiled(self, ex: StepRunner) -> None:
        """torch.compile(model) of the native form: warn when its memory may exceed the schedule's prediction
        (NOTE [compiled memory] in core/regions.py): always when it recomputes, with the numbers where a chain
        was given."""
        import warnings

        fix = ("pick the schedule for a compiled model with hcv.checkpoint(model, batch, budget, native=True) or "
               "hchain_viz.core.regions.for_compile(solution, budget, grad_bytes(stages)), grad_bytes from "
               "hchain_viz.runtime.train.native")
        inductor = ("inductor's kernel scheduling can hold more than that when a region recomputes (measured up to "
                    "1.44x on GPT-2, docs/compile.md): measure the compiled step (hcv.measure(compiled, batch)) "
                    "before relying on the budget, or let hcv.checkpoint(..., native=True, verify=True) measure it "
                    "and keep the fastest schedule that measures within the budget")
        if self.chain is None or (self.selective and self.selective_chain is None):
            warnings.warn(f"torch.compile of a model trained by a native schedule: compiled whole, nested checkpoint "
                          f"regions are recomputed once each and parameter gradients are held until the backward "
                          f"ends, so the peak can exceed the schedule's prediction (pass chain= to hcv.apply, and "
                          f"the selective profile as selective= for that form, to have it predicted); {fix}",
                          stacklevel=2)
            return
        eager = simulate(selective_chain(self.chain, self.selective_chain, self.schedule), self.schedule).peak_memory
        compiled = compiled_peak(self.chain, self.schedule, grad_bytes([m for _, m in ex.stages]), self.selective_chain)
        if compiled > eager:
            warnings.warn(f"torch.compile of a model trained by a native schedule predicted at "
                          f"{format_bytes(eager)}: compiled whole it is predicted at {format_bytes(compiled)} "
                          f"({compiled / eager:.2f}x; nested checkpoint regions are recomputed once each and "
                          f"parameter gradients are held until the backward ends); {fix}. Also, {inductor}",
                          stacklevel=2)
        elif self.schedule.n_recomputed:
            warnings.warn(f"torch.compile of a model trained by a native schedule that recomputes: its compiled peak "
                          f"is predicted at {format_bytes(compiled)} (AOTAutograd's partition, measured within "
                          f"0.9-1.0 of it); {inductor}", stacklevel=2)

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[StepRunner, Any]:
        """The executor and x_0 for a training call, after checking the model and the call's structure."""
        self.check_model()
        if self.first is None:  # unpickled or copied: the executor of the profiled structure again
            self.first = self._executor(None)
        if self.structure is None:
            structure = _Structure.of_call(self, args, kwargs)
            self._check_first_shapes(structure)
            self.structure = structure
        x0, key = self.structure.bind(self, *self._keywords(args, kwargs))
        precision = precision_of(self.model)
        ex = self.executors.get((key, precision))
        if ex is None:
            self._check_precision(precision)
            ex = self._executor_for(key, x0, precision)
        return ex, x0

    def fix_structure(self, sample: Any) -> None:
        self._check_first_shapes(_Structure.of_sample(self, sample))
        self.structure = _Structure.of_sample(self, sample)
        x0, key = self.structure.bind(self, *self.structure.as_call(sample))
        self._executor_for(key, x0, precision_of(self.model))

    def _check_precision(self, precision: Precision) -> None:
        """A training step in another precision than the one profiled trains right (its stages are traced for it)
        but not in the memory planned: warned once per precision (docs/design.md §11)."""
        profiled = (self.chain.meta or {}).get("precision") if self.chain is not None else None
        profiled = profiled or self.schedule.meta.get("precision")
        if profiled is not None and describe_precision(precision) != profiled:
            warn_other_precision(describe_precision(precision), profiled, stacklevel=6)

    def _check_first_shapes(self, structure: _Structure) -> None:
        chain = self.chain
        if chain is None or "input_shape" not in (chain.meta or {}):
            return
        shapes = structure.shapes()
        profiled = chain.meta["input_shape"]
        profiled = [profiled] if profiled and isinstance(profiled[0], int) else profiled
        if [list(s) for s in shapes] != [list(s) for s in profiled]:
            raise InputMismatch(
                f"the schedule was profiled for inputs of shapes {profiled}, and this model is trained with "
                f"{[list(s) for s in shapes]}; profile with a batch of the training shapes (hcv.checkpoint(model, "
                f"batch, ...)) so the schedule's memory is the training step's")

    def _executor_for(self, key: Any, x0: Any, precision: Precision) -> StepRunner:
        if key == () and self.first.stages is None:  # the profiled structure: its stages traced now
            names = list(self.chain.names) if self.chain is not None else None
            self.first.bind(self._trace(x0, names, "the profiled inputs"))
        if key == () and runs_in(self.first.stages, precision):  # the stages profiled (or traced now)
            ex = self.first
            self._check_stages(ex.stages)
        else:  # accepted: loss arguments added, a smaller batch, another precision; the same stages traced for it
            ex = self._retrace(x0, key, precision)
        self.executors[key, precision] = ex
        return ex

    def _retrace(self, x0: Any, key: tuple, precision: Precision) -> StepRunner:
        smaller = any(k.startswith("batch=") for k in key)
        if self.first.stages is None and not smaller:  # the stages of the profiled structure, to compare with
            self._executor_for((), {k: v for k, v in x0.items() if k not in LOSS_KWARGS}, precision)
        if self.first.stages is not None:
            names = [n for n, _ in self.first.stages]
        else:  # unpickled, then first called with a smaller batch: the profiled stages are the chain's
            names = list(self.chain.names) if self.chain is not None else None
        what = " and ".join([*(f"the loss argument {k}" for k in key if not k.startswith("batch=")),
                             *(f"a smaller {k.replace('=', ' of ')}" for k in key if k.startswith("batch="))]
                            or [f"the inputs profiled, in {describe_precision(precision)}"])
        ex = self._executor(None)
        ex.bind(self._trace(x0, names, what))
        return ex

    def _trace(self, x0: Any, names: list[str] | None, what: str) -> list[Stage]:
        """The model's stages traced on ``x0``: those named ``names`` (the profiled ones; any granularity that
        gives them), or without names as many as the schedule has; checked against the model's parameters."""
        tried = []
        for granularity in (None, "sublayer", "finest"):
            with self._bypassed():
                try:
                    stages = sequentialize(self.model, x0, granularity=granularity)
                except HChainError as exc:
                    tried.append(" ".join(line.strip() for line in str(exc).splitlines()[:3]))
                    continue
            if [n for n, _ in stages] == names or (names is None and len(stages) == self.first.length):
                self._check_stages(stages)
                return stages
            tried.append(f"granularity {granularity!r}: {len(stages)} stages")
        raise InputMismatch(
            f"with {what} the model could not be cut into the profiled stages ({'; '.join(tried)}); profile with a "
            f"batch like this one, as training calls the model")

    def check_model(self) -> None:
        """Per training call: the model's modules and parameters are those it had when the schedule was applied, and
        Hugging Face's checkpointing is off."""
        model = self.model
        objects, modes, hf_on = _walk(model)
        if _Same(objects) != self.fingerprint:
            raise ScheduleMismatch(
                f"the modules or parameters of this {type(model).__name__} changed after the schedule was applied "
                f"(adapters added, a layer replaced, parameters sharded or re-created; with FSDP2, fully_shard the "
                f"model before hcv.apply): its stages would run the old ones. Call hcv.remove(model), profile the "
                f"model as it is now, and apply the new schedule")
        if hf_on:
            _refuse_hf_checkpointing(model, when="call")
        if modes != self.modes:  # dropout may come and go with submodules' modes: learn again which stages draw
            self.modes = modes
            for ex in self.executors.values():
                ex.forget_draws()


class _Missing:
    """No instance attribute was there before ``apply`` (one object, also after pickling)."""

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()


def _walk(model: nn.Module) -> tuple[list, tuple[bool, ...], bool]:
    """One pass over the model, per training call (about 0.1 ms for a small GPT-2): its modules and their own
    parameters (objects, for :class:`_Same`), their training modes, and whether Hugging Face's checkpointing is on
    in any (an instance attribute, read from ``__dict__``: ``getattr`` on a module without it costs an exception)."""
    objects: list = []
    modes = []
    hf_on = False
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded by it
    sharded: dict[int, nn.Parameter] = {}
    for m in model.modules():
        objects.append(m)
        objects.extend(p for p in m._parameters.values() if p is not None)
        modes.append(m.training)
        hf_on = hf_on or m.__dict__.get("gradient_checkpointing") is True
        if fsdp is not None and isinstance(m, fsdp.FSDPModule):
            sharded.update(_gathered_to_sharded(m))
    if sharded:  # FSDP2 registers each parameter's gathered copy or its sharded form: one parameter either way
        objects = [sharded.get(id(o), o) for o in objects]
    return objects, tuple(modes), hf_on


def _gathered_to_sharded(module: nn.Module) -> dict[int, nn.Parameter]:
    """For an FSDP2 module: the id of each gathered parameter (registered in the module from its pre-forward to its
    reshard; the same object every step) -> its sharded parameter. FSDP2 has no public mapping (torch 2.13): its
    state's parameter groups'."""
    out = {}
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            gathered = getattr(fsdp_param, "_unsharded_param", None)
            if gathered is not None:
                out[id(gathered)] = fsdp_param.sharded_param
    return out


class _Same:
    """The model's modules and parameters, compared by identity (objects, not ids: a deep copy maps them)."""

    def __init__(self, objects: list):
        self.objects = objects

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Same) and len(self.objects) == len(other.objects)
                and all(a is b for a, b in zip(self.objects, other.objects)))

    __hash__ = None  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------- call structure
def _value_key(value: Any) -> Any:
    """What makes two argument values the same structure: tensors by shape, dtype and device; others by value."""
    leaves, spec = pytree.tree_flatten(value)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.type))
        else:
            try:
                hash(leaf)
                out.append(("value", type(leaf).__name__, leaf))
            except TypeError:
                out.append(("value", type(leaf).__name__, repr(leaf)))
    return str(spec), tuple(out)


def _describe(key: Any) -> str:
    _, leaves = key
    parts = []
    for kind, *rest in leaves:
        parts.append(f"{list(rest[0])} {str(rest[1]).replace('torch.', '')}" if kind == "tensor" else repr(rest[1]))
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


class _Structure:
    """The profiled call: its form (``"single"``: the model takes x_0 itself; ``"tuple"``: positional arguments;
    ``"dict"``: keyword arguments) and, per argument name, the key of its value (:func:`_value_key`)."""

    def __init__(self, form: str, keys: dict[str, Any]):
        self.form, self.keys = form, keys

    @classmethod
    def of_sample(cls, state: _Applied, sample: Any) -> _Structure:
        if state.sequential or not isinstance(sample, (Mapping, tuple, list)):
            form = "single"
        else:
            form = "dict" if isinstance(sample, Mapping) else "tuple"
        named = _named(state, *cls.as_call_form(form, sample))
        return cls(form, {k: _value_key(v) for k, v in named.items()})

    @classmethod
    def of_call(cls, state: _Applied, args: tuple, kwargs: dict) -> _Structure:
        if len(args) == 1 and not kwargs and isinstance(args[0], Mapping) and not state.sequential:
            args, kwargs = (), dict(args[0])
        form = "single" if state.sequential or (len(args) == 1 and not kwargs) else "dict" if kwargs else "tuple"
        named = _named(state, args, kwargs)
        # The Trainer's loss arguments are no part of a batch as profiled: accepted as additions (see bind)
        return cls(form, {k: _value_key(v) for k, v in named.items() if k not in LOSS_KWARGS or form != "dict"})

    @staticmethod
    def as_call_form(form: str, sample: Any) -> tuple[tuple, dict]:
        if form == "dict":
            return (), dict(sample)
        if form == "tuple":
            return tuple(sample), {}
        return (sample,), {}

    def as_call(self, sample: Any) -> tuple[tuple, dict]:
        return self.as_call_form(self.form, sample)

    def shapes(self) -> list[list[int]]:
        return [list(leaf[1]) for _, leaves in self.keys.values() for leaf in leaves if leaf[0] == "tensor"]

    def bind(self, state: _Applied, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """x_0 for this call, in the profiled form, and the key of its structure; raises InputMismatch."""
        named = _named(state, args, kwargs)
        keys = {k: _value_key(v) for k, v in named.items()}
        extra = [k for k in keys if k not in self.keys]
        missing = [k for k in self.keys if k not in keys]
        changed = [k for k in keys if k in self.keys and keys[k] != self.keys[k]]
        allowed = set(extra) <= LOSS_KWARGS and self.form == "dict" and all(
            leaf[0] == "tensor" for k in extra for leaf in keys[k][1])
        batch = self._smaller_batch(keys, changed) if changed else None
        if batch is not None:  # the same structure with fewer samples: the same stages, traced again for it
            changed = []
        if missing or changed or (extra and not allowed):
            lines = [f"{k}: profiled {_describe(self.keys[k])}, called with {_describe(keys[k])}" for k in changed]
            lines += [f"{k}: profiled, missing in the call" for k in missing]
            lines += [f"{k}: in the call ({_describe(keys[k])}), not profiled" for k in extra]
            hint = ("smaller batches (fewer samples, other sizes equal) are accepted; for these shapes profile again "
                    "with a batch of them (hcv.remove(model), then hcv.checkpoint(model, batch, ...) or hcv.profile, "
                    "solve and hcv.apply), or pad batches to the profiled shapes" if changed else
                    "call the model with the arguments it was profiled with, or profile it with a batch as training "
                    "calls it")
            raise InputMismatch(
                "this training call differs from the inputs the schedule was profiled with:\n  - "
                + "\n  - ".join(lines) + f"\nThe stages run what was traced for the profiled inputs; {hint}")
        if self.form == "dict":
            x0 = {k: named[k] for k in [*self.keys, *extra]}
        elif self.form == "tuple":
            x0 = tuple(named[k] for k in self.keys)
        else:
            (x0,) = named.values()
        return x0, tuple(sorted(extra)) + ((f"batch={batch}",) if batch is not None else ())

    def _smaller_batch(self, keys: dict[str, Any], changed: list[str]) -> int | None:
        """The batch size ``b`` of a call that differs from the profiled one only by a smaller first dimension
        ``b < B`` of every tensor whose first dimension was the profiled ``B`` (the last, smaller batch of an
        epoch); None for any other difference. Its peak is at most the profiled one's: every activation that scales
        with the batch is smaller, the rest is the same."""
        profiled_batch = small = None
        for k in changed:
            (spec_p, leaves_p), (spec_c, leaves_c) = self.keys[k], keys[k]
            if spec_p != spec_c or len(leaves_p) != len(leaves_c):
                return None
            for lp, lc in zip(leaves_p, leaves_c):
                if lp == lc:
                    continue
                if lp[0] != "tensor" or lc[0] != "tensor" or lp[2:] != lc[2:] or len(lp[1]) != len(lc[1]) \
                        or not lp[1] or lp[1][1:] != lc[1][1:] or not 0 < lc[1][0] < lp[1][0]:
                    return None
                if profiled_batch is None:
                    profiled_batch, small = lp[1][0], lc[1][0]
                elif (lp[1][0], lc[1][0]) != (profiled_batch, small):
                    return None
        unchanged = [leaf for k in self.keys if k in keys for leaf, now in zip(self.keys[k][1], keys[k][1])
                     if leaf == now and leaf[0] == "tensor"]
        if any(leaf[1] and leaf[1][0] == profiled_batch for leaf in unchanged):
            return None  # another tensor of the profiled batch kept it: not one smaller batch
        return small


def _named(state: _Applied, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, without those passed at their default value (``attention_mask=None``)."""
    sig = state.signature
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise InputMismatch(f"{type(state.model).__name__}.forward{sig} cannot take this call: {exc}") from None
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        p = sig.parameters[name]
        if p.kind == p.VAR_KEYWORD:
            named.update(value)
        elif p.kind == p.VAR_POSITIONAL:
            if value:
                raise InputMismatch(f"{type(state.model).__name__}.forward takes *{name}; a schedule needs named "
                                    f"arguments, pass them as keywords")
        elif p.default is not p.empty and not isinstance(value, torch.Tensor) and _same(value, p.default):
            continue
        else:
            named[name] = value
    return named


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:
        return False

