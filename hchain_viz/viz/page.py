"""What every offline page shares (:mod:`.html`'s explorer page, :mod:`.pipeline`'s page and section): plotly.js
embedded, JSON safe inside a ``<script>`` element, and plotly's config. A leaf: it imports nothing of the package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PLOTLY_CONFIG", "plotly_js", "script_json"]

#: plotly's config for every figure of a page: no logo, resizing with the page, no cloud upload.
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["sendDataToCloud"]}


def plotly_js() -> str:
    """plotly.js itself (several MB), embedded so that a page fetches nothing."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def script_json(obj: Any) -> str:
    """JSON safe inside a <script> element: no "</" can close it early (stage names are user text)."""
    from plotly.io.json import to_json_plotly

    return to_json_plotly(obj).replace("</", "<\\/")
