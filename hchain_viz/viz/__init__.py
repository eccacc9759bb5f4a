"""Views of schedules: plotly figures, the notebook explorer and the offline HTML export.

Imported lazily (``import hchain_viz`` does not load plotly or ipywidgets): ``figures`` needs plotly, ``Explorer``
and ``explore`` need ipywidgets as well.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "timeline": "figures",
    "memory_curve": "figures",
    "storage_tape": "figures",
    "frontier": "figures",
    "Explorer": "explorer",
    "explore": "explorer",
    "to_html": "html",
}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hchain_viz.viz' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
