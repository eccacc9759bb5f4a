"""Helpers of the course notebooks (``notebooks/course/``): teaching chains in abstract units, and exercise checks.

The lessons work on small chains whose times and sizes are plain numbers ("units"), not seconds and bytes.
:func:`abstract` marks such a chain so that :mod:`hchain_viz.figures` labels its axes in units, and :func:`mem` /
:func:`time` print numbers the same way. :func:`check` compares a reader's prediction with what the simulator says
and explains the answer either way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .core.chain import Chain

__all__ = ["abstract", "is_abstract", "mem", "time", "check"]


def abstract(chain: Chain) -> Chain:
    """``chain`` with ``meta["units"] = "abstract"``: figures and these helpers print its numbers as units."""
    return dataclasses.replace(chain, meta={**chain.meta, "units": "abstract"})


def is_abstract(chain: Any) -> bool:
    meta = getattr(chain, "meta", None)
    return isinstance(meta, dict) and meta.get("units") == "abstract"


def _num(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.4g}"


def mem(v: float) -> str:
    """A memory size of a teaching chain: ``'12 units'``."""
    return f"{_num(v)} units"


def time(v: float) -> str:
    """A duration of a teaching chain: ``'56 time units'``."""
    return f"{_num(v)} time units"


def check(answer: Any, expected: float, *, why: str, unit: str = "units", tol: float = 0.0) -> bool:
    """Print whether ``answer`` matches ``expected`` (within ``tol``, absolute) and why; return True when it does.

    ``answer`` left as ``...`` (or None) prints a reminder instead of a verdict, so a notebook still runs top to
    bottom before the reader has answered.
    """
    if answer is ... or answer is None:
        print(f"Write your prediction in `answer` and run this cell again. (Hint: the answer is in {unit}.)")
        return False
    try:
        value = float(answer)
    except (TypeError, ValueError):
        print(f"`answer` should be a number of {unit}, got {answer!r}.")
        return False
    ok = abs(value - expected) <= tol
    verdict = "Right" if ok else "Not quite"
    print(f"{verdict}: you said {_num(value)}, the simulator says {_num(expected)} {unit}.\nWhy: {why}")
    return ok
