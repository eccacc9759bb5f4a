"""The entry points of graph extraction: :func:`extract_stages` (trace, plan, cut, name, build, verify) and
:func:`cached_stages`, with the input convention they share (see the package docstring)."""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from torch import nn

from ...errors import NotSequentialError
from ..precision import precision_of
from .plan import _NoCut, _Plan
from .tracing import _route_root_buffers, _sharding_hooks_off, _trace_export, _trace_fx
from .verify import _verify

# The latest extraction per model, granularity and precision (None: stages that run in any, traced by torch.fx), for
# callers that get no sample input (see cached_stages).
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[Any, list[tuple[str, nn.Module]]]] = weakref.WeakKeyDictionary()


def extract_stages(model: nn.Module, sample_input: Any, *,
                   granularity: None | str | int = None) -> list[tuple[str, nn.Module]]:
    """Cut ``model`` into a chain of named stages whose sequential run equals ``model(sample_input)``.

    Args:
        model: any ``nn.Module``; its parameters and buffers are shared with the stages, never copied.
        sample_input: a tensor (``model(x)``), a tuple/list (``model(*x)``) or a dict (``model(**x)``). Stage 0
            takes this same object.
        granularity: ``None`` or ``"module"`` (default): cut only between whole blocks, plus ``"stem"`` and
            ``"head"``; ``"sublayer"``: also inside the blocks, where a few tensors cross, named by role
            (``h.3.attn.probs``); ``"finest"``: every cut point; an int ``N``: ``N`` stages balanced by the measured
            time of their ops. Names, and encoder-decoders: docs/models.md; the cuts: docs/design.md §8.

    Returns:
        ``[(name, stage), ...]`` of :class:`GraphStage` objects; ``stage.group`` names the block (``"h.3"``,
        ``None`` for the stem and head), ``stage.tag`` is ``"attn_core"`` on the core attention's stages.

    Raises:
        NotSequentialError: the model could not be traced (data-dependent control flow, unsupported inputs), has
            no cut point, or ``granularity`` is not one of the accepted values. The message says what failed and
            how to pass the stages by hand.
    """
    mode = _check_granularity(granularity)
    if not isinstance(model, nn.Module):
        raise NotSequentialError(f"extract_stages needs an nn.Module; got {type(model).__name__}")
    args, kwargs = _as_call(sample_input)
    kwargs = _without_cache(model, kwargs)
    single = not isinstance(sample_input, (dict, tuple, list))  # stage 0 gets the tensor itself, not a 1-tuple
    failures: list[str] = []
    for method, tracer in (("torch.fx", _trace_fx), ("torch.export", _trace_export)):
        try:
            with _sharding_hooks_off(model):  # FSDP2's gathered parameters stay in place (tracing.py)
                traced = _route_root_buffers(tracer(model, args, kwargs, single), model)
                plan = _Plan.make(traced, model, sample_input, timed=isinstance(mode, int))
                segments = plan.segments(mode)
                names = plan.names(segments, mode)
                if len(set(names)) != len(names):  # names key chains, schedules and figures: never ambiguous
                    raise AssertionError(f"repeated stage names {sorted({n for n in names if names.count(n) > 1})}")
                stages = [(name, plan.build_stage(a, b, name)) for (a, b), name in zip(segments, names)]
                for (_, stage), group, tag in zip(stages, plan.groups, plan.tags):
                    stage.group, stage.tag = group, tag
                _verify(model, sample_input, args, kwargs, stages)
        except _NoCut as exc:
            failures.append(f"{method}: {exc}")
            continue
        except Exception as exc:  # each tracer fails in its own ways; the message collects them all
            failures.append(f"{method}: {type(exc).__name__}: {_first_line(exc)}")
            continue
        precision = stages[0][1].precision
        _CACHE.setdefault(model, {})[mode, precision] = stages
        _CACHE[model][None, precision] = stages
        return stages
    raise NotSequentialError(
        f"could not cut {type(model).__name__} into a chain of stages automatically:\n  - "
        + "\n  - ".join(failures)
        + "\nPass the stages by hand instead: a list of (name, module) pairs or an nn.Sequential whose modules "
          "each take the previous one's output (a tensor or a tuple of tensors), keeping any `if` on tensor "
          "values inside one stage (or rewrite it with torch.where / torch.cond so that it can be traced).")


def cached_stages(model: nn.Module, granularity: None | str | int | object = ...) -> list[tuple[str, nn.Module]] | None:
    """The stages of the latest :func:`extract_stages` call on ``model`` (with this granularity if given) that run in
    the precision active now (runtime/precision.py), or None.

    For callers that have the model but no sample input (``wrap(model, schedule)`` after ``profile(model, x)``).
    """
    per_model = _CACHE.get(model)
    if per_model is None:
        return None
    key = None if granularity is ... else _check_granularity(granularity)
    found = per_model.get((key, precision_of(model)))
    return found if found is not None else per_model.get((key, None))


# ----------------------------------------------------------------------------------------------------------------
# input conventions and small helpers


def _check_granularity(granularity: Any) -> str | int:
    if granularity is None or granularity == "module":
        return "module"
    if granularity in ("finest", "sublayer"):
        return granularity
    if isinstance(granularity, int) and not isinstance(granularity, bool) and granularity >= 1:
        return granularity
    raise NotSequentialError(
        f"granularity must be None or 'module' (whole blocks), 'sublayer' (blocks cut where the residual stream and "
        f"the current value cross), 'finest' (every single-value cut point) or a positive int (that many balanced "
        f"stages); got {granularity!r}")


def _as_call(sample_input: Any) -> tuple[tuple, dict]:
    """Split the sample input into (args, kwargs) by the convention of the module docstring."""
    if isinstance(sample_input, dict):
        return (), dict(sample_input)
    if isinstance(sample_input, (tuple, list)):
        return tuple(sample_input), {}
    return (sample_input,), {}


def _without_cache(model: nn.Module, kwargs: dict) -> dict:
    """The call's keyword arguments with ``use_cache=False`` added for models that keep a KV cache (Hugging Face).

    Training never reads the cache, and a cache object in the output cannot be traced. This is what HF's own
    gradient checkpointing does: it passes ``use_cache=False`` in the call and leaves ``model.config`` unchanged;
    so do we (the stages are traced with it; the user's config and input dict are not modified).
    """
    config = getattr(model, "config", None)
    takes = "use_cache" in inspect.signature(model.forward).parameters or hasattr(config, "use_cache")
    if not takes or kwargs.get("use_cache") is False:
        return kwargs
    return {**kwargs, "use_cache": False}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
