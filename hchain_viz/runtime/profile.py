"""Profile a real PyTorch model into a :class:`~hchain_viz.core.chain.Chain`: per-stage times and sizes.

The model is cut into stages by :func:`~hchain_viz.runtime.stages.sequentialize`, then each stage is measured on its
own, in order, on the real output of the stage before (one stage's autograd graph alive at a time); the model is
left exactly as found. What each field measures: NOTE [how the fields are measured] below; the fields:
docs/design.md §2.
"""

# NOTE [how the fields are measured] (docs/design.md §2, §3.4), each stage on the real output of the one before:
# - ``fwd_time`` / ``bwd_time``: medians of ``repeats`` runs after ``warmup`` runs — a forward with autograd recording,
#   then the backward from the output gradient (CUDA events on a GPU, ``perf_counter`` on the CPU). The last stage's
#   output gradient is the real loss gradient; the others get a dense tensor of ones of the right size.
#   Each backward so timed is a call of its own; ``backward_call`` is what such a call costs beyond the stage's share
#   of a backward through several stages (the engine's start, the input gradients handed between calls), measured on
#   up to ``CALL_PAIRS`` pairs of neighbours run backward as one call and apart (:func:`_call_cost`); ``bwd_time`` is
#   the share, the measured time less ``backward_call``, which the simulator charges once per call (design.md §3.3).
# - ``x[i]``: bytes of stage i's input (``x[L]``: the network output, and the loss computed from it with the gradient
#   its backward starts from, which the caller holds to the end of the step), each storage counted once.
# - ``xbar[i]``: the output plus what autograd saves for the backward, seen through
#   ``torch.autograd.graph.saved_tensors_hooks``: each storage once, only storages the forward created (parameters,
#   buffers, the stage input and constants are resident anyway).
# - ``delta[i]``: bytes of the gradient δ_i the backward of stage i leaves (``delta[L]``: the loss's gradient of
#   the output); ``delta_through[i]``: how much of it is δ_{i+1} handed on unchanged (the gradient of a tensor the
#   stage passes on and does not use, which the input takes as it is), no new memory.
# - ``transit[i]``: bytes of x_i that no backward needs — storages stage i-1 made and neither its saved tensors nor
#   stage i's hold, and that stage i does not hand on (the pre-softmax scores; q and k that an attention product copies
#   before saving): the executor frees them once Fall(i) has run (``memtrack.transit_storages``).
# - ``consumed[i]``: bytes of x_i that only B(i) needs — storages stage i-1 made and did not save, that stage i saves
#   and does not hand on (the MLP's hidden activation, which the down-projection saves): the executor frees them once
#   B(i) has run, when x_i is the output inside x̄_i (``memtrack.consumed_storages``).
# - ``fwd_tmp[i]``: peak bytes above the resident set during the recording forward (a ``Fall``), beyond what it
#   leaves; ``nograd_tmp[i]``: the same for a forward without autograd (``Fck``, ``Fn``), whose intermediates are not
#   saved; ``bwd_tmp[i]``: the same for the backward, beyond the input gradient.
#   The backward is measured as the executor runs it, with δ_{i+1} handed over to autograd (freed as soon as it is
#   done with it), plus ``BACKWARD_SLACK``; where the next stage's backward makes δ_{i+1} in another layout than
#   x_{i+1}'s, as it arrives inside a joined backward, it is measured again in that one and the larger kept
#   (:func:`_relayout`; each stage's input is held to the end of profiling for this). Measured by
#   :class:`~hchain_viz.runtime.memtrack.MemoryMeter` (CUDA statistics, or the allocator's own log of allocations and
#   frees on the CPU, which leaves compiled stages compiled).
#
# Profiling leaves the model exactly as found: parameters, buffers (BatchNorm statistics), ``.grad``, training flags
# and the global RNG state are the same afterwards. During profiling every parameter has a zero gradient of its own,
# as in training after the first step, so accumulating into it is measured as a transient, never as a new resident.
from __future__ import annotations

import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.chain import Chain
from ..errors import NotSequentialError, ProfileError, TimingWarning
from . import roofline
from .compiled import compile_options, compile_stage, describe
from .fixed import check_optimizer, fixed_memory
from .measure import (
    LossFn,
    _shapes,
    default_loss,
    loss_of,
    preserved_state,
    resolve_device,
    timed,
    to_device,
    user_code,
)
from .memtrack import (
    AllocationLog,
    MemoryMeter,
    backward_handing_over,
    consumed_storages,
    copy_with_layout,
    flatten,
    made_storages,
    map_tensors,
    nbytes,
    pointers,
    storage_of,
    storages,
    tensors,
    transit_storages,
    unflatten,
)
from .precision import autocast_now, running, uncached
from .precision import describe as describe_precision
from .progress import progress_bar
from .stages import sequentialize

__all__ = ["profile"]


# NOTE [profile's options] (what the arguments of :func:`profile` change, and what ``chain.meta`` records):
# - ``estimate_for``: sizes stay measured, times are roofline estimates; ``meta["times"]`` says "estimate", and
#   ``meta["measured_fwd_time"]`` / ``["measured_bwd_time"]`` keep the measured ones.
# - ``optimizer``, ``world_size``: ``Chain.fixed``, the whole step's memory, measured by two real steps undone
#   afterwards (docs/design.md §7).
# - ``compile``, ``selective``: untimed warm-up runs compile the graphs; ``meta["compile"]``, ``meta["selective"]``.
# - ``granularity``: ``groups``, ``tags`` and ``shared`` come from the extraction (docs/design.md §8).
# - ``tie_identical`` (docs/design.md §10.1): ``Chain.tied``, ``copy_spread``, ``meta["untied_time"]``.
# - ``autocast``: without it, the precision active around the call counts, e.g. once ``Trainer(bf16=True)`` has
#   entered it (docs/design.md §11); ``meta["precision"]`` names it, and a schedule applied with this chain warns at
#   a step run in another.
# - ``meta`` also records device, dtype, ``param_bytes`` (parameters and gradients, beside the budget, not in it),
#   model class, input shape, torch version and the settings.
def profile(model: Any, sample_input: Any, loss_fn: LossFn | None = None, *,
            device: str | torch.device | None = None, warmup: int = 2, repeats: int = 5,
            progress: bool = True, optimizer: torch.optim.Optimizer | None = None, world_size: int = 1,
            compile: bool | Mapping[str, Any] = False, granularity: str | int | None = None,
            estimate_for: str | None = None, tie_identical: bool = True, selective: bool = False,
            autocast: torch.dtype | None = None) -> Chain:
    """Measure ``model`` stage by stage on ``sample_input`` and return its :class:`Chain` (docs/design.md §2).

    Args:
        model: anything :func:`sequentialize` cuts; each stage is called with one argument, as in ``nn.Sequential``.
        loss_fn: ``loss_fn(output) -> scalar`` for the last stage's real output gradient (default: mean of squares).
        device, progress: where to run (default: the model's device, where it must be already); a progress bar.
        warmup, repeats: untimed runs, then the timed runs whose medians are kept.
        estimate_for: ``"H100"``, ``"A100"`` or ``"H200"``: roofline times for that GPU (:mod:`.roofline`).
        optimizer, world_size: the step's optimizer and the ranks sharding its state (FSDP, ZeRO-3): ``Chain.fixed``.
        compile, selective: profile each stage compiled, as ``wrap(..., compile=True)`` runs it; with ``selective``,
            under selective checkpointing as ``apply(..., native=True, selective=True)`` (§5.3).
        granularity: how finely a traced model is cut (:func:`~hchain_viz.runtime.graph.extract_stages`, §8).
        tie_identical: give identical stages the median of their times, so noise never picks the copy to recompute.
        autocast: profile under ``torch.autocast(device, dtype=autocast)``; without it, in the precision active around
            the call (§11). Notes on these, and what ``chain.meta`` records: NOTE [profile's options] above.

    Raises:
        ProfileError: a bad setting, ``selective`` without ``compile``, or an optimizer not built on the model.
        NotSequentialError: the model cannot be cut into stages.
    """
    if not isinstance(warmup, int) or warmup < 0:
        raise ProfileError(f"warmup must be a non-negative integer, got {warmup!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats must be a positive integer, got {repeats!r}")
    gpu = None if estimate_for is None else roofline.gpu_of(estimate_for)
    modules = [model] if isinstance(model, nn.Module) else [m for _, m in sequentialize(model)]
    if autocast is not None:  # the whole profile, tracing included, in the precision that will run
        with running(autocast, resolve_device(modules, sample_input, device)):
            return profile(model, sample_input, loss_fn, device=device, warmup=warmup, repeats=repeats,
                           progress=progress, optimizer=optimizer, world_size=world_size, compile=compile,
                           granularity=granularity, estimate_for=estimate_for, tie_identical=tie_identical,
                           selective=selective)
    if optimizer is not None:  # before the long part: a wrong optimizer fails fast
        check_optimizer(optimizer, [p for m in modules for p in m.parameters()])
    dev = resolve_device(modules, sample_input, device)
    sample_input = to_device(sample_input, dev)
    stages = sequentialize(model, sample_input, granularity=granularity)
    if not stages:
        raise NotSequentialError(f"the {type(model).__name__} has no stages to profile")
    loss_fn = default_loss if loss_fn is None else loss_fn
    options = compile_options(compile)
    if selective and options is None:
        raise ProfileError("selective=True profiles compiled stages (pass compile=True too): in eager mode the "
                           "tensors selective checkpointing keeps are out of the profiler's sight")
    runners = ([s for _, s in stages] if options is None
               else [compile_stage(_Selective(s) if selective else s, options, len(stages)) for _, s in stages])
    if options is not None:
        warmup = max(warmup, 1)  # compiling (forward on the first call, backward on the first backward) is untimed

    L = len(stages)
    pairs = {int(round(k)) for k in np.linspace(1, L - 1, min(L - 1, CALL_PAIRS))} if L > 1 and gpu is None else set()
    calls: list[float] = []  # per pair of neighbours: what the second backward call cost beyond the shares
    prev: _StageProfile | None = None
    fwd, bwd, xs, xbar, ftmp, btmp = [0.0] * L, [0.0] * L, [nbytes(sample_input)] + [0] * L, [0] * L, [0] * L, [0] * L
    ntmp = [0] * L
    fwd_spread, bwd_spread = [0.0] * L, [0.0] * L
    transit, consumed, delta, handed = [0] * (L + 1), [0] * (L + 1), [0] * (L + 1), [0] * L
    candidates: list[bool] = [False] * len(tensors(sample_input))  # x_0 is the caller's: never transit
    through = list(candidates)  # per input tensor: made two stages back, handed on, saved by neither backward
    eaten: set[int] = set()  # ids (see identity) of the tensors only one later backward needs (consumed_shared)
    counts: list[tuple[int, int, int, int]] = []  # per stage, for estimate_for: fwd/bwd FLOPs and bytes
    bar = progress_bar(L, "profiling", "stage", enabled=progress)  # in a notebook, text once done
    # identity[i][j]: which tensor the j-th tensor of boundary value x[i] is (a stage may hand on its input's)
    identity: list[list[int]] = [list(range(len(tensors(sample_input))))]
    signatures: list[Any] = []  # per stage, what makes two stages the same computation (see _signature)
    sizes = {j: nbytes(t) for j, t in enumerate(tensors(sample_input))}
    profiled: list[_StageProfile] = []  # each keeps its input x_i to the end, for _relayout
    with preserved_state(modules + [m for _, m in stages], dev), bar, _threads_for_idle_cores(dev) as threads:
        h = _leaves(sample_input)
        for i, ((name, module), stage) in enumerate(zip(stages, runners)):
            bar.set_postfix_str(name, refresh=False)
            signatures.append(_signature(module, h, getattr(module, "tag", "") or ""))
            r = _StageProfile(name, stage, module, h, dev, loss_fn if i == L - 1 else None, candidates, through)
            r.run(warmup, repeats)
            if i in pairs and prev is not None and (c := _call_cost(prev, r, warmup, repeats)) is not None:
                calls.append(c)
            if prev is not None:
                prev.grads = None  # made again, in another layout, where _relayout needs them
            prev = r
            profiled.append(r)
            transit[i], consumed[i] = (r.transit_in, r.consumed_in) if i > 0 else (0, 0)
            delta[i], ntmp[i], handed[i] = r.delta_in, r.nograd_tmp, r.delta_through
            candidates, through = r.candidates_out, r.through_out
            eaten |= {identity[i][k] for k in r.consumed_through}
            fwd[i], bwd[i], xs[i + 1], xbar[i], ftmp[i], btmp[i] = (r.fwd_time, r.bwd_time, r.out_bytes, r.xbar,
                                                                   r.fwd_tmp, r.bwd_tmp)
            if r.loss_bytes:  # x[L] is all the caller holds: the output and the loss (x̄_L contains x_L)
                xs[i + 1] += r.loss_bytes
                xbar[i] += r.loss_bytes
            fwd_spread[i], bwd_spread[i] = r.fwd_spread, r.bwd_spread
            if gpu is not None:
                counts.append(r.counts())
            h = r.next_input
            ids = []
            for k, t in enumerate(tensors(h)):
                j = r.passed_on.get(k)
                if j is None:
                    j = len(sizes)
                    sizes[j] = nbytes(t)
                else:
                    j = identity[i][j]
                ids.append(j)
            identity.append(ids)
            bar.update(1)
        _relayout(profiled, btmp, delta, handed)
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    meta = {
        "device": str(dev),
        "dtype": _dtype_name(params, sample_input),
        "precision": describe_precision((autocast_now(), next((p.dtype for p in params if p.is_floating_point()),
                                                               None))),
        "param_bytes": nbytes(params) + nbytes([p for p in params if p.requires_grad]),
        "buffer_bytes": nbytes([b for m in modules for b in m.buffers()]),
        "model": type(model).__name__,
        "input_shape": _shapes(sample_input),
        "torch": torch.__version__,
        "warmup": warmup,
        "repeats": repeats,
        "threads": threads,  # torch's CPU threads while profiling (None: not set here)
        # per stage, half the range of the repeats' times over their median: the time is median ± spread
        "time_spread": {"fwd": fwd_spread, "bwd": bwd_spread},
        "timer": "cuda events" if dev.type == "cuda" else "perf_counter",
        "memory": "cuda memory stats" if dev.type == "cuda" else "allocator log",
        "loss": "default (output.loss if present, else mean of squares)" if loss_fn is default_loss else repr(loss_fn),
    }
    if options is not None:
        meta["compile"] = describe(options)
    if selective:
        meta["selective"] = True
    if gpu is not None:
        meta.update(measured_fwd_time=fwd, measured_bwd_time=bwd, estimate_for=gpu.name,
                    times=f"estimate: roofline for {gpu.name} from FLOP and byte counts (not measured)",
                    flops=[[f, b] for f, b, _, _ in counts])
        fwd = [roofline.estimate_time(gpu, meta["dtype"], f, n) for f, _, n, _ in counts]
        bwd = [roofline.estimate_time(gpu, meta["dtype"], b, n) for _, b, _, n in counts]
    tied, copy_spread = _identical(signatures, xs, xbar), []
    if tie_identical and tied:
        meta["untied_time"] = {"fwd": list(fwd), "bwd": list(bwd)}
        fwd, bwd = list(fwd), list(bwd)
        for stages_ in tied:
            copy_spread.append((_spread([fwd[i] for i in stages_]), _spread([bwd[i] for i in stages_])))
            f, b = statistics.median(fwd[i] for i in stages_), statistics.median(bwd[i] for i in stages_)
            for i in stages_:
                fwd[i], bwd[i] = f, b
    else:
        tied = []
    call = max(0.0, statistics.median(calls)) if calls else 0.0
    if calls:
        meta["backward_call"] = {"seconds": call, "per_pair": calls}
        bwd = [max(0.0, b - call) for b in bwd]
    fixed = None
    if optimizer is not None:
        fixed = fixed_memory(params, [m for _, m in stages], [b for m in modules for b in m.buffers()], optimizer,
                             dev, world_size, sample_input=sample_input)
    shared, shared_ids = _shared(identity, sizes)
    delta[L] = nbytes(r.grads)
    # what B(i) handed through is part of both gradients as charged (δ_L, the loss's, is charged by its storage: an
    # expanded one for a sum, which the profiler's dense copy outgrows)
    handed = [min(v, delta[i], delta[i + 1]) for i, v in enumerate(handed)]
    chain = Chain(fwd_time=fwd, bwd_time=bwd, x=xs, xbar=xbar, fwd_tmp=ftmp, bwd_tmp=btmp,
                  names=[n for n, _ in stages], meta=meta, fixed=fixed, groups=_groups(stages),
                  tags=[getattr(m, "tag", "") or "" for _, m in stages], shared=shared,
                  consumed_shared=[n for n, j in enumerate(shared_ids) if j in eaten],
                  transit=transit, consumed=consumed, delta=delta, nograd_tmp=ntmp,
                  delta_through=handed, tied=tied, copy_spread=copy_spread, backward_call=call)
    _warn_if_noisy(chain, bar)
    return chain


# Bytes added to every backward transient for autograd's own small allocations, which a stage's backward measured
# alone does not always make in a step (seen: 8 B in a compiled backward, 1,036 B in the joined backward of a LLaMA
# layer): measured peaks must never exceed predictions. Negligible beside any real activation.
BACKWARD_SLACK = 4096

# Timings that varied more than this across repeats (step-time weighted) make profile() warn: the machine was busy.
NOISY_SPREAD = 0.10


@contextmanager
def _threads_for_idle_cores(dev: torch.device) -> Iterator[int | None]:
    """On CPU, profile with no more torch threads than there are idle cores (at least one), then restore torch's
    setting; yields the number used (None elsewhere, or where the load cannot be read).

    Why: a thread on a core that another program keeps busy holds up every parallel op of the others, so each op
    waits for the busy core and the times swing between repeats (docs/design.md §10)."""
    before = torch.get_num_threads()
    idle = _idle_cores() if dev.type == "cpu" and before > 1 else None
    if idle is None:
        yield None
        return
    n = max(1, min(before, int(idle + 0.5)))
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def _idle_cores(sample_s: float = 0.1) -> float | None:
    """How many of the machine's cores were idle over the next ``sample_s`` seconds (Linux's /proc/stat); None where
    it cannot be read."""
    def read() -> tuple[int, int, int]:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        fields = [int(v) for v in lines[0].split()[1:]]
        cores = sum(1 for line in lines if re.match(r"cpu\d", line))
        return sum(fields[:8]), fields[3] + fields[4], cores  # all but guest time; idle + iowait

    try:
        total0, idle0, cores = read()
        time.sleep(sample_s)
        total1, idle1, _ = read()
    except (OSError, ValueError, IndexError):
        return None
    return cores * (idle1 - idle0) / (total1 - total0) if total1 > total0 else None


def _warn_if_noisy(chain: Chain, bar: Any = None) -> None:
    """Warn in one line, naming the stages that varied most, when the times that sharing a median over identical
    copies does not steady (:attr:`Chain.untied_spread`) varied by more than NOISY_SPREAD across repeats. In a
    notebook it is a few words on the line the progress bar left, not a warning block: the explorer says it in full,
    with what to do."""
    spread = chain.untied_spread
    if spread is None or spread <= NOISY_SPREAD:
        return
    s = chain.meta["time_spread"]
    tied = {i for t in chain.tied for i in t}
    worst = sorted(((max(f, b), chain.fwd_time[i] * f + chain.bwd_time[i] * b, chain.names[i])
                    for i, (f, b) in enumerate(zip(s["fwd"], s["bwd"])) if i not in tied), key=lambda t: -t[1])
    named = ", ".join(f"{name} ±{100 * sp:.0f}%" for sp, _, name in worst[:3] if sp > NOISY_SPREAD)
    if hasattr(bar, "note"):  # a notebook's progress line
        bar.note(f"timings rough: ±{100 * spread:.0f}% between repeats (a busy machine?)")
        return
    warnings.warn(f"stage times varied by ±{100 * spread:.0f}% across the {chain.meta.get('repeats')} repeats "
                  f"({named}); times may be off: profile again when the machine is quieter, or with more repeats",
                  TimingWarning, stacklevel=3)


def _signature(module: nn.Module, h: Any, tag: str) -> Any:
    """What makes two stages the same computation: module types, parameter shapes and dtypes, input shapes and
    dtypes, the tag, and for a traced stage its code without numbers (``h_3_attn`` reads ``h_attn``, ``layer_norm_1``
    ``layer_norm``: tracing numbers layers and repeated node names; shapes are compared apart)."""
    code = getattr(module, "code", None)
    return (tag, tuple(type(m).__qualname__ for m in module.modules()),
            tuple((tuple(p.shape), str(p.dtype)) for p in module.parameters()),
            tuple((tuple(t.shape), str(t.dtype), t.requires_grad) for t in tensors(h)),
            re.sub(r"_?\d+", "", code) if isinstance(code, str) else None)


def _identical(signatures: list[Any], xs: list[int], xbar: list[int]) -> list[tuple[int, ...]]:
    """Sets (two or more) of stages with the same signature and the same measured sizes (a check that they are the
    same computation: output and saved bytes)."""
    by: dict[Any, list[int]] = {}
    for i, sig in enumerate(signatures):
        by.setdefault((sig, xs[i + 1], xbar[i]), []).append(i)
    return [tuple(v) for v in by.values() if len(v) > 1]


def _relayout(profiled: list[_StageProfile], btmp: list[int], delta: list[int], handed: list[int]) -> None:
    """Measure B(i) again with δ_{i+1} laid out as the backward of stage i+1 makes it, where that differs from the
    layout of x_{i+1} it was measured with, and keep the larger backward (``btmp``, ``handed``: updated in place).

    The executor hands a group's last backward δ_{i+1} from a leaf's ``.grad``, laid out as x_{i+1}; inside a
    joined graph δ_{i+1} arrives as stage i+1's backward made it (contiguous from a mean's backward where x_{i+1} is
    channels-last), and B(i) may copy it into the layout it needs (a convolution's backward does). The layouts
    arriving at each boundary are followed from the loss down, since a residual block hands δ on unchanged."""
    arriving = {profiled[-1].raw_delta}  # the layouts in which δ_{i+1} leaves stage i+1's backward
    for i in range(len(profiled) - 2, -1, -1):
        r = profiled[i]
        made = {r.raw_delta}
        total, through = btmp[i] + delta[i] - handed[i], handed[i]
        for layout in {r.layout_from(raw) for raw in arriving} - {r.grad_layout}:
            bwd_tmp, delta_in, delta_through, raw = r.backward_in(layout)
            total, through = max(total, bwd_tmp + delta_in - delta_through), min(through, delta_through)
            made.add(raw)
        btmp[i], handed[i] = total - (delta[i] - through), through
        arriving = made


# Pairs of neighbouring stages whose backward is timed as one call and apart (spread over the chain): what a call
# costs is the median over them.
CALL_PAIRS = 12


def _call_cost(prev: _StageProfile, cur: _StageProfile, warmup: int, repeats: int) -> float | None:
    """Seconds a backward call costs beyond its stages' shares, from two neighbours: per repeat, each one's own
    backward (as the profile times it) plus the other's, less both run as one call through the joined graphs (as the
    executor runs a Fall that joins the graph before it); the median over repeats. None when nothing of the output
    needs a gradient."""
    diffs = []
    for k in range(warmup + repeats):
        _, b_prev = prev._timed_once()
        _, b_cur = cur._timed_once()
        inp = prev._input()
        outs, grads = cur._graded(cur._forward(prev._forward(inp)))
        if not outs:
            return None
        joined = timed(lambda outs=outs, grads=grads: torch.autograd.backward(outs, grads), cur.dev)
        prev._clear_input_grads()
        if k >= warmup:
            diffs.append(b_prev + b_cur - joined)
    return statistics.median(diffs)


class _StageProfile:
    """Times and sizes of one stage, given its input ``h`` (tensors detached from any graph); ``stage`` runs
    ``module`` (itself, or compiled); ``candidates_in[k]``: input tensor k was made by the stage before and is not
    saved for its backward (a transit candidate); ``through_in[k]``: it was made by the stage before that, and
    neither stage saves it (the stage before handed it on)."""

    def __init__(self, name: str, stage: Callable[[Any], Any], module: nn.Module, h: Any, dev: torch.device,
                 loss_fn: LossFn | None, candidates_in: list[bool], through_in: list[bool]):
        self.name, self.stage, self.module, self.h, self.dev, self.loss_fn = name, stage, module, h, dev, loss_fn
        self.candidates_in, self.through_in = candidates_in, through_in
        self.in_bytes = nbytes(h)
        self.writes_input: bool | None = None  # learned by the probe, as the executor learns it (Learned.mutates)

    def _input(self) -> Any:
        """A copy of the input, as a stage inside the chain receives it: laid out as in the chain (views of one
        storage stay views of one copy, with their strides: a contiguous clone of each would hide the copies that
        ops make of strided views, and what they save of them), and, where it requires grad, a leaf as the
        executor's (``wrap._Step._leaf``), or, for a stage that writes into its input (or not probed yet), a
        non-leaf whose gradient flows back to ``self.h``, so in-place first ops are legal.

        A leaf matters for memory: autograd runs a leaf's AccumulateGrad as soon as its gradient is ready, before any
        other node, so a gradient the stage hands to an input and to its own ops (a parallel block's residual add)
        is copied there while those ops still hold it. Behind a node of ours, the ops ran first and the input stole
        the gradient: the backward measured one activation lower than the executor's (issue 23)."""
        copies: dict[int, tuple] = {}
        leaves = self.writes_input is False

        def one(t: torch.Tensor) -> torch.Tensor:
            new = copy_with_layout(t, copies)
            if not t.requires_grad:
                return new
            if not leaves:
                return _GradInto.apply(t, new)
            return (uncached(new) if autocast_now() else new).requires_grad_()

        return map_tensors(self.h, one)

    def _input_grads(self, inp: Any) -> list[torch.Tensor]:
        """The input gradient the last backward on ``inp`` (from :meth:`_input`) left: on its leaves, or on
        ``self.h``."""
        return [t.grad for t in [*tensors(inp), *tensors(self.h)] if t.is_leaf and t.grad is not None]

    def _forward(self, inp: Any) -> Any:
        with user_code(lambda e: f"stage {self.name!r} failed on its input {_shapes(inp)}: {type(e).__name__}: {e}"):
            out = self.stage(inp)
        if not tensors(out):
            raise ProfileError(f"stage {self.name!r} returned {type(out).__name__}, which holds no tensor; every "
                               f"stage must return a tensor or a tuple of tensors")
        return out

    def _clear_input_grads(self) -> None:
        for t in tensors(self.h):
            t.grad = None

    def run(self, warmup: int, repeats: int) -> None:
        self._probe()
        ft, bt = [], []
        for k in range(warmup + repeats):
            f, b = self._timed_once()
            if k >= warmup:
                ft.append(f)
                bt.append(b)
        self.fwd_time, self.bwd_time = statistics.median(ft), statistics.median(bt)
        self.fwd_spread, self.bwd_spread = _spread(ft), _spread(bt)
        self._memory()

    def counts(self) -> tuple[int, int, int, int]:
        """Forward FLOPs, backward FLOPs, and the bytes each must at least move (for the roofline estimate): the
        forward reads its input and parameters and writes what it leaves (x̄); the backward reads x̄, its input, the
        output gradient and the parameters, and writes the input and parameter gradients."""
        inp = self._input()
        box: list[Any] = []
        f = roofline.count_flops(lambda: box.append(self._forward(inp)))
        outs, grads = self._graded(box[0])
        b = roofline.count_flops(lambda: torch.autograd.backward(outs, grads)) if outs else 0
        self._clear_input_grads()
        params = nbytes(list(self.stage.parameters()))
        return (f, b, self.in_bytes + params + self.xbar,
                self.xbar + 2 * self.in_bytes + self.out_bytes + 2 * params)

    def _graded(self, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The output tensors that get a gradient, and their gradients δ_{i+1}."""
        diff = [t for t in tensors(out) if t.requires_grad]
        pairs = [(t, g) for t, g in zip(diff, self.grads) if g is not None]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _timed_once(self) -> tuple[float, float]:
        """Seconds of one recording forward and of its backward (the graph and copies die on return)."""
        inp = self._input()
        box: list[Any] = []
        f = timed(lambda: box.append(self._forward(inp)), self.dev)
        outs, grads = self._graded(box[0])
        b = timed(lambda: torch.autograd.backward(outs, grads), self.dev) if outs else 0.0
        self._clear_input_grads()
        return f, b

    def _probe(self) -> None:
        """One forward: the output (next stage's input), its size, and the gradient the backward will get."""
        inp = self._input()
        versions = [t._version for t in tensors(inp)]
        out = self._forward(inp)
        self.writes_input = any(t._version != v for t, v in zip(tensors(inp), versions))
        self.out_bytes = nbytes(out)
        # output tensor k is input tensor j, handed on unchanged (the residual stream, a mask): {k: j}
        ins = {(t.untyped_storage().data_ptr(), t.data_ptr(), t.shape): j for j, t in enumerate(tensors(inp))}
        self.passed_on = {k: ins[key] for k, t in enumerate(tensors(out))
                          if (key := (t.untyped_storage().data_ptr(), t.data_ptr(), t.shape)) in ins}
        # What of the output the forward did not allocate: the tensors handed on (shared, charged once; design.md §8).
        self.passed_bytes = nbytes([tensors(out)[k] for k in self.passed_on])
        self.next_input = _leaves(out)
        diff = [t for t in tensors(out) if t.requires_grad]
        self.loss_tmp = self.loss_bytes = 0
        if self.loss_fn is not None:
            # The loss is the caller's, but its memory is on the device between the last forward and B(L-1): what
            # it saves (a log-softmax over the vocabulary) and its backward's transients, beside δ_L.
            # The loss sees the output as the executor hands it to the caller: detached aliases, so δ_L is only what
            # the loss itself back-propagates (none for the logits beside an HF model's own loss, whose gradient
            # arises inside the last stage's backward).
            with MemoryMeter(self.dev) as meter:
                flat, spec = flatten(out)
                ends = [t.detach().requires_grad_(t.requires_grad) for t in flat]
                loss = loss_of(self.loss_fn, unflatten(spec, ends))  # raises when nothing requires grad
                ends = [t for t in ends if t.requires_grad]
                grads = torch.autograd.grad(loss, ends, allow_unused=True) if ends else ()
                del flat, ends
            self.loss_tmp = max(0, meter.peak - nbytes([g for g in grads if g is not None]))
            # The caller holds the loss to the end of the step, as it holds x_L, and torch.autograd.backward the
            # gradient it starts from (ones of the loss's shape) through the whole backward.
            self.loss_bytes = 2 * nbytes(loss)
            # None for an output the loss does not use: the executor's δ_L has no tensor there either.
            self.grads = [None if g is None else g.detach() for g in grads]
        else:
            self.grads = [torch.ones_like(t) for t in diff]
        self.grad_layout = tuple(None if g is None else g.stride() for g in self.grads)

    def layout_from(self, raw: tuple) -> tuple:
        """The strides of δ_{i+1} (per output that gets a gradient) as the next stage's backward made it (``raw``:
        its ``raw_delta``), the stand-in's where that backward left none."""
        at = [k for k, t in enumerate(tensors(self.next_input)) if t.requires_grad]
        return tuple(s if raw[k] is None else raw[k] for k, s in zip(at, self.grad_layout))

    def backward_in(self, layout: tuple) -> tuple[int, int, int, tuple]:
        """Measure again with δ_{i+1} laid out as ``layout``: ``(bwd_tmp, delta_in, delta_through, raw_delta)``."""
        diff = [t for t in tensors(self.next_input) if t.requires_grad]
        self.grads = [torch.ones_like(t) if s is None else
                      torch.empty_strided(t.shape, s, dtype=t.dtype, device=t.device).fill_(1)
                      for t, s in zip(diff, layout)]
        self._memory()
        self.grads = None
        return self.bwd_tmp, self.delta_in, self.delta_through, self.raw_delta

    def _memory(self) -> None:
        """xbar, fwd_tmp, bwd_tmp from one recording forward + backward and one no-grad forward."""
        inp = self._input()
        saved: dict[int, tuple[int, int]] = {}  # what autograd saves: id(storage) -> (address, bytes)
        # the strides of δ_i as this backward makes it, before a leaf's AccumulateGrad lays it out as x_i
        raw: list[tuple[int, ...] | None] = [None] * len(tensors(inp))
        for k, t in enumerate(tensors(inp)):
            if t.requires_grad:
                t.register_hook(lambda g, k=k: raw.__setitem__(k, g.stride()))

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = storage_of(t)
            if st is not None:
                saved[id(st)] = (st.data_ptr(), st.nbytes())
            return t

        # Which saved storages the forward created comes from the allocator's log (the CPU meter's own; on CUDA a
        # second one beside the statistics): a dispatch-mode tracker would make compiled stages run eager.
        created = nullcontext(None) if self.dev.type != "cuda" else AllocationLog(self.dev)
        with MemoryMeter(self.dev) as meter, created as cuda_log:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self._forward(inp)
            out_storages = storages(out)
            kept = {k: v for k, v in saved.items() if k not in out_storages}
            saved_ptrs = {ptr for ptr, _ in saved.values()}
            saved.clear()
            ins, outs = tensors(inp), tensors(out)
            unneeded = transit_storages(ins, self.candidates_in, saved_ptrs, outs)
            self.transit_in = sum(st.nbytes() for st in unneeded.values())
            only_here = consumed_storages(ins, self.candidates_in, saved_ptrs, outs)
            self.consumed_in = sum(st.nbytes() for st in only_here.values())
            # Which output tensors the next stage's transit may hold: made here, not saved for this backward.
            made = made_storages(pointers(ins), pointers(outs), self.module) - saved_ptrs
            self.candidates_out = [(st := storage_of(t)) is not None and st.data_ptr() in made for t in outs]
            # A tensor made two stages back that only this backward needs (chain.consumed_shared: v handed on beside
            # the attention probabilities); and those this stage hands on to the next one unsaved.
            eaten = consumed_storages(ins, self.through_in, saved_ptrs, outs)
            self.consumed_through = [k for k, t in enumerate(ins)
                                     if (st := storage_of(t)) is not None and st.data_ptr() in eaten]
            self.through_out = [j is not None and self.candidates_in[j] and (st := storage_of(ins[j])) is not None
                                and st.data_ptr() not in saved_ptrs
                                for j in (self.passed_on.get(k) for k in range(len(outs)))]
            del ins, outs, unneeded, only_here, out_storages, eaten
            if cuda_log is not None:
                cuda_log.mark()
            meter.mark()  # span 0: the recording forward; span 1: δ_{i+1}; span 2: the backward
            # The backward as the executor runs it: δ_{i+1} handed over, so autograd frees it once done with it (a
            # copy made inside the meter, so its early free is seen). The outputs stay referenced to the end: freeing
            # them early too made the predictions of `bench transformers` fall up to 5% below measured peaks.
            pairs = [(t, g.clone()) for t, g in zip(*self._graded(out))]
            handed = {g.untyped_storage().data_ptr() for _, g in pairs}
            outs = tensors(out)
            if cuda_log is not None:
                cuda_log.mark()
            meter.mark()
            backward_handing_over(pairs)
            del out, outs
        # δ_i as the backward left it: a gradient per input tensor that needs one (none for ids and masks; the
        # gradient of a broadcast view or of views of one storage is larger than the storage).
        grads = self._input_grads(inp)
        self.delta_in = nbytes(grads)
        log = cuda_log if cuda_log is not None else meter.log
        # Of δ_i, what is δ_{i+1} handed on unchanged (the gradient of a tensor passed through, which the input's
        # AccumulateGrad took as it was): δ_{i+1}'s storages, not memory the backward allocated at their address.
        fresh = log.created_addresses(2)
        self.delta_through = nbytes([g for g in grads if (p := g.untyped_storage().data_ptr()) in handed
                                     and p not in fresh])
        del grads
        self._clear_input_grads()
        self.raw_delta = tuple(raw)
        del inp
        created = log.created_addresses(0)
        fwd, _, bwd = meter.spans
        # What the forward left is at least what the allocator still holds of it: autograd also keeps what no hook
        # sees (the scalar of ``t * 0.125``, wrapped as a tensor of its own).
        self.xbar = max(self.out_bytes + sum(size for ptr, size in set(kept.values()) if ptr in created),
                        fwd.end + self.passed_bytes)
        fwd_peak, bwd_peak = fwd.peak, bwd.peak - bwd.start

        inp = self._input()
        with torch.no_grad(), MemoryMeter(self.dev) as meter:
            out = self._forward(inp)
            del out
        del inp
        nograd_peak = meter.peak
        # Transients above what the forward leaves that it allocated itself (x̄ less the tensors handed on: the
        # simulator charges those once, as part of the input).
        passed = self.passed_bytes
        self.fwd_tmp = max(0, fwd_peak - (self.xbar - passed))
        self.nograd_tmp = max(0, nograd_peak - (self.out_bytes - passed))
        # Beyond the new part of the δ_i it leaves (the simulator charges delta[i] - delta_through[i] beside
        # δ_{i+1}: not x_i's bytes, which differ for ids, masks and broadcast views). The last stage's backward runs
        # right after the loss's: its transient covers the loss's (see _probe).
        self.bwd_tmp = max(0, bwd_peak - (self.delta_in - self.delta_through), self.loss_tmp) + BACKWARD_SLACK


# ---------------------------------------------------------------------------------------------- helpers
class _GradInto(torch.autograd.Function):
    """``copy`` (of ``src``, same shape) as a non-leaf whose gradient goes to ``src``."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        return copy.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def _groups(stages: list[tuple[str, nn.Module]]) -> list[tuple[str, int, int]]:
    """Runs of consecutive stages that graph extraction put in the same block: ``(block, first, last)``."""
    out: list[tuple[str, int, int]] = []
    for i, (_, m) in enumerate(stages):
        group = getattr(m, "group", None)
        if group is None:
            continue
        if out and out[-1][0] == group and out[-1][2] == i - 1:
            out[-1] = (group, out[-1][1], i)
        else:
            out.append((group, i, i))
    return out


def _shared(identity: list[list[int]], sizes: dict[int, int]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """``(first, last, bytes)`` for every tensor found in more than one consecutive boundary value, and its id."""
    seen: dict[int, list[int]] = {}
    for i, ids in enumerate(identity):
        for j in dict.fromkeys(ids):
            seen.setdefault(j, []).append(i)
    found = [(j, at) for j, at in seen.items() if len(at) > 1 and sizes[j] > 0]
    return [(at[0], at[-1], sizes[j]) for j, at in found], [j for j, _ in found]


def _leaves(obj: Any) -> Any:
    """Detached tensors sharing storage with ``obj``'s, requiring grad where the originals did (new leaves)."""
    return map_tensors(obj, lambda t: t.detach().requires_grad_(t.requires_grad))


def _spread(times: list[float]) -> float:
    """Half the range of ``times`` over their median (0 for one repeat or zero times)."""
    med = statistics.median(times)
    return (max(times) - min(times)) / (2 * med) if med > 0 else 0.0


def _dtype_name(params: list[torch.Tensor], sample_input: Any) -> str:
    for t in [*params, *tensors(sample_input)]:
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"


class _Selective(nn.Module):
    """A stage run as ``hcv.apply(..., native=True, selective=True)`` runs it, for compiling and profiling."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, x: Any) -> Any:
        from .train.native import selective_call

        return selective_call(self.stage, x)
