"""Memory as predicted: a wrapped training step measured on the CPU peaks where the simulator says (docs/design.md §3).

For each demo model: profile it, solve, and at five budgets across the feasible range measure one real step of the
optimal schedule. The measured activation peak must not exceed the simulated peak by more than 5% plus a small
allocator constant, and the low budgets must really save memory compared with storing everything.
"""

from __future__ import annotations

import pytest

import hchain_viz as hcv
from hchain_viz.core.solver import solve
from hchain_viz.runtime.measure import measure

pytestmark = pytest.mark.torch

SLACK = 64 * 1024  # bytes: small allocations the chain model does not itemise (scalars, loss, shape tensors)

DEMOS = {
    "mlp_chain": dict(batch=64),
    "resnet_chain": dict(batch=4, image=32, width=8),
    "transformer_chain": dict(batch=4, seq=32, dim=64, heads=2, layers=3),
}


@pytest.fixture(scope="module", params=list(DEMOS))
def demo(request):
    model, x, loss_fn = hcv.models.demo_model(request.param, **DEMOS[request.param])
    chain = hcv.profile(model, x, loss_fn, warmup=1, repeats=1, progress=False)
    return model, x, loss_fn, chain, solve(chain)


def test_measured_peak_within_prediction_at_five_budgets(demo):
    model, x, loss_fn, chain, sol = demo
    lo, hi = sol.min_budget, sol.store_all_peak
    budgets = [lo + (hi - lo) * k // 4 for k in range(5)]
    measured, predicted = [], []
    for budget in budgets:
        schedule = sol.schedule(budget)
        pred = hcv.simulate(chain, schedule).peak_memory
        assert pred <= budget
        got = measure(hcv.wrap(model, schedule), x, loss_fn, repeats=1).peak_bytes
        assert got <= pred * 1.05 + SLACK, (f"budget {budget}: measured {got} B, predicted {pred} B "
                                            f"({schedule.n_recomputed} recomputed forwards)")
        measured.append(got)
        predicted.append(pred)
    assert sol.schedule(budgets[0]).n_recomputed > 0
    assert measured[0] < measured[-1]  # the smallest budget really runs in less memory than store-all
