"""Plotly figures of a simulated step and of the budget/time frontier: pure functions returning ``go.Figure``.

- :func:`timeline`: every op a bar over time, one row per stage (forward blue, recomputed forward red, backward
  orange, loss grey); with offloading (design.md §9) two transfer lanes (to host, to device) and the compute stream's
  idle waits for prefetches, hatched.
- :func:`memory_curve`: resident memory over time, stacked by kind, with the transient peaks, the budget and the peak.
- :func:`storage_tape`: a stage × time grid of what each stage holds (checkpoint x, full x̄, output, gradient δ).
- :func:`frontier`: makespan and overhead over store-all against the budget, for the optimal solver and baselines.

Each figure is assembled from ``*_traces`` / ``*_layout`` builders that return plain dicts; the explorer pushes the
same dicts into its FigureWidgets and the HTML export serialises them, so every view draws the same data. Figures read
Traces (through :class:`~hchain_viz.viz.trace_view.TraceView`) and Solutions only; they never recompute memory.
Numbers stay in bytes and seconds; axis ticks and hover text are formatted by :mod:`hchain_viz.viz.style`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.simulate import Trace
from ..core.units import format_bytes, format_time
from ..errors import HChainError
from . import style
from .trace_view import CATEGORIES, LAYERS, TraceView

try:
    import plotly.graph_objects as go
except ImportError as e:  # pragma: no cover - plotly is a hard dependency of the package
    from ..errors import DependencyError

    raise DependencyError("hchain_viz.viz needs plotly; install it with `pip install plotly`") from e

__all__ = ["timeline", "memory_curve", "storage_tape", "frontier", "throughput"]

REMAT_ONLY = "optimal, remat only"  # the remat-only curve beside an OffloadSolution's
_FUTURE_OPACITY = 0.22  # ops after the step cursor are drawn faint
# The layout keys a budget or step change may alter (title, axis ranges and ticks, the cursor); the explorer and the
# HTML export resend only these.
DYNAMIC_LAYOUT = ("title", "xaxis", "yaxis", "shapes", "annotations")


def _view(trace: Trace | TraceView) -> TraceView:
    if isinstance(trace, TraceView):
        return trace
    if not isinstance(trace, Trace):
        raise HChainError(f"expected a Trace (from hcv.simulate(chain, schedule)), got {type(trace).__name__}")
    return TraceView.of(trace)


def _cursor_shapes(view: TraceView, step: int | None) -> list[dict]:
    """The player's cursor after ``step`` ops: always one shape, hidden without a step, so that widgets update it
    in place (plotly.py's layout.shapes view goes stale when the number of shapes changes)."""
    t = view.time_at(step)
    return [dict(type="line", x0=t, x1=t, y0=0, y1=1, yref="paper", xref="x", visible=step is not None,
                 line=dict(color=style.CURSOR_COLOR, width=2))]


def _units(fig: go.Figure, source: Any) -> go.Figure:
    """``fig`` relabelled in plain units when its chain is a teaching chain (``hchain_viz.course.abstract``)."""
    chain = source.trace.chain if isinstance(source, TraceView) else getattr(source, "chain", None)
    meta = getattr(chain, "meta", None)
    if isinstance(meta, dict) and meta.get("units") == "abstract":
        style.in_abstract_units(fig)
    return fig


def _check_step(view: TraceView, step: int | None) -> int | None:
    if step is None:
        return None
    if not 0 <= step <= view.n:
        raise HChainError(f"step {step} is out of range; a step is a number of ops done, 0..{view.n}")
    return int(step)


# ====================================================================== timeline
def timeline_traces(view: TraceView, step: int | None = None, unit: tuple[str, int] | None = None) -> list[dict]:
    """Seven traces: forward, recomputed forward, backward bars; loss markers; offload and prefetch bars on the
    transfer lanes (rows L+1 and L+2); idle waits of the compute stream (empty without transfers).

    Bars have ``base`` = op start and ``x`` = duration; ops at or after ``step`` are faint.
    """
    uname, scale = unit or style.byte_unit(view.peak)
    idx = np.arange(view.n)
    mem = np.column_stack([view.start, view.end, view.mem_before / scale, view.mem_peak / scale,
                           view.mem_after / scale]) if view.n else np.zeros((0, 5))
    hover = ("%{text}<br>%{customdata[0]:" + style.TIME_HOVER + "}s → %{customdata[1]:" + style.TIME_HOVER
             + "}s<br>memory %{customdata[2]:.4g} → %{customdata[4]:.4g} " + uname
             + " (peak %{customdata[3]:.4g} " + uname + ")<extra>%{fullData.name}</extra>")
    out = []
    L = view.trace.chain.length
    for c, cat in enumerate(CATEGORIES):
        m = view.category == c
        rows = view.stage[m] if c < 4 else np.full(int(m.sum()), L + c - 3)  # transfers: lanes L+1, L+2
        common = dict(name=style.OP_LABELS[cat], customdata=mem[m], text=view.labels[m], hovertemplate=hover,
                      y=rows, legendgroup=cat)
        opacity = 1.0 if step is None else np.where(idx[m] < step, 1.0, _FUTURE_OPACITY)
        if cat == "loss":  # zero duration: a marker, not a bar
            out.append(dict(type="scatter", mode="markers", x=view.start[m],
                            marker=dict(color=style.OP_COLORS[cat], symbol="diamond", size=10, opacity=opacity),
                            **common))
        else:
            out.append(dict(type="bar", orientation="h", base=view.start[m], x=view.end[m] - view.start[m],
                            width=0.8, textposition="none",
                            marker=dict(color=style.OP_COLORS[cat], opacity=opacity, line_width=0), **common))
    idle = view.trace.idle
    k = view.n if step is None else step
    shown = [w for w in idle if w.index < k]
    out.append(dict(type="bar", orientation="h", name="idle (waits for a prefetch)", textposition="none",
                    y=[int(view.stage[w.index]) for w in shown], base=[w.start for w in shown],
                    x=[w.end - w.start for w in shown], width=0.8, showlegend=bool(idle),
                    text=[f"waits for Pre{w.stage}" for w in shown],
                    hovertemplate="%{text}: %{x:" + style.TIME_HOVER + "}s<extra></extra>",
                    marker=dict(color=style.IDLE_COLOR, opacity=1.0, pattern=dict(shape="/"), line_width=0)))
    return out


_MAX_LABELS = 24  # stage-axis labels at most (~24 stay readable at the figures' heights)
_BAND_FILL = "rgba(0, 0, 0, 0.05)"


def _stage_axis(view: TraceView, loss_label: str = "loss", lanes: bool = False) -> dict:
    """The stage axis: one row per stage and the loss. A chain with layers (``chain.groups``, a sub-layer profile)
    is labelled by layer at the layer's middle, with a minor tick per stage; otherwise by stage. Labels are thinned
    to at most ~24. With ``lanes`` and transfers, two more rows for the transfer channels (docs/design.md §9)."""
    chain = view.trace.chain
    L = chain.length
    names = list(chain.names) + [loss_label]
    if chain.groups:
        inside = {i for _, first, last in chain.groups for i in range(first, last + 1)}
        marks = sorted([((first + last) / 2, name) for name, first, last in chain.groups]
                       + [(i, names[i]) for i in range(L + 1) if i not in inside])
        every = -(-len(marks) // _MAX_LABELS)
        marks = marks[::every] + ([marks[-1]] if (len(marks) - 1) % every else [])
        top = L
        if lanes and view.trace.n_transfers:
            marks += [(L + 1, "link → host"), (L + 2, "link → device")]
            top = L + 2
        return dict(tickmode="array", tickvals=[v for v, _ in marks], ticktext=[t for _, t in marks],
                    minor=dict(tickmode="array", tickvals=list(range(L + 1)), ticks="inside", ticklen=4),
                    range=[-0.6, top + 0.6], title_text="layer", zeroline=False, showgrid=False, automargin=True)
    every = max(1, (L + 1) // _MAX_LABELS)
    vals = list(range(0, L + 1, every))
    if vals[-1] != L:
        vals.append(L)
    text = [f"{i} {names[i]}" if i < L else names[i] for i in vals]
    top = L
    if lanes and view.trace.n_transfers:
        vals += [L + 1, L + 2]
        text += ["link → host", "link → device"]
        top = L + 2
    return dict(tickmode="array", tickvals=vals, ticktext=text, range=[-0.6, top + 0.6], title_text="stage",
                zeroline=False, showgrid=False, automargin=True)  # long stage names push the margin, not off-page


def _estimate_note(view: TraceView) -> str:
    """" · times: estimate (...)" when the chain's times are a roofline estimate, not measured."""
    times = view.trace.chain.meta.get("times", "")
    return f" · times: {times.split(' from ')[0]}" if isinstance(times, str) and times.startswith("estimate") else ""


def _layer_bands(view: TraceView) -> list[dict]:
    """Shaded horizontal bands behind every other layer of ``chain.groups`` (none without groups), so the
    sub-stages of one layer read as one block."""
    return [dict(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=first - 0.5, y1=last + 0.5, layer="below",
                 fillcolor=_BAND_FILL, line_width=0)
            for n, (_, first, last) in enumerate(view.trace.chain.groups) if n % 2 == 0]


def _rows_height(view: TraceView) -> int:
    return max(260, min(640, 140 + 14 * (view.trace.chain.length + 1)))  # ~14 px per stage row


def timeline_layout(view: TraceView, step: int | None = None, title: str | None = None) -> dict:
    """Layout of the timeline: stage rows, a time axis, and the step cursor when ``step`` is given."""
    name = view.trace.schedule.meta.get("strategy", "schedule")
    idle = f", idle {format_time(view.trace.idle_time)}" if view.trace.idle else ""
    lay = style.base_layout(title or f"Timeline ({name}): {view.n} ops, {format_time(view.makespan)}{idle}"
                            + _estimate_note(view), height=_rows_height(view))
    lay.update(barmode="overlay", bargap=0, yaxis=_stage_axis(view, lanes=True),
               xaxis=dict(style.TIME_AXIS, range=[0, max(view.makespan, 1e-12)]),
               shapes=_cursor_shapes(view, step) + _layer_bands(view))  # the cursor first, as without layers
    return lay


def timeline(trace: Trace, step: int | None = None) -> go.Figure:
    """Every op of ``trace`` as a bar over time on its stage's row; ``step`` draws a cursor after that many ops."""
    view = _view(trace)
    step = _check_step(view, step)
    return _units(go.Figure(data=timeline_traces(view, step), layout=timeline_layout(view, step)), view)


# ====================================================================== memory curve
def memory_traces(view: TraceView, budget: int | None = None, step: int | None = None,
                  overlay: TraceView | None = None, unit: tuple[str, int] | None = None) -> list[dict]:
    """Traces of the memory figure, in this order: the three stacked layers (checkpoints, saved activations,
    gradients), the total with transient peaks, the peak marker, the budget line, the overlay's total, and the
    host-resident band (values offloaded to the host; empty without transfers).

    The total is exactly :meth:`Trace.memory_curve` drawn as a step (memory reaches the op's peak at its start and
    holds it until its end). Layers are drawn after each op; up to ``step`` ops when given.
    """
    uname, scale = unit or style.byte_unit(max(view.peak, budget or 0))
    k = view.n if step is None else step
    t_curve, m_curve = view.trace.memory_curve()
    if view.trace.n_transfers:  # event-based: layers from item lifetimes in time, the total from the curve
        t_stop = view.time_at(step)
        t_layer, layer_values = _layers_in_time(view, t_stop)
        keep = t_curve <= t_stop
        t_curve, m_curve = t_curve[keep], m_curve[keep]
        n_pts = len(t_curve)
        point_labels = np.array([""] * n_pts + [None], dtype=object)[:-1]
    else:
        n_pts = 1 + 3 * k  # memory_curve has the initial point, then (start, start, end) per op
        t_layer = np.concatenate([[0.0], view.end[:k]])
        layer_values = view.layers[:, : k + 1]
        point_labels = np.concatenate([["start"], np.repeat(view.labels, 3)])[:n_pts]
    out = []
    cum = np.zeros(len(t_layer), np.int64)
    for j, layer in enumerate(LAYERS):
        own = layer_values[j]
        cum = cum + own
        out.append(dict(
            type="scatter", mode="lines", name=style.KIND_LABELS[layer], x=t_layer, y=cum, customdata=own / scale,
            line=dict(shape="hv", width=0.5, color=style.KIND_COLORS[layer]), fillcolor=style.KIND_COLORS[layer],
            fill="tozeroy" if j == 0 else "tonexty",
            hovertemplate=f"{style.KIND_LABELS[layer]}: %{{customdata:.4g}} {uname}<extra></extra>"))
    out.append(dict(
        type="scatter", mode="lines", name="total (with transients)", x=t_curve[:n_pts], y=m_curve[:n_pts],
        customdata=m_curve[:n_pts] / scale, text=point_labels,
        line=dict(shape="hv", width=1.5, color=style.TOTAL_COLOR),
        hovertemplate="%{text}<br>t = %{x:" + style.TIME_HOVER + "}s<br>%{customdata:.4g} " + uname
                      + "<extra>total</extra>"))
    if view.n and view.trace.peak_index < k:
        p = view.trace.peak_index
        peak_pt = dict(x=[view.start[p]], y=[view.mem_peak[p]], text=[f"peak {format_bytes(view.mem_peak[p])}"])
    else:
        peak_pt = dict(x=[], y=[], text=[])
    out.append(dict(type="scatter", mode="markers", name="peak",  # its label is memory_layout's annotation
                    marker=dict(color=style.PEAK_COLOR, size=9, symbol="triangle-down"), hoverinfo="text",
                    **peak_pt))
    t_end = max(view.makespan, overlay.makespan if overlay is not None else 0.0)
    out.append(dict(type="scatter", mode="lines", name="budget" if budget is None else f"budget {format_bytes(budget)}",
                    x=[] if budget is None else [0.0, t_end], y=[] if budget is None else [budget, budget],
                    line=dict(color=style.BUDGET_COLOR, dash="dash", width=1.5), hoverinfo="name",
                    showlegend=budget is not None))
    if overlay is not None:
        t_o, m_o = overlay.trace.memory_curve()
        oname = overlay.trace.schedule.meta.get("strategy", "overlay")
        out.append(dict(type="scatter", mode="lines", name=f"{oname} (total)", x=t_o, y=m_o,
                        line=dict(shape="hv", width=1.5, dash="dot", color=style.OVERLAY_COLOR), hoverinfo="name",
                        showlegend=True))
    else:
        out.append(dict(type="scatter", mode="lines", name="overlay", x=[], y=[], showlegend=False,
                        line=dict(shape="hv", width=1.5, dash="dot", color=style.OVERLAY_COLOR)))
    if view.trace.host_lifetimes:  # a separate band: bytes parked on the host, not counted on the device
        t_h, m_h = view.trace.host_curve()
        keep = t_h <= view.time_at(step)
        host = dict(x=t_h[keep], y=m_h[keep], customdata=m_h[keep] / scale, showlegend=True)
    else:
        host = dict(x=[], y=[], customdata=[], showlegend=False)
    out.append(dict(type="scatter", mode="lines", name="on host (not on the device)", fill="tozeroy",
                    fillcolor=style.HOST_COLOR, line=dict(shape="hv", width=1, dash="dash", color="#8c6d31"),
                    hovertemplate=f"on host: %{{customdata:.4g}} {uname}<extra></extra>", **host))
    return out


def _layers_in_time(view: TraceView, t_stop: float) -> tuple[np.ndarray, np.ndarray]:
    """Resident bytes per layer as steps in time (items live from the start of the op that creates them to the end
    of the op that frees them: a prefetch allocates at its copy's start, an offload frees at its copy's end)."""
    from .trace_view import LAYER_OF

    layer = np.fromiter((LAYER_OF[kind] for kind in view.item_kind), np.int64, len(view.item_kind))
    times = np.unique(np.concatenate([[0.0], view.item_t0, view.item_t1]))
    times = times[times <= t_stop]
    values = np.zeros((len(LAYERS), len(times)), np.int64)
    lo = np.searchsorted(times, view.item_t0, side="left")
    hi = np.searchsorted(times, view.item_t1, side="left")
    diff = np.zeros((len(LAYERS), len(times) + 1), np.int64)
    np.add.at(diff, (layer, lo), view.item_size)
    np.add.at(diff, (layer, hi), -view.item_size)
    values = np.cumsum(diff[:, :-1], axis=1)
    return times, values


def memory_layout(view: TraceView, budget: int | None = None, step: int | None = None,
                  overlay: TraceView | None = None, title: str | None = None) -> dict:
    """Layout of the memory figure: MiB/GiB ticks up to the highest of peak, budget and overlay."""
    top = max(view.peak, budget or 0, overlay.peak if overlay is not None else 0)
    t_end = max(view.makespan, overlay.makespan if overlay is not None else 0.0, 1e-12)
    name = view.trace.schedule.meta.get("strategy", "schedule")
    lay = style.base_layout(title or f"Memory ({name}): peak {format_bytes(view.peak)}"
                            + ("" if budget is None else f" of {format_bytes(budget)} budget"))
    yaxis = style.byte_axis(0, top * 1.08)
    # no tick label at 0: "0 B" would sit on the time axis' "0s" at the origin
    keep = [k for k, v in enumerate(yaxis["tickvals"]) if v > 0] or list(range(len(yaxis["tickvals"])))
    yaxis["tickvals"] = [yaxis["tickvals"][k] for k in keep]
    yaxis["ticktext"] = [yaxis["ticktext"][k] for k in keep]
    lay.update(yaxis=dict(yaxis, range=[0, top * 1.12]),
               xaxis=dict(style.TIME_AXIS, range=[0, t_end]), hovermode="closest",
               shapes=_cursor_shapes(view, step), annotations=[_peak_label(view, step, top)])
    return lay


def _peak_label(view: TraceView, step: int | None, top: float) -> dict:
    """"peak X MiB" above the highest line (peak or budget), pointing down at the peak; hidden until the player
    reaches it. Always one annotation, so that updates change it in place."""
    p = view.trace.peak_index
    shown = view.n > 0 and (step is None or p < step)
    x, y = (float(view.start[p]), float(view.mem_peak[p])) if view.n else (0.0, 0.0)
    return dict(x=x, y=y, xref="x", yref="y", ax=x, ay=top * 1.04, axref="x", ayref="y", visible=shown,
                text=f"peak {format_bytes(y)}", showarrow=True, arrowhead=0, arrowwidth=1,
                arrowcolor=style.PEAK_COLOR, yanchor="bottom", font=dict(color=style.PEAK_COLOR, size=11),
                bgcolor="rgba(255, 255, 255, 0.85)")


def memory_curve(trace: Trace, budget: int | None = None, step: int | None = None) -> go.Figure:
    """Resident memory of ``trace`` over time, stacked by kind, with transient peaks, the peak and the ``budget``.

    ``step`` reveals the curve up to that many ops, as the explorer's player does.
    """
    view = _view(trace)
    step = _check_step(view, step)
    return _units(go.Figure(data=memory_traces(view, budget, step), layout=memory_layout(view, budget, step)), view)


# ====================================================================== storage tape
# Drawing order: narrow bars last, on top.
TAPE_KINDS = ("xbar", "out", "delta", "x", "transit", "consumed", "shared")
_PARTS = ("transit", "consumed")  # parts of x_i named in the legend only on chains that have them


def tape_traces(view: TraceView, step: int | None = None, unit: tuple[str, int] | None = None) -> list[dict]:
    """Eight bar traces (x̄, output, gradient, checkpoint, transit part, consumed part, shared tensor, and values on
    the host) of item lifetimes; up to ``step`` ops when given.

    Row i holds x_i (its input, kept as a checkpoint), x̄_{i+1} (what its recording forward saved) and δ_i (the
    gradient its backward produced); row L holds the output x_L and δ_L. A tensor shared by several cuts from x_i on
    (design.md §8, e.g. the residual stream) is one thin bar on row i while any value holds it; the others leave its
    bytes out of their own. The part of x_i that no backward needs (``chain.transit``) is a thin bar on row i from its
    making to the ``Fall(i)`` that frees it; the part only B(i) needs (``chain.consumed``), one to that ``B(i)``.
    """
    uname, scale = unit or style.byte_unit(view.peak)
    if step is None:
        keep = np.ones(len(view.item_i0), bool)
        t1 = view.item_t1
    else:
        keep = view.item_i0 < step
        t1 = np.where(view.item_i1 < step, view.item_t1, view.time_at(step))
    out = []
    for kind in TAPE_KINDS:
        m = keep & (view.item_kind == kind)
        stage = view.item_stage[m]  # items carry their row already: ("out", L), ("delta", L) sit on the loss row
        sub = {"x": "x_%d", "xbar": "x̄_%d", "out": "output x_%d", "delta": "δ_%d",
               "transit": "part of x_%d no backward needs", "consumed": "part of x_%d only its backward needs",
               "shared": "shared tensor from x_%d"}[kind]
        shift = 1 if kind == "xbar" else 0
        text = np.array([sub % (s + shift) for s in stage.tolist()] + [""], dtype=object)[:-1]
        out.append(dict(
            type="bar", orientation="h", name=style.TAPE_LABELS[kind], y=stage, base=view.item_t0[m],
            x=t1[m] - view.item_t0[m], width=style.TAPE_WIDTHS[kind], text=text, textposition="none",
            showlegend=kind not in _PARTS or any(getattr(view.trace.chain, kind)),
            customdata=np.column_stack([view.item_size[m] / scale, view.item_t0[m], t1[m]]) if m.any()
            else np.zeros((0, 3)),
            marker=dict(color=style.TAPE_COLORS[kind], line_width=0),
            hovertemplate="%{text}: %{customdata[0]:.4g} " + uname + "<br>%{customdata[1]:" + style.TIME_HOVER
                          + "}s → %{customdata[2]:" + style.TIME_HOVER + "}s<extra></extra>"))
    # Values parked on the host (design.md §9): from the offload's completion to the prefetch's, on the value's row.
    hosted = [h for h in view.trace.host_lifetimes if step is None or h.created < step]
    t0 = [float(view.end[h.created]) for h in hosted]
    t1 = [float(view.end[h.freed]) if step is None or h.freed < step else max(view.time_at(step), a)
          for h, a in zip(hosted, t0)]
    out.append(dict(
        type="bar", orientation="h", name="on host", y=[h.stage for h in hosted], base=t0,
        x=[b - a for a, b in zip(t0, t1)], width=0.9, textposition="none",
        showlegend=bool(view.trace.host_lifetimes),
        text=[(f"x̄_{h.stage + 1}" if h.kind == "xbar" else f"x_{h.stage}") + " on host" for h in hosted],
        customdata=[h.size / scale for h in hosted],
        marker=dict(color=style.HOST_COLOR, pattern=dict(shape="x"), line=dict(width=1, color="#8c6d31")),
        hovertemplate="%{text}: %{customdata:.4g} " + uname + "<extra></extra>"))
    return out


def tape_layout(view: TraceView, step: int | None = None, title: str | None = None) -> dict:
    """Layout of the storage tape: the same stage rows and time axis as the timeline."""
    lay = style.base_layout(title or "Storage tape: what each stage holds",
                            height=_rows_height(view))
    lay.update(barmode="overlay", bargap=0, yaxis=_stage_axis(view, "output / loss"),
               xaxis=dict(style.TIME_AXIS, range=[0, max(view.makespan, 1e-12)]),
               shapes=_cursor_shapes(view, step) + _layer_bands(view))  # the cursor first, as without layers
    return lay


def storage_tape(trace: Trace, step: int | None = None) -> go.Figure:
    """A stage × time grid of what each stage holds: nothing, a checkpoint x, a full x̄, the output or a gradient δ."""
    view = _view(trace)
    step = _check_step(view, step)
    return _units(go.Figure(data=tape_traces(view, step), layout=tape_layout(view, step)), view)


# ====================================================================== frontier
@dataclass(frozen=True)
class FrontierData:
    """The budget→makespan curves of a Solution and of baselines, read once; arrays in bytes and seconds."""

    budgets: np.ndarray  # optimal curve, dense enough that a click anywhere lands near a point
    makespans: np.ndarray
    steps_b: np.ndarray  # the Solution's frontier breakpoints
    steps_t: np.ndarray
    baselines: dict[str, tuple[np.ndarray, np.ndarray]]
    min_budget: int
    max_budget: int
    store_all_time: float
    x_range: tuple[float, float]
    y_range: tuple[float, float]

    def makespan(self, budget: float) -> float:
        """Optimal makespan at ``budget`` read from the Solution's frontier steps (inf below the least budget)."""
        k = np.searchsorted(self.steps_b, budget, side="right") - 1
        return float(self.steps_t[k]) if k >= 0 else float("inf")

    @classmethod
    def of(cls, solution: Any, strategies: Any = None, n_dense: int = 400,
           max_overhead: float | None = None) -> FrontierData:
        """``max_overhead``: see :func:`frontier`."""
        if max_overhead is not None and (isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float))
                                         or not max_overhead > 0):
            raise HChainError(f"max_overhead is a positive fraction of the store-all time (0.5: +50%), got "
                              f"{max_overhead!r}")
        pts = sorted((int(b), float(t)) for b, t in solution.frontier() if np.isfinite(t))
        if not pts:
            raise HChainError("the solution has no feasible budget; solve with a larger max_budget")
        steps_b = np.array([b for b, _ in pts], np.int64)
        steps_t = np.array([t for _, t in pts], float)
        chain = solution.chain
        lo_b = int(solution.min_budget)
        hi_b = int(max(steps_b[-1], getattr(solution, "store_all_peak", steps_b[-1])))
        dense = np.linspace(lo_b, hi_b, n_dense).round().astype(np.int64)
        budgets = np.unique(np.concatenate([steps_b, dense, [hi_b]]))
        budgets = budgets[budgets >= steps_b[0]]
        k = np.searchsorted(steps_b, budgets, side="right") - 1
        makespans = steps_t[k]
        baselines = _baseline_points(chain, strategies)
        remat = getattr(solution, "remat", None)
        if remat is not None:  # an OffloadSolution: its remat-only optimum beside it, to see where offloading pays
            rb, rt = zip(*remat.frontier())
            baselines = {REMAT_ONLY: (np.asarray(rb, float), np.asarray(rt, float)), **baselines}
        span = max(hi_b - lo_b, hi_b * 0.05, 1)
        peaks = [float(np.max(b)) for b, _ in baselines.values() if len(b)]
        x_hi = max([hi_b] + [p for p in peaks if p <= hi_b + 2 * span]) + 0.04 * span
        x_lo = max(0.0, lo_b - 0.12 * span)
        T = chain.store_all_time
        top = max(float(makespans.max()), T)
        # A cliff: just above the least budget a deep chain's optimum can cost many times what it costs a little
        # higher (only schedules that recompute most of the chain again and again fit). It goes off the top, and a note
        # says what it costs, instead of flattening the rest of the curve.
        near = max(float(makespans[np.searchsorted(budgets, lo_b + 0.05 * (hi_b - lo_b))]), T)
        if top > 3 * near:
            top = 1.3 * near
        times = [top] + [float(np.max(t)) for _, t in baselines.values() if len(t)]
        y_hi = min(max(times), top * 1.6)  # far-off baselines must not flatten the curve either
        y_lo = min(T, float(makespans.min()))

        def pad(hi: float) -> float:
            return max(hi - y_lo, T * 0.02, 1e-12) * 0.06

        y_range = (y_lo - pad(y_hi), y_hi + pad(y_hi))
        cap = None if max_overhead is None else T * (1 + max_overhead)
        if cap is not None and cap < y_range[1]:
            y_range = (y_lo - pad(cap), cap)
        return cls(budgets, makespans, steps_b, steps_t, baselines, lo_b, hi_b, T, (x_lo, x_hi), y_range)


def _baseline_points(chain: Any, strategies: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``strategies``: None (every baseline the strategies module offers), False/empty (none), a list of names,
    or a mapping name → [(peak_bytes, makespan)]."""
    if strategies is False or (isinstance(strategies, Sequence) and not strategies):
        points = {}  # before the Sequence case: an empty list must not compute every baseline's frontier
    elif strategies is None or (isinstance(strategies, Sequence) and not isinstance(strategies, str)):
        from ..core import strategies as strat

        points = strat.frontier_points(chain)
        if strategies is not None:
            unknown = [s for s in strategies if s not in points]
            if unknown:
                raise HChainError(f"unknown strategies {unknown}; choose among {sorted(points)}")
            points = {s: points[s] for s in strategies}
    elif isinstance(strategies, Mapping):
        points = dict(strategies)
    else:
        raise HChainError(f"strategies must be None, a list of names or a mapping name -> [(peak, makespan)], "
                          f"got {type(strategies).__name__}")
    out = {}
    for name, pts in points.items():
        pts = _pareto(pts)
        out[name] = (np.array([b for b, _ in pts]), np.array([t for _, t in pts]))
    return out


def _pareto(points: Any) -> list[tuple[float, float]]:
    """The points no other point beats: sorted by peak, each faster than every one with a lower or equal peak.

    A family's other schedules (revolve(c) for values of c that give the same peak, a periodic segment that is slower
    for no memory) would stack in one column of the frontier and hide each other."""
    out: list[tuple[float, float]] = []
    for b, t in sorted((float(b), float(t)) for b, t in points):
        if not out or t < out[-1][1]:
            out.append((b, t))
    return out


def frontier_traces(data: FrontierData, budget: int | None = None, unit: tuple[str, int] | None = None,
                    chain_name: str = "optimal") -> list[dict]:
    """Traces: the optimal curve, one per baseline, the current budget line and its point, a hidden trace on the
    overhead axis. The current budget pieces are the last three traces."""
    uname, scale = unit or style.byte_unit(data.max_budget)
    T = data.store_all_time

    def over(t: np.ndarray) -> np.ndarray:
        return 100.0 * (t / T - 1.0) if T > 0 else np.zeros_like(t)

    hover = ("%{fullData.name}<br>budget %{customdata[0]:.4g} " + uname + "<br>makespan %{y:" + style.TIME_HOVER
             + "}s (%{customdata[1]:+.1f}% over store-all)<extra></extra>")
    out = [dict(type="scatter", mode="lines", name=chain_name, x=data.budgets, y=data.makespans,
                customdata=np.column_stack([data.budgets / scale, over(data.makespans)]), hovertemplate=hover,
                line=dict(shape="hv", width=2.5, color=style.strategy_color("optimal")))]
    for j, (name, (b, t)) in enumerate(data.baselines.items()):
        color = style.strategy_color(name, j)
        symbol, size = style.strategy_marker(name, j)
        # open symbols of different shapes and sizes: baselines that share a point (store-all's is every family's
        # last one) stay visible one inside the other
        out.append(dict(type="scatter", mode="lines+markers", name=name, x=b, y=t,
                        customdata=np.column_stack([b / scale, over(t)]) if len(b) else np.zeros((0, 2)),
                        hovertemplate=hover, line=dict(width=1, dash="dot", color=color),
                        marker=dict(size=size, symbol=symbol, color=color, line=dict(width=2, color=color))))
    out.append(_beyond_axes_trace(data))
    out += frontier_budget_traces(data, budget)
    y2 = over(np.asarray(data.y_range))
    out.append(dict(type="scatter", mode="markers", x=[data.x_range[0]] * 2, y=y2, yaxis="y2", showlegend=False,
                    hoverinfo="skip", marker=dict(opacity=0), name="overhead axis"))
    return out


def _beyond_axes_trace(data: FrontierData) -> dict:
    """Baseline points outside the axes' ranges (recompute-all's time far above the rest, a peak beyond store-all),
    drawn as triangles on the edge they are beyond, in their strategy's colour; the hover text gives the real values.
    Always one trace (maybe empty), so that the explorer's trace indices stay put."""
    (x_lo, x_hi), (y_lo, y_hi) = data.x_range, data.y_range
    gap = 0.045 * (x_hi - x_lo)  # two triangles closer than this along an edge are set apart, not drawn as one
    xs, ys, symbols, colors, text = [], [], [], [], []
    for j, (name, (b, t)) in enumerate(data.baselines.items()):
        for bb, tt in zip(b.tolist(), t.tolist()):
            if x_lo <= bb <= x_hi and y_lo <= tt <= y_hi:
                continue
            x0, y = min(max(bb, x_lo), x_hi), min(max(tt, y_lo), y_hi)
            x = x0
            for k in range(1, len(xs) + 2):  # the nearest free place along the edge, rightwards first
                if not any(abs(x - x2) < gap and y == y2 for x2, y2 in zip(xs, ys)):
                    break
                x = x0 + k * gap if x0 + k * gap <= x_hi else x0 - k * gap
            xs.append(x)
            ys.append(y)
            symbols.append("triangle-up" if tt > y_hi else "triangle-right" if bb > x_hi else
                           "triangle-left" if bb < x_lo else "triangle-down")
            colors.append(style.strategy_color(name, j))
            text.append(f"{name}: {format_bytes(bb)}, {format_time(tt)} (beyond the axes)")
    return dict(type="scatter", mode="markers", name="beyond the axes", x=xs, y=ys, text=text, hoverinfo="text",
                cliponaxis=False, showlegend=False,  # a triangle on the edge says it; its hover names the point
                marker=dict(symbol=symbols, color=colors, size=11, line=dict(width=1, color="#222")))


def frontier_budget_traces(data: FrontierData, budget: int | None,
                           point: tuple[float, float] | None = None) -> list[dict]:
    """The two traces that mark the current budget: a vertical line and a point — the optimal one at ``budget``,
    or ``point`` = (peak bytes, makespan) of the schedule on screen when it is a baseline."""
    line = dict(x=[], y=[]) if budget is None else dict(x=[budget, budget], y=list(data.y_range))
    if point is None and budget is not None:
        point = (budget, data.makespan(budget))
    if point is None or not np.isfinite(point[1]):
        point = dict(x=[], y=[], text=[])
    else:
        point = dict(x=[point[0]], y=[point[1]], text=[f"{format_bytes(point[0])}: {format_time(point[1])}"])
    return [dict(type="scatter", mode="lines", name="budget", showlegend=False, hoverinfo="skip",
                 line=dict(color=style.BUDGET_COLOR, dash="dash", width=1.5), **line),
            dict(type="scatter", mode="markers", name="current", showlegend=False, hoverinfo="text",
                 marker=dict(color=style.BUDGET_COLOR, size=11, symbol="circle-open", line_width=2), **point)]


def frontier_layout(data: FrontierData, title: str | None = None) -> dict:
    """Layout of the frontier: budget axis in MiB/GiB, makespan on the left, overhead % on the right, the
    infeasible budgets (below the least feasible one) shaded."""
    T = data.store_all_time
    lay = style.base_layout(title or f"Makespan vs memory budget (least feasible {format_bytes(data.min_budget)})")
    x_lo, x_hi = data.x_range
    lay.update(
        xaxis=dict(style.byte_axis(x_lo, x_hi, ""), range=[x_lo, x_hi]),
        yaxis=dict(title_text="makespan", tickformat="~s", ticksuffix="s", range=list(data.y_range)),
        hovermode="x",  # a click anywhere picks the nearest budget: the explorer jumps there
        # a compact legend: at 420 px the default one took a third of the figure
        legend=dict(orientation="h", yanchor="top", y=-0.1, xanchor="left", x=0.0, font=dict(size=11),
                    itemwidth=30, tracegroupgap=0),
        shapes=[dict(type="rect", xref="x", yref="paper", x0=x_lo, x1=data.min_budget, y0=0, y1=1,
                     fillcolor=style.INFEASIBLE_FILL, line_width=0, layer="below")],
        annotations=[dict(x=(x_lo + data.min_budget) / 2, y=0.5, xref="x", yref="paper", text="infeasible",
                          showarrow=False, textangle=-90, font=dict(color="#555"))],
    )
    if data.makespans[0] > data.y_range[1]:  # the optimum's cliff at the least budget is off the top: say its cost
        lay["annotations"].append(dict(
            x=data.min_budget, y=1, xref="x", yref="paper", xanchor="left", yanchor="top", showarrow=False,
            text=f"↑ {format_time(float(data.makespans[0]))} at the least budget, off the top",
            font=dict(size=11, color="#555")))
    if T > 0:
        lo, hi = (100 * (y / T - 1) for y in data.y_range)
        # round percentages, none below 0% (nothing is faster than store-all); plotly's own choice for an overlaying
        # axis follows the left axis' ticks and lands on values like 50.9%
        ticks = style.nice_ticks(max(lo, 0.0), hi)
        lay["yaxis2"] = dict(title_text="overhead over store-all", overlaying="y", side="right", range=[lo, hi],
                             tickmode="array", tickvals=ticks, ticktext=[f"{v:g}%" for v in ticks],
                             showgrid=False, zeroline=False)
        lay["margin"] = dict(style.MARGIN, r=60)
    return lay


def frontier(solution: Any, strategies: Any = None, budget: int | None = None, *,
             max_overhead: float | None = None) -> go.Figure:
    """Makespan (left axis) and overhead over store-all (right axis) against the budget.

    ``solution`` is what :func:`hchain_viz.solve` returns (from :func:`hchain_viz.solve_offload`, the remat+offload
    curve is drawn with the remat-only optimum beside it); ``strategies`` picks the baselines drawn beside the
    optimal curve (None: all of ``core.strategies.frontier_points``; False: none; a list of names; or a mapping
    name → [(peak_bytes, makespan)]). ``budget`` (bytes) is marked with a line. ``max_overhead`` (0.5: +50%) caps
    the time axis at that overhead over store-all: just above the least budget a deep chain's optimum can cost many
    times store-all (a cliff), which would flatten the rest of the curve.
    """
    for attr in ("frontier", "min_budget", "chain"):
        if not hasattr(solution, attr):
            raise HChainError(f"frontier() needs a Solution from hcv.solve(chain), got {type(solution).__name__}")
    data = FrontierData.of(solution, strategies, max_overhead=max_overhead)
    name = "optimal + offload" if hasattr(solution, "remat") else "optimal"
    return _units(go.Figure(data=frontier_traces(data, budget, chain_name=name), layout=frontier_layout(data)),
                  solution)


# ---------------------------------------------------------------------------------------------- will it fit (§7)
#: Strategy names of the batch-size figure as the legend shows them.
BATCH_LABELS = {"optimal": "optimal", "store_all": "store-all", "checkpoint_sequential": "checkpoint_sequential"}


def throughput_traces(sweep: Mapping[str, Sequence[Any]], largest: Mapping[str, Any] | None = None) -> list[dict]:
    """One line per strategy of samples/s against the batch size (only where it fits), and a marker at the
    largest batch it fits. ``sweep``: strategy -> FitPoints (``core.device.batch_sweep``); ``largest``: strategy ->
    the FitPoint of ``core.device.largest_batch`` (or None when nothing fits)."""
    traces = []
    for k, (name, points) in enumerate(sweep.items()):
        color = style.strategy_color("periodic" if name == "checkpoint_sequential" else name, k)
        fit = [p for p in points if p.fits]
        traces.append(dict(type="scatter", mode="lines+markers", name=BATCH_LABELS.get(name, name), legendgroup=name,
                           x=[p.batch for p in fit], y=[p.throughput for p in fit],
                           customdata=[[format_time(p.makespan), format_bytes(p.device_peak)] for p in fit],
                           line=dict(color=color), marker=dict(size=5),
                           hovertemplate="batch %{x}: %{y:,.0f} samples/s<br>step %{customdata[0]}, device peak "
                                         "%{customdata[1]}<extra>" + BATCH_LABELS.get(name, name) + "</extra>"))
        top = None if largest is None else largest.get(name)
        if top is not None:
            traces.append(dict(type="scatter", mode="markers+text", name=f"largest batch ({name})", legendgroup=name,
                               showlegend=False, x=[top.batch], y=[top.throughput], text=[f"max {top.batch}"],
                               textposition="top center", textfont=dict(color=color),
                               marker=dict(color=color, size=13, symbol="star"),
                               hovertemplate=f"largest batch that fits: {top.batch}<br>%{{y:,.0f}} samples/s"
                                             f"<extra>{BATCH_LABELS.get(name, name)}</extra>"))
    return traces


def throughput_layout(device_memory: int | None = None, margin: float | None = None, title: str | None = None) -> dict:
    """Layout of the batch-size figure: batch size on a log axis, samples/s on the left."""
    dev = "" if device_memory is None else f" on {format_bytes(device_memory)}"
    if device_memory is not None and margin:
        dev += f" (margin {100 * margin:g}%)"
    lay = style.base_layout(title or f"Throughput vs batch size{dev}")
    lay.update(xaxis=dict(type="log", title_text="batch size", zeroline=False),
               yaxis=dict(title_text="samples/s", rangemode="tozero", zeroline=False), hovermode="closest")
    return lay


def throughput(chain: Any, device_memory: int | str, batches: Sequence[int] | None = None, margin: float = 0.05,
               strategies: Sequence[str] | None = None) -> go.Figure:
    """Samples/s against the batch size on a device of ``device_memory``, for the optimal schedule, store-all and
    ``checkpoint_sequential``; each marks the largest batch it fits.

    ``chain`` must carry a fixed part and a batch-size fit (``hcv.profile_batches(..., optimizer=opt)``);
    ``batches``: the sizes drawn (default: powers of two up to past the largest fitting batch).
    """
    from ..core import device
    from ..core.units import parse_bytes

    if getattr(chain, "batch_fit", None) is None or getattr(chain, "fixed", None) is None:
        raise HChainError("throughput() needs a chain with a batch-size fit and a fixed part: profile it with "
                          "hcv.profile_batches(model, make_batch, sizes, optimizer=opt)")
    names = tuple(strategies or device.BATCH_STRATEGIES)
    largest = {s: device.largest_batch(chain, device_memory, s, margin) for s in names}
    if batches is None:
        top = max([p.batch for p in largest.values() if p is not None], default=1)
        batches = [2**k for k in range(0, max(1, (2 * top).bit_length()))]
    sweep = device.batch_sweep(chain, device_memory, sorted(set(batches)), margin, names)
    return go.Figure(data=throughput_traces(sweep, largest),
                     layout=throughput_layout(parse_bytes(device_memory), margin))
