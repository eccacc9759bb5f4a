"""The executor (runtime/train/, docs/design.md §5): training by any schedule equals eager training, bit for bit.

Every model below is trained for three SGD steps eagerly and wrapped by every baseline strategy and by the optimal
schedule at several budgets; outputs, input and parameter gradients, buffers and the global RNG state must be
identical after each step. Schedules come from random chains of the model's length: a schedule is valid for any
chain of that length, and random sizes give a wide variety of recomputation patterns.
"""

from __future__ import annotations

import copy
import functools
import gc
import io
import weakref
from collections import OrderedDict

import pytest
import torch
from torch import nn

import hchain_viz as hcv
from hchain_viz.core import strategies
from hchain_viz.core.chain import Chain
from hchain_viz.core.simulate import simulate
from hchain_viz.core.solver import solve
from hchain_viz.errors import HChainError, InvalidSchedule, NotSequentialError
from hchain_viz.runtime.train import executor as executor_module
from hchain_viz.runtime.train.wrap import ScheduledModule, wrap

pytestmark = pytest.mark.torch


# ---------------------------------------------------------------------------------------------- models
class Split(nn.Module):
    """Returns a tuple (two views of one linear output, and a plain int that rides along)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 24)

    def forward(self, x):
        a, b = self.lin(x).chunk(2, dim=1)
        return a, b, 3


class Pair(nn.Module):
    """Takes the tuple, returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.la, self.lb = nn.Linear(12, 12), nn.Linear(12, 12)

    def forward(self, t):
        a, b, k = t
        return torch.tanh(self.la(a)), torch.sigmoid(self.lb(b)), k


class Merge(nn.Module):
    def forward(self, t):
        a, b, k = t
        return a * b + k


class ScaleInPlace(nn.Module):
    """Writes into its input (not idempotent): a stored checkpoint fed to it must not be corrupted."""

    def forward(self, x):
        return x.mul_(2.0)


def _seeded(build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return build()


def mlp():
    return _seeded(lambda: (nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.Tanh(),
                                          nn.Linear(24, 8)),
                            torch.randn(6, 16).requires_grad_()))


def cnn_bn():
    return _seeded(lambda: (nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, stride=2),
        nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)),
        torch.randn(4, 3, 12, 12).requires_grad_()))


def transformer():
    def build():
        layer = lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True)
        model = nn.Sequential(nn.Linear(12, 32), layer(), layer(), nn.Dropout(0.3), nn.Linear(32, 5))
        return model, torch.randn(3, 7, 12).requires_grad_()
    return _seeded(build)


def tuple_stage():
    return _seeded(lambda: (nn.Sequential(Split(), Pair(), Merge(), nn.Linear(12, 4)),
                            torch.randn(5, 16).requires_grad_()))


def inplace_first():
    """A standalone in-place first op on the caller's input, and a stage that writes into its input; the input
    does not require grad (eager would refuse an in-place op on a leaf that does)."""
    return _seeded(lambda: (nn.Sequential(nn.ReLU(inplace=True), nn.Linear(16, 32), ScaleInPlace(), nn.Tanh(),
                                          nn.Linear(32, 8)),
                            torch.randn(6, 16)))


def no_grad_input():
    """BatchNorm and Dropout with an input that does not require grad: parameters still get gradients."""
    return _seeded(lambda: (nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Dropout(0.25),
                                          nn.Conv2d(6, 6, 3), nn.Flatten(), nn.Linear(6 * 8 * 8, 3)),
                            torch.randn(2, 3, 12, 12)))


def demo_transformer():
    """The demo GPT (embedding of integer tokens, dropout everywhere), small."""
    model, x, _ = hcv.models.transformer_chain(batch=2, seq=8, dim=32, heads=2, layers=2, vocab=16)
    return model, x


MODELS = {f.__name__: f for f in (mlp, cnn_bn, transformer, tuple_stage, inplace_first, no_grad_input,
                                  demo_transformer)}


@functools.cache
def _n_stages(name: str) -> int:
    model, _ = MODELS[name]()
    return len(hcv.sequentialize(model))


# ---------------------------------------------------------------------------------------------- schedules
def _budgets(lo: int, hi: int, n: int = 3) -> list[int]:
    return sorted({lo + (hi - lo) * k // (n + 1) for k in range(n)})


@functools.cache
def schedules_for(L: int) -> dict[str, hcv.Schedule]:
    """Every strategy, three or more budgets for the budget-driven ones, on a random chain of length L."""
    chain = Chain.random(L, seed=L)
    out = {
        "store_all": strategies.store_all(chain),
        "recompute_all": strategies.recompute_all(chain),
        "sqrt_n": strategies.sqrt_n(chain),
    }
    for k in sorted({2, max(2, L // 2), L}):
        if k <= L:
            out[f"periodic{k}"] = strategies.periodic(chain, k)
    points = strategies.frontier_points(chain)
    for name, fn in (("revolve", strategies.revolve), ("chen_greedy", strategies.chen_greedy)):
        peaks = sorted({p for p, _ in points[name]})
        for b in sorted({peaks[0], peaks[len(peaks) // 2], peaks[-1]}):
            out[f"{name}@{b}"] = fn(chain, b)
    sol = solve(chain)
    for b in _budgets(sol.min_budget, sol.store_all_peak, 4):
        out[f"optimal@{b}"] = sol.schedule(b)
    return out


CASES = [(name, sname) for name in MODELS for sname in schedules_for(_n_stages(name))]


# ---------------------------------------------------------------------------------------------- harness
def _fresh(x):
    return x.detach().clone().requires_grad_(x.requires_grad)


def _loss(out):
    ts = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
    return sum((t.float() ** 2).mean() for t in ts)


def train(model, x, schedule=None, *, steps=3, seed=7, **wrap_kwargs):
    """Three SGD steps (momentum, so later steps depend on earlier gradients); a record per step."""
    model = copy.deepcopy(model)
    net = model if schedule is None else wrap(model, schedule, **wrap_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(seed)
    records = []
    for _ in range(steps):
        xs = _fresh(x)
        out = net(xs)
        _loss(out).backward()
        records.append({
            "out": out.detach().clone(),
            "x_grad": None if xs.grad is None else xs.grad.clone(),
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()],
            "rng": torch.get_rng_state(),
        })
        opt.step()
        opt.zero_grad(set_to_none=True)
    records.append({"params": [p.detach().clone() for p in model.parameters()]})
    return records


def assert_identical(got, ref):
    for step, (g, r) in enumerate(zip(got, ref)):
        for key in r:
            a, b = g[key], r[key]
            if isinstance(b, list):
                assert len(a) == len(b)
                for k, (u, v) in enumerate(zip(a, b)):
                    assert (u is None) == (v is None), f"step {step}: {key}[{k}] is None on one side only"
                    assert u is None or torch.equal(u, v), f"step {step}: {key}[{k}] differs"
            else:
                assert (a is None) == (b is None), f"step {step}: {key} is None on one side only"
                assert a is None or torch.equal(a, b), f"step {step}: {key} differs"


_REFERENCE: dict[str, list] = {}


def reference(name: str):
    if name not in _REFERENCE:
        model, x = MODELS[name]()
        _REFERENCE[name] = train(model, x)
    return _REFERENCE[name]


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("name,sname", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_bitwise_equal_to_eager(name, sname):
    model, x = MODELS[name]()
    schedule = schedules_for(_n_stages(name))[sname]
    ref = reference(name)
    assert all(g is not None for g in ref[0]["grads"]), "the eager reference must give every parameter a gradient"
    assert_identical(train(model, x, schedule), ref)


def test_the_matrix_exercises_recomputation():
    """The schedules above are not all store-all in disguise: most recompute, some a lot."""
    for name in MODELS:
        scheds = schedules_for(_n_stages(name))
        recomputing = [s for s, sch in scheds.items() if sch.n_recomputed > 0]
        assert len(recomputing) >= len(scheds) - 3, name
        assert sum(sch.n_recomputed > 0 for s, sch in scheds.items() if s.startswith("optimal")) >= 2, name


def test_without_rng_preservation_dropout_masks_differ():
    """The RNG test can fail: replays that draw fresh random numbers give different gradients."""
    model, x = transformer()
    L = len(hcv.sequentialize(model))
    schedule = strategies.recompute_all(Chain.random(L))
    got = train(model, x, schedule, preserve_rng_state=False)
    ref = reference("transformer")
    assert torch.equal(got[0]["out"], ref[0]["out"])  # the forward's first runs draw exactly as eager
    assert not all(torch.equal(a, b) for a, b in zip(got[0]["grads"], ref[0]["grads"]))


def test_global_rng_state_after_step_equals_eager():
    model, x = transformer()
    L = len(hcv.sequentialize(model))
    schedule = strategies.recompute_all(Chain.random(L))
    torch.manual_seed(3)
    model(_fresh(x)).sum().backward()
    eager_state = torch.get_rng_state()
    torch.manual_seed(3)
    out = wrap(copy.deepcopy(model), schedule)(_fresh(x))
    assert torch.equal(torch.get_rng_state(), eager_state)  # after the forward ...
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), eager_state)  # ... and after the backward's replays


def test_batchnorm_buffers_updated_once_per_step():
    model, x = cnn_bn()
    L = len(hcv.sequentialize(model))
    wrapped = wrap(model, strategies.recompute_all(Chain.random(L)))
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for step in range(1, 4):
        wrapped(_fresh(x)).sum().backward()
        assert all(int(bn.num_batches_tracked) == step for bn in bns)
    # Each stage with buffers is recomputed several times per step under recompute_all.
    assert wrapped.schedule.n_recomputed > L


def test_parameters_get_gradients_when_input_does_not_require_grad():
    model, x = no_grad_input()
    assert not x.requires_grad
    L = len(hcv.sequentialize(model))
    wrapped = wrap(model, strategies.sqrt_n(Chain.random(L)))
    out = wrapped(x)
    assert out.requires_grad
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert x.grad is None


class _WithMask(nn.Module):
    """Returns (h, mask): a float mask made from a buffer, which needs no gradient (as an attention mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("bias", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), (self.bias + 1.0).expand(x.shape[0], 8)


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, hm: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = hm
        return self.lin(h) * mask, mask


def test_cut_tensors_that_need_no_gradient_get_none_after_no_grad_forwards(monkeypatch):
    """A mask that crosses cuts needs no gradient. After a no-grad forward (Fn/Fck) that cannot be read off the
    values; the executor learns it from one probing forward, so B never computes a gradient for it (eager does
    not), and training stays bitwise equal to eager."""
    torch.manual_seed(0)
    model = nn.Sequential(_WithMask(), _Masked(), _Masked(), nn.Sequential())
    model[3] = _Head()
    x = torch.randn(4, 8)
    eager = copy.deepcopy(model)
    eager(x).sum().backward()
    wrapped = wrap(model, strategies.recompute_all(Chain.random(4)))
    grads: list[list] = []
    backward_op = executor_module._Step._backward_op

    def spy(step, i):
        backward_op(step, i)
        if step.delta.get(i) not in (None, executor_module._SPENT):
            grads.append(step.delta[i])

    monkeypatch.setattr(executor_module._Step, "_backward_op", spy)
    wrapped(x).sum().backward()
    assert wrapped.executor.learned.grad_mask[1:3] == [[True, False], [True, False]]
    assert any(len(d) == 2 for d in grads) and all(d[1] is None for d in grads if len(d) == 2)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)


class _Head(nn.Module):
    def forward(self, hm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return hm[0]


# ---------------------------------------------------------------------------------------------- in-place inputs
def test_inplace_stage_does_not_corrupt_kept_checkpoints():
    model, x = inplace_first()
    L = len(hcv.sequentialize(model))
    # x_2, the input of ScaleInPlace, is kept by Fck2 and read again by the second Fck2 and by Fall2.
    schedule = hcv.Schedule.parse("Fck0 Fn1 Fck2 Fn3 Fall4 Loss B4 Fck2 Fall3 B3 Fall2 B2 Fck0 Fall1 B1 Fall0 B0")
    assert L == 5
    wrapped = wrap(copy.deepcopy(model), schedule)
    for _ in range(2):
        wrapped.zero_grad(set_to_none=True)
        ref_model = copy.deepcopy(wrapped.model)
        xe, xw = _fresh(x), _fresh(x)
        out_e = ref_model(xe)
        out_w = wrapped(xw)
        assert torch.equal(out_w, out_e)
        out_e.sum().backward()
        out_w.sum().backward()
        for p, q in zip(wrapped.model.parameters(), ref_model.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert torch.equal(xw, xe)  # the caller's input is changed exactly as eager changes it
    learned = wrapped.executor.learned
    assert learned.mutates[0] is True and learned.mutates[2] is True  # learned: these stages write their input
    assert wrapped.executor.learned.mutates[1] is False


def test_inplace_first_op_on_input_that_requires_grad_does_not_raise():
    """Eager refuses relu_ on a leaf; a non-leaf input is fine in both, with the same gradient."""
    model, x0 = inplace_first()
    base = x0.detach().clone().requires_grad_()
    wrapped = wrap(copy.deepcopy(model), strategies.recompute_all(Chain.random(5)))
    out = wrapped(base * 1.0)
    out.sum().backward()
    base_e = x0.detach().clone().requires_grad_()
    model(base_e * 1.0).sum().backward()
    assert torch.equal(base.grad, base_e.grad)


# ---------------------------------------------------------------------------------------------- memory model
def _resident(step):
    held = {("x", i) for i in step.x if i > 0} | {("xbar", i) for i in step.xbar} | {("delta", i) for i in step.delta}
    return held


def _checkpointing_schedules(L):
    chain = Chain.random(L, seed=11)
    sol = solve(chain)
    return {"recompute_all": strategies.recompute_all(chain), "store_all": strategies.store_all(chain),
            "revolve": strategies.revolve(chain, None), "sqrt_n": strategies.sqrt_n(chain),
            **{f"optimal{k}": sol.schedule(b) for k, b in enumerate(_budgets(sol.min_budget, sol.store_all_peak))}}


@pytest.mark.parametrize("sname", list(_checkpointing_schedules(5)))
def test_resident_set_follows_the_simulator_op_by_op(monkeypatch, sname):
    """After every op, what the executor holds is what the simulator says is resident (besides x_0 and the
    caller's output): checkpoints are dropped at B(i), not later."""
    model, x = mlp()
    L = len(hcv.sequentialize(model))
    schedule = _checkpointing_schedules(L)[sname]
    seen = []
    fwd, bwd = executor_module._Step._forward_op, executor_module._Step._backward_op

    def record_f(self, *args, **kw):
        fwd(self, *args, **kw)
        seen.append(_resident(self))

    def record_b(self, i):
        bwd(self, i)
        seen.append(_resident(self))

    monkeypatch.setattr(executor_module._Step, "_forward_op", record_f)
    monkeypatch.setattr(executor_module._Step, "_backward_op", record_b)
    wrap(copy.deepcopy(model), schedule)(_fresh(x)).sum().backward()
    expected = [{(it.kind, it.stage) for it in e.resident if it.kind != "out" and (it.kind, it.stage) != ("x", 0)}
                for e in simulate(Chain.random(L), schedule).events if e.op.kind != "Loss"]
    assert seen == expected


@pytest.mark.parametrize("sname", list(_checkpointing_schedules(5)))
def test_checkpoint_storage_is_freed_right_after_its_backward(monkeypatch, sname):
    """Not only forgotten by the bookkeeping: nothing else keeps the memory alive after B(i). Every storage made
    for x_i (plain checkpoints), for x̄_{i+1} (outputs of Fall(i)) and for δ_{i+1} is gone right after B(i)."""
    model, x = mlp()
    L = len(hcv.sequentialize(model))
    schedule = _checkpointing_schedules(L)[sname]
    refs: dict[tuple[str, int], list] = {}
    fwd, bwd = executor_module._Step._forward_op, executor_module._Step._backward_op
    alive_after_b = {}

    def record_f(self, n, kind, i, role, joined, *, in_backward):
        fwd(self, n, kind, i, role, joined, in_backward=in_backward)
        if kind == "Fall" and (in_backward or i < L - 1):  # the first x_L is the caller's to hold
            refs.setdefault(("xbar", i), []).append(weakref.ref(self.xbar[i][1].untyped_storage()))
        elif kind != "Fall" and i + 1 < L:
            refs.setdefault(("x", i + 1), []).append(weakref.ref(self.x[i + 1].untyped_storage()))

    def record_b(self, i):
        delta = self.delta[i + 1]  # δ_{i+1}: a list of tensors (or a placeholder inside a joined group)
        mine = [weakref.ref(t.untyped_storage()) for t in (delta if isinstance(delta, list) else []) if t is not None]
        del delta
        bwd(self, i)
        gc.collect()
        mine += refs.get(("xbar", i), []) + refs.get(("x", i), [])
        alive_after_b[i] = sum(r() is not None for r in mine)

    monkeypatch.setattr(executor_module._Step, "_forward_op", record_f)
    monkeypatch.setattr(executor_module._Step, "_backward_op", record_b)
    out = wrap(copy.deepcopy(model), schedule)(_fresh(x))
    _loss(out).backward()  # a real output gradient (sum()'s is a view of the caller's scalar)
    assert sum(len(v) for v in refs.values()) >= L - 1
    assert alive_after_b == {i: 0 for i in range(L)}


def test_joined_stages_share_one_backward():
    """Falls that read the previous Fall's output, with adjacent backwards, form one graph (as in eager mode):
    store-all is a single group; recompute-all, whose Falls all read plain checkpoints, has one group per stage."""
    model, _ = mlp()
    chain = Chain.random(5)
    assert wrap(model, strategies.store_all(chain)).executor.group_start == [0] * 5
    assert wrap(model, strategies.recompute_all(chain)).executor.group_start == list(range(5))
    # Fall3 reads x_3 from inside x̄_3, but a forward runs between B3 and B2: no joining across the gap.
    gap = "Fck0 Fn1 Fall2 Fall3 Fall4 Loss B4 B3 Fck0 B2 Fall1 B1 Fall0 B0"
    assert wrap(model, gap).executor.group_start == [0, 1, 2, 3, 3]
    # as many backward calls as the simulator charges (chain.backward_call)
    for s in (strategies.store_all(chain), strategies.recompute_all(chain), hcv.Schedule.parse(gap)):
        assert len(set(wrap(model, s).executor.group_start)) == 5 - len(hcv.simulate(chain, s).joined)
    model, x = mlp()
    assert_identical(train(model, x, gap), reference("mlp"))


class _Tied(nn.Module):
    """An output layer whose weight is the embedding's (GPT-2's lm_head and wte)."""

    def __init__(self, embed: nn.Linear) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.embed.weight


def test_stages_sharing_a_weight_back_propagate_apart():
    """Store-all would join every stage into one backward, which holds the tied weight's first gradient until the
    embedding's arrives (the memory model charges no such buffer): the stage that shares it starts a group of its
    own. The step measures within its prediction and its gradients are eager's."""
    from hchain_viz.runtime.measure import measure
    from hchain_viz.runtime.profile import profile

    torch.manual_seed(0)
    embed = nn.Linear(1024, 256, bias=False)  # a 1 MiB weight, next to small activations (batch 16)
    model = nn.Sequential(embed, nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 256), _Tied(embed))
    x = torch.randn(16, 1024)
    chain = profile(model, x, warmup=0, repeats=1, progress=False)
    wrapped = wrap(model, strategies.store_all(chain))
    assert wrapped.executor.group_start == [0, 0, 0, 0, 4]  # joined, it measured 2.39 MB against 1.36 MB predicted
    assert measure(wrapped, x, repeats=1).peak_bytes <= hcv.simulate(chain, strategies.store_all(chain)).peak_memory
    eager = copy.deepcopy(model)
    _loss(eager(x)).backward()
    model.zero_grad(set_to_none=True)
    _loss(wrapped(x)).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)


# ---------------------------------------------------------------------------------------------- module behaviour
def test_eval_and_no_grad_run_the_plain_model():
    model, x = transformer()
    wrapped = wrap(model, strategies.recompute_all(Chain.random(len(hcv.sequentialize(model)))))
    with torch.no_grad():
        out = wrapped(x)
    assert out.grad_fn is None
    wrapped.eval()
    assert not any(m.training for m in model.modules())
    out = wrapped(x)
    assert type(out.grad_fn).__name__ != "_OutputBackward"
    assert torch.equal(out, model(x))
    wrapped.train()
    assert all(m.training for m in model.modules())
    assert type(wrapped(x).grad_fn).__name__ == "_OutputBackward"


def test_state_dict_has_the_plain_keys_and_loads_both_ways():
    model, x = cnn_bn()
    wrapped = wrap(copy.deepcopy(model), strategies.sqrt_n(Chain.random(9)))
    wrapped(_fresh(x)).sum().backward()  # buffers change
    sd = wrapped.state_dict()
    assert list(sd) == list(model.state_dict())
    model.load_state_dict(sd)  # wrapped -> plain
    for a, b in zip(model.state_dict().values(), sd.values()):
        assert torch.equal(a, b)
    fresh = wrap(cnn_bn()[0], strategies.sqrt_n(Chain.random(9)))
    fresh.load_state_dict(model.state_dict())  # plain -> wrapped, strict
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), sd.values()))
    outer = nn.Sequential(OrderedDict(net=fresh))  # nested: keys stay plain under the parent's prefix
    assert list(outer.state_dict()) == ["net." + k for k in sd]
    outer.load_state_dict(nn.Sequential(OrderedDict(net=model)).state_dict())
    buf = io.BytesIO()
    torch.save(wrapped.state_dict(), buf)
    buf.seek(0)
    model.load_state_dict(torch.load(buf))


def test_text_schedules_work():
    model, x = mlp()
    s = strategies.store_all(Chain.random(5))
    assert isinstance(hcv.wrap(model, s), ScheduledModule)
    w = wrap(model, str(s))
    assert w.schedule.ops == s.ops
    assert "store_all" in repr(hcv.wrap(model, s))


def test_schedule_for_another_length_is_refused():
    model, x = mlp()
    with pytest.raises(InvalidSchedule, match="chain of 6 stages but Sequential has 5 stages"):
        wrap(model, strategies.store_all(Chain.random(6)))  # more than the model's stages: refused at once
    # Fewer: stages that write into their input may still be fused once an input is seen; refused at the first call.
    wrapped = wrap(model, strategies.store_all(Chain.random(4)))
    with pytest.raises(InvalidSchedule, match="chain of 4 stages but Sequential has 5 stages"):
        wrapped(x)


def test_bad_schedules_and_models_are_refused():
    model, _ = mlp()
    with pytest.raises(InvalidSchedule, match="B3 needs"):
        wrap(model, "Fall0 Fall1 Fall2 Fall3 Fall4 Loss B3 B4 B2 B1 B0")
    with pytest.raises(InvalidSchedule, match="exactly one Loss"):
        wrap(model, "Fall0 Fall1 Fall2 Fall3 Fall4 B4 B3 B2 B1 B0")
    with pytest.raises(InvalidSchedule, match="ends before"):
        wrap(model, "Fall0 Fall1 Fall2 Fall3 Fall4 Loss B4 B3")
    with pytest.raises(InvalidSchedule, match="needs a Schedule"):
        wrap(model, 42)
    with pytest.raises(NotSequentialError, match="nn.Module"):
        wrap([nn.Linear(2, 2)], "Fall0 Loss B0")
    with pytest.raises(NotSequentialError, match="already wrapped"):
        wrap(wrap(model, strategies.store_all(Chain.random(5))), strategies.store_all(Chain.random(5)))
    assert issubclass(InvalidSchedule, HChainError)


def test_second_backward_is_refused_with_a_clear_error():
    model, x = mlp()
    out = wrap(model, strategies.sqrt_n(Chain.random(5)))(_fresh(x))
    loss = out.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(HChainError, match="backward ran twice"):
        loss.backward()


def test_torchvision_style_resnet_with_custom_forward():
    """A model with its own forward(), laid out like torchvision's ResNet: the stages are found structurally."""
    model, x, loss_fn = hcv.models.resnet_skip(batch=2, image=16, width=4, blocks=(1, 1))
    L = len(hcv.sequentialize(model))
    chain = Chain.random(L, seed=1)
    sol = solve(chain)
    schedule = sol.schedule(_budgets(sol.min_budget, sol.store_all_peak)[0])
    assert schedule.n_recomputed > 0
    eager, wrapped = copy.deepcopy(model), wrap(copy.deepcopy(model), schedule)
    out_e, out_w = eager(x), wrapped(x)
    assert torch.equal(out_w, out_e)
    loss_fn(out_e).backward()
    loss_fn(out_w).backward()
    for p, q in zip(wrapped.model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)
    for a, b in zip(wrapped.model.buffers(), eager.buffers()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- transfers (§9)
def _offload_everything(L: int) -> hcv.Schedule:
    """Store-all with every x̄ sent to the host during the forward and brought back just in time."""
    ops = ["Fall0"]
    for i in range(1, L):
        ops += [f"Fall{i}", f"Off{i - 1}"]
    ops += [f"Off{L - 1}", "Loss", f"Pre{L - 1}"]
    for i in range(L - 1, -1, -1):
        if i > 0:
            ops.append(f"Pre{i - 1}")
        ops.append(f"B{i}")
    return hcv.Schedule.parse(" ".join(ops), strategy="offload_everything")


@functools.cache
def offload_schedules_for(L: int) -> dict[str, hcv.Schedule]:
    """Offloading everything, and the offload solver's schedules at a few budgets on a GPU-like random chain."""
    out = {"offload_everything": _offload_everything(L)}
    c = Chain.random(L, seed=L)
    chain = Chain(fwd_time=c.fwd_time, bwd_time=c.bwd_time, x=c.x, xbar=c.xbar, fwd_tmp=c.fwd_tmp,
                  bwd_tmp=c.bwd_tmp, bandwidth=1e12)
    sol = hcv.solve_offload(chain, grid=8)
    for b in sol.grid:
        s = sol.schedule(b) if sol.makespan(b) < float("inf") else None
        if s is not None and s.n_transfers and str(s) not in {str(v) for v in out.values()}:
            out[f"offload@{b}"] = s
        if len(out) >= 4:
            break
    for s in out.values():
        simulate(chain, s)  # valid
    return out


OFFLOAD_CASES = [(name, sname) for name in MODELS for sname in offload_schedules_for(_n_stages(name))]


@pytest.mark.parametrize("name,sname", OFFLOAD_CASES, ids=[f"{m}-{s}" for m, s in OFFLOAD_CASES])
def test_offload_bitwise_equal_to_eager(name, sname, monkeypatch):
    """Off/Pre on the CPU path (host copies as plain tensors): outputs, gradients, buffers (BatchNorm) and the RNG
    (dropout) are identical to eager training, and every Off really swapped tensors for copies."""
    from hchain_viz.runtime import transfer

    moved = []
    real_off = transfer.Link.off

    def counting_off(self, i, holders):
        holders = list(holders)
        before = [get() for get, _ in holders]
        real_off(self, i, holders)
        moved.append(sum(get() is not b for (get, _), b in zip(holders, before)))

    monkeypatch.setattr(transfer.Link, "off", counting_off)
    model, x = MODELS[name]()
    schedule = offload_schedules_for(_n_stages(name))[sname]
    assert_identical(train(model, x, schedule), reference(name))
    assert len(moved) == 3 * sum(op.kind == "Off" for op in schedule.ops) and sum(moved) > 0


def test_offload_matrix_moves_checkpoints_and_saved_activations():
    """Across the models, the solver's schedules offload both kinds of value (x̄ after Fall, checkpoints after Fck)."""
    kinds = set()
    for name in MODELS:
        L = _n_stages(name)
        chain = Chain.homogeneous(L).with_bandwidth(1.0)
        for s in offload_schedules_for(L).values():
            trace = simulate(chain, s)
            kinds |= {h.kind for h in trace.host_lifetimes}
    assert kinds == {"x", "xbar"}


def test_a_parameter_replaced_or_frozen_after_a_step_is_seen_by_the_next_one():
    """The executor lists each stage's modules once and reads their parameters live: a weight replaced by a frozen
    copy after a step makes the next step learn again which cut tensors need a gradient (none here), as eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    wrapped = wrap(model, strategies.recompute_all(Chain.random(3)))
    wrapped(x).sum().backward()
    assert wrapped.executor.learned.grad_mask[1] == [True]
    model[0].weight = nn.Parameter(model[0].weight.detach().clone(), requires_grad=False)
    model.zero_grad(set_to_none=True)
    eager = copy.deepcopy(model)
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    assert wrapped.executor.learned.grad_mask[1] == [False]
    for p, q in zip(model.parameters(), eager.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    assert model[0].weight.grad is None and model[1].weight.grad is not None
