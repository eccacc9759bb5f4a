"""Figures draw exactly what the Trace says: op bars, memory values, item lifetimes, the Solution's frontier."""

from __future__ import annotations

import numpy as np
import pytest

import hchain_viz as hcv
from hchain_viz.core import strategies
from hchain_viz.errors import HChainError
from hchain_viz.viz import figures as F
from hchain_viz.viz import style
from hchain_viz.viz.trace_view import TraceView

# Fck0 keeps x_0, Fn1/Fn2 drop their inputs, B3 frees the checkpoint x_3, Fall0..2 are recomputations.
HANDMADE = "Fck0 Fn1 Fn2 Fall3 Fall4 Fall5 Loss B5 B4 B3 Fall0 Fall1 Fall2 B2 B1 B0"


@pytest.fixture(scope="module")
def chain():
    return hcv.Chain.random(6, seed=1)


@pytest.fixture(scope="module")
def traces(chain):
    sol = hcv.solve(chain)
    mid = (sol.min_budget + sol.store_all_peak) // 2
    return {
        "handmade": hcv.simulate(chain, hcv.Schedule.parse(HANDMADE, strategy="handmade")),
        "store_all": hcv.simulate(chain, strategies.store_all(chain)),
        "recompute_all": hcv.simulate(chain, strategies.recompute_all(chain)),
        "optimal_low": hcv.simulate(chain, sol.schedule(sol.min_budget)),
        "optimal_mid": hcv.simulate(chain, sol.schedule(mid)),
    }


@pytest.fixture(scope="module")
def solution(chain):
    return hcv.solve(chain)


def by_name(fig, name):
    (t,) = [t for t in fig.data if t.name == name]
    return t


# ---------------------------------------------------------------------------------------------- timeline
@pytest.mark.parametrize("key", ["handmade", "store_all", "recompute_all", "optimal_low", "optimal_mid"])
def test_timeline_has_one_mark_per_op_at_the_simulated_times(traces, key):
    trace = traces[key]
    fig = F.timeline(trace)
    assert sum(len(t.y) for t in fig.data) == len(trace.events)
    drawn = []
    for t in fig.data:
        start = np.asarray(t.base if t.type == "bar" else t.x, float)
        end = start + (np.asarray(t.x, float) if t.type == "bar" else 0.0)
        drawn += list(zip(start.tolist(), end.tolist(), np.asarray(t.y).tolist(), [t.name] * len(start)))
    expected = []
    for e in trace.events:
        cat = ("loss" if e.op.kind == "Loss" else "backward" if e.op.kind == "B"
               else "recompute" if e.recompute else "forward")
        expected.append((e.start, e.end, e.op.stage, style.OP_LABELS[cat]))
    assert sorted(drawn) == sorted(expected)


def test_timeline_colours_recomputation_apart(traces):
    fig = F.timeline(traces["handmade"])
    recomputed = by_name(fig, style.OP_LABELS["recompute"])
    assert recomputed.marker.color == style.OP_COLORS["recompute"]
    assert len({style.OP_COLORS[c] for c in style.OP_COLORS}) == len(style.OP_COLORS)  # all distinct
    assert sorted(np.asarray(recomputed.y).tolist()) == [0, 1, 2]  # Fall0, Fall1, Fall2 run a second time
    assert len(by_name(F.timeline(traces["store_all"]), style.OP_LABELS["recompute"]).y) == 0


def test_timeline_hover_carries_op_name_times_and_memory(traces, chain):
    trace = traces["handmade"]
    fig = F.timeline(trace)
    unit, scale = style.byte_unit(trace.peak_memory)
    bwd = by_name(fig, "backward")
    events = [e for e in trace.events if e.op.kind == "B"]
    assert [str(t).split(" · ")[0] for t in bwd.text] == [str(e.op) for e in events]
    assert chain.names[events[0].op.stage] in bwd.text[0]
    cd = np.asarray(bwd.customdata)
    assert np.allclose(cd[:, 0], [e.start for e in events]) and np.allclose(cd[:, 1], [e.end for e in events])
    assert np.allclose(cd[:, 3] * scale, [e.mem_peak for e in events])
    assert np.allclose(cd[:, 4] * scale, [e.mem_after for e in events])
    assert unit in bwd.hovertemplate


def test_timeline_step_cursor_and_faded_future(traces):
    trace = traces["handmade"]
    k = 9
    fig = F.timeline(trace, step=k)
    (cursor,) = fig.layout.shapes
    assert cursor.x0 == cursor.x1 == trace.events[k - 1].end
    fwd = by_name(fig, "forward")
    op_index = [e.index for e in trace.events if e.op.kind != "B" and e.op.kind != "Loss" and not e.recompute]
    faint = np.asarray(fwd.marker.opacity) < 1
    assert faint.tolist() == [i >= k for i in op_index]
    with pytest.raises(HChainError, match="out of range"):
        F.timeline(trace, step=len(trace.events) + 1)


def test_figures_refuse_what_is_not_a_trace():
    with pytest.raises(HChainError, match="Trace"):
        F.timeline("Fall0 Loss B0")


# ---------------------------------------------------------------------------------------------- memory curve
@pytest.mark.parametrize("key", ["handmade", "store_all", "optimal_low", "optimal_mid"])
def test_memory_total_is_the_trace_memory_curve(traces, key):
    trace = traces[key]
    fig = F.memory_curve(trace)
    total = by_name(fig, "total (with transients)")
    t, m = trace.memory_curve()
    assert np.array_equal(np.asarray(total.x), t) and np.array_equal(np.asarray(total.y), m)
    assert total.line.shape == "hv"  # the op's peak holds from its start to its end


@pytest.mark.parametrize("key", ["handmade", "store_all", "recompute_all", "optimal_low"])
def test_memory_layers_stack_to_the_resident_memory_after_each_op(traces, key):
    trace = traces[key]
    fig = F.memory_curve(trace)
    layers = [by_name(fig, style.KIND_LABELS[k]) for k in ("x", "saved", "delta")]
    top = np.asarray(layers[-1].y)  # cumulative: the last layer is the total resident memory
    assert top[0] == trace.initial_memory
    assert top[1:].tolist() == [e.mem_after for e in trace.events]
    assert np.asarray(layers[0].x)[1:].tolist() == [e.end for e in trace.events]
    # each layer's own bytes (hover) are the resident items of that kind
    unit, scale = style.byte_unit(trace.peak_memory)
    e = trace.events[len(trace.events) // 2]
    own_delta = np.asarray(layers[2].customdata)[e.index + 1] * scale
    assert own_delta == pytest.approx(sum(i.size for i in e.resident if i.kind == "delta"))
    own_saved = np.asarray(layers[1].customdata)[e.index + 1] * scale
    assert own_saved == pytest.approx(sum(i.size for i in e.resident if i.kind in ("xbar", "out")))


def test_memory_budget_line_peak_marker_and_byte_axis(traces):
    trace = traces["handmade"]
    budget = 10 * 2**20
    fig = F.memory_curve(trace, budget=budget)
    line = by_name(fig, "budget 10 MiB")
    assert list(line.y) == [budget, budget] and line.x[0] == 0 and line.x[1] == trace.makespan
    peak = by_name(fig, "peak")
    p = trace.events[trace.peak_index]
    assert list(peak.y) == [trace.peak_memory] and list(peak.x) == [p.start]
    assert all(lbl.endswith(("MiB", "KiB", " B")) for lbl in fig.layout.yaxis.ticktext)
    assert fig.layout.yaxis.range[1] >= budget
    no_budget = F.memory_curve(trace)
    assert len(by_name(no_budget, "budget").y) == 0


def test_memory_step_reveals_the_curve_up_to_the_cursor(traces):
    trace = traces["handmade"]
    for k in (0, 4, len(trace.events)):
        fig = F.memory_curve(trace, step=k)
        total = by_name(fig, "total (with transients)")
        assert len(total.y) == 1 + 3 * k
        assert len(by_name(fig, style.KIND_LABELS["x"]).y) == k + 1
        assert fig.layout.shapes[0].x0 == (trace.events[k - 1].end if k else 0.0)
    before_peak = F.memory_curve(trace, step=trace.peak_index)
    assert len(by_name(before_peak, "peak").y) == 0  # not revealed yet
    assert before_peak.layout.annotations[0].visible is False  # nor its label


def test_peak_label_sits_above_the_budget_line_and_points_at_the_peak(traces):
    trace = traces["optimal_mid"]
    for budget in (trace.peak_memory, trace.peak_memory * 3 // 2):  # a budget met exactly, and a looser one
        fig = F.memory_curve(trace, budget=budget)
        (label,) = fig.layout.annotations
        p = trace.events[trace.peak_index]
        assert (label.x, label.y) == (p.start, trace.peak_memory) and label.visible
        assert label.text == f"peak {hcv.format_bytes(trace.peak_memory)}"
        assert label.yanchor == "bottom" and budget < label.ay < fig.layout.yaxis.range[1]  # text above the line


def test_memory_axis_spans_the_longer_of_the_two_compared_schedules(chain, solution):
    view = TraceView.of(hcv.simulate(chain, solution.schedule(solution.store_all_peak)))
    slow = TraceView.of(hcv.simulate(chain, strategies.recompute_all(chain)))
    lay = F.memory_layout(view, solution.store_all_peak, overlay=slow)
    assert lay["xaxis"]["range"][1] == slow.makespan > view.makespan


# ---------------------------------------------------------------------------------------------- storage tape
@pytest.mark.parametrize("key", ["handmade", "store_all", "recompute_all", "optimal_low", "optimal_mid"])
def test_tape_lifetimes_match_the_resident_items_after_every_op(traces, key):
    trace = traces[key]
    v = TraceView.of(trace)
    for s, e in enumerate(trace.events, start=1):
        alive = (v.item_i0 < s) & (v.item_i1 >= s)
        got = sorted(zip(v.item_kind[alive].tolist(), v.item_stage[alive].tolist(), v.item_size[alive].tolist()))
        assert got == sorted(e.resident), f"after op #{s - 1} {e.op}"


def test_tape_bars_are_the_item_lifetimes(traces):
    trace = traces["handmade"]
    v = TraceView.of(trace)
    fig = F.storage_tape(trace)
    assert sum(len(t.y) for t in fig.data) == len(v.item_kind)
    ckpt = by_name(fig, style.TAPE_LABELS["x"])
    rows = sorted(np.asarray(ckpt.y).tolist())
    assert rows == [0, 1, 2, 3]  # x_0 (caller), x_1 (Fck0), x_2 (Fn1), x_3 (Fn2)
    x3 = np.asarray(ckpt.y).tolist().index(3)
    b3 = next(e for e in trace.events if str(e.op) == "B3")
    fn2 = next(e for e in trace.events if str(e.op) == "Fn2")
    assert ckpt.base[x3] == fn2.start and ckpt.base[x3] + ckpt.x[x3] == pytest.approx(b3.end)
    out = by_name(fig, style.TAPE_LABELS["out"])
    assert list(out.y) == [trace.chain.length]  # the held output sits on the loss row


def test_tape_draws_transit_bytes_from_their_making_to_their_fall():
    """chain.transit: x_1's part that no backward needs is a bar on row 1 that ends where Fall1 ends; on a chain
    without transit bytes the legend does not name the kind."""
    d = hcv.Chain.random(4, seed=1).to_dict()
    plain = hcv.Chain.from_dict(d)
    d["transit"] = [0, plain.x[1] // 2, 0, 0, 0]
    chain = hcv.Chain.from_dict(d)
    trace = hcv.simulate(chain, strategies.store_all(chain))
    bar = by_name(F.storage_tape(trace), style.TAPE_LABELS["transit"])
    fall1 = next(e for e in trace.events if str(e.op) == "Fall1")
    assert list(bar.y) == [1] and bar.base[0] + bar.x[0] == pytest.approx(fall1.end) and bar.showlegend
    assert not by_name(F.storage_tape(hcv.simulate(plain, strategies.store_all(plain))),
                       style.TAPE_LABELS["transit"]).showlegend


def test_tape_draws_consumed_bytes_from_their_making_to_their_backward():
    """chain.consumed: x_2's part that only B(2) needs is a bar on row 2 that ends where B2 ends (x_2 sits inside
    x̄_2 under store-all, which stays to B1); named in the legend only on chains that have the kind."""
    d = hcv.Chain.random(4, seed=1).to_dict()
    plain = hcv.Chain.from_dict(d)
    d["consumed"] = [0, 0, plain.x[2] // 2, 0, 0]
    chain = hcv.Chain.from_dict(d)
    trace = hcv.simulate(chain, strategies.store_all(chain))
    bar = by_name(F.storage_tape(trace), style.TAPE_LABELS["consumed"])
    fall1, b2 = (next(e for e in trace.events if str(e.op) == op) for op in ("Fall1", "B2"))
    assert list(bar.y) == [2] and bar.base[0] == pytest.approx(fall1.start) and bar.showlegend
    assert bar.base[0] + bar.x[0] == pytest.approx(b2.end)
    assert not by_name(F.storage_tape(hcv.simulate(plain, strategies.store_all(plain))),
                       style.TAPE_LABELS["consumed"]).showlegend


def test_tape_step_shows_the_state_at_that_moment(traces):
    trace = traces["handmade"]
    k = 7  # after Loss
    fig = F.storage_tape(trace, step=k)
    t = trace.events[k - 1].end
    ends = np.concatenate([np.asarray(tr.base) + np.asarray(tr.x) for tr in fig.data if len(tr.y)])
    assert ends.max() == pytest.approx(t)
    grads = by_name(fig, style.TAPE_LABELS["delta"])
    assert list(grads.y) == [trace.chain.length]  # only δ_L exists after the loss


# ---------------------------------------------------------------------------------------------- frontier
def test_frontier_optimal_curve_is_the_solution(solution):
    fig = F.frontier(solution, strategies=False)
    opt = by_name(fig, "optimal")
    xs, ys = np.asarray(opt.x), np.asarray(opt.y)
    for b, t in solution.frontier():
        assert t in ys[xs == b]
    for b, t in zip(xs[::7], ys[::7]):
        assert t == pytest.approx(solution.makespan(int(b)))
    assert xs.min() == solution.min_budget
    (shade,) = [s for s in fig.layout.shapes if s.type == "rect"]
    assert shade.x1 == solution.min_budget and shade.x0 < solution.min_budget
    T = solution.chain.store_all_time
    lo, hi = fig.layout.yaxis.range
    assert fig.layout.yaxis2.range[0] == pytest.approx(100 * (lo / T - 1))
    assert fig.layout.yaxis2.range[1] == pytest.approx(100 * (hi / T - 1))
    # round overhead ticks, none below 0%, inside the axis (plotly's own follow the left axis: 50.9%, -5.6%)
    ticks = list(fig.layout.yaxis2.tickvals)
    lo2, hi2 = fig.layout.yaxis2.range
    assert ticks and all(t >= 0 and lo2 <= t <= hi2 for t in ticks)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    assert all(t / step == pytest.approx(round(t / step)) for t in ticks)
    assert list(fig.layout.yaxis2.ticktext) == [f"{t:g}%" for t in ticks]


def test_frontier_draws_every_baseline_and_marks_the_budget(solution):
    points = strategies.frontier_points(solution.chain)
    b = (solution.min_budget + solution.store_all_peak) // 2
    fig = F.frontier(solution, budget=b)
    for name, pts in points.items():
        tr = by_name(fig, name)
        drawn = list(zip(np.asarray(tr.x, float).tolist(), np.asarray(tr.y, float).tolist()))
        # each family's best points: every one of its schedules is drawn or beaten (no more memory, no more time)
        # by a drawn one, and no drawn point beats another, so none sits in another's column
        assert set(drawn) <= {(float(p), float(t)) for p, t in pts}
        for p, t in pts:
            assert any(dp <= p and dt <= t for dp, dt in drawn), (name, p, t)
        assert all(b1 < b2 and t1 > t2 for (b1, t1), (b2, t2) in zip(drawn, drawn[1:])), (name, drawn)
    line = by_name(fig, "budget")
    assert list(line.x) == [b, b]
    point = by_name(fig, "current")
    assert list(point.x) == [b] and point.y[0] == pytest.approx(solution.makespan(b))


def test_frontier_strategy_selection(solution):
    fig = F.frontier(solution, strategies=["revolve", "sqrt_n"])
    names = {t.name for t in fig.data}
    assert {"revolve", "sqrt_n", "optimal"} <= names and "periodic" not in names
    custom = F.frontier(solution, strategies={"mine": [(solution.store_all_peak, 1.0)]})
    assert list(by_name(custom, "mine").x) == [solution.store_all_peak]
    with pytest.raises(HChainError, match="unknown strategies"):
        F.frontier(solution, strategies=["nope"])
    with pytest.raises(HChainError, match="Solution"):
        F.frontier(solution.chain)


# ---------------------------------------------------------------------------------------------- style
def test_byte_ticks_are_round_binary_values():
    vals, text = style.byte_ticks(0, 300 * 2**20)
    assert text[0] == "0 B" and all(t.endswith("MiB") for t in text[1:])
    steps = np.diff(vals)
    assert np.allclose(steps, steps[0]) and steps[0] % 2**20 == 0
    assert style.byte_unit(3 * 2**30) == ("GiB", 2**30) and style.byte_unit(12) == ("B", 1)
    vals, text = style.byte_ticks(0, 5)  # tiny teaching chains: whole bytes
    assert all(float(v).is_integer() for v in vals)


# ---------------------------------------------------------------------------------------------- layers (groups)
def test_sub_layer_chain_is_drawn_by_layer():
    """A sub-layer transformer (chain.groups): the timeline and tape label layers, shade every other one, keep a
    minor tick per stage, and stay at ~24 labels on a long chain; the cursor stays the first shape."""
    chain = hcv.Chain.transformer(24, seq=32, hidden=32, heads=2)  # 146 stages
    budget = hcv.simulate(chain, strategies.per_layer(chain)).peak_memory
    trace = hcv.simulate(chain, hcv.solve(chain, slots=100).schedule(budget))
    for fig in (F.timeline(trace, step=5), F.storage_tape(trace)):
        ax = fig.layout.yaxis
        assert ax.title.text == "layer" and len(ax.tickvals) <= 25
        # every other layer labelled (26 marks), and the ungrouped embedding and loss rows
        assert "h.1" in ax.ticktext and "embed" in ax.ticktext and ax.ticktext[-1] in ("loss", "output / loss")
        assert list(ax.minor.tickvals) == list(range(chain.length + 1))
        cursor, *bands = fig.layout.shapes
        assert cursor.type == "line" and len(bands) == 12  # every other one of 24 layers
        assert (bands[0].y0, bands[0].y1) == (1 - 0.5, 6 + 0.5)  # h.0 is stages 1..6
    plain = F.timeline(hcv.simulate(hcv.Chain.random(6, seed=0), strategies.store_all(hcv.Chain.random(6, seed=0))))
    assert plain.layout.yaxis.title.text == "stage" and len(plain.layout.shapes) == 1


# ---------------------------------------------------------------------------------------------- transfers (§9)
@pytest.fixture(scope="module")
def offload_trace():
    """x̄_1 offloaded during the forward and prefetched late enough that B1 waits for it."""
    ch = hcv.Chain(fwd_time=[1.0] * 4, bwd_time=[1.0] * 4, x=[1] * 5, xbar=[10] * 4, bandwidth=4.0)
    return hcv.simulate(ch, hcv.Schedule.parse("Fall0 Fall1 Off0 Fall2 Fall3 Loss B3 Pre0 B2 B1 B0"))


def test_timeline_transfer_lanes_and_idle(offload_trace):
    t = offload_trace
    fig = F.timeline(t)
    L = t.chain.length
    off, pre, idle = by_name(fig, "offload → host"), by_name(fig, "prefetch → device"), fig.data[-1]
    (e_off,) = [e for e in t.events if e.op.kind == "Off"]
    (e_pre,) = [e for e in t.events if e.op.kind == "Pre"]
    assert list(off.y) == [L + 1] and list(off.base) == [e_off.start] and list(off.x) == [e_off.end - e_off.start]
    assert list(pre.y) == [L + 2] and list(pre.base) == [e_pre.start]
    (w,) = t.idle
    assert list(idle.base) == [w.start] and list(idle.x) == [w.end - w.start] and idle.showlegend
    assert list(idle.y) == [t.events[w.index].op.stage]
    assert "link → host" in fig.layout.yaxis.ticktext and "idle" in fig.layout.title.text
    # a remat-only trace keeps the lanes empty and the axis without them (same number of traces for the explorer)
    plain = F.timeline(hcv.simulate(t.chain, hcv.strategies.store_all(t.chain)))
    assert len(plain.data) == len(fig.data) and len(plain.data[-1].x) == 0
    assert "link → host" not in plain.layout.yaxis.ticktext


def test_memory_curve_host_band_and_device_layers(offload_trace):
    t = offload_trace
    fig = F.memory_curve(t, budget=40)
    total = by_name(fig, "total (with transients)")
    tt, mm = t.memory_curve()
    assert list(total.y) == mm.tolist() and max(total.y) == t.peak_memory
    host = by_name(fig, "on host (not on the device)")
    th, mh = t.host_curve()
    assert list(host.y) == mh.tolist() and max(host.y) == 10
    # the stacked layers end at the device's resident bytes (no transients): x̄_1 absent while on the host
    top = np.asarray(fig.data[2].y)  # cumulative: x + saved + delta
    t_layer = np.asarray(fig.data[2].x)
    hosted = (t_layer >= th[np.argmax(mh)]) & (t_layer < th[len(mh) - 1 - np.argmax(mh[::-1])])
    assert hosted.any() and top.max() <= t.peak_memory
    step = F.memory_curve(t, step=5)
    assert max(np.asarray(step.data[3].x)) <= max(e.end for e in t.events[:5])


def test_tape_marks_values_on_the_host(offload_trace):
    t = offload_trace
    fig = F.storage_tape(t)
    host = by_name(fig, "on host")
    (h,) = t.host_lifetimes
    assert list(host.y) == [0] and list(host.base) == [t.events[h.created].end]
    assert list(host.x) == [t.events[h.freed].end - t.events[h.created].end]
    assert len(by_name(F.storage_tape(t, step=h.created), "on host").y) == 0


def test_frontier_of_an_offload_solution_shows_both_curves():
    c = hcv.Chain.random(10, seed=3)
    c = hcv.Chain(fwd_time=[v / 20 for v in c.fwd_time], bwd_time=[v / 20 for v in c.bwd_time], x=c.x, xbar=c.xbar,
                  fwd_tmp=c.fwd_tmp, bwd_tmp=c.bwd_tmp, bandwidth="nvlink-c2c")
    sol = hcv.solve_offload(c, grid=8)
    fig = F.frontier(sol, strategies=False)
    main, remat = fig.data[0], by_name(fig, F.REMAT_ONLY)
    assert main.name == "optimal + offload"
    assert list(remat.x) == [b for b, _ in sol.remat.frontier()]
    # the remat+offload curve is never above the remat-only one
    for b, t in zip(main.x, main.y):
        assert t <= sol.remat.makespan(int(b)) * (1 + 1e-12)


def test_teaching_chains_are_drawn_in_units_not_seconds_and_bytes():
    from hchain_viz import course

    chain = course.abstract(hcv.Chain.homogeneous(6, fwd_time=1.0, bwd_time=2.0, x=1, xbar=3))
    sol = hcv.solve(chain, max_budget=40, slots=40)
    trace = hcv.simulate(chain, sol.schedule(10))
    figs = [F.timeline(trace), F.memory_curve(trace, budget=10), F.storage_tape(trace),
            F.frontier(sol, budget=10)]
    for fig in figs:
        text = fig.to_json()
        assert " B" not in fig.layout.title.text and not fig.layout.title.text.endswith(" s")
        assert "KiB" not in text and '"ticksuffix":"s"' not in text.replace(" ", "")
    assert figs[0].layout.title.text.endswith("time units")  # "... 23 ops, 30 time units"
    assert "peak 10 units of 10 units budget" in figs[1].layout.title.text
    assert list(figs[1].layout.yaxis.ticktext) == [f"{v:.4g}" for v in figs[1].layout.yaxis.tickvals]
    assert figs[3].layout.yaxis.title.text == "makespan (time units)"
    # a measured chain keeps its seconds and bytes
    plain = F.timeline(hcv.simulate(hcv.Chain.homogeneous(6), strategies.store_all(hcv.Chain.homogeneous(6))))
    assert plain.layout.xaxis.ticksuffix == "s"


def test_frontier_points_that_coincide_stay_visible():
    """Issue 43: store-all's point hid under periodic's and chen_greedy's, and the legend was 9 px. Every baseline
    has its own open marker shape, and store-all's is the largest, so points that coincide show one inside the other.
    """
    chain = hcv.Chain.random(12, seed=8)
    fig = F.frontier(hcv.solve(chain))
    base = [t for t in fig.data if t.name in strategies.frontier_points(chain)]
    symbols = [t.marker.symbol for t in base]
    assert len(set(symbols)) == len(symbols) and all(s.endswith("-open") for s in symbols)
    sizes = {t.name: t.marker.size for t in base}
    assert sizes["store_all"] == max(sizes.values())
    assert fig.layout.legend.font.size >= 11


def test_beyond_the_axes_triangles_at_one_place_are_set_apart():
    """Issue 43: revolve's off-chart triangle sat exactly on recompute_all's."""
    chain = hcv.Chain.random(12, seed=8)
    solution = hcv.solve(chain)
    peak = float(solution.min_budget)
    fig = F.frontier(solution, strategies={"a": [(peak, 50.0)], "b": [(peak, 60.0)], "c": [(peak, 70.0)]})
    beyond = next(t for t in fig.data if t.name == "beyond the axes")
    (x_lo, x_hi), (_, y_hi) = fig.layout.xaxis.range, fig.layout.yaxis.range
    assert list(beyond.y) == [y_hi] * 3 and all(x_lo <= x <= x_hi for x in beyond.x)
    xs = sorted(beyond.x)
    assert min(b - a for a, b in zip(xs, xs[1:])) >= 0.02 * (x_hi - x_lo)  # three triangles, not one
    assert min(abs(x - peak) for x in beyond.x) == 0  # the first stays where its point is


def test_the_frontier_draws_what_the_solver_returns_at_the_least_budget():
    """No cliff in the solution: the optimum at the least budget is on the chart, with no "off the top" note; the
    curve starts at the least budget with the solution's time there."""
    chain = hcv.Chain.random(12, seed=8)
    solution = hcv.solve(chain)
    fig = F.frontier(solution, strategies=False)
    opt = by_name(fig, "optimal")
    assert opt.x[0] == solution.min_budget and opt.y[0] == pytest.approx(solution.makespan(solution.min_budget))
    lo, hi = fig.layout.yaxis.range
    assert all(lo <= y <= hi for y in opt.y)
    assert not any("off the top" in a.text for a in fig.layout.annotations)


def test_frontier_marks_baseline_points_beyond_its_axes_on_the_edge():
    chain = hcv.Chain.random(12, seed=8)  # a chain whose recompute-all is off the chart
    fig = F.frontier(hcv.solve(chain))
    beyond = next(t for t in fig.data if t.name == "beyond the axes")
    (x_lo, x_hi), (y_lo, y_hi) = fig.layout.xaxis.range, fig.layout.yaxis.range
    far = hcv.simulate(chain, strategies.recompute_all(chain))
    assert far.makespan > y_hi  # recompute-all's time is off the chart here ...
    k = next(k for k, s in enumerate(beyond.text) if s.startswith("recompute_all"))
    assert beyond.y[k] == y_hi and beyond.marker.symbol[k] == "triangle-up"  # ... and drawn on the top edge
    assert hcv.format_time(far.makespan) in beyond.text[k]
    assert all(x_lo <= x <= x_hi and y_lo <= y <= y_hi for x, y in zip(beyond.x, beyond.y))
    # a point inside the axes is not repeated there
    inside = sum(1 for t in fig.data[1:] if t.name not in ("beyond the axes", "budget", "current", "overhead axis")
                 for x, y in zip(t.x, t.y) if x_lo <= x <= x_hi and y_lo <= y <= y_hi)
    assert inside > 0 and len(beyond.x) < inside


class _Cliff:
    """A solution whose optimum costs 30x store-all at the least budget only (what a chain model with a steep rise
    there gives): the frontier draws whatever the solver returns."""

    def __init__(self, solution):
        self.chain, self.min_budget, self.store_all_peak = solution.chain, solution.min_budget, solution.store_all_peak
        pts = solution.frontier()
        self._pts = [(pts[0][0], 30 * solution.chain.store_all_time)] + [(b + 1, t) for b, t in pts]

    def frontier(self):
        return self._pts

    def makespan(self, budget):
        return max((t for b, t in self._pts if b <= budget), default=float("inf"), key=lambda t: -t)


def test_a_cliff_at_the_least_budget_goes_off_the_top_and_max_overhead_caps_the_axis():
    chain = hcv.Chain.random(12, seed=8)
    solution = _Cliff(hcv.solve(chain))
    T = chain.store_all_time
    least = solution.makespan(solution.min_budget)
    assert least > 10 * T
    fig = F.frontier(solution, strategies=False)
    top = fig.layout.yaxis.range[1]
    assert 1.2 * T < top < 3 * T  # the rest of the curve keeps the axis; the cliff is off the top ...
    notes = [a.text for a in fig.layout.annotations]
    assert f"↑ {hcv.format_time(least)} at the least budget, off the top" in notes  # ... and a note says its cost
    smooth = hcv.Chain.random(12, seed=8)  # no cliff: the least budget's time stays on the chart, no note
    fig = F.frontier(hcv.solve(smooth), strategies=False)
    assert fig.layout.yaxis.range[1] >= hcv.solve(smooth).makespan(hcv.solve(smooth).min_budget)
    assert not any("off the top" in a.text for a in fig.layout.annotations)
    fig = F.frontier(solution, strategies=["recompute_all"], max_overhead=0.5)
    assert fig.layout.yaxis.range[1] == pytest.approx(1.5 * T)
    assert fig.layout.yaxis2.range[1] == pytest.approx(50.0)  # the overhead axis agrees with the time axis
    beyond = next(t for t in fig.data if t.name == "beyond the axes")
    assert any(s.startswith("recompute_all") for s in beyond.text)  # above the cap: drawn on the top edge
    for bad in (0, -0.5, "50%", True):
        with pytest.raises(HChainError, match="max_overhead"):
            F.frontier(solution, strategies=False, max_overhead=bad)


def test_memory_figure_leaves_no_zero_byte_label_at_the_origin():
    chain = hcv.Chain.random(6, seed=1)
    fig = F.memory_curve(hcv.simulate(chain, strategies.store_all(chain)))
    assert 0 not in list(fig.layout.yaxis.tickvals) and "0 B" not in list(fig.layout.yaxis.ticktext)
