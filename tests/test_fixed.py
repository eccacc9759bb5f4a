"""runtime/fixed.py with profile(optimizer=) and measure(optimizer=): the fixed part of a training step measured
from the real optimizer, the whole-step peak predicted against the measured one, and the user's model and optimizer
left as found (DESIGN §7)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import hchain_viz as hcv  # noqa: E402
from hchain_viz.errors import ProfileError  # noqa: E402

pytestmark = pytest.mark.torch


def model_and_input(seed: int = 0):
    """Dense stages (Linear + ReLU, each saving its input, as the chain model assumes) and a BatchNorm stage."""
    model, x, _ = hcv.models.mlp_chain(batch=16, in_features=32, widths=(512, 256, 512), seed=seed)
    model.add_module("bn", nn.BatchNorm1d(10))
    return model, x


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


OPTIMIZERS = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    "adam": (lambda ps: torch.optim.Adam(ps), 2),
    "adamw": (lambda ps: torch.optim.AdamW(ps, weight_decay=0.1), 2),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps), 1),  # "others": found by inspecting the state after a step
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_profile_records_the_fixed_part_of_the_real_optimizer(name):
    make, copies = OPTIMIZERS[name]
    model, x = model_and_input()
    opt = make(model.parameters())
    chain = hcv.profile(model, x, optimizer=opt, repeats=1, warmup=0, progress=False)
    f = chain.fixed
    P = param_bytes(model)
    n_params = len(list(model.parameters()))
    assert f.params == P and f.grads == P and f.optimizer == type(opt).__name__
    assert f.buffers == sum(b.numel() * b.element_size() for b in model.buffers())
    # momentum / moments are one or two tensors per parameter; Adam's step counters are 4-byte CPU tensors
    assert copies * P <= f.optimizer_state <= copies * P + 4 * n_params
    # each stage's gradients are its own parameters'
    assert list(f.stage_grads) == [sum(p.numel() * 4 for p in m.parameters()) for m in model]
    assert f.step_tmp >= 0 and (name != "adam" or f.step_tmp > 0)  # Adam's denominator is a temporary
    assert hcv.Chain.from_json(chain.to_json()).fixed == f


def test_profile_and_measure_leave_model_and_optimizer_as_found():
    model, x = model_and_input()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    # a model that has trained one step: the optimizer has state and the parameters have gradients
    nn.functional.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)).backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    buffers = [b.clone() for b in model.buffers()]
    hcv.profile(model, x, optimizer=opt, repeats=1, warmup=0, progress=False)
    hcv.measure(model, x, optimizer=opt, repeats=1)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    after = opt.state_dict()["state"]
    assert after.keys() == state.keys()
    assert all(torch.equal(state[k][n], after[k][n]) for k in state for n in state[k])
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hcv.measure(model, x, optimizer=fresh, repeats=1)
    assert len(fresh.state) == 0  # a fresh optimizer stays fresh


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw"])
def test_predicted_whole_step_peak_matches_the_measured_one(name):
    model, x = model_and_input()
    opt = OPTIMIZERS[name][0](model.parameters())
    chain = hcv.profile(model, x, optimizer=opt, repeats=1, warmup=0, progress=False)
    measured = hcv.measure(model, x, optimizer=opt, repeats=1)
    predicted = hcv.simulate(chain, hcv.strategies.store_all(chain)).device_peak
    assert measured.device_peak > chain.fixed.params + chain.fixed.optimizer_state
    assert predicted == pytest.approx(measured.device_peak, rel=0.05)
    # without an optimizer the step keeps zeroed gradients, so the peak holds parameters and gradients
    plain = hcv.measure(model, x, repeats=1)
    assert plain.device_peak >= plain.baseline_bytes + plain.peak_bytes - plain.input_bytes


def test_optimizer_errors():
    model, x = model_and_input()
    other, _ = model_and_input(1)
    with pytest.raises(ProfileError, match="none of the model's parameters"):
        hcv.profile(model, x, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), progress=False)
    with pytest.raises(ProfileError, match="torch.optim.Optimizer"):
        hcv.measure(model, x, optimizer="adamw")
    with pytest.raises(ProfileError, match="world_size"):
        hcv.profile(model, x, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), world_size=0, repeats=1,
                    warmup=0, progress=False)
