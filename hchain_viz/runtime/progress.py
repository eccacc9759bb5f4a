"""A progress bar for long loops (profiling) that leaves plain text behind in notebooks.

tqdm's notebook bar is an ipywidget. Once the loop ends the widget is gone, but the notebook keeps a reference to it in
the cell's output: a saved and reloaded notebook then shows "Error displaying widget: model not found". Here, in a
notebook kernel, the bar is a widget displayed with a display id, and when it closes the same output is replaced by
one line of text (``profiling: 12/12 stages in 2.1 s``), so what the notebook saves is text. Elsewhere it is tqdm's
text bar.

:func:`status` does the same for a step without a count (building the explorer): in a notebook, a line that counts
the seconds while the step runs, so that no stretch of a long cell passes without a sign of life.
"""

from __future__ import annotations

import contextvars
import html
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["progress_bar", "status", "until_the_cell_ends", "in_kernel"]

DELAY_S = 0.5  # no bar at all for loops quicker than this


def in_kernel() -> bool:
    """True inside a Jupyter kernel (a frontend that can show widgets may be attached)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True) -> Any:
    """A context manager with ``update(n=1)`` and ``set_postfix_str(text)``: a widget that turns into text in a
    notebook, tqdm's text bar elsewhere, nothing when ``enabled`` is false."""
    if enabled and in_kernel():
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            pass
        else:
            return _NotebookBar(total, desc, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, delay=DELAY_S, leave=False)


class _NotebookBar:
    """An ipywidgets bar shown after :data:`DELAY_S`, replaced in the output by a line of text when it closes. Its
    label counts the seconds (a timer thread): one stage can take long on a busy machine, and must not look stuck."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.postfix = ""
        self._t0 = time.perf_counter()
        self._handle: Any = None
        self._widgets: Any = None
        self._lock = threading.Lock()  # the loop's thread and the timer both draw
        self._done = threading.Event()
        threading.Thread(target=contextvars.copy_context().run, args=(self._tick,), name="hchain_viz progress",
                         daemon=True).start()

    def _tick(self) -> None:
        while not self._done.wait(0.5):
            self._show()

    def __enter__(self) -> _NotebookBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(failed=exc[0] is not None)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text
        self._show()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._show()

    def _text(self) -> str:
        return f"{self.desc}: {self.n}/{self.total} {self.unit}s in {time.perf_counter() - self._t0:.1f} s"

    def _show(self) -> None:
        with self._lock:
            if self._done.is_set():
                return
            if self._widgets is None:
                if time.perf_counter() - self._t0 < DELAY_S:
                    return
                import ipywidgets as W
                from IPython.display import display

                bar = W.IntProgress(min=0, max=max(self.total, 1), description=self.desc)
                label = W.HTML()
                self._widgets = (W.HBox([bar, label]), bar, label)
                self._handle = display(self._widgets[0], display_id=True)
            box, bar, label = self._widgets
            bar.value = self.n
            label.value = html.escape(f"{self.n}/{self.total} {self.postfix} · {time.perf_counter() - self._t0:.0f} s")

    def close(self, failed: bool = False) -> None:
        """Replace the widget by a line of text in the output (the notebook saves that), then release it."""
        with self._lock:
            self._done.set()
        if not failed:  # the cell goes on (solve, wrap, steps, the explorer): that must not look stuck either
            until_the_cell_ends(f"after {self.desc}, the rest of the cell")
        if self._widgets is None:
            return
        box = self._widgets[0]
        self._widgets = None
        self._final = self._text() + (f" (stopped at {self.postfix})" if failed and self.postfix else "")
        self._handle.update({"text/plain": self._final}, raw=True)
        box.close()
        for w in box.children:
            w.close()

    def note(self, text: str) -> None:
        """Add ``text`` to the line the bar left (or show it as a line of its own when the bar never showed)."""
        if self._handle is None:
            from IPython.display import display

            display({"text/plain": f"{self.desc}: {text}"}, raw=True)
            return
        self._final = f"{getattr(self, '_final', self._text())} · {text}"
        self._handle.update({"text/plain": self._final}, raw=True)


@contextmanager
def status(desc: str, enabled: bool = True) -> Iterator[None]:
    """While the block runs longer than :data:`DELAY_S`, show ``desc… 1.2 s`` in a notebook, counting the seconds
    (a timer thread updates it: the block itself may be one long call); when it ends the line says how long it took.
    Nothing outside a notebook kernel."""
    ticker = _Ticker.start(desc) if enabled and in_kernel() else None
    try:
        yield
    finally:
        if ticker is not None:
            ticker.stop()


def until_the_cell_ends(desc: str) -> None:
    """In a notebook, a :func:`status` line from now until the running cell finishes: after profiling, a cell goes
    on (solve, wrap, a few steps, the explorer) and must not look stuck meanwhile. Nothing elsewhere."""
    if not in_kernel():
        return
    from IPython import get_ipython

    ip = get_ipython()
    ticker = None if ip is None else _Ticker.start(desc)
    if ticker is None:
        return
    events = ip.events

    def done(*_: Any) -> None:
        events.unregister("post_run_cell", done)
        ticker.stop()

    events.register("post_run_cell", done)


class _Ticker:
    """A line ``desc… 3.5 s`` that a timer thread shows after :data:`DELAY_S` and updates twice a second; stop()
    turns it into text (``desc: 3.5 s``) that the notebook saves."""

    def __init__(self, desc: str, widgets: Any):
        self.desc, self.W = desc, widgets
        self.t0 = time.perf_counter()
        self.done = threading.Event()
        self.label: Any = None
        self.handle: Any = None
        # the thread runs in this cell's context: its output goes to this cell (ipykernel keeps the parent message
        # in a context variable)
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._tick,),
                                       name="hchain_viz status", daemon=True)

    @classmethod
    def start(cls, desc: str) -> _Ticker | None:
        try:
            import ipywidgets
        except ImportError:
            return None
        ticker = cls(desc, ipywidgets)
        ticker.thread.start()
        return ticker

    def _tick(self) -> None:
        from IPython.display import display

        while not self.done.wait(DELAY_S if self.label is None else 0.5):
            text = f"{self.desc}… {time.perf_counter() - self.t0:.1f} s"
            if self.label is None:
                self.label = self.W.Label(text)
                self.handle = display(self.label, display_id=True)
            else:
                self.label.value = text

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        if self.label is not None:
            self.handle.update({"text/plain": f"{self.desc}: {time.perf_counter() - self.t0:.1f} s"}, raw=True)
            self.label.close()
