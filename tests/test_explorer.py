"""The explorer reacts to budget, strategy, overlay and step changes, to its controls and to frontier clicks."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

import hchain_viz as hcv
from hchain_viz.core import strategies
from hchain_viz.errors import HChainError, InfeasibleBudget
from hchain_viz.viz import style
from hchain_viz.viz.explorer import Explorer
from hchain_viz.viz.throttle import Throttle


@pytest.fixture(scope="module")
def chain():
    return hcv.Chain.random(8, seed=4)


@pytest.fixture(scope="module")
def solution(chain):
    return hcv.solve(chain)


@pytest.fixture
def ex(chain, solution):
    return Explorer(chain, solution=solution)


def trace_named(fig, name):
    (t,) = [t for t in fig.data if t.name == name]
    return t


def bar_times(fig):
    """(start, end, stage) of every bar and marker of the timeline."""
    out = []
    for t in fig.data:
        start = np.asarray(t.base if t.type == "bar" else t.x, float)
        end = start + (np.asarray(t.x, float) if t.type == "bar" else 0.0)
        out += zip(start.tolist(), end.tolist(), np.asarray(t.y).tolist())
    return sorted(out)


def expected_times(trace):
    return sorted((e.start, e.end, e.op.stage) for e in trace.events)


def low_budget(solution):
    """A budget where the optimal schedule recomputes."""
    return next(b for b, t in solution.frontier() if t > solution.chain.store_all_time)


def test_initial_state_draws_the_optimal_schedule(ex, solution):
    assert ex.min_budget == solution.min_budget and ex.max_budget == solution.store_all_peak
    assert ex.min_budget <= ex.budget <= ex.max_budget
    assert ex.strategy == "optimal" and ex.step == len(ex.schedule)
    assert ex.schedule.ops == solution.schedule(ex.budget).ops
    assert set(ex.figures) == {"frontier", "memory", "timeline", "tape"}
    assert bar_times(ex.figures["timeline"]) == expected_times(hcv.simulate(ex.chain, ex.schedule))
    assert "Explorer(8 stages" in repr(ex)


def test_budget_change_updates_every_figure(ex, solution):
    figs = ex.figures
    before_tl = bar_times(figs["timeline"])
    before_mem = np.asarray(trace_named(figs["memory"], "total (with transients)").y).copy()
    before_tape = sum(len(t.y) for t in figs["tape"].data)
    b = low_budget(solution)
    ex.budget = b
    assert ex.budget == b and ex.schedule.ops == solution.schedule(b).ops
    trace = hcv.simulate(ex.chain, solution.schedule(b))
    assert bar_times(figs["timeline"]) == expected_times(trace) != before_tl
    total = trace_named(figs["memory"], "total (with transients)")
    assert np.array_equal(np.asarray(total.y), trace.memory_curve()[1])
    assert not np.array_equal(np.asarray(total.y), before_mem)
    assert list(trace_named(figs["memory"], f"budget {hcv.format_bytes(b)}").y) == [b, b]
    assert sum(len(t.y) for t in figs["tape"].data) != before_tape
    assert list(trace_named(figs["frontier"], "budget").x) == [b, b]
    assert ex._budget_slider.value == b and hcv.format_bytes(b) in ex._budget_label.value
    assert f"<td>{trace.n_recomputed}</td>" in ex._stats.value and trace.n_recomputed > 0
    ex.budget = "1GiB"  # text works; above store-all the answer is store-all
    assert ex.budget == 2**30 and ex.schedule.n_recomputed == 0


def test_the_page_gets_the_figures_on_screen(ex, solution):
    """The board's synced state (what a page, a reloaded page or a saved notebook draws) follows every change."""
    def page(name):
        return json.loads(ex._board._figure_json[name])

    ex.budget = low_budget(solution)
    ex.step = 3
    for name, fig in ex.figures.items():
        assert page(name)["layout"]["title"]["text"] == fig.layout.title.text
        assert "width" not in page(name)["layout"]  # the page sizes every figure to its box
    assert page("timeline")["layout"]["shapes"][0]["x0"] == pytest.approx(ex.trace.events[2].end)
    assert ex._board.rows == [["timeline"], ["frontier", "memory"], ["tape"]]


def test_the_player_sits_right_above_the_timeline(ex):
    """Play animates the timeline first: the play row, the status line and then the board with the timeline on top."""
    kids = ex.widget.children
    k = kids.index(ex._board)
    assert ex._play in kids[k - 1].children and ex._board.texts  # the board's caption is the status line
    assert ex._board.rows[0] == ["timeline"]


def test_rough_timings_are_said_once_in_plain_words_with_what_to_do(chain, solution):
    import dataclasses

    def texts(ex):
        return [w.value for w in ex.widget.children if isinstance(getattr(w, "value", None), str)]

    quiet = Explorer(chain, solution=solution, baselines=False)
    assert quiet._timing.value == "" and not any("±" in t for t in texts(quiet))
    spread = [0.18] * 8
    spread[5] = 0.9  # one stage much noisier than the rest: named
    noisy = dataclasses.replace(chain, meta={"time_spread": {"fwd": spread, "bwd": spread}, "repeats": 5})
    ex = Explorer(noisy, baselines=False)
    note = ex._timing.value
    assert "Rough timings." in note and "timed 5 times" in note and f"(most in {noisy.names[5]})" in note
    assert "profile again when the machine is quieter" in note and "repeats=10" in note  # what to do
    said = [t for t in texts(ex) if "±" in t or "timed" in t]
    assert said == [note] and note.count("±") == 1  # once: the header does not repeat it
    assert "median" not in ex._head.value and "identical stages" not in ex._head.value  # no jargon in the header
    tied = dataclasses.replace(noisy, tied=((2, 3, 4),), copy_spread=((0.4, 0.1),))
    assert "identical" not in Explorer(tied, baselines=False)._head.value
    steady_copies = dataclasses.replace(chain, meta={"time_spread": {"fwd": [0.0] * 8, "bwd": [0.0] * 8},
                                                     "repeats": 5})
    assert Explorer(steady_copies, baselines=False)._timing.value == ""


def test_infeasible_budget_is_refused_and_nothing_changes(ex):
    b = ex.budget
    with pytest.raises(InfeasibleBudget, match="least feasible budget") as err:
        ex.budget = ex.min_budget - 1
    assert err.value.min_budget == ex.min_budget
    assert ex.budget == b


def test_strategy_switch_and_overlay(ex, chain, solution):
    ex.budget = solution.store_all_peak
    ex.strategy = "recompute_all"
    assert ex.schedule.ops == strategies.recompute_all(chain).ops
    rec = trace_named(ex.figures["timeline"], style.OP_LABELS["recompute"])
    assert len(rec.y) == strategies.recompute_all(chain).n_recomputed > 0
    assert ex._strategy_dd.value == "recompute_all"
    ex.overlay = "store_all"
    over = trace_named(ex.figures["memory"], "store_all (total)")
    assert np.array_equal(np.asarray(over.y), hcv.simulate(chain, strategies.store_all(chain)).memory_curve()[1])
    assert "store_all" in ex._stats.value
    ex.overlay = None
    assert all(t.name != "store_all (total)" for t in ex.figures["memory"].data)
    ex._strategy_dd.value = "optimal"  # the dropdown drives the same state
    assert ex.strategy == "optimal" and ex.schedule.ops == solution.schedule(ex.budget).ops
    with pytest.raises(HChainError, match="unknown strategy"):
        ex.strategy = "fastest"


def current_point(ex):
    t = trace_named(ex.figures["frontier"], "current")
    return list(t.x), list(t.y)


def test_the_frontier_point_follows_the_strategy_back_to_optimal(ex, solution):
    """Issue 43: after switching back to optimal the marker stayed on the baseline's point until the next key."""
    ex.budget = low_budget(solution)
    optimal = current_point(ex)
    assert optimal == ([ex.budget], [pytest.approx(solution.makespan(ex.budget))])
    ex.strategy = "recompute_all"
    assert current_point(ex) == ([ex.trace.peak_memory], [pytest.approx(ex.trace.makespan)]) != optimal
    ex._strategy_dd.value = "optimal"  # as the dropdown does it
    assert current_point(ex) == optimal


def test_compare_marks_a_strategy_over_the_budget(ex, solution):
    """A compared strategy whose peak is above the budget is marked in the table and said in the note."""
    ex.budget = ex.min_budget
    ex.overlay = "store_all"
    o = hcv.simulate(ex.chain, strategies.store_all(ex.chain))
    assert o.peak_memory > ex.budget
    stats = ex._stats.value
    assert stats.count("hcv-over") == 1 and f"{hcv.format_bytes(o.peak_memory)} ▲" in stats
    assert (f"store_all peaks at {hcv.format_bytes(o.peak_memory)}, "
            f"{hcv.format_bytes(o.peak_memory - ex.budget)} over the {hcv.format_bytes(ex.budget)} budget: "
            "it does not fit") in stats
    ex.budget = ex.max_budget  # everything fits: no mark, no note
    assert "hcv-over" not in ex._stats.value and "does not fit" not in ex._stats.value


def test_compare_fills_a_row_that_is_always_there(ex):
    """Turning compare on changes no height above the figures: the same table rows and note line either way."""
    def shape(html):
        return html.count("<tr"), html.count("hcv-note")

    off = shape(ex._stats.value)
    assert "compare: none" in ex._stats.value
    ex.overlay = "sqrt_n"
    assert shape(ex._stats.value) == off and "compare: none" not in ex._stats.value
    ex.overlay = None
    assert shape(ex._stats.value) == off


def test_baseline_that_cannot_fit_is_shown_at_its_least_budget_with_a_note(ex, chain):
    ex.budget = ex.min_budget
    ex.strategy = "store_all"
    assert ex.schedule.ops == strategies.store_all(chain).ops
    assert "store_all needs at least" in ex._stats.value


def test_step_moves_the_cursor_and_reveals_memory(ex, solution):
    ex.budget = low_budget(solution)
    n = len(ex.schedule)
    figs = ex.figures
    for k in (0, 5, n):
        ex.step = k
        t = ex.trace.events[k - 1].end if k else 0.0
        for name in ("timeline", "memory", "tape"):
            assert figs[name].layout.shapes[0].x0 == pytest.approx(t), name
        assert len(trace_named(figs["memory"], "total (with transients)").y) == 1 + 3 * k
        faint = sum(int(np.sum(np.asarray(tr.marker.opacity) < 1)) for tr in figs["timeline"].data)
        assert faint == n - k
        assert ex._step_slider.value == k
    label = ex._board  # its caption is the status line
    assert label.step == n and len(label.texts) == n + 1 and label.texts[n].startswith("The whole step:")
    ex._step_slider.value = 3  # dragging the step slider: the player and the label follow
    assert ex.step == 3 and label.step == 3 and ex._play.value == 3
    with pytest.raises(HChainError, match="step must be"):
        ex.step = n + 1


def test_play_moves_the_figures_the_slider_and_the_label_together(ex, solution):
    """Issue 43: the label and slider moved in the page while the figures trailed by up to 2 ops. Now the player's
    tick goes through the kernel, which moves all of them in one turn."""
    ex.budget = low_budget(solution)
    for k in (1, 2, 3, 7):
        ex._play.value = k  # a tick of Play in the page
        t = ex.trace.events[k - 1].end
        assert ex.step == k and ex._step_slider.value == k and ex._board.step == k
        for name in ("timeline", "memory", "tape"):
            assert ex.figures[name].layout.shapes[0].x0 == pytest.approx(t), name
            assert json.loads(ex._board._figure_json[name])["layout"]["shapes"][0]["x0"] == pytest.approx(t)


def test_play_slows_to_the_pace_the_kernel_keeps(ex, solution, monkeypatch):
    from hchain_viz.viz import explorer as E

    ex.budget = low_budget(solution)
    ex._play.playing = True
    ticks = [0.0, 0.5, 1.0, 1.01]  # a step that took 500 ms to draw, then one of 10 ms
    monkeypatch.setattr(E.time, "perf_counter", lambda: ticks.pop(0) if len(ticks) > 1 else ticks[0])
    ex._play.value = 1
    assert ex._play.interval == E._PLAY_MAX_MS  # 1.5 x 500 ms, capped
    ex._play.value = 2
    assert ex._play.interval == E._PLAY_MS  # back to its pace once the kernel keeps up


def test_the_step_slider_is_found_by_the_page_keys(ex, solution):
    """Home/End on the step slider are handled in the page (board.py) by this class, with the range as it is now."""
    assert "hcv-step" in ex._step_slider._dom_classes
    n0 = ex._step_slider.max
    ex.budget = low_budget(solution)  # another schedule, another op count: the slider's range follows
    assert ex._step_slider.max == ex._play.max == len(ex.schedule) != n0


def test_budget_change_resets_the_player(ex, solution):
    ex.step = 2
    ex.budget = solution.store_all_peak
    assert ex.step == len(ex.schedule) == ex._play.max == ex._step_slider.max
    assert ex.figures["timeline"].layout.shapes[0].visible is False  # the whole step shown: no cursor


def click(ex, name, x, trace=0):
    """What the page sends when a point of figure ``name`` is clicked."""
    ex._board._on_msg(ex._board, {"event": "click", "name": name, "trace": trace, "x": x, "y": 1.0}, None)


def test_clicking_the_frontier_sets_the_budget(ex, solution):
    fig = ex.figures["frontier"]
    opt = trace_named(fig, "optimal")
    b = int(opt.x[len(opt.x) // 3])
    click(ex, "frontier", b)
    assert ex.budget == b
    assert list(trace_named(fig, "budget").x) == [b, b]
    click(ex, "frontier", 10 * solution.store_all_peak, trace=3)  # any curve: the budget is where the click landed
    assert ex.budget == ex.max_budget  # clamped to the slider's range
    before = ex.budget
    click(ex, "memory", ex.min_budget)  # other figures do not set the budget
    click(ex, "frontier", None)
    assert ex.budget == before


def test_budget_slider_drives_the_budget(ex):
    target = (ex.min_budget + 2 * ex.max_budget) // 3
    ex._budget_slider.value = target  # no event loop here: the throttle runs at once
    assert ex.budget == target


def test_save_schedule_writes_json(ex, tmp_path, solution):
    ex.budget = low_budget(solution)
    path = ex.save_schedule(tmp_path / "s.json")
    back = hcv.Schedule.from_json(path)
    assert back.ops == ex.schedule.ops
    meta = json.loads(open(path).read())
    assert meta["budget"] == ex.budget and meta["strategy"] == "optimal"
    assert meta["makespan"] == pytest.approx(ex.trace.makespan) and meta["peak"] == ex.trace.peak_memory
    ex._path.value = str(tmp_path / "button.json")
    ex._save.click()
    assert hcv.Schedule.from_json(str(tmp_path / "button.json")).ops == ex.schedule.ops
    assert "saved" in ex._save_label.value
    ex._path.value = str(tmp_path / "missing-dir" / "x.json")
    ex._save.click()
    assert "cannot write" in ex._save_label.value


def test_wrap_needs_a_model(ex):
    with pytest.raises(HChainError, match="no model"):
        ex.wrap()


def test_display_hooks(ex):
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_bad_arguments(chain, solution):
    with pytest.raises(HChainError, match="needs a Chain"):
        Explorer(solution)
    with pytest.raises(HChainError, match="another chain"):
        Explorer(hcv.Chain.random(5, seed=9), solution=solution)
    with pytest.raises(HChainError, match="unknown strategy"):
        Explorer(chain, solution=solution, strategy="nope")


# ---------------------------------------------------------------------------------------------- throttle
class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_throttle_without_event_loop_runs_every_call():
    seen = []
    th = Throttle(seen.append, 10.0)
    th(1)
    th(2)
    assert seen == [1, 2]


def test_throttle_coalesces_a_burst_and_ends_on_the_last_value():
    seen = []

    async def drag():
        th = Throttle(seen.append, 0.05)
        for v in range(10):  # a burst well inside one interval
            th(v)
        assert seen == [0] and th.pending
        await asyncio.sleep(0.12)
        assert not th.pending
        th(42)  # long after the last call: runs at once
        assert seen[-1] == 42

    asyncio.run(drag())
    assert seen == [0, 9, 42]


def test_throttle_flush_and_clock():
    seen = []
    clock = FakeClock()

    async def run():
        th = Throttle(seen.append, 1.0, clock=clock)
        th("a")
        th("b")  # too soon: pending
        assert seen == ["a"]
        th.flush()
        assert seen == ["a", "b"] and not th.pending
        clock.t = 5.0
        th("c")
        assert seen == ["a", "b", "c"]

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- with a model
@pytest.mark.torch
def test_explore_profiles_a_model_and_wraps_the_schedule_on_screen():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    ex = hcv.explore(model, x, warmup=0, repeats=1, progress=False)
    assert isinstance(ex, Explorer) and ex.model is model
    assert ex.chain.length == 5 and ex.chain.x[0] == x.numel() * x.element_size()
    ex.budget = ex.min_budget
    wrapped = ex.wrap()
    assert wrapped.schedule.ops == ex.schedule.ops
    out = wrapped(x)
    out.square().mean().backward()
    ref = model(x)
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------- stale widgets
def _alive(ex):
    """The explorer's widgets still open in the kernel (a closed widget has no comm)."""
    from hchain_viz.viz.explorer import _tree

    return [w for w in _tree(ex.widget) if w.comm is not None]


def test_close_releases_every_widget(chain, solution):
    ex = Explorer(chain, solution=solution)
    assert ex._board in _alive(ex) and len(_alive(ex)) > 10
    ex.close()
    assert _alive(ex) == []
    assert ex.schedule.ops == solution.schedule(ex.budget).ops  # the state stays readable


def test_a_new_explorer_on_the_same_chain_replaces_the_old_one(chain, solution):
    first = Explorer(chain, solution=solution)
    other = Explorer(hcv.Chain.random(5, seed=1), baselines=False)
    second = Explorer(chain, solution=solution)
    assert _alive(first) == [] and _alive(second) and _alive(other)  # another chain's explorer stays
    other.close()


def test_rerunning_a_notebook_cell_replaces_its_explorer(chain, solution, monkeypatch):
    from hchain_viz.viz import explorer as E

    cell = {"run": ("cell-a", [])}
    monkeypatch.setattr(E, "_cell", lambda: cell["run"])
    first = Explorer(hcv.Chain.random(5, seed=1), baselines=False)
    # the same cell again with a new chain (re-profiled): replaces the first
    second = Explorer(hcv.Chain.random(5, seed=1), baselines=False)
    assert _alive(first) == [] and _alive(second)
    cell["run"] = ("cell-b", [])
    third = Explorer(hcv.Chain.random(5, seed=2), baselines=False)  # another cell: both stay
    assert _alive(second) and _alive(third)
    cell["run"] = ("cell-c", ["cell-a"])  # cell-a was deleted: its explorer goes
    fourth = Explorer(hcv.Chain.random(5, seed=3), baselines=False)
    assert _alive(second) == [] and _alive(third) and _alive(fourth)
    third.close()
    fourth.close()


def test_transformer_baselines_are_offered_where_they_apply(ex):
    assert "per_layer" not in ex._strategy_dd.options  # a chain without layers: not offered
    with pytest.raises(HChainError, match="unknown strategy 'selective'"):
        ex.strategy = "selective"
    chain = hcv.Chain.transformer(2, seq=64, hidden=64)
    tx = Explorer(chain, solution=hcv.solve(chain, slots=200))
    assert {"per_layer", "selective", "layer_periodic"} <= set(tx._strategy_dd.options)
    tx.strategy = "selective"
    assert tx.schedule.meta["strategy"] == "selective"
    assert {"per_layer", "selective"} <= {t.name for t in tx.figures["frontier"].data}


def test_a_chain_of_compiled_stages_says_so(ex, chain, solution):
    import dataclasses

    assert "compiled" not in ex._head.value
    compiled = dataclasses.replace(chain, meta={**chain.meta, "compile": "fullgraph=True"})
    assert "compiled stages" in Explorer(compiled, solution=solution)._head.value


def test_explorer_shows_an_offload_solution():
    """Explorer(chain, solution=hcv.solve_offload(chain)): the schedules carry transfers, the timeline their
    lanes, the frontier both curves (docs/design.md §9)."""
    import hchain_viz as hcv

    base = hcv.Chain.random(10, seed=3)
    chain = hcv.Chain(fwd_time=[t / 20 for t in base.fwd_time], bwd_time=[t / 20 for t in base.bwd_time], x=base.x,
                      xbar=base.xbar, fwd_tmp=base.fwd_tmp, bwd_tmp=base.bwd_tmp, bandwidth="nvlink-c2c")
    sol = hcv.solve_offload(chain, grid=12)
    ex = hcv.Explorer(chain, solution=sol, baselines=False)
    seen = 0
    for b in sol.grid:
        if b >= ex.min_budget:
            ex.budget = b
            assert ex.trace.makespan == pytest.approx(sol.makespan(b), rel=1e-9)
            seen += ex.schedule.n_transfers > 0
    assert seen
    names = [t.name for t in ex.figures["frontier"].data]
    assert "optimal, remat only" in names


def test_the_status_line_speaks_plain_words_from_the_first_op(ex, solution):
    ex.budget = low_budget(solution)
    texts, ops = ex._board.texts, ex.schedule.ops
    assert texts[0].startswith("Before the first op: only the input x_0 is in memory")
    assert texts[1].startswith("Op 1 of ") and "in memory after it" in texts[1]
    # the figures come first, so that a narrow output area wraps the words, never the numbers
    for text in texts[1:-1]:
        assert text.index("in memory after it") < text.index("<b>") and "done at " in text.split("<b>")[0]
    kinds = {"Fck": "stays as a checkpoint", "Fn": "is dropped", "Fall": "stays for its backward",
             "Loss": "the first gradient", "B": "is handed back"}
    for k, op in enumerate(ops[:-1], 1):
        assert kinds[op.kind] in texts[k], (k, op, texts[k])
    # after the last op (where the explorer opens and a replay ends): the whole step, and how to go through it
    assert texts[-1].startswith(f"The whole step: <b>{len(ops)} ops</b>") and "plays it from the first op" in texts[-1]
    again = [k for k, e in enumerate(ex.trace.events[:-1], 1) if e.recompute]
    assert again and all("runs again" in texts[k] for k in again)


def test_keyboard_steps_are_one_percent_of_the_range(ex, solution):
    lo, hi = ex._budget_slider.min, ex._budget_slider.max
    assert ex._budget_slider.step == max(1, (hi - lo) // 100)
    assert "hcv-budget" in ex._budget_slider._dom_classes  # the page's PageUp/PageDown handler finds it by this


def test_a_glossary_explains_x_xbar_and_delta(ex):
    text = " ".join(getattr(w, "value", "") for w in ex.widget.children if hasattr(w, "value"))
    for term in ("x<sub>i</sub>", "x̄<sub>i+1</sub>", "δ<sub>i</sub>", "forwards run again"):
        assert term in text


# ---------------------------------------------------------------------------------------------- the pipeline view
def with_fixed(chain):
    """``chain`` as if profiled with an optimizer: parameters, gradients and AdamW-like state per stage."""
    import dataclasses

    from hchain_viz.core.fixed import FixedMemory

    g = [50_000 * (1 + i % 3) for i in range(chain.length)]
    return dataclasses.replace(chain, fixed=FixedMemory(params=sum(g), stage_grads=g, optimizer_state=2 * sum(g),
                                                        step_tmp=sum(g) // 2))


def test_pipeline_view_shows_bars_and_timeline_driven_by_its_slider(chain):
    from hchain_viz.viz import pipeline as V
    from hchain_viz.viz.explorer import _tree

    ex = Explorer(with_fixed(chain), pipeline=(2, 4))
    view = ex.pipeline
    assert isinstance(view, V.PipelineView) and (view.pipe.devices, view.microbatches) == (2, 4)
    shown = _tree(ex.widget)
    assert view.slider in shown and view.bars in shown and view.timeline in shown
    assert [t.name for t in view.bars.data] == list(V.PART_LABELS.values())
    assert view.timeline.data[2].name == "recomputation inside the backward"

    def drawn(plan):  # the bars' totals per device and the recomputation per backward, as the figures hold them
        assert np.allclose(sum(np.asarray(t.y) for t in view.bars.data) * view._unit[1], plan.peaks)
        assert list(view.timeline.data[2].x) == [e.recompute for evs in plan.simulate().events for e in evs
                                                  if e.kind == "B"]
        assert hcv.format_time(plan.step_time) in view.text.value

    last = len(view.limits) - 1
    view.slider.value = 0  # the least memory that fits: the stages recompute
    low = view.plan(0)
    drawn(low)
    assert low.peak <= view.limits[0] and sum(view.timeline.data[2].x) > 0
    view.slider.value = last  # where nothing gets faster
    high = view.plan(last)
    drawn(high)
    assert high.step_time < low.step_time and high.peaks != low.peaks
    ex.close()
    plain = Explorer(chain)
    assert plain.pipeline is None and not any(isinstance(w, type(view.slider)) for w in _tree(plain.widget))
    plain.close()


def test_pipeline_view_needs_the_fixed_part(chain, solution):
    with pytest.raises(HChainError, match="optimizer="):
        Explorer(chain, solution=solution, pipeline=(2, 4))
    with pytest.raises(HChainError, match=r"\(devices, microbatches\)"):
        Explorer(with_fixed(chain), pipeline=(2, 0))


@pytest.fixture(scope="module")
def long_chain():
    return hcv.Chain.random(300, seed=5)  # coarse tables: the slider's answer at the least budget is 34% slow


@pytest.mark.slow
def test_a_long_chain_answer_is_refined_and_says_so(long_chain):
    """Above about 250 stages the tables are coarse (solution.coarse); refine() shows Solution.refined's answer for
    the budget on screen, and the stats say which answer it is."""
    ex = Explorer(long_chain)
    assert ex.solution.coarse and ex.budget >= ex.min_budget
    ex.budget = ex.min_budget
    first = ex.trace.makespan
    assert "refined" not in ex._stats.value
    ex.refine()
    assert ex.trace.makespan < 0.8 * first and ex.trace.peak_memory <= ex.min_budget
    assert ex.schedule.meta["source"] == "dp-refined" and "refined for this budget" in ex._stats.value
    ex.budget = ex.min_budget + 1  # another budget: the tables' answer again, not said to be refined
    assert "refined" not in ex._stats.value


@pytest.mark.slow
def test_the_slider_refines_in_the_background_in_a_notebook(long_chain):
    """In a notebook (an event loop runs) a slider stop on a coarse solution refines on a thread; the answer
    replaces the tables' when it comes, and the stats say it was refining meanwhile."""
    ex = Explorer(long_chain)

    async def drag() -> list[str]:
        ex._budget_slider.value = ex.min_budget + 1  # the page's slider (no device: the slider is the budget)
        said = [ex._stats.value]
        for _ in range(600):
            if ex._refining is None:
                break
            await asyncio.sleep(0.1)
        return said

    said = asyncio.run(drag())
    assert "refining for this budget" in said[0]
    assert "refined for this budget" in ex._stats.value and ex.schedule.meta["source"] == "dp-refined"
