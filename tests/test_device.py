"""core/fixed.py, core/batch.py, core/device.py: the whole-step memory model, device sizes as budgets, batch-size
fits and the largest batch (docs/design.md §7). Torch-free."""

from __future__ import annotations

import dataclasses
import json

import pytest

import hchain_viz as hcv
from hchain_viz.core import device
from hchain_viz.core.batch import fit_batch, fit_error
from hchain_viz.core.chain import Chain
from hchain_viz.core.fixed import FixedMemory
from hchain_viz.core.strategies import periodic, store_all
from hchain_viz.errors import DoesNotFit, HChainError, InvalidChain

MiB = 2**20


def fixed(L: int, **over) -> FixedMemory:
    d = dict(params=40 * MiB, stage_grads=[4 * MiB] * L, optimizer_state=80 * MiB, buffers=MiB, step_tmp=2 * MiB,
             optimizer="AdamW")
    d.update(over)
    return FixedMemory(**d)


def with_fixed(chain: Chain, **over) -> Chain:
    return dataclasses.replace(chain, fixed=fixed(chain.length, **over))


def linear_chains(sizes=(8, 16, 32), L=6):
    """Chains whose sizes are exactly linear in the batch size and times affine (an intercept of 10 µs)."""
    base = Chain.random(L, seed=3)

    def at(b: int) -> Chain:
        return dataclasses.replace(
            base, fwd_time=[1e-5 + t * b for t in base.fwd_time], bwd_time=[2e-5 + t * b for t in base.bwd_time],
            x=[v * b for v in base.x], xbar=[v * b + 64 for v in base.xbar], fwd_tmp=[v * b for v in base.fwd_tmp],
            bwd_tmp=[v * b for v in base.bwd_tmp], fixed=fixed(L))
    return {b: at(b) for b in sizes}, at


# ------------------------------------------------------------------ FixedMemory and the Chain's JSON
def test_fixed_memory_parts_and_sharding():
    f = fixed(3, params=10, stage_grads=[3, 3, 4], optimizer_state=21, buffers=5, step_tmp=7)
    assert f.grads == 10 and f.static_per_rank == 10 + 21 + 5 and f.total_per_rank == 46
    g = f.with_world_size(4)
    # parameters, gradients, state and the step transient are divided (rounded up per tensor group); buffers are not
    assert g.static_per_rank == 3 + 6 + 5 and g.grads_per_rank == 1 + 1 + 1 and g.step_tmp_per_rank == 2
    assert "sharded over 4 ranks" in g.describe() and "AdamW state" in g.describe()
    with pytest.raises(InvalidChain, match="world_size"):
        f.with_world_size(0)
    with pytest.raises(InvalidChain, match="non-negative"):
        fixed(3, params=-1)


def test_chain_json_round_trips_fixed_and_batch_fit_and_old_json_still_loads():
    chains, _ = linear_chains()
    c = fit_batch(chains).with_world_size(2)
    back = Chain.from_json(c.to_json())
    assert back == c and back.fixed.world_size == 2 and back.batch == 8
    assert hcv.at_batch(back, 24) == hcv.at_batch(c, 24)
    d = json.loads(c.to_json())
    del d["fixed"], d["batch_fit"]
    old = Chain.from_dict(d)
    assert old.fixed is None and old.batch_fit is None and old.batch is None
    with pytest.raises(InvalidChain, match="stage_grads has 2 entries"):
        dataclasses.replace(c, fixed=fixed(2))
    with pytest.raises(InvalidChain, match="'fixed' must be an object"):
        Chain.from_dict({**json.loads(c.to_json()), "fixed": [1, 2]})
    assert "fixed" in repr(c) and "batch 8" in repr(c)
    assert "AdamW state" in c._repr_html_() and "batch 8" in c._repr_html_()


def test_without_fixed_part_device_questions_say_what_to_do():
    c = Chain.random(4)
    assert hcv.device_peak(hcv.simulate(c, store_all(c))) is None
    with pytest.raises(HChainError, match="optimizer=opt"):
        hcv.device_schedule(hcv.solve(c), "1GiB")
    with pytest.raises(HChainError, match="optimizer="):
        c.with_world_size(2)


# ------------------------------------------------------------------ device peak
def test_device_peak_by_hand_on_a_two_stage_chain():
    # x0=1, x1=2, x2=4 (output); xbar=[8, 16]; no transients.
    c = Chain(fwd_time=[1, 1], bwd_time=[1, 1], x=[1, 2, 4], xbar=[8, 16],
              fixed=FixedMemory(params=100, stage_grads=[10, 20], optimizer_state=200, buffers=3, step_tmp=1000))
    t = hcv.simulate(c, store_all(c))
    static = 100 + 200 + 3
    # store-all: Fall0 (1+8), Fall1 (+16: out inside), Loss (+4: δ2) -> 29, peak of B1 = 29 + δ1 (2) with grads 20,
    # then B0 creates δ0 (1) with grads 30; end: x0 + out + δ0 = 1 + 4 + 1 = 6; optimizer step 6 + 30 + 1000.
    assert t.peak_memory == 31
    assert hcv.device_peak(t) == static + max(20 + 31, 30 + 6 + 1000)
    small_step = dataclasses.replace(c, fixed=dataclasses.replace(c.fixed, step_tmp=0))
    assert hcv.device_peak(hcv.simulate(small_step, store_all(small_step))) == static + 20 + 31


def test_library_workspace_is_resident_unsharded_and_round_trips():
    """cuBLAS's workspace (FixedMemory.workspace, measured on CUDA): resident through the whole step like the
    parameters, on every rank whole, shown in the parts, kept by JSON."""
    base = FixedMemory(params=100, stage_grads=[10, 20], optimizer_state=200, buffers=3, step_tmp=1000)
    c = Chain(fwd_time=[1, 1], bwd_time=[1, 1], x=[1, 2, 4], xbar=[8, 16], fixed=base)
    with_ws = dataclasses.replace(c, fixed=dataclasses.replace(base, workspace=64))
    peak = lambda chain: hcv.device_peak(hcv.simulate(chain, store_all(chain)))  # noqa: E731
    assert peak(with_ws) == peak(c) + 64
    assert with_ws.fixed.with_world_size(4).static_per_rank == -(-100 // 4) + -(-200 // 4) + 3 + 64
    assert with_ws.fixed.parts()["library workspace"] == 64 and "library workspace" not in base.parts()
    assert Chain.from_json(with_ws.to_json()).fixed == with_ws.fixed


# ------------------------------------------------------------------ mixed precision (docs/design.md §11)
def test_autocast_weight_copies_live_from_a_stages_forward_to_its_backward_by_hand():
    """The two-stage chain above with autocast's copies: 50 B made by stage 0's forward, 70 B by stage 1's. A
    stage's copies count from its forward and overlap its own backward's transient; the optimizer step has none."""
    base = FixedMemory(params=100, stage_grads=[10, 20], optimizer_state=200, buffers=3, step_tmp=0,
                       precision="bf16-mixed", stage_casts=[50, 70])
    c = Chain(fwd_time=[1, 1], bwd_time=[1, 1], x=[1, 2, 4], xbar=[8, 16], fixed=base)
    static = 100 + 200 + 3
    # Loss: 29 of activations with both stages' copies (452); B1 (peak 31): stage 0's copies, then the larger of its
    # new gradients (20) and its own copies (70) -> 454; without copies the same point is static + 20 + 31.
    assert hcv.device_peak(hcv.simulate(c, store_all(c))) == static + 50 + 31 + 70
    assert base.static_per_rank == static + 120 and base.at_step_per_rank == static
    assert base.total_per_rank == static + 120 + 30 and base.step_total_per_rank == static + 30
    big_step = dataclasses.replace(c, fixed=dataclasses.replace(base, step_tmp=1000))
    assert hcv.device_peak(hcv.simulate(big_step, store_all(big_step))) == static + 30 + 6 + 1000  # no copies
    assert device.optimizer_step_peak(big_step) == static + 30 + 6 + 1000
    assert base.with_world_size(4).static_per_rank == 25 + 50 + 3 + 120  # copies are not sharded
    assert base.parts()["autocast weight copies"] == 120 and base.describe().split("(")[1].startswith("bf16-mixed: ")
    assert Chain.from_json(c.to_json()).fixed == base


def test_in_precision_rescales_the_fixed_part():
    f = FixedMemory(params=400, stage_grads=[100, 300], optimizer_state=808, buffers=3, step_tmp=400,
                    precision="bf16-mixed", stage_casts=[50, 150])
    assert f.in_precision("fp16-mixed") == dataclasses.replace(f, precision="fp16-mixed")
    master = f.in_precision("bf16-master")  # 100 trainable elements: 2-byte weights, a 4-byte master copy
    assert (master.params, master.stage_grads, master.master_weights, master.optimizer_state, master.step_tmp,
            master.cast_cache) == (200, (50, 150), 400, 808, 400, 0)
    assert master.parts()["master weights"] == 400 and master.with_world_size(2).at_step_per_rank == 100 + 200 + 404 + 3
    pure = f.in_precision("bf16")  # the optimizer's state in bf16 too
    assert (pure.params, pure.grads, pure.master_weights, pure.optimizer_state, pure.step_tmp) == (200, 200, 0, 404,
                                                                                                   200)
    assert pure.in_precision("bf16-master").optimizer_state == 808
    chain = dataclasses.replace(Chain.random(2, seed=1), fixed=f)
    assert device.in_precision(chain, "bf16") == dataclasses.replace(chain, fixed=pure)
    # what a device panel offers: every precision derivable from the record, and each one derives
    assert f.precisions() == ["bf16-mixed", "fp16-mixed", "bf16-master", "bf16", "fp16"]
    assert pure.precisions() == ["bf16", "bf16-master", "fp16"] and FixedMemory(1, [1]).precisions() == ["fp32"]
    assert all(f.in_precision(p).precision == p for p in f.precisions() + pure.precisions())


def test_precision_errors_name_the_precision_and_what_to_do():
    f = FixedMemory(params=400, stage_grads=[400], precision="bf16-mixed", stage_casts=[200])
    with pytest.raises(HChainError, match=r"unknown precision 'bf17'; choose one of fp32, bf16-mixed"):
        f.in_precision("bf17")
    with pytest.raises(HChainError, match=r"'fp32' computes in 32-bit floats .* profiled in 'bf16-mixed'"):
        f.in_precision("fp32")
    with pytest.raises(HChainError, match=r"'bf16-mixed' computes in 16-bit floats .* profile the model in bf16"):
        FixedMemory(params=400, stage_grads=[400]).in_precision("bf16-mixed")
    with pytest.raises(HChainError, match=r"'fp16-mixed' runs under torch.autocast.*profiled in 'bf16'"):
        f.in_precision("bf16").in_precision("fp16-mixed")
    with pytest.raises(InvalidChain, match="fixed.precision: unknown precision 'half'"):
        FixedMemory(params=1, stage_grads=[1], precision="half")
    with pytest.raises(InvalidChain, match="stage_casts has 2 entries for 1 stages"):
        FixedMemory(params=1, stage_grads=[1], stage_casts=[1, 2])
    with pytest.raises(HChainError, match="optimizer=opt"):
        device.in_precision(Chain.random(2), "bf16")
    old = {k: v for k, v in f.to_dict().items() if k not in ("precision", "master_weights", "stage_casts")}
    assert FixedMemory.from_dict(old).precision == "fp32"  # JSON from before precisions: fp32


# ------------------------------------------------------------------ device memory as the budget
@pytest.mark.parametrize("seed", range(4))
def test_device_schedule_fits_the_device_under_the_simulator(seed):
    c = with_fixed(Chain.random(8, seed=seed), stage_grads=[MiB // 8] * 8, step_tmp=MiB // 2)  # activations matter
    sol = hcv.solve(c)
    least = device.least_device_memory(c, margin=0.1, solution=sol)
    sa_dev = int(hcv.device_peak(hcv.simulate(c, store_all(c))) / 0.9) + 1  # a device where store-all just fits
    assert least < sa_dev
    for dev in (least, (least + sa_dev) // 2, sa_dev):
        s = hcv.device_schedule(sol, dev, margin=0.1)
        trace = hcv.simulate(c, s)
        assert hcv.device_peak(trace) <= dev * 0.9
        assert s.meta["device_memory"] == dev
    assert hcv.simulate(c, hcv.device_schedule(sol, sa_dev, margin=0.1)).n_recomputed == 0
    too_small = int((c.fixed.static_per_rank + hcv.core.solver.least_budget(c) // 2) / 0.9)
    with pytest.raises(DoesNotFit) as e:
        hcv.device_schedule(sol, too_small, margin=0.1)
    assert e.value.min_budget == least and f"({least} B) fits" in str(e.value) and "AdamW state" in str(e.value)


def test_device_schedule_argument_errors():
    c = with_fixed(Chain.random(4))
    sol = hcv.solve(c)
    with pytest.raises(HChainError, match="margin"):
        hcv.device_schedule(sol, "1GiB", margin=1.5)
    with pytest.raises(HChainError, match="device memory"):
        hcv.device_schedule(sol, "lots")
    with pytest.raises(DoesNotFit, match="the optimizer step alone"):
        hcv.device_schedule(sol, c.fixed.total_per_rank)


def test_sharding_lowers_the_device_peak_by_what_it_divides():
    c = with_fixed(Chain.random(5))
    one = hcv.device_peak(hcv.simulate(c, store_all(c)))
    two = hcv.device_peak(hcv.simulate(c.with_world_size(2), store_all(c)))
    assert 0 < one - two <= (c.fixed.params + c.fixed.optimizer_state + c.fixed.grads + c.fixed.step_tmp) // 2 + 5


# ------------------------------------------------------------------ batch size
def test_fit_is_exact_on_linear_chains_and_checked_on_a_held_out_size():
    chains, at = linear_chains()
    c = fit_batch(chains)
    for b in (1, 8, 24, 100):
        got, want = hcv.at_batch(c, b), at(b)
        assert got.x == want.x and got.xbar == want.xbar and got.bwd_tmp == want.bwd_tmp
        assert got.fwd_time == pytest.approx(want.fwd_time)
        assert got.batch == b
    err = fit_error(hcv.at_batch(c, 24), at(24))
    assert abs(err["store_all_peak"]) < 1e-12 and err["size_max"] == 0
    wrong = dataclasses.replace(at(24), x=[v + 1000 for v in at(24).x])
    assert fit_error(hcv.at_batch(c, 24), wrong)["size_max"] > 0


def test_fit_needs_two_sizes_and_the_same_stages():
    chains, at = linear_chains(sizes=(8,))
    with pytest.raises(HChainError, match="two or more"):
        fit_batch(chains)
    other = dataclasses.replace(at(16), names=[f"n{i}" for i in range(6)])
    with pytest.raises(HChainError, match="same stages"):
        fit_batch({8: at(8), 16: other})
    with pytest.raises(HChainError, match="no batch-size fit"):
        hcv.at_batch(at(8), 4)
    with pytest.raises(HChainError, match="positive integer"):
        hcv.at_batch(fit_batch({8: at(8), 16: at(16)}), 0)


def test_largest_batch_bisection_agrees_with_a_scan_and_strategies_are_ordered():
    chains, _ = linear_chains()
    c = fit_batch(chains)
    dev = 512 * MiB
    found = {}
    for s in device.BATCH_STRATEGIES:
        p = device.largest_batch(c, dev, s)
        assert p.fits and p.device_peak <= device.usable_memory(dev)
        above = device.fit_point(hcv.at_batch(c, p.batch + 1), s, dev)
        assert not above.fits
        grid = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
        on_grid = device.largest_batch(c, dev, s, batches=grid)
        assert on_grid.batch == max(b for b in grid if b <= p.batch)
        found[s] = p.batch
    assert found["optimal"] >= found["checkpoint_sequential"] >= found["store_all"]
    assert found["optimal"] > found["store_all"]


def test_fit_point_optimal_is_never_slower_than_the_baselines_when_they_fit():
    chains, _ = linear_chains()
    c = fit_batch(chains)
    sweep = device.batch_sweep(c, 256 * MiB, [4, 16, 64])
    for k in range(3):
        opt = sweep["optimal"][k]
        for s in ("store_all", "checkpoint_sequential"):
            p = sweep[s][k]
            if p.fits:
                assert opt.fits and opt.makespan <= p.makespan * (1 + 1e-9)
    cs = sweep["checkpoint_sequential"][0]
    assert cs.schedule.meta["strategy"] == "periodic"
    assert cs.schedule.ops in {periodic(hcv.at_batch(c, 4), n).ops for n in range(1, 7)}


def test_fit_scales_shared_tensors_with_the_batch():
    _, at = linear_chains()
    chains = {b: dataclasses.replace(at(b), x=[max(v, 100 * b) for v in at(b).x],
                                     xbar=[max(v, 100 * b) for v in at(b).xbar], shared=((1, 3, 100 * b),))
              for b in (8, 16)}
    c = fit_batch(chains)
    assert hcv.at_batch(c, 32).shared == ((1, 3, 3200),)
    assert hcv.at_batch(Chain.from_json(c.to_json()), 4).shared == ((1, 3, 400),)
