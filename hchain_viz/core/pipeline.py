"""Pipeline parallelism with the memory each stage really holds (docs/design.md §12).

A :class:`PipelinePlan` splits a chain into P contiguous pipeline stages, one per device, and gives each its own
checkpointing :class:`~hchain_viz.core.schedule.Schedule`. With M microbatches, stage s (from 0) holds the stored
activations of ``in_flight(kind, P, M, s)`` microbatches at once: ``min(P - s, M)`` under 1F1B, ``M`` under GPipe.
Its peak is its fixed memory (parameters, gradients, optimizer state) plus ``in_flight - 1`` microbatches' stored
activations plus one microbatch's working peak. The first stage therefore runs out first, and the best schedule
differs per stage.

:func:`plan_pipeline` chooses the partition and the per-stage schedules together: each stage's schedule is the
fastest one (of the sub-chain's optimal frontier and the uniform policies) whose in-flight peak fits; the partition
is found by a dynamic programme over split points, scored by :meth:`PipelinePlan.simulate`, the event-level timeline
of every rank (forwards and backwards per microbatch, recomputation inside the backwards, point-to-point transfers
over a link of ``bandwidth`` bytes/s at each boundary).

Interleaved 1F1B (torch's ``ScheduleInterleaved1F1B``): each device holds v chunks, chunk c of device r being
virtual stage ``c * P + r``; a device's memory over time follows torch's order of its ops
(:func:`interleaved_order`), its chunks' in-flight microbatches beside the running op, and the bubble shrinks to
``(P - 1) / v`` stage times. The planner searches the v·P - 1 cuts; each device takes, of every choice of one
candidate per chunk that fits, the least total time.

Splits fall between layers: ``chain.groups`` when the chain has them (stages before the first group join it, those
after the last join the last), else between any two stages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from ..errors import HChainError, InvalidPipeline, PipelineDoesNotFit
from .chain import Chain, bandwidth_of
from .fixed import FixedMemory
from .in_flight import InFlight
from .schedule import Schedule
from .simulate import Trace, simulate
from .solver import _check_chain, solve
from .strategies import per_layer, recompute_all, store_all
from .units import format_bytes, format_time, parse_bytes

PIPELINE_SCHEDULES = ("1F1B", "GPipe", "interleaved")

__all__ = ["PIPELINE_SCHEDULES", "FitAnswer", "Pipeline", "PipelinePlan", "PipelineStage", "PipelineTrace", "StageRun",
           "in_flight", "interleaved_order", "plan_pipeline", "baseline_plans", "fit_pipeline", "stage_chain",
           "split_units"]


# ------------------------------------------------------------------------------------------------ the model
def pipeline_kind(schedule: Any) -> str:
    """The canonical name of a pipeline schedule (``"1F1B"``, ``"GPipe"`` or ``"interleaved"`` (torch's
    ``ScheduleInterleaved1F1B``; also ``"interleaved1f1b"``), any case). Raises InvalidPipeline."""
    name = schedule.strip().lower().replace(" ", "").replace("_", "") if isinstance(schedule, str) else None
    if name == "interleaved1f1b":
        return "interleaved"
    for kind in PIPELINE_SCHEDULES:
        if name == kind.lower():
            return kind
    raise InvalidPipeline(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(PIPELINE_SCHEDULES)}")


def in_flight(kind: str, devices: int, microbatches: int, stage: int, chunks: int = 1) -> int:
    """Microbatches whose stored activations stage ``stage`` (from 0) holds at once: ``min(P - s, M)`` under 1F1B
    (torch's ``Schedule1F1B`` runs that many warm-up forwards), ``M`` under GPipe; under interleaved 1F1B (``stage``
    a virtual stage of ``devices * chunks``), the most that torch's order (:func:`interleaved_order`) holds."""
    kind = pipeline_kind(kind)
    if kind == "interleaved":
        return _interleaved_model(devices, chunks, microbatches, stage % devices).most[stage // devices]
    return microbatches if kind == "GPipe" else min(devices - stage, microbatches)


def check_interleaved(devices: int, chunks: int, microbatches: int) -> None:
    """Raise InvalidPipeline unless torch's ``ScheduleInterleaved1F1B`` runs ``microbatches`` on ``devices`` ranks of
    ``chunks`` stages each: at least 2 chunks, and M a multiple of its rounds, ``max(1, M // P)``."""
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 2:
        raise InvalidPipeline(f"interleaved 1F1B needs chunks (model chunks per device) >= 2, got {chunks!r}; use "
                              f"\"1F1B\" for one stage per device")
    rounds = max(1, microbatches // devices)
    if microbatches % rounds:
        raise InvalidPipeline(f"torch's ScheduleInterleaved1F1B needs the microbatches to be a multiple of "
                              f"max(1, M // P) = {rounds}; got M = {microbatches} on P = {devices}: use a multiple "
                              f"of {devices}")


def interleaved_order(devices: int, chunks: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """The ops of rank ``rank`` under torch's ``ScheduleInterleaved1F1B``, as ``("F" or "B", chunk, microbatch)``;
    chunk c of rank r is virtual stage ``c * P + r``. As torch computes it: ``(v - 1) * M/rounds + 2 (P - 1 - r)``
    warm-up forwards (at most ``v * M``), the forwards' chunk advancing every ``M/rounds`` ops, then one forward and
    one backward in turn (the backwards from the last chunk down), then the remaining backwards."""
    P, v, M = devices, chunks, microbatches
    check_interleaved(P, v, M)
    per_round = M // max(1, M // P)
    warmup = min((v - 1) * per_round + 2 * (P - 1 - rank), M * v)
    steady = M * v - warmup
    f_next, b_next = [0] * v, [0] * v
    order: list[tuple[str, int, int]] = []

    def fwd(op: int) -> None:
        c = (op // per_round) % v
        order.append(("F", c, f_next[c]))
        f_next[c] += 1

    def bwd(op: int) -> None:
        c = v - 1 - ((op - warmup) // per_round) % v
        order.append(("B", c, b_next[c]))
        b_next[c] += 1

    for op in range(M * v + warmup):
        if op < warmup:
            fwd(op)
        elif op < warmup + steady:
            fwd(op)
            bwd(op)
        else:
            bwd(op)
    return order


class _RankModel(NamedTuple):
    """One rank's interleaved order with, before each op, how many microbatches each chunk holds (``held``) and how
    many backwards each has done (``done``), and the most each chunk holds at once (``most``)."""

    ops: tuple[tuple[str, int, int], ...]
    held: tuple[tuple[int, ...], ...]
    done: tuple[tuple[int, ...], ...]
    most: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def _interleaved_model(devices: int, chunks: int, microbatches: int, rank: int) -> _RankModel:
    ops = interleaved_order(devices, chunks, microbatches, rank)
    held, done, now, back, most = [], [], [0] * chunks, [0] * chunks, [0] * chunks
    for op, c, _ in ops:
        held.append(tuple(now))
        done.append(tuple(back))
        now[c] += 1 if op == "F" else -1
        back[c] += op == "B"
        most[c] = max(most[c], now[c])
    return _RankModel(tuple(ops), tuple(held), tuple(done), tuple(most))


def rank_activation_peak(devices: int, chunks: int, microbatches: int, rank: int, runs: Sequence[StageRun],
                         sent: Sequence[int] | None = None) -> int:
    """Peak activation bytes of rank ``rank`` under interleaved 1F1B, its chunks run by ``runs``: over the ops of its
    order, the stored bytes of every microbatch its chunks hold plus the running op's own curve (a forward's from
    its start, a backward's in place of its microbatch's stored bytes), plus ``sent[c]`` bytes per backward chunk c
    has done: torch's interleaved runtime waits for its sends only when the step ends, so each microbatch's sent
    output and input gradient stay allocated until then (see :meth:`PipelinePlan.rank_sent`)."""
    return sum(_rank_peak_parts(devices, chunks, microbatches, rank, runs, sent))


def _rank_peak_parts(devices: int, chunks: int, microbatches: int, rank: int, runs: Sequence[StageRun],
                     sent: Sequence[int] | None = None) -> tuple[int, int]:
    """:func:`rank_activation_peak` as (what the device holds when the peak op starts, that op's own rise)."""
    model = _interleaved_model(devices, chunks, microbatches, rank)
    sent = sent or [0] * chunks
    best = (microbatches * sum(sent), 0)  # after the last backward, before the sends are waited for
    for (op, c, _), held, done in zip(model.ops, model.held, model.done):
        base = sum(h * r.stored for h, r in zip(held, runs)) + sum(d * b for d, b in zip(done, sent))
        rise = runs[c].fwd_peak if op == "F" else runs[c].bwd_peak - runs[c].stored
        if base + rise > sum(best):
            best = (base, rise)
    return best


def sent_bytes(chain: Chain, first: int, end: int, stage: int, stages: int) -> int:
    """What (virtual) stage ``stage`` of ``stages`` on chain stages ``first .. end-1`` sends per microbatch: its
    output (but the last stage) and its input's gradient (but the first)."""
    return (chain.x[end] if stage < stages - 1 else 0) + (chain.delta_bytes[first] if stage > 0 else 0)


def split_units(chain: Chain) -> list[tuple[int, int]]:
    """The chain's layers as ``(first, end)`` stage ranges that cover it: where a pipeline may be split."""
    L = chain.length
    if not chain.groups:
        return [(i, i + 1) for i in range(L)]
    starts = [first for _, first, _ in chain.groups]
    starts[0] = 0  # stages before the first layer (the embedding) go with it; between layers, with the next one
    return list(zip(starts, starts[1:] + [L]))


def stage_chain(chain: Chain, first: int, end: int) -> Chain:
    """Stages ``first .. end-1`` of ``chain`` as a chain of their own: one pipeline stage, whose loss is the
    gradient it receives from the next stage (δ of size ``delta_bytes[end]``). Its input and output are whole
    tensors (received and sent), so their transit and consumed parts are not freed early; the fixed memory is
    split by the stages' gradient bytes (see :func:`stage_fixed`)."""
    L = chain.length
    if not (isinstance(first, int) and isinstance(end, int) and 0 <= first < end <= L):
        raise InvalidPipeline(f"a pipeline stage spans stages first..end-1 with 0 <= first < end <= {L}; got "
                              f"first={first!r}, end={end!r}")

    def boundary(v: Sequence[int]) -> list[int]:  # per boundary first..end, zero at the two ends
        return [0] + list(v[first + 1:end]) + [0]

    shared, index = [], {}
    for n, (a, b, size) in enumerate(chain.shared):
        lo, hi = max(a, first), min(b, end)
        if lo < hi:
            index[n] = len(shared)
            shared.append((lo - first, hi - first, size))
    consumed_shared = [index[n] for n in chain.consumed_shared
                       if n in index and first < chain.shared[n][0] and chain.shared[n][1] < end]
    tied = [t for t in (tuple(i - first for i in s if first <= i < end) for s in chain.tied) if len(t) >= 2]
    spread = [chain.copy_spread[k] for k, s in enumerate(chain.tied)
              if len([i for i in s if first <= i < end]) >= 2] if chain.copy_spread else []
    return Chain(
        fwd_time=chain.fwd_time[first:end], bwd_time=chain.bwd_time[first:end], x=chain.x[first:end + 1],
        xbar=chain.xbar[first:end], fwd_tmp=chain.fwd_tmp[first:end], bwd_tmp=chain.bwd_tmp[first:end],
        names=chain.names[first:end], tags=chain.tags[first:end], backward_call=chain.backward_call,
        groups=[(g, a - first, b - first) for g, a, b in chain.groups if first <= a and b < end],
        shared=shared, transit=boundary(chain.transit), consumed=boundary(chain.consumed),
        delta=None if chain.delta is None else chain.delta[first:end + 1],
        delta_through=chain.delta_through[first:end], consumed_shared=consumed_shared,
        nograd_tmp=None if chain.nograd_tmp is None else chain.nograd_tmp[first:end],
        fixed=stage_fixed(chain.fixed, first, end), tied=tied, copy_spread=spread,
        meta={"pipeline_stage": (first, end)})


def stage_fixed(fixed: FixedMemory | None, first: int, end: int) -> FixedMemory | None:
    """The part of ``fixed`` that stages ``first .. end-1`` hold: their own gradients, and the parameters, optimizer
    state, buffers and optimizer-step transient in proportion to their gradient bytes (a chain records those for
    the whole model only); the libraries' workspace whole (each device has its own). Weights these stages share
    with a later stage (``fixed.tied_grads``: a tied embedding, whose LM head comes last) are held here too, as a
    copy with its own gradient and optimizer state, counted on the last of these stages that uses them."""
    if fixed is None:
        return None
    grads = list(fixed.stage_grads[first:end])
    for users, nbytes in fixed.tied_grads:
        mine = [u for u in users if first <= u < end]
        if mine and users[-1] >= end:  # the whole model counts them on users[-1], a later device
            grads[mine[-1] - first] += nbytes
    total = sum(fixed.stage_grads)
    share = sum(grads) / total if total else (end - first) / len(fixed.stage_grads)

    def part(n: int) -> int:
        return math.ceil(n * share)

    tied = [(tuple(u - first for u in users if first <= u < end), n) for users, n in fixed.tied_grads]
    return dataclasses.replace(fixed, params=part(fixed.params), stage_grads=grads,
                               optimizer_state=part(fixed.optimizer_state), buffers=part(fixed.buffers),
                               step_tmp=part(fixed.step_tmp), world_size=1, master_weights=part(fixed.master_weights),
                               stage_casts=fixed.stage_casts[first:end],
                               tied_grads=[(users, n) for users, n in tied if len(users) >= 2])


@dataclass(frozen=True)
class StageRun:
    """One microbatch through one pipeline stage by ``schedule``, simulated once (bytes, seconds).

    ``fwd_time``: the forward phase (the ops before ``Loss``); ``bwd_time``: the backward phase, recomputation
    included (``recompute_time`` of it); ``stored``: what the microbatch keeps resident between the two (its input,
    checkpoints, saved activations, output); ``working``: the peak while it runs (its own stored bytes included).
    """

    schedule: Schedule
    fwd_time: float
    bwd_time: float
    recompute_time: float
    stored: int
    working: int
    trace: Trace = field(repr=False, compare=False)

    @classmethod
    def of(cls, chain: Chain, schedule: Schedule) -> StageRun:
        trace = simulate(chain, schedule)
        ev = trace.events
        k = next(n for n, e in enumerate(ev) if e.op.kind == "Loss")
        fwd = ev[k].end
        recompute = sum(e.end - e.start for e in ev[k:] if e.op.is_forward)
        stored = ev[k - 1].mem_after if k else trace.initial_memory
        return cls(schedule, fwd, trace.makespan - fwd, recompute, stored, trace.peak_memory, trace)

    @property
    def time(self) -> float:
        return self.fwd_time + self.bwd_time

    @cached_property
    def curves(self) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
        """The forward's and the backward's memory curves as ``(time, bytes)`` points (the backward's times from
        the Loss's start)."""
        ev = self.trace.events
        k = next(n for n, e in enumerate(ev) if e.op.kind == "Loss")
        fwd = [(0.0, self.trace.initial_memory)] + [p for e in ev[:k] for p in
                                                    ((e.start, e.mem_before), (e.start, e.mem_peak),
                                                     (e.end, e.mem_after))]
        t0 = ev[k].start
        bwd = [p for e in ev[k:] for p in ((e.start - t0, e.mem_before), (e.start - t0, e.mem_peak),
                                           (e.end - t0, e.mem_after))]
        return fwd, bwd

    @cached_property
    def fwd_peak(self) -> int:
        """The highest point of the forward's curve (bytes)."""
        return max(m for _, m in self.curves[0])

    @cached_property
    def bwd_peak(self) -> int:
        """The highest point of the backward's curve (bytes; the microbatch's stored bytes included)."""
        return max(m for _, m in self.curves[1])

    def need(self, in_flight: int) -> int:
        """Activation bytes at the peak with ``in_flight`` microbatches held: the others' stored bytes beside this
        one's working peak."""
        return (in_flight - 1) * self.stored + self.working


@dataclass(frozen=True)
class PipelineStage:
    """One device's part of a plan: stages ``first .. end-1`` of the chain, run by ``run.schedule``.

    ``fixed``: its parameters, gradients, optimizer state, buffers and workspace (bytes); ``step_tmp``: the optimizer
    step's transient; ``in_flight``: microbatches it holds at once.
    """

    first: int
    end: int
    chain: Chain = field(repr=False)
    run: StageRun = field(repr=False)
    fixed: int
    step_tmp: int
    in_flight: int

    @property
    def schedule(self) -> Schedule:
        return self.run.schedule

    @property
    def in_flight_bytes(self) -> int:
        """The other in-flight microbatches' stored activations at the peak."""
        return (self.in_flight - 1) * self.run.stored

    @property
    def working(self) -> int:
        return self.run.working

    @property
    def peak(self) -> int:
        """Predicted peak device memory (bytes): fixed, plus the larger of the activations at their peak and the
        optimizer step's transient."""
        return self.fixed + max(self.in_flight_bytes + self.run.working, self.step_tmp)


class PipeEvent(NamedTuple):
    """One op on one rank's timeline: ``kind`` ``"F"`` or ``"B"`` of ``microbatch``; a B includes ``recompute``
    seconds of recomputed forwards. ``chunk``: which of the rank's stages runs it (0 but under interleaved 1F1B)."""

    rank: int
    kind: str
    microbatch: int
    start: float
    end: float
    recompute: float
    chunk: int = 0


@dataclass(frozen=True, eq=False)
class PipelineTrace:
    """The simulated pipeline step: ``events`` per rank in time order and ``step_time`` in seconds; ``memory[rank]``
    as ``(times, bytes)`` step points (fixed memory counted from the start, the optimizer step at the end)."""

    plan: PipelinePlan = field(repr=False)
    events: tuple[tuple[PipeEvent, ...], ...]
    step_time: float

    @cached_property
    def memory(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        p = self.plan
        return tuple(_rank_memory(p.rank_stages(r), p.rank_fixed(r), p.rank_sent(r), evs, self.step_time)
                     for r, evs in enumerate(self.events))

    @property
    def peaks(self) -> tuple[int, ...]:
        return tuple(int(m.max()) for _, m in self.memory)

    @property
    def bubble(self) -> float:
        """Idle fraction of the devices over the step."""
        busy = sum(e.end - e.start for evs in self.events for e in evs)
        total = self.step_time * len(self.events)
        return 1.0 - busy / total if total > 0 else 0.0


def rank_order(kind: str, devices: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The order in which rank ``stage`` runs its forwards and backwards, as torch's schedules do: GPipe all
    forwards then all backwards; 1F1B ``min(P - s, M)`` forwards, then one backward and one forward in turn."""
    M = microbatches
    if pipeline_kind(kind) == "GPipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    w = in_flight(kind, devices, M, stage)
    order = [("F", m) for m in range(w)]
    for m in range(M):
        order.append(("B", m))
        if w + m < M:
            order.append(("F", w + m))
    return order


@dataclass(frozen=True, eq=False)
class PipelinePlan:
    """A partition of ``chain`` into pipeline stages, each with its checkpointing schedule (docs/design.md §12).

    ``kind``: ``"1F1B"``, ``"GPipe"`` or ``"interleaved"``; ``microbatches``: M; ``bandwidth``: bytes/s of the link
    between neighbouring devices (None: transfers are free); ``label``: how it was chosen (``"optimal"``,
    ``"balanced+uniform"``, ``"balanced+per-stage"``); ``chunks``: v, stages per device (interleaved: ``stages``
    holds the ``v * P`` virtual stages in pipeline order, stage j on device ``j % P``). ``simulate()`` gives the
    timeline and memory per rank; ``step_time`` reads it.
    """

    chain: Chain = field(repr=False)
    kind: str
    microbatches: int
    stages: tuple[PipelineStage, ...]
    bandwidth: float | None = None
    label: str = "plan"
    memory_limit: int | None = None
    exact: bool = True  # False when the partition search stopped at its node limit (the best found is returned)
    chunks: int = 1

    @property
    def devices(self) -> int:
        return len(self.stages) // self.chunks

    def rank_of(self, stage: int) -> int:
        """The device that runs (virtual) stage ``stage``."""
        return stage % self.devices

    def rank_stages(self, rank: int) -> tuple[PipelineStage, ...]:
        """The stages device ``rank`` runs, its chunks in order."""
        return self.stages[rank::self.devices]

    def rank_sent(self, rank: int) -> tuple[int, ...]:
        """Per chunk of device ``rank``: the bytes each backward leaves allocated until the step ends (interleaved:
        the microbatch's sent output and input gradient, see :func:`rank_activation_peak`; else none)."""
        S = len(self.stages)
        if self.chunks == 1:
            return (0,)
        return tuple(sent_bytes(self.chain, self.stages[j].first, self.stages[j].end, j, S)
                     for j in range(rank, S, self.devices))

    def rank_parts(self, rank: int) -> tuple[int, int, int]:
        """Device ``rank``'s peak as (fixed, other microbatches in flight, working): under interleaved 1F1B, what it
        holds when its peak op starts (its chunks' stored microbatches and sent bytes) and that op's rise."""
        if self.chunks == 1:
            st = self.stages[rank]
            return st.fixed, st.in_flight_bytes, st.peak - st.fixed - st.in_flight_bytes
        fixed, step = self.rank_fixed(rank)
        held, rise = _rank_peak_parts(self.devices, self.chunks, self.microbatches, rank,
                                      [st.run for st in self.rank_stages(rank)], self.rank_sent(rank))
        return (fixed, held, rise) if held + rise >= step else (fixed, 0, step)

    def rank_fixed(self, rank: int) -> tuple[int, int]:
        """Device ``rank``'s fixed memory and optimizer-step transient (bytes): its stages' sums, the libraries'
        workspace once."""
        sts = self.rank_stages(rank)
        ws = self.chain.fixed.workspace if self.chain.fixed is not None else 0
        return sum(st.fixed for st in sts) - (len(sts) - 1) * ws, sum(st.step_tmp for st in sts)

    @property
    def bounds(self) -> tuple[int, ...]:
        """The first chain stage of each pipeline stage."""
        return tuple(s.first for s in self.stages)

    def rank_activations(self, rank: int) -> int:
        """Device ``rank``'s activation peak over the pipeline's forwards and backwards (bytes), the optimizer
        step's transient left out: its in-flight microbatches' stored bytes and the running op's working memory;
        under interleaved 1F1B as torch's order holds them (:func:`rank_activation_peak`)."""
        if self.chunks == 1:
            st = self.stages[rank]
            return st.in_flight_bytes + st.run.working
        return rank_activation_peak(self.devices, self.chunks, self.microbatches, rank,
                                    [st.run for st in self.rank_stages(rank)], self.rank_sent(rank))

    @property
    def peaks(self) -> tuple[int, ...]:
        """Predicted peak device memory per device (bytes): its fixed memory and the larger of its activation
        peak (:meth:`rank_activations`) and the optimizer step's transient."""
        fixed = [self.rank_fixed(r) for r in range(self.devices)]
        return tuple(f + max(self.rank_activations(r), step) for r, (f, step) in enumerate(fixed))

    @property
    def peak(self) -> int:
        return max(self.peaks)

    @property
    def step_time(self) -> float:
        """Predicted seconds per step (M microbatches), from :meth:`simulate`."""
        return self.simulate().step_time

    def transfer_time(self, boundary: int) -> tuple[float, float]:
        """Seconds to send the activation forward and its gradient back across chain boundary ``boundary``."""
        if self.bandwidth is None:
            return 0.0, 0.0
        return self.chain.x[boundary] / self.bandwidth, self.chain.delta_bytes[boundary] / self.bandwidth

    def simulate(self) -> PipelineTrace:
        """Every rank's timeline and memory over one step (cached)."""
        return self._trace

    @cached_property
    def _trace(self) -> PipelineTrace:
        return simulate_pipeline(self)

    def describe(self) -> str:
        v = f" x {self.chunks} chunks" if self.chunks > 1 else ""
        lines = [f"{self.kind} pipeline, {self.devices} devices{v}, {self.microbatches} microbatches ({self.label}): "
                 f"step {format_time(self.step_time)}, peak {format_bytes(self.peak)}"]
        if self.chunks > 1:
            lines.append("  device peaks: " + ", ".join(format_bytes(p) for p in self.peaks) + " (the stages' own "
                         "numbers below count each alone)")
        for s, st in enumerate(self.stages):
            on = f" (device {self.rank_of(s)})" if self.chunks > 1 else ""
            lines.append(f"  stage {s}{on}: {self.chain.names[st.first]} .. {self.chain.names[st.end - 1]} "
                         f"({st.end - st.first} stages), {st.in_flight} in flight, fixed {format_bytes(st.fixed)} + "
                         f"in flight {format_bytes(st.in_flight_bytes)} + working {format_bytes(st.working)} = "
                         f"{format_bytes(st.peak)}; {format_time(st.run.time)} per microbatch "
                         f"({st.schedule.n_recomputed} recomputed forwards)")
        return "\n".join(lines)

    __repr__ = describe


def simulate_pipeline(plan: PipelinePlan) -> PipelineTrace:
    """Replay ``plan``'s step (see :func:`timeline`); memory per rank: fixed, plus the stored activations of the
    microbatches between their forward and backward, plus the running op's own curve from the stage's simulated
    schedule."""
    st = plan.stages
    comm = [plan.transfer_time(s.first) for s in st[1:]]
    args = ([s.run.fwd_time for s in st], [s.run.bwd_time for s in st], [c[0] for c in comm], [c[1] for c in comm],
            [s.run.recompute_time for s in st])
    if plan.kind == "interleaved":
        events = interleaved_timeline(plan.devices, plan.chunks, plan.microbatches, *args)
    else:
        events = timeline(plan.kind, plan.microbatches, *args)
    return PipelineTrace(plan, events, max(evs[-1].end for evs in events))


def interleaved_timeline(devices: int, chunks: int, microbatches: int, fwd: Sequence[float], bwd: Sequence[float],
                         send_fwd: Sequence[float], send_bwd: Sequence[float],
                         recompute: Sequence[float] | None = None) -> tuple[tuple[PipeEvent, ...], ...]:
    """Each rank's events under interleaved 1F1B: rank r runs :func:`interleaved_order`; virtual stage j
    (``fwd[j]``, ``bwd[j]``, on rank ``j % P``) waits as in :func:`timeline`, the transfers at boundary j | j+1 taking
    ``send_fwd[j]`` and ``send_bwd[j]`` (the last device sends to the first between chunks)."""
    P, v, M = devices, chunks, microbatches
    S = P * v
    orders = [interleaved_order(P, v, M, r) for r in range(P)]
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    pos, free = [0] * P, [0.0] * P
    events: list[list[PipeEvent]] = [[] for _ in range(P)]
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                op, c, m = orders[r][pos[r]]
                j = c * P + r
                if op == "F":
                    if j > 0 and (j - 1, m) not in f_end:
                        break
                    ready = f_end[(j - 1, m)] + send_fwd[j - 1] if j > 0 else 0.0
                else:
                    if j < S - 1 and (j + 1, m) not in b_end:
                        break
                    ready = b_end[(j + 1, m)] + send_bwd[j] if j < S - 1 else f_end[(j, m)]
                start = max(free[r], ready)
                end = free[r] = start + (fwd[j] if op == "F" else bwd[j])
                (f_end if op == "F" else b_end)[(j, m)] = end
                rec = recompute[j] if recompute and op == "B" else 0.0
                events[r].append(PipeEvent(r, op, m, start, end, rec, c))
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:  # torch's order respects the data dependencies
            raise RuntimeError("internal error: the interleaved orders deadlock")
    return tuple(tuple(e) for e in events)


def timeline(kind: str, microbatches: int, fwd: Sequence[float], bwd: Sequence[float], send_fwd: Sequence[float],
             send_bwd: Sequence[float], recompute: Sequence[float] | None = None) -> tuple[tuple[PipeEvent, ...], ...]:
    """Each rank's events: rank s runs its ops in :func:`rank_order`, a forward taking ``fwd[s]`` seconds, a
    backward ``bwd[s]``. A forward waits for the previous stage's forward of the same microbatch plus
    ``send_fwd[s-1]`` (the activation crossing boundary s-1 | s), a backward for the next stage's backward plus
    ``send_bwd[s]``; each boundary's link carries its transfers without queueing."""
    P, M = len(fwd), microbatches
    orders = [rank_order(kind, P, M, s) for s in range(P)]
    f_end, b_end = [[0.0] * M for _ in range(P)], [[0.0] * M for _ in range(P)]
    f_done, b_done = [0] * P, [0] * P  # microbatches done, in order (both schedules run them in order)
    pos, free = [0] * P, [0.0] * P
    events: list[list[PipeEvent]] = [[] for _ in range(P)]
    left = 2 * P * M
    while left:
        moved = False
        for s in range(P):
            order = orders[s]
            while pos[s] < len(order):
                kind_, m = order[pos[s]]
                if kind_ == "F":
                    if s > 0 and f_done[s - 1] <= m:
                        break
                    ready = f_end[s - 1][m] + send_fwd[s - 1] if s > 0 else 0.0
                    start = max(free[s], ready)
                    end = f_end[s][m] = start + fwd[s]
                    f_done[s] += 1
                    events[s].append(PipeEvent(s, "F", m, start, end, 0.0))
                else:
                    if s < P - 1 and b_done[s + 1] <= m:
                        break
                    ready = b_end[s + 1][m] + send_bwd[s] if s < P - 1 else 0.0
                    start = max(free[s], ready)
                    end = b_end[s][m] = start + bwd[s]
                    b_done[s] += 1
                    events[s].append(PipeEvent(s, "B", m, start, end, recompute[s] if recompute else 0.0))
                free[s] = end
                pos[s] += 1
                left -= 1
                moved = True
        if not moved:  # cannot happen with rank_order: each rank's order respects the data dependencies
            raise RuntimeError("internal error: the pipeline orders deadlock")
    return tuple(tuple(e) for e in events)


def _rank_memory(stages: Sequence[PipelineStage], fixed_step: tuple[int, int], sent: Sequence[int],
                 events: Sequence[PipeEvent], step: float) -> tuple[np.ndarray, np.ndarray]:
    """(times, bytes) of one rank: each stage trace's memory curve, split at its Loss, laid on each F and B of that
    stage (``e.chunk``), above the stored bytes of every microbatch the rank's stages hold and the ``sent`` bytes
    each backward leaves until the step ends."""
    fixed, step_tmp = fixed_step
    held, done = [0] * len(stages), [0] * len(stages)

    def holding() -> int:
        return fixed + sum(h * st.run.stored for h, st in zip(held, stages)) + sum(d * b for d, b in zip(done, sent))

    ts, ms = [0.0], [fixed]
    for e in events:
        run = stages[e.chunk].run
        fwd_pts, bwd_pts = run.curves
        if e.kind == "F":
            base = holding()
            pts = [(e.start + t, base + m) for t, m in fwd_pts]
            held[e.chunk] += 1
        else:
            base = holding() - run.stored
            pts = [(e.start + t, base + m) for t, m in bwd_pts]
            held[e.chunk] -= 1
            done[e.chunk] += 1
        pts.append((e.end, holding()))
        ts += [t for t, _ in pts]
        ms += [m for _, m in pts]
    ts += [step, step]
    ms += [fixed + step_tmp, fixed]
    return np.asarray(ts, float), np.asarray(ms, np.int64)


# ------------------------------------------------------------------------------------------------ the solver
# Partitions the exact search simulates at most; beyond, it returns the best found (PipelinePlan.exact is False).
_SEARCH_LEAVES = 20_000


class _Candidate:
    """One candidate schedule of a layer range, simulated only when first asked for (:meth:`run`). ``time`` is its
    simulated makespan; ``peak`` its peak activation bytes (for the frontier's breakpoints the budget where the
    answer changes, which is that schedule's exact peak: the least need of any in-flight count). An in-flight
    candidate (``in_flight=True``, one k) is judged by ``peak`` = its need from the DP, at least the simulated one
    (slots are rounded up), so that its simulation waits until it is chosen."""

    __slots__ = ("chain", "schedule", "time", "peak", "_run", "in_flight")

    def __init__(self, chain: Chain, schedule: Schedule, time: float, peak: int, run: StageRun | None = None,
                 in_flight: bool = False) -> None:
        self.chain, self.schedule, self.time, self.peak, self._run = chain, schedule, time, peak, run
        self.in_flight = in_flight

    def run(self) -> StageRun:
        if self._run is None:
            self._run = StageRun.of(self.chain, self.schedule)
        return self._run

    def need(self, k: int) -> int:
        """Activation bytes with ``k`` microbatches in flight, as the planner counts them."""
        return self.peak if self.in_flight else self.run().need(k)

    def simulated(self) -> _Candidate:
        """This candidate with its time and peak from its simulation (a schedule without a predicted makespan)."""
        r = self.run()
        self.time, self.peak = r.time, r.working
        return self


class _Planner:
    """Per-layer-range candidates of one chain, solved once and reused across memory limits and microbatch counts.

    For each range of layers, the candidate schedules of its sub-chain are the breakpoints of its optimal frontier
    (``hcv.solve``), the uniform policies (store-all, full per-layer recomputation) and, for k >= 2 microbatches in
    flight, the breakpoints of :class:`~hchain_viz.core.in_flight.InFlight`'s frontier for k, sorted fastest first.
    Ranges whose sub-chains hold the same numbers (the same blocks at another depth) share them, and a candidate is
    simulated as a :class:`StageRun` only when a memory limit reaches it (its peak bounds every need from below)."""

    def __init__(self, chain: Chain, slots: int) -> None:
        self.chain, self.slots, self._solve = chain, slots, solve
        self.units = split_units(chain)
        self._cands: dict[tuple, list[_Candidate]] = {}
        self._in_flight: dict[tuple, InFlight] = {}
        self._cands_k: dict[tuple, list[_Candidate]] = {}  # (key, k): the candidates for k in flight
        self._chains: dict[tuple[int, int], Chain] = {}
        self._uniform: dict[tuple, tuple[StageRun, StageRun]] = {}

    def span(self, u0: int, u1: int) -> tuple[int, int]:
        return self.units[u0][0], self.units[u1 - 1][1]

    def sub(self, u0: int, u1: int) -> Chain:
        key = (u0, u1)
        if key not in self._chains:
            self._chains[key] = stage_chain(self.chain, *self.span(u0, u1))
        return self._chains[key]

    def _key(self, u0: int, u1: int) -> tuple:
        """What the candidates of layers u0..u1-1 depend on: the sub-chain's numbers, not its names."""
        c = self.sub(u0, u1)
        return tuple(getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in ("names", "groups", "meta")) \
            + (tuple((a, b) for _, a, b in c.groups),)

    def uniform(self, u0: int, u1: int) -> tuple[StageRun, StageRun]:
        """(store-all, full per-layer recomputation) on layers u0..u1-1."""
        key = self._key(u0, u1)
        if key not in self._uniform:
            c = self.sub(u0, u1)
            self._uniform[key] = (StageRun.of(c, store_all(c)),
                                  StageRun.of(c, per_layer(c) if c.groups else recompute_all(c)))
        return self._uniform[key]

    def candidates(self, u0: int, u1: int, k: int = 1) -> list[_Candidate]:
        """The candidates of layers u0..u1-1 for ``k`` microbatches in flight, fastest first (ties: the smaller
        peak)."""
        key = self._key(u0, u1)
        if key not in self._cands:
            c = self.sub(u0, u1)
            sol = self._solve(c, slots=self.slots)
            cands = []
            for b, _ in sol.frontier():
                sched = sol.schedule(b)
                t = sched.meta.get("predicted_makespan")
                cands.append(_Candidate(c, sched, t, b) if t is not None else _Candidate(c, sched, 0.0, b).simulated())
            cands += [_Candidate(c, r.schedule, r.time, r.working, r) for r in self.uniform(u0, u1)]
            self._cands[key] = sorted(cands, key=lambda r: (r.time, r.peak))
        if k == 1:
            return self._cands[key]
        if (key, k) not in self._cands_k:
            if key not in self._in_flight:
                self._in_flight[key] = InFlight(self.sub(u0, u1), self.slots)
            known = {cand.schedule.ops for cand in self._cands[key]}
            more = [_Candidate(self.sub(u0, u1), s, t, need, in_flight=True)
                    for need, t, s in self._in_flight[key].frontier(k) if s.ops not in known]
            self._cands_k[(key, k)] = sorted(self._cands[key] + more, key=lambda r: (r.time, r.peak))
        return self._cands_k[(key, k)]

    def runs(self, u0: int, u1: int, k: int = 1) -> list[StageRun]:
        """Every candidate of layers u0..u1-1 for ``k`` microbatches in flight simulated, fastest first."""
        return [c.run() for c in self.candidates(u0, u1, k)]

    def fixed(self, u0: int, u1: int) -> tuple[int, int]:
        f = self.sub(u0, u1).fixed
        return (0, 0) if f is None else (f.total_per_rank, f.step_tmp_per_rank)

    def best(self, u0: int, u1: int, k: int, limit: int) -> StageRun | None:
        """The fastest candidate of layers u0..u1-1 whose peak with ``k`` microbatches in flight fits ``limit``."""
        fixed, step = self.fixed(u0, u1)
        if fixed + step > limit:
            return None
        room = limit - fixed
        for c in self.candidates(u0, u1, k):
            if c.peak <= room and c.need(k) <= room:  # need(k) >= the peak: no simulation above the room
                return c.run()
        return None

    def least(self, u0: int, u1: int, k: int) -> int:
        """The least device memory any candidate of layers u0..u1-1 needs with ``k`` microbatches in flight."""
        fixed, step = self.fixed(u0, u1)
        least = math.inf
        for c in sorted(self.candidates(u0, u1, k), key=lambda c: c.peak):
            if c.peak >= least:
                break  # every need from here on is at least its peak
            least = min(least, c.need(k))
        return fixed + max(step, least)

    def stage(self, u0: int, u1: int, run: StageRun, k: int) -> PipelineStage:
        fixed, step = self.fixed(u0, u1)
        return PipelineStage(*self.span(u0, u1), self.sub(u0, u1), run, fixed, step, k)


def _check_int(v: Any, name: str, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise InvalidPipeline(f"{name} must be a positive integer ({what}), got {v!r}")
    return int(v)


class Pipeline:
    """Plans for one chain on P devices, reusing the per-stage candidates across memory limits and microbatch
    counts (what the explorer's slider and :func:`fit_pipeline` need). See :func:`plan_pipeline`."""

    def __init__(self, chain: Chain, devices: int, schedule: str = "1F1B", *, bandwidth: float | str | None = None,
                 slots: int = 200, chunks: int | None = None) -> None:
        self.chain = _check_chain(chain)
        self.kind = pipeline_kind(schedule)
        self.devices = _check_int(devices, "devices", "the number of pipeline stages")
        if self.kind == "interleaved":
            self.chunks = 2 if chunks is None else chunks
            check_interleaved(self.devices, self.chunks, self.devices)
        elif chunks not in (None, 1):
            raise InvalidPipeline(f"chunks={chunks!r} (stages per device) needs schedule=\"interleaved\"; "
                                  f"{self.kind} runs one stage per device")
        else:
            self.chunks = 1
        self.bandwidth = None if bandwidth is None else bandwidth_of(bandwidth)
        self._p = _Planner(self.chain, slots)
        self._picks: dict[tuple, tuple[StageRun, ...] | None] = {}
        U = len(self._p.units)
        if self.devices * self.chunks > U:
            what = "layers (chain.groups)" if chain.groups else "stages"
            each = f" x {self.chunks} chunks" if self.chunks > 1 else ""
            raise InvalidPipeline(f"{self.devices * self.chunks} pipeline stages ({self.devices} devices{each}) but "
                                  f"the chain has only {U} {what} to split between them; use at most {U} stages"
                                  + (" (devices x chunks)" if self.chunks > 1 else " (devices)"))

    # ---------------------------------------------------------------- building plans
    def _plan(self, cuts: Sequence[int], M: int, limit: int | None, label: str,
              pick: Any = None) -> PipelinePlan | None:
        """The plan with layer cuts ``cuts`` (0 = c_0 < c_1 < ... < c_P = U); each stage's run from ``pick(u0, u1,
        s)``, by default the fastest that fits ``limit``. None when a stage has none."""
        P, stages = self.devices, []
        for s in range(P):
            u0, u1 = cuts[s], cuts[s + 1]
            k = in_flight(self.kind, P, M, s)
            run = pick(u0, u1, s, k) if pick else self._p.best(u0, u1, k, limit if limit is not None else 2**62)
            if run is None:
                return None
            stages.append(self._p.stage(u0, u1, run, k))
        return PipelinePlan(self.chain, self.kind, M, tuple(stages), self.bandwidth, label, limit)

    def _cost(self, M: int, limit: int) -> list[list[list[float]]]:
        """cost[s][u0][u1]: seconds per microbatch of layers u0..u1-1 as stage s (inf when nothing fits)."""
        P, U = self.devices, len(self._p.units)
        cost = [[[math.inf] * (U + 1) for _ in range(U + 1)] for _ in range(P)]
        for s in range(P):
            k = in_flight(self.kind, P, M, s)
            for u0 in range(s, U - (P - 1 - s)):
                for u1 in range(u0 + 1, U - (P - 2 - s) if s < P - 1 else U + 1):
                    if s == P - 1 and u1 != U:
                        continue
                    r = self._p.best(u0, u1, k, limit)
                    if r is not None:
                        cost[s][u0][u1] = r.time
        return cost

    def _min_sum(self, cost: list, cap: float) -> list[int] | None:
        """Cuts minimising the sum of stage times with every stage at most ``cap`` (``len(cost)`` stages)."""
        P, U = len(cost), len(self._p.units)
        best = [[math.inf] * (U + 1) for _ in range(P + 1)]
        arg = [[-1] * (U + 1) for _ in range(P + 1)]
        best[0][0] = 0.0
        for s in range(P):
            for u1 in range(s + 1, U + 1):
                for u0 in range(s, u1):
                    c = cost[s][u0][u1]
                    if c <= cap and best[s][u0] + c < best[s + 1][u1]:
                        best[s + 1][u1], arg[s + 1][u1] = best[s][u0] + c, u0
        if best[P][U] == math.inf:
            return None
        cuts, u = [U], U
        for s in range(P, 0, -1):
            u = arg[s][u]
            cuts.append(u)
        return cuts[::-1]

    def plan(self, microbatches: int, memory: int | str) -> PipelinePlan:
        """The fastest plan within ``memory`` bytes per device; see :func:`plan_pipeline`.

        A DP over split points (the least total stage time under each bottleneck cap, the cap raised until M
        microbatches through the bottleneck outlast the best step) and the baselines give a first plan; a
        branch-and-bound over partitions, pruned by lower bounds every step time obeys, then makes it the optimum
        of the simulated step time (docs/design.md §12)."""
        M = _check_int(microbatches, "microbatches", "M, the microbatches per step")
        limit = _read_memory(memory)
        if self.kind == "interleaved":
            return self._plan_interleaved(M, limit)
        cost = self._cost(M, limit)
        best: PipelinePlan | None = None
        tried: set[tuple[int, ...]] = set()
        for cap in sorted({c for row in cost for r in row for c in r if c < math.inf}):
            if best is not None and M * cap >= best.step_time:
                break  # every partition left has a stage slower than cap, through which all M microbatches pass
            cuts = self._min_sum(cost, cap)
            if cuts is None or tuple(cuts) in tried:
                continue
            tried.add(tuple(cuts))
            p = self._plan(cuts, M, limit, "optimal")
            if p is not None and (best is None or p.step_time < best.step_time):
                best = p
        if best is None:
            raise self._does_not_fit(M, limit)
        for base in self.baselines(M, limit).values():
            if base is not None and base.step_time < best.step_time:
                best = base
        cuts, exact = self._search(cost, M, limit, best.step_time)
        if cuts is not None:
            best = self._plan(cuts, M, limit, "optimal")
        return dataclasses.replace(best, label="optimal", exact=exact)

    def _search(self, cost: list, M: int, limit: int, incumbent: float) -> tuple[list[int] | None, bool]:
        """Cuts of a plan faster than ``incumbent`` seconds if any (None otherwise), and whether the search was
        complete. Depth-first over stage ends; a partial partition is dropped when a lower bound reaches the best
        step so far: for each placed stage s, the forwards before it, its M microbatches and the backwards after
        it (sum of F_j + B_j over j < s, plus M(F_s + B_s), plus transfers); and one microbatch's path through
        every stage (placed ones, plus the least total time of the rest)."""
        P, U, units = self.devices, len(self._p.units), self._p.units
        comm_f, comm_b = [0.0] * (U + 1), [0.0] * (U + 1)  # transfer times at the cut before unit u
        if self.bandwidth is not None:
            for u in range(1, U):
                comm_f[u] = self.chain.x[units[u][0]] / self.bandwidth
                comm_b[u] = self.chain.delta_bytes[units[u][0]] / self.bandwidth
        rest = [[math.inf] * (U + 1) for _ in range(P + 1)]  # least total time of units u.. as stages s..
        rest[P][U] = 0.0
        for s in range(P - 1, -1, -1):
            for u0 in range(U):
                rest[s][u0] = min((cost[s][u0][u1] + comm_f[u1] + comm_b[u1] * (u1 < U) + rest[s + 1][u1]
                                   for u1 in range(u0 + 1, U + 1)), default=math.inf)
        runs: dict[tuple[int, int, int], StageRun] = {}

        def run(s: int, u0: int, u1: int) -> StageRun:
            if (s, u0, u1) not in runs:
                runs[(s, u0, u1)] = self._p.best(u0, u1, in_flight(self.kind, P, M, s), limit)
            return runs[(s, u0, u1)]

        best, found, leaves = incumbent * (1 - 1e-12), None, 0
        cuts = [0]
        fwd: list[float] = []
        bwd: list[float] = []

        def dfs(s: int, u0: int, before: float) -> None:  # before: F + B + transfers of the placed stages
            nonlocal best, found, leaves
            ends = [U] if s == P - 1 else range(u0 + 1, U - (P - 1 - s) + 1)
            for u1 in ends:
                t = cost[s][u0][u1]
                if t == math.inf or leaves >= _SEARCH_LEAVES:
                    continue
                if max(before + M * t, before + t + rest[s + 1][u1] + comm_f[u1] + comm_b[u1]) >= best:
                    continue
                r = run(s, u0, u1)
                cuts.append(u1)
                fwd.append(r.fwd_time)
                bwd.append(r.bwd_time)
                if s == P - 1:
                    leaves += 1
                    cf = [comm_f[u] for u in cuts[1:-1]]
                    cb = [comm_b[u] for u in cuts[1:-1]]
                    step = max(evs[-1].end for evs in timeline(self.kind, M, fwd, bwd, cf, cb))
                    if step < best:
                        best, found = step * (1 - 1e-12), list(cuts)
                else:
                    dfs(s + 1, u1, before + t + comm_f[u1] + comm_b[u1])
                cuts.pop()
                fwd.pop()
                bwd.pop()

        dfs(0, 0, 0.0)
        return found, leaves < _SEARCH_LEAVES

    def _cuts(self, plan: PipelinePlan) -> list[int]:
        firsts = [u0 for u0, _ in self._p.units]
        return [firsts.index(st.first) for st in plan.stages] + [len(firsts)]

    def balanced_cuts(self) -> list[int]:
        """Cuts minimising the slowest stage's store-all time (ties: the smaller sum), as time-balanced
        partitioners do (``devices * chunks`` stages)."""
        P, U = self.devices * self.chunks, len(self._p.units)
        t = [0.0]
        for a, b in self._p.units:
            t.append(t[-1] + sum(self.chain.fwd_time[a:b]) + sum(self.chain.bwd_time[a:b]))
        cost = [[[t[u1] - t[u0] if u0 < u1 else math.inf for u1 in range(U + 1)] for u0 in range(U + 1)]
                for _ in range(P)]
        for cap in sorted({t[u1] - t[u0] for u0 in range(U) for u1 in range(u0 + 1, U + 1)}):
            cuts = self._min_sum(cost, cap)
            if cuts:
                return cuts
        raise AssertionError("unreachable: one stage per layer always fits some cap")

    def baselines(self, microbatches: int, memory: int | str) -> dict[str, PipelinePlan | None]:
        """``"balanced+uniform"``: the time-balanced partition with the same checkpointing on every stage (none where
        that fits on every stage, else full per-layer recomputation everywhere); ``"balanced+per-stage"``: the same
        partition with each stage's fastest schedule that fits. None where it does not fit."""
        M, limit = _check_int(microbatches, "microbatches", "M"), _read_memory(memory)
        cuts = self.balanced_cuts()
        if self.kind == "interleaved":
            return self._baselines_interleaved(cuts, M, limit)
        out: dict[str, PipelinePlan | None] = {}
        for n, name in ((0, "store-all"), (1, "recomputation")):
            def pick(u0: int, u1: int, s: int, k: int, n: int = n) -> StageRun | None:
                run = self._p.uniform(u0, u1)[n]
                return run if self._p.fixed(u0, u1)[0] + max(run.need(k), self._p.fixed(u0, u1)[1]) <= limit \
                    else None
            p = self._plan(cuts, M, limit, f"balanced+uniform ({name})", pick)
            if p is not None:
                out["balanced+uniform"] = p
                break
        out.setdefault("balanced+uniform", None)
        out["balanced+per-stage"] = self._plan(cuts, M, limit, "balanced+per-stage")
        return out

    def least_memory(self, microbatches: int, bounds: Sequence[int] | None = None) -> int:
        """The least per-device memory (bytes) in which some plan fits, with ``microbatches`` microbatches; with
        ``bounds`` (each stage's first chain stage, as :attr:`PipelinePlan.bounds`), for that partition only."""
        M = _check_int(microbatches, "microbatches", "M")
        P, U = self.devices, len(self._p.units)
        if self.kind == "interleaved":
            return self._least_interleaved(M, bounds)
        if bounds is not None:
            firsts = [u0 for u0, _ in self._p.units]
            cuts = [firsts.index(b) for b in bounds] + [U]
            return max(self._p.least(cuts[s], cuts[s + 1], in_flight(self.kind, P, M, s)) for s in range(P))
        best = [[math.inf] * (U + 1) for _ in range(P + 1)]
        best[0][0] = 0
        for s in range(P):
            k = in_flight(self.kind, P, M, s)
            for u1 in range(s + 1, U + 1 if s == P - 1 else U - (P - 1 - s) + 1):
                if s == P - 1 and u1 != U:
                    continue
                for u0 in range(s, u1):
                    if best[s][u0] < math.inf:
                        best[s + 1][u1] = min(best[s + 1][u1], max(best[s][u0], self._p.least(u0, u1, k)))
        return int(best[P][U])

    # ---------------------------------------------------------------- interleaved 1F1B
    def _rank_fixed(self, ranges: Sequence[tuple[int, int]]) -> tuple[int, int]:
        fs = [self._fixed(*g) for g in ranges]
        ws = self.chain.fixed.workspace if self.chain.fixed is not None else 0
        return sum(f for f, _ in fs) - (len(fs) - 1) * ws, sum(t for _, t in fs)

    def _fixed(self, u0: int, u1: int) -> tuple[int, int]:
        """The planner's fixed memory and step transient of layers u0..u1-1, kept (the searches ask often)."""
        key = ("fixed", u0, u1)
        if key not in self._picks:
            self._picks[key] = self._p.fixed(u0, u1)
        return self._picks[key]

    def _rows(self, rank: int, M: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Device ``rank``'s activation peak (:func:`rank_activation_peak`) as the largest of linear forms, one per
        state of its order before an op: ``(held, done, rise)``, held and done ``(R, v)`` microbatch counts per
        chunk, rise ``c`` for a forward of chunk c, ``v + c`` for a backward, -1 for the step's end (M done each).
        A state holding and having done no more than another of the same rise is left out: its value is never the
        larger, every byte count being >= 0 (cached)."""
        key = ("rows", rank, M)
        if key not in self._picks:
            v = self.chunks
            model = _interleaved_model(self.devices, v, M, rank)
            states = {(c if op == "F" else v + c, held, done)
                      for (op, c, _), held, done in zip(model.ops, model.held, model.done)}
            states.add((-1, (0,) * v, (M,) * v))
            kept = sorted(s for s in states if not any(
                o != s and o[0] == s[0] and all(a >= b for a, b in zip(o[1] + o[2], s[1] + s[2])) for o in states))
            self._picks[key] = (np.array([s[1] for s in kept], np.int64), np.array([s[2] for s in kept], np.int64),
                                np.array([s[0] for s in kept]))
        return self._picks[key]

    def _shapes(self, g: tuple[int, int]) -> tuple[list[StageRun], np.ndarray, np.ndarray]:
        """Layers ``g``'s candidates (fastest first), their times, and each one's ``(stored, forward peak, backward
        rise)``, the three numbers a device's peak grows with (cached)."""
        key = ("shapes", g)
        if key not in self._picks:
            runs = self._p.runs(*g)
            q = np.array([(r.stored, r.fwd_peak, r.bwd_peak - r.stored) for r in runs], np.int64).reshape(-1, 3)
            self._picks[key] = (runs, np.array([r.time for r in runs], float), q)
        return self._picks[key]

    def _terms(self, g: tuple[int, int], c: int, rank: int, M: int) -> tuple[list[StageRun], np.ndarray, np.ndarray]:
        """Layers ``g`` as chunk c of device ``rank``: its candidates (fastest first), their times, and each one's
        part of every row of :meth:`_rows` ``(R, n)``: its held microbatches' stored bytes, its sent bytes per
        backward done, and the running op's rise when the row's op is its own (cached)."""
        key = ("terms", g, c, rank, M)
        if key not in self._picks:
            P, v = self.devices, self.chunks
            held, done, rise = self._rows(rank, M)
            runs, times, q = self._shapes(g)
            sent = sent_bytes(self.chain, *self._p.span(*g), c * P + rank, P * v)
            terms = (held[:, c:c + 1] * q[:, 0] + (rise == c)[:, None] * q[:, 1] + (rise == v + c)[:, None] * q[:, 2]
                     + done[:, c:c + 1] * sent)
            self._picks[key] = (runs, times, terms)
        return self._picks[key]

    def _front(self, g: tuple[int, int], faster: bool) -> np.ndarray:
        """Indices of layers ``g``'s candidates that no other beats: one beats another when its stored bytes,
        forward peak and backward rise are none larger (every row grows with them) and, with ``faster``, it comes
        first and is no slower (so it also wins the ties of :meth:`rank_pick`); equal ones keep the first (cached)."""
        key = ("front", g, faster)
        if key not in self._picks:
            runs, t, q = self._shapes(g)
            n = np.arange(len(runs))
            le = (q[:, None, :] <= q[None, :, :]).all(axis=2)  # [a, b]: a none larger than b
            first = n[:, None] < n[None, :]
            beats = le & first & (t[:, None] <= t[None, :]) if faster else \
                le & (first | ~(q[:, None, :] == q[None, :, :]).all(axis=2))
            self._picks[key] = np.flatnonzero(~beats.any(axis=0))
        return self._picks[key]

    def _rank_part(self, parts: tuple[tuple[int, int] | None, ...], rank: int, M: int, cap: float = math.inf) -> int:
        """The least memory device ``rank`` needs with its chunks on ``parts`` (None: not placed yet), a lower bound
        while some are not: their bytes are left out, with the rows of their backwards, whose rise may be below 0.
        When the fixed memory and step transient alone reach ``cap``, their sum (a lower bound, not cached)."""
        key = ("least", parts, rank, M)
        if key in self._picks:
            return self._picks[key]
        placed = [c for c, g in enumerate(parts) if g is not None]
        fixed, step = self._rank_fixed([parts[c] for c in placed])
        if fixed + step >= cap:
            return fixed + step
        held, done, rise = self._rows(rank, M)
        rows = ~np.isin(rise, [self.chunks + c for c, g in enumerate(parts) if g is None])
        total = np.zeros((int(rows.sum()),) + (1,) * len(placed), np.int64)
        for n, c in enumerate(placed):
            terms = self._terms(parts[c], c, rank, M)[2][rows][:, self._front(parts[c], False)]
            total = total + terms.reshape(terms.shape[:1] + (1,) * n + terms.shape[1:] + (1,) * (len(placed) - n - 1))
        self._picks[key] = fixed + max(step, int(total.max(axis=0).min()))
        return self._picks[key]

    def rank_pick(self, ranges: Sequence[tuple[int, int]], rank: int, M: int,
                  limit: int) -> tuple[StageRun, ...] | None:
        """Device ``rank``'s schedules for its chunks on layer ranges ``ranges`` under interleaved 1F1B: of every
        choice of one candidate per chunk whose device peak fits ``limit``, the least total time (ties: the smaller
        peak, then the candidates' order). None when none fits.

        A depth-first search over the chunks (v >= 2), the last two's candidates paired at once, fastest first;
        it skips the candidates another beats (:meth:`_front`) or that cannot fit beside the least of the others,
        and the branches that cannot fit or be faster than the best so far."""
        ranges = tuple(ranges)
        key = ("pick", ranges, rank, M, limit)
        if key not in self._picks:
            self._picks[key] = self._pick(ranges, rank, M, limit)
        return self._picks[key]

    def _pick(self, ranges: tuple[tuple[int, int], ...], rank: int, M: int, limit: int) -> tuple[StageRun, ...] | None:
        fixed, step = self._rank_fixed(ranges)
        room, v = limit - fixed, len(ranges)
        if step > room:
            return None
        full = [self._terms(g, c, rank, M) for c, g in enumerate(ranges)]
        low = [terms.min(axis=1) for _, _, terms in full]  # per row, the least any candidate of the chunk adds
        lists = []
        for c, (_, times, terms) in enumerate(full):
            idx = self._front(ranges[c], True)
            idx = idx[(terms[:, idx] + (sum(low) - low[c])[:, None]).max(axis=0) <= room]
            if not len(idx):
                return None
            idx = idx[np.argsort(times[idx], kind="stable")]  # fastest first
            lists.append((idx, times[idx], terms[:, idx]))
        low_after = [np.zeros_like(low[0])] * (v + 1)  # per row, the least the chunks after c add
        for c in range(v - 1, -1, -1):
            low_after[c] = low_after[c + 1] + lists[c][2].min(axis=1)
        best: tuple | None = None  # (total time, peak, the candidates' indices)

        def dfs(c: int, acc: np.ndarray, t: float, chosen: tuple[int, ...]) -> None:
            nonlocal best
            idx, times, terms = lists[c]
            total = t + times  # the same sums, in the same order, as sum(r.time for r in runs)
            bound = total
            for d in range(c + 1, v):
                bound = bound + lists[d][1][0]
            held = acc[:, None] + terms
            ok = np.flatnonzero((held + low_after[c + 1][:, None] <= room).all(axis=0))
            if best is not None:
                ok = ok[bound[ok] <= best[0]]
            if c == v - 2:  # the last two chunks at once: every pair of their candidates
                idx2, times2, terms2 = lists[v - 1]
                acts = (held[:, ok, None] + terms2[:, None, :]).max(axis=0)
                a, b = np.nonzero(acts <= room)
                if len(a):
                    tt, peaks = total[ok][a] + times2[b], fixed + np.maximum(step, acts[a, b])
                    j = np.lexsort((idx2[b], idx[ok][a], peaks, tt))[0]
                    got = (float(tt[j]), int(peaks[j]), chosen + (int(idx[ok][a[j]]), int(idx2[b[j]])))
                    best = got if best is None or got < best else best
                return
            for n in ok:
                if best is not None and bound[n] > best[0]:
                    break  # the bounds grow with the times
                dfs(c + 1, held[:, n], total[n], chosen + (int(idx[n]),))

        dfs(0, np.zeros_like(low[0]), 0.0, ())
        return None if best is None else tuple(full[c][0][i] for c, i in enumerate(best[2]))

    def _interleaved_plan(self, cuts: Sequence[int], M: int, limit: int | None, label: str,
                          picks: Sequence[Sequence[StageRun] | None] | None = None) -> PipelinePlan | None:
        """The plan with chunk cuts ``cuts`` (v·P + 1 of them); each device's runs from ``picks[rank]``, by default
        :meth:`rank_pick`. None when a device has none."""
        P, v = self.devices, self.chunks
        runs: dict[int, StageRun] = {}
        for r in range(P):
            ranges = tuple((cuts[c * P + r], cuts[c * P + r + 1]) for c in range(v))
            pick = picks[r] if picks is not None else self.rank_pick(ranges, r, M, limit if limit is not None
                                                                     else 2**62)
            if pick is None:
                return None
            for c, run in enumerate(pick):
                runs[c * P + r] = run
        stages = tuple(self._p.stage(cuts[j], cuts[j + 1], runs[j], in_flight("interleaved", P, M, j, v))
                       for j in range(P * v))
        return PipelinePlan(self.chain, self.kind, M, stages, self.bandwidth, label, limit, chunks=v)

    def _plan_interleaved(self, M: int, limit: int) -> PipelinePlan:
        """The fastest interleaved plan: a depth-first search over the v·P - 1 cuts, each device's chunks given
        :meth:`rank_pick`'s schedules, scored by the simulated step; pruned by lower bounds (a device runs M forwards
        and backwards of each of its chunks, each at least its fastest candidate's time, or once its chunks are all
        placed, its pick's; one microbatch passes through every placed chunk) and by the devices' memory (what its
        placed chunks need at least, :meth:`_rank_part`). Starts from the baselines, so never slower."""
        P, v, U, p = self.devices, self.chunks, len(self._p.units), self._p
        S = P * v
        interleaved_order(P, v, M, 0)  # torch's rules on M, before any work
        best_plan = None
        for base in self._baselines_interleaved(self.balanced_cuts(), M, limit).values():
            if base is not None and (best_plan is None or base.step_time < best_plan.step_time):
                best_plan = base
        best = best_plan.step_time * (1 - 1e-12) if best_plan is not None else math.inf
        comm_f, comm_b = [0.0] * (U + 1), [0.0] * (U + 1)
        if self.bandwidth is not None:
            for u in range(1, U):
                comm_f[u] = self.chain.x[p.units[u][0]] / self.bandwidth
                comm_b[u] = self.chain.delta_bytes[p.units[u][0]] / self.bandwidth
        tmin: dict[tuple[int, int], float] = {}

        def fastest(u0: int, u1: int) -> float:
            if (u0, u1) not in tmin:
                tmin[(u0, u1)] = min(r.time for r in p.runs(u0, u1))
            return tmin[(u0, u1)]

        cuts, busy, fixed, start = [0], [0.0] * P, [0] * P, [0.0] * P
        compute = [0.0]  # per unit boundary: every op's time once, from the first layer, rounded down a little
        for a, b in p.units:
            compute.append(compute[-1] + math.fsum(self.chain.fwd_time[a:b]) + math.fsum(self.chain.bwd_time[a:b]))
        compute = [x * (1 - 1e-9) for x in compute]
        fs, lo, shared = self._fixed_lows()
        placed = [0]  # the placed chunks' fixed memory and step transients
        parts: list[list[tuple[int, int] | None]] = [[None] * v for _ in range(P)]
        found, leaves = None, 0
        ws = self.chain.fixed.workspace if self.chain.fixed is not None else 0  # counted once per device

        def dfs(j: int, u0: int, path: float) -> None:
            nonlocal best, found, leaves
            r, c = j % P, j // P
            for u1 in ([U] if j == S - 1 else range(u0 + 1, U - (S - 1 - j) + 1)):
                if leaves >= _SEARCH_LEAVES:
                    break
                f = (self._fixed(u0, u1)[0] - (ws if j >= P else 0), self._fixed(u0, u1)[1])
                if fixed[r] + f[0] + f[1] > limit or placed[0] + fs[u0][u1] + lo[j + 1][u1] - shared > P * limit:
                    continue
                head = path if c == 0 else start[r]  # before the device's first forward: chunk 0 of those before
                t = compute[u1] - compute[u0]  # no schedule is faster than its ops once each (before solving)
                if max(head + M * (busy[r] + t), path + t) >= best:
                    continue
                parts[r][c] = (u0, u1)
                if self._rank_part(tuple(parts[r]), r, M, limit + 1) > limit:
                    continue  # no choice of candidates fits this device
                t = fastest(u0, u1)
                if max(head + M * (busy[r] + t), path + t) >= best:
                    continue
                if c == v - 1:  # the device's chunks are all placed: its pick's times
                    pick = self.rank_pick(tuple(parts[r]), r, M, limit)
                    if pick is None or head + M * sum(run.time for run in pick) >= best:
                        continue
                if c == 0:
                    start[r] = path
                cuts.append(u1)
                busy[r] += t
                fixed[r] += f[0]
                placed[0] += fs[u0][u1]
                if j == S - 1:
                    leaves += 1
                    plan = self._interleaved_plan(cuts, M, limit, "optimal")
                    if plan is not None and plan.step_time < best:
                        best, found = plan.step_time * (1 - 1e-12), plan
                else:
                    dfs(j + 1, u1, path + t + comm_f[u1] + comm_b[u1])
                cuts.pop()
                busy[r] -= t
                fixed[r] -= f[0]
                placed[0] -= fs[u0][u1]
            parts[r][c] = None

        dfs(0, 0, 0.0)
        best_plan = found or best_plan
        if best_plan is None:
            raise self._does_not_fit(M, limit)
        return dataclasses.replace(best_plan, label="optimal", exact=leaves < _SEARCH_LEAVES)

    def _baselines_interleaved(self, cuts: list[int], M: int, limit: int) -> dict[str, PipelinePlan | None]:
        P, v = self.devices, self.chunks
        out: dict[str, PipelinePlan | None] = {}
        for n, name in ((0, "store-all"), (1, "recomputation")):
            picks = [tuple(self._p.uniform(cuts[c * P + r], cuts[c * P + r + 1])[n] for c in range(v))
                     for r in range(P)]
            plan = self._interleaved_plan(cuts, M, limit, f"balanced+uniform ({name})", picks)
            if plan.peak <= limit:
                out["balanced+uniform"] = plan
                break
        out.setdefault("balanced+uniform", None)
        out["balanced+per-stage"] = self._interleaved_plan(cuts, M, limit, "balanced+per-stage")
        return out

    def _fixed_lows(self) -> tuple[list[list[int]], list[list[float]], int]:
        """(each layer range's fixed memory plus step transient, ``lo[j][u]``: the least sum of those over the
        partitions of layers u.. into chunks j.., what the devices' sum leaves out: their workspaces counted once).
        The devices' needs add up to at least the sum over every chunk, less that, so the largest is at least its
        P-th part: a bound on what the chunks still to place add (cached)."""
        key = ("fixed lows",)
        if key not in self._picks:
            P, v, U = self.devices, self.chunks, len(self._p.units)
            S = P * v
            fs = [[sum(self._fixed(u0, u1)) if u0 < u1 else 0 for u1 in range(U + 1)] for u0 in range(U + 1)]
            lo = [[math.inf] * (U + 1) for _ in range(S + 1)]
            lo[S][U] = 0
            for j in range(S - 1, -1, -1):
                for u0 in range(j, U - (S - 1 - j)):
                    ends = [U] if j == S - 1 else range(u0 + 1, U - (S - 1 - j) + 1)
                    lo[j][u0] = min(fs[u0][u1] + lo[j + 1][u1] for u1 in ends)
            ws = self.chain.fixed.workspace if self.chain.fixed is not None else 0
            self._picks[key] = (fs, lo, P * (v - 1) * ws)
        return self._picks[key]

    def _least_interleaved(self, M: int, bounds: Sequence[int] | None) -> int:
        """The least device memory over every partition (or the one whose stages start at ``bounds``): the most any
        device needs with its least-memory choice of candidates (:meth:`_rank_part`).

        A depth-first search over the cuts from the time-balanced partition's need, a branch dropped when a lower
        bound reaches the best: what each device's placed chunks need (:meth:`_rank_part`), and the P-th part of
        the fixed memory of all chunks, the ones to place at their least (:meth:`_fixed_lows`)."""
        P, v, U = self.devices, self.chunks, len(self._p.units)
        S = P * v
        interleaved_order(P, v, M, 0)

        def need(cuts: Sequence[int]) -> int:
            return max(self._rank_part(tuple((cuts[c * P + r], cuts[c * P + r + 1]) for c in range(v)), r, M)
                       for r in range(P))

        if bounds is not None:
            firsts = [u0 for u0, _ in self._p.units]
            return need([firsts.index(b) for b in bounds] + [U])
        best = need(self.balanced_cuts())
        fs, lo, shared = self._fixed_lows()
        parts: list[list[tuple[int, int] | None]] = [[None] * v for _ in range(P)]
        held = [0] * P  # each device's lower bound from its placed chunks

        def dfs(j: int, u0: int, placed: int) -> None:
            nonlocal best
            r, c = j % P, j // P
            for u1 in ([U] if j == S - 1 else range(u0 + 1, U - (S - 1 - j) + 1)):
                if -(-(placed + fs[u0][u1] + lo[j + 1][u1] - shared) // P) >= best:
                    continue
                parts[r][c] = (u0, u1)
                n = self._rank_part(tuple(parts[r]), r, M, best)
                if n >= best or max(held) >= best:
                    continue
                if j == S - 1:  # every device complete: n and held are their exact needs
                    best = max(max(held), n)
                    continue
                old, held[r] = held[r], n
                dfs(j + 1, u1, placed + fs[u0][u1])
                held[r] = old
            parts[r][c] = None

        dfs(0, 0, 0)
        return int(best)

    def _does_not_fit(self, M: int, limit: int) -> PipelineDoesNotFit:
        least = self.least_memory(M)
        hint = " or fewer microbatches (GPipe holds all of them)" if self.kind == "GPipe" else ""
        return PipelineDoesNotFit(
            f"no {self.kind} plan on {self.devices} devices with {M} microbatches fits {limit} B "
            f"({format_bytes(limit)}) per device; the least per-device memory for this P and M is {least} B "
            f"({format_bytes(least)}). Give at least that, more devices{hint}", min_budget=least, budget=limit)


def _read_memory(memory: Any) -> int:
    try:
        return parse_bytes(memory)
    except HChainError:
        raise InvalidPipeline(f"cannot read the per-device memory {memory!r}; give bytes or text like '24GiB'") \
            from None


def plan_pipeline(chain: Chain, devices: int, microbatches: int, memory: int | str, schedule: str = "1F1B", *,
                  bandwidth: float | str | None = None, slots: int = 200, chunks: int | None = None) -> PipelinePlan:
    """The partition into ``devices`` stages and the per-stage schedules with the least predicted step time.

    Args:
        chain: the model at the microbatch size (its ``fixed`` part, when set, is split over the stages).
        devices: P, the pipeline stages, one per device. microbatches: M per step.
        memory: per-device memory limit (bytes or text like ``"24GiB"``), no margin taken off.
        schedule: ``"1F1B"``, ``"GPipe"`` or ``"interleaved"`` (torch's ``ScheduleInterleaved1F1B``, ``chunks``
            stages per device, default 2). bandwidth: the link between neighbouring devices, bytes/s each way or a
            preset name (None: free transfers). slots: the per-stage solver's resolution.
    Returns:
        a :class:`PipelinePlan` never slower in prediction than :func:`baseline_plans`' that fit.
    Raises:
        InvalidPipeline (more devices than layers, an unknown schedule, bad numbers); PipelineDoesNotFit with the
        least per-device memory for this P and M. See docs/design.md §12.
    """
    return Pipeline(chain, devices, schedule, bandwidth=bandwidth, slots=slots, chunks=chunks).plan(microbatches,
                                                                                                    memory)


def baseline_plans(chain: Chain, devices: int, microbatches: int, memory: int | str, schedule: str = "1F1B", *,
                   bandwidth: float | str | None = None, slots: int = 200,
                   chunks: int | None = None) -> dict[str, PipelinePlan | None]:
    """The two baselines of :func:`plan_pipeline` (see :meth:`Pipeline.baselines`); None where one does not fit."""
    return Pipeline(chain, devices, schedule, bandwidth=bandwidth, slots=slots, chunks=chunks).baselines(
        microbatches, memory)


class FitAnswer(NamedTuple):
    """Per microbatch count tried: the plan (None where nothing fits) and the least per-device memory it needs."""

    microbatches: int
    plan: PipelinePlan | None
    least_memory: int


def fit_pipeline(chain: Chain, devices: int, memory: int | str, microbatches: Sequence[int] = (1, 2, 4, 8, 16),
                 schedule: str = "1F1B", *, bandwidth: float | str | None = None,
                 slots: int = 200, chunks: int | None = None) -> list[FitAnswer]:
    """Does a step fit on ``devices`` devices at all, and with which microbatch counts: one :class:`FitAnswer` per
    count in ``microbatches`` (each microbatch is the chain's batch). The fastest per sample is the fitting answer
    with the least ``plan.step_time / microbatches``. Raises InvalidPipeline for bad input."""
    pipe = Pipeline(chain, devices, schedule, bandwidth=bandwidth, slots=slots, chunks=chunks)
    limit = _read_memory(memory)
    out = []
    for M in microbatches:
        M = _check_int(M, "microbatches", "each a microbatch count")
        least = pipe.least_memory(M)
        out.append(FitAnswer(M, pipe.plan(M, limit) if least <= limit else None, least))
    return out
