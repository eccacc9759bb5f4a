"""Chains profiled from real models, shipped with the package.

The course and the explorer guide use them where installing torchvision and profiling a real network would take
longer than the lesson. Each is a plain :class:`~hchain_viz.core.chain.Chain` (torch-free to load); its ``meta``
says how it was profiled, and, for a model users checkpoint with ``checkpoint_sequential`` over its top-level
children, where each segment count's segments start in this chain (:func:`checkpoint_sequential`).

    from hchain_viz import examples
    chain = examples.load("densenet121-sublayer")
    examples.checkpoint_sequential(chain, 3)   # what checkpoint_sequential(children, 3, x) runs, on this chain

Regenerate them (needs torchvision; a few minutes on a CPU): ``python -m hchain_viz.examples``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from .core import strategies
from .core.chain import Chain
from .core.schedule import Schedule
from .errors import HChainError

__all__ = ["NAMES", "load", "checkpoint_sequential", "segment_counts"]

_DATA = Path(__file__).resolve().parent / "data"
# name -> (torchvision model, granularity); all at batch 4, 3x128x128, random weights, CPU, one thread
_MODELS = {"densenet121-module": ("densenet121", "module"), "densenet121-sublayer": ("densenet121", "sublayer")}
NAMES = tuple(_MODELS)
_BATCH, _SIDE = 4, 128


def load(name: str) -> Chain:
    """The shipped chain ``name`` (one of :data:`NAMES`)."""
    if name not in _MODELS:
        raise HChainError(f"no example chain {name!r}; choose from {', '.join(NAMES)}")
    return Chain.from_json(_DATA / f"{name}.json")


def segment_counts(chain: Chain) -> list[int]:
    """The segment counts ``n`` for which :func:`checkpoint_sequential` knows this chain's segment starts."""
    return sorted(int(n) for n in _starts_of(chain))


def checkpoint_sequential(chain: Chain, segments: int) -> Schedule:
    """What ``checkpoint_sequential(children, segments, x)`` over the model's top-level children runs, replayed on
    this (finer) chain: its segments start at the first stage of the child that starts them."""
    starts = _starts_of(chain).get(str(segments))
    if starts is None:
        raise HChainError(f"segments must be one of {segment_counts(chain)} (the model's top-level children), got "
                          f"{segments!r}")
    schedule = strategies.segments(chain, starts)
    return Schedule(schedule.ops, {"strategy": "checkpoint_sequential", "segments": segments})


def _starts_of(chain: Chain) -> dict[str, list[int]]:
    known = chain.meta.get("checkpoint_sequential", {}).get("starts")
    if not known:
        raise HChainError("this chain does not record checkpoint_sequential's segments over the model's children; "
                          "use an example chain (hchain_viz.examples.load) or strategies.periodic on your own")
    return known


def _regenerate(out: Path = _DATA) -> None:
    """Profile each example model and write its chains (needs torchvision)."""
    import torch
    import torchvision

    from .bench.models import cross_entropy, segment_starts, user_stages
    from .runtime.profile import profile
    from .runtime.stages import sequentialize

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    for name, (arch, granularity) in _MODELS.items():
        torch.manual_seed(0)
        model = getattr(torchvision.models, arch)(weights=None, num_classes=10).train()
        x, target = torch.randn(_BATCH, 3, _SIDE, _SIDE), torch.randint(0, 10, (_BATCH,))
        stages = sequentialize(model, x, granularity=granularity)
        chain = profile(stages, x, cross_entropy(target), progress=True)
        user = user_stages(arch, model)
        starts = {str(n): list(segment_starts(user, chain.names, n)) for n in range(1, len(user) + 1)}
        source = (f"torchvision {arch}, random weights, batch {_BATCH}, 3x{_SIDE}x{_SIDE}, cross-entropy loss, "
                  f"granularity {granularity!r}, CPU, 1 thread, torch {torch.__version__}, torchvision "
                  f"{torchvision.__version__}")
        chain = dataclasses.replace(chain, meta={**chain.meta, "source": source, "checkpoint_sequential": {
            "children": [n for n, _ in user], "starts": starts}})
        chain.to_json(out / f"{name}.json")
        print(f"{name}: {chain.length} stages -> {out / (name + '.json')}")


if __name__ == "__main__":
    _regenerate(Path(sys.argv[1]) if len(sys.argv) > 1 else _DATA)
