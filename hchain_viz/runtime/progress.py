"""A progress bar for long loops (profiling) that leaves plain text behind in notebooks.

tqdm's notebook bar is an ipywidget. Once the loop ends the widget is gone, but the notebook keeps a reference to it in
the cell's output: a saved and reloaded notebook then shows "Error displaying widget: model not found". Here, in a
notebook kernel, the bar is a widget displayed with a display id, and when it closes the same output is replaced by
one line of text (``profiling: 12/12 stages in 2.1 s``), so what the notebook saves is text. Elsewhere it is tqdm's
text bar.
"""

from __future__ import annotations

import html
import time
from typing import Any

__all__ = ["progress_bar"]

DELAY_S = 0.5  # no bar at all for loops quicker than this


def _in_kernel() -> bool:
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
    if enabled and _in_kernel():
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            pass
        else:
            return _NotebookBar(total, desc, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, delay=DELAY_S, leave=False)


class _NotebookBar:
    """An ipywidgets bar shown after :data:`DELAY_S`, replaced in the output by a line of text when it closes."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.postfix = ""
        self._t0 = time.perf_counter()
        self._handle: Any = None
        self._widgets: Any = None

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
        label.value = html.escape(f"{self.n}/{self.total} {self.postfix}")

    def close(self, failed: bool = False) -> None:
        """Replace the widget by a line of text in the output (the notebook saves that), then release it."""
        if self._widgets is None:
            return
        box = self._widgets[0]
        self._widgets = None
        text = self._text() + (f" (stopped at {self.postfix})" if failed and self.postfix else "")
        self._handle.update({"text/plain": text}, raw=True)
        box.close()
        for w in box.children:
            w.close()
