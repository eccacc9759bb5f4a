"""The one memory and time model: replay a schedule on a chain, op by op (docs/design.md §3, §9.1).

``simulate(chain, schedule)`` is the ground truth every strategy is scored by and the solver is checked against.
It returns a :class:`Trace` with, per op, its start and end time, memory before / at its peak / after, and which
items are resident, so figures never recompute memory themselves. The resident items' kinds and transfers:
NOTE [resident items], NOTE [transfers].

Checkpoints persist: once ``Fck(k)`` has kept x_k, only ``B(k)`` frees it. This is the class of schedules the
optimal DP searches (Rotor's model), which keeps "optimal" exact here; dropping a kept checkpoint early is outside
the model (docs/design.md §3.5; tests/test_solver.py::test_non_persistent_schedules_are_outside_the_model).
"""

# NOTE [resident items] (Item.kind):
# - "x": a plain activation x_i (a checkpoint, or the input of the next no-grad forward). x_0 is the caller's input,
#   resident for the whole step.
# - "xbar": x̄_{i+1}, what Fall(i) leaves (the output plus autograd's saved tensors).
# - "out": the network output x_L, held by the caller from its first computation to the end of the step. When the
#   first forward of stage L-1 is a Fall, the output lives inside x̄_L, so that xbar item carries only
#   xbar[L-1] - x[L] bytes beside it; a recomputed Fall(L-1) holds a full second copy.
# - "delta": a gradient δ_i (chain.delta_bytes[i] bytes, x[i] unless profiled); δ_L is created by the loss. B(i)
#   peaks at δ_i's bytes less chain.delta_through[i] (the tensors of δ_{i+1} it hands on unchanged, which become
#   part of δ_i as δ_{i+1} goes) plus its transient.
# - "transit": the part of x_i no backward needs (chain.transit[i]). It comes with the value that holds x_i (a plain
#   x, or the xbar of stage i-1, which carry it less) and goes after Fall(i), the last forward of stage i before B(i)
#   (no forward of i can run between them), or with its holder if that goes first.
# - "consumed": the part of x_i that B(i) needs and B(i-1) does not (chain.consumed[i]). It comes with its holder as
#   the transit part does and goes after B(i) (or with its holder): it matters when x_i is the output inside x̄_i,
#   which stays until B(i-1). Schedules with transfers keep transit and consumed bytes with their holder (the
#   executor moves whole values).
# - "shared": one copy of a tensor that several cuts share (chain.shared, docs/design.md §8: the residual stream
#   inside a layer), stage = the first cut that holds it. Resident while any value holds it; those values leave its
#   bytes out of their own size, so it is counted once. A forward passes its input's copy on to its output; a
#   (re)computation of the stage that makes the tensor makes a new copy. δ's never share. An offloaded value keeps
#   its hold on a shared copy, which stays on the device (a conservative rule for transfers).
#
# NOTE [transfers] (docs/design.md §9.1): Off(i) / Pre(i) run on a transfer channel beside the compute stream, at
# chain.bandwidth bytes/s, one channel each way. Compute ops run in schedule order on the compute stream; transfers
# run in schedule order on their channel and start no earlier than the end of the compute op listed before them (where
# the executor records the event the copy stream waits for). Off(i) moves x̄_{i+1} (left by Fall(i)), else the
# checkpoint x_i kept by Fck(i); its device bytes are freed when the copy completes. Pre(i) brings it back; its
# device bytes are allocated when the copy starts, and a compute op that needs the value waits for the copy (an idle
# wait, recorded in Trace.idle). Between Off(i) and Pre(i) no compute op may use the value. Memory is replayed as a
# time-ordered list of changes (ties in schedule order; a completed offload frees before anything else happens at
# that instant), so a schedule without transfers gives exactly the sequential numbers.

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from ..errors import InvalidSchedule
from .chain import Chain
from .schedule import Op, Schedule
from .units import format_bytes, format_time

_PARTS = ("transit", "consumed")  # parts of a value x_i freed before the value itself (chain.transit, chain.consumed)


class Item(NamedTuple):
    """A resident piece of memory: ``kind`` in ``x, xbar, out, delta, transit, consumed, shared``, the ``stage``
    index, its ``size`` in bytes."""

    kind: str
    stage: int
    size: int


class Lifetime(NamedTuple):
    """One resident item from the op that created it to the op that freed it.

    ``created`` is the index of the creating op (-1 for x_0, resident before the first op); ``freed`` the index of the
    op after which it is gone, or ``None`` when it is still resident at the end of the step.
    """

    kind: str
    stage: int
    size: int
    created: int
    freed: int | None


@dataclass(frozen=True, eq=False)
class Event:
    """One simulated op. Memory in bytes, times in seconds; ``resident`` is the state after the op."""

    index: int
    op: Op
    start: float
    end: float
    mem_before: int
    mem_peak: int
    mem_after: int
    recompute: bool  # a forward of a stage that was already run forward earlier in the step
    # For a transfer (Off/Pre), start/end are the copy on its channel; memory is just before / after its own change
    # of device memory (the free at an Off's completion, the allocation at a Pre's start).
    _lifetimes: tuple[Lifetime, ...] = field(repr=False, default=())

    @property
    def resident(self) -> tuple[Item, ...]:
        """Items resident after this op, in order of creation (derived from the trace's lifetimes on demand)."""
        k = self.index
        return tuple(Item(lt.kind, lt.stage, lt.size) for lt in self._lifetimes
                     if lt.created <= k and (lt.freed is None or lt.freed > k))

    @property
    def is_transfer(self) -> bool:
        """An ``Off`` or ``Pre`` (transfer channel), not a compute op."""
        return self.op.is_transfer


class Idle(NamedTuple):
    """The compute stream waiting from ``start`` to ``end`` (seconds) before op ``index`` for a prefetch of
    ``stage`` to complete."""

    start: float
    end: float
    index: int
    stage: int


@dataclass(frozen=True)
class Trace:
    """The simulated run of ``schedule`` on ``chain``: one :class:`Event` per op. ``peak_memory`` counts activations;
    the whole step with the chain's fixed part is :func:`hchain_viz.core.device.device_peak` (docs/design.md §7)."""

    chain: Chain
    schedule: Schedule
    events: tuple[Event, ...]
    initial_memory: int  # x_0, resident before the first op
    lifetimes: tuple[Lifetime, ...]  # every item that was ever resident, in order of creation
    # Transfers only (empty for a remat-only schedule): compute idle waits; host-resident values (``created``: the
    # Off's op index, ``freed``: the Pre's); the device memory curve as (time, bytes) after each change.
    idle: tuple[Idle, ...] = ()
    host_lifetimes: tuple[Lifetime, ...] = ()
    curve: tuple[tuple[float, int], ...] = ()
    # Stages whose Fall joins the graph of the stage before it, so that one backward call runs through both
    # (see _joins); each backward call is charged chain.backward_call once, at the B that starts it.
    joined: frozenset[int] = frozenset()

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events) if self.events else 0.0

    @property
    def idle_time(self) -> float:
        """Seconds the compute stream waited for prefetches."""
        return float(sum(w.end - w.start for w in self.idle))

    @property
    def n_transfers(self) -> int:
        return sum(e.is_transfer for e in self.events)

    def transfer_events(self) -> tuple[Event, ...]:
        """The Off/Pre events (copy intervals on their channels)."""
        return tuple(e for e in self.events if e.is_transfer)

    def host_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(time, bytes) step points of host-resident bytes: a value counts from its Off's completion to its Pre's
        completion."""
        ends = {e.index: e.end for e in self.events}
        changes = sorted([(ends[h.created], h.size) for h in self.host_lifetimes]
                         + [(ends[h.freed], -h.size) for h in self.host_lifetimes])
        t, m, cur = [0.0], [0], 0
        for when, d in changes:
            cur += d
            t += [when, when]
            m += [m[-1], cur]
        t.append(self.makespan)
        m.append(cur)
        return np.asarray(t), np.asarray(m)

    @property
    def peak_memory(self) -> int:
        return max([self.initial_memory] + [e.mem_peak for e in self.events])

    @property
    def peak_index(self) -> int:
        """Index of the op at which the peak is reached (first such op)."""
        return int(np.argmax([e.mem_peak for e in self.events]))

    @property
    def n_recomputed(self) -> int:
        return sum(e.recompute for e in self.events)

    @property
    def overhead(self) -> float:
        """Makespan over store-all, minus one (0.25 = 25% slower than storing everything)."""
        base = self.chain.store_all_time
        return self.makespan / base - 1.0 if base > 0 else 0.0

    def fits(self, budget: int) -> bool:
        """True when the simulated peak never exceeds ``budget`` bytes."""
        return self.peak_memory <= budget

    def memory_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(time, bytes) points of a step curve through every op's before / peak / after memory."""
        t, m = [0.0], [self.initial_memory]
        if self.curve:  # with transfers: the time-ordered changes, as steps
            for when, mem in self.curve:
                t += [when, when]
                m += [m[-1], mem]
            return np.asarray(t), np.asarray(m)
        for e in self.events:
            t += [e.start, e.start, e.end]
            m += [e.mem_before, e.mem_peak, e.mem_after]
        return np.asarray(t), np.asarray(m)

    def __repr__(self) -> str:
        name = self.schedule.meta.get("strategy", "schedule")
        return (f"Trace({name}: {len(self.events)} ops, makespan {format_time(self.makespan)} "
                f"({100 * self.overhead:+.1f}% over store-all), peak {format_bytes(self.peak_memory)}, "
                f"{self.n_recomputed} recomputed forwards"
                + (f", {self.n_transfers} transfers, idle {format_time(self.idle_time)}" if self.n_transfers else "")
                + ")")


def simulate(chain: Chain, schedule: Schedule) -> Trace:
    """Replay ``schedule`` on ``chain`` under the memory model of docs/design.md §3 (shared tensors counted once, §8).

    Raises :class:`InvalidSchedule` naming the first op that needs something not resident (or on the host),
    creates something already resident, is out of range, or when the schedule ends before every backward has run.
    """
    return _replay(chain, schedule, True)


def peak_and_makespan(chain: Chain, schedule: Schedule) -> tuple[int, float]:
    """``(trace.peak_memory, trace.makespan)`` of ``simulate(chain, schedule)``, the same replay without recording
    the trace (about twice as fast: what scoring many baseline schedules needs). Raises as :func:`simulate`."""
    return _replay(chain, schedule, False)


def _replay(chain: Chain, schedule: Schedule, record: bool) -> Any:
    """:func:`simulate`'s replay: the Trace, or with ``record=False`` just (peak, makespan)."""
    if not isinstance(chain, Chain):
        raise InvalidSchedule(f"simulate() needs a Chain as first argument, got {type(chain).__name__}")
    if not isinstance(schedule, Schedule):
        raise InvalidSchedule(f"simulate() needs a Schedule as second argument, got {type(schedule).__name__}")
    L = chain.length
    x, xbar = chain.x, chain.xbar
    tensors = _Shared(chain)
    res: dict[tuple, int] = {}  # key -> bytes of every resident item (shared tensors are items of their own)
    opened: dict[tuple, int] = {}  # key -> index into `spans` of its open lifetime
    spans: list[list] = []
    mem = 0
    t = 0.0
    loss_done = False
    kept: set[int] = set()  # stages whose input x_k a Fck kept: a checkpoint until B(k)
    forwarded: set[int] = set()
    backward_done: set[int] = set()
    events = []
    top, end = x[0], 0.0  # without a record: the peak and the makespan so far
    link = _Link(chain, res, spans, opened, kept)  # the transfer channels (design.md §9); idle unless Off/Pre appear
    transfers = bool(schedule.n_transfers)
    if transfers and not record:  # the transfers' replay needs the record
        trace = _replay(chain, schedule, True)
        return trace.peak_memory, trace.makespan
    b_pos = {i: k for k, (kind, i) in enumerate(schedule.ops) if kind == "B"}  # where each backward runs (_joins)
    offloaded = {i for kind, i in schedule.ops if kind == "Off"}
    joined: set[int] = set()
    parts = {kind: (0,) * (L + 1) if transfers else getattr(chain, kind) for kind in _PARTS}

    def held(new: list[tuple[tuple, int]], boundary: int) -> list[tuple[tuple, int]]:
        """The items of a new value holding x[boundary] (its own item first), its transit and consumed parts split
        off."""
        split = [((kind, boundary), parts[kind][boundary]) for kind in _PARTS if parts[kind][boundary]]
        if not split:
            return new
        (key, size), *rest = new
        return [(key, size - sum(b for _, b in split)), *split, *rest]

    def add(key: tuple, size: int, k: int) -> None:
        res[key] = size
        if record:
            opened[key] = len(spans)
            spans.append([key[0], key[1], size, k, None])

    def drop(key: tuple, k: int) -> int:
        if record:
            spans[opened.pop(key)][4] = k
        return res.pop(key)

    for key, size in tensors.create(("x", 0), 0, None, x[0]):  # x_0 and the shared tensors that start there
        add(key, size, -1)
        mem += size

    for k, op in enumerate(schedule.ops):
        kind, i = op
        fail = partial(_invalid, k, op)
        gone: list[tuple] = []  # values this op frees once it has run
        if kind in ("Off", "Pre"):
            if i >= L:
                raise fail(f"stage {i} does not exist; the chain has stages 0..{L - 1}")
            events.append(link.transfer(k, op, fail))
            continue
        link.check_not_on_host(i, kind, fail)
        if kind == "Loss":
            if i != L:
                raise fail(f"the loss is stage {L} for this {L}-stage chain")
            if loss_done:
                raise fail("the loss runs once per step")
            if ("out", L) not in res:
                raise fail(f"the output x_{L} has not been computed (run every forward up to stage {L - 1} first)")
            new = [(("delta", L), chain.delta_bytes[L])]
            tmp, dt = 0, 0.0
            loss_done = True
        elif i >= L:
            raise fail(f"stage {i} does not exist; the chain has stages 0..{L - 1}")
        elif kind == "B":
            if not loss_done:
                raise fail("a backward needs the loss to have run first")
            if ("delta", i + 1) not in res:
                raise fail(f"B{i} needs the gradient δ_{i + 1}, which is not resident (run B{i + 1} first)"
                           if i + 1 < L else "B needs δ_L")
            if ("xbar", i) not in res:
                raise fail(f"B{i} needs x̄_{i + 1} from a Fall{i}, which is not resident")
            if not _input_available(res, i):
                raise fail(f"B{i} needs its input x_{i}, which is not resident")
            gone = [("delta", i + 1), ("xbar", i)]
            if i > 0 and ("x", i) in res:  # a plain checkpoint goes whole (with its parts)
                gone.append(("x", i))
            elif ("consumed", i) in res:  # of the x_i inside x̄_i, the part B(i) needed and B(i-1) does not
                gone.append(("consumed", i))
            if not transfers and ("xbar", i - 1) in res:  # and the shared tensors only B(i) needed
                gone += tensors.consume(i, ("xbar", i - 1))
            new = [(("delta", i), chain.delta_bytes[i])]
            # of δ_i, the part handed through from δ_{i+1} is no new memory (chain.delta_through)
            tmp, dt = chain.bwd_tmp[i] - chain.delta_through[i], chain.bwd_time[i]
            if i + 1 not in joined:  # B(i) starts a backward call of its own
                dt += chain.backward_call
            backward_done.add(i)
            kept.discard(i)
        else:  # forward ops
            if i in backward_done:
                raise fail(f"the backward of stage {i} has already run; its forward is no longer needed")
            if not _input_available(res, i):
                raise fail(f"its input x_{i} is not resident (keep a checkpoint with Fck or recompute it)")
            if ("xbar", i) in res or (i + 1 < L and ("x", i + 1) in res):
                raise fail(f"x_{i + 1} is already resident; recomputing it would hold two copies")
            source = ("x", i) if ("x", i) in res else ("xbar", i - 1)  # the resident value that holds x_i
            if kind == "Fall":
                if _joins(i, source, b_pos, offloaded):
                    joined.add(i)
                else:
                    joined.discard(i)
                if i == L - 1 and ("out", L) not in res:
                    new = tensors.create(("out", L), L, source, x[L]) + [(("xbar", i), xbar[i] - x[L])]
                else:
                    new = held(tensors.create(("xbar", i), i + 1, source, xbar[i]), i + 1)
                if ("transit", i) in res:  # x_i's part that neither B(i-1) nor B(i) needs: freed now
                    gone = [("transit", i)]
            else:
                if i + 1 in backward_done:
                    raise fail(f"its output x_{i + 1} is no longer needed (B{i + 1} has run); use Fall{i} to "
                               f"prepare B{i}")
                if i + 1 == L:
                    if ("out", L) in res:
                        raise fail(f"the output x_{L} is already held by the caller")
                    new = tensors.create(("out", L), L, source, x[L])
                else:
                    new = held(tensors.create(("x", i + 1), i + 1, source, x[i + 1]), i + 1)
                if kind == "Fn":
                    if i == 0:
                        raise fail("x_0 is the caller's input and cannot be dropped; use Fck0")
                    if ("x", i) not in res:
                        raise fail(f"Fn drops its input, but x_{i} is part of x̄_{i} here; use Fck{i}")
                    if i in kept:
                        raise fail(f"x_{i} is a checkpoint kept by an earlier Fck{i}; checkpoints stay until B{i} "
                                   f"(use Fck{i})")
                    gone = [("x", i)]
            tmp = chain.fwd_tmp[i] if kind == "Fall" else chain.nograd_tmp_bytes[i]
            dt = chain.fwd_time[i]
        recompute = kind in ("Fck", "Fn", "Fall") and i in forwarded
        if kind in ("Fck", "Fn", "Fall"):
            forwarded.add(i)
        if kind == "Fck":
            kept.add(i)
        for key, size in new:
            add(key, size, k)
            link.ready.pop(key, None)
        created = sum(size for _, size in new)
        freed = 0
        for key in gone:
            freed += drop(key, k)
            for inst in tensors.release(key):  # a shared tensor goes with the last value that holds it
                freed += drop(inst, k)
            if key[0] in ("x", "xbar"):  # a holder of x_b takes the parts of x_b still resident
                for part in ((kind, key[1] + (key[0] == "xbar")) for kind in _PARTS):
                    if part in res:
                        freed += drop(part, k)
        t = link.start_compute(k, op, t)  # later than t only when it waits for a prefetch
        before = mem
        peak = before + created + tmp
        mem = before + created - freed
        if record:
            events.append((k, op, t, t + dt, before, peak, mem, recompute))
            link.compute_done(t, t + dt, created + tmp, tmp + freed)
        else:
            top = max(top, peak)
            end = max(end, t + dt)
        t += dt

    missing = [i for i in range(L - 1, -1, -1) if i not in backward_done]
    if missing or not loss_done:
        what = "the loss" if not loss_done else f"B{missing[0]}"
        raise InvalidSchedule(f"the schedule ends before {what}: a complete step runs the loss and B{L - 1}..B0",
                              len(schedule.ops))
    if link.host:
        i = next(iter(link.host))
        raise InvalidSchedule(f"the schedule ends with a value of stage {i} still on the host; every Off{i} needs a "
                              f"Pre{i} before B{i}", len(schedule.ops))
    if not record:
        return top, end
    lifetimes = tuple(Lifetime(*span) for span in spans)
    if not link.used:  # remat only: the sequential numbers of docs/design.md §3, exactly
        return Trace(chain, schedule, tuple(Event(*e, lifetimes) for e in events), x[0], lifetimes,
                     joined=frozenset(joined))
    events, curve = link.replay_memory(events, x[0])
    return Trace(chain, schedule, tuple(Event(*e, lifetimes) for e in events), x[0], lifetimes,
                 tuple(link.idle), tuple(Lifetime(*h) for h in link.host_spans), curve, frozenset(joined))


def _joins(i: int, source: tuple, b_pos: dict[int, int], offloaded: set[int]) -> bool:
    """Whether Fall(i) joins the graph of stage i-1, so that one backward call runs B(i) and B(i-1): it reads x_i from
    inside x̄_{i-1} (``source``; not from a plain checkpoint, which starts a graph of its own), B(i-1) comes right
    after B(i) (nothing needs δ_i on its own), and neither stage is offloaded (a transfer moves one stage's graph)."""
    return (source == ("xbar", i - 1) and b_pos.get(i - 1) == b_pos.get(i, -2) + 1
            and not {i - 1, i} & offloaded)


class _Shared:
    """Tensor identity for ``chain.shared`` (docs/design.md §8): which instance of each shared tensor a value holds.

    A shared tensor ``t = (first, last, bytes)`` is created by the forward of stage ``first - 1`` (or is part of the
    caller's x_0 when ``first == 0``) and passes unchanged through the forwards of stages ``first..last-1``. Every
    such forward hands its output the *instance* its input holds; a recomputation of stage ``first - 1`` makes a new
    one. An instance is an item of its own (kind ``"shared"``, stage ``first``) resident while any value holds it,
    and the values that hold it leave its bytes out of their own size, so memory counts it once.
    """

    def __init__(self, chain: Chain) -> None:
        self.shared = chain.shared
        self.consumed: dict[int, list[int]] = {}  # last -> the consumed_shared tensors ending there
        for n in chain.consumed_shared:
            self.consumed.setdefault(chain.shared[n][1], []).append(n)
        self.count = 0
        self.holds: dict[tuple, dict[int, tuple]] = {}  # value key -> {tensor index: instance key}
        self.holders: dict[tuple, int] = {}  # instance key -> number of values holding it

    def create(self, key: tuple, boundary: int, source: tuple | None, size: int) -> list[tuple[tuple, int]]:
        """The items a new value ``key`` (holding boundary value x[boundary], ``size`` bytes in all) brings:
        itself less its shared bytes, and the instances it creates; ``source`` is the value its input came from."""
        if not self.shared:
            return [(key, size)]
        held: dict[int, tuple] = {}
        new = []
        for n, (first, last, nbytes) in enumerate(self.shared):
            if not first <= boundary <= last:
                continue
            size -= nbytes
            inst = self.holds.get(source, {}).get(n) if first < boundary else None
            if inst is None:  # made here (or the caller's x_0 holds it)
                self.count += 1
                inst = ("shared", first, self.count)
                new.append((inst, nbytes))
            held[n] = inst
            self.holders[inst] = self.holders.get(inst, 0) + 1
        self.holds[key] = held
        return [(key, size)] + new

    def consume(self, last: int, holder: tuple) -> list[tuple]:
        """After B(last), with x_last inside ``holder``: the instances it holds of the tensors only B(last) needed
        (``chain.consumed_shared``), gone from every value that holds them."""
        out = []
        for n in self.consumed.get(last, ()):
            inst = self.holds.get(holder, {}).get(n)
            if inst is None:
                continue
            for held in self.holds.values():
                if held.get(n) == inst:
                    del held[n]
            del self.holders[inst]
            out.append(inst)
        return out

    def release(self, key: tuple) -> list[tuple]:
        """Forget value ``key``; the instances no other value holds any more."""
        out = []
        for inst in self.holds.pop(key, {}).values():
            self.holders[inst] -= 1
            if not self.holders[inst]:
                del self.holders[inst]
                out.append(inst)
        return out


class _Link:
    """The transfer channels and their effect on compute: which values are on the host, when prefetched values are
    ready, and the device-memory changes in time for the event-based replay (docs/design.md §9).

    Shares the simulator's ``res`` / ``spans`` / ``opened`` / ``kept`` (it moves values out of and back into the
    resident set). Memory changes are ``(time, order, bytes)``; at equal times ``order`` keeps schedule order:
    compute op c allocates at ``2c`` and frees at ``2c + 1``, a prefetch listed after compute op c allocates at
    ``2c + 1.5``, and a completed offload frees first (``-1``).
    """

    def __init__(self, chain: Chain, res: dict, spans: list, opened: dict, kept: set) -> None:
        self.chain, self.res, self.spans, self.opened, self.kept = chain, res, spans, opened, kept
        self.host: dict[int, tuple] = {}  # stage -> (key, size, copy end, Off's op index), while on the host
        self.ready: dict[tuple[str, int], float] = {}  # prefetched key -> time its copy completes
        self.free_at = {"Off": 0.0, "Pre": 0.0}  # each direction's channel is free from this time
        self.compute_end = 0.0  # end of the last compute op so far: a transfer listed after it starts no earlier
        self.n_compute = 0
        self.changes: list[tuple[float, float, int]] = []
        self.idle: list[Idle] = []
        self.host_spans: list[list] = []
        self.used = False

    def transfer(self, k: int, op: Op, fail) -> tuple:
        kind, i = op
        bw = self.chain.bandwidth
        if bw is None:
            raise fail("the chain has no bandwidth for transfers; set one with chain.with_bandwidth('pcie5') (or "
                       "a number of bytes/s)")
        self.used = True
        res = self.res
        if kind == "Off":
            if i in self.host:
                raise fail(f"a value of stage {i} is already on the host; bring it back with Pre{i} first")
            if ("xbar", i) in res:
                key = ("xbar", i)
            elif i > 0 and i in self.kept and ("x", i) in res:
                key = ("x", i)
            else:
                raise fail(f"nothing of stage {i} to offload: Off{i} moves x̄_{i + 1} left by Fall{i}, or the "
                           f"checkpoint x_{i} kept by Fck{i}")
            size = res.pop(key)
            self.spans[self.opened.pop(key)][4] = k
            start = max(self.free_at["Off"], self.compute_end, self.ready.pop(key, 0.0))
            end = start + size / bw
            self.host[i] = (key, size, end, k)
            self.changes.append((end, -1.0, -size))
        else:
            if i not in self.host:
                raise fail(f"no value of stage {i} is on the host; Pre{i} needs an earlier Off{i}")
            key, size, off_end, off_k = self.host.pop(i)
            start = max(self.free_at["Pre"], self.compute_end, off_end)
            end = start + size / bw
            self.ready[key] = end
            res[key] = size
            self.opened[key] = len(self.spans)
            self.spans.append([key[0], key[1], size, k, None])
            self.host_spans.append([key[0], key[1], size, off_k, k])
            self.changes.append((start, 2.0 * self.n_compute - 0.5, size))
        self.free_at[kind] = end
        return (k, op, start, end, 0, 0, 0, False)  # memory filled in by replay_memory

    def check_not_on_host(self, i: int, kind: str, fail) -> None:
        """A compute op may not read (its input, x̄ for B) or re-create (a forward's output) a value on the host."""
        if not self.host or kind == "Loss":
            return
        for s in (i - 1, i, i + 1):
            key = self.host[s][0] if s in self.host else None
            if key in (("x", i), ("xbar", i - 1), ("xbar", i)) or (kind != "B" and key == ("x", i + 1)):
                what = f"x̄_{s + 1}" if key[0] == "xbar" else f"x_{s}"
                raise fail(f"{what} is on the host after Off{s}; put Pre{s} before this op")

    def start_compute(self, k: int, op: Op, t: float) -> float:
        """When compute op ``k`` starts: after the previous one (``t``) and after the prefetches it reads."""
        if not self.ready:
            return t
        kind, i = op
        keys = [("x", i), ("xbar", i - 1)] if kind != "Loss" else []
        if kind == "B":
            keys.append(("xbar", i))
        start = max([t] + [self.ready[key] for key in keys if key in self.ready])
        if start > t:
            waited = next(key for key in keys if self.ready.get(key) == start)
            self.idle.append(Idle(t, start, k, waited[1]))
        return start

    def compute_done(self, start: float, end: float, alloc: int, free: int) -> None:
        c = 2.0 * self.n_compute
        self.changes += [(start, c, alloc), (end, c + 1.0, -free)]
        self.n_compute += 1
        self.compute_end = end

    def replay_memory(self, events: list[tuple], initial: int) -> tuple[list[tuple], tuple]:
        """Fill every event's memory from the time-ordered changes; also the curve (time, bytes after each)."""
        order = sorted(range(len(self.changes)), key=lambda n: self.changes[n][:2])
        after = [0] * len(self.changes)
        mem = initial
        curve = []
        for n in order:
            mem += self.changes[n][2]
            after[n] = mem
            curve.append((self.changes[n][0], mem))
        pos = {n: p for p, n in enumerate(order)}
        out, c, n_change = [], 0, 0
        for e in events:
            k, op, start, end = e[:4]
            if op.is_transfer:
                n = n_change  # its one change, in the order appended: transfers and compute interleave in list order
                d = self.changes[n][2]
                out.append((k, op, start, end, after[n] - d, max(after[n], after[n] - d), after[n], False))
                n_change += 1
            else:
                a, z = n_change, n_change + 1  # its start and end changes
                lo, hi = pos[a], pos[z]
                peak = max(after[order[p]] for p in range(min(lo, hi), max(lo, hi) + 1))
                out.append((k, op, start, end, after[a] - self.changes[a][2], peak, after[z], e[7]))
                n_change += 2
                c += 1
        return out, tuple(curve)


def _invalid(k: int, op: Op, why: str) -> InvalidSchedule:
    return InvalidSchedule(f"op #{k} {op} is invalid: {why}", k)


def _input_available(res: dict, i: int) -> bool:
    """x_i is resident as a plain activation, or inside x̄_i (what Fall(i-1) left), or it is the caller's x_0."""
    return ("x", i) in res or (i > 0 and ("xbar", i - 1) in res)
