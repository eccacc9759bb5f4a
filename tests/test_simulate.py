"""core/simulate.py: the memory model of docs/design.md §3, checked against hand-computed numbers, and every error case.

The hand chain uses powers of two so every memory figure below can be read back as a sum of named items:
x = [1, 2, 4] (x_0, x_1, x_2 = the output), xbar = [8, 16], fwd_tmp = [32, 64], bwd_tmp = [128, 256];
times fwd = [1, 2], bwd = [3, 4].
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hchain_viz.core.chain import Chain
from hchain_viz.core.schedule import Schedule
from hchain_viz.core.simulate import Item, peak_and_makespan, simulate
from hchain_viz.errors import InvalidSchedule

CH = Chain(fwd_time=[1.0, 2.0], bwd_time=[3.0, 4.0], x=[1, 2, 4], xbar=[8, 16], fwd_tmp=[32, 64], bwd_tmp=[128, 256])


def rows(trace):
    return [(str(e.op), e.start, e.end, e.mem_before, e.mem_peak, e.mem_after, e.recompute) for e in trace.events]


def resident(event):
    return {(it.kind, it.stage): it.size for it in event.resident}


def test_store_all_by_hand():
    t = simulate(CH, Schedule.parse("Fall0 Fall1 Loss B1 B0"))
    assert rows(t) == [
        # op     start end  before peak        after
        ("Fall0", 0.0, 1.0, 1, 1 + 8 + 32, 9, False),  # creates xbar_1 (8) over x_0 (1), transient 32
        ("Fall1", 1.0, 3.0, 9, 9 + 16 + 64, 25, False),  # xbar_2 = 16 bytes, of which 4 are the held output x_2
        ("Loss", 3.0, 3.0, 25, 29, 29, False),  # δ_2 = 4 bytes, no time
        ("B1", 3.0, 7.0, 29, 29 + 2 + 256, 15, False),  # δ_1 (2) + bwd_tmp; frees δ_2 (4) and xbar_2 minus output (12)
        ("B0", 7.0, 10.0, 15, 15 + 1 + 128, 6, False),  # δ_0 (1); frees δ_1 (2) and xbar_1 (8); x_0 stays
    ]
    assert t.makespan == 10.0 == CH.store_all_time
    assert t.peak_memory == 287 and t.peak_index == 3
    assert t.overhead == 0.0 and t.n_recomputed == 0
    # After Fall1 the output lives inside x̄_2: an "out" item plus the rest of x̄_2.
    assert resident(t.events[1]) == {("x", 0): 1, ("xbar", 0): 8, ("out", 2): 4, ("xbar", 1): 12}
    # At the end: the caller's input x_0, the held output x_2 and the input gradient δ_0.
    assert resident(t.events[-1]) == {("x", 0): 1, ("out", 2): 4, ("delta", 0): 1}
    assert all(isinstance(it, Item) for it in t.events[0].resident)


def test_recompute_with_checkpoints_and_second_output_copy():
    t = simulate(CH, Schedule.parse("Fck0 Fn1 Loss Fck0 Fall1 B1 Fall0 B0"))
    assert rows(t) == [
        ("Fck0", 0.0, 1.0, 1, 1 + 2 + 32, 3, False),  # keeps x_0, creates x_1
        ("Fn1", 1.0, 3.0, 3, 3 + 4 + 64, 5, False),  # x_1 counted during the op, dropped after; output x_2 held
        ("Loss", 3.0, 3.0, 5, 9, 9, False),
        ("Fck0", 3.0, 4.0, 9, 9 + 2 + 32, 11, True),
        ("Fall1", 4.0, 6.0, 11, 11 + 16 + 64, 27, True),  # recomputed Fall(L-1): a full x̄_2 beside the held x_2
        ("B1", 6.0, 10.0, 27, 27 + 2 + 256, 7, False),  # frees δ_2, x̄_2 and the plain checkpoint x_1
        ("Fall0", 10.0, 11.0, 7, 7 + 8 + 32, 15, True),
        ("B0", 11.0, 14.0, 15, 15 + 1 + 128, 6, False),
    ]
    assert resident(t.events[4]) == {("x", 0): 1, ("out", 2): 4, ("delta", 2): 4, ("x", 1): 2, ("xbar", 1): 16}
    assert t.makespan == 14.0 and t.peak_memory == 285
    assert t.n_recomputed == 3 and t.overhead == pytest.approx(0.4)


def test_fck_into_output_and_backward_reading_checkpoint():
    # Fck1 creates the output directly; B0 reads x_1 from inside x̄_1 left by Fall0.
    t = simulate(CH, Schedule.parse("Fall0 Fck1 Loss Fall1 B1 B0"))
    assert [(e.mem_before, e.mem_peak, e.mem_after) for e in t.events] == [
        (1, 41, 9),
        (9, 9 + 4 + 64, 13),  # Fck1: output 4; x_1 (inside x̄_1) kept
        (13, 17, 17),
        (17, 17 + 16 + 64, 33),  # recomputed Fall1: second copy
        (33, 33 + 2 + 256, 33 + 2 - 4 - 16),  # x_1 is inside x̄_1, so B1 does not free it
        (15, 15 + 1 + 128, 15 + 1 - 2 - 8),
    ]


def test_zero_sizes_and_times():
    z = Chain(fwd_time=[0, 0], bwd_time=[0, 0], x=[0, 0, 0], xbar=[0, 0])
    t = simulate(z, Schedule.parse("Fck0 Fn1 Loss Fck0 Fall1 B1 Fall0 B0"))
    assert t.makespan == 0.0 and t.peak_memory == 0 and t.overhead == 0.0


def test_memory_curve_and_fits():
    t = simulate(CH, Schedule.parse("Fall0 Fall1 Loss B1 B0"))
    times, mem = t.memory_curve()
    assert len(times) == len(mem) == 1 + 3 * 5
    assert mem[0] == 1 and mem.max() == 287 and mem[-1] == 6
    assert np.all(np.diff(times) >= 0)
    assert t.fits(287) and not t.fits(286)


def test_repr():
    t = simulate(CH, Schedule.parse("Fck0 Fn1 Loss Fck0 Fall1 B1 Fall0 B0", strategy="hand"))
    assert repr(t) == "Trace(hand: 8 ops, makespan 14 s (+40.0% over store-all), peak 285 B, 3 recomputed forwards)"


def test_single_stage_chain():
    c = Chain(fwd_time=[1], bwd_time=[2], x=[3, 5], xbar=[7])
    t = simulate(c, Schedule.parse("Fall0 Loss B0"))
    assert [(e.mem_peak, e.mem_after) for e in t.events] == [(3 + 7, 10), (15, 15), (15 + 3, 3 + 5 + 3)]


@pytest.mark.parametrize(
    "text, index, words",
    [
        ("Fall0 Fall1 Loss3 B1 B0", 2, "the loss is stage 2"),
        ("Fall0 Fall1 Loss Loss B1 B0", 3, "the loss runs once"),
        ("Fall0 Loss2 B0", 1, "has not been computed"),
        ("Fall0 Fall2 Loss B1 B0", 1, "stage 2 does not exist"),
        ("Fall0 B0 Fall1 Loss B1", 1, "needs the loss"),
        ("Fall0 Fall1 Loss B0 B1", 3, "δ_1"),
        ("Fck0 Fn1 Loss B1 B0", 3, "x̄_2"),
        ("Fall0 Fall1 Loss B1 B0 Fall0", 5, "already run"),
        ("Fck0 Fn1 Fall1 Loss B1 B0", 2, "input x_1 is not resident"),
        ("Fall0 Fall0 Fall1 Loss B1 B0", 1, "already resident"),
        ("Fall0 Fck0 Fall1 Loss B1 B0", 1, "already resident"),
        ("Fck0 Fck0 Fall1 Loss B1 B0", 1, "already resident"),
        ("Fall0 Fck1 Fck1 Loss", 2, "already held by the caller"),
        ("Fck0 Fall1 Loss B1 Fck0 Fall0 B0", 4, "no longer needed"),
        ("Fn0 Fall1 Loss B1 Fall0 B0", 0, "cannot be dropped"),
        ("Fall0 Fn1 Loss", 1, "part of x̄_1"),
        ("Fall0 Fall1 Loss B1 B1 B0", 4, "δ_L"),
        ("Fall0 Fall1 Loss B1", 4, "ends before B0"),
        ("Fall0 Fall1", 2, "ends before the loss"),
        ("", 0, "ends before the loss"),
    ],
)
def test_invalid_schedules_name_the_first_bad_op(text, index, words):
    with pytest.raises(InvalidSchedule, match=words) as info:
        simulate(CH, Schedule.parse(text))
    assert info.value.index == index
    if index < len(text.split()):
        assert f"op #{index}" in str(info.value)


def test_wrong_argument_types():
    with pytest.raises(InvalidSchedule, match="needs a Chain"):
        simulate("chain", Schedule.parse("Fall0 Loss B0"))  # type: ignore[arg-type]
    with pytest.raises(InvalidSchedule, match="needs a Schedule"):
        simulate(CH, "Fall0 Fall1 Loss B1 B0")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- shared tensors
# docs/design.md §8: a residual of 2 bytes crosses cuts x_0..x_2 of a 3-stage chain (x = [3, 4, 5, 1]).
SH = Chain(fwd_time=[1.0, 1.0, 1.0], bwd_time=[1.0, 1.0, 1.0], x=[3, 4, 5, 1], xbar=[6, 7, 1], shared=[(0, 2, 2)])


def test_shared_tensor_is_counted_once():
    t = simulate(SH, Schedule.parse("Fck0 Fck1 Fall2 Loss B2 Fall1 B1 Fall0 B0"))
    plain = simulate(Chain(**{k: getattr(SH, k) for k in ("fwd_time", "bwd_time", "x", "xbar")}), t.schedule)
    # x_0 = 1 own byte + the residual (2); x_1 and x_2 hold the same residual: 2 and 3 more bytes, not 4 and 5.
    assert [e.mem_after for e in t.events][:2] == [3 + 2, 3 + 2 + 3]
    assert [e.mem_after for e in plain.events][:2] == [3 + 4, 3 + 4 + 5]
    assert resident(t.events[1]) == {("x", 0): 1, ("shared", 0): 2, ("x", 1): 2, ("x", 2): 3}
    # Fall1 recomputes x_2 inside x̄_2 from x_1: the same residual, so x̄_2 adds 7 - 2 bytes.
    k = 5
    assert str(t.events[k].op) == "Fall1" and t.events[k].mem_after - t.events[k].mem_before == 7 - 2
    assert all(e.mem_peak <= p.mem_peak for e, p in zip(t.events, plain.events))
    # the residual lives as long as any value holds it: x_0 holds it to the end of the step
    assert [lt for lt in t.lifetimes if lt.kind == "shared"] == [("shared", 0, 2, -1, None)]


def test_recomputing_the_producer_makes_a_second_copy():
    """A residual made by stage 0 (crossing x_1..x_3, the output): recomputing stage 0 while the held output still
    holds the first copy makes a second one."""
    ch = Chain(fwd_time=[1.0] * 3, bwd_time=[1.0] * 3, x=[1, 4, 4, 4], xbar=[4, 4, 4], shared=[(1, 3, 3)])
    t = simulate(ch, Schedule.parse("Fck0 Fn1 Fn2 Loss Fck0 Fall1 Fall2 B2 B1 Fall0 B0"))
    assert [e.mem_after for e in t.events][:3] == [1 + 4, 1 + 1 + 3, 1 + 1 + 3]  # one residual, passed along
    copies = [lt for lt in t.lifetimes if lt.kind == "shared"]
    # the output keeps the first copy to the end; Fall0 makes a third (inside x̄_1), freed by B0
    assert [(lt.created, lt.freed) for lt in copies] == [(0, None), (4, 8), (9, 10)]
    assert t.events[4].mem_after - t.events[4].mem_before == 4  # the recomputed x_1 is a full new copy
    assert t.events[5].mem_after - t.events[5].mem_before == 4 - 3  # x̄_2 holds that new copy


def test_zero_byte_shared_tensors_change_nothing():
    for seed in range(20):
        ch = Chain.random(6, seed=seed)
        d = ch.to_dict()
        d["shared"] = [(0, 6, 0), (2, 4, 0)]
        zero = Chain.from_dict(d)
        ops = "Fck0 Fn1 Fck2 Fall3 Fall4 Fall5 Loss B5 B4 B3 Fall2 B2 Fck0 Fall1 B1 Fall0 B0"
        a, b = simulate(ch, Schedule.parse(ops)), simulate(zero, Schedule.parse(ops))
        assert [(e.mem_before, e.mem_peak, e.mem_after) for e in a.events] == \
            [(e.mem_before, e.mem_peak, e.mem_after) for e in b.events]


# ---------------------------------------------------------------------------------------------------- transfers (§9)
def test_offload_by_hand():
    """Off0 after Fall1 (which reads x_1 inside x̄_1) starts when Fall1 ends; Pre0 starts at that copy's end. B1
    needs x_1, which lives inside x̄_1, so it waits for Pre0. At 4 B/s x̄_1 (8 bytes) takes 2 s each way."""
    t = simulate(CH.with_bandwidth(4), Schedule.parse("Fall0 Fall1 Off0 Loss Pre0 B1 B0"))
    assert rows(t) == [
        ("Fall0", 0.0, 1.0, 1, 41, 9, False),
        ("Fall1", 1.0, 3.0, 9, 89, 25, False),
        ("Off0", 3.0, 5.0, 29, 29, 21, False),  # frees x̄_1's 8 bytes when the copy completes
        ("Loss", 3.0, 3.0, 25, 29, 29, False),
        ("Pre0", 5.0, 7.0, 21, 29, 29, False),  # allocates them again when the copy back starts
        ("B1", 7.0, 11.0, 29, 287, 15, False),  # waited 4 s for Pre0
        ("B0", 11.0, 14.0, 15, 144, 6, False),
    ]
    assert t.makespan == 14.0 and t.idle == ((3.0, 7.0, 5, 0),) and t.idle_time == 4.0 and t.peak_memory == 287
    assert [tuple(h) for h in t.host_lifetimes] == [("xbar", 0, 8, 2, 4)]
    hc = t.host_curve()
    assert hc[1].max() == 8 and list(hc[0][hc[1] == 8]) == [5.0, 7.0]  # on the host from t=5 to t=7
    assert "2 transfers" in repr(t)
    tt, mm = t.memory_curve()
    assert mm.max() == t.peak_memory and tt[-1] == t.makespan


def test_slow_link_makes_compute_wait():
    """At 1 B/s the copies take 8 s each: B1 waits from t=3 until Pre0 completes at t=19."""
    t = simulate(CH.with_bandwidth(1), Schedule.parse("Fall0 Fall1 Off0 Loss Pre0 B1 B0"))
    assert [(e.start, e.end) for e in t.transfer_events()] == [(3.0, 11.0), (11.0, 19.0)]
    assert t.makespan == 26.0 and t.idle == ((3.0, 19.0, 5, 0),)


def test_offload_lowers_the_peak_and_hides_behind_compute():
    """x̄_1 goes to the host during the forward and comes back after B3: the peak moves from B3 (43) to B2 (34),
    and a fast enough link costs no time."""
    ch = Chain(fwd_time=[1.0] * 4, bwd_time=[1.0] * 4, x=[1] * 5, xbar=[10] * 4, bandwidth=100.0)
    plain = simulate(ch, Schedule.parse("Fall0 Fall1 Fall2 Fall3 Loss B3 B2 B1 B0"))
    off = simulate(ch, Schedule.parse("Fall0 Fall1 Off0 Fall2 Fall3 Loss B3 Pre0 B2 B1 B0"))
    assert plain.peak_memory == 1 + 40 + 1 + 1  # x_0, four x̄, δ_4, and δ_3 during B3
    assert off.peak_memory == 34  # now at B2, after x̄_1 is back: x_0, x̄_1..x̄_3 less the output, x_4, δ_3, δ_2
    assert off.makespan == plain.makespan == 8.0 and off.idle == ()
    assert [e.is_transfer for e in off.events].count(True) == 2 == off.n_transfers
    slow = simulate(ch.with_bandwidth(2.0), off.schedule)  # 5 s per copy: B1 waits for Pre0
    assert slow.makespan > 8.0 and slow.idle and slow.idle[0].stage == 0


def test_checkpoint_offload_and_prefetch():
    """Off moves a checkpoint kept by Fck when no x̄ of that stage is resident."""
    ch = Chain(fwd_time=[1.0, 1.0], bwd_time=[1.0, 1.0], x=[1, 4, 1], xbar=[5, 2], bandwidth=8.0)
    t = simulate(ch, Schedule.parse("Fck0 Fck1 Off1 Loss Pre1 Fall1 B1 Fall0 B0"))
    assert [tuple(h) for h in t.host_lifetimes] == [("x", 1, 4, 2, 4)]
    assert [(e.start, e.end) for e in t.transfer_events()] == [(2.0, 2.5), (2.5, 3.0)]
    assert t.events[5].start == 3.0 and t.idle == ((2.0, 3.0, 5, 1),)  # Fall1 waited for x_1


@pytest.mark.parametrize(("text", "index", "words"), [
    ("Fall0 Off0 Fall1 Loss B1 B0", 2, "on the host after Off0"),  # Fall1 reads x_1 inside x̄_1
    ("Fall0 Fall1 Off0 Loss B1 B0", 4, "put Pre0"),  # B1 reads x_1 inside x̄_1
    ("Fall0 Fall1 Off0 Off0 Loss", 3, "already on the host"),
    ("Fall0 Fall1 Loss Pre0 B1 B0", 3, "needs an earlier Off0"),
    ("Fck0 Fn1 Off1 Loss", 2, "nothing of stage 1 to offload"),
    ("Fall0 Fall1 Off5 Loss", 2, "does not exist"),
])
def test_invalid_transfers(text, index, words):
    with pytest.raises(InvalidSchedule) as err:
        simulate(CH.with_bandwidth(4), Schedule.parse(text))
    assert err.value.index == index and words in str(err.value)


def test_transfers_need_a_bandwidth():
    with pytest.raises(InvalidSchedule, match="with_bandwidth"):
        simulate(CH, Schedule.parse("Fall0 Fall1 Off0 Loss Pre0 B1 B0"))


def test_schedule_text_and_json_round_trip_transfers():
    s = Schedule.parse("Fall0 Fall1 Off0 Loss Pre0 B1 B0", strategy="x")
    assert str(s) == "Fall0 Fall1 Off0 Loss2 Pre0 B1 B0".replace("Loss2", "Loss") and s.n_transfers == 2
    assert Schedule.from_json(s.to_json()) == s and s.ops[2].is_transfer and not s.ops[1].is_transfer


def _schedules_of(chain):
    """Optimal schedules at a few budgets and every baseline: the remat-only schedules the project produces."""
    from hchain_viz.core import strategies
    from hchain_viz.core.solver import solve

    sol = solve(chain, slots=60)
    out = [sol.schedule(b) for b in np.linspace(sol.min_budget, sol.store_all_peak, 4).astype(int)]
    for fn in strategies.STRATEGIES.values():
        try:
            out.append(fn(chain))
        except Exception:  # a baseline with no schedule at its default budget on this chain
            pass
    return out


@pytest.mark.parametrize("seed", range(12))
def test_remat_only_schedules_simulate_exactly_as_before_transfers(seed):
    """The event-based simulator gives the frozen pre-transfer simulator's numbers bit for bit (tests/oracles.py),
    on the random chains of the solver tests (Chain.random with zeros, and small integer chains)."""
    import oracles
    from test_solver import random_int_chain

    chains = [Chain.random(3 + seed, seed=seed, zero_fraction=0.2 if seed % 2 else 0.0, scale=2**12),
              random_int_chain(seed)]
    for chain in chains:
        for bw in (None, 1e9):
            chain = chain.with_bandwidth(bw)
            for schedule in _schedules_of(chain):
                trace = simulate(chain, schedule)
                events, spans = oracles.frozen_simulate(chain, schedule)
                got = [(e.index, e.op, e.start, e.end, e.mem_before, e.mem_peak, e.mem_after, e.recompute)
                       for e in trace.events]
                assert got == events
                assert [tuple(lt) for lt in trace.lifetimes] == spans
                assert trace.makespan == (events[-1][3] if events else 0.0) and trace.idle == ()


@pytest.mark.parametrize("seed", range(6))
def test_peak_and_makespan_is_the_traces(seed):
    """The replay without a record (what scores the baselines) gives the trace's peak and makespan exactly, with
    shared tensors (a transformer), transfers, and invalid schedules raising the same error at the same op."""
    from hchain_viz.core import strategies

    chains = [Chain.random(3 + 2 * seed, seed=seed, zero_fraction=0.2 if seed % 2 else 0.0),
              Chain.transformer(1 + seed % 3, seq=64)]
    for chain in chains:
        schedules = _schedules_of(chain)
        schedules += [s for cands in strategies._candidates(chain).values() for *_, s in cands]
        for schedule in schedules:
            trace = simulate(chain, schedule)
            assert peak_and_makespan(chain, schedule) == (trace.peak_memory, trace.makespan)
    for chain, text in ((Chain.random(4, seed=seed).with_bandwidth(1e9), "Fall0 Fall1 Off0 Fall2 Fall3 Loss B3 Pre0 B2 "
                         "B1 B0"), (CH.with_bandwidth(4), "Fall0 Fall1 Off0 Loss Pre0 B1 B0")):
        trace = simulate(chain, Schedule.parse(text))
        assert trace.n_transfers and peak_and_makespan(chain, Schedule.parse(text)) == (trace.peak_memory,
                                                                                         trace.makespan)
    for text, index in (("Fall0 Fall1 Loss B0 B1", 3), ("Fall0 Fall1 Loss B1", 4)):
        with pytest.raises(InvalidSchedule) as info:
            peak_and_makespan(CH, Schedule.parse(text))
        assert info.value.index == index


def test_each_backward_call_is_charged_once():
    """chain.backward_call: one backward call per group of stages whose graphs join (a Fall that reads its input from
    inside the x̄ before it, with B of the stage before right after its own); a plain checkpoint starts a call."""
    chain = replace(Chain.homogeneous(4), backward_call=10.0)
    whole = simulate(chain, Schedule.parse("Fall0 Fall1 Fall2 Fall3 Loss B3 B2 B1 B0"))
    assert whole.joined == {1, 2, 3} and whole.makespan == 4 * 1.0 + 4 * 2.0 + 10.0 == chain.store_all_time
    split = simulate(chain, Schedule.parse("Fck0 Fn1 Fall2 Fall3 Loss B3 B2 Fall0 Fall1 B1 B0"))
    assert split.joined == {1, 3}  # x_2 is a plain checkpoint: B2 starts a second call
    assert split.makespan == 4 * 1.0 + 2 * 1.0 + 4 * 2.0 + 2 * 10.0
    # the call is charged at the B that starts it (the last stage of its group)
    assert [e.end - e.start for e in split.events if e.op.kind == "B"] == [12.0, 2.0, 12.0, 2.0]
    assert peak_and_makespan(chain, split.schedule)[1] == split.makespan
    # an offloaded stage's graph moves apart (stage 1 does not join 0), and so does a stage whose B is not followed
    # right away by the B before it (a prefetch between B2 and B1)
    link = simulate(chain.with_bandwidth(1e9), Schedule.parse("Fall0 Fall1 Off0 Fall2 Fall3 Loss B3 B2 Pre0 B1 B0"))
    assert link.joined == {3} and link.makespan >= 4 * 1.0 + 4 * 2.0 + 3 * 10.0
