"""Coalescing throttle for widget events: run a handler at most once per interval, and always with the last value.

A dragged slider sends a stream of values; recomputing and redrawing for every one of them would queue work the
user never sees. :class:`Throttle` runs the first value at once, then at most one call per ``interval`` seconds,
and a trailing call with the newest value so the display always ends on where the slider stopped. The trailing call is
scheduled on the running asyncio loop (the notebook kernel's); without a loop (scripts, tests) every call runs at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

_NOTHING = object()


class Throttle:
    """``Throttle(fn, interval)(value)``: call ``fn(value)`` now, or later with the newest value if called too soon."""

    def __init__(self, fn: Callable[[Any], None], interval: float, clock: Callable[[], float] = time.monotonic):
        self.fn = fn
        self.interval = interval  # seconds between two calls of fn
        self.clock = clock
        self._last = -float("inf")  # clock() of the last call of fn
        self._pending: Any = _NOTHING  # newest value not yet passed to fn
        self._handle: asyncio.TimerHandle | None = None  # the scheduled trailing call

    def __call__(self, value: Any) -> None:
        self._pending = value
        if self._handle is not None:  # a trailing call is already on its way; it will take this value
            return
        wait = self._last + self.interval - self.clock()
        loop = _running_loop()
        if wait <= 0 or loop is None:
            self._fire()
        else:
            self._handle = loop.call_later(wait, self._fire)

    @property
    def pending(self) -> bool:
        """True while a value waits for its trailing call."""
        return self._pending is not _NOTHING

    def flush(self) -> None:
        """Run the pending value now (if any) and cancel the trailing call."""
        if self._handle is not None:
            self._handle.cancel()
        if self.pending:
            self._fire()

    def cancel(self) -> None:
        """Drop the pending value and its trailing call."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._pending = _NOTHING

    def _fire(self) -> None:
        self._handle = None
        value, self._pending = self._pending, _NOTHING
        if value is _NOTHING:
            return
        self._last = self.clock()
        self.fn(value)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
