"""runtime/profile.py: sizes against hand counts, the model left untouched, predictions against measurements."""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import hchain_viz as hcv  # noqa: E402
from hchain_viz.core import strategies  # noqa: E402
from hchain_viz.core.chain import Chain  # noqa: E402
from hchain_viz.errors import HChainError, NotSequentialError, ProfileError  # noqa: E402
from hchain_viz.runtime import models  # noqa: E402
from hchain_viz.runtime.measure import default_loss, measure  # noqa: E402
from hchain_viz.runtime.profile import BACKWARD_SLACK, profile  # noqa: E402

pytestmark = pytest.mark.torch
F32 = 4
LOSS = 8  # the loss and the gradient its backward starts from (float32 scalars), held beside the output (in x[L])



def quick(model, x, loss_fn=None, **kw):
    return profile(model, x, loss_fn, warmup=0, repeats=1, progress=False, **kw)


class Pair(nn.Module):
    """Returns a tuple whose two tensors share one storage."""

    def forward(self, x):
        y = x * 2
        return y, y[:, :3]


class Two(nn.Module):
    """Takes a tuple, returns a tuple of two distinct tensors."""

    def forward(self, t):
        a, b = t
        return a[:, :3] + b, a * 3


class Join(nn.Module):
    def forward(self, t):
        return t[0].sum(1, keepdim=True) + t[1][:, :3]


# ---------------------------------------------------------------------------------------------- sizes by hand
def test_linear_relu_and_tuple_stages_by_hand():
    B = 4
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(lin=nn.Linear(16, 32), relu=nn.ReLU(), lin2=nn.Linear(32, 32), pair=Pair(),
                                      two=Two(), join=Join()))
    chain = quick(model, torch.randn(B, 16))
    assert isinstance(chain, Chain) and chain.names == ("lin", "relu", "lin2", "pair", "two", "join")
    act = B * 32 * F32
    # x[L]: the output, the loss and its backward's starting gradient, held by the caller to the end of the step
    assert chain.x == (B * 16 * F32, act, act, act, act, B * 3 * F32 + act, B * 3 * F32 + LOSS)
    # Linear saves its input (x_i, resident anyway) and its weight (a parameter): only the output is new.
    # ReLU saves its output. Pair's two tensors share one storage. Two returns 48 + 512 bytes.
    # `x * 2` and `a * 3` also keep their scalar, wrapped as an 8-byte tensor that no saved-tensor hook sees.
    assert chain.xbar == (act, act, act, act + 8, B * 3 * F32 + act + 8, B * 3 * F32 + LOSS)
    # `x * 2` wraps the Python scalar in a tensor (8 bytes, kept: above) and casts it to float32 (4 transient bytes),
    # which the allocator sees (memory is measured from its log of allocations and frees).
    assert chain.fwd_tmp[:5] == (0, 0, 0, 4, 4)
    # lin2's backward holds, above the resident set: the input gradient (x[2]), the fresh weight and bias gradients
    # (added in place into .grad afterwards); bwd_tmp is what exceeds the input gradient, plus the fixed slack for
    # autograd's own small allocations.
    assert chain.bwd_tmp[2] == (32 * 32 + 32) * F32 + BACKWARD_SLACK
    assert chain.bwd_tmp[1] == BACKWARD_SLACK  # ReLU's backward creates only the input gradient


def test_conv_batchnorm_flatten_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(800, 5))
    x = torch.randn(2, 3, 10, 10)
    act = 2 * 8 * 10 * 10 * F32
    chain = quick(model, x)
    assert chain.x == (2 * 3 * 100 * F32, act, act, act, act, 2 * 5 * F32 + LOSS)
    # Conv saves input and weight; BatchNorm (training) saves its input plus per-channel mean and inverse std;
    # Flatten is a view: its output is its input's storage, counted as the output, nothing more.
    assert chain.xbar == (act, act + 2 * 8 * F32, act, act, 2 * 5 * F32 + LOSS)
    # The no-grad forward still computes batch statistics, then drops them: with the per-channel temporaries of the
    # running-statistics update, four per-channel vectors are alive at once. The recording forward saves two of them
    # (in x̄): two more above what it leaves.
    assert chain.nograd_tmp[1] == 4 * 8 * F32 and chain.fwd_tmp[1] == 2 * 8 * F32
    assert chain.fwd_tmp[3] == 0 and chain.bwd_tmp[3] == BACKWARD_SLACK
    assert chain.bwd_tmp[4] == (800 * 5 + 5) * F32 + BACKWARD_SLACK
    model.eval()  # BatchNorm in eval mode saves no statistics
    assert quick(model, x).xbar[1] == act


def test_meta_records_the_setting():
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8))
    x = torch.randn(3, 16)
    chain = quick(model, x)
    params = (16 * 8 + 8 + 8 * 8 + 8) * F32
    assert chain.meta["param_bytes"] == 2 * params  # parameters and their gradients
    assert chain.meta["device"] == "cpu" and chain.meta["dtype"] == "float32"
    assert chain.meta["model"] == "Sequential" and chain.meta["input_shape"] == [3, 16]
    assert chain.meta["torch"] == torch.__version__
    assert Chain.from_json(chain.to_json()).meta == chain.meta  # JSON-serialisable
    # a backward's share can be all call cost on stages this small (see chain.backward_call), never negative
    assert all(t > 0 for t in chain.fwd_time) and all(t >= 0 for t in chain.bwd_time)
    assert chain.store_all_time > sum(chain.fwd_time)


def test_list_of_pairs_and_public_name():
    stages = [("a", nn.Linear(4, 4)), ("b", nn.Tanh())]
    chain = hcv.profile(stages, torch.randn(2, 4), warmup=0, repeats=2, progress=False)
    assert chain.names == ("a", "b") and chain.length == 2


# ---------------------------------------------------------------------------------------------- model state
def test_profile_leaves_model_exactly_as_found():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Dropout(0.5),
                          nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    model[5].eval()  # mixed training flags must survive
    model[0].weight.grad = torch.ones_like(model[0].weight)
    grad = model[0].weight.grad
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    x_before = x.detach().clone()

    profile(model, x, warmup=1, repeats=2, progress=False)

    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # params and BatchNorm stats
    assert model[0].weight.grad is grad and bool((grad == 1).all())
    assert model[0].bias.grad is None and model[5].weight.grad is None
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(rng, torch.get_rng_state())
    assert x.grad is None and torch.equal(x.detach(), x_before)


# ---------------------------------------------------------------------------------------------- predicted vs measured
@pytest.mark.parametrize("name", list(models.DEMOS))
def test_store_all_prediction_matches_measured_peak(name):
    model, x, loss_fn = models.demo_model(name)
    chain = profile(model, x, loss_fn, warmup=0, repeats=1, progress=False)
    predicted = hcv.simulate(chain, strategies.store_all(chain)).peak_memory
    measured = measure(model, x, loss_fn, repeats=1).peak_bytes
    ratio = predicted / measured
    print(f"{name}: predicted {hcv.format_bytes(predicted)} / measured {hcv.format_bytes(measured)} = {ratio:.3f}")
    assert 0.9 <= ratio <= 1.1


class Split(nn.Module):
    """Hands on q, k, v as strided views of one projection's output, per head, as attention stages do: (batch 2,
    heads 2, tokens 8, 16) views of a (2, 8, 96) tensor."""

    def forward(self, x):
        return tuple(t.view(2, 8, 2, 16).transpose(1, 2) for t in x.view(2, 8, 96).split(32, dim=-1))


class Scores(nn.Module):
    """q @ k^T of strided views: the matmul copies them contiguous, and autograd saves the copies."""

    def forward(self, t):
        q, k, v = t
        return q @ k.transpose(-2, -1), v


def test_stage_inputs_keep_their_layout():
    """A stage receives views of one storage as in the chain (strided, sharing it), so what its ops copy and save is
    counted: here the two contiguous copies of q and k (8 x 16 floats each) that the matmul saves, and not v."""
    model = nn.Sequential(Split(), Scores())
    x = torch.randn(2, 8 * 96, requires_grad=True)
    chain = quick(model, x, lambda out: out[0].sum() + out[1].sum())
    out = 2 * 2 * 8 * 8 * F32
    copies = 2 * 2 * 2 * 8 * 16 * F32
    assert chain.x[1] == x.numel() * F32  # q, k, v: one storage, counted once
    # scores, v (the projection it views), the saved copies, and the loss (x̄_L contains x_L)
    assert chain.xbar[1] == out + x.numel() * F32 + copies + LOSS
    measured = measure(model, x, lambda out: out[0].sum() + out[1].sum(), repeats=1).peak_bytes
    assert measured <= hcv.simulate(chain, strategies.store_all(chain)).peak_memory


class _Scores(nn.Module):
    """Returns y = W x: the backward of a Linear saves its input x, not its output y."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Shift(nn.Module):
    """2 y + 1 saves nothing of y (nor does the Linear after it save 2 y + 1's input): y is transit."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.lin(y * 2 + 1)


def _check_schedules(model, x, chain, schedules, *, lowest):
    """Each schedule, run by the executor: measured peak within [lowest, 1] of its prediction, and gradients equal
    to eager training's, bit for bit."""
    from hchain_viz.runtime.train.wrap import wrap

    eager = copy.deepcopy(model)
    default_loss(eager(x)).backward()
    for s in schedules:
        wrapped = wrap(model, s)
        measured = measure(wrapped, x, repeats=1).peak_bytes
        predicted = hcv.simulate(chain, s).peak_memory
        assert lowest * predicted <= measured <= predicted, (s.meta.get("strategy"), measured, predicted)
        model.zero_grad(set_to_none=True)
        default_loss(wrapped(x)).backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_transit_bytes_are_found_freed_and_predicted(monkeypatch):
    """docs/design.md §3.4: x_1 = W x_0 is needed by no backward; the profile says so (transit[1] = its bytes), the
    executor frees it after Fall(1) (store-all's measured peak is that much lower than with it held), every
    schedule's measured peak stays within its prediction, and the gradients equal eager training's."""
    from hchain_viz.runtime.train import executor as executor_module
    from hchain_viz.runtime.train.wrap import wrap

    torch.manual_seed(0)
    model = nn.Sequential(_Scores(), _Shift(), nn.Linear(64, 1024))  # a wide head: the peak comes after Fall(1)
    x = torch.randn(512, 64)
    chain = profile(model, x, warmup=0, repeats=1, progress=False)
    y_bytes = 512 * 64 * 4
    assert chain.transit == (0, y_bytes, 0, 0)
    _check_schedules(model, x, chain, [strategies.store_all(chain), strategies.recompute_all(chain)], lowest=0.8)
    held = hcv.simulate(chain.__class__.from_dict({**chain.to_dict(), "transit": None}), strategies.store_all(chain))
    assert held.peak_memory - hcv.simulate(chain, strategies.store_all(chain)).peak_memory == y_bytes
    freed = measure(wrap(model, strategies.store_all(chain)), x, repeats=1).peak_bytes
    monkeypatch.setattr(executor_module._Step, "_free_transit", lambda *args: set())  # the step that learns frees
    monkeypatch.setattr(executor_module._Step, "_free_known", lambda *args: None)  # and the steps that know
    kept = measure(wrap(model, strategies.store_all(chain)), x, repeats=1).peak_bytes
    assert kept - freed == y_bytes


class _Widen(nn.Module):
    """2 W x: the product by 2 saves nothing, so the wide output is needed only by the next stage's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


class _Spread(nn.Module):
    """A stage that saves nothing large but whose forward holds 8 MiB for a moment (a wide repeat, averaged back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, 64).view(-1, 64, 64).mean(1)


def test_consumed_bytes_are_found_freed_and_predicted(monkeypatch):
    """docs/design.md §3.4: x_3 = 2 W x_2 is needed only by B(3) (the Linear after it saves it); the profile says so
    (consumed[3] = its bytes; consumed[1], consumed[2]: the Linears' outputs likewise). This schedule recomputes x_1
    between B(3) and B(2), so the two backwards run apart: the executor frees x_3 after B(3), before that wide
    recomputation, as the model charges it (without, the step measures 2 MiB above its prediction). Under store-all
    the backwards run as one and autograd frees x_3 itself. Every schedule measures within its prediction, and the
    gradients equal eager training's."""
    from hchain_viz.runtime.train import executor as executor_module
    from hchain_viz.runtime.train.wrap import wrap

    torch.manual_seed(0)
    model = nn.Sequential(_Spread(), nn.Linear(64, 64), _Widen(), nn.Linear(1024, 64), nn.Linear(64, 16))
    x = torch.randn(512, 64)
    chain = profile(model, x, warmup=0, repeats=1, progress=False)
    wide, narrow = 512 * 1024 * 4, 512 * 64 * 4
    assert chain.consumed == (0, narrow, narrow, wide, narrow, 0) and chain.transit == (0,) * 6
    apart = hcv.Schedule.parse("Fck0 Fn1 Fall2 Fall3 Fall4 Loss B4 B3 Fck0 B2 Fall1 B1 Fall0 B0")
    assert str(hcv.simulate(chain, apart).events[8].op) == "Fck0"  # the peak: the recomputation between B3 and B2
    assert hcv.simulate(chain, apart).peak_index == 8
    _check_schedules(model, x, chain, [strategies.store_all(chain), strategies.recompute_all(chain), apart],
                     lowest=0.9)
    monkeypatch.setattr(executor_module._Step, "_free_consumed", lambda *args: None)
    kept = measure(wrap(model, apart), x, repeats=1).peak_bytes
    assert kept - hcv.simulate(chain, apart).peak_memory > wide * 0.9


class _Broadcast(nn.Module):
    """Hands on a broadcast view: 4 rows that share one row's storage (as repeat_kv's expand does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, None, :].expand(-1, 4, -1)


def test_gradient_sizes_are_measured():
    """δ_1 is the gradient of a broadcast view, four times the bytes of its storage (x[1]); the input needs no
    gradient, so B(0) makes none (delta[0] = 0); δ_L is the loss's gradient of the output. A store-all step measures
    within its prediction (0.78 of it here: the expanded gradient is summed back into a 64 KiB one as it goes)."""
    from hchain_viz.runtime.train.wrap import wrap

    torch.manual_seed(0)
    model = nn.Sequential(_Broadcast(), nn.Linear(64, 16))
    x = torch.randn(256, 64)
    chain = profile(model, x, warmup=0, repeats=1, progress=False)
    assert chain.x[1] == 256 * 64 * 4 and chain.delta[1] == 4 * chain.x[1]
    assert chain.delta[0] == 0 and chain.delta[2] == chain.x[2] - LOSS == 256 * 4 * 16 * 4
    s = strategies.store_all(chain)
    measured = measure(wrap(model, s), x, repeats=1).peak_bytes
    assert 0.7 * hcv.simulate(chain, s).peak_memory <= measured <= hcv.simulate(chain, s).peak_memory


@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "llama"])
def test_sublayer_predictions_bound_measured_peaks(name):
    """Sub-layer chains (views of qkv, the residual stream handed on, the loss's log-softmax, transit and consumed
    bytes, the gradients of broadcast views): every schedule's measured peak within [0.9, 1.0] of its prediction,
    never above it."""
    from hchain_viz.runtime.graph import extract_stages
    from hchain_viz.runtime.train.wrap import wrap

    if name == "nanogpt":
        model, x, loss_fn = models.nanogpt(batch=2, seq=64, dim=64, heads=4, layers=2)
    else:
        pytest.importorskip("transformers")
        model, x, loss_fn = models.hf_model(name, batch=2, seq=64, layers=2, hidden=64, heads=4, vocab=128,
                                            attn_implementation="eager")
    model.train()
    stages = extract_stages(model, x, granularity="sublayer")
    chain = profile(stages, x, loss_fn, warmup=0, repeats=1, progress=False)
    # the pre-softmax scores cross a cut that neither adjacent backward needs (softmax saves its output)
    probs = [i for i, n in enumerate(chain.names) if n.endswith("attn.probs")]
    assert probs and all(chain.transit[i] > 0 for i in probs)
    # the MLP's hidden activation crosses a cut that only the down-projection's backward needs
    down = [i for i, n in enumerate(chain.names) if n.endswith("mlp.down")]
    assert down and all(chain.consumed[i] > 0 for i in down)
    sol = hcv.solve(chain)
    seq = nn.Sequential(*[m for _, m in stages])
    lo, hi = sol.min_budget, sol.store_all_peak
    schedules = [strategies.store_all(chain), strategies.per_layer(chain), strategies.selective(chain)]
    schedules += [sol.schedule(lo + (hi - lo) * k // 3) for k in range(3)]
    for s in schedules:
        ratio = measure(wrap(seq, s), x, loss_fn, repeats=1).peak_bytes / hcv.simulate(chain, s).peak_memory
        print(f"{name} {s.meta.get('strategy')}: measured / predicted {ratio:.3f}")
        assert 0.9 <= ratio <= 1.0, (s.meta.get("strategy"), ratio)


def test_sublayer_and_module_chains_predict_one_schedule_alike():
    """One per-layer schedule (and store-all) on LLaMA's module chain and on its sub-layer chain: the same run, so
    the same prediction, within 1%, and both at or above the measured peak. The sub-layer chain once predicted more
    (37.0 against 33.0 MiB here at seq 512; 269 against 253 MiB at `bench transformers` sizes), charging twice
    what a part hands on unchanged: the gradients of v and of the residual stream that B(attn.probs) and
    B(attn.context) pass through (``delta_through``), and v itself after B(attn.context), which only that backward
    needs (``consumed_shared``)."""
    from hchain_viz.runtime.graph import extract_stages
    from hchain_viz.runtime.train.wrap import wrap

    pytest.importorskip("transformers")
    model, x, loss_fn = models.hf_model("llama", batch=2, seq=256, layers=2, hidden=64, heads=4, vocab=128,
                                        attn_implementation="eager")
    model.train()
    predicted = {}
    for granularity in ("module", "sublayer"):
        stages = extract_stages(model, x, granularity=None if granularity == "module" else granularity)
        chain = profile(stages, x, loss_fn, warmup=0, repeats=1, progress=False)
        seq = nn.Sequential(*[m for _, m in stages])
        for s in (strategies.per_layer(chain), strategies.store_all(chain)):
            p = predicted[granularity, s.meta["strategy"]] = hcv.simulate(chain, s).peak_memory
            got = measure(wrap(seq, s), x, loss_fn, repeats=1).peak_bytes
            assert 0.97 * p <= got <= p, (granularity, s.meta["strategy"], got, p)
    for strategy in ("per_layer", "store_all"):
        sub, module = predicted["sublayer", strategy], predicted["module", strategy]
        assert abs(sub - module) <= 0.01 * module, (strategy, sub, module)
    probs = [i for i, n in enumerate(chain.names) if n.endswith("attn.probs")]
    assert all(chain.delta_through[i] > 0 for i in probs)  # v's and the residual's gradients pass through
    assert len(chain.consumed_shared) == len(probs)  # v, beside the probabilities, for B(attn.context) only


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["resnet_chain", "mlp_chain"])
def test_store_all_prediction_matches_measured_peak_cuda(name):
    model, x, loss_fn = models.demo_model(name, device="cuda")
    chain = profile(model, x, loss_fn, warmup=1, repeats=2, progress=False)
    assert chain.meta["device"].startswith("cuda") and chain.meta["timer"] == "cuda events"
    predicted = hcv.simulate(chain, strategies.store_all(chain)).peak_memory
    measured = measure(model, x, loss_fn, repeats=2).peak_bytes
    print(f"{name} (cuda): predicted / measured = {predicted / measured:.3f}")
    assert 0.9 <= predicted / measured <= 1.1


# ---------------------------------------------------------------------------------------------- errors
def test_not_a_module():
    with pytest.raises(NotSequentialError, match="nn.Module"):
        quick(42, torch.randn(2))


def test_input_on_another_device_than_the_model():
    model = nn.Sequential(nn.Linear(4, 4)).to("meta")
    with pytest.raises(ProfileError, match="meta") as e:
        quick(model, torch.randn(2, 4))
    assert "x.to(" in str(e.value)
    with pytest.raises(ProfileError, match="meta tensors hold no data"):
        quick(model, torch.randn(2, 4, device="meta"))
    with pytest.raises(ProfileError, match="model.to"):
        quick(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), device="meta")


@pytest.mark.parametrize("empty", [nn.Sequential(), []])
def test_empty_model(empty):
    with pytest.raises(NotSequentialError, match="no modules"):
        quick(empty, torch.randn(2, 4))


def test_model_that_cannot_be_split(monkeypatch):
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + x

    monkeypatch.setitem(sys.modules, "hchain_viz.runtime.graph", None)  # no graph extraction available
    with pytest.raises(NotSequentialError, match=r"\(name, module\)"):
        quick(Custom(), torch.randn(2, 4))


def test_bad_arguments_and_failing_stage():
    model, x = nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)
    with pytest.raises(ProfileError, match="repeats"):
        profile(model, x, repeats=0)
    with pytest.raises(ProfileError, match="warmup"):
        profile(model, x, warmup=-1)
    with pytest.raises(ProfileError, match="scalar"):
        quick(model, x, loss_fn=lambda out: out * 2)
    with pytest.raises(HChainError, match="shape"):
        quick(nn.Sequential(nn.Linear(5, 4)), x)  # wrong input width
    with pytest.raises(ProfileError, match=r"loss_fn\(output\) failed"):
        quick(model, x, loss_fn=lambda out: F.cross_entropy(out, torch.zeros(5, dtype=torch.long)))


# ---------------------------------------------------------------------------------------------- timing spread
def fake_timer(times):
    """A stand-in for measure.timed that runs the function and reports the next of ``times`` (seconds)."""
    it = iter(times * 1000)

    def timed(fn, dev):
        fn()
        return next(it)

    return timed


def test_profile_records_the_spread_of_each_stage(monkeypatch):
    import warnings

    import hchain_viz.runtime.profile as P

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    # every stage: forward 1, 1, 2 ms (median 1 ms, spread (2-1)/2 = 50%), backward a steady 3 ms
    monkeypatch.setattr(P, "CALL_PAIRS", 0)  # no neighbours timed together: the timer's values go to the stages
    monkeypatch.setattr(P, "timed", fake_timer([1e-3, 3e-3, 1e-3, 3e-3, 2e-3, 3e-3]))
    with pytest.warns(hcv.TimingWarning, match=r"varied by ±12% across the 3 repeats \(0 ±50%, 1 ±50%, 2 ±50%\)"):
        chain = profile(model, torch.randn(3, 4), warmup=0, repeats=3, progress=False)
    assert chain.meta["time_spread"] == {"fwd": [0.5] * 3, "bwd": [0.0] * 3}
    assert chain.fwd_time == (1e-3,) * 3 and chain.bwd_time == (3e-3,) * 3
    assert chain.time_spread == pytest.approx(0.5 * 1 / 4)  # forwards are a quarter of the step time
    assert Chain.from_json(chain.to_json()).time_spread == chain.time_spread  # the chain keeps it

    monkeypatch.setattr(P, "timed", fake_timer([1e-3, 3e-3]))  # steady: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steady = profile(model, torch.randn(3, 4), warmup=0, repeats=3, progress=False)
    assert steady.time_spread == 0.0


def test_backward_call_is_measured_on_neighbours_and_left_out_of_each_backward(monkeypatch):
    """Each stage's backward is timed as a call of its own. Two neighbours run backward as one call take less than
    both apart: what a call costs (chain.backward_call, the median over the pairs), which each stage's bwd_time leaves
    out (its share of a joined backward; the simulator charges the call once per group)."""
    import hchain_viz.runtime.profile as P

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ms = 1e-3
    times = [1 * ms, 5 * ms,  # stage 0: forward, backward
             1 * ms, 3 * ms,  # stage 1
             1 * ms, 5 * ms, 1 * ms, 3 * ms, 6.5 * ms,  # stages 0 and 1 apart, then as one call: 1.5 ms less
             1 * ms, 4 * ms,  # stage 2
             1 * ms, 3 * ms, 1 * ms, 4 * ms, 6 * ms]  # stages 1 and 2: 1 ms less
    monkeypatch.setattr(P, "timed", fake_timer(times))
    chain = profile(model, torch.randn(3, 4), warmup=0, repeats=1, progress=False)
    assert chain.meta["backward_call"]["per_pair"] == pytest.approx([1.5 * ms, 1 * ms])
    assert chain.backward_call == pytest.approx(1.25 * ms)
    assert chain.bwd_time == pytest.approx((3.75 * ms, 1.75 * ms, 2.75 * ms))
    assert chain.store_all_time == pytest.approx(3 * ms + 12 * ms - 2 * 1.25 * ms)  # one call, not three
    assert Chain.from_json(chain.to_json()).backward_call == chain.backward_call


def test_backward_call_is_positive_on_small_stages_and_absent_from_estimates():
    """Measured for real: on stages whose own backward is mostly the autograd engine's start, two neighbours joined
    cost less than apart. An estimate for another GPU keeps no measured call cost."""
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    chain = profile(model, torch.randn(4, 16), warmup=2, repeats=5, progress=False)
    assert len(chain.meta["backward_call"]["per_pair"]) == 7 and chain.backward_call > 0
    assert all(b >= 0 for b in chain.bwd_time)
    estimate = profile(model, torch.randn(4, 16), warmup=0, repeats=1, progress=False, estimate_for="H100")
    assert estimate.backward_call == 0.0 and "backward_call" not in estimate.meta


# ---------------------------------------------------------------------------------------------- identical stages
def test_identical_stages_share_their_median_time(monkeypatch):
    """Three copies of one layer measured 1, 2 and 6 ms: each costs the median, 2 ms; the spread stays in the chain;
    the warning only speaks of the stages that sharing does not steady."""
    import warnings

    import hchain_viz.runtime.profile as P

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    # one repeat, no warm-up: stage i gets (fwd, bwd) = the i-th pair. Stage 0 (input without grad) and stage 4
    # (another shape) are not copies of stages 1-3.
    times = [5e-3, 7e-3, 1e-3, 3e-3, 2e-3, 3e-3, 6e-3, 4e-3, 9e-3, 9e-3]
    monkeypatch.setattr(P, "CALL_PAIRS", 0)
    monkeypatch.setattr(P, "timed", fake_timer(times))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copies differ by ±125%, but they are tied: no warning
        chain = profile(model, torch.randn(3, 8), warmup=0, repeats=1, progress=False)
    assert chain.tied == ((1, 2, 3),)
    assert chain.fwd_time == (5e-3, 2e-3, 2e-3, 2e-3, 9e-3) and chain.bwd_time == (7e-3, 3e-3, 3e-3, 3e-3, 9e-3)
    assert chain.copy_spread == (pytest.approx(((6 - 1) / (2 * 2), (4 - 3) / (2 * 3))),)
    assert chain.meta["untied_time"]["fwd"] == pytest.approx([5e-3, 1e-3, 2e-3, 6e-3, 9e-3])
    note = chain.timing_note()
    assert "\n" not in note and "3 identical stages in 1 kind share their median time" in note and "±125%" in note
    again = Chain.from_json(chain.to_json())
    assert again.tied == chain.tied and again.copy_spread == chain.copy_spread and again == chain

    monkeypatch.setattr(P, "timed", fake_timer(times))
    raw = profile(model, torch.randn(3, 8), warmup=0, repeats=1, progress=False, tie_identical=False)
    assert raw.tied == () and raw.fwd_time == (5e-3, 1e-3, 2e-3, 6e-3, 9e-3)


def test_timing_warning_is_one_line_about_untied_stages(monkeypatch):
    import hchain_viz.runtime.profile as P

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    monkeypatch.setattr(P, "CALL_PAIRS", 0)
    monkeypatch.setattr(P, "timed", fake_timer([1e-3, 3e-3, 1e-3, 3e-3, 2e-3, 3e-3]))
    with pytest.warns(hcv.TimingWarning) as rec:
        profile(model, torch.randn(3, 4), warmup=0, repeats=3, progress=False)
    assert len(rec) == 1 and "\n" not in str(rec[0].message) and len(str(rec[0].message)) < 160


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sublayer_copies_of_each_layer_part_are_tied(family):
    pytest.importorskip("transformers")
    from hchain_viz.runtime.graph import extract_stages

    model, x, loss_fn = models.hf_model(family, batch=2, seq=32, layers=3, hidden=64, heads=4, vocab=128,
                                        attn_implementation="eager")
    stages = extract_stages(model, x, granularity="sublayer")
    chain = profile(stages, x, loss_fn, warmup=0, repeats=1, progress=False)
    # one set per part of a layer, with that part of every layer, and nothing else (embedding, head)
    parts = {n.split(".", 2)[-1] for _, a, b in chain.groups for n in chain.names[a:b + 1]}
    assert len(chain.tied) == len(parts) and all(len(t) == 3 for t in chain.tied)
    for t in chain.tied:
        assert len({chain.names[i].split(".", 2)[-1] for i in t}) == 1
        assert len({chain.fwd_time[i] for i in t}) == 1 and len({chain.bwd_time[i] for i in t}) == 1
