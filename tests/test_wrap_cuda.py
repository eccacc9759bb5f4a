"""The executor on a GPU (skipped without CUDA): dropout replays draw the CUDA random numbers of their first run,
gradients match eager training, and the measured peak (CUDA allocator statistics) stays within the prediction."""

from __future__ import annotations

import copy

import pytest
import torch

import hchain_viz as hcv
from hchain_viz.core import strategies
from hchain_viz.core.solver import solve
from hchain_viz.runtime.measure import measure

pytestmark = [pytest.mark.torch, pytest.mark.cuda]

SLACK = 2 * 2**20  # bytes: the caching allocator rounds blocks up (512 B .. 2 MiB granularity)


def test_cuda_training_matches_eager_with_dropout_replays():
    model, x, loss_fn = hcv.models.transformer_chain(batch=4, seq=32, dim=64, heads=2, layers=3, device="cuda")
    L = len(hcv.sequentialize(model))
    schedule = strategies.recompute_all(hcv.Chain.random(L))
    results = []
    for wrapped in (False, True):
        m = copy.deepcopy(model)
        net = hcv.wrap(m, schedule) if wrapped else m
        torch.manual_seed(0)
        out = net(x)
        loss_fn(out).backward()
        results.append((out.detach(), [p.grad for p in m.parameters()], torch.cuda.get_rng_state()))
    (out_e, g_e, rng_e), (out_w, g_w, rng_w) = results
    assert torch.equal(out_w, out_e)  # first runs draw exactly as eager
    assert torch.equal(rng_w, rng_e)  # replays leave the CUDA RNG where eager leaves it
    for a, b in zip(g_w, g_e):
        torch.testing.assert_close(a, b)  # same dropout masks; cuBLAS may reorder sums between runs


def test_cuda_measured_peak_within_prediction():
    model, x, loss_fn = hcv.models.resnet_chain(batch=8, image=64, width=16, device="cuda")
    chain = hcv.profile(model, x, loss_fn, progress=False)
    sol = solve(chain)
    lo, hi = sol.min_budget, sol.store_all_peak
    for k in range(5):
        schedule = sol.schedule(lo + (hi - lo) * k // 4)
        pred = hcv.simulate(chain, schedule).peak_memory
        got = measure(hcv.wrap(model, schedule), x, loss_fn, repeats=2).peak_bytes
        assert got <= pred * 1.05 + SLACK, (k, got, pred)
