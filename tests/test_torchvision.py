"""Real torchvision (and timm) models end to end: extract the chain, profile, solve, and train one step by an
optimal schedule with gradients bitwise equal to eager PyTorch.

torchvision cannot import beside the CPU torch wheel of the README's environment, so these tests skip there; the
second stage of ``.ci/run`` runs them in a separate environment with ``torch==2.14.1 torchvision==0.29.1``.
Inputs are small (2 images of 32-64 pixels) to keep the stage within minutes on a CPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import hchain_viz as hcv  # noqa: E402
from hchain_viz.core.solver import least_budget, store_all_peak  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _import(name: str):
    try:
        return __import__(name)
    except Exception as exc:  # PyPI's torchvision fails at import beside a CPU-only torch build
        pytest.skip(f"{name} unavailable: {type(exc).__name__}: {exc}")


def _trains_like_eager(model, x):
    """Profile, solve at a budget between the least and store-all, train one step by it: same grads as eager."""
    loss_fn = lambda out: out.float().pow(2).mean()  # noqa: E731
    chain = hcv.profile(model, x, loss_fn, warmup=0, repeats=1, progress=False)
    # between the least budget the table resolves (the exact least one can lie within a slot's rounding of the
    # store-all peak: on a small resnet18 the whole range is under 1 MiB of an 86 MB peak) and store-all
    sol = hcv.solve(chain)
    assert least_budget(chain) <= sol.min_budget <= store_all_peak(chain) == sol.store_all_peak
    schedule = sol.schedule((sol.min_budget + sol.store_all_peak) // 2)
    twin = copy.deepcopy(model)
    torch.manual_seed(3)
    loss_fn(hcv.wrap(model, schedule)(x)).backward()
    torch.manual_seed(3)
    loss_fn(twin(x)).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name
    return chain, schedule


# name -> (constructor kwargs, image side, least number of stages)
TORCHVISION = {
    "resnet18": ({}, 32, 10),
    "densenet121": ({}, 32, 10),
    "mobilenet_v3_small": ({}, 32, 10),
    "vit_b_16": ({"image_size": 32}, 32, 12),
    "swin_t": ({}, 64, 8),
    "squeezenet1_0": ({}, 64, 5),  # its layout is not the VGG-like one its attributes suggest: graph extraction
}


@pytest.mark.parametrize("name", list(TORCHVISION))
def test_torchvision_model_trains_by_an_optimal_schedule(name):
    torchvision = _import("torchvision")
    kwargs, side, least = TORCHVISION[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs)
    chain, schedule = _trains_like_eager(model, torch.randn(2, 3, side, side))
    assert chain.length >= least, chain.names
    assert schedule.n_recomputed > 0


@pytest.mark.parametrize("name, kwargs", [("resnet18", {}), ("vit_tiny_patch16_224", {"img_size": 32})])
def test_timm_model_trains_by_an_optimal_schedule(name, kwargs):
    timm = _import("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    chain, _ = _trains_like_eager(model, torch.randn(2, 3, 32, 32))
    assert chain.length >= 8, chain.names
