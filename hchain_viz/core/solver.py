"""The optimal solver (design.md §4): Rotor's dynamic programme, corrected for the memory model of docs/design.md §3.

``solve(chain)`` fills the DP tables once for every memory budget up to a maximum; the returned :class:`Solution`
answers any budget from the schedules the tables hold (``makespan``) and rebuilds the op list from the stored choices
(``schedule``), so a slider over budgets never re-solves.

The tables (``C[m, i, l]`` for a sub-chain that ends before the loss, ``D[m, i]`` for the spine that holds it), in
*slots*, their options, recurrences and guards, the two corrections to the published Rotor code, and the rounding of
budgets to slots are docs/design.md §4.1, §4.2 and §4.4; the kernels below follow them line by line. A
:class:`Solution` answers a budget with the fastest schedule whose exact peak (``_peaks``) fits it, from the tables
over the whole range, its bottom and the ladder between, the fastest schedule at exactly the least budget
(``_least_tree``) and, on first use, a far finer table near the limit (``Solution._near_limit_front``; §4.4). Shared
tensors (``chain.shared``, §8) are counted once (:func:`dp_sizes`, §4.1). The optimum is over schedules whose
checkpoints persist (§3.5); the least feasible budget is exact over all schedules.

Heavy lifting is in private Numba kernels over plain arrays (``_fill_table``, ``_rebuild``, and ``_least_memory``:
the least feasible budget, by the same recurrences with max/min in place of +/min); the public functions validate
their input and never hand Python objects to the kernels.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, NamedTuple

import numpy as np

from ..errors import DependencyError, HChainError, InfeasibleBudget, InvalidChain
from .chain import Chain
from .schedule import Op, Schedule
from .simulate import peak_and_makespan
from .strategies import baseline_frontier, store_all
from .units import format_bytes, format_time, parse_bytes

__all__ = ["Solution", "solve", "optimal_schedule"]

# Numba options of every kernel, in one place. cache: the compiled kernels persist on disk, so a fresh process pays
# only for loading them. fastmath stays off: the tie rule and the makespans must be bit-for-bit reproducible.
_NUMBA_OPTIONS = {"cache": True, "nogil": True, "fastmath": False, "error_model": "numpy", "boundscheck": False}

# The chain option wins unless the best leaf option is faster by more than this relative margin: on equal time (up to
# float reassociation, e.g. around zero-cost stages) nothing is recomputed.
_TIE_RTOL = 1e-12

# A leaf option is skipped at budgets where its least possible time exceeds the best so far by this relative margin
# (far above the tie rule's slack, far below any real difference: see _useful_end).
_PRUNE_RTOL = 1e-9

# The two tables of solve: the whole range, and its bottom up to _BOTTOM_SPAN (3/2) of the least budget (the whole
# range when narrower). Each is finer where a table is cheap: c = (_LONG / L)^2 is how much finer a table of L stages
# can be in the time of one at _LONG stages. The whole range gets ``slots / 2`` times c (at least 1), the bottom
# ``slots`` times c / 2 (at least _BOTTOM_SHARE[0]: its rows do more work per slot); both at most _BOTTOM_SHARE[1]
# times that and within _BOTTOM_BYTES while building. So L = 500 builds in the time of one table of ``slots``.
# Below _MIN_BOTTOM_SLOTS slots for each, one table serves.
_BOTTOM_SPAN = (3, 2)
_BOTTOM_SHARE = (0.2, 4.0)
_LONG = 300
_BOTTOM_BYTES = 128 * 2**20
_MIN_BOTTOM_SLOTS = 8
# Between the bottom table and the whole range, the ladder: tables spanning twice the bottom's, then doubling while
# below 2/3 of the whole range, each of _LADDER_SHARE of the whole table's slots. A table answers budgets near its top
# best (a schedule holds many items, each rounded to a slot), so each budget finds one at most twice its size; the
# whole range alone left random chains of 200 stages 3.9% behind a 4000-slot table at twice the least budget
# (docs/benchmarks.md). Only while the work of all tables (slots x L^3) stays within _LADDER_WORK, the work of
# L = 500 without a ladder: the build time of long chains stays as it was.
_LADDER_SHARE = (1, 4)
_LADDER_WORK = 350 * 500**3
# Rungs of fewer slots leave the middle of the range coarse: 140-slot rungs kept random(200, 17) within 0.72% of a
# 4000-slot table; 62-slot ones (L = 300) left 43 of 79 budgets more than 1% behind.
_LADDER_FINE = 128
# The whole-range table rounds a charge down when it exceeds whole slots by at most a fifth of a slot: its budgets
# are then nearer the truth on average (the exact peaks decide what fits). Measured in docs/benchmarks.md.
_ROUND_DOWN = (1, 5)
_BOTTOM_ROUND = (1, 5)
# The near-limit tables of a Solution (Solution._near_limit_front): budgets up to 1/50 above the least budget, one per
# rounding of _NEAR_ROUNDS (see _slot_sizes), each at most _NEAR_SLOTS slots and _REFINE_BYTES while building, all
# together at most this much work (slots x L^3: 8e9 is 2 x 500 slots at L = 200, about half a second). 0 turns them off
# (tests build their references without them).
_NEAR_SPAN = (1, 50)
_NEAR_WORK = 8e9
_NEAR_SLOTS = 2048
_NEAR_ROUNDS = ((0, 1), (1, 5))

# Choice codes in the tables: the chain option (also the base case i == l, and the loss), or infeasible; a leaf
# option stores its checkpoint index j > i.
_CHAIN = 0
_NONE = -1

# Op codes written by _rebuild.
_KINDS = ("Fck", "Fn", "Fall", "Loss", "B")

# Refuse tables that would not fit comfortably in memory (float64 times + int16 choices during the build).
_MAX_TABLE_BYTES = 8 * 2**30


# ------------------------------------------------------------------------------------------------------------------
# Kernels (compiled lazily by _kernels(): importing hchain_viz must not import Numba)
# ------------------------------------------------------------------------------------------------------------------
# Stages i whose C rows are filled together (one block): they read the same right-hand rows C[j, l], so each is
# fetched from memory once per block instead of once per row.
_BLOCK = 16
# Rows (i, l) of a block filled together over l (see _fill_table): each left row C[i, j-1] is read once per tile.
# 16 x 16 measured best at L = 500, 500 slots (2 cores; 8 x 8 took 1.2-1.5x as long, 32 x 32 no better).
_TILE = 16


def _row(L, i, l):  # noqa: E741  # pragma: no cover - runs compiled
    """Row of the pair (i, l), i <= l < L, in the C table (upper triangle, row by row)."""
    return i * L - (i * (i - 1)) // 2 + l - i


def _take_chain(out, cho, sub, t, shift, lo, keep):  # pragma: no cover - runs compiled
    """Merge the chain option (``t + sub[m - shift]`` for budgets m >= ``lo``) into the best leaf so far: the chain
    wins unless a leaf is faster by more than the tie margin (``keep`` = 1 + 1e-12; no pointless recomputation).
    ``sub`` is read at most at its last budget (see _sub_at)."""
    top = sub.shape[0] - 1
    for m in range(lo, out.shape[0]):
        cv = t + sub[_sub_at(m, shift, top)]
        v = out[m]
        leaf_wins = v * keep < cv
        out[m] = v if leaf_wins else cv
        cho[m] = cho[m] * leaf_wins  # _CHAIN is 0: a plain store, which LLVM vectorises


def _sub_at(m, shift, top):  # pragma: no cover - runs compiled
    """The budget the chain option's sub-chain gets: ``m - shift``, where ``shift`` = x̄_{i+1} less the transit part of
    x_i that Fall(i) frees (negative when it frees more than it leaves). Past the table's last budget ``top`` the
    sub-chain is read at ``top``: rows are non-increasing in m, so that schedule fits; exact when the table reaches
    store-all's peak (the default), where every row is constant already."""
    return min(m - shift, top)


def _bounds(x, xs, xbar, tr, co, ftmp, ntmp, btmp, G, LOC, SAT):  # pragma: no cover - runs compiled
    """Per pair (i, l), in slots: ``G`` the guard (design.md §4: the forwards of stages i..l-1 that run before Fall(i),
    while x_i is whole and δ_{l+1} resident; a leaf option with its checkpoint at j needs the part for stages
    i..j-1, ``G[i, j] - x[j+1] + x[l+1]``), ``LOC`` the least m of the chain option (the base case when i == l),
    ``SAT`` the least m from which the all-chain schedule ``Fall(i..l) B(l..i)`` fits. From SAT on nothing beats it
    (it runs each stage once) and the chain option, preferred on ties, is taken: C is constant there. ``tr[i]``: the
    transit part of x_i, freed by Fall(i), which B(i) and the rest of the chain option do without; ``co[i]`` its
    consumed part, freed by B(i), which the chain option's B(i-1) does without."""
    L = xbar.shape[0]
    for i in range(L - 1, -1, -1):
        need_b = x[i] + x[i + 1] + xbar[i] + btmp[i] - tr[i]  # B(i): δ_i, δ_{i+1}, x̄_{i+1} and its transient
        LOC[i, i] = max(x[i + 1] + xbar[i] + ftmp[i], need_b)  # base: Fall(i) with δ_{i+1} resident, B(i)
        SAT[i, i] = LOC[i, i]
        G[i, i] = 0
        run = xs[i, i + 1] + ntmp[i]  # Fck(i): x_i is the caller's
        for l in range(i + 1, L):  # noqa: E741
            if l - 1 > i:  # a later forward holds its input and output (their parts not in x_i)
                run = max(run, xs[i, l - 1] + xs[l - 1, l] + ntmp[l - 1])
            G[i, l] = run + x[l + 1]
            # Chain option: Fall(i) while δ_{l+1} is resident, [i+1..l] within m - (xbar[i] - tr[i]), then B(i),
            # by when the sub-chain's Fall(i+1) has freed the transit part of the x_{i+1} inside x̄_{i+1} and its
            # last op B(i+1) the consumed part. (The forwards of stages beyond i run inside the sub-chain, whose own
            # guard covers them.)
            shift = xbar[i] - tr[i]
            LOC[i, l] = max(x[l + 1] + xbar[i] + ftmp[i], need_b - tr[i + 1] - co[i + 1], shift)
            SAT[i, l] = max(LOC[i, l], shift + SAT[i + 1, l])


def _useful_end(out, ub, lo, hi, bound):  # pragma: no cover - runs compiled
    """The end of the budgets in ``[lo, hi)`` where a leaf option whose time is at least ``bound`` can still win.

    ``out`` is the best so far, ``ub`` the time of some valid schedule of the same sub-chain (an upper bound of the
    optimum). Both are non-increasing in m (every C row is), so the budgets where ``min(out, ub) < bound`` form a
    suffix: the leaf loses there, and the search for its start is binary. The margin ``_PRUNE_RTOL`` covers float
    rounding and the tie rule's slack (a chain option kept within 1e-12 of a leaf per level) so that nothing the full
    loop would have changed is skipped: the tables stay bit-for-bit the same."""
    limit = bound * (1.0 - _PRUNE_RTOL)
    if not min(out[hi - 1], ub[hi - 1]) < limit:
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if min(out[mid], ub[mid]) < limit:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _chain_time(u, sub, t, shift, lo):  # pragma: no cover - runs compiled
    """``u[m] = t + sub[m - shift]`` from ``lo`` on (the chain option's time over ``sub``, see _sub_at), ``inf``
    below."""
    top = sub.shape[0] - 1
    for m in range(lo):
        u[m] = np.inf
    for m in range(lo, u.shape[0]):
        u[m] = t + sub[_sub_at(m, shift, top)]


def _leaf(out, cho, right, left, f, j, ties):  # pragma: no cover - runs compiled
    """``out = min(out, f + right + left)`` elementwise, recording ``j`` where it wins (``ties``: also on equality).

    Over 1-D views (made by the caller: measurably faster than slicing here). The strict form, nearly all of the
    table's work, is written so that LLVM vectorises it: where the leaf loses, the store would write back the value
    just loaded, which LLVM turns into a masked store (microcoded, slower than scalar code on AMD's cores) or leaves
    scalar; ``r + 0.0`` (the same bits: times are never -0.0) and ``max`` for the choice (every strict caller takes
    j ascending over rows whose choices are _CHAIN = 0 or smaller j) make both plain stores. The tables stay
    bit-for-bit the same (checked against the previous kernel on 1,130 random chains)."""
    if ties:  # the same plain stores; j descends here, so the choice is blended rather than taken by max
        for k in range(out.shape[0]):
            v = f + right[k] + left[k]
            r = out[k]
            better = v <= r
            out[k] = v if better else r + 0.0
            c = cho[k]
            cho[k] = c + (j - c) * better
    else:
        jj = cho.dtype.type(j)
        for k in range(out.shape[0]):
            v = f + right[k] + left[k]
            r = out[k]
            better = v < r
            out[k] = v if better else r + 0.0
            cho[k] = max(cho[k], jj * cho.dtype.type(better))


def _leaves(C, Cch, U, F, G, SAT, x, xs, L, S1, ilo, ihi, j, l):  # noqa: E741  # pragma: no cover - runs compiled
    """Leaf options with the checkpoint at ``j`` (beyond the block, its rows final) for the rows (i, l) of the block
    ``i in [ilo, ihi]``: strict <, so over j ascending the smallest j wins ties. The right row C[j, l] is shared by
    these rows."""
    rj = _row(L, j, l)
    for i in range(ilo, ihi + 1):
        xj = xs[i, j]
        lo = max(G[i, j] - x[j + 1] + x[l + 1], xj)
        hi = min(S1, SAT[i, l])
        if lo < hi:
            r = _row(L, i, l)
            rl = _row(L, i, j - 1)
            f = F[i - ilo, j]
            hi = _useful_end(C[r], U[i - ilo], lo, hi, f + C[rj, S1 - 1] + C[rl, S1 - 1])
            if lo < hi:
                _leaf(C[r, lo:hi], Cch[r, lo:hi], C[rj, lo - xj:hi - xj], C[rl, lo:hi], f, j, False)


def _finish(C, Cch, u, F, G, LOC, SAT, x, xs, xbar, tr, fwd, bwd, L, S1, ilo, i, top, l, keep):  # noqa: E741  # pragma: no cover
    """Finish row (i, l) once the rows (j, l) of the block above i are final: leaves with j in the block,
    descending with <= so the smallest j wins ties; then the chain option (preferred on ties); ``u`` is scratch."""
    r = _row(L, i, l)
    out = C[r]
    cho = Cch[r]
    t = fwd[i] + bwd[i]
    lo = LOC[i, l]
    shift = xbar[i] - tr[i]
    if i < l:  # the chain option's time bounds the leaves below
        _chain_time(u, C[_row(L, i + 1, l)], t, shift, min(lo, S1))
    hi = min(S1, SAT[i, l])
    for j in range(top, i, -1):
        xj = xs[i, j]
        lo_j = max(G[i, j] - x[j + 1] + x[l + 1], xj)
        if lo_j < hi:
            rj = _row(L, j, l)
            rl = _row(L, i, j - 1)
            f = F[i - ilo, j]
            end = _useful_end(out, u, lo_j, hi, f + C[rj, S1 - 1] + C[rl, S1 - 1])
            if lo_j < end:
                _leaf(out[lo_j:end], cho[lo_j:end], C[rj, lo_j - xj:end - xj], C[rl, lo_j:end], f, j, True)
    if i == l:
        for m in range(lo, S1):
            out[m] = t
    elif lo < S1:
        _take_chain(out, cho, C[_row(L, i + 1, l)], t, shift, lo, keep)
    for m in range(S1):
        if out[m] == np.inf:
            cho[m] = _NONE


def _tile(x, xs, xbar, tr, fwd, bwd, call, C, Cch, G, LOC, SAT, F, U, ihi, la):  # pragma: no cover - runs compiled
    """Fill the rows (i, l) of the block of stages ``i in [ilo, ihi]`` for the columns ``l`` of one tile: the block's
    own columns when ``la <= ihi`` (then also its forward sums ``F``, plus ``call``: a leaf's checkpoint x_j starts
    the backward call of [j..l]), else ``l in [la, la + _TILE)``. Reads the
    block's earlier columns and, for the leaves beyond the block, the rows C[j, l] of every later block (j > ihi) at
    these columns, which must be final. ``F`` and ``U`` are the caller's scratch (``F`` kept across the block's
    tiles).

    Per row the options are taken in one fixed order: leaves with j beyond the block ascending, leaves with j in the
    block descending, the chain option. Nearly all the time is memory traffic over rows of C: a tile reads each left
    row C[i, j-1] once for its _TILE rows (i, l), each right row C[j, l] once for the block's rows, while the tile's
    own rows stay in cache."""
    L = xbar.shape[0]
    S1 = C.shape[1]
    keep = 1.0 + _TIE_RTOL
    ilo = max(0, ihi - _BLOCK + 1)
    if la <= ihi:  # the block's own columns: no checkpoint beyond the block yet
        for i in range(ilo, ihi + 1):
            s = 0.0
            for j in range(i + 1, L + 1):
                s += fwd[j - 1]
                F[i - ilo, j] = s + call
        for l in range(ilo, ihi + 1):  # noqa: E741
            for i in range(ilo, l + 1):
                C[_row(L, i, l)] = np.inf
                Cch[_row(L, i, l)] = _CHAIN
            for i in range(l, ilo - 1, -1):
                _finish(C, Cch, U[0, 0], F, G, LOC, SAT, x, xs, xbar, tr, fwd, bwd, L, S1, ilo, i, l, l, keep)
        return
    lb = min(L - 1, la + _TILE - 1)
    # U[l - la, i - ilo]: the time of a valid schedule of (i, l) per budget, which prunes leaf options: Fall(i..ihi)
    # around the final row (ihi+1, l), for the leaves beyond the block.
    for l in range(la, lb + 1):  # noqa: E741
        for i in range(ihi, ilo - 1, -1):
            C[_row(L, i, l)] = np.inf
            Cch[_row(L, i, l)] = _CHAIN
            sub = C[_row(L, ihi + 1, l)] if i == ihi else U[l - la, i + 1 - ilo]
            _chain_time(U[l - la, i - ilo], sub, fwd[i] + bwd[i], xbar[i] - tr[i], min(LOC[i, l], S1))
    for j in range(ihi + 1, la + 1):  # checkpoints j <= la: their left rows C[i, j-1] are final for the whole tile
        for l in range(la, lb + 1):  # noqa: E741
            _leaves(C, Cch, U[l - la], F, G, SAT, x, xs, L, S1, ilo, ihi, j, l)
    for l in range(la, lb + 1):  # noqa: E741
        for j in range(la + 1, l + 1):  # left rows of the tile, final now
            _leaves(C, Cch, U[l - la], F, G, SAT, x, xs, L, S1, ilo, ihi, j, l)
        for i in range(ihi, ilo - 1, -1):
            _finish(C, Cch, U[l - la, i - ilo], F, G, LOC, SAT, x, xs, xbar, tr, fwd, bwd, L, S1, ilo, i, ihi, l,
                    keep)


def _columns(ihi, L):  # pragma: no cover - runs compiled
    """The first column of each tile of the block that ends at ``ihi``: its own columns first, then tiles of _TILE
    (the blocks are aligned from the last stage, so each tile is exactly a later block's columns)."""
    return [max(0, ihi - _BLOCK + 1)] + list(range(ihi + 1, L, _TILE))


def _fill_blocks(x, xs, xbar, tr, fwd, bwd, call, C, Cch, G, LOC, SAT):  # pragma: no cover - runs compiled
    """Every block of C on this thread: blocks from the last stage down, each tile by tile."""
    L = xbar.shape[0]
    F = np.empty((_BLOCK, L + 1))
    U = np.empty((_TILE, _BLOCK, C.shape[1]))
    for ihi in range(L - 1, -1, -_BLOCK):
        for la in _columns(ihi, L):
            _tile(x, xs, xbar, tr, fwd, bwd, call, C, Cch, G, LOC, SAT, F, U, ihi, la)


def _fill_chains(x, xs, xbar, tr, fwd, bwd, call, C, Cch, G, LOC, SAT):  # pragma: no cover - runs compiled
    """C with the chain option only (``solve(single_level=True)``): every sub-chain after the loss runs storing
    everything, so a checkpoint region of the spine is recomputed once, its stages plainly (no region inside it).
    O(S·L²): rows (i, l) for l ascending, i descending (the chain option reads (i+1, l))."""
    L = xbar.shape[0]
    S1 = C.shape[1]
    keep = 1.0 + _TIE_RTOL
    F = np.empty((1, L + 1))  # unread: _finish's leaf loop is empty when top == i
    u = np.empty(S1)
    for l in range(L):  # noqa: E741
        for i in range(l, -1, -1):
            C[_row(L, i, l)] = np.inf
            Cch[_row(L, i, l)] = _CHAIN
            _finish(C, Cch, u, F, G, LOC, SAT, x, xs, xbar, tr, fwd, bwd, L, S1, i, i, i, l, keep)


def _spine(x, xs, xbar, tr, co, ftmp, ntmp, btmp, fwd, bwd, call, C, D, Dch, floor):  # pragma: no cover
    """Fill D (rows i = 0..L) and its choices from the final C: the spine with the loss. D[., L] is the loss
    (creates δ_L), then i = L-1 .. 0. ``floor``: the least budget the spine may leave at the loss (0: any that holds
    δ_L); a pipeline stage bounds what a microbatch stores this way (core/in_flight.py)."""
    L = xbar.shape[0]
    S1 = C.shape[1]
    inf = np.inf
    keep = 1.0 + _TIE_RTOL
    at_loss = max(x[L], floor)
    for m in range(S1):  # δ_L
        D[L, m] = 0.0 if m >= at_loss else inf
        Dch[L, m] = _CHAIN if m >= at_loss else _NONE
    for i in range(L - 1, -1, -1):
        out = D[i]
        cho = Dch[i]
        out[:] = inf
        cho[:] = _CHAIN
        g = xs[i, i + 1] + ntmp[i]  # the guard: forwards of i..j-1 before Fall(i), with x_i whole
        xL = xs[i, L]  # the held output, less what x_i holds of it
        # Leaf options: Fck(i) Fn(i+1..j-1), [j..L] with x_j charged (its own backward call), then [i..j-1] after the
        # loss, with the held output x_L charged.
        fs = 0.0
        for j in range(i + 1, L + 1):
            if j - 1 > i:
                g = max(g, xs[i, j - 1] + xs[j - 1, j] + ntmp[j - 1])
            fs += fwd[j - 1]
            xj = xs[i, j]
            lo = max(g, xj, xL)
            if lo < S1:
                _leaf(out[lo:], cho[lo:], D[j, lo - xj:], C[_row(L, i, j - 1), lo - xL:S1 - xL], fs + call, j, False)
        # Chain option: Fall(i), [i+1..L] within m - xbar[i], B(i), which also holds x_L beside x̄_{i+1} unless
        # x_L is inside it (i == L-1); x_L was computed from the x_{i+1} inside x̄_{i+1}, so it costs what it does
        # beside x_{i+1}.
        # (by B(i), the sub-spine's Fall(i+1) has freed the transit part of x_{i+1}, and its B(i+1) the consumed
        # part; tr[L] = co[L] = 0)
        need_b = (x[i] + x[i + 1] + xbar[i] + btmp[i] + (0 if i == L - 1 else xs[i + 1, L]) - tr[i] - tr[i + 1]
                  - co[i + 1])
        shift = xbar[i] - tr[i]
        lo = max(xbar[i] + ftmp[i], need_b, shift)
        t = fwd[i] + bwd[i]
        if lo < S1:
            _take_chain(out, cho, D[i + 1], t, shift, lo, keep)
        for m in range(S1):
            if out[m] == inf:
                cho[m] = _NONE


def _rebuild(xs, xbar, tr, Cch, Dch, m0, out):  # pragma: no cover - runs compiled
    """Write the ops of the optimal schedule for ``D[m0, 0]`` into ``out`` (rows: kind code, stage); return their
    count, or -1 if ``out`` is too short. An explicit stack replaces the recursion: task kinds 0 = D(m, i),
    1 = C(m, i, l), 2 = emit B(i)."""
    L = xbar.shape[0]
    top_m = Cch.shape[1] - 1
    stack = np.empty((2 * L + 8, 4), np.int64)  # one pending task per nesting level, levels <= L + 1
    stack[0, 0] = 0
    stack[0, 1] = m0
    stack[0, 2] = 0
    stack[0, 3] = L
    top = 1
    n = 0
    cap = out.shape[0]
    while top > 0:
        top -= 1
        task = stack[top, 0]
        m = stack[top, 1]
        i = stack[top, 2]
        l = stack[top, 3]  # noqa: E741
        if task == 2 or (task == 0 and i == L):  # B(i), or the loss
            if n >= cap:
                return -1
            out[n, 0] = 4 if task == 2 else 3
            out[n, 1] = i
            n += 1
            continue
        j = Dch[i, m] if task == 0 else Cch[_row(L, i, l), m]
        if j == _CHAIN:  # Fall(i), the rest within m - (xbar[i] - tr[i]), then B(i)
            if n >= cap:
                return -1
            out[n, 0] = 2
            out[n, 1] = i
            n += 1
            stack[top, 0] = 2
            stack[top, 2] = i
            top += 1
            if task == 0 or i < l:
                stack[top, 0] = task
                stack[top, 1] = _sub_at(m, xbar[i] - tr[i], top_m)
                stack[top, 2] = i + 1
                stack[top, 3] = l
                top += 1
        else:  # Fck(i) Fn(i+1..j-1), then [j..l] with x_j charged, then [i..j-1]
            if n + j - i > cap:
                return -1
            out[n, 0] = 0
            out[n, 1] = i
            n += 1
            for k in range(i + 1, j):
                out[n, 0] = 1
                out[n, 1] = k
                n += 1
            stack[top, 0] = 1
            stack[top, 1] = m - xs[i, L] if task == 0 else m
            stack[top, 2] = i
            stack[top, 3] = j - 1
            top += 1
            stack[top, 0] = task
            stack[top, 1] = m - xs[i, j]
            stack[top, 2] = j
            stack[top, 3] = l
            top += 1
    return n


def _peaks(xs, xbar, tr, Cch, Dch, starts, ex, exs, eloc, eg, egd, edloc, eshift, out):  # pragma: no cover
    """The exact peak (bytes) of the table's schedule for each start budget ``starts[k]`` (slots, as ``_rebuild``
    takes ``m0``), written to ``out[k]``. The walk follows ``_rebuild``'s choices (slot sizes ``xs``, ``xbar``,
    ``tr`` track the budgets) and charges each node the conditions of its option in exact bytes (``ex``: the δ
    sizes; ``exs``: ``xs``; ``eloc``/``eg``: ``_bounds``'s LOC and G; ``egd[i, j]``: a spine leaf's guard;
    ``edloc[i]``: the spine chain option's conditions; ``eshift[i]``: x̄_{i+1} less the transit part of x_i). Every
    condition is ``offset + constant`` and a child's offset adds to its parent's, so the peak is the largest
    ``offset + constant`` over the tree: the least budget at which these exact recurrences accept the schedule,
    the simulator's peak (tests/test_solver.py)."""
    L = xbar.shape[0]
    top_m = Cch.shape[1] - 1
    stack = np.empty((2 * L + 8, 5), np.int64)  # task (0 = D, 1 = C), m, i, l, offset in bytes
    for k in range(starts.shape[0]):
        stack[0, 0] = 0
        stack[0, 1] = starts[k]
        stack[0, 2] = 0
        stack[0, 3] = L
        stack[0, 4] = 0
        top = 1
        peak = 0
        while top > 0:
            top -= 1
            task = stack[top, 0]
            m = stack[top, 1]
            i = stack[top, 2]
            l = stack[top, 3]  # noqa: E741
            a = stack[top, 4]
            if task == 0 and i == L:  # the loss: δ_L
                peak = max(peak, a + ex[L])
                continue
            j = Dch[i, m] if task == 0 else Cch[_row(L, i, l), m]
            if j == _CHAIN:
                peak = max(peak, a + (edloc[i] if task == 0 else eloc[i, l]))
                if task == 0 or i < l:
                    stack[top, 0] = task
                    stack[top, 1] = _sub_at(m, xbar[i] - tr[i], top_m)
                    stack[top, 2] = i + 1
                    stack[top, 3] = l
                    stack[top, 4] = a + eshift[i]
                    top += 1
            else:
                if task == 0:
                    peak = max(peak, a + egd[i, j])
                    stack[top, 1] = m - xs[i, L]
                    stack[top, 4] = a + exs[i, L]
                else:
                    peak = max(peak, a + max(eg[i, j] - ex[j + 1] + ex[l + 1], exs[i, j]))
                    stack[top, 1] = m
                    stack[top, 4] = a
                stack[top, 0] = 1
                stack[top, 2] = i
                stack[top, 3] = j - 1
                top += 1
                stack[top, 0] = task
                stack[top, 1] = m - xs[i, j]
                stack[top, 2] = j
                stack[top, 3] = l
                stack[top, 4] = a + exs[i, j]
                top += 1
        out[k] = peak


def _spine_bounds(x, xs, xbar, tr, co, ftmp, ntmp, btmp, GD, DLOC):  # pragma: no cover - runs compiled
    """Per spine stage i (as ``_spine`` states them): ``GD[i, j]`` the guard of the leaf option with its checkpoint
    at j, ``DLOC[i]`` the least m of the chain option (before its sub-spine)."""
    L = xbar.shape[0]
    for i in range(L - 1, -1, -1):
        g = xs[i, i + 1] + ntmp[i]
        for j in range(i + 1, L + 1):
            if j - 1 > i:
                g = max(g, xs[i, j - 1] + xs[j - 1, j] + ntmp[j - 1])
            GD[i, j] = max(g, xs[i, j], xs[i, L])
        need_b = (x[i] + x[i + 1] + xbar[i] + btmp[i] + (0 if i == L - 1 else xs[i + 1, L]) - tr[i] - tr[i + 1]
                  - co[i + 1])
        DLOC[i] = max(xbar[i] + ftmp[i], need_b, xbar[i] - tr[i])


def _least_memory(x, xs, xbar, tr, co, ftmp, ntmp, btmp):  # pragma: no cover - runs compiled
    """The least m for which ``D[m, 0]`` is finite: the same recurrences with feasibility thresholds composed by
    ``max`` (all of an option's conditions) and ``min`` (the best option). O(L^3), no slots."""
    L = xbar.shape[0]
    big = np.iinfo(np.int64).max // 4
    Cm = np.empty((L, L), np.int64)
    for d in range(L):
        for i in range(L - d):
            l = i + d  # noqa: E741
            need_b = x[i] + x[i + 1] + xbar[i] + btmp[i] - tr[i]
            if d == 0:
                Cm[i, l] = max(x[i + 1] + xbar[i] + ftmp[i], need_b)
                continue
            best = max(x[l + 1] + xbar[i] + ftmp[i], need_b - tr[i + 1] - co[i + 1], xbar[i] - tr[i] + Cm[i + 1, l])
            g = xs[i, i + 1] + ntmp[i]  # the leaf's guard: forwards of i..j-1 with x_i whole
            for j in range(i + 1, l + 1):
                if j - 1 > i:
                    g = max(g, xs[i, j - 1] + xs[j - 1, j] + ntmp[j - 1])
                best = min(best, max(g + x[l + 1], xs[i, j] + Cm[j, l], Cm[i, j - 1]))
            Cm[i, l] = best
    Dm = np.empty(L + 1, np.int64)
    Dm[L] = x[L]  # δ_L
    for i in range(L - 1, -1, -1):
        xL = xs[i, L]
        need_b = (x[i] + x[i + 1] + xbar[i] + btmp[i] + (0 if i == L - 1 else xs[i + 1, L]) - tr[i] - tr[i + 1]
                  - co[i + 1])
        best = max(xbar[i] + ftmp[i], need_b, xbar[i] - tr[i] + Dm[i + 1])
        g = xs[i, i + 1] + ntmp[i]
        for j in range(i + 1, L + 1):
            if j - 1 > i:
                g = max(g, xs[i, j - 1] + xs[j - 1, j] + ntmp[j - 1])
            best = min(best, max(g, xs[i, j] + Dm[j], xL + Cm[i, j - 1]))
        Dm[i] = min(best, big)
    return Dm[0]


def _least_tree(x, xs, xbar, tr, co, ftmp, ntmp, btmp, fwd, bwd, call, Cc, Dc):  # pragma: no cover - runs compiled
    """The fastest schedule among those that ``_least_memory``'s recurrences give the least budget, option by option
    (least requirement first, then least time; the chain option, then the smallest j, on ties): its choices in the
    one-column tables ``Cc`` and ``Dc`` (rows as in C and D), for ``_rebuild`` with every size 0. Returns (least
    budget less x_0, time less the top-level backward call). Exact in bytes, O(L^3), no slots."""
    L = xbar.shape[0]
    Cm = np.empty((L, L), np.int64)
    Ct = np.empty((L, L))
    for d in range(L):
        for i in range(L - d):
            l = i + d  # noqa: E741
            r = _row(L, i, l)
            need_b = x[i] + x[i + 1] + xbar[i] + btmp[i] - tr[i]
            Cc[r, 0] = _CHAIN
            if d == 0:
                Cm[i, l] = max(x[i + 1] + xbar[i] + ftmp[i], need_b)
                Ct[i, l] = fwd[i] + bwd[i]
                continue
            best = max(x[l + 1] + xbar[i] + ftmp[i], need_b - tr[i + 1] - co[i + 1], xbar[i] - tr[i] + Cm[i + 1, l])
            bt = fwd[i] + bwd[i] + Ct[i + 1, l]
            g = xs[i, i + 1] + ntmp[i]
            f = call
            for j in range(i + 1, l + 1):
                if j - 1 > i:
                    g = max(g, xs[i, j - 1] + xs[j - 1, j] + ntmp[j - 1])
                f += fwd[j - 1]
                m = max(g + x[l + 1], xs[i, j] + Cm[j, l], Cm[i, j - 1])
                t = f + Ct[j, l] + Ct[i, j - 1]
                if m < best or (m == best and t < bt):
                    best, bt = m, t
                    Cc[r, 0] = j
            Cm[i, l] = best
            Ct[i, l] = bt
    Dm = np.empty(L + 1, np.int64)
    Dt = np.empty(L + 1)
    Dm[L] = x[L]
    Dt[L] = 0.0
    Dc[L, 0] = _CHAIN
    for i in range(L - 1, -1, -1):
        xL = xs[i, L]
        need_b = (x[i] + x[i + 1] + xbar[i] + btmp[i] + (0 if i == L - 1 else xs[i + 1, L]) - tr[i] - tr[i + 1]
                  - co[i + 1])
        best = max(xbar[i] + ftmp[i], need_b, xbar[i] - tr[i] + Dm[i + 1])
        bt = fwd[i] + bwd[i] + Dt[i + 1]
        Dc[i, 0] = _CHAIN
        g = xs[i, i + 1] + ntmp[i]
        f = call
        for j in range(i + 1, L + 1):
            if j - 1 > i:
                g = max(g, xs[i, j - 1] + xs[j - 1, j] + ntmp[j - 1])
            f += fwd[j - 1]
            m = max(g, xs[i, j] + Dm[j], xL + Cm[i, j - 1])
            t = f + Dt[j] + Ct[i, j - 1]
            if m < best or (m == best and t < bt):
                best, bt = m, t
                Dc[i, 0] = j
        Dm[i] = best
        Dt[i] = bt
    return Dm[0], Dt[0]


# NOTE [filling the tables] (docs/design.md §4.3)
# - Order: stages i descending, in blocks of _BLOCK; for each block, its own columns l, then l ascending in tiles of
#   _TILE (``_tile``); then every entry read is final (C[j, l] has j > i, C[i, j-1] has j-1 < l; sizes of 0 read the
#   same m of those rows). m is innermost. The spine D comes last.
# - Tie rule (the twin in tests/oracles.py follows it): among leaf options the least time wins, the smallest j on
#   equal time; the chain option wins unless the best leaf is faster by more than _TIE_RTOL (relative).
# - Pruning (exact: the tables are bit-for-bit those of the plain loops): a leaf is skipped at the budgets where its
#   least possible time already exceeds a known schedule's (_useful_end).
# - Threads (``_wavefront``) take whole blocks, and a tile waits only for the same columns of the block above it, so
#   the tables do not depend on the thread count, and a thread that waits sleeps instead of spinning.
def _fill_table(x, xs, xbar, tr, co, ftmp, ntmp, btmp, fwd, bwd, call, C, Cch, D, Dch, threads: int,
                single_level: bool = False) -> None:
    """Fill C and D and their choices in place, on ``threads`` threads (docs/design.md §4.2, §4.3).

    Args:
        x, xs, xbar, tr, co, ftmp, ntmp, btmp: sizes in slots (``_slot_sizes``): ``x`` (L+2 entries, x[L+1] = 0) sizes
            the gradients δ; ``xs[i, j]`` the part of x_j not in x_i, what x_j costs while x_i is resident (§8);
            ``xbar`` the part of x̄_{i+1} not in x_i; ``tr[i]`` / ``co[i]`` the transit / consumed part of x_i
            (rounded down), which Fall(i) / B(i) frees; the temporaries of Fall, of Fck/Fn and of B.
        fwd, bwd: per-stage seconds.
        call: seconds of a backward call (``chain.backward_call``), charged to each leaf option, whose checkpoint
            x_j starts a graph of its own; the chain option joins Fall(i+1) to stage i's graph (``simulate._joins``).
            The top-level call is the caller's to add.
        C, Cch, D, Dch: the tables and their choices (C's rows: pairs (i, l), see ``_row``; columns m = 0..S; D's rows
            i = 0..L).
        threads: threads for C's blocks (``_wavefront``); the tables do not depend on the count.
        single_level: C without leaf options (``_fill_chains``), one thread; the spine as always.

    Order, tie rule and pruning: NOTE [filling the tables] above.
    """
    k = _kernels()
    L = xbar.shape[0]
    G, LOC, SAT = (np.empty((L, L), np.int64) for _ in range(3))
    k["bounds"](x, xs, xbar, tr, co, ftmp, ntmp, btmp, G, LOC, SAT)
    blocks = -(-L // _BLOCK)
    if single_level:
        k["chains"](x, xs, xbar, tr, fwd, bwd, call, C, Cch, G, LOC, SAT)
    elif threads <= 1 or blocks < 2:
        k["blocks"](x, xs, xbar, tr, fwd, bwd, call, C, Cch, G, LOC, SAT)
    else:
        _wavefront(k, (x, xs, xbar, tr, fwd, bwd, call, C, Cch, G, LOC, SAT), L, C.shape[1], min(threads, blocks))
    k["spine"](x, xs, xbar, tr, co, ftmp, ntmp, btmp, fwd, bwd, call, C, D, Dch, 0)


def _wavefront(k: dict[str, Any], args: tuple, L: int, S1: int, threads: int) -> None:
    """C's blocks on ``threads`` threads. Each thread takes the next block not yet taken, counted from the last
    stage, and fills it tile by tile (``_tile``, compiled without the GIL). A tile needs the rows of every later block
    at its columns; the block just above has them once it has finished those columns itself (it waited for the one
    above it), so each block follows the block above one tile behind. Waiting is on a condition, never a spinning
    barrier: with a core taken by other work, a thread that waits costs nothing (OpenMP's barriers measured 2.8x
    slower than one thread at L = 500)."""
    tops = list(range(L - 1, -1, -_BLOCK))
    done = [0] * len(tops)  # columns l < done[b] of block b are final
    taken = [0]  # blocks taken so far
    failed: list[BaseException] = []
    cond = threading.Condition()

    def ready(b: int, end: int) -> bool:
        return done[b - 1] >= end or bool(failed)

    def work() -> None:
        F = np.empty((_BLOCK, L + 1))
        U = np.empty((_TILE, _BLOCK, S1))
        try:
            while True:
                with cond:
                    b = taken[0]
                    taken[0] += 1
                if b >= len(tops) or failed:
                    return
                ihi = tops[b]
                for la in k["columns"](ihi, L):
                    end = ihi + 1 if la <= ihi else min(L, la + _TILE)
                    if la > ihi:
                        with cond:
                            cond.wait_for(lambda b=b, end=end: ready(b, end))
                            if failed:
                                return
                    k["tile"](*args, F, U, ihi, la)
                    with cond:
                        done[b] = end
                        cond.notify_all()
        except BaseException as e:  # noqa: BLE001  # handed to the caller; the other threads stop waiting
            with cond:
                failed.append(e)
                cond.notify_all()

    helpers = [threading.Thread(target=work, daemon=True) for _ in range(1, threads)]
    for t in helpers:
        t.start()
    work()
    for t in helpers:
        t.join()
    if failed:
        raise failed[0]


_compiled: dict[str, Any] = {}


def _busy_cores() -> int:
    """Cores other work is using now: runnable threads system-wide (``procs_running`` of ``/proc/stat``, an
    instantaneous count, unlike the load average) less this one, the least of up to three looks a millisecond apart
    (a thread that is just finishing counts once at most; the first look that sees nothing busy ends it). 0 where
    unknown."""
    least = None
    try:
        for k in range(3):
            with open("/proc/stat", "rb") as f:
                for line in f:
                    if line.startswith(b"procs_running"):
                        n = int(line.split()[1]) - 1
                        least = n if least is None else min(least, n)
                        break
            if least == 0:  # nothing busy: no need to look again (a sleep costs 1 ms, far more on a loaded machine)
                break
            if k < 2:
                time.sleep(0.001)
    except (OSError, ValueError):
        return 0
    return max(0, least or 0)


def solver_threads(requested: int | None = None) -> int:
    """How many threads a table fill uses: ``requested`` (capped at the cores this process may run on), or by default
    those cores that nothing else is using now (at least 1). A thread on a core that other work holds would hold up
    every block below its own (``_wavefront``), so the default never counts on a busy core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if requested is not None:
        return max(1, min(int(requested), cores))
    return max(1, cores - _busy_cores())


def _kernels() -> dict[str, Any]:
    """Compile (or load from Numba's on-disk cache) the kernels on first use."""
    if not _compiled:
        try:
            import numba
        except ImportError:
            raise DependencyError("the solver needs Numba: pip install numba (it comes with pip install hchain_viz)") \
                from None

        # Callees first: a kernel resolves the helpers it calls through the module globals when it compiles.
        g = globals()
        for name in ("_row", "_sub_at", "_take_chain", "_bounds", "_useful_end", "_chain_time", "_leaf", "_leaves",
                     "_finish", "_tile", "_columns", "_fill_blocks", "_fill_chains", "_spine", "_rebuild",
                     "_least_memory", "_peaks", "_spine_bounds", "_least_tree"):
            g[name] = numba.njit(**_NUMBA_OPTIONS)(g[name])
        _compiled.update(fill=_fill_table, bounds=_bounds, tile=_tile, columns=_columns, blocks=_fill_blocks,
                         chains=_fill_chains, spine=_spine, rebuild=_rebuild, least=_least_memory,
                         peaks=_peaks, spine_bounds=_spine_bounds,
                         least_tree=_least_tree)
    return _compiled


# ------------------------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------------------------
class Solution:
    """The optimal makespan and schedule for every budget up to ``max_budget``, from the DP tables of :func:`solve`.

    Attributes (bytes and seconds): ``chain``; ``max_budget``; ``slots`` (the memory resolution asked of
    :func:`solve`); ``single_level`` (answers only with schedules that recompute each stage at most once, see
    :func:`solve`); ``unit`` (bytes per slot of the whole-range table); ``min_budget`` (the least budget with an
    answer: the exact least feasible budget, see :func:`least_budget`, unless ``single_level``; None when nothing fits
    up to ``max_budget``); ``store_all_peak`` (peak of storing everything; at or above it the answer is exactly
    store-all, ``chain.store_all_time``).

    Budgets above ``max_budget`` are answered as ``max_budget``. The answer at budget b is the fastest schedule of
    the tables (with, from the first answer on, a far finer one up to 2% above the least budget: the first answer
    takes up to about half a second longer) whose exact (simulated) peak is at most b, so it never exceeds b and
    never gets slower as b grows (docs/design.md §4), or the fastest :mod:`~hchain_viz.core.strategies` baseline
    whose simulated peak fits when that is faster still (docs/design.md §10;
    :func:`~hchain_viz.core.strategies.baseline_frontier`, computed on first use and cached per chain, shared with
    the explorer's baseline points). A schedule's ``meta["source"]`` says which it
    is: ``"dp"`` or ``"baseline:<family>(<setting>)"`` (e.g. ``"baseline:periodic(3)"``). For a single budget,
    :func:`optimal_schedule` also re-solves at a finer resolution (``"dp-refined"``).
    """

    def __init__(self, chain: Chain, max_budget: int, slots: int, store_all_peak: int, tables: list[_Table],
                 single_level: bool = False, coarse: bool = False) -> None:
        self.chain = chain
        self.single_level = single_level
        # Long chains: the ladder of tables was cut short to build in time, so answers in the middle of the range
        # may be a few percent slower than refined() finds (docs/design.md §4.4)
        self.coarse = coarse
        self.max_budget = int(max_budget)
        self.slots = int(slots)
        self.store_all_peak = int(store_all_peak)
        self._tables = tuple(tables)  # the whole range first, then the bottom table if any (see solve)
        self._store_all_time = chain.store_all_time
        self._lock = threading.Lock()  # the front is computed once, on first use (see _front)
        self._cache: dict[str, Any] = {}  # the front and the baselines, computed on first use
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"a Solution is read-only; solve again to change {name!r}")
        object.__setattr__(self, name, value)

    def _front(self) -> tuple[np.ndarray, np.ndarray, list]:
        """(exact peaks, times, where) of the answers' Pareto front over every table's schedules, peaks increasing;
        ``where[k]`` is ``(table, m)`` (its start in that table) or the schedule's ops. Computed on first use: with the
        near-limit table (``_near_limit_front``) when the least budget is within ``max_budget``."""
        with self._lock:
            if "front" not in self._cache:
                peaks, times, where = [], [], []
                for k, table in enumerate(self._tables):
                    starts = self._candidates(table)
                    peaks.append(_exact_peaks(self.chain, table, starts))
                    times.append(table.times[starts])
                    where += [(k, m) for m in starts.tolist()]
                near = self._near_limit_front()
                if near is not None:
                    peaks.append(near[0])
                    times.append(near[1])
                    where += near[2]
                peak_all, time_all = np.concatenate(peaks), np.concatenate(times)
                sat = self._store_all_time  # within the tie margin of store-all time is store-all time
                time_all = np.where(time_all <= sat * (1.0 + _TIE_RTOL), sat, time_all)
                keep, cur_t = [], math.inf
                for n in np.lexsort((time_all, peak_all)).tolist():  # by exact peak: counts only if faster than all
                    if time_all[n] * (1.0 + _TIE_RTOL) < cur_t:  # below
                        keep.append(n)
                        cur_t = time_all[n]
                self._cache["front"] = (peak_all[keep], time_all[keep], [where[n] for n in keep])
            return self._cache["front"]

    def _candidates(self, table: _Table) -> np.ndarray:
        """The least slot of each time ``table`` reaches (its schedule fits the fewest slots): the answers are these
        schedules' Pareto front in exact bytes, not in slots (docs/design.md §4)."""
        t = np.where(table.times <= self._store_all_time * (1.0 + _TIE_RTOL), self._store_all_time, table.times)
        cand, cur_t = [], math.inf
        for m in range(t.shape[0]):  # a few thousand slots at most: a plain loop is fine here, once
            if t[m] * (1.0 + _TIE_RTOL) < cur_t:
                cand.append(m)
                cur_t = t[m]
        return np.array(cand, np.int64)

    def _near_limit_front(self) -> tuple[np.ndarray, np.ndarray, list] | None:
        """(exact peaks, times, ops) of the schedules of tables over budgets up to ``_NEAR_SPAN`` above the least
        budget, as fine as ``_NEAR_WORK`` allows (one exact table when every size shares a divisor that makes it
        affordable, else one per rounding of ``_NEAR_ROUNDS``): near the least budget the whole-range tables'
        rounding to slots decides which schedules fit, and these slots are far smaller (docs/design.md §4). Only the
        schedules are kept, not the tables. None when the tables are exact already, the least budget is above
        ``max_budget``, or ``single_level``."""
        least = self._tables[-1].max_budget if self._tables[-1].slots == 0 else None  # the _least_table, if any
        if least is None or _NEAR_WORK <= 0 or self._tables[0].slots == self._tables[0].max_budget:
            return None
        L = self.chain.length
        top = min(self.max_budget, least + -(-least * _NEAR_SPAN[0] // _NEAR_SPAN[1]))
        cap = int(min(_NEAR_WORK / len(_NEAR_ROUNDS) / L**3, _NEAR_SLOTS,
                      _REFINE_BYTES / ((L * (L + 1) // 2 + L + 1) * 10)))
        g = 0
        for v in dp_sizes(self.chain).values():
            g = math.gcd(g, *(int(a) for a in np.ravel(v)))
        threads = solver_threads(None)
        if g > 0 and top // g <= cap * len(_NEAR_ROUNDS):  # exact: sizes and budgets in whole multiples of g
            tables = [_build_table(self.chain, top // g * g, max(1, top // g), (0, 1), threads, False)]
        elif cap > self._tables[-2].slots * top / self._tables[-2].max_budget:  # finer than the bottom table
            # Which schedules fit exactly at the least budget depends on how their sizes round: each rounding
            # finds some the other misses.
            tables = [_build_table(self.chain, top, cap, r, threads, False) for r in _NEAR_ROUNDS]
        else:
            return None
        peaks, times, ops = [], [], []
        for table in tables:
            starts = self._candidates(table)
            peaks.append(_exact_peaks(self.chain, table, starts))
            times.append(table.times[starts])
            ops += [_rebuild_ops(table, m) for m in starts.tolist()]
        return np.concatenate(peaks), np.concatenate(times), ops

    @property
    def _front_peak(self) -> np.ndarray:
        return self._front()[0]

    @property
    def _front_t(self) -> np.ndarray:
        return self._front()[1]

    @property
    def _front_at(self) -> list:
        return self._front()[2]

    @property
    def _dp_min(self) -> int | None:
        return int(self._front_peak[0]) if len(self._front_peak) else None

    @property
    def min_budget(self) -> int | None:
        """The least budget (bytes) with an answer: the exact least feasible budget, where the tables hold a schedule
        (source ``"dp"``); with ``single_level``, the least peak of the tables' schedules or a baseline's below it;
        None when nothing fits up to ``max_budget``."""
        peaks = self._baselines()[0]
        cands = [b for b in (self._dp_min, self.store_all_peak if self.store_all_peak <= self.max_budget else None,
                             int(peaks[0]) if len(peaks) else None) if b is not None]
        return min(cands) if cands else None

    def _baselines(self) -> tuple[np.ndarray, np.ndarray, tuple]:
        """(peaks, makespans, entries) of the baselines' Pareto front up to ``max_budget``, peaks increasing."""
        if "base" not in self._cache:
            every = baseline_frontier(self.chain, single_level=self.single_level)
            front = tuple(c for c in every if c[0] <= self.max_budget)
            times = np.array([c[1] for c in front], np.float64)
            sat = self._store_all_time  # as the table's times: within the tie margin of it is store-all time
            times[times <= sat * (1.0 + _TIE_RTOL)] = sat
            self._cache["base"] = (np.array([c[0] for c in front], np.int64), times, front)
        return self._cache["base"]

    def _answer(self, b: int) -> tuple[float, Any]:
        """(makespan, which) at ``b`` bytes (at most ``max_budget``): ``which`` is ``"store_all"``, the index (int)
        of the tables' schedule in the front, a baseline entry ``(peak, makespan, label, schedule)`` that beats the
        tables by more than the tie margin, or None when nothing fits."""
        if b >= self.store_all_peak:
            return self._store_all_time, "store_all"
        k = int(np.searchsorted(self._front_peak, b, side="right")) - 1
        t = float(self._front_t[k]) if k >= 0 else math.inf
        peaks, times, front = self._baselines()
        kb = int(np.searchsorted(peaks, b, side="right")) - 1
        if kb >= 0 and times[kb] < t:  # the exact minimum: makespan stays non-increasing in the budget
            return float(times[kb]), front[kb]
        return t, (k if k >= 0 else None)

    # ---------------------------------------------------------------- budgets and slots
    @property
    def unit(self) -> float:
        """Bytes per slot of the whole-range table."""
        return self._tables[0].max_budget / self._tables[0].slots

    def _budget(self, budget: Any) -> int:
        return min(_read_bytes(budget), self.max_budget)

    # ---------------------------------------------------------------- answers
    def makespan(self, budget: int | str) -> float:
        """Least makespan (seconds) within ``budget`` bytes; ``inf`` when nothing fits."""
        return self._answer(self._budget(budget))[0]

    def schedule(self, budget: int | str) -> Schedule:
        """The optimal schedule within ``budget`` bytes of activations (budgets above ``max_budget`` are answered as
        ``max_budget``). Raises :class:`~hchain_viz.errors.InfeasibleBudget` (with ``.min_budget``) when none fits.

        For a whole device instead (the chain's fixed part plus activations), use
        :func:`hchain_viz.core.device.device_schedule`: ``hcv.device_schedule(solution, "24GiB")``.
        """
        requested = _read_bytes(budget)
        b = min(requested, self.max_budget)
        _, which = self._answer(b)
        if which is None:
            raise self._infeasible(requested)
        meta = {"strategy": "optimal", "budget": requested, "slots": self.slots, "source": "dp"}
        if which == "store_all":  # store-all is optimal and exact here: no rounding, no recomputation
            return self._finish(store_all(self.chain).ops, meta)
        if isinstance(which, tuple):  # a baseline that fits beats the rounded table here
            meta["source"] = f"baseline:{which[2]}"
            return self._finish(which[3].ops, meta)
        return self._slot_schedule(which, meta)

    def refined(self, budget: int | str) -> Schedule:
        """:meth:`schedule` or :func:`optimal_schedule` at ``budget``, whichever is faster (simulated): the answer
        for one budget, about a second of solving more (docs/design.md §4.4). The tables answer within 1% of
        it on chains up to a few hundred stages; longer ones are solved coarser to build in time."""
        first = self.schedule(budget)
        b = min(_read_bytes(budget), self.max_budget)
        if first.meta["source"] != "dp" or b >= self.store_all_peak or self.single_level:
            return first
        try:
            other = optimal_schedule(self.chain, b, self.slots)
        except InfeasibleBudget:  # the finer table's rounding misses what the exact least-budget schedule fits
            return first
        if other.meta["predicted_makespan"] < first.meta["predicted_makespan"]:
            other.meta.update(budget=first.meta["budget"], source="dp-refined")
            return other
        return first

    def _dp_schedule(self, budget: int) -> Schedule:
        """The table's own answer at ``budget`` bytes (no baseline check): the fastest of its schedules whose exact
        peak fits."""
        b = min(budget, self.max_budget)
        k = int(np.searchsorted(self._front_peak, b, side="right")) - 1
        if k < 0:
            raise self._infeasible(budget)
        meta = {"strategy": "optimal", "budget": budget, "slots": self.slots, "source": "dp"}
        return self._slot_schedule(k, meta)

    def _slot_schedule(self, k: int, meta: dict) -> Schedule:
        """The schedule of the front's entry ``k``, rebuilt from its table."""
        at = self._front_at[k]
        if isinstance(at[0], Op):  # a near-limit schedule, kept as ops
            return self._finish(at, meta)
        return self._finish(_rebuild_ops(self._tables[at[0]], at[1]), meta)

    def _finish(self, ops: tuple[Op, ...], meta: dict) -> Schedule:
        # The predicted makespan is the simulator's (one place that counts the backward calls).
        meta["predicted_makespan"] = peak_and_makespan(self.chain, Schedule(ops))[1]
        if "precision" in self.chain.meta:  # a wrapped schedule warns when it runs in another (docs/design.md §11)
            meta["precision"] = self.chain.meta["precision"]
        return Schedule(ops, meta)

    def _infeasible(self, budget: int) -> InfeasibleBudget:
        if self.min_budget is not None:
            least = self.min_budget
            msg = (f"no schedule fits in a budget of {budget} B ({_mib(budget)}); the least feasible budget is "
                   f"{least} B ({_mib(least)}) at this resolution ({self.slots} slots of {format_bytes(self.unit)}); "
                   f"give at least that")
        elif self.single_level:
            least = least_budget(self.chain)
            msg = (f"no schedule that recomputes each stage at most once fits up to max_budget "
                   f"{self.max_budget} B ({_mib(self.max_budget)}) at this resolution ({self.slots} slots); solve "
                   f"again with a larger max_budget (any schedule needs at least {least} B, and a single level of "
                   f"checkpoints usually more)")
        else:
            least = least_budget(self.chain)
            if least <= budget:  # feasible in bytes, lost to rounding sizes up to whole slots
                msg = (f"at this resolution ({self.slots} slots of {format_bytes(self.unit)}) nothing fits in "
                       f"{budget} B ({_mib(budget)}), though the exact least feasible budget is {least} B "
                       f"({_mib(least)}): sizes are rounded up to whole slots. Solve with more slots, or give a "
                       f"budget a few slots above {least} B")
            else:
                msg = (f"no schedule fits in a budget of {budget} B ({_mib(budget)}); the least feasible budget is "
                       f"{least} B ({_mib(least)}); solve again with max_budget above it (a little more, or more "
                       f"slots, for the rounding to whole slots)")
        return InfeasibleBudget(msg, min_budget=least, budget=budget)

    def frontier(self) -> list[tuple[int, float]]:
        """Breakpoints ``(budget_bytes, makespan)`` of the time-memory trade-off: budgets increasing, makespans
        strictly decreasing; the first at ``min_budget``; empty when nothing fits up to ``max_budget``."""
        cands = {int(p) for p in self._front_peak.tolist()}
        cands.update(int(p) for p in self._baselines()[0])
        if self.store_all_peak <= self.max_budget:
            cands.add(self.store_all_peak)
        points: list[tuple[int, float]] = []
        for b in sorted(cands):  # the answer changes only at these budgets
            t = self._answer(b)[0]
            if t < (points[-1][1] if points else math.inf):
                points.append((b, t))
        return points

    # ---------------------------------------------------------------- display
    def _rows(self, n: int = 12) -> list[tuple[str, str, str]]:
        pts = self.frontier()
        if len(pts) > n:
            step = (len(pts) - 1) / (n - 1)
            pts = [pts[round(k * step)] for k in range(n)]
        base = self._store_all_time
        return [(format_bytes(b), format_time(t), f"{100 * (t / base - 1):+.1f}%" if base > 0 else "")
                for b, t in pts]

    def _head(self) -> str:
        least = "none" if self.min_budget is None else format_bytes(self.min_budget)
        grids = " and ".join(f"up to {format_bytes(t.max_budget)} in {t.slots} slots of "
                             f"{format_bytes(t.max_budget / t.slots)}" for t in self._tables if t.slots)
        return (f"Solution: {self.chain.length} stages, budgets {grids}; least feasible {least}, store-all peak "
                f"{format_bytes(self.store_all_peak)} ({format_time(self._store_all_time)})")

    def __repr__(self) -> str:
        head = ("budget", "makespan", "overhead")
        rows = self._rows()
        widths = [max(len(r[c]) for r in [head, *rows]) for c in range(3)]
        lines = [self._head(), "  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in self._rows())
        return (f"<b>{self._head()}</b><table><thead><tr><th>budget</th><th>makespan</th><th>overhead</th></tr>"
                f"</thead><tbody>{body}</tbody></table>")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _check_chain(chain: Any) -> Chain:
    if not isinstance(chain, Chain):
        raise InvalidChain(f"the solver needs a hchain_viz.Chain, got {type(chain).__name__}; build one with "
                           "hcv.Chain(...) or hcv.profile(model, x)")
    return chain


def _check_slots(slots: Any) -> int:
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
        raise HChainError(f"slots must be a positive integer (the DP's memory resolution, e.g. 500), got {slots!r}")
    return int(slots)


def dp_sizes(chain: Chain) -> dict[str, np.ndarray]:
    """The sizes the DP charges, in bytes (docs/design.md §4.1 for ``chain.shared``).

    - ``x`` (L+2 entries, ``x[L+1] = 0``): the gradients δ_i (``chain.delta``, never shared); ``x0``: the input x_0.
    - ``xs[i, j]`` (i < j <= L): the part of the value x_j that is not in x_i: ``x[j]`` less the shared tensors that
      cross every cut ``i..j``. The DP charges a value x_j (a checkpoint, the held output) so while x_i, from which
      it was computed, is resident; the two then hold the same instance of those tensors (the simulator's rule).
    - ``xbar[i]``: x̄_{i+1} less the shared tensors it has in common with x_i. Exact: x_i stays resident from
      Fall(i) to B(i) (B(i) needs it; nothing frees it before: Fn(i) cannot run while x_{i+1} is resident).
    - ``fwd_tmp`` (of a Fall), ``nograd_tmp`` (of a Fck or Fn: ``chain.nograd_tmp_bytes``), ``bwd_tmp``: B(i)'s
      transient less ``chain.delta_through[i]``, the part of δ_i that is δ_{i+1}'s (charged once, as the simulator
      does); negative when B(i) hands on more than it needs beside. The kernels only ever add it to δ_i.
    - ``tr`` (L+1 entries): ``chain.transit``, the part of x_i that Fall(i) frees (never shared: not handed on).
    - ``co`` (L+1 entries): ``chain.consumed``, the part of x_i that B(i) frees when x_i is inside x̄_i, and the
      shared tensors ``chain.consumed_shared`` that it frees then too (x_i inside x̄_{i-1} is all the simulator asks:
      they cross only the cut before).

    With ``chain.shared == ()`` these are the chain's own sizes (``xs[i, j] == x[j]``).
    """
    L = chain.length
    x = np.asarray(chain.x, dtype=np.int64)
    span = np.zeros((L + 1, L + 1), np.int64)  # span[i, j], i <= j: bytes of shared tensors crossing all of i..j
    for first, last, nbytes in chain.shared:
        span[first:last + 1, first:last + 1] += nbytes
    xs = np.triu(x[None, :] - span, 1)
    xbar = np.asarray(chain.xbar, dtype=np.int64) - span[np.arange(L), np.arange(1, L + 1)]
    return {"x": np.append(np.asarray(chain.delta_bytes, dtype=np.int64), 0), "x0": x[:1], "xs": xs, "xbar": xbar,
            "fwd_tmp": np.asarray(chain.fwd_tmp, dtype=np.int64),
            "nograd_tmp": np.asarray(chain.nograd_tmp_bytes, dtype=np.int64),
            "bwd_tmp": np.asarray(chain.bwd_tmp, dtype=np.int64) - np.asarray(chain.delta_through, dtype=np.int64),
            "tr": np.asarray(chain.transit, dtype=np.int64),
            "co": _consumed_bytes(chain)}


def _consumed_bytes(chain: Chain) -> np.ndarray:
    """Per boundary i, what B(i) frees of an x_i inside x̄_{i-1}: ``chain.consumed[i]`` and the shared tensors of
    ``chain.consumed_shared`` that end there."""
    co = np.asarray(chain.consumed, dtype=np.int64).copy()
    for n in chain.consumed_shared:
        _, last, nbytes = chain.shared[n]
        co[last] += nbytes
    return co


def _slot_sizes(chain: Chain, max_budget: int, slots: int, round_down: tuple[int, int] = (0, 1)
                ) -> dict[str, np.ndarray]:
    """:func:`dp_sizes` in slots of ``max_budget / slots`` bytes (exact integer arithmetic): charged sizes are rounded
    up unless their excess over whole slots is at most the fraction ``round_down`` = (p, q) of a slot, freed ones
    (transit and consumed bytes) rounded down unless at most that fraction short, and never more than the x they are
    part of. (0, 1) rounds every charge up, so the table's schedules fit their slots; above 0 the table's budgets
    are nearer the truth on average, and the exact peaks decide what fits (docs/design.md §4). Anything above the
    whole budget is capped at slots + 1, which is infeasible anyway and keeps sums far from overflow."""
    p, q = round_down
    exact = slots == max_budget

    def scaled(v: np.ndarray, shift: int) -> np.ndarray:  # floor((q·v·slots + shift) / (q·max_budget))
        if exact:
            return v
        den = q * max_budget
        if int(np.abs(v).max(initial=0)) < 2**61 // (q * slots) and shift < 2**61:
            return (q * slots * v + shift) // den
        return np.array([(q * slots * int(b) + shift) // den for b in v.ravel()], dtype=object).reshape(v.shape)

    def charged(v: np.ndarray) -> np.ndarray:  # ceil(v·slots/max_budget - p/q)
        return np.minimum(-scaled(-v, p * max_budget), slots + 1).astype(np.int64)

    sizes = dp_sizes(chain)
    freed = ("tr", "co")
    out = {k: charged(v) for k, v in sizes.items() if k not in freed}
    for k in freed:
        out[k] = np.minimum(np.minimum(scaled(sizes[k], p * max_budget), slots + 1).astype(np.int64),
                            charged(np.asarray(chain.x, np.int64)))
    return out


class _Table(NamedTuple):
    """One filled table: its budget range, resolution, sizes in slots (:func:`_slot_sizes`), choices, and
    ``times[m]``: the least time within m slots (x_0 included)."""

    max_budget: int
    slots: int
    sizes: dict[str, np.ndarray]
    Cch: np.ndarray
    Dch: np.ndarray
    times: np.ndarray


def _build_table(chain: Chain, max_budget: int, slots: int, round_down: tuple[int, int], threads: int,
                 single_level: bool) -> _Table:
    """Fill the tables C and D for budgets 0..``slots`` slots of ``max_budget / slots`` bytes (see _fill_table) and
    keep their choices."""
    L = chain.length
    rows = L * (L + 1) // 2
    sizes = _slot_sizes(chain, max_budget, slots, round_down)
    arr = chain.arrays()
    choice_type = np.int16 if L < 2**15 - 1 else np.int32
    C = np.empty((rows, slots + 1), np.float64)
    Cch = np.empty((rows, slots + 1), choice_type)
    D = np.empty((L + 1, slots + 1), np.float64)
    Dch = np.empty((L + 1, slots + 1), choice_type)
    _kernels()["fill"](sizes["x"], sizes["xs"], sizes["xbar"], sizes["tr"], sizes["co"], sizes["fwd_tmp"],
                       sizes["nograd_tmp"], sizes["bwd_tmp"], arr["fwd_time"], arr["bwd_time"], chain.backward_call, C,
                       Cch, D, Dch, threads, single_level)
    times = np.full(slots + 1, math.inf)
    sx0 = int(sizes["x0"][0])
    if sx0 <= slots:  # D[m, 0] leaves out x_0; the backward call that starts with B(L-1) is the caller's
        times[sx0:] = D[0, : slots + 1 - sx0] + chain.backward_call
    return _Table(max_budget, slots, sizes, Cch, Dch, times)


def _least_table(chain: Chain) -> _Table:
    """The schedule of ``_least_tree`` as a one-slot table (every size 0 in slots, so its rebuild follows the
    one-column choices): a schedule at exactly the least budget, which no table in slots need reach."""
    z = dp_sizes(chain)
    arr = chain.arrays()
    L = chain.length
    choice_type = np.int16 if L < 2**15 - 1 else np.int32
    Cc = np.empty((L * (L + 1) // 2, 1), choice_type)
    Dc = np.empty((L + 1, 1), choice_type)
    least, t = _kernels()["least_tree"](z["x"], z["xs"], z["xbar"], z["tr"], z["co"], z["fwd_tmp"], z["nograd_tmp"],
                                    z["bwd_tmp"], arr["fwd_time"], arr["bwd_time"], chain.backward_call, Cc, Dc)
    zero = {k: np.zeros_like(v) for k, v in z.items()}
    return _Table(int(least + z["x0"][0]), 0, zero, Cc, Dc, np.array([t + chain.backward_call]))


def _rebuild_ops(table: _Table, m: int) -> tuple[Op, ...]:
    """The ops of ``table``'s schedule within ``m`` slots (x_0 included; ``times[m]`` must be finite)."""
    L = table.Dch.shape[0] - 1
    size = L * (L + 1) // 2 + 2 * L + 2  # room for L(L+1)/2 forwards and a spine that recomputes the whole chain
    sz = table.sizes
    while True:  # a longer schedule (core/in_flight.py's spines can recompute more) retries with twice the room
        out = np.empty((size, 2), np.int32)
        n = _kernels()["rebuild"](sz["xs"], sz["xbar"], sz["tr"], table.Cch, table.Dch, m - int(sz["x0"][0]), out)
        if n >= 0:
            break
        size *= 2
    kinds = [_KINDS[k] for k in out[:n, 0].tolist()]
    return tuple(map(Op, kinds, out[:n, 1].tolist()))


def _exact_peaks(chain: Chain, table: _Table, starts: np.ndarray) -> np.ndarray:
    """The exact peak (bytes) of ``table``'s schedule within each of ``starts`` (slots, x_0 included; each must be
    feasible): the table's choices, charged the conditions of :func:`dp_sizes` in bytes (``_peaks``)."""
    z = dp_sizes(chain)
    L = chain.length
    k = _kernels()
    args = (z["x"], z["xs"], z["xbar"], z["tr"], z["co"], z["fwd_tmp"], z["nograd_tmp"], z["bwd_tmp"])
    G, LOC, SAT = (np.empty((L, L), np.int64) for _ in range(3))
    k["bounds"](*args, G, LOC, SAT)
    GD, DLOC = np.zeros((L, L + 1), np.int64), np.empty(L, np.int64)
    k["spine_bounds"](*args, GD, DLOC)
    out = np.empty(len(starts), np.int64)
    sz = table.sizes
    k["peaks"](sz["xs"], sz["xbar"], sz["tr"], table.Cch, table.Dch, starts - int(sz["x0"][0]), z["x"], z["xs"], LOC,
               G, GD, DLOC, z["xbar"] - z["tr"][:L], out)
    return out + int(z["x0"][0])


def _read_bytes(value: Any, what: str = "the budget") -> int:
    """``parse_bytes`` with a message that names the argument."""
    try:
        return parse_bytes(value)
    except HChainError:
        raise HChainError(f"cannot read {what} {value!r}; give bytes (int) or text like '300MiB'") from None


def store_all_peak(chain: Chain) -> int:
    """Simulated peak of storing everything (``strategies.store_all``): the largest budget worth solving for."""
    return peak_and_makespan(chain, store_all(chain))[0]


def _ladder(L: int, bottom: int, top: int, whole: int, slots: int) -> tuple[list[tuple[int, int]], bool]:
    """``(span, slots)`` of the ladder's tables between a bottom table spanning ``bottom`` bytes and the whole range
    ``top``, given ``slots`` in the other tables (see _LADDER_SHARE), and whether the work cap left the ladder short
    (the middle of the range is then coarse)."""
    n = max(_MIN_BOTTOM_SLOTS, whole * _LADDER_SHARE[0] // _LADDER_SHARE[1])
    spans, span = [], 2 * bottom
    while 3 * span < 2 * top:
        if (slots + n * (len(spans) + 1)) * L**3 > _LADDER_WORK:
            return [(s, n) for s in spans], True
        spans.append(span)
        span *= 2
    return [(s, n) for s in spans], bool(spans) and n < _LADDER_FINE


def least_budget(chain: Chain) -> int:
    """The least budget (bytes, exact) within which any schedule of ``chain`` fits."""
    z = dp_sizes(chain)
    return int(z["x0"][0] + _kernels()["least"](z["x"], z["xs"], z["xbar"], z["tr"], z["co"], z["fwd_tmp"],
                                                z["nograd_tmp"], z["bwd_tmp"]))


def solve(chain: Chain, max_budget: int | str | None = None, slots: int = 500, *, threads: int | None = None,
          single_level: bool = False) -> Solution:
    """Solve ``chain`` for every budget up to ``max_budget`` at once (recomputation only; offloading to host memory
    as well: :func:`hchain_viz.core.offload.solve_offload`, docs/design.md §9).

    ``max_budget``: bytes (int) or text like ``"300MiB"``; default the store-all peak, above which nothing gets
    faster. ``slots``: the memory resolution (capped at ``max_budget``, which makes integer sizes exact): half of it
    spans the whole range, and a second table the bottom up to 1.5x the least budget; both finer on chains shorter
    than 300 stages, where a table is cheap (docs/design.md §4); the :class:`Solution` adds a far finer table up to
    2% above the least budget on its first answer. Time O(slots·L³), memory about ``slots·L²·5``
    bytes while building (only the int16 choices are kept).
    ``threads``: threads of the table fill (default: the free cores, see :func:`solver_threads`); the table does not
    depend on it.

    ``single_level=True``: the optimum over schedules that recompute each stage at most once (every checkpoint region
    on the spine, its stages recomputed plainly; no region inside a region), in O(slots·L²). ``torch.compile`` of the
    whole model runs exactly these as scheduled (``core/regions.py``, NOTE [compiled memory]); the full optimum's
    low budgets nest regions, which a compiled backward collapses.
    """
    chain = _check_chain(chain)
    slots = _check_slots(slots)
    peak = store_all_peak(chain)
    if max_budget is None:
        max_budget = max(peak, 1)  # a chain of zero sizes still gets a one-byte table
    else:
        max_budget = _read_bytes(max_budget, "max_budget")
    if max_budget < 1:
        raise HChainError(f"max_budget must be at least 1 byte, got {max_budget!r}")
    slots = min(slots, max_budget)  # finer than one byte buys nothing
    L = chain.length
    need = (L * (L + 1) // 2 + L + 1) * (slots + 1) * 10
    if need > _MAX_TABLE_BYTES:
        raise HChainError(f"the DP table for {L} stages and {slots} slots would need {format_bytes(need)}; "
                          f"use fewer slots (try slots={max(1, slots * _MAX_TABLE_BYTES // need)})")
    threads = solver_threads(threads)
    least = _least_table(chain)
    coarse = False
    if slots == max_budget or slots < 2 * _MIN_BOTTOM_SLOTS:  # exact, or too coarse to split
        tables = [_build_table(chain, max_budget, slots, (0, 1), threads, single_level)]
    else:  # a whole-range table and a finer one over the bottom of the range (docs/design.md §4)
        bottom = min(max_budget, -(-_BOTTOM_SPAN[0] * least.max_budget // _BOTTOM_SPAN[1]))
        cheap = (_LONG / L) ** 2  # how much more a table of this chain could take in the time of one at L = _LONG
        most = max(slots // 2, _BOTTOM_BYTES // ((L * (L + 1) // 2 + L + 1) * 10))  # slots within _BOTTOM_BYTES
        whole = min(int(slots / 2 * min(_BOTTOM_SHARE[1], max(1.0, cheap))), most)
        fine = min(int(slots * min(_BOTTOM_SHARE[1], max(_BOTTOM_SHARE[0], cheap / 2))), most)
        ladder, coarse = _ladder(L, bottom, max_budget, whole, whole + fine)
        tables = [_build_table(chain, max_budget, whole, _ROUND_DOWN, threads, single_level),
                  *[_build_table(chain, span, n, _ROUND_DOWN, threads, single_level) for span, n in ladder],
                  _build_table(chain, bottom, fine, _BOTTOM_ROUND, threads, single_level)]
    if not single_level and least.max_budget <= max_budget:  # (that schedule may nest regions)
        tables.append(least)
    return Solution(chain, max_budget, slots, peak, tables, single_level, coarse)


# optimal_schedule's finer table: at most this much work (slots x L^3; L = 500 at 500 slots is 6e10, ~3 s) and this
# many bytes while building.
_REFINE_WORK = 1e10
_REFINE_BYTES = 256 * 2**20


def _refined_slots(chain: Chain, budget: int, slots: int) -> tuple[int, int]:
    """(max_budget, slots) of optimal_schedule's tables: at least ``slots``, as fine as the work and memory caps
    allow, over budgets up to 9/8 of ``budget`` (a schedule whose sizes round up past the budget may still fit it in
    exact bytes); exact (one slot per common divisor of every size) when that fits."""
    L = chain.length
    z = dp_sizes(chain)
    g = 0
    for v in z.values():
        g = math.gcd(g, *(int(a) for a in np.ravel(v)))
    cap = int(min(_REFINE_WORK / L**3, _REFINE_BYTES / ((L * (L + 1) // 2 + L + 1) * 10)))
    if g > 0 and budget // g <= max(cap, slots):  # exact: sizes and the budget in whole multiples of g
        return budget // g * g, max(1, budget // g)
    return budget + budget // 8, max(slots, cap // slots * slots)


def optimal_schedule(chain: Chain, budget: int | str, slots: int = 500) -> Schedule:
    """The optimal schedule for one budget (bytes or text like ``"300MiB"``), narrowing the rounding gap of a
    whole-range table: solved for budgets up to just above this one at the finest resolution that costs about a
    second (exact where every size shares a divisor that makes it affordable), and
    checked against every baseline that fits (design.md §10). ``meta["source"]``: ``"dp"`` (the table at ``slots``),
    ``"dp-refined"`` (a finer one) or ``"baseline:<family>(<setting>)"``. Raises InfeasibleBudget when none fits."""
    chain = _check_chain(chain)
    slots = _check_slots(slots)
    b = _read_bytes(budget)
    least = least_budget(chain)
    if b < max(least, 1):
        raise InfeasibleBudget(f"no schedule fits in a budget of {b} B ({_mib(b)}); the least feasible budget "
                               f"is {least} B ({_mib(least)})", min_budget=least, budget=b)
    top, fine = _refined_slots(chain, b, slots)
    solution = solve(chain, max_budget=top, slots=fine)
    if solution.min_budget is None or solution.min_budget > b:
        raise InfeasibleBudget(
            f"a budget of {b} B ({_mib(b)}) fits a schedule (the least feasible budget is {least} B) but not at the "
            f"resolution of {solution.slots} slots of {format_bytes(solution.unit)}, which round sizes up; pass more "
            f"slots or a slightly larger budget", min_budget=least, budget=b)
    out = solution.schedule(b)
    if out.meta["source"] == "dp" and solution.slots > slots:
        out.meta["source"] = "dp-refined"
    return out
