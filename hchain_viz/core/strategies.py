"""Baseline checkpointing strategies, each a plain :class:`Schedule` scored by the one simulator (docs/design.md §10.3).

From fastest/largest to slowest/smallest: :func:`store_all` (no recomputation), :func:`periodic` / :func:`sqrt_n`
(exactly ``torch.utils.checkpoint.checkpoint_sequential``), :func:`chen_greedy` (Chen et al. 2016's segmentation by
accumulated activation size), :func:`revolve` (Griewank-Walther binomial checkpointing, every stage one uniform step)
and :func:`recompute_all` (keep only the input). For chains grouped into layers and tagged (sub-layer profiles,
docs/design.md §8): :func:`per_layer` (Hugging Face ``gradient_checkpointing_enable()``, Megatron full recomputation),
:func:`selective` (Megatron's: recompute the ``"attn_core"`` stages), :func:`layer_periodic` /
:func:`best_layer_periodic` (``checkpoint_sequential`` over whole layers, each ungrouped stage one unit) and
:func:`megatron_block` / :func:`megatron_uniform` (``recompute_method="block"``: the first k layers recomputed one by
one; ``"uniform"``: layers in groups of k), with :func:`best_megatron_block` / :func:`best_megatron_uniform`.

The optimal solver's frontier lies on or below every one of them. A family that needs structure the chain lacks
raises :class:`HChainError` saying how to get it; :func:`applicable` names the families a chain supports.
``STRATEGIES[name](chain, budget=None)`` is one signature for every family: the fastest schedule within ``budget``
(bytes or ``"300MiB"``; None: no limit; for ``"periodic"`` it picks the segment count, ``periodic(chain, n)`` fixes
it), or :class:`InfeasibleBudget` carrying the least budget it needs;
:func:`baseline_schedules` (every family at one budget) and :func:`frontier_points` (every schedule of every family
as a (peak, makespan) point) serve the explorer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

from ..errors import HChainError, InfeasibleBudget
from .chain import Chain
from .schedule import Op, Schedule
from .simulate import peak_and_makespan
from .units import format_bytes, parse_bytes

__all__ = [
    "store_all", "recompute_all", "periodic", "sqrt_n", "revolve", "chen_greedy", "best_periodic",
    "per_layer", "selective", "layer_periodic", "best_layer_periodic", "segments",
    "megatron_block", "megatron_uniform", "best_megatron_block", "best_megatron_uniform",
    "STRATEGIES", "applicable", "baseline_schedules", "frontier_points", "baseline_frontier", "pareto",
]

ATTN_CORE = "attn_core"  # the tag of the stages Megatron's selective recomputation recomputes
_HOW_TO_GROUP = ("profile the model at sub-layer granularity (hcv.profile(model, x, granularity=\"sublayer\")), "
                 "which records them, or build the Chain with groups=[(name, first_stage, last_stage), ...] and tags")

Budget = int | str | None
Point = tuple[int, float]  # (simulated peak bytes, makespan seconds)


# ---------------------------------------------------------------------------------------------------- fixed schedules
def store_all(chain: Chain) -> Schedule:
    """Keep every activation: ``Fall0 .. Fall(L-1) Loss B(L-1) .. B0``. Fastest, largest peak."""
    L = chain.length
    ops = [Op("Fall", i) for i in range(L)] + [Op("Loss", L)] + [Op("B", i) for i in reversed(range(L))]
    return Schedule(tuple(ops), {"strategy": "store_all"})


def recompute_all(chain: Chain) -> Schedule:
    """Keep only the input x_0: run the forward without autograd, then before each backward B(i), recompute x_i
    from x_0 and run stage i once more with autograd.

    The smallest-memory baseline: about L²/2 extra forwards (``Fck0 Fn1 .. Fn(L-1) Loss``, then for i = L-1 .. 0:
    ``Fck0 Fn1 .. Fn(i-1) Fall(i) B(i)``).
    """
    L = chain.length
    ops = _advance(0, L) + [Op("Loss", L)]
    for i in reversed(range(L)):
        ops += _advance(0, i) + [Op("Fall", i), Op("B", i)]
    return Schedule(tuple(ops), {"strategy": "recompute_all"})


def periodic(chain: Chain, segments: int) -> Schedule:
    """Exactly ``torch.utils.checkpoint.checkpoint_sequential(stages, segments, x)``.

    The first ``segments - 1`` segments of ``L // segments`` stages each run without autograd, keeping only their
    input; the last segment (all remaining stages) runs with autograd. In the backward, each checkpointed segment is
    re-run with autograd (``Fall``) just before its backwards, last segment first.
    """
    L = chain.length
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= L:
        raise HChainError(f"segments must be an integer from 1 to the number of stages ({L}), got {segments!r}")
    size = L // segments
    starts = tuple(range(0, size * segments, size))  # segments - 1 checkpointed ones, then the rest
    return _segmented(chain, starts, {"strategy": "periodic", "segments": segments})


def sqrt_n(chain: Chain) -> Schedule:
    """:func:`periodic` with ``round(sqrt(L))`` segments: the classic O(√L)-memory, one-extra-forward rule."""
    segments = max(1, round(math.sqrt(chain.length)))
    s = periodic(chain, segments)
    return Schedule(s.ops, {"strategy": "sqrt_n", "segments": segments})


# ---------------------------------------------------------------------------------------------------- transformers
def per_layer(chain: Chain) -> Schedule:
    """Full per-layer recomputation (Hugging Face ``gradient_checkpointing_enable()``, Megatron "full").

    Each layer (``chain.groups``) runs forward without autograd keeping only its input (``Fck`` on its first stage,
    ``Fn`` through the rest); in the backward it is run again with autograd just before its backwards. Stages outside
    every layer (embedding, head) store what they save, as those libraries leave them.
    """
    runs = [(first, last) for _, first, last in _need_groups(chain, "per_layer")]
    return _recompute_runs(chain, runs, {"strategy": "per_layer"})


def selective(chain: Chain) -> Schedule:
    """Megatron's selective recomputation (Korthikanti et al. 2022): store everything except the core attention.

    Each run of consecutive stages tagged ``"attn_core"`` (scores, softmax, probabilities times values) runs
    forward without autograd, keeping its input, and is recomputed with autograd just before its backwards; every
    other stage stores what it saves.
    """
    runs = _tag_runs(chain, ATTN_CORE)
    if not runs:
        raise HChainError(f"selective recomputation needs the core-attention stages tagged {ATTN_CORE!r} "
                          f"(chain.tags), and this chain has none; {_HOW_TO_GROUP}")
    return _recompute_runs(chain, runs, {"strategy": "selective"})


def layer_periodic(chain: Chain, segments: int) -> Schedule:
    """``checkpoint_sequential(layers, segments, x)`` over whole layers.

    The units are the layers of ``chain.groups`` plus every stage outside them (each its own unit), in order; they
    are split as :func:`periodic` splits stages (``segments - 1`` checkpointed segments of ``U // segments`` units,
    then the rest, stored).
    """
    units = _units(chain)
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= len(units):
        raise HChainError(f"segments must be an integer from 1 to the number of layers and other stages "
                          f"({len(units)}), got {segments!r}")
    size = len(units) // segments
    starts = tuple(units[u] for u in range(0, size * segments, size))
    return _segmented(chain, starts, {"strategy": "layer_periodic", "segments": segments})


def segments(chain: Chain, starts: tuple[int, ...] | list[int]) -> Schedule:
    """``checkpoint_sequential``'s pattern with its segments starting at the stages ``starts`` (the first 0).

    What ``checkpoint_sequential(modules, n, x)`` over a coarser list of modules runs on a finer chain: each of its
    segments starts at the first stage of the module that starts it (``hchain_viz.examples`` ships the starts of a
    real model's top-level children with its chains).
    """
    starts = tuple(starts)
    if (not starts or starts[0] != 0 or any(not isinstance(s, int) or isinstance(s, bool) for s in starts)
            or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= chain.length):
        raise HChainError(f"segment starts must be increasing stage indices from 0 below the chain's length "
                          f"({chain.length}), got {list(starts)}")
    return _segmented(chain, starts, {"strategy": "segments", "starts": list(starts)})


def best_layer_periodic(chain: Chain, budget: Budget = None) -> Schedule:
    """The fastest :func:`layer_periodic` schedule (over every segment count) whose simulated peak fits
    ``budget``."""
    b = _parse_budget(budget)
    scored = [(_score(chain, layer_periodic(chain, n)), n) for n in range(1, len(_units(chain)) + 1)]
    return layer_periodic(chain, _pick(scored, b, "layer_periodic"))


def megatron_block(chain: Chain, k: int) -> Schedule:
    """Megatron-LM ``recompute_granularity="full", recompute_method="block", recompute_num_layers=k``.

    The first ``k`` layers of ``chain.groups`` are each recomputed on their own (their input kept, the layer re-run
    with autograd just before its backwards, as :func:`per_layer`); the other layers and every stage outside the
    layers store what they save. ``k = 0`` is store-all, ``k`` = the number of layers is :func:`per_layer`.
    """
    layers = _need_groups(chain, "megatron_block")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(layers):
        raise HChainError(f"k must be an integer from 0 to the number of layers ({len(layers)}), got {k!r}")
    runs = [(first, last) for _, first, last in layers[:k]]
    return _recompute_runs(chain, runs, {"strategy": "megatron_block", "k": k})


def megatron_uniform(chain: Chain, k: int) -> Schedule:
    """Megatron-LM ``recompute_granularity="full", recompute_method="uniform", recompute_num_layers=k``.

    The layers of ``chain.groups`` are split in order into groups of ``k`` (the last may be smaller); each group
    keeps only its input and is re-run with autograd as one unit just before its backwards. Stages outside the
    layers store what they save. ``k = 1`` is :func:`per_layer`. A group never spans a gap between layers (a stage
    outside every layer): it is cut there.
    """
    layers = _need_groups(chain, "megatron_uniform")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(layers):
        raise HChainError(f"k must be an integer from 1 to the number of layers ({len(layers)}), got {k!r}")
    runs: list[tuple[int, int]] = []
    for n in range(0, len(layers), k):
        _, start, end = layers[n]
        for _, first, last in layers[n + 1:n + k]:
            if first != end + 1:  # a stage outside the layers lies between: cut the group there
                runs.append((start, end))
                start = first
            end = last
        runs.append((start, end))
    return _recompute_runs(chain, runs, {"strategy": "megatron_uniform", "k": k})


def best_megatron_block(chain: Chain, budget: Budget = None) -> Schedule:
    """The fastest :func:`megatron_block` schedule (over every k) whose simulated peak fits ``budget``."""
    b = _parse_budget(budget)
    n = len(_need_groups(chain, "megatron_block"))
    scored = [(_score(chain, megatron_block(chain, k)), k) for k in range(n + 1)]
    return megatron_block(chain, _pick(scored, b, "megatron_block"))


def best_megatron_uniform(chain: Chain, budget: Budget = None) -> Schedule:
    """The fastest :func:`megatron_uniform` schedule (over every k) whose simulated peak fits ``budget``."""
    b = _parse_budget(budget)
    n = len(_need_groups(chain, "megatron_uniform"))
    scored = [(_score(chain, megatron_uniform(chain, k)), k) for k in range(1, n + 1)]
    return megatron_uniform(chain, _pick(scored, b, "megatron_uniform"))


def _need_groups(chain: Chain, name: str) -> tuple[tuple[str, int, int], ...]:
    if not chain.groups:
        raise HChainError(f"{name} needs to know which stages form a layer (chain.groups), and this chain has no "
                          f"groups; {_HOW_TO_GROUP}")
    return chain.groups


def _units(chain: Chain) -> list[int]:
    """First stages of the layers and of every stage outside them, in order (checkpoint_sequential's units)."""
    groups = _need_groups(chain, "layer_periodic")
    inside = {i for _, first, last in groups for i in range(first + 1, last + 1)}
    return [i for i in range(chain.length) if i not in inside]


def _tag_runs(chain: Chain, tag: str) -> list[tuple[int, int]]:
    """Maximal runs ``(first, last)`` of consecutive stages tagged ``tag``, not crossing a layer boundary."""
    starts = {first for _, first, _ in chain.groups}
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(chain.tags):
        if t != tag:
            continue
        if runs and runs[-1][1] == i - 1 and i not in starts:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _recompute_runs(chain: Chain, runs: list[tuple[int, int]], meta: dict) -> Schedule:
    """Recompute the stage ranges ``runs`` (disjoint, increasing) in the backward; store every other stage.

    Forward: a run is ``Fck(first) Fn(first+1..last)``, any other stage ``Fall``. Backward, from the last stage: a
    run is ``Fall(first..last) B(last..first)``, any other stage ``B``.
    """
    L = chain.length
    ends = {last: first for first, last in runs}
    starts = {first: last for first, last in runs}
    ops: list[Op] = []
    i = 0
    while i < L:
        if i in starts:
            ops += _advance(i, starts[i] + 1)
            i = starts[i] + 1
        else:
            ops.append(Op("Fall", i))
            i += 1
    ops.append(Op("Loss", L))
    i = L - 1
    while i >= 0:
        if i in ends:
            first = ends[i]
            ops += [Op("Fall", k) for k in range(first, i + 1)] + [Op("B", k) for k in range(i, first - 1, -1)]
            i = first - 1
        else:
            ops.append(Op("B", i))
            i -= 1
    return Schedule(tuple(ops), dict(meta))


# ---------------------------------------------------------------------------------------------------- budget-driven
def best_periodic(chain: Chain, budget: Budget = None) -> Schedule:
    """The fastest :func:`periodic` schedule (over every segment count 1..L) whose simulated peak fits ``budget``."""
    b = _parse_budget(budget)
    scored = [(_score(chain, periodic(chain, n)), n) for n in range(1, chain.length + 1)]
    return periodic(chain, _pick(scored, b, "periodic"))


def revolve(chain: Chain, budget: Budget = None) -> Schedule:
    """Griewank–Walther binomial checkpointing (revolve), treating every stage as one uniform step.

    With ``c`` checkpoint slots besides the held input, the reversal of ``l`` steps advances (no autograd) to a
    split point chosen so the number of recomputed forwards is the binomial minimum, stores a checkpoint there,
    reverses the right part with ``c - 1`` slots and then the left part with ``c``; the reversal of a single step is
    ``Fall(i) B(i)``. ``c`` is the largest the budget allows given the chain's sizes (``None``: no limit). Raises
    :class:`InfeasibleBudget` when no ``c`` fits, with ``min_budget`` the least peak of any revolve schedule.
    """
    b = _parse_budget(budget)
    L = chain.length
    c_max = max(0, L - 2)  # with l - 2 slots besides the start, every step is recomputed at most once
    if b is None:
        return _revolve_schedule(L, c_max, None)

    def fits(c: int) -> bool:
        return _score(chain, _revolve_schedule(L, c, None))[0] <= b

    # Estimate from the largest activation a slot may hold, then walk to the largest c that fits.
    base = _score(chain, _revolve_schedule(L, 0, None))[0]
    biggest = max(chain.x[1:L], default=0)
    c = c_max if biggest == 0 else min(c_max, max(0, (b - base) // biggest))
    if fits(c):
        while c < c_max and fits(c + 1):
            c += 1
    else:
        c = next((k for k in range(c - 1, -1, -1) if fits(k)), -1)
        if c < 0:  # nothing at or below the estimate: peaks need not be monotone in c, so look at them all
            peaks = {k: _score(chain, _revolve_schedule(L, k, None))[0] for k in range(c_max + 1)}
            ok = [k for k, p in peaks.items() if p <= b]
            if not ok:
                raise _infeasible("revolve", b, min(peaks.values()))
            c = max(ok)
    return _revolve_schedule(L, c, b)


def chen_greedy(chain: Chain, budget: Budget = None) -> Schedule:
    """Chen et al. 2016 ("Training deep nets with sublinear memory cost"), greedy segmentation.

    Walk the stages accumulating the bytes each keeps for its backward (``xbar[i]``); when the running sum exceeds a
    threshold b, the stage's output becomes a checkpoint and a new segment starts. Segments then run like
    :func:`periodic`. A sweep of thresholds gives several segmentations; the fastest whose simulated peak fits
    ``budget`` is returned (``None``: no limit), :class:`InfeasibleBudget` if none does.
    """
    b = _parse_budget(budget)
    scored = [(_score(chain, _chen_schedule(chain, starts, thr, None)), (starts, thr))
              for starts, thr in _chen_candidates(chain)]
    starts, thr = _pick(scored, b, "chen_greedy")
    return _chen_schedule(chain, starts, thr, b)


# ---------------------------------------------------------------------------------------------------- registry
def _fixed(fn: Callable[[Chain], Schedule], name: str) -> Callable[[Chain, Budget], Schedule]:
    """Give a budget-free strategy the registry signature: its one schedule, if it fits the budget."""

    def at_budget(chain: Chain, budget: Budget = None) -> Schedule:
        b = _parse_budget(budget)
        s = fn(chain)
        peak = _score(chain, s)[0]
        if b is not None and peak > b:
            raise _infeasible(name, b, peak)
        return s

    at_budget.__name__ = name
    at_budget.__doc__ = fn.__doc__
    return at_budget


#: name -> ``f(chain, budget=None) -> Schedule``; see the module docstring for the budget's meaning.
STRATEGIES: dict[str, Callable[..., Schedule]] = {
    "store_all": _fixed(store_all, "store_all"),
    "periodic": best_periodic,
    "sqrt_n": _fixed(sqrt_n, "sqrt_n"),
    "chen_greedy": chen_greedy,
    "revolve": revolve,
    "recompute_all": _fixed(recompute_all, "recompute_all"),
    "per_layer": _fixed(per_layer, "per_layer"),
    "selective": _fixed(selective, "selective"),
    "layer_periodic": best_layer_periodic,
    "megatron_block": best_megatron_block,
    "megatron_uniform": best_megatron_uniform,
}

# What each structure-dependent family needs from the chain (the others apply to every chain).
_NEEDS: dict[str, Callable[[Chain], bool]] = {
    "per_layer": lambda chain: bool(chain.groups),
    "layer_periodic": lambda chain: bool(chain.groups),
    "megatron_block": lambda chain: bool(chain.groups),
    "megatron_uniform": lambda chain: bool(chain.groups),
    "selective": lambda chain: ATTN_CORE in chain.tags,
}


def applicable(chain: Chain) -> list[str]:
    """Names of the registered families that can run on ``chain`` (the transformer ones need groups / tags)."""
    return [name for name in STRATEGIES if _NEEDS.get(name, lambda _: True)(chain)]


def baseline_schedules(chain: Chain, budget: Budget = None) -> dict[str, Schedule]:
    """Every applicable family's schedule at ``budget`` (``None``: no limit); families that cannot fit are left
    out."""
    out = {}
    for name in applicable(chain):
        try:
            out[name] = STRATEGIES[name](chain, budget)
        except InfeasibleBudget:
            pass
    return out


@lru_cache(maxsize=16)
def frontier_points(chain: Chain) -> dict[str, list[Point]]:
    """For each family, the (simulated peak bytes, makespan seconds) of every schedule it can produce.

    ``store_all``, ``sqrt_n``, ``recompute_all``, ``per_layer``, ``selective``: one point each; ``periodic`` and
    ``layer_periodic``: one per segment count; ``megatron_block`` / ``megatron_uniform``: one per k;
    ``revolve``: one per number of checkpoint slots (each is what some budget selects); ``chen_greedy``: one per
    distinct segmentation of the threshold sweep. On long chains periodic and revolve are sampled (every count up to
    32, then about 10% apart) to keep this interactive. Points are distinct and sorted by peak, then time; they are
    not filtered, so a family may contain dominated points (use :func:`pareto` to drop them). Cached per chain.
    """
    return {name: sorted({(p, t) for p, t, _, _ in cands}) for name, cands in _candidates(chain).items()}


@lru_cache(maxsize=16)
def _candidates(chain: Chain) -> dict[str, list[tuple[int, float, str, Schedule]]]:
    """Every schedule of every applicable family as ``(peak, makespan, label, schedule)``; labels like
    ``"periodic(3)"`` name the setting (see :func:`frontier_points`)."""
    L = chain.length
    families: dict[str, list[tuple[str, Schedule]]] = {
        "store_all": [("store_all", store_all(chain))],
        "periodic": [(f"periodic({n})", periodic(chain, n)) for n in _sampled_counts(1, L)],
        "sqrt_n": [("sqrt_n", sqrt_n(chain))],
        "chen_greedy": [(f"chen_greedy({len(st)})", _chen_schedule(chain, st, t, None))
                        for st, t in _chen_candidates(chain)],
        "revolve": [(f"revolve({c})", _revolve_schedule(L, c, None)) for c in _sampled_counts(0, max(0, L - 2))],
        "recompute_all": [("recompute_all", recompute_all(chain))],
    }
    if _NEEDS["per_layer"](chain):
        n = len(chain.groups)
        families["per_layer"] = [("per_layer", per_layer(chain))]
        families["layer_periodic"] = [(f"layer_periodic({k})", layer_periodic(chain, k))
                                      for k in _sampled_counts(1, len(_units(chain)))]
        families["megatron_block"] = [(f"megatron_block({k})", megatron_block(chain, k)) for k in range(n + 1)]
        families["megatron_uniform"] = [(f"megatron_uniform({k})", megatron_uniform(chain, k))
                                        for k in range(1, n + 1)]
    if _NEEDS["selective"](chain):
        families["selective"] = [("selective", selective(chain))]
    return {name: [(*_score(chain, s), label, s) for label, s in ss] for name, ss in families.items()}


@lru_cache(maxsize=32)
def baseline_frontier(chain: Chain, single_level: bool = False) -> tuple[tuple[int, float, str, Schedule], ...]:
    """The Pareto front of every baseline schedule of every applicable family (:func:`frontier_points`), as
    ``(peak, makespan, label, schedule)`` sorted by peak (makespans then strictly decrease): at a budget b, the
    fastest baseline that fits is the last entry with ``peak <= b``. Cached per chain; what the optimal solver checks
    its answers against (design.md §10). ``single_level``: only the baselines that recompute each stage at most once
    (``Schedule.single_level``)."""
    every = sorted((c for cands in _candidates(chain).values() for c in cands
                    if not single_level or c[3].single_level), key=lambda c: (c[0], c[1], c[2]))
    out: list[tuple[int, float, str, Schedule]] = []
    for c in every:
        if not out or c[1] < out[-1][1]:
            out.append(c)
    return tuple(out)


def _sampled_counts(lo: int, hi: int) -> list[int]:
    """Every integer in [lo, hi] up to 32, then a geometric progression (ratio ~1.1) and hi itself."""
    counts = list(range(lo, min(hi, 32) + 1))
    while counts[-1] < hi:
        counts.append(min(hi, max(counts[-1] + 1, round(counts[-1] * 1.1))))
    return counts


def pareto(points: list[Point]) -> list[Point]:
    """The points no other point beats on both memory and time, sorted by memory (time then decreases)."""
    out: list[Point] = []
    for p in sorted(set(points)):
        if not out or p[1] < out[-1][1]:
            out.append(p)
    return out


# ---------------------------------------------------------------------------------------------------- helpers
def _advance(i: int, j: int) -> list[Op]:
    """Ops that bring x_j from a held x_i without autograd, keeping x_i: ``Fck(i) Fn(i+1) .. Fn(j-1)``."""
    return [Op("Fck", i)] + [Op("Fn", k) for k in range(i + 1, j)] if j > i else []


def _segmented(chain: Chain, starts: tuple[int, ...], meta: dict) -> Schedule:
    """checkpoint_sequential's pattern for segments beginning at ``starts`` (``starts[0] == 0``, increasing).

    Every segment but the last runs forward without autograd keeping its input (the checkpoint); the last runs with
    autograd. Backward: the last segment's B ops, then each earlier segment re-run with Fall and reversed.
    """
    L = chain.length
    ends = [s - 1 for s in starts[1:]] + [L - 1]
    ops: list[Op] = []
    for s, e in zip(starts[:-1], ends[:-1]):
        ops += _advance(s, e + 1)
    last = starts[-1]
    ops += [Op("Fall", i) for i in range(last, L)] + [Op("Loss", L)] + [Op("B", i) for i in range(L - 1, last - 1, -1)]
    for s, e in reversed(list(zip(starts[:-1], ends[:-1]))):
        ops += [Op("Fall", i) for i in range(s, e + 1)] + [Op("B", i) for i in range(e, s - 1, -1)]
    return Schedule(tuple(ops), dict(meta))


@lru_cache(maxsize=4096)
def _score(chain: Chain, schedule: Schedule) -> Point:
    """(peak, makespan) of a simulated schedule; cached because budget sweeps re-score the same candidates."""
    return peak_and_makespan(chain, schedule)


def _parse_budget(budget: Budget) -> int | None:
    return None if budget is None else parse_bytes(budget)


def _infeasible(name: str, budget: int, min_budget: int) -> InfeasibleBudget:
    return InfeasibleBudget(
        f"no {name} schedule fits in {budget} bytes ({format_bytes(budget)}); it needs at least {min_budget} bytes "
        f"({min_budget / 2**20:.2f} MiB): raise the budget or use a strategy that recomputes more",
        min_budget=min_budget, budget=budget,
    )


def _pick(scored: list, budget: int | None, name: str):
    """The key of the fastest candidate whose peak fits ``budget`` (ties: smaller peak); ``scored`` holds
    ``((peak, makespan), key)`` pairs."""
    ok = [(t, p, k) for (p, t), k in scored if budget is None or p <= budget]
    if not ok:
        raise _infeasible(name, budget, min(p for (p, _), _ in scored))
    return min(ok, key=lambda c: (c[0], c[1]))[2]


# ------------------------------------------------------------------ revolve
def _binomial(s: int, r: int) -> int:
    """β(s, r) = C(s + r, s): the most steps s snapshots can reverse with at most r forwards of any step."""
    return math.comb(s + r, s) if r >= 0 else 0


def _revolve_cost(steps: int, slots: int) -> int:
    """Least number of advancing forwards to reverse ``steps`` uniform steps from a held start with ``slots`` extra
    checkpoints (Griewank–Walther: r·l − β(s+1, r−1) with s = slots + 1 snapshots, r the least repetition count with
    β(s, r) ≥ l)."""
    if steps <= 1:
        return 0
    s, r = slots + 1, 0
    while _binomial(s, r) < steps:
        r += 1
    return r * steps - _binomial(s + 1, r - 1)


def _revolve_split(steps: int, slots: int) -> int:
    """How far to advance before storing the next checkpoint so the total cost is :func:`_revolve_cost`.

    Griewank–Walther's closed-form choice (as in their ``revolve`` code), with s = slots + 1 snapshots and r the
    repetition count; the tests check it against a brute-force minimum over every split.
    """
    s, r = slots + 1, 0
    while _binomial(s, r) < steps:
        r += 1
    b = lambda a, k: _binomial(a, k) if a >= 0 else 0
    if steps <= b(s, r - 1) + b(s - 2, r - 1):
        j = b(s, r - 2)
    elif steps >= b(s, r) - b(s - 3, r):
        j = b(s, r - 1)
    else:
        j = steps - b(s - 1, r - 1) - b(s - 2, r - 1)
    return max(1, min(steps - 1, j))


@lru_cache(maxsize=256)
def _revolve_ops(L: int, slots: int) -> tuple[Op, ...]:
    """The revolve op list for an L-stage chain with ``slots`` checkpoints besides x_0 (depends on L only)."""
    ops: list[Op] = []
    # Explicit stack of (start, steps, slots, holds_loss): the recursion is up to L deep.
    todo = [(0, L, slots, True)]
    while todo:
        i, steps, c, spine = todo.pop()
        if steps == 1 or c == 0:
            # No slot left: for each step from the last, advance to it from the held start and reverse it.
            for k in range(steps - 1, -1, -1):
                ops += _advance(i, i + k) + [Op("Fall", i + k)]
                ops += [Op("Loss", L)] if spine and k == steps - 1 else []
                ops.append(Op("B", i + k))
            continue
        j = _revolve_split(steps, c)
        ops += _advance(i, i + j)  # x_{i+j} is now a checkpoint
        todo.append((i, j, c, False))  # then the left part, with the slot back
        todo.append((i + j, steps - j, c - 1, spine))  # first the right part
    return tuple(ops)


def _revolve_schedule(L: int, slots: int, budget: int | None) -> Schedule:
    meta = {"strategy": "revolve", "slots": slots}
    if budget is not None:
        meta["budget"] = budget
    return Schedule(_revolve_ops(L, slots), meta)


# ------------------------------------------------------------------ Chen et al.
def _chen_segments(sizes: tuple[int, ...], threshold: float) -> tuple[int, ...]:
    """Segment starts from Chen's greedy walk: close a segment after the stage where the running size exceeds the
    threshold (its output x_{i+1} becomes a checkpoint; the network output x_L never does)."""
    starts, run = [0], 0
    for i in range(len(sizes) - 1):
        run += sizes[i]
        if run > threshold:
            starts.append(i + 1)
            run = 0
    return tuple(starts)


def _chen_candidates(chain: Chain, n: int = 48) -> list[tuple[tuple[int, ...], float]]:
    """Distinct segmentations over a geometric sweep of thresholds from 0 to the total size (store-all)."""
    sizes = chain.xbar
    total = sum(sizes)
    lo = min((s for s in sizes if s > 0), default=0)
    thresholds = [0.0]
    if total > 0:
        thresholds += [lo * (total / lo) ** (k / (n - 1)) for k in range(n)]
    seen: dict[tuple[int, ...], float] = {}
    for thr in thresholds:
        seen.setdefault(_chen_segments(sizes, thr), thr)
    return list(seen.items())


def _chen_schedule(chain: Chain, starts: tuple[int, ...], threshold: float, budget: int | None) -> Schedule:
    meta = {"strategy": "chen_greedy", "threshold": threshold, "checkpoints": list(starts[1:])}
    if budget is not None:
        meta["budget"] = budget
    return _segmented(chain, starts, meta)
