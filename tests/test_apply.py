"""hcv.apply: a schedule installed on the model itself (runtime/train/inplace.py), by the executor and in the
native form (runtime/train/native.py). The model stays the same object with the same signature and keys, trains
bitwise like eager, and every bad input is an HChainError that says what to do."""

from __future__ import annotations

import copy
import inspect
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import hchain_viz as hcv
from hchain_viz.core import strategies
from hchain_viz.core.chain import Chain
from hchain_viz.core.regions import segment_tree
from hchain_viz.core.solver import solve
from hchain_viz.errors import AlreadyApplied, DoubleCheckpointing, InputMismatch, NotNative, ScheduleMismatch

pytestmark = pytest.mark.torch


def _model(width: int = 32, batch: int = 8):
    """Dropout and a BatchNorm1d: RNG and buffers matter."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        w = width
        model = nn.Sequential(nn.Linear(16, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Dropout(0.2), nn.Linear(w, w),
                              nn.Tanh(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 4))
        x = torch.randn(batch, 16)
        y = torch.randint(0, 4, (batch,))
    return model, x, y


def _schedules(L: int) -> dict[str, hcv.Schedule]:
    chain = Chain.random(L, seed=5)
    sol = solve(chain)
    lo, hi = sol.min_budget, sol.store_all_peak
    return {"recompute_all": strategies.recompute_all(chain), "optimal_low": sol.schedule(lo),
            "optimal_mid": sol.schedule(lo + (hi - lo) // 3), "store_all": strategies.store_all(chain)}


L_SEQ = len(hcv.sequentialize(_model()[0]))
SCHEDULES = _schedules(L_SEQ)


def _step(net, x, y, seed=1):
    torch.manual_seed(seed)
    out = net(x)
    loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    return loss.detach(), torch.get_rng_state()


@pytest.mark.parametrize("native", [False, True], ids=["executor", "native"])
@pytest.mark.parametrize("sname", list(SCHEDULES))
def test_applied_model_trains_bitwise_like_eager_and_stays_itself(sname, native):
    model, x, y = _model()
    twin = copy.deepcopy(model)
    signature, keys, cls = inspect.signature(model.forward), list(model.state_dict()), type(model)
    assert hcv.apply(model, SCHEDULES[sname], native=native) is model
    assert type(model) is cls and inspect.signature(model.forward) == signature
    assert list(model.state_dict()) == keys and len(list(model.modules())) == len(list(twin.modules()))
    for _ in range(2):  # two steps: dropout, BatchNorm statistics and the global RNG as eager
        (loss_a, rng_a), (loss_e, rng_e) = _step(model, x, y), _step(twin, x, y)
        assert torch.equal(loss_a, loss_e) and torch.equal(rng_a, rng_e)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), name
        for a, b in zip(model.buffers(), twin.buffers()):
            assert torch.equal(a, b)
    # eval() and no_grad run the plain forward
    model.eval(), twin.eval()
    assert torch.equal(model(x), twin(x))
    model.train(), twin.train()
    with torch.no_grad():
        torch.manual_seed(3)
        got = model(x)
        torch.manual_seed(3)
        assert torch.equal(got, twin(x))
    hcv.remove(model)
    assert "forward" not in vars(model) and inspect.signature(model.forward) == signature
    with pytest.raises(hcv.HChainError, match="no schedule applied"):
        hcv.remove(model)


class _AddOne(nn.Module):
    """Writes into its input without saying so: only a sample input shows that it fuses with the stage before."""

    def forward(self, x):
        return x.add_(1)


@pytest.mark.parametrize("native", [False, True], ids=["executor", "native"])
def test_stages_fused_only_with_an_input_are_found_at_the_first_step_by_both_forms(native):
    """More stages by structure than the schedule's: both forms wait for the first input (one find_stages, #40)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 8), _AddOne(), nn.Tanh(), nn.Linear(8, 4))
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    twin = copy.deepcopy(model)
    assert len(hcv.sequentialize(model)) == 4 and len(hcv.sequentialize(model, x)) == 3
    hcv.apply(model, hcv.Schedule.parse("Fck0 Fn1 Fall2 Loss B2 Fall0 Fall1 B1 B0"), native=native)
    (loss_a, _), (loss_e, _) = _step(model, x, y), _step(twin, x, y)
    assert torch.equal(loss_a, loss_e)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))


def test_an_applied_model_is_deep_copied_with_its_schedule():
    model, x, y = _model()
    hcv.apply(model, SCHEDULES["optimal_low"])
    copied = copy.deepcopy(model)
    twin = copy.deepcopy(_model()[0])
    _step(copied, x, y), _step(twin, x, y)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(copied.parameters(), twin.parameters()))
    assert all(p.grad is None for p in model.parameters())  # the copy trained its own parameters
    assert vars(copied)["forward"]._state.model is copied


def test_applying_twice_is_refused():
    model, _, _ = _model()
    hcv.apply(model, SCHEDULES["store_all"])
    with pytest.raises(AlreadyApplied, match="hcv.remove"):
        hcv.apply(model, SCHEDULES["optimal_low"])
    with pytest.raises(AlreadyApplied):
        hcv.apply(hcv.wrap(_model()[0], SCHEDULES["store_all"]), SCHEDULES["store_all"])


def test_a_chain_of_another_model_is_refused():
    model, x, _ = _model()
    chain = hcv.profile(model, x, warmup=0, repeats=1, progress=False)
    schedule = strategies.store_all(chain)
    wider = nn.Sequential(*[nn.Linear(16, 64) if i == 0 else m for i, m in enumerate(_model()[0])])
    with pytest.raises(ScheduleMismatch, match="parameters"):
        hcv.apply(wider, schedule, chain=chain)
    other = nn.Sequential(*_model()[0][:-1], nn.Linear(32, 4), nn.Identity())
    with pytest.raises(hcv.HChainError, match="stages"):
        hcv.apply(other, schedule, chain=chain)
    hcv.apply(model, schedule, chain=chain)  # its own model: accepted


def test_other_input_shapes_than_profiled_are_refused():
    model, x, y = _model()
    chain = hcv.profile(model, x, warmup=0, repeats=1, progress=False)
    hcv.apply(model, strategies.store_all(chain), chain=chain)
    with pytest.raises(InputMismatch, match=r"\[8, 16\]"):
        model(torch.randn(4, 16))  # the first training call has the profiled shapes
    _step(model, x, y)  # the profiled shape trains
    with pytest.raises(InputMismatch, match="profiled \\[8, 16\\] float32, called with \\[12, 16\\]"):
        model(torch.randn(12, 16))  # a larger batch: the schedule's memory would not hold
    with pytest.raises(InputMismatch, match="profile again"):
        model(x.double())
    model.eval()
    assert model(torch.randn(12, 16)).shape == (12, 4)  # eval is the plain model, any shape


@pytest.mark.parametrize("native", [False, True], ids=["executor", "native"])
def test_a_smaller_last_batch_trains_exactly_within_the_predicted_peak(native):
    from hchain_viz.core.simulate import simulate

    model, x, y = _model(width=256, batch=64)  # activations well above the native form's RNG states (5 KiB each)
    twin = copy.deepcopy(model)
    chain = hcv.profile(model, x, warmup=0, repeats=1, progress=False)
    sol = solve(chain)
    schedule = sol.schedule(sol.min_budget)
    assert schedule.n_recomputed > 0
    hcv.apply(model, schedule, chain=chain, native=native)
    for xs, ys in ((x, y), (x[:40], y[:40]), (x, y), (x[:40], y[:40])):  # epochs ending with a smaller batch
        model.zero_grad(), twin.zero_grad()
        (loss_a, rng_a), (loss_e, rng_e) = _step(model, xs, ys), _step(twin, xs, ys)
        assert torch.equal(loss_a, loss_e) and torch.equal(rng_a, rng_e)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), twin.buffers()))
    small = hcv.measure(model, x[:40], lambda out: nn.functional.cross_entropy(out, y[:40]), repeats=1)
    assert small.peak_bytes <= simulate(chain, schedule).peak_memory
    assert sorted(key for key, _ in vars(model)["_hcv_applied"].executors) == [(), ("batch=40",)]


def test_a_model_changed_after_applying_or_profiling_is_refused():
    model, x, y = _model()
    hcv.apply(model, SCHEDULES["optimal_mid"])
    _step(model, x, y)
    model[4] = nn.Linear(32, 32)  # a layer replaced after applying
    with pytest.raises(ScheduleMismatch, match="changed after the schedule was applied"):
        _step(model, x, y)
    # Changed between profiling and applying: a traced model keeps its old stages, which would run without the new
    # parameters (as LoRA adapters added after profiling).
    net, inp = _Pair(), {"a": torch.randn(4, 8), "b": torch.randn(4, 8)}
    chain = hcv.profile(net, inp, warmup=0, repeats=1, progress=False)
    net.extra = nn.Parameter(torch.zeros(8))
    with pytest.raises(ScheduleMismatch, match="extra"):
        hcv.apply(net, strategies.store_all(chain), sample=inp)


class _Pair(nn.Module):
    """A custom forward with two keyword inputs (traced into stages)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))

    def forward(self, a: torch.Tensor, b: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        h = a if b is None else a + b
        for layer in self.layers:
            h = layer(h)
        return h * scale


def test_keywords_and_the_dict_are_the_same_structure_other_structures_are_refused():
    net, inp = _Pair(), {"a": torch.randn(4, 8), "b": torch.randn(4, 8)}
    twin = copy.deepcopy(net)
    chain = hcv.profile(net, inp, warmup=0, repeats=1, progress=False)
    hcv.apply(net, solve(chain).schedule(solve(chain).min_budget), chain=chain)
    grads = []
    for call in (lambda m: m(**inp), lambda m: m(inp), lambda m: m(inp["a"], b=inp["b"]),
                 lambda m: m(**inp, scale=1.0)):  # a default value passed explicitly is no difference
        net.zero_grad()
        call(net).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    twin(**inp).pow(2).sum().backward()
    for g in grads:
        assert all(torch.equal(a, p.grad) for a, p in zip(g, twin.parameters()))
    with pytest.raises(InputMismatch, match="b: profiled, missing"):
        net(a=inp["a"])
    with pytest.raises(InputMismatch, match="scale"):
        net(**inp, scale=2.0)
    with pytest.raises(InputMismatch, match="cannot take this call"):
        net(**inp, c=inp["a"])
    # A smaller batch of the same structure is traced again and trains as the plain model; a mixed one is refused
    net.zero_grad(), twin.zero_grad()
    net(a=inp["a"][:3], b=inp["b"][:3]).pow(2).sum().backward()
    twin(a=inp["a"][:3], b=inp["b"][:3]).pow(2).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), twin.parameters()))
    with pytest.raises(InputMismatch, match="called with \\[3, 8\\]"):
        net(a=inp["a"][:3], b=inp["b"])


@pytest.mark.parametrize("native", [False, True], ids=["executor", "native"])
def test_an_applied_model_is_saved_whole_and_loaded_trains_the_same(native):
    import io

    net, inp = _Pair(), {"a": torch.randn(4, 8), "b": torch.randn(4, 8)}  # traced stages: not picklable themselves
    chain = hcv.profile(net, inp, warmup=0, repeats=1, progress=False)
    hcv.apply(net, solve(chain).schedule(solve(chain).min_budget), chain=chain, native=native)
    net(**inp).pow(2).sum().backward()
    net.zero_grad()
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert vars(loaded)["_hcv_applied"].model is loaded and vars(loaded)["forward"]._state.model is loaded
    for m in (net, loaded):
        m(**inp).pow(2).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), loaded.parameters()))
    with pytest.raises(InputMismatch, match="missing"):
        loaded(a=inp["a"])  # the profiled structure came along
    hcv.remove(loaded)
    assert "forward" not in vars(loaded)


def test_torch_compile_of_a_model_applied_by_the_executor_says_to_use_native():
    model, x, _ = _model()
    hcv.apply(model, SCHEDULES["optimal_low"])
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(hcv.HChainError, match="native=True"):
        compiled(x)


# ---------------------------------------------------------------------------------------------- Hugging Face
def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 16))
    return model, {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.long), "labels": ids}


def test_hf_model_keeps_config_save_pretrained_generate_and_refuses_double_checkpointing(tmp_path, capsys):
    model, batch = _gpt2()
    plain = copy.deepcopy(model)
    hcv.checkpoint(model, batch, budget="250KiB", progress=False)
    torch.save(model, tmp_path / "whole.pt")  # the refusing methods pickle too (torch.save(model))
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    with pytest.raises(DoubleCheckpointing):
        loaded.gradient_checkpointing_enable()
    said = capsys.readouterr().out
    assert "GPT2LMHeadModel" in said and "predicted activation peak" in said and "vs store-all" in said
    assert re.search(r"activation budget 250 KiB: [1-9]\d* recomputed forwards", said), said
    assert model.config.n_layer == 2 and inspect.signature(model.forward) == inspect.signature(plain.forward)
    model.save_pretrained(tmp_path / "pretrained")
    assert sorted(p.name for p in (tmp_path / "pretrained").iterdir()) == ["config.json", "generation_config.json",
                                                           "model.safetensors"]
    model.eval()
    torch.manual_seed(0)
    out = model.generate(batch["input_ids"][:, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(out, plain.eval().generate(batch["input_ids"][:, :4], max_new_tokens=3, do_sample=False))
    model.train()
    with pytest.raises(DoubleCheckpointing, match="gradient_checkpointing"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()
    with pytest.raises(DoubleCheckpointing):
        model.activation_checkpointing_enable()
    hcv.remove(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()  # HF's own again, after remove
        with pytest.raises(DoubleCheckpointing, match="already checkpoints"):
            hcv.apply(model, hcv.Schedule.parse(" ".join(f"Fall{i}" for i in range(4)) + " Loss "
                                                + " ".join(f"B{i}" for i in reversed(range(4)))))


def test_native_form_refuses_a_schedule_that_is_no_tree_before_installing_anything():
    """The segment tree itself is tested torch-free in tests/test_regions.py."""
    offload = hcv.Schedule.parse("Fall0 Off0 Fall1 Loss B1 Pre0 B0")
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with pytest.raises(NotNative, match="without native=True"):
        hcv.apply(model, offload, native=True)
    assert "forward" not in vars(model)  # refused before anything was installed


def test_checkpoint_one_liner_budgets(capsys):
    model, x, y = _model()
    with pytest.raises(hcv.HChainError, match="optimizer="):
        hcv.checkpoint(model, x, device_memory="1GiB", progress=False)
    with pytest.raises(hcv.HChainError, match="not both"):
        hcv.checkpoint(model, x, budget="1MiB", device_memory="1GiB", progress=False)
    hcv.checkpoint(model, x, progress=False)  # a CPU model and no budget: store-all, and it says so
    assert "store-all" in capsys.readouterr().out
    assert vars(model)["_hcv_applied"].schedule.n_recomputed == 0
    with pytest.raises(AlreadyApplied):
        hcv.checkpoint(model, x, progress=False)
    hcv.remove(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hcv.checkpoint(model, x, device_memory="64MiB", optimizer=opt, progress=False, verbose=False)
    assert capsys.readouterr().out == ""
    _step(model, x, y)


def test_verify_measures_the_step_and_scales_the_budget_until_the_fastest_fits(capsys):
    """checkpoint(..., verify=True) measures the applied model's step and applies the schedule for the budget scaled
    by budget / measured: lower above it, higher below it; it keeps the fastest that measured within the budget, and
    when nothing fits it raises and leaves the model plain. Driven here by the executor (no compile), from store-all
    measured over a budget set below it, and from the least schedule with room above it."""
    import functools

    from hchain_viz.runtime.train.auto import _verified

    model, x, y = _model(width=256, batch=512)
    loss_fn = nn.CrossEntropyLoss()
    loss = lambda out: loss_fn(out, y)  # noqa: E731
    chain = hcv.profile(model, x, loss, warmup=0, repeats=1, progress=False)
    sol = solve(chain)
    put = functools.partial(hcv.apply, model, chain=chain, sample=x)
    store_all = hcv.measure(model, x, loss, repeats=1).peak_bytes
    limit = (sol.min_budget + store_all) // 2
    put(strategies.store_all(chain))
    schedule, measured = _verified(model, x, loss, limit, sol.schedule, put, verbose=True)
    said = capsys.readouterr().out.splitlines()
    assert "with 0 recomputed forwards (above" in said[0] and any("(within" in line for line in said[1:]), said
    assert len(said) <= 4 and vars(model)["_hcv_applied"].schedule is schedule and schedule.n_recomputed > 0
    kept = f"peak {hcv.format_bytes(measured)} with {schedule.n_recomputed} recomputed forwards (within"
    assert measured <= limit and any(kept in line for line in said)
    assert hcv.measure(model, x, loss, repeats=1).peak_bytes <= limit
    hcv.remove(model)
    put(sol.schedule(sol.min_budget))  # room above it: raised to store-all, which fits
    assert _verified(model, x, loss, store_all + 1024, sol.schedule, put, verbose=False)[0].n_recomputed == 0
    hcv.remove(model)
    put(strategies.store_all(chain))
    with pytest.raises(hcv.InfeasibleBudget, match="left as it was; give a larger budget"):
        _verified(model, x, loss, sol.min_budget // 2, sol.schedule, put, verbose=False)  # nothing fits the lowered
    assert "_hcv_applied" not in vars(model)


def test_checkpoint_verify_compiled_whole_fits_its_budget_measured(capsys):
    """The native form compiled with inductor, verified: what checkpoint leaves applied measures, compiled, within
    the budget, and it said so."""
    from hchain_viz.runtime.models import demo_model

    model, x, loss_fn = demo_model("nanogpt", batch=4, seq=64, dim=32, heads=2, layers=2, vocab=64, dropout=0.1)
    chain = hcv.profile(model, x, loss_fn, warmup=0, repeats=1, progress=False)
    sol = solve(chain)
    budget = (2 * sol.min_budget + sol.store_all_peak) // 3
    hcv.checkpoint(model, x, budget=budget, loss_fn=loss_fn, native=True, verify=True, progress=False)
    said = capsys.readouterr().out
    assert "measured compiled step peak" in said and f"(within {hcv.format_bytes(budget)})" in said, said
    assert ", measured " in said.splitlines()[-1]  # the summary gives the measured peak of what stays applied
    torch._dynamo.reset()
    assert hcv.measure(torch.compile(model), x, loss_fn, repeats=1).peak_bytes <= budget


def test_compiled_form_is_single_level_and_for_compile_fits_its_budget():
    """What torch.compile runs for a native schedule (core/regions.py, NOTE [compiled memory]): nested regions
    collapse into their top-level regions; the gradients held to the end of the backward count in its peak."""
    from hchain_viz.core.regions import compiled_peak, compiled_schedule, compiled_tree, for_compile
    from hchain_viz.core.simulate import simulate
    from hchain_viz.runtime.train.native import grad_bytes

    nested = hcv.Schedule.parse("Fck0 Fn1 Fn2 Fall3 Loss B3 Fck0 Fn1 Fall2 B2 Fall0 Fall1 B1 B0")
    flat = compiled_schedule(nested)
    assert str(flat) == str(hcv.Schedule.parse("Fck0 Fn1 Fn2 Fall3 Loss B3 Fall0 Fall1 Fall2 B2 B1 B0"))
    assert compiled_tree(segment_tree(flat)) == segment_tree(flat) and compiled_schedule(flat) is flat
    assert flat.single_level and not nested.single_level  # stage 1 forwarded three times in the nested tree
    shared = nn.Linear(4, 4)
    assert grad_bytes([shared, nn.Linear(4, 2), shared]) == [0, 40, 80]  # shared: counted at its last stage
    for seed in range(4):
        chain = Chain.random(8, seed=seed)
        sol = solve(chain)
        one = solve(chain, single_level=True)
        # down to the single-level optimum's least budget (below it only nested schedules fit, which collapse)
        assert for_compile(sol, one.min_budget, [0] * 8).single_level
        grads = [int(g) for g in np.random.default_rng(seed).integers(0, max(chain.x), 8)]
        for budget in np.linspace(sol.min_budget, sol.store_all_peak, 6).astype(int):
            s = sol.schedule(int(budget))
            c = compiled_schedule(s)
            simulate(chain, c)  # a valid schedule
            assert compiled_peak(chain, s, [0] * 8) == simulate(chain, c).peak_memory
            assert compiled_peak(chain, s, grads) >= simulate(chain, c).peak_memory
            try:
                fit = for_compile(sol, int(budget), grads)
            except hcv.InvalidSchedule:
                assert compiled_peak(chain, sol.schedule(sol.min_budget), grads) > budget
                continue
            assert compiled_schedule(fit) is fit and compiled_peak(chain, fit, grads) <= budget
            if compiled_peak(chain, s, grads) <= budget:  # the DP's own schedule fits compiled: none slower
                assert simulate(chain, fit).makespan <= simulate(chain, c).makespan + 1e-12
            if budget >= one.min_budget and compiled_peak(chain, o := one.schedule(int(budget)), grads) <= budget:
                assert simulate(chain, fit).makespan <= simulate(chain, o).makespan + 1e-12  # nor the single-level


def test_checkpoint_native_with_room_for_store_all_and_its_held_gradients_recomputes_nothing():
    """A budget above the store-all peak plus the gradients the compiled backward holds is store-all in the native
    form too (the budget was capped at the store-all peak, where the held gradients no longer fit, so it recomputed)."""
    from hchain_viz.runtime.models import demo_model

    model, x, loss_fn = demo_model("resnet_chain", batch=2, image=16, width=8, blocks=(1, 2))
    hcv.checkpoint(model, x, budget="1MiB", loss_fn=loss_fn, native=True, progress=False, verbose=False)
    assert vars(model)["_hcv_applied"].schedule.n_recomputed == 0


@pytest.mark.parametrize("native", [False, True], ids=["executor", "native"])
def test_apply_drives_its_executor_only_through_the_written_protocol(monkeypatch, native):
    """The applied state uses nothing of an executor but the protocol (runtime/train/executor.py, Note: [executor
    protocol]): an executor that lets it read nothing else trains the model like eager, a mode change included."""
    from hchain_viz.runtime.train import inplace
    from hchain_viz.runtime.train.executor import StepRunner

    protocol = set(StepRunner.__annotations__) | {n for n in vars(StepRunner) if not n.startswith("_")}
    assert protocol == {"length", "stages", "bind", "ensure_stages", "train_step", "forget_draws"}
    used: set[str] = set()

    class OnlyProtocol:
        def __init__(self, inner):
            self.__dict__["inner"] = inner

        def __getattr__(self, name):
            assert name in protocol, f"the applied state read {name!r} of its executor"
            used.add(name)
            return getattr(self.__dict__["inner"], name)

        def __setattr__(self, name, value):
            raise AssertionError(f"the applied state set {name!r} of its executor")

    name = "NativeSchedule" if native else "Executor"
    real = getattr(inplace, name)
    monkeypatch.setattr(inplace, name, lambda *args, **kwargs: OnlyProtocol(real(*args, **kwargs)))
    model, x, y = _model()
    twin = copy.deepcopy(model)
    hcv.apply(model, SCHEDULES["optimal_mid"], native=native)
    for step in range(3):
        if step == 2:  # dropout off in one submodule: the executor forgets which stages draw
            model[3].eval(), twin[3].eval()
        (loss_a, rng_a), (loss_e, rng_e) = _step(model, x, y), _step(twin, x, y)
        assert torch.equal(loss_a, loss_e) and torch.equal(rng_a, rng_e)
    assert {"stages", "train_step", "forget_draws"} <= used
