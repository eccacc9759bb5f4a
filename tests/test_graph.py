"""Tests of runtime/graph/ (the package): automatic chain extraction with torch.fx / torch.export.

Every model is checked end to end: the stages run in sequence give the model's output bitwise (CPU), and the
gradients of a backward through the staged run equal eager ones. Optional packages (transformers, torchvision)
skip cleanly when they are missing or cannot be imported beside this torch.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from hchain_viz.errors import HChainError, NotSequentialError  # noqa: E402
from hchain_viz.runtime import models  # noqa: E402
from hchain_viz.runtime.graph import GraphStage, _without_cache, cached_stages, extract_stages  # noqa: E402

pytestmark = pytest.mark.torch


# ---------------------------------------------------------------------------------------------- test-local models
def TinyGPT(layers: int = 3) -> nn.Module:
    """The nanoGPT-style decoder of hcv.models at test size: vocab 50, width 32, 4 heads, 16 positions."""
    return models.NanoGPT(vocab=50, dim=32, heads=4, seq=16, layers=layers, dropout=0.1)


class DenseLayer(nn.Module):
    def __init__(self, c_in: int, growth: int):
        super().__init__()
        self.norm, self.conv = nn.BatchNorm2d(c_in), nn.Conv2d(c_in, growth, 3, padding=1, bias=False)

    def forward(self, features: list):
        return self.conv(F.relu(self.norm(torch.cat(features, 1))))


class DenseBlock(nn.ModuleDict):
    """DenseNet's block: every layer reads all earlier features (no single-value cut inside)."""

    def __init__(self, layers: int, c_in: int, growth: int):
        super().__init__({f"denselayer{i + 1}": DenseLayer(c_in + i * growth, growth) for i in range(layers)})

    def forward(self, x):
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, c_in: int, c_out: int):
        super().__init__(nn.BatchNorm2d(c_in), nn.ReLU(), nn.Conv2d(c_in, c_out, 1, bias=False), nn.AvgPool2d(2))


class TinyDenseNet(nn.Module):
    """torchvision's DenseNet layout: ``features`` (Sequential with dense blocks), functional tail, classifier."""

    def __init__(self, growth: int = 4, classes: int = 5):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, 8, 3, padding=1, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(8))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("denseblock1", DenseBlock(2, 8, growth))
        self.features.add_module("transition1", Transition(8 + 2 * growth, 8))
        self.features.add_module("denseblock2", DenseBlock(2, 8, growth))
        self.features.add_module("norm5", nn.BatchNorm2d(8 + 2 * growth))
        self.classifier = nn.Linear(8 + 2 * growth, classes)

    def forward(self, x):
        out = F.adaptive_avg_pool2d(F.relu(self.features(x), inplace=True), (1, 1))
        return self.classifier(torch.flatten(out, 1))


class Scaled(nn.Module):
    """Top-level buffer and parameter read in every block, plus a tensor literal: attributes used by many stages."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * self.scale * self.gain
        return x + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])


class MaskedEncoder(nn.Module):
    """Keyword inputs, a mask read by every layer (a side value travelling beside the activation)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.out = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask=None):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x) * attention_mask.unsqueeze(-1)
        return {"logits": self.out(x), "pooled": x.mean(1)}


class Branchy(nn.Module):
    """Data-dependent control flow: neither fx nor export can trace it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 0:
            y = y * 2
        return self.b(y)


# ---------------------------------------------------------------------------------------------- helpers
def run_stages(stages, x):
    for _, stage in stages:
        x = stage(x)
    return x


def leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [v for v in out.values() if isinstance(v, torch.Tensor)]
    return [t for t in out if isinstance(t, torch.Tensor)]


def assert_matches_eager(model, x, *, granularity=None, seed=0, loss=lambda out: sum(t.float().pow(2).mean()
                                                                                       for t in leaves(out))):
    """Stages reproduce the forward bitwise and give eager's parameter gradients bitwise; buffers updated once."""
    stages = extract_stages(model, x, granularity=granularity)
    twin = copy.deepcopy(model)
    call = (lambda m: m(**x)) if isinstance(x, dict) else (lambda m: m(*x) if isinstance(x, tuple) else m(x))
    torch.manual_seed(seed)
    want = call(twin)
    loss(want).backward()
    torch.manual_seed(seed)
    got = run_stages(stages, x)
    loss(got).backward()
    assert len(leaves(got)) == len(leaves(want))
    for g, w in zip(leaves(got), leaves(want)):
        assert torch.equal(g, w)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None, name
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), twin.buffers()):
        assert torch.equal(b, c), f"buffer {name} not updated exactly as in eager mode"
    return stages


# ---------------------------------------------------------------------------------------------- models
def test_resnet_skip_blocks_and_eager_equality():
    from hchain_viz.runtime.models import resnet_skip

    model, x, _ = resnet_skip(batch=2, image=16, width=4, blocks=(1, 2))
    stages = assert_matches_eager(model, x)
    names = [n for n, _ in stages]
    assert names == ["stem", "layer1.0", "layer2.0", "layer2.1", "head"]
    assert all(isinstance(s, GraphStage) and s.method == "fx" for _, s in stages)


def test_no_stage_writes_into_its_input():
    """ReLU(inplace=True) right after a cut would overwrite the checkpoint: such cuts are not taken."""
    from hchain_viz.runtime.models import resnet_skip

    model, x, _ = resnet_skip(batch=2, image=16, width=4, blocks=(1, 1))
    model.eval()
    finest = extract_stages(model, x, granularity="finest")
    assert len(finest) > 4
    h = x
    with torch.no_grad():
        for name, stage in finest:
            inp, version = h, h._version
            h = stage(inp)
            assert inp._version == version, f"stage {name} wrote into its input"
        assert torch.equal(h, model(x))


def test_transformer_residual_stream_dropout_and_tied_weights():
    torch.manual_seed(0)
    model = TinyGPT()
    idx = torch.randint(0, 50, (2, 16))
    stages = assert_matches_eager(model, idx, seed=3)
    assert [n for n, _ in stages] == ["stem", "h.0", "h.1", "h.2", "head"]
    # fx stages stay shape-generic: another batch size and a shorter sequence run too.
    other = torch.randint(0, 50, (3, 9))
    model.eval()
    with torch.no_grad():
        assert torch.equal(run_stages(stages, other), model(other))


def test_densenet_concat_blocks_are_whole_stages():
    torch.manual_seed(0)
    model = TinyDenseNet()
    x = torch.randn(2, 3, 8, 8)
    stages = assert_matches_eager(model, x)
    assert [n for n, _ in stages] == ["stem", "denseblock1", "transition1", "denseblock2", "head"]
    finest = [n for n, _ in extract_stages(model, x, granularity="finest")]
    assert not any(n.startswith("denseblock1[") for n in finest)  # no cut between dense layers
    assert len(finest) > len(stages)


def test_keyword_inputs_and_side_mask_travel_in_a_tuple():
    torch.manual_seed(0)
    model = MaskedEncoder()
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    inp = {"input_ids": torch.randint(0, 20, (2, 5)), "attention_mask": mask}
    stages = assert_matches_eager(model, inp)
    assert [n for n, _ in stages] == ["stem", "layers.0", "layers.1", "layers.2", "head"]
    h = stages[0][1](inp)
    assert isinstance(h, tuple) and len(h) == 2 and h[1] is inp["attention_mask"]  # (activation, mask)
    out = run_stages(stages, inp)
    assert set(out) == {"logits", "pooled"}


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, y=None):
        h = self.a(x) if y is None else self.a(x) + y
        return self.c(self.b(h))


@pytest.mark.parametrize("arity", [1, 2])
def test_tuple_inputs_are_positional_arguments(arity):
    torch.manual_seed(0)
    x = tuple(torch.randn(3, 4) for _ in range(arity))
    stages = assert_matches_eager(TwoInputs(), x)
    assert [n for n, _ in stages] == ["a", "b", "c"]


def test_parameters_and_buffers_are_shared_not_copied():
    torch.manual_seed(0)
    model = Scaled()
    keys = list(model.state_dict())
    attrs = set(vars(model))
    x = torch.randn(4, 8)
    stages = assert_matches_eager(model, x, granularity="finest")
    assert list(model.state_dict()) == keys and set(vars(model)) == attrs  # the model is left as it was
    own = {id(p) for p in model.parameters()}
    staged = {id(p) for _, s in stages for p in s.parameters()}
    assert staged == own
    # An optimizer over the model's parameters drives the stages.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = run_stages(stages, x).detach()
    opt.step()
    after = run_stages(stages, x).detach()
    assert not torch.equal(before, after) and torch.equal(after, model(x).detach())
    # model.to() replaces buffers by new tensors: the stages follow (top-level and nested attributes alike).
    model.double()
    xd = x.double()
    assert torch.equal(run_stages(stages, xd), model(xd))


def test_stages_reach_submodules_without_module_getattr_and_leave_the_model_alone():
    torch.manual_seed(0)
    model = TinyDenseNet()
    before = {name: set(vars(m)) for name, m in model.named_modules()}
    x = torch.randn(2, 3, 8, 8)
    stages = assert_matches_eager(model, x, granularity="sublayer")
    assert {name: set(vars(m)) for name, m in model.named_modules()} == before  # no plain attribute on the model
    calls = []
    real = nn.Module.__getattr__

    def counting(self, name):
        calls.append(name)
        return real(self, name)

    nn.Module.__getattr__ = counting
    try:
        run_stages(stages, x)
    finally:
        nn.Module.__getattr__ = real
    stage_paths = {part for _, s in stages for n in s.gm.graph.nodes if n.op == "call_module" for part in
                   n.target.split(".")}
    assert not stage_paths & set(calls)  # the stages' own path walks hit plain attributes
    # Replacing a submodule on a stage's container replaces what the generated code calls.
    stage = next(s for _, s in stages if any(n.op == "call_module" and n.target.count(".") >= 2
                                             for n in s.gm.graph.nodes))
    target = next(n.target for n in stage.gm.graph.nodes if n.op == "call_module" and n.target.count(".") >= 2)
    parent_path, _, leaf = target.rpartition(".")
    parent = stage.gm.get_submodule(parent_path)
    assert type(parent) is nn.Module  # one of the containers fx made
    setattr(parent, leaf, nn.Identity())
    assert getattr(parent, leaf) is parent._modules[leaf] and isinstance(parent._modules[leaf], nn.Identity)


def test_granularity_finest_and_balanced():
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    idx = torch.randint(0, 50, (2, 16))
    module = extract_stages(model, idx)
    finest = extract_stages(model, idx, granularity="finest")
    assert len(finest) > len(module) == 4
    names = [n for n, _ in finest]
    assert len(set(names)) == len(names)
    for n in (1, 3):
        stages = extract_stages(model, idx, granularity=n)
        assert len(stages) == n
        model.eval()
        with torch.no_grad():
            assert torch.equal(run_stages(stages, idx), model(idx))
        model.train()
    with pytest.warns(UserWarning, match="more stages"):
        assert len(extract_stages(model, idx, granularity=len(finest) + 5)) == len(finest)


def test_cached_stages_per_granularity():
    model = Scaled()
    assert cached_stages(model) is None
    x = torch.randn(2, 8)
    fine = extract_stages(model, x, granularity="finest")
    default = extract_stages(model, x)
    assert cached_stages(model) is default
    assert cached_stages(model, "finest") is fine and cached_stages(model, None) is default
    # The cache does not keep the model alive.
    import gc
    import weakref

    ref = weakref.ref(model)
    del model, fine, default
    gc.collect()
    assert ref() is None


def test_sequentialize_falls_back_to_extraction():
    from hchain_viz.runtime.stages import sequentialize

    model = TinyGPT(layers=2)
    idx = torch.randint(0, 50, (2, 16))
    assert [n for n, _ in sequentialize(model, idx)] == ["stem", "h.0", "h.1", "head"]


# ---------------------------------------------------------------------------------------------- errors
def test_data_dependent_control_flow_raises_with_advice():
    with pytest.raises(NotSequentialError) as err:
        extract_stages(Branchy(), torch.randn(2, 4))
    text = str(err.value)
    assert "torch.fx" in text and "torch.export" in text and "by hand" in text


def test_no_cut_point_raises():
    with pytest.raises(NotSequentialError, match="cut"):
        extract_stages(nn.Linear(4, 4), torch.randn(2, 4))


@pytest.mark.parametrize("bad", ["coarse", 0, -2, 1.5, True])
def test_bad_granularity(bad):
    with pytest.raises(NotSequentialError, match="granularity"):
        extract_stages(Scaled(), torch.randn(2, 8), granularity=bad)


def test_not_a_module():
    with pytest.raises(HChainError):
        extract_stages(lambda x: x, torch.randn(2))


# ---------------------------------------------------------------------------------------------- optional packages
def _gpt2(layers: int = 3):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow
def test_hf_gpt2_via_export():
    model = _gpt2()
    ids = torch.randint(0, 64, (2, 16))
    for inp in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.long)}):
        for p in model.parameters():
            p.grad = None
        stages = assert_matches_eager(model, inp, loss=lambda out: out.logits.pow(2).mean(), seed=7)
        assert [n for n, _ in stages] == ["stem", "h.0", "h.1", "h.2", "head"]
        assert stages[0][1].method == "export"
    assert type(run_stages(stages, inp)).__name__ == type(model(**inp)).__name__
    # The export graph fixed dropout in train mode: running the stages in eval mode is refused, not silently wrong.
    model.eval()
    with pytest.raises(NotSequentialError, match="eval"):
        run_stages(stages, inp)


def _torchvision():
    try:
        import torchvision
    except Exception as exc:  # PyPI's torchvision can fail at import beside a CPU-only torch build
        pytest.skip(f"torchvision unavailable: {type(exc).__name__}: {exc}")
    return torchvision


@pytest.mark.slow
@pytest.mark.parametrize("name, blocks", [("resnet18", 8), ("densenet121", 7)])
def test_torchvision_models(name, blocks):
    torchvision = _torchvision()
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, num_classes=10)
    stages = assert_matches_eager(model, torch.randn(2, 3, 32, 32))
    names = [n for n, _ in stages]
    assert names[0] == "stem" and names[-1] == "head" and len(names) == blocks + 2


# ---------------------------------------------------------------------------------------------- end to end
def _train_step_matches(model, x, loss_fn, seed=11, granularity=None):
    import hchain_viz as hcv
    from hchain_viz.core.solver import least_budget, store_all_peak

    chain = hcv.profile(model, x, loss_fn, warmup=0, repeats=1, progress=False, granularity=granularity)
    budget = (least_budget(chain) + store_all_peak(chain)) // 2
    schedule = hcv.solve(chain).schedule(budget)
    assert schedule.n_recomputed > 0
    twin = copy.deepcopy(model)
    wrapped = hcv.wrap(model, schedule)
    # Three steps: the executor learns in the second what each stage frees, and reads it in the third.
    for step in range(3):
        torch.manual_seed(seed + step)
        loss_fn(wrapped(x)).backward()
        torch.manual_seed(seed + step)
        # The eager reference runs as HF's gradient checkpointing does, with the KV cache off: with it on, eager
        # attention reads contiguous copies of keys and values from the cache, and where BLAS rounding depends on
        # layout (AVX-512) the last bits of the gradients differ from the cache-free step.
        loss_fn(twin(**_without_cache(twin, x)) if isinstance(x, dict) else twin(*x) if isinstance(x, tuple)
                else twin(x)).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            # (a parameter eager leaves without a gradient, such as Marian's sinusoidal positions, gets none either)
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), (step, name)
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
    assert wrapped.executor.learned.frees is not None
    return chain


def test_profile_solve_wrap_train_step_tiny_gpt():
    torch.manual_seed(0)
    model = TinyGPT()
    idx, target = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    chain = _train_step_matches(model, idx, lambda out: F.cross_entropy(out.reshape(-1, 50), target.reshape(-1)))
    assert chain.names == ("stem", "h.0", "h.1", "h.2", "head")


@pytest.mark.slow
def test_profile_solve_wrap_train_step_hf_gpt2():
    model = _gpt2()
    inp = {"input_ids": torch.randint(0, 64, (2, 16)), "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    _train_step_matches(model, inp, lambda out: out.logits.pow(2).mean())


# ---------------------------------------------------------------------------------------------- Hugging Face families
# Default configs (the path a new user takes: use_cache on, sdpa attention), shrunk to test size.
HF_LAYER = {"gpt2": "h.{}", "llama": "layers.{}", "bert": "layer.{}", "vit": "layers.{}"}  # one-stack families


def _hf(family: str, layers: int = 2, **kwargs):
    pytest.importorskip("transformers")
    from hchain_viz.runtime.models import hf_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "vit":  # 16-pixel images in 4-pixel patches: 16 tokens + CLS
            kwargs.setdefault("patch_size", 4)
        return hf_model(family, layers=layers, hidden=32, heads=4, vocab=64, seq=16, **kwargs)


@pytest.mark.parametrize("family", list(HF_LAYER))
def test_hf_default_config_families_split_per_layer_and_train_like_eager(family):
    model, inp, loss_fn = _hf(family)
    config_before = model.config.to_dict()
    inp_before = dict(inp)
    chain = _train_step_matches(model, inp, loss_fn)
    layers = [n for n in chain.names if n.split(".")[0] == HF_LAYER[family].split(".")[0]]
    assert layers == [HF_LAYER[family].format(i) for i in range(2)], chain.names
    # The KV cache is switched off in the call, as HF's gradient checkpointing does: the config is not touched.
    # (BERT itself records problem_type on its first call with labels.)
    config_before.pop("problem_type", None)
    assert {k: v for k, v in model.config.to_dict().items() if k != "problem_type"} == config_before
    assert inp == inp_before and "use_cache" not in inp


def test_hf_labels_make_output_loss_the_default_loss():
    from hchain_viz.runtime.measure import default_loss

    model, inp, _ = _hf("gpt2", layers=1)
    out = model(**inp, use_cache=False)
    assert default_loss(out) is out.loss
    del inp["labels"]
    out = model(**inp, use_cache=False)
    assert out.loss is None and torch.equal(default_loss(out), out.logits.float().pow(2).mean())
    import hchain_viz as hcv

    model, inp, _ = _hf("bert", layers=1)
    chain = hcv.profile(model, inp, warmup=0, repeats=1, progress=False)
    assert "output.loss" in chain.meta["loss"] and chain.x[-1] > 0


@pytest.mark.parametrize("family, layer", [("bart", "{}.layers.{}"), ("t5", "{}.block.{}")])
def test_hf_encoder_decoder_splits_per_layer_and_trains_like_eager(family, layer):
    """The encoder output crosses every cut of the decoder beside its activation (a tuple boundary)."""
    model, inp, loss_fn = _hf(family)
    # T5's relative position bias, made from a parameter by the first layer of each stack, crosses the cuts too: the
    # bias parameter's gradient is eager's, bitwise.
    chain = _train_step_matches(model, inp, loss_fn)
    assert chain.names == ("stem", *(layer.format(part, i) for part in ("encoder", "decoder") for i in range(2)),
                           "head")
    # The encoder output crosses every cut from the decoder's first layer to the model's output (which returns it).
    decoder = chain.names.index(layer.format("decoder", 0))
    assert any(a == decoder and b == chain.length for a, b, _ in chain.shared), chain.shared


def test_hf_unknown_family_is_an_hchain_error():
    from hchain_viz.runtime.models import hf_model

    with pytest.raises(HChainError, match="gpt2"):
        hf_model("t6")


# ---------------------------------------------------------------------------------------------- sub-layer stages
SUBLAYER_EAGER = ["attn.qkv", "attn.scores", "attn.probs", "attn.context", "attn.out", "mlp.up", "mlp.down"]
CORE = {"attn.scores", "attn.probs", "attn.context", "attn.core"}


def _check_sublayer_chain(chain, layer: str, roles: list[str], layers: int = 2) -> None:
    """Names, groups and tags per layer; the residual stream is one tensor shared across the cuts of a layer."""
    expected = [layer.format(i) + "." + r for i in range(layers) for r in roles]
    assert [n for n in chain.names if n.startswith(layer.split(".")[0] + ".")] == expected, chain.names
    for i in range(layers):
        name = layer.format(i)
        first = chain.names.index(f"{name}.{roles[0]}")
        assert (name, first, first + len(roles) - 1) in chain.groups
    assert all((tag == "attn_core") == (name.split(".", 2)[-1] in CORE) for name, tag in zip(chain.names, chain.tags)
               if name.startswith(layer.split(".")[0] + "."))
    # Inside a layer the residual stream (the layer's input, x[first]) crosses the attention's cuts unchanged.
    for i in range(layers):
        first = chain.names.index(f"{layer.format(i)}.{roles[0]}")
        out = first + roles.index("attn.out")  # x[first..out]: the inputs of qkv .. attn.out all hold it
        assert any(a == first and b == out and size <= chain.x[first] for a, b, size in chain.shared), (
            first, chain.shared)
    for a, b, size in chain.shared:
        assert all(chain.x[k] >= size for k in range(a, b + 1))


def test_sublayer_nanogpt_trains_like_eager():
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    idx, target = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    chain = _train_step_matches(model, idx, lambda out: F.cross_entropy(out.reshape(-1, 50), target.reshape(-1)),
                                granularity="sublayer")
    assert chain.names[0] == "stem" and chain.names[-1] == "head"
    _check_sublayer_chain(chain, "h.{}", SUBLAYER_EAGER)


def test_later_steps_free_what_the_learning_step_freed():
    """The executor learns in the second step which input tensors each Fall frees (transit, consumed, eaten: the
    attention's parts) and reads it afterwards without noting saved tensors: the same frees when relearned from
    scratch, and a peak of the known steps within the prediction."""
    import hchain_viz as hcv
    from hchain_viz.runtime.measure import measure

    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    idx, target = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    loss_fn = lambda out: F.cross_entropy(out.reshape(-1, 50), target.reshape(-1))  # noqa: E731
    chain = hcv.profile(model, idx, loss_fn, warmup=0, repeats=1, progress=False, granularity="sublayer")
    sol = hcv.solve(chain)
    schedule = sol.schedule(sol.min_budget + (sol.store_all_peak - sol.min_budget) // 10)
    wrapped = hcv.wrap(model, schedule)
    for _ in range(3):
        loss_fn(wrapped(idx)).backward()
    learned, reads = wrapped.executor.learned.frees, wrapped.executor.learned.frees_made
    assert any(f.transit for f in learned.values()) and any(f.consumed for f in learned.values())
    assert reads
    known_peak = measure(wrapped, idx, loss_fn, repeats=1).peak_bytes
    wrapped.executor.learned.frees = None  # relearn
    loss_fn(wrapped(idx)).backward()
    loss_fn(wrapped(idx)).backward()
    assert wrapped.executor.learned.frees == learned and wrapped.executor.learned.frees_made == reads
    assert known_peak <= hcv.simulate(chain, schedule).peak_memory


@pytest.mark.parametrize("family, layer", [("gpt2", "h.{}"), ("llama", "layers.{}")])
def test_sublayer_hf_eager_attention_trains_like_eager(family, layer):
    model, inp, loss_fn = _hf(family, attn_implementation="eager")
    chain = _train_step_matches(model, inp, loss_fn, granularity="sublayer")
    _check_sublayer_chain(chain, layer, SUBLAYER_EAGER)


def test_sublayer_fused_attention_is_one_core_stage():
    from hchain_viz.runtime.graph import extract_stages

    model, inp, _ = _hf("gpt2", attn_implementation="sdpa")
    stages = extract_stages(model, inp, granularity="sublayer")
    names = [n for n, _ in stages]
    assert names[1:6] == ["h.0.attn.qkv", "h.0.attn.core", "h.0.attn.out", "h.0.mlp.up", "h.0.mlp.down"]
    assert [s.tag for _, s in stages[1:6]] == ["", "attn_core", "", "", ""]
    assert {s.group for _, s in stages[1:6]} == {"h.0"} and stages[0][1].group is None



def test_sublayer_bert_encoder_with_mask():
    model, inp, loss_fn = _hf("bert", attn_implementation="eager")
    chain = _train_step_matches(model, inp, loss_fn, granularity="sublayer")
    _check_sublayer_chain(chain, "layer.{}", SUBLAYER_EAGER)


SUBLAYER_DECODER = ["attn.qkv", "attn.scores", "attn.probs", "attn.context", "attn.out", "xattn.in0", "xattn.qkv",
                    "xattn.scores", "xattn.probs", "xattn.context", "xattn.out", "mlp.up", "mlp.down"]


@pytest.mark.parametrize("family, blocks", [("bart", "layers"), ("t5", "block")])
def test_sublayer_encoder_decoder_has_cross_attention_parts_and_trains_like_eager(family, blocks):
    from hchain_viz.core.strategies import per_layer, selective

    model, inp, loss_fn = _hf(family, attn_implementation="eager")
    chain = _train_step_matches(model, inp, loss_fn, granularity="sublayer")
    for part, roles in (("encoder", SUBLAYER_EAGER), ("decoder", SUBLAYER_DECODER)):
        layer = f"{part}.{blocks}.{{}}"
        assert [n for n in chain.names if n.startswith(part)] == [
            layer.format(i) + "." + r for i in range(2) for r in roles], chain.names
        first = chain.names.index(layer.format(1) + "." + roles[0])
        assert (layer.format(1), first, first + len(roles) - 1) in chain.groups
    cores = [n for n, tag in zip(chain.names, chain.tags) if tag == "attn_core"]
    assert len(cores) == 3 * 2 + 6 * 2 and all(n.split(".")[-1] in ("scores", "probs", "context") for n in cores)
    # The baselines see both stacks' layers: per-layer keeps 4 layer inputs, selective recomputes 6 attention cores.
    assert per_layer(chain).n_recomputed > 0 and selective(chain).n_recomputed == len(cores)


def test_torch_transformer_is_an_encoder_decoder_chain_and_trains_like_eager():
    torch.manual_seed(0)
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                           batch_first=True).train()
    src, tgt = torch.randn(2, 8, 32), torch.randn(2, 6, 32)
    chain = _train_step_matches(model, (src, tgt), lambda out: out.pow(2).mean())
    assert chain.names == ("stem", "encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1",
                           "head")


@pytest.mark.parametrize("family", ["gpt2", "bart"])
def test_wrapped_hf_model_in_eval_and_no_grad_is_the_plain_call(family):
    import hchain_viz as hcv

    model, inp, loss_fn = _hf(family)
    chain = hcv.profile(model, inp, loss_fn, warmup=0, repeats=1, progress=False)
    wrapped = hcv.wrap(model, hcv.strategies.per_layer(chain))
    wrapped.eval()
    assert torch.equal(wrapped(inp).logits, model(**inp).logits)
    wrapped.train()
    with torch.no_grad():
        torch.manual_seed(3)
        got = wrapped(inp).logits
        torch.manual_seed(3)
        assert torch.equal(got, model(**inp).logits)


@pytest.mark.parametrize("family", ["marian", "whisper"])
def test_other_hf_encoder_decoders_split_per_layer_and_train_like_eager(family):
    """The BART line (Marian; mBART and Pegasus alike) and an audio encoder (Whisper's mel features) without any
    family-specific code."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=1,
                 decoder_start_token_id=2)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "whisper":
            config = transformers.WhisperConfig(**sizes, num_mel_bins=16, max_source_positions=16,
                                                max_target_positions=32, bos_token_id=None, eos_token_id=None)
            model = transformers.WhisperForConditionalGeneration(config).train()
            inp = {"input_features": torch.randn(2, 16, 32), "labels": torch.randint(3, 64, (2, 8))}
        else:
            model = transformers.MarianMTModel(transformers.MarianConfig(**sizes, max_position_embeddings=64)).train()
            ids = torch.randint(3, 64, (2, 12))
            inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(3, 64, (2, 10))}
        chain = _train_step_matches(model, inp, lambda out: out["loss"])
    assert chain.names == ("stem", "encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1",
                           "head")


# ------------------------------------------------------------------------------------ custom autograd Functions
class _RoundSTE(torch.autograd.Function):
    """Quantise to quarters; straight-through backward (the identity), as quantization-aware training does."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class _QuantBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + _RoundSTE.apply(self.lin(x))


class _QuantNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_QuantBlock() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _QuantNetKw(_QuantNet):
    def forward(self, x, **unused):  # **kwargs: fx cannot bind it, so torch.export traces this one
        return super().forward(x)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("granularity", ["module", "sublayer", "finest"])
def test_custom_autograd_function_keeps_its_backward(tracer, granularity):
    """A straight-through estimator inside residual blocks: traced through, round's zero derivative would replace
    the identity and every block weight would get a zero gradient. Kept whole, the gradients are eager's."""
    torch.manual_seed(0)
    model = (_QuantNet if tracer == "fx" else _QuantNetKw)()
    x = torch.randn(4, 8)
    stages = assert_matches_eager(model, x, granularity=granularity)
    assert {s.method for _, s in stages} == {tracer}
    assert all(p.grad.abs().sum() > 0 for p in model.parameters())
    assert sum("_RoundSTE_apply" in s.code for _, s in stages) == 3  # one opaque call per block


def test_traced_through_function_is_caught_by_the_gradient_check(monkeypatch):
    """Extraction checks one backward: a Function traced through (as before the fix) is refused, by gradient."""
    from hchain_viz.runtime.graph import functions

    monkeypatch.setattr(functions, "_kept", lambda cls: False)
    with pytest.raises(NotSequentialError, match=r"not its gradients.*blocks\.0\.lin\.weight"):
        extract_stages(_QuantNet(), torch.randn(4, 8))


class _Pair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, "not a tensor"

    @staticmethod
    def backward(ctx, g, _):
        return g * 2


def test_function_with_non_tensor_output_is_refused_by_name():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, **unused):
            return self.b(_Pair.apply(self.a(x))[0])

    with pytest.raises(NotSequentialError, match=r"_Pair returns tuple values, not tensors"):
        extract_stages(Net(), torch.randn(2, 4))


def test_bloom_gelu_function_keeps_bloom_gelu_back():
    """Bloom's MLP activation is a custom Function (GeLUFunction) with a hand-written backward (bloom_gelu_back)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 16))
    for granularity in ("module", "sublayer"):
        model.zero_grad()
        stages = extract_stages(model, {"input_ids": ids, "labels": ids}, granularity=granularity)
        assert sum("GeLUFunction_apply" in s.code for _, s in stages) == 2
    _train_step_matches(model, {"input_ids": ids, "labels": ids}, lambda out: out["loss"], granularity="sublayer")
