"""runtime/measure.py: the measured peak of a real step, in the simulator's terms, and the state it leaves."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import hchain_viz as hcv  # noqa: E402
from hchain_viz.errors import HChainError, ProfileError  # noqa: E402
from hchain_viz.runtime.measure import Measurement, default_loss, measure  # noqa: E402

pytestmark = pytest.mark.torch



def mlp(depth: int, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def test_measurement_fields():
    model, x = mlp(2), torch.randn(8, 64)
    m = measure(model, x, repeats=2)
    assert isinstance(m, Measurement) and hcv.Measurement is Measurement
    assert len(m.step_times) == 2 and m.step_time > 0 and m.device == "cpu"
    assert m.input_bytes == 8 * 64 * 4
    params = sum(p.numel() * 4 for p in model.parameters())
    assert m.baseline_bytes == 2 * params + m.input_bytes  # parameters, their gradients, the input
    assert m.peak_bytes >= m.input_bytes + 2 * 8 * 64 * 4  # x_0 and at least the two layer outputs
    assert "peak" in repr(m)


def test_each_extra_layer_adds_exactly_its_saved_activation():
    """A Linear saves its input; in a store-all eager step every layer output is resident at the start of the
    backward. Adding k layers in front adds exactly k activations to the peak — and nothing else."""
    x = torch.randn(16, 64)
    act = 16 * 64 * 4
    peaks = [measure(mlp(d), x, repeats=1).peak_bytes for d in (2, 3, 5)]
    assert peaks[1] - peaks[0] == act
    assert peaks[2] - peaks[0] == 3 * act


def test_parameter_gradients_are_not_counted():
    model, x = mlp(3), torch.randn(4, 64)
    fresh = measure(model, x, repeats=1).peak_bytes  # .grad is None before
    assert all(p.grad is None for p in model.parameters())  # ... and after
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    grads = [p.grad for p in model.parameters()]
    assert measure(model, x, repeats=1).peak_bytes == fresh
    assert all(p.grad is g and bool((g == 7).all()) for p, g in zip(model.parameters(), grads))


def test_model_state_rng_and_input_are_left_alone():
    torch.manual_seed(1)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 2))
    model[4].eval()
    x = torch.randn(6, 8)
    before_x = x.clone()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    measure(model, x, lambda out: out.square().sum(), repeats=2)
    assert torch.equal(x, before_x)  # the in-place first ReLU ran on a copy
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # incl. BatchNorm statistics
    assert [m.training for m in model] == [True, True, True, True, False]
    assert torch.equal(rng, torch.get_rng_state())


def test_default_loss_has_a_dense_gradient_the_size_of_the_output():
    out = torch.randn(5, 3, requires_grad=True)
    default_loss(out).backward()
    assert torch.allclose(out.grad, 2 * out.detach() / out.numel())
    pair = (torch.randn(2, requires_grad=True), torch.arange(3))  # non-float parts are ignored
    assert default_loss(pair).dim() == 0
    with pytest.raises(ProfileError, match="loss_fn"):
        default_loss(torch.arange(3))


def test_errors():
    model, x = mlp(1), torch.randn(2, 64)
    with pytest.raises(ProfileError, match="nn.Module"):
        measure(lambda t: t, x)
    with pytest.raises(ProfileError, match="meta"):
        measure(mlp(1).to("meta"), x)
    with pytest.raises(ProfileError, match="scalar"):
        measure(model, x, lambda out: out)
    with pytest.raises(ProfileError, match="repeats"):
        measure(model, x, repeats=0)
    with pytest.raises(HChainError, match="no tensor"):
        measure(model, "not a tensor")
    with pytest.raises(ProfileError, match="shape"):
        measure(model, torch.randn(2, 65))  # wrong input width
    with pytest.raises(ProfileError, match=r"loss_fn\(output\) failed"):
        measure(model, x, lambda out: F.cross_entropy(out, torch.zeros(5, dtype=torch.long)))


@pytest.mark.cuda
def test_measure_on_cuda():
    model, x = mlp(3).cuda(), torch.randn(16, 64, device="cuda")
    deeper = mlp(5).cuda()
    m3, m5 = measure(model, x, repeats=2), measure(deeper, x, repeats=2)
    assert m3.device.startswith("cuda") and m3.step_time > 0
    assert m5.peak_bytes - m3.peak_bytes == 2 * 16 * 64 * 4  # blocks of 4 KiB: multiples of 512 bytes


def test_solving_leaves_torch_thread_count_alone():
    """A solve must not touch the process's OpenMP thread count, which PyTorch's CPU ops share (a parallel Numba
    kernel on OpenMP once undid torch.set_num_threads(1), and oneDNN's convolution backward then allocated a
    weight-gradient buffer per thread, beyond every prediction). The solver's threads are plain Python threads."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        hcv.solve(hcv.Chain.random(12, seed=3))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_dict_batch_is_passed_as_keywords_where_forward_takes_them():
    """measure(model, batch) calls model(**batch) as profile and checkpoint do, with the loss from output.loss; a
    module of one argument (hcv.wrap's, a hand-made adapter) still gets the dict itself, and both measure alike."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                                                 n_positions=16))
    ids = torch.randint(0, 64, (2, 16))
    batch = {"input_ids": ids, "labels": ids}

    class Adapter(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, b: dict) -> object:
            return self.inner(**b)

    direct, adapted = measure(model, batch, repeats=1), measure(Adapter(model), batch, repeats=1)
    assert direct.peak_bytes == adapted.peak_bytes > direct.input_bytes
