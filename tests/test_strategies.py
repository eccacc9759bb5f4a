"""core/strategies.py: every baseline is a valid schedule, does what its paper/library does, respects its budget, and
is never better than the optimal solver at its own memory."""

from __future__ import annotations

import math
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hchain_viz.core import strategies as S
from hchain_viz.core.chain import Chain
from hchain_viz.core.schedule import Op, Schedule
from hchain_viz.core.simulate import simulate
from hchain_viz.errors import HChainError, InfeasibleBudget


@st.composite
def chains(draw, max_len: int = 7, max_size: int = 6) -> Chain:
    """Small chains with integer sizes and times (zeros included), so sums are exact."""
    L = draw(st.integers(1, max_len))

    def ints(n: int, hi: int) -> list[int]:
        return draw(st.lists(st.integers(0, hi), min_size=n, max_size=n))

    x = ints(L + 1, max_size)
    extra = ints(L, max_size)
    structure = {}
    if draw(st.booleans()):  # layers, core-attention tags and shared tensors, as a sub-layer profile has them
        cuts = sorted(set(draw(st.lists(st.integers(0, L - 1), max_size=L))))
        bounds = [c for c in cuts] + [L]
        groups = [(f"h.{n}", a, b - 1) for n, (a, b) in enumerate(zip(bounds, bounds[1:])) if b - 1 >= a]
        groups = [g for g in groups if draw(st.booleans())] or groups  # some stages may stay outside every layer
        tags = [draw(st.sampled_from(["", "", "attn_core"])) for _ in range(L)]
        shared = []
        if L >= 1 and draw(st.booleans()):
            first = draw(st.integers(0, L - 1))
            last = draw(st.integers(first + 1, L))
            room = min(x[first:last + 1])
            if room:
                shared = [(first, last, draw(st.integers(1, room)))]
        structure = dict(groups=groups, tags=tags, shared=shared)
    return Chain(fwd_time=ints(L, 3), bwd_time=ints(L, 3), x=x, xbar=[x[i + 1] + extra[i] for i in range(L)],
                 fwd_tmp=ints(L, 3), bwd_tmp=ints(L, 3), **structure)


def every_schedule(chain: Chain) -> list[Schedule]:
    """Every schedule any family can produce on ``chain``."""
    L = chain.length
    out = [S.store_all(chain), S.recompute_all(chain), S.sqrt_n(chain)]
    out += [S.periodic(chain, n) for n in range(1, L + 1)]
    out += [S._revolve_schedule(L, c, None) for c in range(max(0, L - 2) + 1)]
    out += [S._chen_schedule(chain, st_, thr, None) for st_, thr in S._chen_candidates(chain)]
    if chain.groups:
        out += [S.per_layer(chain)] + [S.layer_periodic(chain, n) for n in range(1, len(S._units(chain)) + 1)]
        out += [S.megatron_block(chain, k) for k in range(len(chain.groups) + 1)]
        out += [S.megatron_uniform(chain, k) for k in range(1, len(chain.groups) + 1)]
    if "attn_core" in chain.tags:
        out.append(S.selective(chain))
    return out


# ------------------------------------------------------------------ validity on many chains
@given(chains())
def test_every_schedule_is_valid_and_labelled(chain):
    for s in every_schedule(chain):
        trace = simulate(chain, s)  # raises InvalidSchedule on any broken rule or an incomplete step
        assert s.meta["strategy"] in S.STRATEGIES
        # Each stage runs forward at least once and backward exactly once; the loss once, after every forward of the
        # first sweep.
        assert sorted(op.stage for op in s if op.kind == "B") == list(range(chain.length))
        assert [op.kind for op in s].count("Loss") == 1
        assert trace.makespan >= chain.store_all_time - 1e-9


@given(chains(), st.integers(0, 200))
def test_registry_respects_budget_or_names_the_least(chain, budget):
    for name in S.applicable(chain):
        fn = S.STRATEGIES[name]
        try:
            s = fn(chain, budget)
        except InfeasibleBudget as e:
            assert e.budget == budget and e.min_budget > budget
            assert f"{e.min_budget} bytes" in str(e)
            # The least budget it names is enough.
            assert simulate(chain, fn(chain, e.min_budget)).peak_memory <= e.min_budget
        else:
            assert simulate(chain, s).peak_memory <= budget, name


@given(chains())
def test_no_budget_gives_each_familys_fastest(chain):
    points = S.frontier_points(chain)
    assert set(points) == set(S.applicable(chain))
    for name in S.applicable(chain):
        fn = S.STRATEGIES[name]
        t = simulate(chain, fn(chain)).makespan
        free = ("periodic", "chen_greedy", "layer_periodic", "megatron_block", "megatron_uniform")
        if name in free:  # free choice within the family: its fastest
            assert t == min(p[1] for p in points[name])
        assert (simulate(chain, fn(chain)).peak_memory, t) in points[name]


# ------------------------------------------------------------------ the fixed baselines
@given(chains())
def test_store_all_and_recompute_all_costs(chain):
    L = chain.length
    sa = simulate(chain, S.store_all(chain))
    assert sa.makespan == chain.store_all_time and sa.n_recomputed == 0
    ra = simulate(chain, S.recompute_all(chain))
    # Stage k is recomputed once for every backward at or after it: L - k times.
    assert ra.makespan == chain.store_all_time + sum((L - k) * f for k, f in enumerate(chain.fwd_time))
    assert ra.n_recomputed == L * (L + 1) // 2
    # Nothing but x_0 is kept across the forward: one activation besides the input at a time.
    assert all(sum(it.kind == "x" for it in e.resident) <= 2 for e in ra.events)


def test_recompute_all_ops():
    s = S.recompute_all(Chain.homogeneous(3))
    assert str(s) == "Fck0 Fn1 Fn2 Loss Fck0 Fn1 Fall2 B2 Fck0 Fall1 B1 Fall0 B0"


def checkpoint_sequential_segments(L: int, segments: int) -> list[tuple[int, int, bool]]:
    """(start, end, checkpointed) as torch.utils.checkpoint.checkpoint_sequential splits L functions."""
    size = L // segments
    out, end = [], -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        out.append((start, end, True))
    return out + [(end + 1, L - 1, False)]


def expected_periodic_ops(L: int, segments: int) -> list[Op]:
    segs = checkpoint_sequential_segments(L, segments)
    ops = []
    for a, b, ck in segs:  # forward: no autograd in checkpointed segments, keeping only their input
        ops += [Op("Fck" if k == a else "Fn", k) if ck else Op("Fall", k) for k in range(a, b + 1)]
    ops.append(Op("Loss", L))
    for a, b, ck in reversed(segs):  # backward: recompute a checkpointed segment, then its backwards
        ops += ([Op("Fall", k) for k in range(a, b + 1)] if ck else []) + [Op("B", k) for k in range(b, a - 1, -1)]
    return ops


@pytest.mark.parametrize("L", [1, 2, 3, 5, 7, 10, 16])
def test_periodic_matches_checkpoint_sequential_segmentation(L):
    chain = Chain.homogeneous(L)
    for n in range(1, L + 1):
        s = S.periodic(chain, n)
        assert list(s.ops) == expected_periodic_ops(L, n), n
        assert s.meta == {"strategy": "periodic", "segments": n}
    assert S.periodic(chain, 1).ops == S.store_all(chain).ops


def test_periodic_example():
    # 7 stages, 3 segments: size 2, checkpointed [0,1] and [2,3], then [4..6] with autograd.
    s = S.periodic(Chain.homogeneous(7), 3)
    assert str(s) == ("Fck0 Fn1 Fck2 Fn3 Fall4 Fall5 Fall6 Loss B6 B5 B4 Fall2 Fall3 B3 B2 Fall0 Fall1 B1 B0")


@pytest.mark.parametrize("bad", [0, 6, -1, 1.5, True, "2", None])
def test_periodic_rejects_bad_segments(bad):
    with pytest.raises(HChainError, match="segments must be an integer from 1 to the number of stages \\(5\\)"):
        S.periodic(Chain.homogeneous(5), bad)


@pytest.mark.torch
@pytest.mark.parametrize("L, segments", [(1, 1), (4, 2), (5, 2), (7, 3), (8, 8), (9, 4)])
def test_periodic_replays_torch_checkpoint_sequential(L, segments):
    """Run the real checkpoint_sequential on recording stages and compare its op order with ours."""
    torch = pytest.importorskip("torch")
    log: list[tuple] = []

    class Tag(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, i):
            ctx.i = i
            return y.view_as(y)

        @staticmethod
        def backward(ctx, g):
            log.append(("B", ctx.i))
            return g, None

    class Stage(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i, self.lin = i, torch.nn.Linear(3, 3)

        def forward(self, x):
            log.append(("Fall" if torch.is_grad_enabled() else "Fno", self.i))
            return Tag.apply(torch.tanh(self.lin(x)), self.i)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Stage(i) for i in range(L)])
    x = torch.randn(2, 3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint_sequential(model, segments, x, use_reentrant=True)
    log.append(("Loss", L))
    out.sum().backward()

    as_logged = {"Fck": "Fno", "Fn": "Fno", "Fall": "Fall", "Loss": "Loss", "B": "B"}
    ours = [(as_logged[op.kind], op.stage) for op in S.periodic(Chain.homogeneous(L), segments)]
    assert log == ours


def test_sqrt_n():
    for L, n in [(1, 1), (2, 1), (3, 2), (4, 2), (9, 3), (12, 3), (13, 4), (100, 10)]:
        chain = Chain.homogeneous(L)
        s = S.sqrt_n(chain)
        assert s.meta == {"strategy": "sqrt_n", "segments": n}
        assert s.ops == S.periodic(chain, n).ops


# ------------------------------------------------------------------ revolve
@cache
def revolve_cost_brute(steps: int, slots: int) -> int:
    """The binomial recursion written plainly: advance j, reverse the right part with a slot less, then the left."""
    if steps <= 1:
        return 0
    if slots == 0:
        return steps * (steps - 1) // 2
    return min(j + revolve_cost_brute(steps - j, slots - 1) + revolve_cost_brute(j, slots) for j in range(1, steps))


def test_revolve_cost_and_split_match_brute_force():
    for steps in range(1, 45):
        for slots in range(0, 45):
            assert S._revolve_cost(steps, slots) == revolve_cost_brute(steps, slots), (steps, slots)
            if steps >= 2 and slots >= 1:
                j = S._revolve_split(steps, slots)
                assert 1 <= j < steps
                assert j + S._revolve_cost(steps - j, slots - 1) + S._revolve_cost(j, slots) == \
                    S._revolve_cost(steps, slots), (steps, slots)


def test_revolve_cost_closed_forms():
    assert [S._revolve_cost(n, 0) for n in range(1, 6)] == [0, 1, 3, 6, 10]  # no slot: n(n-1)/2
    assert all(S._revolve_cost(n, n - 2) == n - 1 for n in range(2, 30))  # enough slots: one advance per step
    # Griewank-Walther: with s snapshots and r repetitions, beta(s, r) = C(s + r, s) steps cost r*l - C(s+r, s-1)
    for s_ in range(1, 6):
        for r in range(1, 6):
            n = math.comb(s_ + r, s_)
            assert S._revolve_cost(n, s_ - 1) == r * n - math.comb(s_ + r, s_ + 1)


@pytest.mark.parametrize("L", [1, 2, 3, 6, 11, 20])
def test_revolve_recomputes_the_binomial_minimum(L):
    chain = Chain.homogeneous(L, fwd_time=1.0, bwd_time=0.0)
    for c in range(max(0, L - 2) + 1):
        s = S._revolve_schedule(L, c, None)
        t = simulate(chain, s)
        assert t.n_recomputed == S._revolve_cost(L, c)
        assert t.makespan == L + S._revolve_cost(L, c)
        # At most c checkpoints besides x_0 and the working activation are plain x items at any time.
        assert max(sum(it.kind == "x" for it in e.resident) for e in t.events) <= c + 2


def test_revolve_example():
    # 4 uniform steps, 1 slot: advance 1 (checkpoint x_1), reverse [1..3] from it with no slot left, then [0].
    s = S._revolve_schedule(4, 1, None)
    assert str(s) == "Fck0 Fck1 Fn2 Fall3 Loss B3 Fck1 Fall2 B2 Fall1 B1 Fall0 B0"
    assert S._revolve_cost(4, 1) == 4 == s.n_recomputed


@given(chains(max_len=8), st.integers(0, 300))
def test_revolve_fits_and_uses_as_many_slots_as_fit(chain, budget):
    L = chain.length
    c_max = max(0, L - 2)
    peaks = [S._score(chain, S._revolve_schedule(L, c, None))[0] for c in range(c_max + 1)]
    try:
        s = S.revolve(chain, budget)
    except InfeasibleBudget as e:
        assert e.min_budget == min(peaks) > budget
        return
    c = s.meta["slots"]
    assert s.meta == {"strategy": "revolve", "slots": c, "budget": budget}
    assert peaks[c] == simulate(chain, s).peak_memory <= budget
    assert c == c_max or peaks[c + 1] > budget


def test_revolve_budget_text_and_none():
    chain = Chain.random(12, seed=4)
    assert S.revolve(chain).meta["slots"] == 10
    mid = S.frontier_points(chain)["revolve"][3][0]
    assert S.revolve(chain, f"{mid}B").ops == S.revolve(chain, mid).ops
    with pytest.raises(InfeasibleBudget, match="no revolve schedule fits") as info:
        S.revolve(chain, "1KiB")
    assert info.value.min_budget == S.frontier_points(chain)["revolve"][0][0]


def test_revolve_gets_faster_with_budget_on_uniform_chain():
    chain = Chain.homogeneous(16)
    times = [simulate(chain, S.revolve(chain, p)).makespan for p, _ in S.frontier_points(chain)["revolve"]]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


# ------------------------------------------------------------------ Chen et al.
def chen_walk(sizes, threshold):
    """Chen et al. 2016, Alg. 3 as printed: accumulate sizes; past the threshold, the node becomes a checkpoint."""
    checkpoints, temp = [], 0
    for i, size in enumerate(sizes[:-1]):  # the last stage's output is the network output
        temp += size
        if temp > threshold:
            checkpoints.append(i + 1)
            temp = 0
    return checkpoints


@given(chains(max_len=9), st.integers(0, 300))
def test_chen_greedy_fits_is_fastest_candidate_and_follows_the_walk(chain, budget):
    cands = [(S._score(chain, S._chen_schedule(chain, st_, t, None)), st_) for st_, t in S._chen_candidates(chain)]
    try:
        s = S.chen_greedy(chain, budget)
    except InfeasibleBudget as e:
        assert e.min_budget == min(p for (p, _), _ in cands) > budget
        return
    peak, time = S._score(chain, s)
    assert peak <= budget
    assert time == min(t for (p, t), _ in cands if p <= budget)
    assert s.meta["checkpoints"] == chen_walk(chain.xbar, s.meta["threshold"])
    # The schedule is checkpoint_sequential's pattern on Chen's segments.
    starts = (0, *s.meta["checkpoints"])
    assert s.ops == S._segmented(chain, starts, {}).ops


def test_chen_candidates_span_store_all_to_every_stage():
    chain = Chain.random(10, seed=7)
    segs = {st_ for st_, _ in S._chen_candidates(chain)}
    assert (0,) in segs  # a threshold above the total: store-all
    assert tuple(range(10)) in segs  # threshold 0: every stage input a checkpoint
    assert S.chen_greedy(chain).ops == S.store_all(chain).ops


# ------------------------------------------------------------------ registry, frontier
def test_registry_and_baseline_schedules():
    chain = Chain.random(9, seed=1)
    plain = {"store_all", "periodic", "sqrt_n", "chen_greedy", "revolve", "recompute_all"}
    assert set(S.STRATEGIES) == plain | {"per_layer", "selective", "layer_periodic", "megatron_block",
                                         "megatron_uniform"}
    assert set(S.applicable(chain)) == plain  # no groups, no tags: the transformer families do not apply
    every = S.baseline_schedules(chain)
    assert set(every) == plain
    assert all(s.meta["strategy"] == name for name, s in every.items())
    store_peak = simulate(chain, every["store_all"]).peak_memory
    small = simulate(chain, every["recompute_all"]).peak_memory
    some = S.baseline_schedules(chain, store_peak - 1)
    assert "store_all" not in some and "recompute_all" in some
    assert all(simulate(chain, s).peak_memory <= store_peak - 1 for s in some.values())
    assert S.baseline_schedules(chain, 0) == {}
    assert small < store_peak
    assert set(S.baseline_schedules(chain, f"{store_peak}B")) == plain


def test_fixed_strategy_infeasible_message():
    chain = Chain.homogeneous(4, x=2**20)
    peak = simulate(chain, S.store_all(chain)).peak_memory
    with pytest.raises(InfeasibleBudget, match=rf"store_all .* at least {peak} bytes \({peak / 2**20:.2f} MiB\)"):
        S.STRATEGIES["store_all"](chain, "1MiB")


def test_frontier_points_are_the_simulated_schedules():
    chain = Chain.random(8, seed=2)
    pts = S.frontier_points(chain)
    assert set(pts) == set(S.applicable(chain))
    score = lambda s: (simulate(chain, s).peak_memory, simulate(chain, s).makespan)
    assert pts["store_all"] == [score(S.store_all(chain))]
    assert pts["recompute_all"] == [score(S.recompute_all(chain))]
    assert pts["sqrt_n"] == [score(S.sqrt_n(chain))]
    assert pts["periodic"] == sorted({score(S.periodic(chain, n)) for n in range(1, 9)})
    assert len(pts["revolve"]) >= 2 and len(pts["chen_greedy"]) >= 2
    for name, p in pts.items():
        assert p == sorted(set(p)) and all(isinstance(m, int) and isinstance(t, float) for m, t in p), name
    # Every budget-driven choice is one of the family's points.
    for p, _ in pts["chen_greedy"]:
        assert score(S.chen_greedy(chain, p)) in pts["chen_greedy"]


def test_pareto():
    assert S.pareto([(5, 1.0), (1, 9.0), (3, 4.0), (4, 4.0), (2, 9.5), (6, 1.0), (1, 9.0)]) == \
        [(1, 9.0), (3, 4.0), (5, 1.0)]
    assert S.pareto([]) == []


# ------------------------------------------------------------------ against the optimum
def _solver():
    from hchain_viz.core import solver

    return solver


@given(chains(max_len=6, max_size=5))
def test_optimal_never_slower_than_any_baseline_at_its_peak(chain):
    solver = _solver()
    pts = [p for ps in S.frontier_points(chain).values() for p in ps]
    top = max(1, max(p for p, _ in pts))  # an all-zero chain still needs one slot
    sol = solver.solve(chain, max_budget=top, slots=top)  # exact: integer sizes, one byte per slot
    for peak, time in pts:
        assert sol.makespan(peak) <= time + 1e-9, (peak, time)


# ------------------------------------------------------------------ transformer baselines (chain.groups, chain.tags)
def test_per_layer_and_selective_on_a_sub_layer_transformer():
    chain = Chain.transformer(3)
    L = chain.length
    full, sel, store = S.per_layer(chain), S.selective(chain), S.store_all(chain)
    # per layer: each layer's input kept (Fck on its first stage), its stages recomputed once; embed and head stored
    assert [op.stage for op in full if op.kind == "Fck"] == [first for _, first, _ in chain.groups]
    assert full.n_recomputed == 6 * 3
    assert [op.kind for op in full if op.stage in (0, L - 1)] == ["Fall", "Fall", "B", "B"]
    # selective: only the core-attention stages (2 per layer) run twice
    core = [i for i, t in enumerate(chain.tags) if t == "attn_core"]
    assert sel.n_recomputed == len(core) == 6
    assert sorted({op.stage for op in sel if op.kind in ("Fck", "Fn")}) == core
    t_full, t_sel, t_store = (simulate(chain, s) for s in (full, sel, store))
    assert t_full.peak_memory < t_sel.peak_memory < t_store.peak_memory
    assert t_full.makespan > t_sel.makespan > t_store.makespan
    assert t_sel.makespan == pytest.approx(chain.store_all_time + sum(chain.fwd_time[i] for i in core))
    for s, name in ((full, "per_layer"), (sel, "selective")):
        assert s.meta["strategy"] == name and S.STRATEGIES[name](chain).ops == s.ops


def test_layer_periodic_is_checkpoint_sequential_over_layers():
    chain = Chain.transformer(4)  # units: embed, h.0 .. h.3, head
    units = S._units(chain)
    assert units == [0, 1, 7, 13, 19, 25]
    assert S.layer_periodic(chain, 1).ops == S.store_all(chain).ops
    three = S.layer_periodic(chain, 3)  # 6 units // 3 = 2 per segment: checkpoints at embed and h.1
    assert [op.stage for op in three if op.kind == "Fck"] == [0, 7]
    assert three.ops == S._segmented(chain, (0, 7, 19), {}).ops
    best = S.best_layer_periodic(chain, simulate(chain, three).peak_memory)
    assert simulate(chain, best).makespan <= simulate(chain, three).makespan
    with pytest.raises(HChainError, match="from 1 to the number of layers and other stages"):
        S.layer_periodic(chain, 7)


@pytest.mark.parametrize("name", ["per_layer", "selective", "layer_periodic", "megatron_block", "megatron_uniform"])
def test_transformer_baselines_need_structure(name):
    chain = Chain.random(6, seed=0)
    with pytest.raises(HChainError, match="granularity") as err:
        S.STRATEGIES[name](chain)
    assert not isinstance(err.value, InfeasibleBudget)
    assert name not in S.applicable(chain) and name not in S.frontier_points(chain)


def test_tag_runs_stop_at_layer_boundaries():
    chain = Chain(fwd_time=[1] * 5, bwd_time=[1] * 5, x=[1] * 6, xbar=[1] * 5, groups=[("a", 0, 1), ("b", 2, 4)],
                  tags=["", "attn_core", "attn_core", "attn_core", ""])
    assert S._tag_runs(chain, "attn_core") == [(1, 1), (2, 3)]
    simulate(chain, S.selective(chain))  # valid


def test_transformer_baselines_on_the_frontier():
    chain = Chain.transformer(2)
    pts = S.frontier_points(chain)
    assert {"per_layer", "selective", "layer_periodic", "megatron_block", "megatron_uniform"} <= set(pts)
    assert pts["per_layer"] == [(simulate(chain, S.per_layer(chain)).peak_memory,
                                 simulate(chain, S.per_layer(chain)).makespan)]
    assert len(pts["layer_periodic"]) >= 2
    assert set(S.baseline_schedules(chain)) == set(S.STRATEGIES)


# ------------------------------------------------------------------ Megatron-LM full recomputation, block and uniform
def _recomputed_stages(s: Schedule) -> list[int]:
    """Stages whose forward runs more than once, in stage order."""
    kinds = [op.stage for op in s if op.kind in ("Fck", "Fn", "Fall")]
    return sorted({i for i in kinds if kinds.count(i) > 1})


def test_megatron_block_recomputes_the_first_k_layers():
    chain = Chain.transformer(4)  # embed, h.0 .. h.3 (6 stages each), head
    layers = chain.groups
    assert S.megatron_block(chain, 0).ops == S.store_all(chain).ops
    assert S.megatron_block(chain, 4).ops == S.per_layer(chain).ops
    prev = None
    for k in range(5):
        s = S.megatron_block(chain, k)
        assert s.meta == {"strategy": "megatron_block", "k": k}
        assert _recomputed_stages(s) == [i for _, a, b in layers[:k] for i in range(a, b + 1)]
        assert [op.stage for op in s if op.kind == "Fck"] == [a for _, a, _ in layers[:k]]
        tr = simulate(chain, s)
        assert tr.makespan == pytest.approx(chain.store_all_time + sum(chain.fwd_time[i] for i in
                                                                       _recomputed_stages(s)))
        if prev is not None:  # each more layer recomputed: no more memory, more time (identical layers)
            assert tr.peak_memory <= prev.peak_memory and tr.makespan > prev.makespan
        prev = tr
    assert prev.peak_memory < simulate(chain, S.megatron_block(chain, 1)).peak_memory
    with pytest.raises(HChainError, match="from 0 to the number of layers"):
        S.megatron_block(chain, 5)


def test_megatron_uniform_recomputes_groups_of_k_layers():
    chain = Chain.transformer(5)
    layers = chain.groups
    assert S.megatron_uniform(chain, 1).ops == S.per_layer(chain).ops
    for k in range(1, 6):
        s = S.megatron_uniform(chain, k)
        firsts = [layers[n][1] for n in range(0, 5, k)]
        assert [op.stage for op in s if op.kind == "Fck"] == firsts  # one kept input per group
        assert _recomputed_stages(s) == list(range(layers[0][1], layers[-1][2] + 1))
        # the backward re-runs each group whole before its backwards: Fall over the group, then B reversed
        ops = list(s.ops)
        for n in range(0, 5, k):
            a, b = layers[n][1], layers[min(n + k, 5) - 1][2]
            start = ops.index(Op("Fall", a), ops.index(Op("Loss", chain.length)))
            assert ops[start:start + 2 * (b - a + 1)] == [Op("Fall", i) for i in range(a, b + 1)] + \
                [Op("B", i) for i in range(b, a - 1, -1)]
        simulate(chain, s)
    # fewer kept inputs, bigger recomputed units: the kept-input part of the peak falls with k on this chain
    peaks = [simulate(chain, S.megatron_uniform(chain, k)).peak_memory for k in range(1, 6)]
    assert peaks[-1] != peaks[0]
    with pytest.raises(HChainError, match="from 1 to the number of layers"):
        S.megatron_uniform(chain, 0)


def test_megatron_uniform_cuts_groups_at_stages_outside_layers():
    chain = Chain(fwd_time=[1] * 5, bwd_time=[1] * 5, x=[1] * 6, xbar=[2] * 5,
                  groups=[("a", 0, 1), ("b", 3, 4)])  # stage 2 is in no layer
    s = S.megatron_uniform(chain, 2)
    assert [op.stage for op in s if op.kind == "Fck"] == [0, 3]
    assert _recomputed_stages(s) == [0, 1, 3, 4]
    simulate(chain, s)


@given(chains(), st.integers(0, 200))
def test_best_megatron_picks_the_fastest_k_that_fits(chain, budget):
    if not chain.groups:
        return
    n = len(chain.groups)
    for name, make, ks in (("megatron_block", S.megatron_block, range(n + 1)),
                           ("megatron_uniform", S.megatron_uniform, range(1, n + 1))):
        scored = [(simulate(chain, make(chain, k)), k) for k in ks]
        fits = [tr.makespan for tr, _ in scored if tr.peak_memory <= budget]
        try:
            got = simulate(chain, S.STRATEGIES[name](chain, budget))
        except InfeasibleBudget as e:
            assert not fits and e.min_budget == min(tr.peak_memory for tr, _ in scored)
        else:
            assert got.peak_memory <= budget and got.makespan == min(fits)


def test_baseline_frontier_is_the_pareto_front_of_every_family():
    chain = Chain.transformer(3)
    front = S.baseline_frontier(chain)
    every = [p for ps in S.frontier_points(chain).values() for p in ps]
    assert [(p, t) for p, t, _, _ in front] == S.pareto(every)
    for p, t, label, s in front:
        tr = simulate(chain, s)
        assert (tr.peak_memory, tr.makespan) == (p, t)
        assert label.split("(")[0] == s.meta["strategy"] or label == s.meta["strategy"]
