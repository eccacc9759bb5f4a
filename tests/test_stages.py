"""runtime/stages.py: sequentialize() on Sequentials, lists, torchvision-style models; in-place fusion; errors."""

from __future__ import annotations

import sys
import types
from collections import OrderedDict

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from hchain_viz.errors import HChainError, NotSequentialError  # noqa: E402
from hchain_viz.runtime import models  # noqa: E402
from hchain_viz.runtime.stages import sequentialize  # noqa: E402

pytestmark = pytest.mark.torch


def names(stages):
    return [n for n, _ in stages]


def run(stages, x):
    for _, m in stages:
        x = m(x)
    return x


# ---------------------------------------------------------------------------------------------- torchvision look-alikes
class FakeVGG(nn.Module):
    """Same attribute names and forward() as torchvision.models.VGG."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(64, 32), nn.ReLU(True), nn.Dropout(), nn.Linear(32, 10))

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


class FakeDenseBlock(nn.ModuleDict):
    def __init__(self, c, growth, n):
        super().__init__()
        for i in range(n):
            self[f"denselayer{i + 1}"] = nn.Sequential(nn.BatchNorm2d(c + i * growth), nn.ReLU(inplace=True),
                                                       nn.Conv2d(c + i * growth, growth, 3, padding=1))

    def forward(self, x):
        feats = [x]
        for layer in self.values():
            feats.append(layer(torch.cat(feats, 1)))
        return torch.cat(feats, 1)


class FakeTransition(nn.Sequential):  # torchvision's _Transition: a Sequential subclass without its own forward
    def __init__(self, c_in, c_out):
        super().__init__()
        self.add_module("norm", nn.BatchNorm2d(c_in))
        self.add_module("relu", nn.ReLU(inplace=True))
        self.add_module("conv", nn.Conv2d(c_in, c_out, 1))


class FakeDenseNet(nn.Module):
    """Same attribute names and forward() as torchvision.models.DenseNet."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(3, 8, 3, padding=1)), ("norm0", nn.BatchNorm2d(8)), ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(2)), ("denseblock1", FakeDenseBlock(8, 4, 2)),
            ("transition1", FakeTransition(16, 8)), ("norm5", nn.BatchNorm2d(8)),
        ]))
        self.classifier = nn.Linear(8, 10)

    def forward(self, x):
        features = self.features(x)
        out = F.relu(features, inplace=True)
        out = F.adaptive_avg_pool2d(out, (1, 1))
        out = torch.flatten(out, 1)
        return self.classifier(out)


class AddOne(nn.Module):
    """Writes into its input, without saying so (no ``inplace`` attribute)."""

    def forward(self, x):
        return x.add_(1)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x)) + x


# ---------------------------------------------------------------------------------------------- Sequentials and lists
def test_nested_sequentials_are_flattened_with_dotted_names():
    inner = nn.Sequential(nn.Tanh(), nn.Linear(4, 4))
    model = nn.Sequential(OrderedDict(a=nn.Linear(4, 4), b=nn.Sequential(nn.Linear(4, 4), inner), c=nn.Linear(4, 2)))
    stages = sequentialize(model)
    assert names(stages) == ["a", "b.0", "b.1.0", "b.1.1", "c"]
    assert stages[2][1] is inner[0]  # the model's own modules, not copies
    x = torch.randn(3, 4)
    assert torch.equal(run(stages, x), model(x))


def test_lists_pairs_modulelists_and_dicts():
    lin, tanh = nn.Linear(4, 4), nn.Tanh()
    assert names(sequentialize([lin, tanh])) == ["0", "1"]
    assert names(sequentialize([("first", lin), ("rest", nn.Sequential(tanh, nn.Linear(4, 4)))])) == \
        ["first", "rest.0", "rest.1"]
    assert names(sequentialize(nn.ModuleList([lin, tanh]))) == ["0", "1"]
    assert names(sequentialize({"p": lin, "q": tanh})) == ["p", "q"]
    assert names(sequentialize(nn.ModuleDict({"p": lin, "q": tanh}))) == ["p", "q"]


def test_sequential_subclass_with_own_forward_is_not_flattened():
    class Twice(nn.Sequential):
        def forward(self, x):
            return super().forward(super().forward(x))

    model = nn.Sequential(nn.Linear(4, 4), Twice(nn.Linear(4, 4)))
    stages = sequentialize(model)
    assert names(stages) == ["0", "1"] and isinstance(stages[1][1], Twice)


# ---------------------------------------------------------------------------------------------- in-place fusion
def test_declared_inplace_stage_is_fused_with_predecessor():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Dropout(0.5, inplace=True), nn.Linear(4, 2),
                          nn.ReLU(inplace=True))
    stages = sequentialize(model)
    assert names(stages) == ["0+1+2", "3+4"]
    assert len(list(stages[0][1].children())) == 3  # flat, not nested
    model.eval()
    x = torch.randn(5, 4)
    assert torch.equal(run(stages, x), model(x))


def test_first_stage_inplace_stays_alone():
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))
    assert names(sequentialize(model)) == ["0", "1"]


def test_undeclared_inplace_stage_is_found_with_a_sample_input():
    model = nn.Sequential(nn.Linear(4, 4), AddOne(), nn.Linear(4, 2))
    assert names(sequentialize(model)) == ["0", "1", "2"]  # nothing says it is in-place
    x = torch.randn(3, 4)
    before = x.clone()
    stages = sequentialize(model, x)
    assert names(stages) == ["0+1", "2"]
    assert torch.equal(x, before)  # the check ran on a copy


def test_check_leaves_model_state_alone():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model[3].eval()
    stats = [b.clone() for b in model.buffers()]
    x = torch.randn(6, 4)
    rng = torch.get_rng_state()
    sequentialize(model, x)
    assert [m.training for m in model] == [True, True, True, False]
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))
    assert torch.equal(rng, torch.get_rng_state())


# ---------------------------------------------------------------------------------------------- duck typing
def test_resnet_skip_by_torchvision_resnet_duck_typing():
    model, x, _ = models.resnet_skip(batch=2, image=16, width=4, blocks=(1, 1))
    stages = sequentialize(model, x)
    assert names(stages) == ["conv1", "bn1+relu", "maxpool", "layer1.0", "layer2.0", "avgpool", "flatten", "fc"]
    model.eval()
    with torch.no_grad():
        assert torch.allclose(run(stages, x), model(x), atol=1e-6)


@pytest.mark.parametrize("make, expected", [
    (FakeVGG, ["features.0+features.1", "features.2", "features.3+features.4", "features.5", "avgpool", "flatten",
               "classifier.0+classifier.1", "classifier.2", "classifier.3"]),
    (FakeDenseNet, ["features.conv0", "features.norm0+features.relu0", "features.pool0", "features.denseblock1",
                    "features.transition1.norm+features.transition1.relu", "features.transition1.conv",
                    "features.norm5+relu", "pool", "flatten", "classifier"]),
])
def test_vgg_and_densenet_by_duck_typing(make, expected, monkeypatch):
    monkeypatch.setitem(sys.modules, "hchain_viz.runtime.graph", None)  # the duck typing alone must do it
    torch.manual_seed(0)
    model = make()  # training mode: dropout and batch statistics must not fool the check
    x = torch.randn(2, 3, 16, 16)
    stats = [b.clone() for b in model.buffers()]
    stages = sequentialize(model, x)
    assert names(stages) == expected
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))
    model.eval()
    with torch.no_grad():
        assert torch.allclose(run(stages, x), model(x), atol=1e-6)


# ---------------------------------------------------------------------------------------------- fallbacks and errors
class LooksLikeResNet(nn.Module):
    """Has torchvision ResNet's attribute names, but its forward skips relu: duck typing must not be trusted."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.layer1 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(4, 3)

    def forward(self, x):
        x = self.layer1(self.bn1(self.conv1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def test_custom_model_without_sample_input_raises():
    with pytest.raises(NotSequentialError, match=r"\(name, module\)") as e:
        sequentialize(Custom())
    assert "sample input" in str(e.value) and isinstance(e.value, HChainError)


@pytest.mark.parametrize("model", [Custom(), LooksLikeResNet()])
def test_falls_back_to_graph_extraction(monkeypatch, model):
    calls = []
    fake = types.ModuleType("hchain_viz.runtime.graph")
    fake.extract_stages = lambda m, x, granularity=None: calls.append((m, granularity)) or [("all", m)]
    monkeypatch.setitem(sys.modules, "hchain_viz.runtime.graph", fake)
    x = torch.randn(2, 3, 8, 8) if isinstance(model, LooksLikeResNet) else torch.randn(2, 4)
    assert sequentialize(model, x, granularity="block") == [("all", model)]
    assert calls == [(model, "block")]


def test_without_graph_extraction_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "hchain_viz.runtime.graph", None)  # as if graph.py did not exist
    with pytest.raises(NotSequentialError, match=r"\(name, module\)"):
        sequentialize(LooksLikeResNet(), torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize("bad, match", [
    (42, "nn.Module"),
    (nn.Sequential(), "no modules"),
    ([], "no modules"),
    ([nn.Linear(2, 2), "relu"], "not an nn.Module"),
])
def test_bad_models(bad, match):
    with pytest.raises(NotSequentialError, match=match):
        sequentialize(bad)


def test_traced_model_reuses_its_extracted_stages_without_a_sample():
    class Residual(nn.Module):  # a custom forward(): only graph extraction can cut it
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            h = x + torch.relu(self.a(x))
            return self.head(h + torch.relu(self.b(h)))

    model = Residual()
    with pytest.raises(NotSequentialError, match="sample input"):
        sequentialize(model)
    traced = sequentialize(model, torch.randn(4, 8))
    again = sequentialize(model)  # e.g. wrap(model, schedule) after profile(model, x)
    assert [n for n, _ in again] == [n for n, _ in traced]
    assert all(m1 is m2 for (_, m1), (_, m2) in zip(again, traced))


def test_look_alike_needs_a_checked_forward_before_it_is_trusted_without_a_sample():
    torch.manual_seed(0)
    model, x = FakeVGG(), torch.randn(2, 3, 16, 16)
    with pytest.raises(NotSequentialError, match="sample input"):
        sequentialize(model)  # attribute names alone could train a different computation
    checked = sequentialize(model, x)
    assert names(sequentialize(model)) == names(checked)  # e.g. wrap(model, schedule) after profile(model, x)


def test_look_alike_with_another_forward_reuses_its_traced_stages():
    torch.manual_seed(0)
    model, x = LooksLikeResNet(), torch.randn(2, 3, 8, 8)
    with pytest.raises(NotSequentialError, match="sample input"):
        sequentialize(model)
    traced = sequentialize(model, x)  # the duck stages do not reproduce it: graph extraction
    again = sequentialize(model)
    assert names(again) == names(traced) and all(a is b for (_, a), (_, b) in zip(again, traced))
    model.eval()
    with torch.no_grad():
        assert torch.equal(run(again, x), model(x))


class LooksLikeSqueezeNet(nn.Module):
    """torchvision's SqueezeNet layout: ``features`` and a convolutional ``classifier`` that needs the 4-D map, so
    the VGG-style reading (features, avgpool, flatten, classifier) fails when run."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Conv2d(8, 5, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


def test_look_alike_whose_layout_fails_to_run_falls_back_to_graph_extraction():
    torch.manual_seed(0)
    model, x = LooksLikeSqueezeNet(), torch.randn(2, 3, 12, 12)
    stages = sequentialize(model, x)  # the duck layout raises inside; the traced graph is used instead
    assert type(stages[0][1]).__name__ == "GraphStage"
    with torch.no_grad():
        assert torch.equal(run(stages, x), model(x))
    with pytest.raises(HChainError):  # a wrong input still fails, in extraction
        sequentialize(model, torch.randn(2, 5, 12, 12))


# ---------------------------------------------------------------------------------------------- find_stages (#40)
def test_find_stages_waits_for_an_input_only_where_one_can_change_the_answer():
    from hchain_viz import InvalidSchedule, Schedule
    from hchain_viz.core.regions import stage_count
    from hchain_viz.runtime.stages import find_stages

    two = Schedule.parse("Fall0 Fall1 Loss B1 B0")
    assert stage_count(two) == 2
    model = nn.Sequential(nn.Linear(4, 4), AddOne(), nn.Linear(4, 2))  # 3 stages by structure, 2 traced
    assert find_stages(model, two) is None  # an input may fuse stages: wait for it
    assert names(find_stages(model, two, torch.randn(3, 4))) == ["0+1", "2"]
    assert find_stages(Custom(), two) is None  # a custom forward: cut from the input
    with pytest.raises(InvalidSchedule, match="chain of 2 stages but Sequential has 1"):
        find_stages(nn.Sequential(nn.Linear(4, 4)), two)  # an input never splits a stage
    with pytest.raises(InvalidSchedule, match="chain of 3 stages but Sequential has 2"):
        find_stages(model, Schedule.parse("Fall0 Fall1 Fall2 Loss B2 B1 B0"), torch.randn(3, 4))
    with pytest.raises(InvalidSchedule, match="exactly one Loss"):
        stage_count(Schedule.parse("Fall0 B0"))


def test_find_stages_lets_errors_other_than_not_sequential_through(monkeypatch):
    from hchain_viz import Schedule
    from hchain_viz.runtime import stages as stages_module

    def broken(model, sample_input=None, **kwargs):
        raise RuntimeError("a bug, not a model that cannot be cut")

    monkeypatch.setattr(stages_module, "sequentialize", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        stages_module.find_stages(nn.Sequential(nn.Linear(4, 4)), Schedule.parse("Fall0 Loss B0"))
