"""The precision a training step runs in: the active ``torch.autocast`` and the parameters' dtype (docs/design.md §11).

A traced stage (``torch.export``) is specialised to the precision it was traced in: its dtype casts are fixed and
each is asserted at run time. So stages are traced in the precision that runs, and profiles measure in it;
``chain.meta["precision"]`` names the profiled one, and an applied schedule warns at the first step run in another.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..errors import ProfileError

_DEVICE_TYPES = ("cpu", "cuda")
_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)

# (the autocast regions active now, as (device type, dtype) pairs; the parameters' floating dtype)
Precision = tuple[tuple[tuple[str, torch.dtype], ...], torch.dtype | None]


def autocast_now() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast regions active in this thread: ``(("cpu", torch.bfloat16),)`` inside
    ``torch.autocast("cpu", dtype=torch.bfloat16)``, ``()`` outside any."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES if torch.is_autocast_enabled(d))


def param_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the model's weights compute in (None: it has no floating-point parameter): its first floating-point
    parameter's, or under FSDP2 (``fully_shard``) its ``MixedPrecisionPolicy``'s ``param_dtype``, which the gathered
    copies take for the forward while the sharded parameters keep their own."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return None if dtype is None else fsdp_param_dtype(model) or dtype


def fsdp_param_dtype(model: nn.Module) -> torch.dtype | None:
    """The ``param_dtype`` of the outermost FSDP2 module's policy (None: no FSDP2 module, or no cast)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded by it
    if fsdp is None:
        return None
    outer = next((m for m in model.modules() if isinstance(m, fsdp.FSDPModule)), None)
    # FSDP2 has no public getter for a module's policy (torch 2.13): its state's, or none when that ever moves
    policy = getattr(outer._get_fsdp_state(), "_mp_policy", None) if outer is not None else None
    return getattr(policy, "param_dtype", None)


def precision_of(model: nn.Module) -> Precision:
    """The precision ``model`` runs in now: the active autocast and its parameters' dtype."""
    return autocast_now(), param_dtype(model)


def resolution(precision: Precision) -> float:
    """The coarsest machine epsilon among the dtypes the step computes in (autocast's and the weights'): the unit
    of the rounding differences two orders of the same ops may show."""
    autocast, dtype = precision
    return max(torch.finfo(d).eps for d in (*(d for _, d in autocast), dtype or torch.float32))


def describe(precision: Precision) -> str:
    """``"float32, no autocast"``, ``"autocast bfloat16 (cpu) over float32 weights"``, ``"bfloat16, no autocast"``:
    for messages and ``chain.meta["precision"]``."""
    autocast, dtype = precision
    weights = _short(dtype) if dtype is not None else "no floating-point weights"
    if not autocast:
        return f"{weights}, no autocast"
    regions = ", ".join(f"autocast {_short(d)} ({device})" for device, d in autocast)
    return f"{regions} over {weights} weights"


def uncached(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a stage's input leaf whose casts autocast does not cache, as it never caches eager's activations.

    Autocast caches the lower-precision cast of a float32 leaf that requires grad (meant for weights) unless the leaf
    is a view. Cached, one cast feeds every op that reads the input (BERT's query, key and value projections), and
    their input gradients add up in bfloat16 before the cast back instead of in float32: 0.3% off eager's. Callers
    use it where autocast runs (or will run: a recomputation in the backward enters it after making its leaves)."""
    return t.view_as(t)


def runs_in(stages: list[tuple[str, nn.Module]] | None, precision: Precision) -> bool:
    """Whether ``stages`` run in ``precision``: none of them was traced by torch.export in another."""
    return stages is not None and all(getattr(m, "precision", None) in (None, precision) for _, m in stages)


def warn_other_precision(now: str, profiled: str, stacklevel: int) -> None:
    """The warning of a training step run in another precision than the one its schedule was profiled in."""
    warnings.warn(
        f"this training step runs in {now}, but its schedule was profiled in {profiled}: it trains right (its "
        f"stages are traced again for this precision) but its memory was planned for the other one (autocast halves "
        f"most activations, not softmax inputs, norms or the loss). Profile in the precision that trains: "
        f"hcv.checkpoint(model, batch, budget, autocast=torch.bfloat16), or profile inside the autocast",
        PrecisionWarning, stacklevel=stacklevel)


class PrecisionWarning(UserWarning):
    """A schedule runs in another precision than the one it was profiled in."""


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def running(dtype: Any, device: torch.device) -> Any:
    """The context a profile runs in for ``autocast=dtype`` (``None``: the caller's, unchanged).

    Raises:
        ProfileError: ``dtype`` is not one autocast runs in, or the device cannot run it (bfloat16 on a CUDA GPU
            without it); the message names both.
    """
    if dtype is None:
        return nullcontext()
    if dtype not in _AUTOCAST_DTYPES:
        raise ProfileError(f"autocast={dtype!r}: autocast runs in torch.bfloat16 or torch.float16; pass one of them "
                           f"(or None to profile in the precision active around the call)")
    if device.type not in _DEVICE_TYPES:
        raise ProfileError(f"autocast={_short(dtype)} on a {device.type} device: hchain_viz profiles autocast on "
                           f"cpu and cuda only")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(False):
        raise ProfileError(f"autocast={_short(dtype)}: the CUDA device {torch.cuda.get_device_name(device)} has no "
                           f"native bfloat16; train and profile with autocast=torch.float16 (and a GradScaler)")
    return torch.autocast(device.type, dtype=dtype)
