"""One widget that draws several plotly figures in a grid that fills its output area and reflows.

:class:`FigureBoard` is one anywidget model for all the figures (why not one ``go.FigureWidget`` each: CHANGELOG.md):

- its ES module is a few lines, so anywidget's initialisation never waits for plotly; plotly.js (the copy shipped
  with the ``plotly`` package) travels once per model in :attr:`FigureBoard._plotly_js` and is evaluated once per page;
- the figures sit in a CSS grid (``rows``: names per row, a row of two splits the width, below 720 px every figure takes
  a row of its own), and a ResizeObserver re-sizes them whenever the output area changes width (a sidebar opened, a
  window resized). Figures carry no ``layout.width``; their heights are theirs;
- the kernel keeps each figure as a ``go.Figure`` (:attr:`figures`) and sends a figure's JSON only when it changed
  (:meth:`sync`); the page redraws it with ``Plotly.react``. Clicks come back as ``on_click`` callbacks.

Everything shown is in the synced state, so a reloaded page, a second view and a saved notebook all show the current
figures.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import plotly.graph_objects as go
import traitlets
from plotly.io import to_json

__all__ = ["FigureBoard"]

_NARROW_PX = 720  # below this the paired figures stack

_ESM = r"""
const KEY = "__hchain_viz_plotly__";  // one plotly.js per page, shared by every board

// PageUp / PageDown on an explorer's budget slider move it 10% of its range: ipywidgets' slider (noUiSlider) moves
// 5 steps of 1% per page key, so each real page key is sent once more.
// Home / End on an explorer's sliders go to the range's ends as it is now: noUiSlider's own keys keep the range the
// slider was made with (updateOptions does not renew it), so End stopped short once the op count had grown.
if (!globalThis.__hchain_viz_page_keys__) {
  globalThis.__hchain_viz_page_keys__ = true;
  document.addEventListener("keydown", ev => {
    if (!ev.isTrusted || !ev.target || !ev.target.closest) return;
    const handle = ev.target.closest(".hcv-budget .noUi-handle, .hcv-step .noUi-handle");
    if (!handle) return;
    if ((ev.key === "PageUp" || ev.key === "PageDown") && handle.closest(".hcv-budget")) {
      handle.dispatchEvent(new KeyboardEvent("keydown", {key: ev.key, bubbles: true, cancelable: true}));
    } else if (ev.key === "Home" || ev.key === "End") {
      const slider = handle.closest(".noUi-target").noUiSlider, range = slider.options.range;
      ev.preventDefault();
      ev.stopPropagation();
      slider.set(ev.key === "End" ? range.max : range.min);
    }
  }, true);
}


function plotly(model) {
  if (!globalThis[KEY]) {
    globalThis[KEY] = new Promise((resolve, reject) => {
      try {
        // plotly.min.js is a UMD bundle: hand it a CommonJS `module` so that it neither sets a global nor
        // registers with a page's AMD loader
        const module = {exports: {}};
        new Function("module", "exports", "define", model.get("_plotly_js"))(module, module.exports, undefined);
        resolve(module.exports);
      } catch (e) { delete globalThis[KEY]; reject(e); }
    });
  }
  return globalThis[KEY];
}

function render({ model, el }) {
  el.classList.add("hcv-board");
  const panels = {};   // name -> {div, json}
  let Plotly = null, alive = true;
  const config = {displaylogo: false, responsive: false, modeBarButtonsToRemove: ["lasso2d", "select2d"]};

  // the caption (the explorer's status line for the player's step) spans the grid above the figures; it changes in
  // the same message as the figures, so that the two always show the same op
  const caption = document.createElement("div");
  caption.className = "hcv-steptext";
  function showCaption() {
    const texts = model.get("texts"), k = Math.max(0, Math.min(model.get("step"), texts.length - 1));
    caption.innerHTML = texts.length ? texts[k] : "";
    caption.style.display = texts.length ? "" : "none";
  }

  function layoutGrid() {
    el.replaceChildren(caption);
    for (const row of model.get("rows")) {
      for (const name of row) {
        let p = panels[name];
        if (!p) {
          const div = document.createElement("div");
          div.className = "hcv-panel";
          div.dataset.name = name;
          p = panels[name] = {div, json: null};
        }
        p.div.classList.toggle("hcv-wide", row.length === 1);
        el.appendChild(p.div);
      }
    }
  }

  // fresh: a new plot (its listeners too), laid out from scratch at the panel's width; else Plotly.react
  function plot(name, p, fresh) {
    const fig = JSON.parse(p.json);
    (fresh ? Plotly.newPlot : Plotly.react)(p.div, fig.data, fig.layout, config).then(() => {
      if (fresh) {
        p.div.on("plotly_click", ev => {
          const pt = ev.points && ev.points[0];
          if (pt) model.send({event: "click", name, trace: pt.curveNumber, x: pt.x, y: pt.y});
        });
      }
    });
  }

  function draw() {
    if (!Plotly || !alive || el.clientWidth === 0) return;  // hidden (a background tab): drawn when shown
    const figs = model.get("_figure_json");
    for (const [name, p] of Object.entries(panels)) {
      const json = figs[name];
      if (json === undefined || json === p.json) continue;
      const fresh = p.json === null;
      p.json = json;
      plot(name, p, fresh);
    }
  }

  let pending = 0, lastWidth = -1;
  function resize() {
    pending = 0;
    const w = el.clientWidth;
    if (!alive || w === 0) return;
    el.classList.toggle("hcv-narrow", w < """ + str(_NARROW_PX) + r""");
    if (w === lastWidth) return;
    lastWidth = w;
    const drawn = Object.entries(panels).filter(([, p]) => p.json !== null && p.div.clientWidth > 0);
    draw();  // the first time the board has a width: draw what waited
    // a new plot rather than Plots.resize: after a resize plotly kept the legend's old margins (a legend that had
    // wrapped to more rows in a narrow box then covered the plot once the box widened)
    for (const [name, p] of drawn) plot(name, p, true);
  }
  const observer = new ResizeObserver(() => { if (!pending) pending = requestAnimationFrame(resize); });

  layoutGrid();
  showCaption();
  model.on("change:step", showCaption);
  model.on("change:texts", showCaption);
  model.on("change:rows", () => { layoutGrid(); lastWidth = -1; resize(); });
  model.on("change:_figure_json", draw);
  plotly(model).then(P => { Plotly = P; observer.observe(el); resize(); },
                     e => { el.textContent = "hchain_viz: plotly.js failed to load: " + e; });
  return () => {
    alive = false;
    observer.disconnect();
    if (Plotly) for (const p of Object.values(panels)) Plotly.purge(p.div);
  };
}

export default { render };
"""

_CSS = """
.hcv-board { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 4px 8px; width: 100%;
             min-width: 0; box-sizing: border-box; }
.hcv-board .hcv-panel { min-width: 0; overflow: hidden; }
.hcv-board .hcv-panel.hcv-wide, .hcv-board.hcv-narrow .hcv-panel { grid-column: 1 / -1; }
/* the player's status line: two lines at most, always two lines high, so the figures below never move */
.hcv-board .hcv-steptext { grid-column: 1 / -1; }
.hcv-steptext { display: -webkit-box; -webkit-box-orient: vertical; -webkit-line-clamp: 2; line-clamp: 2;
                overflow: hidden; white-space: normal; line-height: 1.4em; height: 2.8em; }
"""


@functools.cache
def _plotly_js() -> str:
    """The plotly.js bundle of the installed ``plotly`` package (the one its figures are written for)."""
    import plotly

    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


class FigureBoard(anywidget.AnyWidget):
    """Plotly figures in a grid that fills the output area: ``FigureBoard({"a": fa, "b": fb}, rows=[["a", "b"]])``.

    Change a figure in place (``board.figures["a"]``) and call :meth:`sync`; :meth:`on_click` registers a callback for
    clicks on one figure.
    """

    _esm = _ESM
    _css = _CSS
    _plotly_js = traitlets.Unicode().tag(sync=True)
    # names of the figures, row by row: a row of one spans the width, a row of two splits it
    rows = traitlets.List(traitlets.List(traitlets.Unicode())).tag(sync=True)
    # name -> the figure's plotly JSON, as last sent by sync()
    _figure_json = traitlets.Dict(key_trait=traitlets.Unicode(), value_trait=traitlets.Unicode()).tag(sync=True)
    # a caption above the figures: texts[step] (HTML; escape user text), none when texts is empty. The texts travel
    # once; a step change is one number, sent with the figures it goes with (see sync)
    texts = traitlets.List(traitlets.Unicode()).tag(sync=True)
    step = traitlets.Int(0).tag(sync=True)

    def __init__(self, figures: dict[str, go.Figure], rows: Sequence[Sequence[str]] | None = None, **kwargs: Any):
        names = [n for row in rows for n in row] if rows is not None else list(figures)
        unknown = sorted(set(names) - set(figures))
        if unknown:
            raise ValueError(f"rows name figures the board does not have: {unknown}")
        self.figures = dict(figures)
        self._click: dict[str, list[Callable[[dict], None]]] = {}
        super().__init__(_plotly_js=_plotly_js(), rows=[list(r) for r in (rows or [[n] for n in figures])],
                         _figure_json={n: _json(f) for n, f in self.figures.items()}, **kwargs)
        self.on_msg(self._on_msg)

    def sync(self, names: Sequence[str] | None = None, step: int | None = None) -> None:
        """Send the figures ``names`` (default: all) whose JSON changed since the last sync, and the caption's
        ``step`` when given, in one message: the page shows them together."""
        new = dict(self._figure_json)
        for n in self.figures if names is None else names:
            new[n] = _json(self.figures[n])
        with self.hold_sync():
            if new != self._figure_json:
                self._figure_json = new
            if step is not None:
                self.step = step

    def on_click(self, name: str, callback: Callable[[dict], None]) -> None:
        """Call ``callback({"trace": index, "x": x, "y": y})`` when a point of figure ``name`` is clicked."""
        self._click.setdefault(name, []).append(callback)

    def _on_msg(self, _widget: Any, content: dict, _buffers: Any) -> None:
        if isinstance(content, dict) and content.get("event") == "click":
            for cb in self._click.get(content.get("name"), []):
                cb(content)


def _json(fig: go.Figure) -> str:
    """The figure as plotly JSON, numeric arrays as base64 typed arrays (what plotly.py writes, and plotly.js reads).

    Encoded straight from the figure's stored dicts: ``plotly.io.to_json`` deep-copies the figure and walks every list
    element, which took most of a budget change (~40 ms per figure at L=200). Falls back to it for values plain JSON
    cannot hold (NaN, infinities).
    """
    try:
        return json.dumps({"data": fig._data, "layout": fig._layout}, default=_encode, separators=(",", ":"),
                          allow_nan=False)
    except (TypeError, ValueError):
        return to_json(fig, validate=False)


_INT32 = np.iinfo(np.int32)


def _encode(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        if v.dtype.kind == "f" or (v.dtype.kind in "iu" and (v.size == 0 or (v.min() >= _INT32.min and
                                                                              v.max() <= _INT32.max))):
            dt = "<f8" if v.dtype.kind == "f" else "<i4"
            spec = {"dtype": "f8" if v.dtype.kind == "f" else "i4",
                    "bdata": base64.b64encode(np.ascontiguousarray(v, dtype=dt).tobytes()).decode("ascii")}
            if v.ndim > 1:
                spec["shape"] = ",".join(map(str, v.shape))
            return spec
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"cannot encode {type(v).__name__}")
