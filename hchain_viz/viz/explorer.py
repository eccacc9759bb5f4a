"""The interactive explorer: a notebook widget to slide the memory budget and watch the optimal schedule change.

``Explorer(chain)`` (or ``explore(model, x)``, which profiles first) lays out four plotly FigureWidgets — the
frontier, the memory curve, the timeline and the storage tape — under a budget slider (MiB/GiB), a strategy selector
(switch to a baseline, or overlay one), a Play button with a step slider that replays the schedule op by op, and the
step's statistics. Clicking the frontier sets the budget. ``explorer.schedule`` / ``save_schedule`` / ``wrap`` export
what is on screen.

The explorer holds state and pushes data; it computes nothing itself. A budget change re-reads the solver's table
(``solution.schedule``), simulates, and sends the figure builders' output (:mod:`hchain_viz.viz.figures`) into the
widgets inside ``batch_update``. Slider events are throttled (:mod:`hchain_viz.viz.throttle`).

Programmatic control mirrors the controls: ``explorer.budget = nbytes``, ``explorer.strategy = "revolve"``,
``explorer.overlay = "sqrt_n"``, ``explorer.step = k``; ``explorer.figures`` maps names to the FigureWidgets.
"""

from __future__ import annotations

import html
from collections import OrderedDict
from typing import Any

import numpy as np

from ..core.chain import Chain
from ..core.schedule import Schedule
from ..core.simulate import simulate
from ..core.strategies import STRATEGIES, applicable
from ..core.units import format_bytes, format_time, parse_bytes
from ..errors import DependencyError, HChainError, InfeasibleBudget
from . import figures as F
from . import style
from .throttle import Throttle
from .trace_view import TraceView

try:
    import ipywidgets as W
    import plotly.graph_objects as go
    from plotly.basedatatypes import Undefined as _UNDEFINED  # "leave this property as it is" in plotly_update
except ImportError as e:  # pragma: no cover - both are hard dependencies of the package
    raise DependencyError("the explorer needs ipywidgets and plotly: `pip install ipywidgets plotly anywidget`") from e

__all__ = ["Explorer", "explore"]

OPTIMAL = "optimal"
# What a change of budget, strategy or step may alter; everything else (colours, hover templates, modes) is set once
# when the figures are built. Fewer keys per update is most of what keeps a budget change fast.
_DYNAMIC_DATA = frozenset(("x", "y", "base", "customdata", "text", "marker.opacity", "name", "showlegend"))
_CACHE_SIZE = 64  # (strategy, budget) -> view; a slider dragged back and forth hits it


def _baseline_schedule(chain: Chain, name: str, budget: int) -> tuple[Schedule, str]:
    """The family's schedule at ``budget``; when none fits, its least-memory one, with a note saying so."""
    fn = STRATEGIES[name]
    try:
        return fn(chain, budget), ""
    except InfeasibleBudget as e:
        need = e.min_budget
        note = f"{name} needs at least {format_bytes(need)}; shown at that budget" if need else str(e)
        return (fn(chain, need) if need else fn(chain, None)), note


class Explorer:
    """The explorer widget over ``chain`` (and its ``model``, for :meth:`wrap`).

    Parameters
    ----------
    chain:
        The profiled :class:`~hchain_viz.Chain`.
    model:
        The ``nn.Module`` the chain describes; only used by :meth:`wrap`.
    solution:
        A :class:`~hchain_viz.core.solver.Solution` of ``chain``; solved here when omitted.
    budget:
        The initial budget (bytes or text like ``"300MiB"``); halfway between the least feasible budget and
        store-all's peak when omitted.
    strategy:
        The strategy shown: ``"optimal"`` or a baseline name of ``hcv.strategies.STRATEGIES`` that applies to the chain.
    baselines:
        Baselines drawn on the frontier: None (all), False (none), or a list of names (see :func:`figures.frontier`).
    throttle_ms:
        Least time between two redraws while the budget slider is dragged.
    width:
        Width of the layout in pixels (the frontier and the memory curve share a row).
    """

    def __init__(self, chain: Chain, model: Any = None, *, solution: Any = None, budget: int | str | None = None,
                 strategy: str = OPTIMAL, baselines: Any = None, throttle_ms: float = 60.0, width: int = 1100):
        if not isinstance(chain, Chain):
            raise HChainError(f"Explorer needs a Chain (from hcv.profile or hcv.Chain), got {type(chain).__name__}; "
                              "for a model use hcv.explore(model, sample_input)")
        if solution is None:
            from ..core.solver import solve

            solution = solve(chain)
        elif getattr(solution, "chain", None) != chain:
            raise HChainError("the solution was solved for another chain; pass solution=hcv.solve(chain) for this one")
        if solution.min_budget is None:
            raise HChainError(f"no schedule fits up to max_budget = {format_bytes(solution.max_budget)}; solve "
                              "again with a larger max_budget (the default, store-all's peak, always works)")
        self.chain = chain
        self.model = model
        self.solution = solution
        self.min_budget = int(solution.min_budget)
        self.max_budget = int(max(getattr(solution, "store_all_peak", solution.max_budget), self.min_budget))
        self._unit = style.byte_unit(self.max_budget)  # one unit for every hover, so templates never change
        self._strategies = [OPTIMAL, *applicable(chain)]  # the transformer baselines need groups / tags
        self._frontier = F.FrontierData.of(solution, baselines)
        self._cache: OrderedDict[tuple[str, int], tuple[TraceView, str]] = OrderedDict()

        self._budget = self._check_budget(budget if budget is not None else (self.min_budget + self.max_budget) // 2)
        self._strategy = self._check_strategy(strategy)
        self._overlay: str | None = None
        self._view, self._note = self._view_for(self._strategy, self._budget)
        self._overlay_view: TraceView | None = None
        self._step = self._view.n
        self._syncing = False  # True while the explorer itself moves a control: its observer must not echo

        self._build_widgets(throttle_ms / 1000.0, int(width))
        self._draw_budget()

    # ------------------------------------------------------------------------------------------ public state
    @property
    def budget(self) -> int:
        """The memory budget in bytes. Setting it (bytes or text like ``"1.5GiB"``) updates every view."""
        return self._budget

    @budget.setter
    def budget(self, value: int | str) -> None:
        self._budget = self._check_budget(value)
        self._draw_budget()

    @property
    def strategy(self) -> str:
        """The strategy shown: ``"optimal"`` or a baseline name."""
        return self._strategy

    @strategy.setter
    def strategy(self, name: str) -> None:
        self._strategy = self._check_strategy(name)
        self._draw_budget(frontier=False)

    @property
    def overlay(self) -> str | None:
        """A second strategy whose memory curve is drawn over the current one (None: no overlay)."""
        return self._overlay

    @overlay.setter
    def overlay(self, name: str | None) -> None:
        self._overlay = None if name is None else self._check_strategy(name)
        self._draw_budget(frontier=False)

    @property
    def step(self) -> int:
        """Number of ops replayed, 0..len(schedule): the cursor of the player."""
        return self._step

    @step.setter
    def step(self, k: int) -> None:
        n = self._view.n
        if not isinstance(k, int) or not 0 <= k <= n:
            raise HChainError(f"step must be an integer in 0..{n} (ops of the current schedule), got {k!r}")
        self._step = k
        self._draw_step()

    @property
    def schedule(self) -> Schedule:
        """The schedule on screen, with the budget, strategy and predicted makespan and peak in its metadata."""
        tr = self._view.trace
        meta = dict(tr.schedule.meta)
        meta.update(strategy=self._strategy, budget=self._budget, makespan=tr.makespan, peak=tr.peak_memory)
        return Schedule(tr.schedule.ops, meta)

    @property
    def trace(self):
        """The simulated :class:`~hchain_viz.Trace` of :attr:`schedule`."""
        return self._view.trace

    @property
    def figures(self) -> dict[str, go.FigureWidget]:
        """``{"frontier", "memory", "timeline", "tape"}`` → FigureWidget."""
        return dict(self._figs)

    @property
    def widget(self) -> W.Widget:
        """The whole layout, for embedding in other ipywidgets."""
        return self._layout

    def save_schedule(self, path: str) -> str:
        """Write :attr:`schedule` as JSON (``hchain-schedule/1``) to ``path``; returns the path."""
        self.schedule.to_json(str(path), indent=1)
        return str(path)

    def wrap(self, model: Any = None, **kwargs: Any) -> Any:
        """``hcv.wrap(model, explorer.schedule)``: an ``nn.Module`` that trains by the schedule on screen."""
        model = self.model if model is None else model
        if model is None:
            raise HChainError("no model to wrap: pass it, explorer.wrap(model), or build the explorer with one")
        from ..runtime.wrap import wrap

        return wrap(model, self.schedule, **kwargs)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return self._layout._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self._layout)

    def __repr__(self) -> str:
        tr = self._view.trace
        return (f"Explorer({self.chain.length} stages, budget {format_bytes(self._budget)} in "
                f"[{format_bytes(self.min_budget)}, {format_bytes(self.max_budget)}], {self._strategy}: "
                f"makespan {format_time(tr.makespan)}, peak {format_bytes(tr.peak_memory)})")

    # ------------------------------------------------------------------------------------------ validation
    def _check_budget(self, value: int | str) -> int:
        b = parse_bytes(value)
        if b < self.min_budget:
            raise InfeasibleBudget(
                f"no schedule fits {format_bytes(b)} ({b} bytes); the least feasible budget is "
                f"{format_bytes(self.min_budget)} ({self.min_budget} bytes)", self.min_budget, b)
        return b

    def _check_strategy(self, name: str) -> str:
        if name not in self._strategies:
            raise HChainError(f"unknown strategy {name!r}; choose one of {', '.join(self._strategies)}")
        return name

    # ------------------------------------------------------------------------------------------ data
    def _view_for(self, name: str, budget: int) -> tuple[TraceView, str]:
        key = (name, budget)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        if name == OPTIMAL:
            sched = self.solution.schedule(budget)  # a budget above max_budget is answered as max_budget
            note = ""
        else:
            sched, note = _baseline_schedule(self.chain, name, budget)
        if "strategy" not in sched.meta:
            sched = Schedule(sched.ops, {**sched.meta, "strategy": name})
        out = (TraceView.of(simulate(self.chain, sched)), note)
        self._cache[key] = out
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return out

    # ------------------------------------------------------------------------------------------ widgets
    def _build_widgets(self, throttle_s: float, width: int) -> None:
        lo, hi = self.min_budget, self.max_budget
        self._budget_slider = W.IntSlider(
            value=min(self._budget, hi), min=lo, max=max(hi, lo + 1), step=max(1, (hi - lo) // 1000),
            description="budget", readout=False, continuous_update=True, layout=W.Layout(width="420px"))
        self._budget_label = W.HTML()
        self._strategy_dd = W.Dropdown(options=self._strategies, value=self._strategy, description="strategy",
                                       layout=W.Layout(width="230px"))
        # "" stands for "no overlay": an ipywidgets Dropdown treats the value None as "nothing selected" and shows
        # a blank box instead of the "none" option.
        self._overlay_dd = W.Dropdown(options=[("none", "")] + [(s, s) for s in self._strategies], value="",
                                      description="compare", layout=W.Layout(width="230px"))
        self._play = W.Play(value=self._step, min=0, max=self._view.n, interval=80, description="play")
        self._step_slider = W.IntSlider(value=self._step, min=0, max=self._view.n, description="step",
                                        continuous_update=True, layout=W.Layout(width="420px"))
        W.jslink((self._play, "value"), (self._step_slider, "value"))  # the browser advances the slider itself
        # Fixed height: a label that wraps to one or two lines by op name would make the figures jump during Play.
        self._step_label = W.HTML(layout=W.Layout(height="44px", overflow="hidden"))
        self._stats = W.HTML()
        self._path = W.Text(value="schedule.json", description="file", layout=W.Layout(width="300px"))
        self._save = W.Button(description="Save schedule", icon="download")
        self._save_label = W.HTML()

        self._throttled_budget = Throttle(self._on_budget_slider, throttle_s)
        self._budget_slider.observe(lambda ch: self._syncing or self._throttled_budget(ch["new"]), "value")
        self._strategy_dd.observe(lambda ch: self._syncing or setattr(self, "strategy", ch["new"]), "value")
        self._overlay_dd.observe(lambda ch: self._syncing or setattr(self, "overlay", ch["new"] or None), "value")
        self._step_slider.observe(lambda ch: self._syncing or self._on_step_slider(ch["new"]), "value")
        self._save.on_click(lambda _: self._on_save())

        fd = self._frontier
        # Fixed pixel widths (plotly's autosize misjudges widget boxes), given in the layout each widget is BUILT
        # with: a later `fig.layout.width = w` only reaches views that already exist, so a browser that renders
        # the widget afterwards (Voila, a reopened notebook) would autosize to 700 px and clip the half-width pair.
        half = dict(width=width // 2)
        full = dict(width=width)
        self._figs = {
            "frontier": go.FigureWidget(data=F.frontier_traces(fd, self._budget, self._unit),
                                        layout={**F.frontier_layout(fd), **half}),
            "memory": go.FigureWidget(data=F.memory_traces(self._view, self._budget, None, None, self._unit),
                                      layout={**F.memory_layout(self._view, self._budget), **half}),
            "timeline": go.FigureWidget(data=F.timeline_traces(self._view, None, self._unit),
                                        layout={**F.timeline_layout(self._view), **full}),
            "tape": go.FigureWidget(data=F.tape_traces(self._view, None, self._unit),
                                    layout={**F.tape_layout(self._view), **full}),
        }
        self._n_frontier_curves = 1 + len(fd.baselines)  # optimal + baselines; the budget marks come after them
        # Only the optimal curve listens: it is dense and the frontier's hovermode is "x", so a click anywhere lands
        # on it near the pointer; plotly calls back once per clicked trace, and one answer per click is enough.
        self._figs["frontier"].data[0].on_click(self._on_frontier_click)

        L = self.chain.length
        head = W.HTML(f"<b>hchain_viz explorer</b> — {L} stages, store-all "
                      f"{format_time(self.chain.store_all_time)} at {format_bytes(self.max_budget)}; least feasible "
                      f"budget {format_bytes(self.min_budget)}")
        self._layout = W.VBox([
            head,
            W.HBox([self._budget_slider, self._budget_label]),
            W.HBox([self._strategy_dd, self._overlay_dd]),
            W.HBox([self._play, self._step_slider, self._step_label]),
            self._stats,
            W.HBox([self._figs["frontier"], self._figs["memory"]], layout=W.Layout(width="100%")),
            self._figs["timeline"],
            self._figs["tape"],
            W.HBox([self._path, self._save, self._save_label]),
        ])

    # ------------------------------------------------------------------------------------------ event handlers
    def _on_budget_slider(self, value: int) -> None:
        self._budget = self._check_budget(max(int(value), self.min_budget))
        self._draw_budget()

    def _on_step_slider(self, value: int) -> None:
        self._step = min(int(value), self._view.n)
        self._draw_step()

    def _on_frontier_click(self, trace: Any, points: Any, state: Any) -> None:
        """A click on the frontier jumps to that budget (clamped to the feasible range)."""
        if not points.xs:
            return
        self.budget = int(min(max(points.xs[0], self.min_budget), self.max_budget))

    def _on_save(self) -> None:
        try:
            path = self.save_schedule(self._path.value)
            self._save_label.value = f"saved {html.escape(path)}"
        except OSError as e:
            self._save_label.value = f"<span style='color:#c00'>cannot write: {html.escape(str(e))}</span>"

    # ------------------------------------------------------------------------------------------ drawing
    def _draw_budget(self, frontier: bool = True) -> None:
        """Re-read the schedule(s) at the current budget and redraw everything (step reset to the end)."""
        self._view, self._note = self._view_for(self._strategy, self._budget)
        self._overlay_view = None if self._overlay is None else self._view_for(self._overlay, self._budget)[0]
        self._step = self._view.n
        v = self._view
        self._syncing = True
        try:
            self._budget_slider.value = min(max(self._budget, self._budget_slider.min), self._budget_slider.max)
            self._strategy_dd.value = self._strategy
            self._overlay_dd.value = self._overlay or ""
            self._play.max = self._step_slider.max = v.n
            self._play.step = max(1, v.n // 250)  # a replay takes ~20 s at most, whatever the op count
            self._play.value = self._step_slider.value = v.n
        finally:
            self._syncing = False
        self._budget_label.value = f"<b>{format_bytes(self._budget)}</b>"
        self._push_views(None)
        if frontier or self._strategy != OPTIMAL:
            tr = v.trace
            point = None if self._strategy == OPTIMAL else (tr.peak_memory, tr.makespan)
            _push(self._figs["frontier"], F.frontier_budget_traces(self._frontier, self._budget, point),
                  first=self._n_frontier_curves)
        self._draw_stats()

    def _draw_step(self) -> None:
        """Move the player's cursor: faint future ops, memory revealed up to the step, the tape at that moment."""
        self._syncing = True
        try:
            self._step_slider.value = self._step
        finally:
            self._syncing = False
        self._push_views(self._step)
        self._draw_step_label()

    def _push_views(self, step: int | None) -> None:
        """Redraw the memory curve, timeline and tape of the current view after ``step`` ops (None: all, no cursor)."""
        v, u, b, o = self._view, self._unit, self._budget, self._overlay_view
        _push(self._figs["memory"], F.memory_traces(v, b, step, o, u), F.memory_layout(v, b, step, o))
        _push(self._figs["timeline"], F.timeline_traces(v, step, u), F.timeline_layout(v, step))
        _push(self._figs["tape"], F.tape_traces(v, step, u), F.tape_layout(v, step))

    def _draw_step_label(self) -> None:
        v, k = self._view, self._step
        if k == 0:
            text = f"0 / {v.n}: nothing run yet, {format_bytes(v.trace.initial_memory)} resident (x_0)"
        else:
            e = v.trace.events[k - 1]
            text = (f"{k} / {v.n}: <b>{html.escape(str(v.labels[k - 1]))}</b> at {format_time(e.end)}, "
                    f"{format_bytes(e.mem_after)} resident (peak during it {format_bytes(e.mem_peak)})")
        self._step_label.value = text

    def _draw_stats(self) -> None:
        rows = [(self._strategy, self._view)]
        if self._overlay_view is not None:
            rows.append((self._overlay, self._overlay_view))
        cells = "".join(
            f"<tr><td><b>{html.escape(name)}</b></td><td>{format_time(v.makespan)}</td>"
            f"<td>{100 * v.trace.overhead:+.1f}%</td><td>{format_bytes(v.peak)}</td>"
            f"<td>{v.trace.n_recomputed}</td><td>{v.n}</td></tr>" for name, v in rows)
        over = self._view.peak > self._budget
        note = self._note or (f"peak exceeds the budget by {format_bytes(self._view.peak - self._budget)}"
                              if over else "")
        self._stats.value = (
            "<table style='border-collapse:collapse' cellpadding='3'><tr><th>strategy</th><th>makespan</th>"
            "<th>overhead vs store-all</th><th>peak</th><th>recomputed forwards</th><th>ops</th></tr>"
            f"{cells}</table>" + (f"<div style='color:#c00'>{html.escape(note)}</div>" if note else ""))
        self._draw_step_label()


def _push(fig: go.FigureWidget, traces: list[dict], layout: dict | None = None, first: int = 0) -> None:
    """Send builder output into a FigureWidget as ONE plotly update message: trace ``first + j`` gets ``traces[j]``.

    NOTE [fast updates]: ``fig.plotly_update`` (the same path the browser's own edits take) stores values without
    plotly.py's per-property validation, which costs milliseconds per property and dominated a budget change. This
    is safe because the values come from the very builders whose output was validated when the figure was built,
    and only values that differ from the stored ones are sent. It is the one-message equivalent of assigning every
    property inside ``fig.batch_update()``.
    """
    flat = [{k: v for k, v in _flatten(d).items() if k in _DYNAMIC_DATA} for d in traces]
    keys = dict.fromkeys(k for f in flat for k in f)
    restyle = {k: [f.get(k, _UNDEFINED) for f in flat] for k in keys}  # one entry per trace; missing: untouched
    relayout = {} if layout is None else {k: layout[k] for k in F.DYNAMIC_LAYOUT if k in layout}
    fig.plotly_update(restyle_data=restyle, relayout_data=relayout,
                      trace_indexes=list(range(first, first + len(traces))))


def _flatten(d: dict, prefix: str = "") -> dict:
    """``{"marker": {"opacity": x}}`` -> ``{"marker.opacity": x}``; arrays and lists are values, not branches."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v.tolist() if isinstance(v, np.ndarray) and v.dtype == object else v
    return out


def explore(model: Any, sample_input: Any, loss_fn: Any = None, **profile_kwargs: Any) -> Explorer:
    """Profile ``model`` on ``sample_input`` (:func:`hchain_viz.profile`) and open an :class:`Explorer` on it.

    ``loss_fn`` and ``profile_kwargs`` (``device``, ``warmup``, ``repeats``, ``progress``) go to the profiler; the
    explorer keeps ``model`` for :meth:`Explorer.wrap`.
    """
    from ..runtime.profile import profile

    chain = profile(model, sample_input, loss_fn, **profile_kwargs)
    return Explorer(chain, model)
