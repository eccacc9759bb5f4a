"""runtime/fixed.py with profile(optimizer=) and measure(optimizer=): the fixed part of a training step measured
from the real optimizer, the whole-step peak predicted against the measured one, and the user's model and optimizer
left as found (docs/design.md §7)."""

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
    predicted = hcv.device_peak(hcv.simulate(chain, hcv.strategies.store_all(chain)))
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


# ------------------------------------------------------------------ mixed precision (docs/design.md §11)
def training_loop_peak(model, x, opt, autocast=None) -> int:
    """The whole step's peak as a training loop runs it (forward and loss under ``torch.autocast`` when given,
    backward and ``opt.step()`` after it exits), measured from the allocator's log: what is resident before the step
    (parameters, optimizer state, buffers, the input) plus the peak above it. Independent of ``hcv.measure``."""
    from contextlib import nullcontext

    from hchain_viz.runtime.fixed import optimizer_state_tensors
    from hchain_viz.runtime.measure import default_loss
    from hchain_viz.runtime.memtrack import MemoryMeter, nbytes

    def step():
        with torch.autocast("cpu", dtype=autocast) if autocast else nullcontext():
            loss = default_loss(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer's state exists from here on, as after a first step
    resident = nbytes([*model.parameters(), *model.buffers(), *optimizer_state_tensors(opt), x])
    with MemoryMeter("cpu") as meter:
        step()
    return resident + meter.peak


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["bf16-mixed", "bf16"])
def test_whole_step_in_bf16_matches_a_measured_training_loop(name, mode):
    """Profiled in the precision that runs (under autocast, or with bf16 weights), the predicted whole-step peak is
    within 5% of a training loop's, never below it; the fixed part is counted in that precision."""
    model, x, _ = hcv.models.mlp_chain(batch=64, in_features=32, widths=(512, 256, 512), seed=0)
    if mode == "bf16":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    opt = OPTIMIZERS[name][0](model.parameters())
    autocast = torch.bfloat16 if mode == "bf16-mixed" else None
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False):
        chain = hcv.profile(model, x, optimizer=opt, repeats=1, warmup=0, progress=False)
    f = chain.fixed
    elements = sum(p.numel() for p in model.parameters())
    assert f.precision == mode
    if mode == "bf16-mixed":  # every weight is a Linear's: autocast caches a 2-byte copy of each, stage by stage
        assert f.params == 4 * elements and f.cast_cache == 2 * elements
        assert list(f.stage_casts) == [2 * sum(p.numel() for p in m.parameters()) for m in model]
    else:
        assert f.params == 2 * elements and f.stage_casts == ()
        assert name == "sgd" or 2 * 2 * elements <= f.optimizer_state < 2 * 2 * elements + 4 * 16  # bf16 moments
    predicted = hcv.device_peak(hcv.simulate(chain, hcv.strategies.store_all(chain)))
    measured = training_loop_peak(model, x, opt, autocast)
    assert 1.0 <= predicted / measured <= 1.05, (predicted, measured)
    assert hcv.Chain.from_json(chain.to_json()).fixed == f


def test_autocast_cache_counts_only_the_weights_autocast_casts():
    """LayerNorm runs in fp32 under autocast (its weights are not cast) and a frozen weight is not cached; the
    Linear weights and biases are, each once even when a stage uses it twice. Buffers and the RNG are put back."""
    from hchain_viz.runtime.fixed import autocast_cache

    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    frozen = nn.Linear(16, 16).requires_grad_(False)
    stages = [nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)), nn.Sequential(shared, nn.ReLU(), shared),
              nn.Sequential(frozen, nn.BatchNorm1d(16), nn.Dropout(0.5))]
    x = torch.randn(4, 8)
    buffers = [b for s in stages for b in s.buffers()]
    before = [b.clone() for b in buffers]
    rng = torch.get_rng_state()
    casts = autocast_cache(stages, x, buffers, torch.device("cpu"), torch.bfloat16)
    assert casts == [2 * (8 * 16 + 16), 2 * (16 * 16 + 16), 0]
    assert all(torch.equal(a, b) for a, b in zip(before, buffers)) and torch.equal(rng, torch.get_rng_state())


def test_bf16_master_weights_are_derived_from_the_bf16_profile():
    """bf16 weights with fp32 master weights: the bf16 profile's parameters and gradients, plus a 4-byte master copy
    per trainable element, and the optimizer's state in fp32 (twice the bf16 one)."""
    model, x, _ = hcv.models.mlp_chain(batch=16, in_features=32, widths=(64, 32), seed=0)
    model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    chain = hcv.profile(model, x, optimizer=torch.optim.AdamW(model.parameters()), repeats=1, warmup=0,
                        progress=False)
    master = hcv.core.device.in_precision(chain, "bf16-master")
    f, m = chain.fixed, master.fixed
    elements = sum(p.numel() for p in model.parameters())
    assert (m.precision, m.params, m.grads, m.master_weights) == ("bf16-master", 2 * elements, 2 * elements,
                                                                  4 * elements)
    assert m.optimizer_state == 2 * f.optimizer_state and m.step_tmp == 2 * f.step_tmp
    assert m.parts()["master weights"] == 4 * elements and master.x == chain.x  # activations as profiled
    with pytest.raises(hcv.HChainError, match="profiled in 'bf16'.*torch.autocast"):
        hcv.core.device.in_precision(chain, "bf16-mixed")  # its weight copies were never measured


def test_make_optimizer_builds_every_named_optimizer_and_names_the_choices():
    from hchain_viz.core.fixed import OPTIMIZERS as NAMED
    from hchain_viz.runtime.fixed import make_optimizer

    model, _ = model_and_input()
    for name, (cls, kwargs) in NAMED.items():
        opt = make_optimizer(name, model.parameters())
        assert type(opt).__name__ == cls and all(opt.defaults[k] == v for k, v in kwargs.items())
    with pytest.raises(hcv.HChainError, match="unknown optimizer 'lion'.*adamw"):
        make_optimizer("lion", model.parameters())


def test_autocast_weight_copies_are_what_the_prediction_needs():
    """At a batch where the forward's end sets the peak, the prediction without autocast's weight copies falls below
    the measured training loop; with them (a stage's copies live from its forward to its backward) it is within 5%
    above it. The optimizer step holds no copies: its predicted peak does not change."""
    import dataclasses

    model, x, _ = hcv.models.mlp_chain(batch=512, in_features=32, widths=(512, 256, 512), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chain = hcv.profile(model, x, optimizer=opt, repeats=1, warmup=0, progress=False)
    without = dataclasses.replace(chain, fixed=dataclasses.replace(chain.fixed, stage_casts=()))
    measured = training_loop_peak(model, x, opt, torch.bfloat16)
    peak = {c: hcv.device_peak(hcv.simulate(c, hcv.strategies.store_all(c))) for c in (chain, without)}
    assert peak[without] < measured <= peak[chain] <= 1.05 * measured, (peak, measured)
    step = hcv.core.device.optimizer_step_peak
    assert step(chain) == step(without)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_recomputing_schedules_under_autocast_are_predicted_within_5_percent(name):
    """Applied schedules that recompute, trained under bf16 autocast: the predicted whole-step peak (weight copies
    counted from a stage's forward to its backward) is within 5% above the measured training loop's."""
    model, x, _ = hcv.models.mlp_chain(batch=512, in_features=32, widths=(512, 256, 512), seed=0)
    opt = OPTIMIZERS[name][0](model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chain = hcv.profile(model, x, optimizer=opt, repeats=1, warmup=0, progress=False)
    sol = hcv.solve(chain)
    for budget in (sol.min_budget, (sol.min_budget + sol.store_all_peak) // 2):
        schedule = sol.schedule(budget)
        assert schedule.n_recomputed > 0
        predicted = hcv.device_peak(hcv.simulate(chain, schedule))
        measured = training_loop_peak(hcv.wrap(model, schedule), x, opt, torch.bfloat16)
        assert 1.0 <= predicted / measured <= 1.05, (budget, predicted, measured)


def test_profile_records_a_tied_weight_with_the_stages_that_use_it():
    """GPT-2's LM head reuses the token embedding: one gradient, counted on the head, and a ``tied_grads`` entry
    naming both stages (what a pipeline device with the embedding alone holds a copy of)."""
    pytest.importorskip("transformers")
    model, inputs, _ = hcv.models.hf_model("gpt2", batch=2, seq=8, layers=2, hidden=32, heads=4, vocab=64)
    x = inputs["input_ids"]
    chain = hcv.profile(model, x, lambda out: out["logits"].float().pow(2).mean(),
                        optimizer=torch.optim.AdamW(model.parameters()), repeats=1, warmup=0, progress=False)
    wte = model.transformer.wte.weight
    stages = hcv.sequentialize(model)
    users = tuple(i for i, (_, m) in enumerate(stages) if any(p is wte for p in m.parameters()))
    assert len(users) == 2 and users[-1] == chain.length - 1
    assert chain.fixed.tied_grads == ((users, wte.numel() * 4),)
    assert chain.fixed.params == param_bytes(model) and chain.fixed.grads == param_bytes(model)
    assert hcv.Chain.from_json(chain.to_json()).fixed == chain.fixed
