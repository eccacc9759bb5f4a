"""Turn a model into a chain of stages: ``sequentialize(model) -> [(name, module), ...]`` run one after another.

A chain (docs/design.md §2) is a list of stages where stage i receives exactly what stage i-1 returned, called with one
positional argument as ``nn.Sequential`` does (a stage returning a tuple hands the whole tuple to the next one).

What is recognised, in this order:

1. an ``nn.Sequential`` (nested Sequentials are flattened; names are dotted paths such as ``"layer2.1"``),
2. a list / tuple / ``nn.ModuleList`` of modules or ``(name, module)`` pairs, or a mapping name -> module,
3. torchvision-style architectures, duck-typed on attribute names (torchvision itself is not needed):
   ResNet (``conv1, bn1, relu, [maxpool], layer1.., avgpool, fc``), DenseNet (``features`` with ``denseblock*``,
   ``classifier``), VGG / AlexNet / EfficientNet-like (``features, avgpool, classifier``) and MobileNetV2-like
   (``features, classifier``). The functional bits of their ``forward`` (``torch.flatten``, DenseNet's final ReLU and
   pooling) become small stages of their own,
4. anything else, when a ``sample_input`` is given: automatic graph extraction (``runtime/graph/``).

A stage that modifies its input in place (a standalone ``ReLU(inplace=True)``, a ``Dropout(inplace=True)``, or -
detected with a sample input - any stage that bumps its input's version counter) is fused with its predecessor:
its input is the predecessor's private output then, never a checkpoint someone else still needs.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..core.regions import stage_count
from ..core.schedule import Schedule
from ..errors import InvalidSchedule, NotSequentialError, ProfileError
from .memtrack import cuda_devices, map_tensors, tensors
from .snapshot import buffer_snapshot

Stage = tuple[str, nn.Module]

# Look-alike models (torchvision-style by attribute names) whose stages were seen to reproduce the model's output.
_VERIFIED: weakref.WeakSet = weakref.WeakSet()

__all__ = ["sequentialize", "find_stages", "Stage", "fuse"]


def sequentialize(model: Any, sample_input: Any = None, *, granularity: str | int | None = None) -> list[Stage]:
    """The stages of ``model`` as a list of ``(name, module)`` pairs, in execution order.

    ``sample_input`` (optional) lets the structure be checked: the composed stages must reproduce ``model``'s
    output, and stages that write into their input are detected by its version counter. Without a recognised
    structure it is required, for graph extraction; ``granularity`` is passed on to that extraction only, and
    a torchvision-style model given a granularity finer than ``"module"`` is extracted from its graph too (its
    residual and dense blocks cut inside, see ``extract_stages``).
    The modules in the list are ``model``'s own (parameters shared, nothing copied); fused stages and the
    functional glue of torchvision models (``flatten``) are new parameter-free wrappers.
    """
    if _is_compiled(model):
        raise NotSequentialError(
            f"the model is compiled as a whole (torch.compile returned a {type(model).__name__}); its stages cannot "
            f"be cut out of one compiled graph. Pass the plain model (compiled._orig_mod) with compile=True "
            f"(hcv.profile(model, x, compile=True), hcv.wrap(model, schedule, compile=True)): each stage is then "
            f"compiled on its own"
        )
    stages, kind = _structural_stages(model)
    if sample_input is None and kind != "list":
        # A model profiled before (profile(model, x)) keeps its extracted stages: the same cut as the profile.
        from .graph import cached_stages

        cached = cached_stages(model) if granularity is None else cached_stages(model, granularity)
        if cached is not None:
            return cached
    if kind in ("duck", "sequential") and sample_input is not None and granularity not in (None, "module"):
        # Finer than whole blocks (cuts inside a residual or dense block, balanced stages): the model's graph. An
        # nn.Sequential of blocks is cut inside its blocks too, or, where its graph cannot be traced, by its children.
        try:
            return _extract(model, sample_input, granularity,
                            why=f"granularity={granularity!r} cuts inside the blocks of the {type(model).__name__}")
        except NotSequentialError as e:
            if kind == "duck":
                raise
            warnings.warn(f"granularity={granularity!r}: the {type(model).__name__}'s graph could not be cut inside "
                          f"its blocks ({e}); its children are the stages, as at granularity='module'",
                          stacklevel=2)
    if stages is None:
        if sample_input is None:
            raise NotSequentialError(
                f"cannot split a {type(model).__name__} into a chain automatically: it is not an nn.Sequential, a "
                f"list of modules, or a torchvision-style ResNet/VGG/DenseNet. Either pass the stages yourself, as "
                f"a list of (name, module) pairs run one after another, or pass a sample input "
                f"(sequentialize(model, x) / profile(model, x)) so the computation graph can be traced."
            )
        return _extract(model, sample_input, granularity, why=f"{type(model).__name__} has a custom forward()")
    if not stages:
        raise NotSequentialError(
            f"the {type(model).__name__} has no modules; a chain needs at least one stage"
        )
    if kind == "duck" and sample_input is None and not (_trusted(model) or model in _VERIFIED):
        # Matching attribute names say nothing about forward(): running these stages could silently train a
        # different computation. Only a sample input can show that they reproduce the model.
        raise NotSequentialError(
            f"{type(model).__name__} looks like a torchvision model by its attributes, but nothing has checked that "
            f"its forward() runs them in that order; pass a sample input (sequentialize(model, x)), or profile it "
            f"first (hcv.profile(model, x) before hcv.wrap), so the stages can be checked against the model"
        )
    stages = _fuse_marked(stages, [_declares_inplace(m) for _, m in stages])
    if sample_input is not None:
        try:
            reproduces, inplace = _check_stages(model, stages, sample_input, compare=kind == "duck")
        except ProfileError as e:
            if kind != "duck":
                raise
            # The attribute layout matched but running it does not (torchvision's SqueezeNet: features, then a
            # classifier that expects a 4-D input): the model's own graph decides. A bad input fails there too.
            return _extract(model, sample_input, granularity,
                            why=f"it looks like a torchvision {type(model).__name__} but running that layout "
                                f"failed ({e.__cause__ or e})")
        if not reproduces:
            return _extract(model, sample_input, granularity,
                            why=f"it looks like a torchvision {type(model).__name__} but its forward() differs")
        if kind == "duck":
            _VERIFIED.add(model)
        stages = _fuse_marked(stages, inplace)
    return stages


def find_stages(model: Any, schedule: Schedule, sample_input: Any = None) -> list[Stage] | None:
    """The stages of ``model`` that ``schedule`` runs, or None while they can only be found from an input.

    Without ``sample_input`` the answer is None when the model cannot be cut without one (a custom ``forward()``,
    traced at the first training call) or has more stages than the schedule: an input can still fuse stages that
    write into their input, never split one. With ``sample_input`` the stages are traced on it and must number
    exactly ``stage_count(schedule)``.

    Raises:
        InvalidSchedule: the model has fewer stages than the schedule (or another number, given ``sample_input``).
        NotSequentialError: given ``sample_input``, the model cannot be cut into stages.
    """
    length = stage_count(schedule)
    if sample_input is None:
        try:
            stages = sequentialize(model)
        except NotSequentialError:  # only this means "cannot be cut without an input"; any other error is real
            return None
        if len(stages) > length:
            return None
    else:
        stages = sequentialize(model, sample_input)
    if len(stages) != length:
        raise _length_mismatch(schedule, length, stages, model)
    return stages


def _length_mismatch(schedule: Schedule, L: int, stages: list[Stage], model: Any) -> InvalidSchedule:
    names = ", ".join(n for n, _ in stages[:8]) + (", ..." if len(stages) > 8 else "")
    return InvalidSchedule(
        f"the schedule is for a chain of {L} stages but {type(model).__name__} has {len(stages)} stages ({names}); "
        f"build the schedule from a chain profiled on this model (hcv.profile(model, x)) or from a chain of "
        f"length {len(stages)}. (A chain profiled at a finer granularity: profile this very model object, or call "
        f"hcv.sequentialize(model, x, granularity=...) on it first, so that its cut is known.)"
    )


def _trusted(model: nn.Module) -> bool:
    """Classes whose forward() is known to run their stages in order: torchvision's and our demo models'."""
    module = type(model).__module__
    return module.split(".")[0] == "torchvision" or module == "hchain_viz.runtime.models"


# ---------------------------------------------------------------------------------------------- recognition
def _structural_stages(model: Any) -> tuple[list[Stage] | None, str]:
    """(stages, kind) by structure alone; kind is "sequential", "list" or "duck"; (None, "") if not recognised."""
    if isinstance(model, nn.Sequential) and _plain_sequential(model):
        return _flatten(model, ""), "sequential"
    if isinstance(model, (list, tuple, nn.ModuleList, nn.ModuleDict, Mapping)):
        return _from_items(model), "list"
    if not isinstance(model, nn.Module):
        raise NotSequentialError(
            f"expected an nn.Module or a list of (name, module) stages, got {type(model).__name__}"
        )
    for recognise in (_resnet_like, _densenet_like, _vgg_like):
        stages = recognise(model)
        if stages is not None:
            return stages, "duck"
    return None, ""


def _plain_sequential(m: nn.Module) -> bool:
    """An nn.Sequential (or subclass) whose forward is Sequential's own: its children run one after another."""
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward and not isinstance(m, _Fused)


def _flatten(module: nn.Module, prefix: str) -> list[Stage]:
    """Children of a plain Sequential, nested plain Sequentials expanded, named by dotted path."""
    out: list[Stage] = []
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if _plain_sequential(child):
            out += _flatten(child, full + ".")
        else:
            out.append((full, child))
    return out


def _from_items(items: Any) -> list[Stage]:
    if isinstance(items, (Mapping, nn.ModuleDict)):
        pairs = list(items.items())
    else:
        pairs = list(enumerate(items))
    out: list[Stage] = []
    for k, item in pairs:
        if (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and not isinstance(items, (Mapping, nn.ModuleDict))):
            name, module = item
        else:
            name, module = k, item
        if not isinstance(module, nn.Module):
            raise NotSequentialError(
                f"stage {k!r} is a {type(module).__name__}, not an nn.Module; a list of stages holds modules or "
                f"(name, module) pairs"
            )
        name = str(name)
        out += _flatten(module, name + ".") if _plain_sequential(module) else [(name, module)]
    return out


def _children_of(m: nn.Module, name: str) -> list[Stage]:
    child = getattr(m, name)
    return _flatten(child, name + ".") if _plain_sequential(child) else [(name, child)]


def _resnet_like(m: nn.Module) -> list[Stage] | None:
    """torchvision ResNet: conv1 bn1 relu [maxpool] layer1..layerK avgpool flatten fc."""
    needed = ("conv1", "bn1", "relu", "layer1", "avgpool", "fc")
    if not all(isinstance(getattr(m, a, None), nn.Module) for a in needed):
        return None
    stages = [("conv1", m.conv1), ("bn1", m.bn1), ("relu", m.relu)]
    if isinstance(getattr(m, "maxpool", None), nn.Module):
        stages.append(("maxpool", m.maxpool))
    k = 1
    while isinstance(getattr(m, f"layer{k}", None), nn.Module):
        stages += _children_of(m, f"layer{k}")
        k += 1
    return stages + [("avgpool", m.avgpool), ("flatten", nn.Flatten(1)), ("fc", m.fc)]


def _densenet_like(m: nn.Module) -> list[Stage] | None:
    """torchvision DenseNet: features, then relu(inplace), adaptive_avg_pool2d(1), flatten, classifier."""
    features, classifier = getattr(m, "features", None), getattr(m, "classifier", None)
    if not (_plain_sequential(features) and isinstance(classifier, nn.Module)):
        return None
    names = [n for n, _ in features.named_children()]
    if not any(n.startswith("denseblock") for n in names):
        return None
    return (_children_of(m, "features") + [("relu", nn.ReLU(inplace=True)), ("pool", nn.AdaptiveAvgPool2d(1)),
                                           ("flatten", nn.Flatten(1))] + _children_of(m, "classifier"))


def _vgg_like(m: nn.Module) -> list[Stage] | None:
    """VGG / AlexNet / EfficientNet / MobileNetV3: features, avgpool, flatten, classifier.
    MobileNetV2 (no avgpool attribute): features, adaptive_avg_pool2d(1), flatten, classifier."""
    features, classifier = getattr(m, "features", None), getattr(m, "classifier", None)
    if not (isinstance(features, nn.Module) and isinstance(classifier, nn.Module)):
        return None
    pool = getattr(m, "avgpool", None)
    stages = _children_of(m, "features")
    stages.append(("avgpool", pool) if isinstance(pool, nn.Module) else ("avgpool", nn.AdaptiveAvgPool2d(1)))
    head = _children_of(m, "classifier")
    if not any(isinstance(mod, nn.Flatten) for _, mod in head):  # ConvNeXt's classifier flattens itself
        stages.append(("flatten", nn.Flatten(1)))
    return stages + head


# ---------------------------------------------------------------------------------------------- in-place fusion
def _declares_inplace(m: nn.Module) -> bool:
    """Modules that say they overwrite their input: ReLU/ReLU6/LeakyReLU/Hardtanh/SiLU/Dropout(inplace=True)..."""
    return getattr(m, "inplace", False) is True


def fuse(stages: list[Stage]) -> Stage:
    """One stage running ``stages`` in order, named ``"a+b"``; fused groups are flattened, not nested."""
    modules: list[nn.Module] = []
    for _, m in stages:
        modules += list(m) if isinstance(m, _Fused) else [m]
    return "+".join(n for n, _ in stages), _Fused(*modules)


class _Fused(nn.Sequential):
    """Stages run as one (so an in-place stage only ever overwrites its predecessor's private output)."""


def _is_compiled(model: Any) -> bool:
    """Whether ``model`` is what ``torch.compile(module)`` returns (checked without importing Dynamo)."""
    return type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module)


def _fuse_marked(stages: list[Stage], marked: list[bool]) -> list[Stage]:
    """Fuse every marked stage into its predecessor. Stage 0 has none: it stays (the executor copes with it)."""
    out: list[Stage] = []
    for stage, mark in zip(stages, marked):
        if mark and out:
            out[-1] = fuse([out[-1], stage])
        else:
            out.append(stage)
    return out


# ---------------------------------------------------------------------------------------------- checking
def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _same(a: Any, b: Any) -> bool:
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-5)
        for x, y in zip(ta, tb)
    )


def _check_stages(model: Any, stages: list[Stage], sample_input: Any, *, compare: bool) -> tuple[bool, list[bool]]:
    """Run the stages once, without grad, on a copy of ``sample_input``, in the modules' own training mode.

    Returns whether they reproduce ``model(sample_input)`` (checked when ``compare``; both runs start from the same
    RNG state, so dropout draws the same masks) and, per stage, whether it bumped the version counter of a tensor
    it received (it wrote into its input). Buffers (BatchNorm statistics) and the RNG state are restored after.
    """
    modules = [m for _, m in stages] + ([model] if isinstance(model, nn.Module) else [])
    restore = buffer_snapshot(modules)
    devices = cuda_devices(sample_input)
    try:
        with torch.no_grad():
            with torch.random.fork_rng(devices=devices):
                h = map_tensors(sample_input, _clone)
                inplace = []
                for _, stage in stages:
                    inputs = tensors(h)
                    versions = [t._version for t in inputs]
                    h = stage(h)
                    inplace.append(any(t._version != v for t, v in zip(inputs, versions)))
            if compare:
                with torch.random.fork_rng(devices=devices):
                    reference = model(map_tensors(sample_input, _clone))
    except Exception as e:  # a shape / device / dtype mismatch of the user's input
        raise ProfileError(
            f"running the stages of {type(model).__name__} on the sample input failed ({type(e).__name__}: {e}); "
            f"check the input's shape, dtype and device against the model"
        ) from e
    finally:
        restore()
    return (not compare or _same(h, reference)), inplace


def _extract(model: Any, sample_input: Any, granularity: str | None, *, why: str) -> list[Stage]:
    """Graph extraction (runtime/graph/, written separately); its NotSequentialError propagates."""
    try:
        from .graph import extract_stages
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.graph":
            raise
        raise NotSequentialError(
            f"cannot split a {type(model).__name__} into a chain: {why}, and automatic graph extraction is not "
            f"available in this installation. Pass the stages yourself as a list of (name, module) pairs."
        ) from None
    return extract_stages(model, sample_input, granularity=granularity)
