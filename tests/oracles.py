"""Oracles for the solver tests, written apart from ``hchain_viz.core.solver``.

Two of them (STYLE: every kernel is tested against a naive twin, and the optimum against a brute force):

- :func:`brute_force` — an exhaustive shortest-path search (Dijkstra) over *every* op sequence the grammar allows on a
  small chain, each step checked by the memory model of docs/design.md §3. It knows nothing of the DP's structure (no
  sub-chains): it only knows which op may follow which state, what it costs and what it leaves. Its state transition
  :func:`step` re-implements ``simulate``'s rules; ``test_solver`` checks it against ``simulate`` on random op
  sequences, and every path it returns is replayed through ``simulate``. ``relaxed=True`` also searches schedules
  outside the model (a kept checkpoint consumed early), to show what the model leaves out.
- :func:`twin_solve` — the recurrences of design.md §4 written as plain Python over dicts, filled in the other order the
  design allows (m outermost, spans of increasing length inside), so the Numba kernel is checked entry by entry
  against code that shares none of its loops, indexing or layout. Only the tie rule is shared on purpose (the twin
  must pick the same option when two have equal time, so the op lists can be compared too).
"""

from __future__ import annotations

import heapq
import itertools
import math
from functools import partial
from typing import NamedTuple

from hchain_viz.core.chain import Chain
from hchain_viz.core.schedule import Op, Schedule
from hchain_viz.errors import InvalidSchedule

INF = math.inf

# ----------------------------------------------------------------------------------------------------------------
# The brute force
# ----------------------------------------------------------------------------------------------------------------


class State(NamedTuple):
    """What the memory model needs to know to judge the next op.

    ``res``: frozenset of resident items ``(kind, stage, bytes)`` with kinds ``x``, ``xbar``, ``out``, ``delta``,
    ``transit`` (as in ``simulate``: the part of x_b no backward needs, beside the value holding x_b, until
    Fall(b)), ``consumed`` (the part of x_b only B(b) needs, beside the value holding x_b, until B(b));
    ``loss_done``; ``bwd_done``: frozenset of stages whose backward has run.
    """

    res: frozenset
    loss_done: bool
    bwd_done: frozenset
    kept: frozenset = frozenset()  # stages whose input a Fck kept: checkpoints until their B (docs/design.md §3.4)
    # Tensor identity (design.md §8): per shared tensor of ``chain.shared``, the resident values ``(kind, stage)`` that
    # hold the same copy, as a frozenset of groups (frozensets). A group of n values saves (n - 1) x its bytes.
    groups: tuple = ()


def initial_state(chain: Chain) -> State:
    """Only x_0, the caller's input, is resident (with its copy of each shared tensor that starts at boundary 0)."""
    groups = tuple(frozenset({frozenset({("x", 0)})}) if first == 0 else frozenset()
                   for first, _, _ in chain.shared)
    return State(frozenset({("x", 0, chain.x[0])}), False, frozenset(), frozenset(), groups)


def memory(state: State, chain: Chain | None = None) -> int:
    """Resident bytes: every value's full size, less (n - 1) copies of a shared tensor that n values hold."""
    total = sum(size for _, _, size in state.res)
    if state.groups:
        total -= sum((len(g) - 1) * nbytes for (_, _, nbytes), gs in zip(chain.shared, state.groups) for g in gs)
    return total


def _hold(chain: Chain, groups: tuple, value: tuple, boundary: int, source: tuple) -> tuple:
    """``groups`` after the forward whose input is held by ``source`` made ``value`` (boundary value x[boundary]):
    a shared tensor the input already had is the same copy; one that starts at ``boundary`` is a new one."""
    out = []
    for (first, last, _), gs in zip(chain.shared, groups):
        if first <= boundary <= last:
            if first < boundary:
                g = next(g for g in gs if source in g)
                gs = (gs - {g}) | {g | {value}}
            else:
                gs = gs | {frozenset({value})}
        out.append(gs)
    return tuple(out)


_GONE = ("gone",)  # in a group: that copy is freed (chain.consumed_shared), so its n holders save n copies


def _release(groups: tuple, value: tuple) -> tuple:
    """``groups`` once ``value`` is freed."""
    return tuple(frozenset(g - {value} for g in gs if g - {value} - {_GONE}) for gs in groups)


def _consume(chain: Chain, groups: tuple, last: int, holder: tuple) -> tuple:
    """``groups`` once B(last) has freed the copies ``holder`` holds of the tensors only it needed."""
    out = []
    for n, gs in enumerate(groups):
        if n in chain.consumed_shared and chain.shared[n][1] == last:
            gs = frozenset(g | {_GONE} if holder in g else g for g in gs)
        out.append(gs)
    return tuple(out)


def _has(state: State, kind: str, stage: int) -> bool:
    return any(k == kind and s == stage for k, s, _ in state.res)


def _size(state: State, kind: str, stage: int) -> int:
    return next(size for k, s, size in state.res if k == kind and s == stage)


def _without(res: set, state: State, kind: str, stage: int) -> None:
    """Free the value (kind, stage) from ``res``, with the transit and consumed parts of the x_b it holds still
    resident."""
    res.discard((kind, stage, _size(state, kind, stage)))
    b = stage + 1 if kind == "xbar" else stage
    for part in ("transit", "consumed"):
        if _has(state, part, b):
            res.discard((part, b, _size(state, part, b)))


def _with_parts(chain: Chain, item: tuple) -> list[tuple]:
    """A new value holding x_b, its transit and consumed parts split off as items of their own."""
    kind, stage, size = item
    b = stage + 1 if kind == "xbar" else stage
    t, c = chain.transit[b], chain.consumed[b]
    return [(kind, stage, size - t - c)] + [(part, b, v) for part, v in (("transit", t), ("consumed", c)) if v]


def _input_ok(state: State, i: int) -> bool:
    return _has(state, "x", i) or (i > 0 and _has(state, "xbar", i - 1))


def step(chain: Chain, state: State, op: Op, relaxed: bool = False) -> tuple[State, int, float] | None:
    """Apply ``op``: ``(next state, peak bytes during the op, seconds)``, or None when the model forbids it.

    ``relaxed``: also let ``Fn(k)`` drop a checkpoint that ``Fck(k)`` kept (outside the model; see brute_force)."""
    kind, i = op
    L = chain.length
    x, xbar = chain.x, chain.xbar
    res = set(state.res)
    mem = memory(state, chain)
    groups = state.groups
    if kind == "Loss":
        if i != L or state.loss_done or not _has(state, "out", L):
            return None
        res.add(("delta", L, chain.delta_bytes[L]))
        return State(frozenset(res), True, state.bwd_done, state.kept, groups), mem + chain.delta_bytes[L], 0.0
    if not 0 <= i < L:
        return None
    if kind == "B":
        if not state.loss_done or not _has(state, "delta", i + 1) or not _has(state, "xbar", i):
            return None
        if not _input_ok(state, i):
            return None
        peak = mem + chain.delta_bytes[i] - chain.delta_through[i] + chain.bwd_tmp[i]
        if _has(state, "xbar", i - 1):  # x_i inside x̄_i: the shared tensors only B(i) needs go
            groups = _consume(chain, groups, i, ("xbar", i - 1))
        res.discard(("delta", i + 1, _size(state, "delta", i + 1)))
        _without(res, state, "xbar", i)
        groups = _release(groups, ("xbar", i))
        if i > 0 and _has(state, "x", i):
            _without(res, state, "x", i)
            groups = _release(groups, ("x", i))
        elif _has(state, "consumed", i):  # of the x_i inside x̄_i: what B(i) needed and B(i-1) does not
            res.discard(("consumed", i, _size(state, "consumed", i)))
        res.add(("delta", i, chain.delta_bytes[i]))
        nxt = State(frozenset(res), True, state.bwd_done | {i}, state.kept - {i}, groups)
        return nxt, peak, chain.bwd_time[i]
    # a forward of stage i
    if i in state.bwd_done or not _input_ok(state, i):
        return None
    if _has(state, "xbar", i) or (i + 1 < L and _has(state, "x", i + 1)):
        return None  # its output is already resident
    source = ("x", i) if _has(state, "x", i) else ("xbar", i - 1)  # what holds the input x_i
    if kind == "Fall":
        if i == L - 1 and not _has(state, "out", L):
            new = [("out", L, x[L]), ("xbar", i, xbar[i] - x[L])]  # this x̄ item holds no shared tensor
        else:
            new = _with_parts(chain, ("xbar", i, xbar[i]))
    else:
        if i + 1 in state.bwd_done:
            return None
        if i + 1 == L:
            if _has(state, "out", L):
                return None
            new = [("out", L, x[L])]
        else:
            new = _with_parts(chain, ("x", i + 1, x[i + 1]))
    holder = new[0][:2]  # the value that holds the output x_{i+1}
    groups = _hold(chain, groups, holder, i + 1, source)
    res.update(new)
    during = State(frozenset(res), state.loss_done, state.bwd_done, state.kept, groups)
    # for Fn, the input is still counted during the op; a forward without autograd has its own transient
    peak = memory(during, chain) + (chain.fwd_tmp[i] if kind == "Fall" else chain.nograd_tmp_bytes[i])
    if kind == "Fn":
        if i == 0 or not _has(state, "x", i) or (i in state.kept and not relaxed):
            return None
        _without(res, state, "x", i)
        groups = _release(groups, ("x", i))
    if kind == "Fall" and _has(state, "transit", i):  # freed: neither B(i-1) nor B(i) needs it
        res.discard(("transit", i, _size(state, "transit", i)))
    kept = state.kept | {i} if kind == "Fck" else state.kept
    return State(frozenset(res), state.loss_done, state.bwd_done, kept, groups), peak, chain.fwd_time[i]


def all_ops(L: int) -> list[Op]:
    """Every op a schedule of an L-stage chain could contain."""
    ops = [Op(k, i) for i in range(L) for k in ("Fck", "Fn", "Fall", "B")]
    return ops + [Op("Loss", L)]


def is_final(chain: Chain, state: State) -> bool:
    return state.loss_done and len(state.bwd_done) == chain.length


def _successors(chain: Chain, state: State, ops: list[Op], relaxed: bool):
    """``(op, next state, peak, seconds)`` for every op the model (or the relaxed grammar) accepts from ``state``."""
    for op in ops:
        nxt = step(chain, state, op, relaxed)
        if nxt is not None:
            yield op, nxt[0], nxt[1], nxt[2]


def brute_force(chain: Chain, budget: int, *, relaxed: bool = False) -> tuple[float, Schedule | None]:
    """Least makespan over all op sequences whose every op peaks at most ``budget`` bytes (Dijkstra on time).

    Every sequence the memory model accepts is searched; in the model checkpoints persist (an x_k kept by
    ``Fck(k)`` is only freed by ``B(k)``). ``relaxed=True`` searches beyond the model too, letting a later ``Fn(k)``
    consume a kept checkpoint (its backward then recomputes x_k from an earlier one) — sometimes faster; those
    schedules do not pass ``simulate``.

    Returns ``(makespan, schedule)``, or ``(inf, None)`` when nothing fits. Zero-time ops are fine for Dijkstra:
    each state is settled once, at its least time.
    """
    start = initial_state(chain)
    if memory(start, chain) > budget:
        return INF, None
    ops = all_ops(chain.length)
    tie = itertools.count()
    heap = [(0.0, next(tie), start, ())]
    settled = set()
    while heap:
        t, _, key, path = heapq.heappop(heap)
        if key in settled:
            continue
        settled.add(key)
        if is_final(chain, key):
            return t, Schedule(tuple(path), {"strategy": "brute_force"})
        for op, new_key, peak, dt in _successors(chain, key, ops, relaxed):
            if peak <= budget and new_key not in settled:
                heapq.heappush(heap, (t + dt, next(tie), new_key, path + (op,)))
    return INF, None


def brute_frontier(chain: Chain, *, relaxed: bool = False) -> list[tuple[int, float]]:
    """Every budget's optimum at once: the breakpoints ``(budget, makespan)`` (budgets increasing, makespans
    strictly decreasing) of the exhaustive search, by a bi-objective label-setting search (time, running peak).

    Labels are settled in order of time; a label is kept only if its peak is below every label already settled at
    its state (which all came no later), so each state keeps a staircase of (time, peak) pairs.
    """
    start = initial_state(chain)
    ops = all_ops(chain.length)
    tie = itertools.count()
    heap = [(0.0, memory(start, chain), next(tie), start)]
    least_peak: dict = {}
    front: list[tuple[int, float]] = []
    while heap:
        t, p, _, key = heapq.heappop(heap)
        if p >= least_peak.get(key, INF):
            continue
        least_peak[key] = p
        if is_final(chain, key):
            front.append((p, t))
            continue
        for _op, new_key, peak, dt in _successors(chain, key, ops, relaxed):
            q = max(p, peak)
            if q < least_peak.get(new_key, INF):
                heapq.heappush(heap, (t + dt, q, next(tie), new_key))
    # final labels arrive by increasing time with decreasing peaks; keep strict improvements, budget increasing
    front.sort(key=lambda bt: (bt[0], bt[1]))
    out: list[tuple[int, float]] = []
    for b, t in front:
        if not out or t < out[-1][1]:
            out.append((b, t))
    return out


def frontier_makespan(front: list[tuple[int, float]], budget: int) -> float:
    """The optimum within ``budget`` read from a frontier (inf below its first budget)."""
    return min((t for b, t in front if b <= budget), default=INF)


def brute_min_budget(chain: Chain) -> int:
    """The least budget any complete schedule fits in (a bottleneck shortest path: minimise the running peak)."""
    start = initial_state(chain)
    ops = all_ops(chain.length)
    tie = itertools.count()
    heap = [(memory(start, chain), next(tie), start)]
    settled = set()
    while heap:
        peak, _, state = heapq.heappop(heap)
        if state in settled:
            continue
        settled.add(state)
        if is_final(chain, state):
            return peak
        for op in ops:
            nxt = step(chain, state, op)
            if nxt is not None and nxt[0] not in settled:
                heapq.heappush(heap, (max(peak, nxt[1]), next(tie), nxt[0]))
    raise AssertionError("every chain has a complete schedule")  # store-all always exists


# ----------------------------------------------------------------------------------------------------------------
# The plain-Python twin of the DP (docs/design.md §4)
# ----------------------------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Twin(NamedTuple):
    """The twin's tables: ``C[(m, i, l)]``, ``D[(m, i)]`` (seconds, inf when infeasible) and their choices
    (0: the chain option / base case / the loss, j > i: the leaf option with checkpoint j, -1: infeasible);
    ``sizes``: the slot sizes used; ``S``: slots; ``sx0``: slots of x_0."""

    C: dict
    Cch: dict
    D: dict
    Dch: dict
    sizes: dict
    S: int
    sx0: int

    def makespan_at_slot(self, s: int) -> float:
        """Best time for a budget of ``s`` slots (x_0 included)."""
        return self.D[(s - self.sx0, 0)] if s >= self.sx0 else INF


def twin_solve(chain: Chain, max_budget: int, slots: int, tie_rtol: float) -> Twin:
    """Fill C and D for every m in 0..slots, exactly as docs/design.md §4 states them (sizes rounded up to slots)."""
    L = chain.length
    S = slots
    up = lambda v: _ceil_div(v * S, max_budget)  # noqa: E731  (bytes -> slots, rounded up)
    x = [up(v) for v in chain.delta_bytes] + [0]  # the δ's (x[L+1] = 0: nothing arrives from beyond the loss)

    def common(i: int, j: int) -> int:
        """Bytes of the shared tensors that cross every cut i..j (docs/design.md §8)."""
        return sum(nbytes for first, last, nbytes in chain.shared if first <= i and j <= last)

    xs = {(i, j): up(chain.x[j] - common(i, j)) for i in range(L + 1) for j in range(i + 1, L + 1)}  # x_j beside x_i
    xbar = [up(chain.xbar[i] - common(i, i + 1)) for i in range(L)]  # x̄_{i+1} beside x_i
    ftmp = [up(v) for v in chain.fwd_tmp]  # of a Fall
    ntmp = [up(v) for v in chain.nograd_tmp_bytes]  # of a Fck or Fn
    btmp = [up(v - h) for v, h in zip(chain.bwd_tmp, chain.delta_through)]  # beside the new part of δ_i
    tr = [min(v * S // max_budget, up(chain.x[i])) for i, v in enumerate(chain.transit)]  # freed: rounded down
    consumed = list(chain.consumed)  # with the shared tensors only B(i) needs, freed then too
    for n in chain.consumed_shared:
        consumed[chain.shared[n][1]] += chain.shared[n][2]
    co = [min(v * S // max_budget, up(chain.x[i])) for i, v in enumerate(consumed)]  # freed: rounded down
    fwd, bwd = chain.fwd_time, chain.bwd_time
    C: dict = {}
    Cch: dict = {}
    D: dict = {}
    Dch: dict = {}

    def pick(via_chain: float, leaves: list[float], i: int) -> tuple[float, int]:
        """The tie rule: the fastest leaf (smallest j on equal time) beats the chain option only when faster by
        more than ``tie_rtol`` (relative)."""
        leaf = min(leaves, default=INF)
        j = i + 1 + leaves.index(leaf) if leaves else -1
        if leaf * (1 + tie_rtol) < via_chain:
            return leaf, j
        return (via_chain, 0) if via_chain < INF else (INF, -1)

    def sweep_peak(i: int, end: int) -> int:
        """The first forward of each stage i..end-1 (a Fck or Fn) holds its input and output beside x_i: their parts
        not in x_i."""
        return max([xs[(i, i + 1)] + ntmp[i]] + [xs[(i, k)] + xs[(k, k + 1)] + ntmp[k] for k in range(i + 1, end)])

    # Spans outermost, m innermost: the chain option reads its sub-chain at m - (xbar[i] - tr[i]), which is above m
    # when Fall(i) frees more transit bytes than it leaves (read at most at S: rows never increase with m).
    for span in range(L):
        for i in range(L - span):
            l = i + span  # noqa: E741
            need_b = x[i] + x[i + 1] + xbar[i] + btmp[i] - tr[i]
            shift = xbar[i] - tr[i]
            for m in range(S + 1):
                best, choice = INF, -1
                if i == l:
                    if m >= x[i + 1] + xbar[i] + ftmp[i] and m >= need_b:
                        best, choice = fwd[i] + bwd[i], 0
                else:
                    via_chain = INF
                    # by B(i), the sub-chain's Fall(i+1) has freed the transit part of x_{i+1}, its B(i+1) the
                    # consumed part
                    if m >= x[l + 1] + xbar[i] + ftmp[i] and m >= need_b - tr[i + 1] - co[i + 1] and m >= shift:
                        via_chain = fwd[i] + bwd[i] + C[(min(m - shift, S), i + 1, l)]
                    # a leaf's guard: Fck(i) Fn(i+1..j-1) run with x_i whole and δ_{l+1} resident
                    leaves = [sum(fwd[i:j]) + C[(m - xs[(i, j)], j, l)] + C[(m, i, j - 1)]
                              if m >= xs[(i, j)] and m >= x[l + 1] + sweep_peak(i, j) else INF
                              for j in range(i + 1, l + 1)]
                    best, choice = pick(via_chain, leaves, i)
                C[(m, i, l)], Cch[(m, i, l)] = best, choice
    for m in range(S + 1):
        D[(m, L)], Dch[(m, L)] = (0.0, 0) if m >= x[L] else (INF, -1)
    for i in range(L - 1, -1, -1):
        held = xs[(i, L)]  # the output held by the caller, beside x_i (once the left part runs)
        # during B(i) of the chain option the output's source x_{i+1} is resident too (inside x̄_{i+1})
        need_b = (x[i] + x[i + 1] + xbar[i] + btmp[i] + (0 if i == L - 1 else xs[(i + 1, L)]) - tr[i] - tr[i + 1]
                  - co[i + 1])
        shift = xbar[i] - tr[i]
        for m in range(S + 1):
            via_chain = INF
            if m >= xbar[i] + ftmp[i] and m >= need_b and m >= shift:
                via_chain = fwd[i] + bwd[i] + D[(min(m - shift, S), i + 1)]
            leaves = [sum(fwd[i:j]) + D[(m - xs[(i, j)], j)] + C[(m - held, i, j - 1)]
                      if m >= xs[(i, j)] and m >= held and m >= sweep_peak(i, j) else INF for j in range(i + 1, L + 1)]
            D[(m, i)], Dch[(m, i)] = pick(via_chain, leaves, i)
    sizes = {"x": x, "xs": xs, "xbar": xbar, "tr": tr, "co": co, "fwd_tmp": ftmp, "nograd_tmp": ntmp, "bwd_tmp": btmp}
    return Twin(C, Cch, D, Dch, sizes, S, up(chain.x[0]))


def twin_schedule(twin: Twin, L: int, s: int) -> Schedule:
    """Rebuild the op list for a budget of ``s`` slots by recursion over the twin's choices."""
    xs, xbar, tr = twin.sizes["xs"], twin.sizes["xbar"], twin.sizes["tr"]
    ops: list[Op] = []

    def sweep(i: int, j: int) -> None:
        ops.append(Op("Fck", i))
        ops.extend(Op("Fn", k) for k in range(i + 1, j))

    def c(m: int, i: int, l: int) -> None:  # noqa: E741
        j = twin.Cch[(m, i, l)]
        assert j >= 0, (m, i, l)
        if j == 0:
            ops.append(Op("Fall", i))
            if i < l:
                c(min(m - xbar[i] + tr[i], twin.S), i + 1, l)
            ops.append(Op("B", i))
        else:
            sweep(i, j)
            c(m - xs[(i, j)], j, l)
            c(m, i, j - 1)

    def d(m: int, i: int) -> None:
        if i == L:
            ops.append(Op("Loss", L))
            return
        j = twin.Dch[(m, i)]
        assert j >= 0, (m, i)
        if j == 0:
            ops.append(Op("Fall", i))
            d(min(m - xbar[i] + tr[i], twin.S), i + 1)
            ops.append(Op("B", i))
        else:
            sweep(i, j)
            d(m - xs[(i, j)], j)
            c(m - xs[(i, L)], i, j - 1)

    d(s - twin.sx0, 0)
    return Schedule(tuple(ops), {"strategy": "twin"})


# ----------------------------------------------------------------------------------------------------------------
# The simulator as it was before transfers (issue 15), frozen
# ----------------------------------------------------------------------------------------------------------------
# A verbatim copy of core/simulate.py's loop before the event-based rewrite: the new simulator must give exactly
# these numbers (op times, memory before / peak / after, lifetimes) on every schedule without Off/Pre ops.
# Returns the raw per-op tuples (index, op, start, end, before, peak, after, recompute) and the lifetime spans.


def frozen_simulate(chain: Chain, schedule: Schedule) -> list[tuple]:
    """Replay ``schedule`` on ``chain`` under the memory model of docs/design.md §3.

    Raises :class:`InvalidSchedule` naming the first op that needs something not resident, creates something
    already resident, is out of range, or when the schedule ends before every backward has run.
    """
    if not isinstance(chain, Chain):
        raise InvalidSchedule(f"simulate() needs a Chain as first argument, got {type(chain).__name__}")
    if not isinstance(schedule, Schedule):
        raise InvalidSchedule(f"simulate() needs a Schedule as second argument, got {type(schedule).__name__}")
    L = chain.length
    x, xbar = chain.x, chain.xbar
    res: dict[tuple[str, int], int] = {("x", 0): x[0]}
    opened: dict[tuple[str, int], int] = {("x", 0): 0}  # key -> index into `spans` of its open lifetime
    spans: list[list] = [["x", 0, x[0], -1, None]]
    mem = x[0]
    t = 0.0
    loss_done = False
    kept: set[int] = set()  # stages whose input x_k a Fck kept: a checkpoint until B(k)
    forwarded: set[int] = set()
    backward_done: set[int] = set()
    events = []

    for k, op in enumerate(schedule.ops):
        kind, i = op
        fail = partial(_frozen_invalid, k, op)
        if kind == "Loss":
            if i != L:
                raise fail(f"the loss is stage {L} for this {L}-stage chain")
            if loss_done:
                raise fail("the loss runs once per step")
            if ("out", L) not in res:
                raise fail(f"the output x_{L} has not been computed (run every forward up to stage {L - 1} first)")
            created, freed, key_sizes = x[L], 0, [(("delta", L), x[L])]
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
            if not _frozen_input_available(res, i):
                raise fail(f"B{i} needs its input x_{i}, which is not resident")
            created = x[i]
            freed_keys = [("delta", i + 1), ("xbar", i)] + ([("x", i)] if i > 0 and ("x", i) in res else [])
            freed = sum(res[key] for key in freed_keys)
            for key in freed_keys:
                del res[key]
                spans[opened.pop(key)][4] = k
            key_sizes = [(("delta", i), x[i])]
            tmp, dt = chain.bwd_tmp[i], chain.bwd_time[i]
            backward_done.add(i)
            kept.discard(i)
        else:  # forward ops
            if i in backward_done:
                raise fail(f"the backward of stage {i} has already run; its forward is no longer needed")
            if not _frozen_input_available(res, i):
                raise fail(f"its input x_{i} is not resident (keep a checkpoint with Fck or recompute it)")
            if ("xbar", i) in res or (i + 1 < L and ("x", i + 1) in res):
                raise fail(f"x_{i + 1} is already resident; recomputing it would hold two copies")
            freed = 0
            if kind == "Fall":
                if i == L - 1 and ("out", L) not in res:
                    key_sizes = [(("out", L), x[L]), (("xbar", i), xbar[i] - x[L])]
                else:
                    key_sizes = [(("xbar", i), xbar[i])]
            else:
                if i + 1 in backward_done:
                    raise fail(f"its output x_{i + 1} is no longer needed (B{i + 1} has run); use Fall{i} to "
                               f"prepare B{i}")
                if i + 1 == L:
                    if ("out", L) in res:
                        raise fail(f"the output x_{L} is already held by the caller")
                    key_sizes = [(("out", L), x[L])]
                else:
                    key_sizes = [(("x", i + 1), x[i + 1])]
                if kind == "Fn":
                    if i == 0:
                        raise fail("x_0 is the caller's input and cannot be dropped; use Fck0")
                    if ("x", i) not in res:
                        raise fail(f"Fn drops its input, but x_{i} is part of x̄_{i} here; use Fck{i}")
                    if i in kept:
                        raise fail(f"x_{i} is a checkpoint kept by an earlier Fck{i}; checkpoints stay until B{i} "
                                   f"(use Fck{i})")
                    freed = res.pop(("x", i))
                    spans[opened.pop(("x", i))][4] = k
            created = sum(s for _, s in key_sizes)
            tmp, dt = chain.fwd_tmp[i], chain.fwd_time[i]
        recompute = kind in ("Fck", "Fn", "Fall") and i in forwarded
        if kind in ("Fck", "Fn", "Fall"):
            forwarded.add(i)
        if kind == "Fck":
            kept.add(i)
        for key, size in key_sizes:
            res[key] = size
            opened[key] = len(spans)
            spans.append([key[0], key[1], size, k, None])
        before = mem
        peak = before + created + tmp
        mem = before + created - freed
        events.append((k, op, t, t + dt, before, peak, mem, recompute))
        t += dt

    missing = [i for i in range(L - 1, -1, -1) if i not in backward_done]
    if missing or not loss_done:
        what = "the loss" if not loss_done else f"B{missing[0]}"
        raise InvalidSchedule(f"the schedule ends before {what}: a complete step runs the loss and B{L - 1}..B0",
                              len(schedule.ops))
    return events, [tuple(span) for span in spans]


def _frozen_invalid(k: int, op: Op, why: str) -> InvalidSchedule:
    return InvalidSchedule(f"op #{k} {op} is invalid: {why}", k)


def _frozen_input_available(res: dict, i: int) -> bool:
    """x_i is resident as a plain activation, or inside x̄_i (what Fall(i-1) left), or it is the caller's x_0."""
    return ("x", i) in res or (i > 0 and ("xbar", i - 1) in res)


# ----------------------------------------------------------------------------------------------------------------
# Exhaustive search with offloading (docs/design.md §9)
# ----------------------------------------------------------------------------------------------------------------
def all_remat_schedules(chain: Chain) -> list[tuple[Op, ...]]:
    """Every complete remat-only op sequence of the model (no budget), by depth-first search over :func:`step`; a
    path never revisits a state, so the search ends."""
    ops = all_ops(chain.length)
    out: list[tuple[Op, ...]] = []

    def dfs(state: State, path: tuple[Op, ...], seen: frozenset) -> None:
        if is_final(chain, state):
            out.append(path)
            return
        for op, nxt, _, _ in _successors(chain, state, ops, False):
            if nxt not in seen:
                dfs(nxt, path + (op,), seen | {nxt})

    start = initial_state(chain)
    dfs(start, (), frozenset({start}))
    return out


def brute_offload(chain: Chain, max_offloads: int = 1) -> list[tuple[int, float, Schedule]]:
    """Every remat-only sequence with up to ``max_offloads`` Off/Pre pairs inserted at *every* pair of positions
    (Off before Pre), each replayed by ``simulate`` (the judge; invalid ones are skipped): ``(peak, makespan,
    schedule)`` of each valid one. Knows nothing of the solver's gaps or look-ahead."""
    from hchain_viz.core.simulate import simulate

    found = []

    def insert(ops: tuple[Op, ...], left: int, lo_stage: int) -> None:
        try:
            trace = simulate(chain, Schedule(ops))
        except InvalidSchedule:
            trace = None
        if trace is not None:
            found.append((trace.peak_memory, trace.makespan, trace.schedule))
        if left == 0:
            return
        n = len(ops)
        for i in range(lo_stage, chain.length):
            for p in range(n + 1):
                for q in range(p + 1, n + 2):
                    new = ops[:p] + (Op("Off", i),) + ops[p:]
                    new = new[:q] + (Op("Pre", i),) + new[q:]
                    insert(new, left - 1, i + 1)

    for base in all_remat_schedules(chain):
        insert(base, max_offloads, 0)
    return found


def best_within(found: list[tuple[int, float, Schedule]], budget: int) -> float:
    return min((t for p, t, _ in found if p <= budget), default=INF)
