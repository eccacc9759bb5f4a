"""Figures of a pipeline plan (docs/design.md §12): what each device holds, and every rank's timeline.

- :func:`memory_bars`: one stacked bar per device: its fixed memory (parameters, gradients, optimizer state), the
  other in-flight microbatches' stored activations, and one microbatch's working peak, with the memory limit.
- :func:`timeline`: one lane per rank, a bar per forward and backward of each microbatch, the recomputation inside
  each backward marked in the recomputation colour.
- :class:`PipelineView`: both, driven by a device-memory slider (ipywidgets); :func:`to_html` writes the same as a
  self-contained page, as :mod:`hchain_viz.viz.html` does for one device.
- The explorer carries the view (``Explorer(chain, pipeline=(P, M))``), and its page the same section
  (``hchain_viz.viz.html.to_html(..., pipeline=(P, M))``: :func:`html_frames`, :func:`html_section`).

Figures read plans (:class:`~hchain_viz.core.pipeline.PipelinePlan`) only; they never recompute memory or time.
"""

from __future__ import annotations

import html
import os
from typing import Any

import numpy as np

from ..core.pipeline import Pipeline, PipelinePlan
from ..core.units import format_bytes, format_time
from ..errors import HChainError
from . import style
from .page import PLOTLY_CONFIG, plotly_js, script_json

try:
    import plotly.graph_objects as go
except ImportError as e:  # pragma: no cover - plotly is a hard dependency of the package
    from ..errors import DependencyError

    raise DependencyError("hchain_viz.viz needs plotly; install it with `pip install plotly`") from e

__all__ = ["memory_bars", "timeline", "PipelineView", "pipeline_view", "to_html"]

# The three parts of a device's peak, bottom to top.
PART_COLORS = {"fixed": "#969696", "in flight": style.KIND_COLORS["saved"], "working": style.OP_COLORS["backward"]}
PART_LABELS = {"fixed": "fixed (parameters, gradients, optimizer state)",
               "in flight": "other microbatches in flight (stored activations)",
               "working": "one microbatch's working peak"}


def _check_plan(plan: Any) -> PipelinePlan:
    if not isinstance(plan, PipelinePlan):
        raise HChainError(f"expected a PipelinePlan (from hcv.plan_pipeline(...)), got {type(plan).__name__}")
    return plan


# ====================================================================== memory per device
def memory_bars_traces(plan: PipelinePlan, unit: tuple[str, int] | None = None) -> list[dict]:
    """Three bar traces (fixed, in flight, working), one bar per device."""
    plan = _check_plan(plan)
    uname, scale = unit or style.byte_unit(plan.peak)
    devices = [f"device {s}" for s in range(plan.devices)]
    split = [plan.rank_parts(r) for r in range(plan.devices)]  # interleaved: a device's chunks together
    parts = {"fixed": [f for f, _, _ in split], "in flight": [k for _, k, _ in split],
             "working": [w for _, _, w in split]}
    text = ["; ".join(f"{plan.chain.names[st.first]} .. {plan.chain.names[st.end - 1]}: {st.in_flight} in flight, "
                      f"{st.schedule.n_recomputed} recomputed forwards" for st in plan.rank_stages(r))
            + f", peak {format_bytes(plan.peaks[r])}" for r in range(plan.devices)]
    return [dict(type="bar", name=PART_LABELS[k], x=devices, y=np.asarray(v, float) / scale, text=text,
                 textposition="none", marker=dict(color=PART_COLORS[k], line_width=0),
                 hovertemplate="%{text}<br>" + k + " %{y:.4g} " + uname + "<extra></extra>")
            for k, v in parts.items()]


def memory_bars_layout(plan: PipelinePlan, limit: int | None = None, unit: tuple[str, int] | None = None) -> dict:
    plan = _check_plan(plan)
    limit = plan.memory_limit if limit is None else limit
    top = max(plan.peak, limit or 0) * 1.08
    uname, scale = unit or style.byte_unit(top)
    lay = style.base_layout(f"Memory per device: peak {format_bytes(plan.peak)}"
                            + (f" of {format_bytes(limit)}" if limit else ""), height=320)
    lay.update(barmode="stack", yaxis=dict(range=[0, top / scale], title_text=f"memory ({uname})", zeroline=False),
               xaxis=dict(title_text=f"{plan.kind}, {plan.microbatches} microbatches"))
    lay["shapes"] = [dict(type="line", xref="paper", x0=0, x1=1, y0=(limit or 0) / scale, y1=(limit or 0) / scale,
                          visible=limit is not None, line=dict(color=style.BUDGET_COLOR, width=2, dash="dash"))]
    return lay


def memory_bars(plan: PipelinePlan, limit: int | None = None) -> go.Figure:
    """Each device's predicted peak as fixed + other microbatches in flight + one microbatch working; the dashed
    line is the per-device memory limit (the plan's, or ``limit``)."""
    unit = style.byte_unit(max(_check_plan(plan).peak, limit or plan.memory_limit or 0))
    return go.Figure(memory_bars_traces(plan, unit), memory_bars_layout(plan, limit, unit))


# ====================================================================== timeline
def timeline_traces(plan: PipelinePlan) -> list[dict]:
    """Three bar traces: forwards, backwards, and the recomputation inside each backward (drawn at its start: the
    recomputed forwards interleave with the backward's ops, their total is what is shown)."""
    plan = _check_plan(plan)
    events = [e for evs in plan.simulate().events for e in evs]
    F = [e for e in events if e.kind == "F"]
    B = [e for e in events if e.kind == "B"]
    hover = "%{text}<br>%{base:" + style.TIME_HOVER + "}s, %{x:" + style.TIME_HOVER + "}s<extra></extra>"

    def bars(evs: list, name: str, color: str, start: Any, length: Any, text: list[str]) -> dict:
        return dict(type="bar", orientation="h", name=name, y=[f"device {e.rank}" for e in evs], base=start,
                    x=length, width=0.8, text=text, textposition="none", hovertemplate=hover,
                    marker=dict(color=color, line=dict(color="white", width=0.5)))

    return [
        bars(F, "forward", style.OP_COLORS["forward"], [e.start for e in F], [e.end - e.start for e in F],
             [f"F{e.microbatch}{_chunk(plan, e)}" for e in F]),
        bars(B, "backward", style.OP_COLORS["backward"], [e.start + e.recompute for e in B],
             [e.end - e.start - e.recompute for e in B], [f"B{e.microbatch}{_chunk(plan, e)}" for e in B]),
        bars(B, "recomputation inside the backward", style.OP_COLORS["recompute"], [e.start for e in B],
             [e.recompute for e in B], [f"B{e.microbatch}: recomputed forwards" for e in B]),
    ]


def _chunk(plan: PipelinePlan, e: Any) -> str:
    return f" (chunk {e.chunk})" if plan.chunks > 1 else ""


def timeline_layout(plan: PipelinePlan) -> dict:
    plan = _check_plan(plan)
    tr = plan.simulate()
    lay = style.base_layout(f"{plan.kind} timeline: step {format_time(tr.step_time)}, "
                            f"{100 * tr.bubble:.0f}% idle", height=80 + 40 * plan.devices)
    lay.update(barmode="overlay", xaxis=dict(title_text="time", range=[0, tr.step_time * 1.01], **style.TIME_AXIS),
               yaxis=dict(autorange="reversed", categoryorder="array",
                          categoryarray=[f"device {s}" for s in range(plan.devices)]))
    return lay


def timeline(plan: PipelinePlan) -> go.Figure:
    """Every rank's forwards and backwards over one step, recomputation marked."""
    return go.Figure(timeline_traces(plan), timeline_layout(plan))


# ====================================================================== slider
def limits(pipe: Pipeline, microbatches: int, n: int) -> list[int]:
    """``n`` per-device memory limits from the least that fits to where the plan stops getting faster (every stage
    storing everything it can)."""
    lo = pipe.least_memory(microbatches)
    hi = max(pipe.plan(microbatches, 2**60).peak, lo)
    return np.unique(np.linspace(lo, hi, max(int(n), 1)).round().astype(np.int64)).tolist()


class PipelineView:
    """The memory bars and the timeline of the best plan, with a per-device memory slider driving both.

    ``view.widget`` is the ipywidgets box to display; ``view.set_limit(bytes)`` moves the slider (the nearest of
    its ``n`` positions). Plans are computed once per position, on first use.
    """

    def __init__(self, chain: Any, devices: int, microbatches: int, schedule: str = "1F1B", *,
                 bandwidth: Any = None, n: int = 40) -> None:
        try:
            import ipywidgets as W
        except ImportError as e:  # pragma: no cover - a hard dependency of the package
            from ..errors import DependencyError

            raise DependencyError("the pipeline view needs ipywidgets: `pip install ipywidgets`") from e
        self.pipe = Pipeline(chain, devices, schedule, bandwidth=bandwidth)
        self.microbatches = microbatches
        self.limits = limits(self.pipe, microbatches, n)
        self._plans: dict[int, PipelinePlan] = {}
        self._unit = style.byte_unit(self.limits[-1] * 1.08)
        plan = self.plan(len(self.limits) // 2)
        self.bars = go.FigureWidget(memory_bars_traces(plan, self._unit),
                                    memory_bars_layout(plan, None, self._unit))
        self.timeline = go.FigureWidget(timeline_traces(plan), timeline_layout(plan))
        self.slider = W.SelectionSlider(options=[(format_bytes(b), k) for k, b in enumerate(self.limits)],
                                        value=len(self.limits) // 2, description="device memory",
                                        continuous_update=False, layout=W.Layout(width="480px"),
                                        style={"description_width": "initial"})
        self.text = W.HTML(self._stats(plan))
        self.slider.observe(lambda change: self._show(change["new"]), names="value")
        # the two figures wrap onto two rows when the output area is narrow
        self.widget = W.VBox([self.slider, self.text,
                              W.HBox([self.bars, self.timeline], layout=W.Layout(flex_flow="row wrap"))])

    def plan(self, k: int) -> PipelinePlan:
        """The best plan at slider position ``k``."""
        if k not in self._plans:
            self._plans[k] = self.pipe.plan(self.microbatches, self.limits[k])
        return self._plans[k]

    def set_limit(self, memory: int) -> None:
        self.slider.value = int(np.argmin([abs(b - memory) for b in self.limits]))

    def _stats(self, plan: PipelinePlan) -> str:
        return (f"{plan.kind}, {plan.devices} devices, {plan.microbatches} microbatches: step "
                f"<b>{format_time(plan.step_time)}</b>, peak <b>{format_bytes(plan.peak)}</b>, stages start at "
                + ", ".join(plan.chain.names[b] for b in plan.bounds))

    def _show(self, k: int) -> None:
        plan = self.plan(k)
        for fig, data, lay in ((self.bars, memory_bars_traces(plan, self._unit),
                                memory_bars_layout(plan, None, self._unit)),
                               (self.timeline, timeline_traces(plan), timeline_layout(plan))):
            with fig.batch_update():
                for trace, d in zip(fig.data, data):
                    for key in ("x", "y", "base", "text"):
                        if key in d:
                            trace[key] = d[key]
                fig.layout.title.text = lay["title"]["text"]
                fig.layout.xaxis.range = lay["xaxis"].get("range", fig.layout.xaxis.range)
                if "shapes" in lay:
                    fig.layout.shapes = lay["shapes"]
        self.text.value = self._stats(plan)

    def _ipython_display_(self) -> None:  # pragma: no cover - needs a notebook
        from IPython.display import display

        display(self.widget)


def pipeline_view(chain: Any, devices: int, microbatches: int, schedule: str = "1F1B", **kwargs: Any) -> PipelineView:
    """A :class:`PipelineView` to display in a notebook."""
    return PipelineView(chain, devices, microbatches, schedule, **kwargs)


# ====================================================================== HTML export
def check_pipeline(chain: Any, pipeline: Any) -> tuple[int, int]:
    """``pipeline=(devices, microbatches)`` as given to the explorer or ``to_html``, checked.

    Raises:
        HChainError: not two positive integers, or a chain without its fixed part (no optimizer profiled).
    """
    if (not isinstance(pipeline, (tuple, list)) or len(pipeline) != 2
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in pipeline)):
        raise HChainError(f"pipeline must be (devices, microbatches), two positive integers such as (4, 16); "
                          f"got {pipeline!r}")
    if getattr(chain, "fixed", None) is None:
        raise HChainError("the pipeline view needs the chain's fixed part (each device's parameters, gradients and "
                          "optimizer state): profile with the optimizer, hcv.profile(model, x, loss_fn, optimizer=opt)")
    return int(pipeline[0]), int(pipeline[1])


def html_frames(chain: Any, devices: int, microbatches: int, schedule: str = "1F1B", *, bandwidth: Any = None,
                n: int = 40) -> tuple[Pipeline, list[int], list[dict]]:
    """The pipeline, its ``n`` per-device limits and one page frame per limit (the memory bars and the timeline of
    the best plan there), for :func:`html_section`."""
    pipe = Pipeline(chain, devices, schedule, bandwidth=bandwidth)
    budgets = limits(pipe, microbatches, n)
    unit = style.byte_unit(budgets[-1] * 1.08)
    frames = []
    for b in budgets:
        plan = pipe.plan(microbatches, b)
        frames.append(dict(label=format_bytes(b), stats=html.escape(
            f"step {format_time(plan.step_time)}, peak {format_bytes(plan.peak)}, stages start at "
            + ", ".join(plan.chain.names[x] for x in plan.bounds)),
            bars=dict(data=memory_bars_traces(plan, unit), layout=memory_bars_layout(plan, None, unit)),
            timeline=dict(data=timeline_traces(plan), layout=timeline_layout(plan))))
    return pipe, budgets, frames


def html_section(frames: list[dict], prefix: str = "") -> str:
    """The page's pipeline part: a device-memory slider over ``frames`` driving both figures. Element ids start
    with ``prefix``, so the section can sit in another page (:func:`hchain_viz.viz.html.to_html`)."""
    start = (len(frames) - 1) // 2
    return _SECTION.format(p=prefix, n_last=len(frames) - 1, start=start,
                           data=script_json(dict(frames=frames, start=start, config=PLOTLY_CONFIG)))


def to_html(chain: Any, devices: int, microbatches: int, path: str | os.PathLike, schedule: str = "1F1B", *,
            bandwidth: Any = None, n: int = 40, title: str | None = None) -> str:
    """Write a self-contained page (plotly.js embedded, nothing fetched) with the memory bars and the timeline of
    the best plan at ``n`` per-device memory limits and a slider between them; return the path."""
    pipe, budgets, frames = html_frames(chain, devices, microbatches, schedule, bandwidth=bandwidth, n=n)
    title = title or (f"hchain_viz: {pipe.kind} pipeline on {devices} devices, {microbatches} microbatches, "
                      f"{format_bytes(budgets[0])} to {format_bytes(budgets[-1])} per device")
    page = _PAGE.format(title=html.escape(title), plotlyjs=plotly_js(), section=html_section(frames))
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return str(path)


_SECTION = """<div>device memory <input id="{p}limit" type="range" min="0" max="{n_last}" value="{start}">
<span id="{p}label"></span></div>
<div id="{p}stats"></div>
<div class="row"><div id="{p}bars"></div><div id="{p}timeline"></div></div>
<script type="application/json" id="{p}data">{data}</script>
<script>
(function () {{
  const D = JSON.parse(document.getElementById("{p}data").textContent);
  function show(k) {{
    const f = D.frames[k];
    document.getElementById("{p}label").textContent = f.label;
    document.getElementById("{p}stats").innerHTML = f.stats;
    Plotly.react("{p}bars", f.bars.data, f.bars.layout, D.config);
    Plotly.react("{p}timeline", f.timeline.data, f.timeline.layout, D.config);
  }}
  document.getElementById("{p}limit").addEventListener("input", e => show(+e.target.value));
  show(D.start);
}})();
</script>
"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
  body {{ font-family: Helvetica, Arial, sans-serif; margin: 16px; color: #222; }}
  .row {{ display: flex; gap: 8px; }}
  .row > div {{ flex: 1 1 50%; min-width: 0; }}
  input[type=range] {{ width: 420px; }}
</style>
<script type="text/javascript">{plotlyjs}</script>
</head>
<body>
<h3>{title}</h3>
{section}</body>
</html>
"""
