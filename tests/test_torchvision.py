"""Real torchvision (and timm) models end to end: extract the chain, profile, solve, and train one step by an
optimal schedule with gradients bitwise equal to eager PyTorch.

torchvision cannot import beside the CPU torch wheel of the README's environment, so these tests skip there; the
second stage of ``.ci/run`` runs them in a separate environment with ``torch==2.14.1 torchvision==0.29.1``.
Inputs are small (2 images of 32-64 pixels) to keep the stage within minutes on a CPU.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

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


def _sublayer_sweep(model, x):
    """Sub-layer chain: train one step at four budgets from the least to store-all, gradients bitwise equal to
    eager's, each measured peak at or below its prediction."""
    from torch import nn

    from hchain_viz.runtime.graph import extract_stages
    from hchain_viz.runtime.measure import measure

    loss_fn = lambda out: out.float().pow(2).mean()  # noqa: E731
    model.train()
    chain = hcv.profile(model, x, loss_fn, warmup=0, repeats=1, progress=False, granularity="sublayer")
    stages = extract_stages(model, x, granularity="sublayer")
    seq = nn.Sequential(*[m for _, m in stages])
    sol = hcv.solve(chain)
    lo, hi = sol.min_budget, sol.store_all_peak
    for budget in (lo, lo + (hi - lo) // 3, lo + 2 * (hi - lo) // 3, hi):
        schedule = sol.schedule(budget)
        twin = copy.deepcopy(model)
        torch.manual_seed(3)
        loss_fn(hcv.wrap(seq, schedule)(x)).backward()
        torch.manual_seed(3)
        loss_fn(twin(x)).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), (budget, name)
        model.zero_grad(set_to_none=True)
        measured = measure(hcv.wrap(seq, schedule), x, loss_fn, repeats=1).peak_bytes
        # At or below the prediction, but for one 4 KiB page: timm resnet26 once measured 47,731,032 B against a
        # predicted 47,726,936 B (+4096 B of 45.5 MiB; within it in another run), as test_profile's LLaMA does.
        assert measured <= 1.0001 * hcv.simulate(chain, schedule).peak_memory, budget
    return chain, stages


BOUND_MODELS = ("resnet18", "efficientnet_b0", "convnext_tiny")  # at 4x3x96x96, 10 classes
BOUND_FRACTIONS = (0.0, 0.3, 0.6, 1.0)  # of the range from the least budget to store-all


def _measured_over_predicted(name: str) -> list[tuple[int, float]]:
    """``(budget, measured / predicted peak)`` of one training step through the optimal schedule at each of
    BOUND_FRACTIONS (run here, and in a subprocess by test_the_bound_holds_with_avx2_convolutions)."""
    from hchain_viz.runtime.measure import measure

    torchvision = _import("torchvision")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(torchvision.models, name)(weights=None, num_classes=10)
    x = torch.randn(4, 3, 96, 96)
    loss_fn = lambda out: out.float().pow(2).mean()  # noqa: E731
    chain = hcv.profile(model, x, loss_fn, warmup=0, repeats=1, progress=False)
    sol = hcv.solve(chain)
    lo, hi = sol.min_budget, sol.store_all_peak
    ratios = []
    for budget in (lo + round(f * (hi - lo)) for f in BOUND_FRACTIONS):
        schedule = sol.schedule(budget)
        measured = measure(hcv.wrap(model, schedule), x, loss_fn, repeats=1).peak_bytes
        ratios.append((budget, measured / hcv.simulate(chain, schedule).peak_memory))
    return ratios


@pytest.mark.parametrize("name", BOUND_MODELS)
def test_predicted_peaks_bound_measured_ones(name):
    """From the least budget to store-all, the measured peak of a step is 0.9-1.0x of the predicted one."""
    ratios = _measured_over_predicted(name)
    assert all(0.9 <= r <= 1.0 for _, r in ratios), ratios


def test_the_bound_holds_with_avx2_convolutions():
    """convnext_tiny again with oneDNN held to AVX2 (a process of its own: the ISA is fixed at its first
    convolution). There a convolution's backward wants its output gradient channels-last, as the stage's output
    is, while a joined backward hands it on contiguous from the mean's backward: B(i) copies it, and the profile
    measures B(i) in both layouts (docs/design.md §3)."""
    _import("torchvision")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from test_torchvision import "
            "_measured_over_predicted as m; print(json.dumps(m('convnext_tiny')))")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                          env=dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(ratios) == 4 and all(0.9 <= r <= 1.0 for _, r in ratios), ratios

# name -> (stages at module granularity (the structural chain), stages at "sublayer", names that must appear)
CNN_SUBLAYER = {
    "resnet50": (22, 56, ["stem.conv1", "stem.bn1..relu", "stem.maxpool", "layer1.0.conv1", "layer1.0.downsample",
                          "layer3.2.conv2", "layer4.2.conv3"]),
    "densenet121": (20, 123, ["stem.conv0", "stem.norm0..relu0", "stem.pool0", "denseblock1.denselayer1.conv1",
                              "denseblock2.denselayer5.conv2", "transition3", "denseblock4.denselayer16.conv2"]),
}


@pytest.mark.parametrize("name", list(CNN_SUBLAYER))
def test_torchvision_cnn_blocks_cut_inside_at_sublayer(name):
    """Residual bottlenecks and dense blocks are cut after each convolution (the skip, or the feature maps so far,
    beside the current value), grouped by block, and train bitwise like eager within the predicted peak."""
    torchvision = _import("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    module, sublayer, expected = CNN_SUBLAYER[name]
    assert len(hcv.sequentialize(model, x)) == module  # the structural chain stays the default
    chain, stages = _sublayer_sweep(model, x)
    assert chain.length == sublayer and set(expected) <= set(chain.names), chain.names
    assert [n for n, _ in stages[:3]] == [n for n in expected if n.startswith("stem.")]  # the stem, cut
    assert all(stage.group is None for _, stage in stages[:3])
    for stage_name, stage in stages[3:-1]:  # each stage of a block is grouped under that block
        assert stage.group is not None and stage_name.startswith(stage.group + ".") or stage_name == stage.group


def test_timm_resnet_blocks_cut_inside_at_sublayer():
    timm = _import("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet26", pretrained=False, num_classes=10)
    chain, _ = _sublayer_sweep(model, torch.randn(2, 3, 32, 32))
    assert {"layer1.0.conv1", "layer1.0.conv2", "layer1.0.conv3", "layer1.0.downsample"} <= set(chain.names)


def test_inception_branches_read_well_at_sublayer():
    torchvision = _import("torchvision")
    from hchain_viz.runtime.graph import extract_stages

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torchvision.models.inception_v3(weights=None, num_classes=10, aux_logits=False, init_weights=False)
    stages = extract_stages(model, torch.randn(2, 3, 80, 80), granularity="sublayer")
    names = [n for n, _ in stages]
    assert len(names) == len(set(names)) > 60
    assert {"Mixed_5b.branch5x5_2", "Mixed_6e.branch7x7dbl_4", "Mixed_7c.branch_pool"} <= set(names), names
    assert not any(".conv" in n or ".bn" in n for n in names), names  # a branch's BasicConv2d reads as the branch
    groups = [s.group for _, s in stages if s.group and s.group.startswith("Mixed_")]
    assert groups == sorted(groups, key=groups.index) and len(set(groups)) == 11  # contiguous, one per Mixed block


def test_the_shipped_densenet_chains_are_what_a_profile_gives_today(tmp_path):
    """``hchain_viz/data``'s DenseNet-121 chains (lesson 8, the explorer guide) are regenerated by
    ``python -m hchain_viz.examples``: a profile now gives the same stages, groups, shared feature maps and saved
    sizes (transients and times are the CPU's, so they are not compared), and the same checkpoint_sequential
    segment starts over the model's children."""
    _import("torchvision")
    from hchain_viz import examples

    examples._regenerate(tmp_path)
    for name in examples.NAMES:
        shipped, fresh = examples.load(name), hcv.Chain.from_json(tmp_path / f"{name}.json")
        for field in ("names", "groups", "shared", "x", "xbar", "delta_bytes", "consumed", "transit"):
            assert getattr(shipped, field) == getattr(fresh, field), (name, field)
        assert shipped.meta["checkpoint_sequential"] == fresh.meta["checkpoint_sequential"], name
