"""The executor inside ordinary PyTorch training: optimizers, autocast (CPU bfloat16), gradient accumulation and
DistributedDataParallel (gloo, two local processes) give exactly what the plain model gives."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.multiprocessing as mp
from gloo import gloo_rank
from torch import nn

import hchain_viz as hcv
from hchain_viz.core import strategies
from hchain_viz.core.chain import Chain
from hchain_viz.core.solver import solve

pytestmark = pytest.mark.torch


def _model():
    """MLP-ish chain with dropout and a BatchNorm1d: RNG and buffers matter in every scenario below."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32),
                              nn.Tanh(), nn.Linear(32, 4))
        x = torch.randn(8, 16)
        y = torch.randint(0, 4, (8,))
    return model, x, y


def _schedules(L: int) -> dict[str, hcv.Schedule]:
    chain = Chain.random(L, seed=5)
    sol = solve(chain)
    lo, hi = sol.min_budget, sol.store_all_peak
    return {"recompute_all": strategies.recompute_all(chain), "optimal_low": sol.schedule(lo),
            "optimal_mid": sol.schedule(lo + (hi - lo) // 2), "store_all": strategies.store_all(chain)}


SCHEDULES = _schedules(7)


def _equal_lists(a, b):
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("sname", list(SCHEDULES))
def test_autocast_cpu_bfloat16(sname):
    model, x, y = _model()
    results = []
    for schedule in (None, SCHEDULES[sname]):
        m = copy.deepcopy(model)
        net = m if schedule is None else hcv.wrap(m, schedule)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(x)
            loss = nn.functional.cross_entropy(out.float(), y)
        loss.backward()  # outside the autocast region, as recommended
        results.append((out.detach(), [p.grad for p in m.parameters()], list(m.buffers())))
    (out_e, g_e, b_e), (out_w, g_w, b_w) = results
    assert out_w.dtype == torch.bfloat16 and torch.equal(out_w, out_e)
    assert all(g is not None and g.dtype == torch.float32 for g in g_w)  # weight gradients flow through the casts
    assert _equal_lists(g_w, g_e) and _equal_lists(b_w, b_e)


def test_autocast_weight_cache_does_not_cut_gradients():
    """A no-grad run inside an autocast region must not leave gradient-less casts of the weights in its cache."""
    model, x, y = _model()
    L = len(hcv.sequentialize(model))
    # The whole forward without autograd, then again with it, before the loss (legal, if wasteful): within one
    # autocast region each weight is cast in a no-grad run first, then in a recording one.
    ops = " ".join(["Fck0"] + [f"Fn{i}" for i in range(1, L)] + [f"Fall{i}" for i in range(L)] + ["Loss"]
                   + [f"B{i}" for i in reversed(range(L))])
    m = copy.deepcopy(model)
    wrapped = hcv.wrap(m, ops)
    eager = copy.deepcopy(model)
    for net in (wrapped, eager):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(net(x).float(), y)
        loss.backward()
    assert m[0].weight.grad is not None
    assert _equal_lists([p.grad for p in m.parameters()], [p.grad for p in eager.parameters()])


@pytest.mark.parametrize("sname", ["recompute_all", "optimal_low", "optimal_mid"])
def test_gradient_accumulation_over_micro_batches(sname):
    model, x, y = _model()
    params = []
    for schedule in (None, SCHEDULES[sname]):
        m = copy.deepcopy(model)
        net = m if schedule is None else hcv.wrap(m, schedule)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        torch.manual_seed(2)
        for _ in range(2):
            for xb, yb in zip(x.chunk(4), y.chunk(4)):  # four micro-batches, one optimizer step
                loss = nn.functional.cross_entropy(net(xb), yb) / 4
                loss.backward()
            opt.step()
            opt.zero_grad()
        params.append([p.detach().clone() for p in m.parameters()] + [b.clone() for b in m.buffers()])
    assert _equal_lists(params[1], params[0])


# ---------------------------------------------------------------------------------------------- DDP
@gloo_rank
def _ddp_worker(rank: int, world: int, out_dir: str, schedule_json: str) -> None:
    model, x, y = _model()
    xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
    schedule = hcv.Schedule.from_json(schedule_json)
    record = {}
    for label, wrapped in (("plain", False), ("wrapped", True)):
        m = copy.deepcopy(model)
        net = hcv.wrap(m, schedule) if wrapped else m
        ddp = nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        torch.manual_seed(3 + rank)
        grads = []
        for _ in range(2):
            nn.functional.cross_entropy(ddp(xb), yb).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            opt.step()
            opt.zero_grad()
        record[label] = grads
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


def test_distributed_data_parallel_gloo_two_processes(tmp_path):
    model, x, y = _model()
    schedule = SCHEDULES["optimal_low"]
    assert schedule.n_recomputed > 0
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), schedule.to_json()), nprocs=2, join=True)
    records = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rec in records:  # wrapped DDP == plain DDP, bit for bit, on every rank and step
        for g_w, g_p in zip(rec["wrapped"], rec["plain"]):
            assert _equal_lists(g_w, g_p)
    for g0, g1 in zip(records[0]["wrapped"][0], records[1]["wrapped"][0]):
        assert torch.equal(g0, g1)  # all-reduced
    # The first step's all-reduced gradient is the average of the two single-process half-batch gradients.
    singles = []
    for rank in range(2):
        m = copy.deepcopy(model)
        torch.manual_seed(3 + rank)
        nn.functional.cross_entropy(m(x.chunk(2)[rank]), y.chunk(2)[rank]).backward()
        singles.append([p.grad for p in m.parameters()])
    for g, a, b in zip(records[0]["wrapped"][0], *singles):
        torch.testing.assert_close(g, (a + b) / 2, rtol=1e-5, atol=1e-6)
