"""Profile a model at several batch sizes and fit its chain as a function of the batch size (docs/design.md §7).

``profile_batches(model, make_batch, sizes=(8, 16))`` profiles at each size, fits every per-stage time and size as
``a + b·B`` (:func:`~hchain_viz.core.batch.fit_batch`), profiles once more at a held-out ``check`` size and records
how far the fit is from it in ``chain.meta["batch_fit_check"]``. ``hcv.at_batch(chain, B)`` gives the returned chain
at any batch size B.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.batch import at_batch, check_batch, fit_batch, fit_error
from ..core.chain import Chain
from ..errors import HChainError, ProfileError
from .profile import profile

__all__ = ["profile_batches", "batch_of"]


def batch_of(make_batch: Callable[[int], Any], b: int) -> tuple[Any, Any]:
    """``(sample_input, loss_fn)`` from ``make_batch(b)``, which returns either that pair (``loss_fn`` may be None)
    or just the sample input (then the default loss is used)."""
    try:
        out = make_batch(b)
    except HChainError:
        raise
    except Exception as e:
        raise ProfileError(f"make_batch({b}) failed ({type(e).__name__}: {e}); it must build a batch of {b} "
                           f"samples and return (sample_input, loss_fn) or just the sample input") from e
    if isinstance(out, tuple) and len(out) == 2 and (out[1] is None or callable(out[1])):
        return out
    return out, None


def profile_batches(model: Any, make_batch: Callable[[int], Any], sizes: Sequence[int] = (8, 16), *,
                    check: int | None = None, optimizer: torch.optim.Optimizer | None = None, world_size: int = 1,
                    **profile_kwargs: Any) -> Chain:
    """Profile ``model`` at each batch size in ``sizes`` (two or more) and return the fitted chain at the smallest.

    ``make_batch(b)`` returns ``(sample_input, loss_fn)`` for a batch of ``b`` samples (or just the input).
    ``check``: a batch size not used for the fit, profiled to measure the fit's error (default: the largest size
    plus the smallest, an extrapolation); ``check=0`` skips it. ``optimizer`` / ``world_size``: as in
    :func:`~hchain_viz.runtime.profile.profile` (the fixed part is measured once, at the smallest size; it does not
    depend on the batch size). Other keyword arguments go to ``profile``.

    ``chain.meta["batch_fit_check"]``: ``{"batch": check, "store_all_peak": ..., "store_all_time": ...,
    "size_max": ...}``, relative errors of the fit against the profile at ``check``.
    """
    sizes = sorted({check_batch(b) for b in sizes})
    if len(sizes) < 2:
        raise HChainError(f"profile_batches needs two or more distinct batch sizes to fit against, got {sizes}")
    check = sizes[-1] + sizes[0] if check is None else check
    if check != 0:
        check = check_batch(check)
        if check in sizes:
            raise HChainError(f"the check batch size {check} is one of the fitted sizes {sizes}; pick another, so "
                              f"the check is honest")
    chains = {}
    for k, b in enumerate(sizes):
        x, loss_fn = batch_of(make_batch, b)
        chains[b] = profile(model, x, loss_fn, optimizer=optimizer if k == 0 else None, world_size=world_size,
                            **profile_kwargs)
    fitted = fit_batch(chains)
    if check:
        x, loss_fn = batch_of(make_batch, check)
        measured = profile(model, x, loss_fn, **profile_kwargs)
        err = fit_error(at_batch(fitted, check), measured)
        fitted.meta["batch_fit_check"] = {"batch": check, **err}
    fitted.meta["batch_sizes"] = sizes
    return fitted
