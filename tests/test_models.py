"""runtime/models.py: the demo models build deterministically, train, and are what the demos need them to be."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import hchain_viz as hcv  # noqa: E402
from hchain_viz.errors import HChainError  # noqa: E402
from hchain_viz.runtime import models  # noqa: E402
from hchain_viz.runtime.profile import profile  # noqa: E402
from hchain_viz.runtime.stages import sequentialize  # noqa: E402

pytestmark = pytest.mark.torch


SMALL = {
    "resnet_chain": dict(batch=2, image=16, width=4, blocks=(1, 1)),
    "transformer_chain": dict(batch=2, seq=8, dim=16, heads=2, layers=2, vocab=11),
    "mlp_chain": dict(batch=4, in_features=8, widths=(16, 4), classes=3),
    "resnet_skip": dict(batch=2, image=16, width=4, blocks=(1, 1)),
    "nanogpt": dict(batch=2, seq=8, vocab=11, dim=16, heads=2, layers=2),
}


@pytest.mark.parametrize("name", list(models.DEMOS))
def test_demo_trains_with_a_real_output_gradient(name):
    model, x, loss_fn = models.demo_model(name, **SMALL[name])
    out = model(x)
    out.retain_grad()
    loss = loss_fn(out)
    assert loss.dim() == 0 and loss.requires_grad
    loss.backward()
    assert out.grad is not None and out.grad.stride() == out.contiguous().stride()  # dense, not an expanded scalar
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", list(models.DEMOS))
def test_demo_is_seeded_and_leaves_global_rng_alone(name):
    rng = torch.get_rng_state()
    m1, x1, _ = models.demo_model(name, seed=3, **SMALL[name])
    assert torch.equal(rng, torch.get_rng_state())
    m2, x2, _ = models.demo_model(name, seed=3, **SMALL[name])
    m3, x3, _ = models.demo_model(name, seed=4, **SMALL[name])
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1) and torch.equal(x1, x2)
    assert not all(torch.equal(s1[k], s3[k]) for k in s1)


@pytest.mark.parametrize("name, kind", [("resnet_chain", "sequential"), ("transformer_chain", "sequential"),
                                        ("mlp_chain", "sequential"), ("resnet_skip", "module")])
def test_demo_structure_is_what_sequentialize_expects(name, kind):
    model, x, _ = models.demo_model(name, **SMALL[name])
    assert isinstance(model, nn.Sequential) == (kind == "sequential")
    stages = sequentialize(model, x)
    model.eval()
    h = x
    with torch.no_grad():
        for _, stage in stages:
            h = stage(h)
        assert torch.allclose(h, model(x), atol=1e-6)


def test_stage_names():
    names = lambda n: [s for s, _ in sequentialize(models.demo_model(n, **SMALL[n])[0])]
    assert names("resnet_chain") == ["stem", "layer1.0", "layer2.0", "avgpool", "flatten", "fc"]
    assert names("transformer_chain") == ["embed", "blocks.0", "blocks.1", "head"]
    assert names("mlp_chain") == ["fc1", "fc2", "head"]


def test_resnet_skip_has_skip_connections_in_its_own_forward():
    model, x, _ = models.resnet_skip(**SMALL["resnet_skip"])
    assert type(model).forward is not nn.Sequential.forward
    block = model.layer2[0]
    assert block.downsample is not None  # the shape-changing block has a projected shortcut
    # Zeroing the residual branch leaves the shortcut: the block's output is then relu(downsample(x)).
    with torch.no_grad():
        block.bn2.weight.zero_()
        block.bn2.bias.zero_()
        h = torch.randn(2, 4, 8, 8)
        block.eval()
        assert torch.allclose(block(h), torch.relu(block.downsample(h)))


def test_default_demo_is_heterogeneous():
    """Stage times and activation sizes vary by more than 4x, so optimal and uniform checkpointing differ."""
    assert models.DEFAULT_DEMO == "resnet_chain"
    model, x, loss_fn = models.demo_model()
    chain = profile(model, x, loss_fn, warmup=1, repeats=1, progress=False)
    sizes = chain.x[:-1]
    assert max(sizes) > 4 * min(sizes)
    assert max(chain.fwd_time) > 4 * min(chain.fwd_time)
    assert max(chain.xbar) > 4 * min(chain.xbar)


def test_models_is_the_lazy_public_attribute():
    assert hcv.models is models
    assert set(models.DEMOS) == {"resnet_chain", "transformer_chain", "mlp_chain", "resnet_skip", "nanogpt"}


def test_unknown_demo():
    with pytest.raises(HChainError, match="resnet_chain"):
        models.demo_model("vit_huge")


@pytest.mark.parametrize("name", ["transformer_chain", "nanogpt"])
@pytest.mark.parametrize("heads", [3, 0])
def test_heads_must_divide_dim(name, heads):
    with pytest.raises(HChainError, match="multiple of heads"):
        models.demo_model(name, **{**SMALL[name], "heads": heads})


def test_unknown_demo_option_names_the_accepted_ones():
    with pytest.raises(HChainError, match=r"no option\(s\) widht.*width"):
        models.demo_model("resnet_chain", widht=8)
