"""Pipeline plans (docs/design.md §12): the per-stage memory model, the timeline simulator and the solver, checked
against exhaustive enumeration of partitions scored by the simulator."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import oracles
import pytest

import hchain_viz as hcv
from hchain_viz.core.fixed import FixedMemory
from hchain_viz.core.pipeline import (
    Pipeline,
    PipelinePlan,
    StageRun,
    baseline_plans,
    fit_pipeline,
    in_flight,
    interleaved_order,
    plan_pipeline,
    rank_order,
    split_units,
    stage_chain,
)
from hchain_viz.core.strategies import store_all
from hchain_viz.errors import InvalidPipeline, PipelineDoesNotFit


def with_fixed(chain: hcv.Chain, per_stage: int = 50_000) -> hcv.Chain:
    g = [per_stage * (1 + i % 3) for i in range(chain.length)]
    return dataclasses.replace(chain, fixed=FixedMemory(params=sum(g), stage_grads=g, optimizer_state=2 * sum(g),
                                                        step_tmp=sum(g) // 2))


def small_transformer(layers: int = 4) -> hcv.Chain:
    return with_fixed(hcv.Chain.transformer(layers=layers, batch=2, seq=64, hidden=64, heads=2, vocab=300))


# ---------------------------------------------------------------------------------------------- the model
def test_whole_chain_as_one_stage_is_the_chain():
    c = small_transformer()
    sub = stage_chain(c, 0, c.length)
    for f in ("fwd_time", "bwd_time", "x", "xbar", "fwd_tmp", "bwd_tmp", "shared", "transit", "consumed", "groups",
              "consumed_shared", "delta_through"):
        assert getattr(sub, f) == getattr(c, f), f
    s = hcv.optimal_schedule(c, hcv.solve(c).min_budget * 2)
    a, b = hcv.simulate(c, s), hcv.simulate(sub, s)
    assert (a.peak_memory, a.makespan) == (b.peak_memory, b.makespan)


def test_stage_chain_keeps_what_its_stages_hold():
    c = small_transformer()
    units = split_units(c)
    assert units[0][0] == 0 and units[-1][1] == c.length and len(units) == len(c.groups)
    first, end = units[1][0], units[2][1]
    sub = stage_chain(c, first, end)
    assert sub.length == end - first
    assert sub.x == c.x[first:end + 1] and sub.transit[0] == sub.transit[-1] == 0
    assert [g[0] for g in sub.groups] == ["h.1", "h.2"]
    assert sub.fixed.stage_grads == c.fixed.stage_grads[first:end]
    share = sum(c.fixed.stage_grads[first:end]) / c.fixed.grads
    assert sub.fixed.params == math.ceil(c.fixed.params * share)
    # the pieces' fixed parts add up to the whole (rounded up per piece)
    parts = [stage_chain(c, a, b).fixed for a, b in units]
    assert 0 <= sum(p.params for p in parts) - c.fixed.params < len(parts)
    with pytest.raises(InvalidPipeline):
        stage_chain(c, 3, 3)


def test_a_tied_weight_is_held_by_every_device_that_uses_it():
    """GPT-2's embedding and LM head share a weight: the whole model counts its gradient once, on the head; a
    device with the embedding but not the head holds its own copy of the weight, gradient and optimizer state."""
    c = small_transformer(4)
    L, tied = c.length, 200_000
    grads = list(c.fixed.stage_grads)
    grads[-1] += tied  # the head's backward creates the shared gradient first
    fixed = dataclasses.replace(c.fixed, params=c.fixed.params + tied, stage_grads=grads,
                                optimizer_state=c.fixed.optimizer_state + 2 * tied, tied_grads=[((0, L - 1), tied)])
    c = dataclasses.replace(c, fixed=fixed)
    assert hcv.Chain.from_json(c.to_json()).fixed == fixed
    untied = dataclasses.replace(c, fixed=dataclasses.replace(fixed, tied_grads=()))
    units = split_units(c)
    for a, b in (units[0], (units[0][0], units[1][1]), units[-1], (0, L)):
        with_tied, without = stage_chain(c, a, b).fixed, stage_chain(untied, a, b).fixed
        copy = tied if a == 0 and b < L else 0  # the embedding's device, when the head is on another
        assert with_tied.grads - without.grads == copy
        share = copy / fixed.grads
        assert with_tied.params - without.params == pytest.approx(fixed.params * share, abs=1)
        assert with_tied.optimizer_state - without.optimizer_state == pytest.approx(fixed.optimizer_state * share,
                                                                                     abs=1)
    plan = Pipeline(c, 2).plan(4, 2**60)
    plan_untied = Pipeline(untied, 2).plan(4, 2**60)
    assert plan.stages[0].fixed > plan_untied.stages[0].fixed and plan.stages[1].fixed == plan_untied.stages[1].fixed
    with pytest.raises(hcv.HChainError, match="ascending"):
        dataclasses.replace(fixed, tied_grads=[((3, 1), 10)])
    with pytest.raises(hcv.HChainError, match="pairs"):
        dataclasses.replace(fixed, tied_grads=[(5,)])


def test_in_flight_counts_follow_the_schedules():
    assert [in_flight("1F1B", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", 4, 2, s) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", 4, 8, s) for s in range(4)] == [8] * 4
    for kind, P, M in itertools.product(("1F1B", "GPipe"), (1, 2, 4), (1, 3, 8)):
        for s in range(P):
            order = rank_order(kind, P, M, s)
            assert sorted(order) == sorted([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
            held = most = 0
            for op, _ in order:
                held += 1 if op == "F" else -1
                most = max(most, held)
            assert most == in_flight(kind, P, M, s)


def test_simulated_memory_peaks_are_the_predicted_peaks():
    c = small_transformer(6)
    for kind in ("1F1B", "GPipe"):
        pipe = Pipeline(c, 3, kind)
        for M in (1, 2, 5):
            least = pipe.least_memory(M)
            for f in (1.0, 1.3, 3.0):
                plan = pipe.plan(M, int(least * f))
                tr = plan.simulate()
                assert tr.peaks == plan.peaks
                assert plan.peak <= int(least * f)
                for st in plan.stages:
                    assert st.peak == st.fixed + max((st.in_flight - 1) * st.run.stored + st.run.working,
                                                     st.step_tmp)


def test_uniform_pipeline_timeline_matches_the_closed_forms():
    c = hcv.Chain.homogeneous(8, fwd_time=1.0, bwd_time=2.0, x=100)
    pipe = Pipeline(c, 4, "1F1B")
    plan = pipe.plan(6, 10**9)  # room to store everything: no recomputation
    assert plan.bounds == (0, 2, 4, 6)
    assert all(st.schedule.n_recomputed == 0 for st in plan.stages)
    # equal stages of F + B = 6 s: (M + P - 1) stage times
    assert plan.step_time == pytest.approx((6 + 4 - 1) * 6.0)
    # one microbatch through GPipe: forwards then backwards in sequence, plus a transfer each way per boundary
    gp = Pipeline(c, 4, "GPipe", bandwidth=100.0).plan(1, 10**9)
    assert gp.step_time == pytest.approx(8 * 3.0 + 2 * 3 * 1.0)
    events = gp.simulate().events
    assert [e.kind for e in events[0]] == ["F", "B"] and events[3][0].start == pytest.approx(3 * 2.0 + 3 * 1.0)


def test_recomputation_sits_inside_the_backward():
    c = small_transformer()
    pipe = Pipeline(c, 2, "1F1B")
    plan = pipe.plan(4, pipe.least_memory(4))
    st = plan.stages[0]
    assert st.schedule.n_recomputed > 0 and st.run.recompute_time > 0
    b = next(e for e in plan.simulate().events[0] if e.kind == "B")
    assert b.recompute == st.run.recompute_time and b.end - b.start == pytest.approx(st.run.bwd_time)


# ---------------------------------------------------------------------------------------------- the solver
def exhaustive(pipe: Pipeline, M: int, limit: int) -> float:
    """The least simulated step time over every partition, each stage with its fastest candidate that fits."""
    p = pipe._p
    U, P = len(p.units), pipe.devices
    best = math.inf
    for inner in itertools.combinations(range(1, U), P - 1):
        cuts = (0, *inner, U)
        stages = []
        for s in range(P):
            k = in_flight(pipe.kind, P, M, s)
            fixed, step = p.fixed(cuts[s], cuts[s + 1])
            fits = [c for c in p.candidates(cuts[s], cuts[s + 1], k) if fixed + max(step, c.need(k)) <= limit]
            if not fits:
                break
            stages.append(p.stage(cuts[s], cuts[s + 1], min(fits, key=lambda c: c.time).run(), k))
        else:
            plan = PipelinePlan(pipe.chain, pipe.kind, M, tuple(stages), pipe.bandwidth)
            best = min(best, plan.step_time)
    return best


@pytest.mark.parametrize("chain", [with_fixed(hcv.Chain.random(6, seed=3, scale=2**16)), small_transformer(4)],
                         ids=["random", "transformer"])
def test_lazy_candidates_answer_as_every_candidate_simulated(chain):
    """A range's candidates are simulated only when a limit reaches them, and ranges of the same blocks share them:
    each range's fastest fitting run and least need are what every candidate's need gives (the frontier's
    simulated; the in-flight ones' from their DP, never below the simulated one)."""
    pipe = Pipeline(chain, 3)
    p, U = pipe._p, len(pipe._p.units)
    lo = pipe.least_memory(4)
    for u0, u1 in itertools.combinations(range(U + 1), 2):
        fixed, step = p.fixed(u0, u1)
        for k in (1, 2, 4):
            cands = p.candidates(u0, u1, k)
            assert all(c.run().need(k) <= c.need(k) for c in cands)  # a DP need is never below the simulated one
            assert p.least(u0, u1, k) == fixed + max(step, min(c.need(k) for c in cands))
            for f in (1.0, 1.1, 1.4, 3.0):
                limit = int(lo * f)
                fits = [c.run() for c in cands if fixed + max(step, c.need(k)) <= limit]
                got = p.best(u0, u1, k, limit)
                assert (got is None) == (not fits)
                if fits:
                    assert got.time == pytest.approx(min(r.time for r in fits), rel=1e-12)
                    assert fixed + max(step, got.need(k)) <= limit
    if chain.groups:  # the middle blocks are equal: their ranges share one set of candidates
        assert p.candidates(1, 2) is p.candidates(2, 3)


@pytest.mark.parametrize("seed", range(3))
def test_each_stage_schedule_is_the_optimum_for_its_microbatches_in_flight(seed):
    """Against every schedule of a 4-stage chain (tests/oracles.py, simulated): with k microbatches in flight the
    planner's schedule is the fastest whose (k - 1)·stored + working fits, and its least need is the least of all.
    The chain's sizes are small enough that the tables count single bytes (no rounding). Frontier schedules alone
    miss this optimum (a slower schedule that stores less wins once other microbatches hold its stored bytes)."""
    c = hcv.Chain.random(4, seed=seed, scale=8)
    runs = [StageRun.of(c, hcv.Schedule(ops)) for ops in oracles.all_remat_schedules(c)]
    p = Pipeline(c, 1, slots=10**9)._p
    U, behind = len(p.units), 0
    for k in (1, 2, 3, 5):
        least = min(r.need(k) for r in runs)
        assert p.least(0, U, k) == least
        for f in (1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 3.0):
            room = int(least * f)
            best = min(r.time for r in runs if r.need(k) <= room)
            got = p.best(0, U, k, room)
            assert got.need(k) <= room and got.time == pytest.approx(best, rel=1e-12), (k, f)
            frontier = [cand.run() for cand in p.candidates(0, U)]
            behind += min(r.time for r in frontier if r.need(k) <= room) > best * (1 + 1e-9)
    assert behind > 0 or seed != 0


@pytest.mark.parametrize("seed", range(5))
def test_solver_matches_exhaustive_enumeration(seed):
    c = with_fixed(hcv.Chain.random(7, seed=seed, scale=2**16))
    for kind, P, M in (("1F1B", 2, 4), ("1F1B", 3, 5), ("GPipe", 3, 2)):
        pipe = Pipeline(c, P, kind, bandwidth=2e9)
        least = pipe.least_memory(M)
        for f in (1.0, 1.15, 1.5, 2.5):
            limit = int(least * f)
            plan = pipe.plan(M, limit)
            assert plan.peak <= limit and plan.exact
            assert plan.step_time == pytest.approx(exhaustive(pipe, M, limit), rel=1e-12), (kind, P, M, f)


def test_never_slower_than_the_baselines():
    c = small_transformer(6)
    for kind, P, M in (("1F1B", 4, 8), ("GPipe", 2, 4)):
        pipe = Pipeline(c, P, kind)
        least = pipe.least_memory(M)
        fitted = 0
        for f in (1.0, 1.2, 1.6, 2.5, 4.0):
            limit = int(least * f)
            plan = pipe.plan(M, limit)
            for name, base in pipe.baselines(M, limit).items():
                if base is not None:
                    fitted += 1
                    assert base.peak <= limit
                    assert plan.step_time <= base.step_time * (1 + 1e-12), (name, f)
            per_stage = pipe.baselines(M, limit)["balanced+per-stage"]
            uniform = pipe.baselines(M, limit)["balanced+uniform"]
            if per_stage and uniform:
                assert per_stage.step_time <= uniform.step_time * (1 + 1e-12)
            balanced_least = pipe.least_memory(M, bounds=pipe.baselines(M, 2**60)["balanced+per-stage"].bounds)
            assert (per_stage is not None) == (limit >= balanced_least) and balanced_least >= least
        assert fitted >= 4  # the baselines were really compared, not all skipped


def test_first_stage_runs_out_first_under_1f1b():
    c = small_transformer(8)
    pipe = Pipeline(c, 4, "1F1B")
    base = pipe.baselines(8, 10**12)["balanced+uniform"]  # store-all on every stage of the balanced partition
    assert base.label == "balanced+uniform (store-all)"
    acts = [st.in_flight_bytes + st.working for st in base.stages]
    assert acts[0] > acts[1] > acts[2] > acts[3]


def test_memory_limit_no_plan_meets_names_the_least():
    c = small_transformer()
    pipe = Pipeline(c, 2, "1F1B")
    least = pipe.least_memory(4)
    assert pipe.plan(4, least).peak <= least
    with pytest.raises(PipelineDoesNotFit, match=f"least per-device memory for this P and M is {least} B") as e:
        plan_pipeline(c, 2, 4, least - 1)
    assert e.value.min_budget == least and e.value.budget == least - 1
    assert isinstance(e.value, hcv.HChainError)


def test_bad_input_raises_clear_errors():
    c = small_transformer(4)
    with pytest.raises(InvalidPipeline, match="only 4 layers"):
        plan_pipeline(c, 5, 2, "1GiB")
    with pytest.raises(InvalidPipeline, match="unknown pipeline schedule 'zb'"):
        plan_pipeline(c, 2, 2, "1GiB", schedule="zb")
    with pytest.raises(InvalidPipeline, match="microbatches must be a positive integer"):
        plan_pipeline(c, 2, 0, "1GiB")
    with pytest.raises(InvalidPipeline, match="devices must be a positive integer"):
        plan_pipeline(c, 0, 2, "1GiB")
    with pytest.raises(InvalidPipeline, match="per-device memory"):
        plan_pipeline(c, 2, 2, "lots")


def test_fit_answers_which_microbatch_counts_fit():
    c = small_transformer(4)
    answers = fit_pipeline(c, 2, Pipeline(c, 2, "GPipe").least_memory(2), (1, 2, 4, 8), "GPipe")
    assert [a.microbatches for a in answers] == [1, 2, 4, 8]
    leasts = [a.least_memory for a in answers]
    assert leasts == sorted(leasts) and leasts[-1] > leasts[0]  # GPipe holds every microbatch
    assert answers[1].plan is not None and answers[-1].plan is None
    for a in answers:
        assert (a.plan is not None) == (a.least_memory <= answers[1].least_memory)
    one = fit_pipeline(c, 2, "1GiB", (1, 8))
    assert one[1].plan.step_time / 8 < one[0].plan.step_time  # more microbatches: smaller bubbles per sample


def test_baselines_are_what_they_say():
    c = small_transformer(8)
    out = baseline_plans(c, 4, 8, 10**12)
    uniform, per_stage = out["balanced+uniform"], out["balanced+per-stage"]
    assert uniform.bounds == per_stage.bounds
    assert all(st.schedule.ops == store_all(st.chain).ops for st in uniform.stages)


# ---------------------------------------------------------------------------------------------- figures
def test_memory_bars_stack_to_each_device_peak():
    from hchain_viz.viz import pipeline as V

    c = small_transformer()
    pipe = Pipeline(c, 2, "1F1B")
    limit = int(pipe.least_memory(4) * 1.2)
    plan = pipe.plan(4, limit)
    fig = V.memory_bars(plan)
    unit = 2 ** 20 if "MiB" in fig.layout.yaxis.title.text else 2 ** 10
    totals = sum(np.asarray(t.y) for t in fig.data)
    assert np.allclose(totals * unit, plan.peaks)
    assert np.allclose(np.asarray(fig.data[0].y) * unit, [st.fixed for st in plan.stages])
    assert fig.layout.shapes[0].y0 * unit == pytest.approx(limit)
    assert max(plan.peaks) <= limit


def test_timeline_marks_recomputation_inside_each_backward():
    from hchain_viz.viz import pipeline as V

    c = small_transformer()
    pipe = Pipeline(c, 2, "1F1B")
    plan = pipe.plan(3, pipe.least_memory(3))
    fig = V.timeline(plan)
    fwd, bwd, rec = fig.data
    assert len(fwd.x) == len(bwd.x) == len(rec.x) == 2 * 3
    assert all(r > 0 for r in rec.x)  # at the least memory both stages recompute
    assert np.allclose(np.asarray(rec.base) + np.asarray(rec.x), bwd.base)  # marked at the start of each B
    events = [e for evs in plan.simulate().events for e in evs if e.kind == "B"]
    assert np.allclose(np.asarray(bwd.x) + np.asarray(rec.x), [e.end - e.start for e in events])
    assert fig.layout.xaxis.range[1] >= plan.step_time


def test_view_slider_drives_both_figures_and_html_is_self_contained(tmp_path):
    from hchain_viz.viz import pipeline as V

    c = small_transformer()
    view = V.PipelineView(c, 2, 4, n=5)
    assert len(view.limits) == 5 and view.limits[0] == view.pipe.least_memory(4)
    view.set_limit(view.limits[0])
    low = view.plan(0)
    assert view.slider.value == 0 and low.peak <= view.limits[0]
    assert np.allclose(sum(np.asarray(t.y) for t in view.bars.data) * view._unit[1], low.peaks)
    assert list(view.timeline.data[2].x) == [e.recompute for evs in low.simulate().events for e in evs
                                              if e.kind == "B"]
    view.set_limit(view.limits[-1])
    high = view.plan(4)
    assert high.step_time < low.step_time and view.text.value.count(hcv.format_time(high.step_time)) == 1
    path = V.to_html(c, 2, 4, tmp_path / "pipe.html", n=4)
    text = open(path, encoding="utf-8").read()
    head, _, rest = text.partition('<script type="text/javascript">')
    plotly_js, _, page = rest.partition("</script>")
    assert len(plotly_js) > 10**6 and "<script src" not in head + page  # plotly.js inside, nothing fetched
    data = json.loads(page.split('<script type="application/json" id="data">')[1].split("</script>")[0])
    assert len(data["frames"]) == 4 and "Plotly.react" in page
    assert [f["label"] for f in data["frames"]][0] == hcv.format_bytes(view.limits[0])


# ---------------------------------------------------------------------------------------------- interleaved 1F1B
def test_interleaved_order_is_torchs_and_gives_the_in_flight_counts():
    # torch's ScheduleInterleaved1F1B, P = 2, v = 2, M = 4 (its pipeline_order without the idle slots)
    assert interleaved_order(2, 2, 4, 0) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("F", 0, 2), ("B", 1, 0), ("F", 0, 3), ("B", 1, 1),
        ("F", 1, 2), ("B", 0, 0), ("F", 1, 3), ("B", 0, 1), ("B", 1, 2), ("B", 1, 3), ("B", 0, 2), ("B", 0, 3)]
    for P, v, M in itertools.product((1, 2, 3, 4), (2, 3), (1, 2, 4, 6, 8, 12)):
        if M % max(1, M // P):
            with pytest.raises(InvalidPipeline, match="multiple of"):
                interleaved_order(P, v, M, 0)
            continue
        for r in range(P):
            order = interleaved_order(P, v, M, r)
            assert sorted(order) == sorted((k, c, m) for k in "FB" for c in range(v) for m in range(M))
            held, most = [0] * v, [0] * v
            for k, c, m in order:
                if k == "B":
                    assert order.index(("F", c, m)) < order.index(("B", c, m))
                held[c] += 1 if k == "F" else -1
                most[c] = max(most[c], held[c])
            assert [in_flight("interleaved", P, M, c * P + r, v) for c in range(v)] == most
    # the first device's first chunk holds every microbatch of a round and more: (v - 1) M/rounds + 2 (P - 1) warm-up
    assert [in_flight("interleaved", 4, 8, j, 2) for j in range(8)] == [8, 8, 7, 5, 4, 4, 3, 1]


def test_interleaved_bubble_is_smaller_than_1f1b_at_equal_work():
    c = hcv.Chain.homogeneous(8, fwd_time=1.0, bwd_time=2.0, x=100)
    for P, M in ((2, 4), (4, 8), (4, 12)):
        one = Pipeline(c, P, "1F1B").plan(M, 10**9)
        two = Pipeline(c, P, "interleaved", chunks=2).plan(M, 10**9)
        T = 3.0 * 8 / P  # F + B of a device's share of the layers
        assert one.step_time == pytest.approx((M + P - 1) * T)
        assert two.step_time == pytest.approx((M + (P - 1) / 2) * T)  # the bubble shrinks by v
        assert two.simulate().bubble < one.simulate().bubble
        assert two.devices == P and len(two.stages) == 2 * P and two.chunks == 2
        assert all(len(evs) == 2 * 2 * M for evs in two.simulate().events)


def test_interleaved_simulated_memory_peaks_are_the_predicted_peaks():
    c = small_transformer(8)
    for P, v, M in ((2, 2, 4), (2, 3, 2), (3, 2, 3)):
        pipe = Pipeline(c, P, "interleaved", chunks=v)
        least = pipe.least_memory(M)
        for f in (1.0, 1.25, 3.0):
            plan = pipe.plan(M, int(least * f))
            tr = plan.simulate()
            assert tr.peaks == plan.peaks and plan.peak <= int(least * f)
            for r in range(P):
                sts, (fixed, step) = plan.rank_stages(r), plan.rank_fixed(r)
                # between one op's own peak alone and every chunk's most in flight under the largest op's curve
                assert plan.peaks[r] >= fixed + max(max(st.run.working for st in sts), step)
                assert plan.peaks[r] <= fixed + max(step, sum(st.in_flight * st.run.stored for st in sts) + max(
                    max(st.run.fwd_peak, st.run.bwd_peak - st.run.stored) for st in sts) + M * sum(plan.rank_sent(r)))
                assert all(b > 0 for b in plan.rank_sent(r))  # every chunk sends an output or a gradient
                chunks = {e.chunk for e in tr.events[r]}
                assert chunks == set(range(v))
        assert pipe.plan(M, least).peak <= least
        with pytest.raises(PipelineDoesNotFit, match=f"is {least} B"):
            pipe.plan(M, least - 1)


def exhaustive_interleaved(pipe: Pipeline, M: int, limit: int) -> float:
    """The least simulated step over every partition into v·P chunks, each device taking, of every choice of one
    candidate per chunk whose device peak fits, the least total time (ties: smaller peak, then candidate order)."""
    from hchain_viz.core.pipeline import rank_activation_peak, sent_bytes

    p, P, v = pipe._p, pipe.devices, pipe.chunks
    U, S = len(p.units), P * v
    best = math.inf
    for inner in itertools.combinations(range(1, U), S - 1):
        cuts = (0, *inner, U)
        runs = {}
        for r in range(P):
            ranges = [(cuts[c * P + r], cuts[c * P + r + 1]) for c in range(v)]
            fixed = sum(p.fixed(*g)[0] for g in ranges)
            step = sum(p.fixed(*g)[1] for g in ranges)
            sent = [sent_bytes(pipe.chain, *p.span(*g), c * P + r, S) for c, g in enumerate(ranges)]
            fits = []
            for n, combo in enumerate(itertools.product(*(p.runs(*g) for g in ranges))):
                peak = fixed + max(step, rank_activation_peak(P, v, M, r, combo, sent))
                if peak <= limit:
                    fits.append((sum(x.time for x in combo), peak, n, combo))
            if not fits:
                break
            for c, run in enumerate(min(fits)[3]):
                runs[c * P + r] = run
        else:
            stages = tuple(p.stage(cuts[j], cuts[j + 1], runs[j], in_flight("interleaved", P, M, j, v))
                           for j in range(S))
            best = min(best, PipelinePlan(pipe.chain, "interleaved", M, stages, pipe.bandwidth, chunks=v).step_time)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_solver_matches_exhaustive_enumeration(seed):
    c = with_fixed(hcv.Chain.random(7, seed=seed, scale=2**16))
    for P, v, M in ((2, 2, 4), (2, 3, 2), (3, 2, 3)):
        pipe = Pipeline(c, P, "interleaved", chunks=v, bandwidth=2e9)
        least = pipe.least_memory(M)
        for f in (1.0, 1.15, 1.5, 2.5):
            limit = int(least * f)
            plan = pipe.plan(M, limit)
            assert plan.peak <= limit and plan.exact
            assert plan.step_time == pytest.approx(exhaustive_interleaved(pipe, M, limit), rel=1e-12), (P, v, M, f)


def test_interleaved_never_slower_than_the_baselines():
    c = small_transformer(8)
    pipe = Pipeline(c, 2, "interleaved", chunks=2)
    least = pipe.least_memory(4)
    fitted = 0
    for f in (1.0, 1.2, 1.6, 2.5, 4.0):
        limit = int(least * f)
        plan = pipe.plan(4, limit)
        bases = pipe.baselines(4, limit)
        for name, base in bases.items():
            if base is not None:
                fitted += 1
                assert base.peak <= limit and base.chunks == 2
                assert plan.step_time <= base.step_time * (1 + 1e-12), (name, f)
        if bases["balanced+uniform"] and bases["balanced+per-stage"]:
            assert bases["balanced+per-stage"].step_time <= bases["balanced+uniform"].step_time * (1 + 1e-12)
    assert fitted >= 4


def test_interleaved_bad_input_raises_clear_errors():
    c = small_transformer(4)
    with pytest.raises(InvalidPipeline, match="chunks .* >= 2"):
        Pipeline(c, 2, "interleaved", chunks=1)
    with pytest.raises(InvalidPipeline, match="needs schedule=\"interleaved\""):
        Pipeline(c, 2, "1F1B", chunks=2)
    with pytest.raises(InvalidPipeline, match=r"8 pipeline stages \(4 devices x 2 chunks\) but .* only 4 layers"):
        Pipeline(c, 4, "interleaved", chunks=2)
    with pytest.raises(InvalidPipeline, match="multiple of max"):
        plan_pipeline(c, 2, 5, "1GiB", schedule="Interleaved1F1B")
    assert plan_pipeline(c, 2, 4, "1GiB", schedule="interleaved").chunks == 2


def test_interleaved_figures_show_each_device_with_its_chunks():
    from hchain_viz.viz import pipeline as V

    c = small_transformer(8)
    pipe = Pipeline(c, 2, "interleaved", chunks=2)
    limit = int(pipe.least_memory(4) * 1.1)
    plan = pipe.plan(4, limit)
    fig = V.memory_bars(plan)
    unit = 2 ** 20 if "MiB" in fig.layout.yaxis.title.text else 2 ** 10
    assert all(len(t.y) == 2 for t in fig.data)  # one bar per device, not per chunk
    assert np.allclose(sum(np.asarray(t.y) for t in fig.data) * unit, plan.peaks)
    assert np.allclose(np.asarray(fig.data[0].y) * unit, [plan.rank_fixed(r)[0] for r in range(2)])
    assert all(t.count(" .. ") == 2 for t in fig.data[0].text)  # both chunks named
    tl = V.timeline(plan)
    assert len(tl.data[0].x) == len(tl.data[1].x) == 2 * 2 * 4
    assert {t.split(" (")[1] for t in tl.data[0].text} == {"chunk 0)", "chunk 1)"}


def least_interleaved_enumerated(pipe: Pipeline, M: int, bounds: tuple[int, ...] | None = None) -> int:
    """The least device memory by enumeration (the solver's own method before it searched): every partition into
    v·P chunks (or the one starting at ``bounds``), each device with every choice of one candidate per chunk."""
    from hchain_viz.core.pipeline import rank_activation_peak, sent_bytes

    p, P, v = pipe._p, pipe.devices, pipe.chunks
    U, S = len(p.units), P * v
    firsts = [u0 for u0, _ in p.units]
    partitions = [tuple(firsts.index(b) for b in bounds)[1:]] if bounds else itertools.combinations(range(1, U), S - 1)
    best = math.inf
    for inner in partitions:
        cuts = (0, *inner, U)
        worst = 0
        for r in range(P):
            ranges = [(cuts[c * P + r], cuts[c * P + r + 1]) for c in range(v)]
            fixed, step = pipe._rank_fixed(ranges)
            sent = [sent_bytes(pipe.chain, *p.span(*g), c * P + r, S) for c, g in enumerate(ranges)]
            worst = max(worst, min(fixed + max(step, rank_activation_peak(P, v, M, r, combo, sent))
                                   for combo in itertools.product(*(p.runs(*g) for g in ranges))))
        best = min(best, worst)
    return best


def rank_pick_enumerated(pipe: Pipeline, ranges: tuple, r: int, M: int, limit: int) -> tuple | None:
    """Of every choice of one candidate per chunk whose device peak fits, the least (total time, peak, order)."""
    from hchain_viz.core.pipeline import rank_activation_peak, sent_bytes

    p, P, v = pipe._p, pipe.devices, pipe.chunks
    fixed, step = pipe._rank_fixed(ranges)
    sent = [sent_bytes(pipe.chain, *p.span(*g), c * P + r, P * v) for c, g in enumerate(ranges)]
    fits = []
    for n, combo in enumerate(itertools.product(*(p.runs(*g) for g in ranges))):
        peak = fixed + max(step, rank_activation_peak(P, v, M, r, combo, sent))
        if peak <= limit:
            fits.append((sum(x.time for x in combo), peak, n, combo))
    return min(fits, key=lambda f: f[:3])[3] if fits else None


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_least_memory_and_picks_match_enumeration(seed):
    """The searched least memory (pruned by lower bounds) and each device's pick (dominated candidates skipped,
    the last two chunks paired at once) are what enumerating every partition and every choice gives."""
    c = with_fixed(hcv.Chain.random(7, seed=seed, scale=2**16))
    for P, v, M in ((2, 2, 4), (2, 3, 2), (3, 2, 3)):
        pipe = Pipeline(c, P, "interleaved", chunks=v, bandwidth=2e9)
        least = pipe.least_memory(M)
        assert least == least_interleaved_enumerated(pipe, M), (P, v, M)
        plan = pipe.plan(M, int(least * 1.2))
        assert pipe.least_memory(M, plan.bounds) == least_interleaved_enumerated(pipe, M, plan.bounds)
        U = len(pipe._p.units)
        for inner in itertools.islice(itertools.combinations(range(1, U), P * v - 1), 0, None, 2):
            cuts = (0, *inner, U)
            for r in range(P):
                ranges = tuple((cuts[k * P + r], cuts[k * P + r + 1]) for k in range(v))
                for f in (0.9, 1.0, 1.1, 1.5, 4.0):
                    limit = int(least * f)
                    want = rank_pick_enumerated(pipe, ranges, r, M, limit)
                    got = pipe.rank_pick(ranges, r, M, limit)
                    assert (got is None) == (want is None), (P, v, M, cuts, r, f)
                    assert got is None or all(a is b for a, b in zip(got, want, strict=True)), (P, v, M, cuts, r, f)


def test_interleaved_least_memory_matches_enumeration_on_a_transformer():
    c = small_transformer(8)
    for P, v, M in ((2, 2, 4), (3, 2, 3)):
        pipe = Pipeline(c, P, "interleaved", chunks=v)
        assert pipe.least_memory(M) == least_interleaved_enumerated(pipe, M), (P, v, M)


@pytest.mark.parametrize("layers, P, v, M", [(16, 4, 2, 8), (12, 2, 3, 4)])
def test_interleaved_planning_scales_to_many_layers(layers, P, v, M):
    """16 layers into 8 chunks (6435 partitions, each device choosing among ~10^4 pairs of candidates), 12 into 6
    (462, ~10^5 triples): the searches answer in seconds, and their answers hold together: the least memory fits
    and one byte less does not, and the plan is exact, fits and is never slower than the baselines."""
    c = small_transformer(layers)
    pipe = Pipeline(c, P, "interleaved", chunks=v)
    least = pipe.least_memory(M)
    assert pipe.plan(M, least).peak <= least
    with pytest.raises(PipelineDoesNotFit, match=f"is {least} B"):
        pipe.plan(M, least - 1)
    limit = int(least * 1.3)
    plan = pipe.plan(M, limit)
    assert plan.exact and plan.peak <= limit and len(plan.stages) == P * v
    assert pipe.least_memory(M, plan.bounds) <= max(plan.peaks)
    for base in pipe.baselines(M, limit).values():
        if base is not None:
            assert plan.step_time <= base.step_time * (1 + 1e-12)
