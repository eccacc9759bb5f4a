"""The explorer's device panel and batch-size box (design.md §7): presets and custom sizes, the margin, the whole-step
axis with the fixed part as a band, a plain message when nothing fits, and throughput against the batch size."""

from __future__ import annotations

import dataclasses

import pytest

import hchain_viz as hcv
from hchain_viz.core import device
from hchain_viz.core.batch import fit_batch
from hchain_viz.core.fixed import FixedMemory
from hchain_viz.errors import HChainError
from hchain_viz.viz.explorer import Explorer

MiB = 2**20


@pytest.fixture(scope="module")
def chain():
    """A 6-stage chain whose sizes grow linearly with the batch size, with an AdamW-like fixed part."""
    base = hcv.Chain.random(6, seed=3, scale=MiB // 8)
    fixed = FixedMemory(params=4 * MiB, stage_grads=[4 * MiB // 6] * 6, optimizer_state=8 * MiB, step_tmp=MiB // 2,
                        optimizer="AdamW")

    def at(b: int) -> hcv.Chain:
        return dataclasses.replace(
            base, fwd_time=[t * b for t in base.fwd_time], bwd_time=[t * b for t in base.bwd_time],
            x=[v * b for v in base.x], xbar=[v * b for v in base.xbar], fwd_tmp=[v * b for v in base.fwd_tmp],
            bwd_tmp=[v * b for v in base.bwd_tmp], fixed=fixed)
    return hcv.at_batch(fit_batch({4: at(4), 8: at(8)}), 8)


def test_device_panel_picks_the_fastest_schedule_that_fits(chain):
    ex = Explorer(chain)
    assert "choose a device" in ex._device_label.value
    sa = hcv.device_peak(hcv.simulate(chain, hcv.strategies.store_all(chain)))
    least = device.least_device_memory(chain, 0.05)
    dev = (least + int(sa / 0.95)) // 2  # store-all does not fit: recomputation needed
    ex.device_memory = dev
    trace = ex.trace
    assert "Fits" in ex.device_note
    assert hcv.device_peak(trace) <= device.usable_memory(dev, ex.margin) and trace.n_recomputed > 0
    want = hcv.device_schedule(hcv.solve(chain), dev, margin=ex.margin)
    assert trace.schedule.ops == want.ops
    assert "throughput" in ex.figures and ["throughput"] in ex._board.rows
    ex.margin = 0.02  # a smaller margin leaves more: a schedule as fast or faster, still within the device
    assert hcv.device_peak(ex.trace) <= device.usable_memory(dev, 0.02)
    assert ex.trace.makespan <= trace.makespan
    ex.close()


def test_nothing_fits_is_said_plainly_and_keeps_the_budget(chain):
    ex = Explorer(chain)
    before = ex.budget
    ex.device_memory = "4MiB"  # less than the fixed part
    assert ex.device_note.startswith("Nothing fits") and "A device of" in ex.device_note
    assert "color:#c00" in ex._device_label.value
    assert ex.budget == before
    ex.close()


def test_presets_custom_size_and_the_controls(chain):
    ex = Explorer(chain)
    label, size = next(iter(device.DEVICE_PRESETS.items()))
    ex._device_dd.value = size
    assert ex.device_memory == size and "16 GiB" in label and ex.trace.n_recomputed == 0  # roomy: store-all
    ex._device_dd.value = -1
    ex._custom.value = "40MiB"
    assert ex.device_memory == 40 * MiB
    ex._custom.value = "lots"
    assert "cannot read" in ex._device_label.value and ex.device_memory == 40 * MiB
    ex.device_memory = list(device.DEVICE_PRESETS)[1]  # a preset label works too
    assert ex.device_memory == 24 * 2**30
    ex._device_dd.value = 0
    assert ex.device_memory is None and "throughput" not in ex.figures
    ex.close()


def test_whole_step_axis_moves_slider_and_frontier_by_the_fixed_part(chain):
    ex = Explorer(chain, device_memory="40MiB", axis="device")
    fixed = chain.fixed.total_per_rank
    assert ex._budget_slider.value == ex.budget + fixed and ex._budget_slider.min == ex.min_budget + fixed
    front = ex.figures["frontier"]
    optimal = front.data[0]
    assert min(optimal.x) == pytest.approx(hcv.solve(chain).frontier()[0][0] + fixed, rel=1e-3)
    band = [s for s in front.layout.shapes if s.type == "rect" and s.x0 == 0]
    assert band and band[0].x1 == fixed  # the fixed part, drawn as a band
    ex._on_budget_slider(ex.min_budget + fixed + 1000)  # the slider speaks device bytes
    assert ex.budget == ex.min_budget + 1000
    ex._on_frontier_click({"x": ex.max_budget + fixed})
    assert ex.budget == ex.max_budget
    ex.axis = "activations"
    assert ex._budget_slider.value == ex.budget and ex.figures["frontier"].layout.xaxis.range[0] > 0
    ex.close()


def test_batch_box_re_solves_at_another_batch_size(chain):
    ex = Explorer(chain, device_memory="40MiB")
    ex._batch_box.value = 16
    assert ex.chain.batch == 16 and ex.chain.x == hcv.at_batch(chain, 16).x
    assert hcv.device_peak(ex.trace) <= device.usable_memory(40 * MiB, ex.margin) or not ex._device_fits
    mark = [s for s in ex.figures["throughput"].layout.shapes if s.x0 == 16]
    assert mark  # the batch on screen is marked on the throughput figure
    ex.close()


def test_device_panel_needs_a_fixed_part():
    plain = hcv.Chain.random(4)
    ex = Explorer(plain)
    assert not ex._device_widgets
    with pytest.raises(HChainError, match="optimizer=opt"):
        ex.device_memory = "1GiB"
    with pytest.raises(HChainError, match="fixed part"):
        Explorer(plain, axis="device")
    ex.close()


def test_precision_choice_recounts_the_fixed_part_and_answers_the_device_again(chain):
    """A chain profiled under autocast bf16 offers the precisions its fixed part derives (docs/design.md §11)."""
    mixed = dataclasses.replace(chain.fixed, precision="bf16-mixed", stage_casts=[2 * MiB // 6] * 6)
    profiled = dataclasses.replace(chain, fixed=mixed)
    ex = Explorer(profiled, device_memory="40MiB", axis="device")
    assert list(ex._precision_dd.options) == mixed.precisions() and ex.precision == "bf16-mixed"
    assert len(mixed.precisions()) > 2  # bf16-master, bf16 and fp16 weights too
    before = ex.device_note
    ex._precision_dd.value = "bf16"  # 16-bit weights and AdamW state: a smaller fixed part
    want = device.in_precision(profiled, "bf16")
    assert ex.precision == "bf16" and ex.chain.fixed == want.fixed
    assert want.fixed.total_per_rank < mixed.total_per_rank
    assert ex.device_note != before and "bf16:" in ex.device_note  # the answer follows the precision
    assert ex.trace.schedule.ops == hcv.device_schedule(hcv.solve(want), "40MiB", margin=ex.margin).ops
    assert ex._budget_slider.min == ex.min_budget + want.fixed.total_per_rank  # the device axis moves with it
    ex.batch = 16  # another batch keeps the precision chosen
    assert ex.precision == "bf16" and ex.chain.fixed == want.fixed
    ex.precision = "bf16-mixed"  # and back: derived from the record as profiled, its autocast copies included
    assert ex.chain.fixed == mixed and ex._precision_dd.value == "bf16-mixed"
    with pytest.raises(HChainError, match="32-bit"):
        ex.precision = "fp32"  # another activation width: not derivable
    ex.close()


def test_no_precision_choice_when_only_one_derives(chain):
    ex = Explorer(chain)  # profiled in fp32: 16-bit compute would change the activations too
    assert chain.fixed.precisions() == ["fp32"] and ex._precision_dd is None and ex.precision == "fp32"
    ex.close()
