"""core/regions.py: a schedule as nested checkpoint regions and its peak compiled whole (docs/design.md §5.3).
Torch-free: the planning of the native form runs without PyTorch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hchain_viz as hcv
from hchain_viz.core import strategies
from hchain_viz.core.chain import Chain
from hchain_viz.core.regions import (
    Region,
    compiled_peak,
    compiled_schedule,
    compiled_tree,
    held_peak,
    segment_tree,
    stage_count,
    tree_ops,
)
from hchain_viz.core.simulate import simulate
from hchain_viz.core.solver import solve
from hchain_viz.errors import InvalidSchedule, NotNative

NESTED = "Fck0 Fn1 Fn2 Fall3 Loss B3 Fck0 Fn1 Fall2 B2 Fall0 Fall1 B1 B0"


def test_regions_import_no_torch():
    code = "import sys, hchain_viz.core.regions; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_segment_tree_of_every_dp_schedule_and_baseline_gives_back_its_ops():
    for seed in range(6):
        chain = Chain.random(9, seed=seed)
        sol = solve(chain)
        for budget in range(sol.min_budget, sol.store_all_peak + 1, max(1, (sol.store_all_peak - sol.min_budget) // 7)):
            schedule = sol.schedule(budget)
            assert tree_ops(segment_tree(schedule), 9) == [(op.kind, op.stage) for op in schedule.ops]
    chain = Chain.random(12, seed=1)
    for name, schedule in strategies.baseline_schedules(chain).items():
        assert tree_ops(segment_tree(schedule), 12) == [(op.kind, op.stage) for op in schedule.ops], name
    assert segment_tree(hcv.Schedule.parse(NESTED)) == (Region(0, 2, (Region(0, 1, (0, 1)), 2)), 3)


def test_schedules_that_are_no_tree_raise_not_native_naming_the_op():
    with pytest.raises(NotNative, match="Off/Pre"):
        segment_tree(hcv.Schedule.parse("Fall0 Off0 Fall1 Loss B1 Pre0 B0"))
    with pytest.raises(NotNative, match="op 2 is B1 where the segment tree needs Fck2") as e:
        segment_tree(hcv.Schedule.parse("Fall0 Fall1 B1 Fall2 Loss B2 B0"))
    assert e.value.index == 2
    with pytest.raises(InvalidSchedule, match="exactly one Loss"):
        stage_count(hcv.Schedule.parse("Fall0 B0"))


def test_compiled_form_collapses_nested_regions_and_holds_the_gradients_to_the_end():
    nested = hcv.Schedule.parse(NESTED)
    flat = compiled_schedule(nested)
    assert str(flat) == "Fck0 Fn1 Fn2 Fall3 Loss B3 Fall0 Fall1 Fall2 B2 B1 B0"
    assert compiled_tree(segment_tree(flat)) == segment_tree(flat) and compiled_schedule(flat) is flat
    assert flat.meta["compiled_form_of"] == "schedule" and flat.single_level and not nested.single_level
    chain = Chain.random(4, seed=2)
    trace = simulate(chain, flat)
    assert compiled_peak(chain, nested, [0] * 4) == trace.peak_memory == held_peak(trace, [0] * 4)
    # each stage's gradients are held from its B to the end: stage 0's (B0 is the last op) never add to a peak,
    # stage 3's (B3 runs first) add to every event of the backward after it
    big = 10 * trace.peak_memory
    assert compiled_peak(chain, nested, [big, 0, 0, 0]) == trace.peak_memory
    after_b3 = [e.mem_peak for e in trace.events[[str(e.op) for e in trace.events].index("B3") + 1:]]
    assert compiled_peak(chain, nested, [0, 0, 0, big]) == max(after_b3) + big
