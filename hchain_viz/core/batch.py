"""A chain as a function of the batch size (docs/design.md §7): per-stage times and sizes fitted from profiles at two or
more batch sizes, checked on a batch size not used for the fit.

Every field is fitted per entry as ``a + b·B`` by least squares (exact through two points). Activation sizes are
usually exactly linear in the batch size; times are roughly so (small batches pay a fixed launch cost, the
intercept). :func:`fit_batch` builds the fit (a :class:`~hchain_viz.core.chain.BatchFit` the chain carries);
``at_batch(chain, B)`` evaluates it; :func:`fit_error` compares a fitted chain with one profiled at the same batch size.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..errors import HChainError
from .chain import BATCH_FIELDS, BatchFit, Chain, check_batch, unshared_bytes
from .simulate import simulate
from .strategies import store_all


def fit_batch(chains: dict[int, Chain], *, batch: int | None = None) -> Chain:
    """Fit every field of the chains profiled at the batch sizes ``chains`` maps from, and return the chain at
    ``batch`` (default: the smallest profiled size) carrying the fit, so ``at_batch(chain, b)`` answers any size.

    The chains must have the same stages. The fixed part and meta are taken from the chain at the smallest size.
    """
    if len(chains) < 2:
        raise HChainError(f"fitting against the batch size needs profiles at two or more batch sizes, got "
                          f"{sorted(chains)}")
    sizes = sorted(check_batch(b) for b in chains)
    first = chains[sizes[0]]
    for b in sizes[1:]:
        if chains[b].names != first.names:
            raise HChainError(f"the chain profiled at batch {b} has stages {chains[b].names}, unlike the one at batch "
                              f"{sizes[0]} ({first.names}); the model must cut into the same stages at every size")
        if [t[:2] for t in chains[b].shared] != [t[:2] for t in first.shared]:
            raise HChainError(f"the chain profiled at batch {b} has other shared tensors than the one at batch "
                              f"{sizes[0]}; the model must cut the same way at every size")
    design = np.stack([np.ones(len(sizes)), np.asarray(sizes, dtype=np.float64)], axis=1)
    values = {f: [getattr(chains[b], f) for b in sizes] for f in BATCH_FIELDS}
    if first.shared:
        values["shared"] = [[t[2] for t in chains[b].shared] for b in sizes]
    coef = []
    for f, v in values.items():
        (a, s), *_ = np.linalg.lstsq(design, np.asarray(v, dtype=np.float64), rcond=None)  # v: (sizes, entries)
        coef.append((f, tuple(a.tolist()), tuple(s.tolist())))
    fit = BatchFit(batch=sizes[0], sizes=tuple(sizes), coef=tuple(coef))
    return at_batch(replace(first, batch_fit=fit), sizes[0] if batch is None else batch)


def at_batch(chain: Chain, batch: int) -> Chain:
    """``chain`` at another batch size, from the :class:`BatchFit` it carries: ``hcv.at_batch(chain, 64)``.

    Sizes are rounded up to whole bytes, and each ``xbar[i]`` kept at least ``x[i+1]`` (it contains the stage's output).

    Raises:
        HChainError: ``batch`` is not a positive integer, or the chain has no batch-size fit (``fit_batch``,
            ``hcv.profile_batches``).
    """
    b = check_batch(batch)
    if chain.batch_fit is None:
        raise HChainError("this chain has no batch-size fit; profile at two or more batch sizes with "
                          "hcv.profile_batches(model, make_batch, sizes=[...]) to get one")
    v = chain.batch_fit.values(b)
    x = [_whole(s) for s in v["x"]]
    xbar = [max(_whole(s), x[i + 1]) for i, s in enumerate(v["xbar"])]
    shared = chain.shared
    if "shared" in v:  # a shared tensor is part of every x it crosses: never larger than the smallest of them
        shared = tuple((f, la, min(_whole(s), *x[f:la + 1])) for (f, la, _), s in zip(chain.shared, v["shared"]))

    # Transit and consumed bytes are parts of x[i]: the same share of it at every batch size (rounded down: they are
    # freed), within the bytes no shared tensor holds.
    def part(values: tuple[int, ...]) -> list[int]:
        return [v * x[i] // chain.x[i] if chain.x[i] else 0 for i, v in enumerate(values)]

    room = unshared_bytes(x, shared)
    transit = [max(0, min(t, r)) for t, r in zip(part(chain.transit), room)]
    consumed = [max(0, min(c, r - t)) for c, t, r in zip(part(chain.consumed), transit, room)]

    # A gradient's size and the no-grad transient follow the stage input's size (rounded up: both are charged).
    def scaled(values: tuple[int, ...] | None) -> list[int] | None:
        return None if values is None else [-(-v * x[i] // chain.x[i]) if chain.x[i] else v
                                            for i, v in enumerate(values)]

    # The gradient handed through B(i) follows δ_{i+1}'s size (rounded down: it is not charged), within δ_i.
    def through(values: tuple[int, ...]) -> list[int]:
        delta = scaled(chain.delta) or x
        return [min(v * x[i + 1] // chain.x[i + 1] if chain.x[i + 1] else 0, delta[i], delta[i + 1])
                for i, v in enumerate(values)]

    return replace(chain, fwd_time=v["fwd_time"], bwd_time=v["bwd_time"], x=x, xbar=xbar, shared=shared,
                   transit=transit, consumed=consumed, delta=scaled(chain.delta),
                   delta_through=through(chain.delta_through),
                   nograd_tmp=scaled(chain.nograd_tmp), fwd_tmp=[_whole(s) for s in v["fwd_tmp"]],
                   bwd_tmp=[_whole(s) for s in v["bwd_tmp"]],
                   batch_fit=replace(chain.batch_fit, batch=b))


def _whole(v: float) -> int:
    """Bytes rounded up, but not for the last bits of float noise of a least-squares fit."""
    return math.ceil(v - 1e-9 * abs(v) - 1e-6)


def fit_error(fitted: Chain, measured: Chain) -> dict[str, float]:
    """Relative errors (fitted / measured - 1) of a fitted chain against one profiled at the same batch size:
    ``store_all_peak`` (simulated activation peak), ``store_all_time`` (sum of stage times), and ``size_max`` (the
    largest error of any single nonzero x / xbar / fwd_tmp / bwd_tmp entry, as an absolute value)."""
    if fitted.names != measured.names:
        raise HChainError("fit_error compares chains of the same stages")
    pf, pm = (simulate(c, store_all(c)).peak_memory for c in (fitted, measured))
    worst = 0.0
    for f in ("x", "xbar", "fwd_tmp", "bwd_tmp"):
        for a, m in zip(getattr(fitted, f), getattr(measured, f)):
            if m > 0:
                worst = max(worst, abs(a / m - 1))
    return {"store_all_peak": pf / pm - 1 if pm else 0.0,
            "store_all_time": fitted.store_all_time / measured.store_all_time - 1 if measured.store_all_time else 0.0,
            "size_max": worst}
