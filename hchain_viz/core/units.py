"""Units at the edges: bytes and seconds inside, MiB/GiB and ms only when printing or parsing user text."""

from __future__ import annotations

import math
import numbers
import re

from ..errors import HChainError, InvalidChain

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``; binary units, at most three significant figures."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    if math.isinf(n):
        return "inf"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{sign}{v:.3g} {unit}" if v < 1000 else f"{sign}{v:.0f} {unit}"
    return f"{sign}{int(n)} B"


def format_time(s: float) -> str:
    """``0.0123 -> '12.3 ms'``."""
    if s is None or math.isnan(s):
        return "n/a"
    if math.isinf(s):
        return "inf"
    a = abs(s)
    if a >= 1:
        return f"{s:.3g} s" if a < 1000 else f"{s:.0f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{s * 1e6:.3g} µs"
    return f"{s * 1e9:.3g} ns" if a else "0 s"


def parse_bytes(text: str | int | float) -> int:
    """``'300MiB' -> 314572800``; plain numbers are bytes. Raises HChainError on anything else."""
    if isinstance(text, numbers.Real) and not isinstance(text, bool):  # numpy integers too, without a float trip
        if text < 0 or not math.isfinite(text):
            raise HChainError(f"a memory size must be a finite non-negative number of bytes, got {text!r}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise HChainError(
            f"cannot read {text!r} as a memory size; write it like '300MiB', '1.5GiB', '2GB' or a number of bytes"
        )
    value = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if not math.isfinite(value):  # '1e400' overflows to inf
        raise HChainError(f"memory size {text!r} is too large to be a number of bytes")
    return int(value)


def finite_nonnegative(v: object, label: str, what: str = "times and sizes", kind: str = "a number") -> float:
    """``v`` as a float, or :class:`InvalidChain` naming ``label`` (``"x[3]"``, ``"fixed.params"``) when it is not a
    number, or is NaN, infinite or negative (the one check behind every time and size a chain holds)."""
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidChain(f"{label} = {v!r} is not {kind}") from None
    if math.isnan(f) or math.isinf(f) or f < 0:
        raise InvalidChain(f"{label} = {v!r}; {what} must be finite and non-negative")
    return f
