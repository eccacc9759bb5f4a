"""The interactive explorer: a notebook widget to slide the memory budget and watch the optimal schedule change.

``Explorer(chain)`` (or ``explore(model, x)``, which profiles first) lays out the frontier, the memory curve, the
timeline and the storage tape in one :class:`~hchain_viz.viz.board.FigureBoard` under a budget slider, a strategy
selector and a player; a device panel for a chain with a fixed part (design.md §7), and a pipeline view
(:mod:`hchain_viz.viz.pipeline`, docs/design.md §12) on request. Every control and its property: docs/explorer.md.

It holds state and computes nothing (docs/design.md §1): a budget change re-reads ``solution.schedule``, simulates,
and has the board send the changed figures (:mod:`hchain_viz.viz.figures`); slider events are throttled.
"""

from __future__ import annotations

import asyncio
import html
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import numpy as np

from ..core import device as D
from ..core.batch import at_batch
from ..core.chain import Chain
from ..core.schedule import Schedule
from ..core.simulate import simulate
from ..core.strategies import STRATEGIES, applicable
from ..core.units import format_bytes, format_time, parse_bytes
from ..errors import DependencyError, DoesNotFit, HChainError, InfeasibleBudget
from ..runtime.progress import status
from . import figures as F
from . import style
from .throttle import Throttle
from .trace_view import TraceView

try:
    import ipywidgets as W
    import plotly.graph_objects as go
    from plotly.basedatatypes import Undefined as _UNDEFINED  # "leave this property as it is" in plotly_update

    from .board import FigureBoard
except ImportError as e:  # pragma: no cover - all three are hard dependencies of the package
    raise DependencyError("the explorer needs ipywidgets, plotly and anywidget: "
                          "`pip install ipywidgets plotly anywidget`") from e

__all__ = ["Explorer", "explore"]

OPTIMAL = "optimal"
# What a change of budget, strategy or step may alter; everything else (colours, hover templates, modes) is set once
# when the figures are built. Fewer keys per update is most of what keeps a budget change fast.
_DYNAMIC_DATA = frozenset(("x", "y", "base", "customdata", "text", "marker.opacity", "name", "showlegend"))
# Keyboard: the budget slider's arrow keys move it 1% of its range (PageUp/PageDown 10%: see board.py's page keys).
_KEY_STEPS = 100
# What x, x̄ and δ are, under the controls (hover a term for more).
_GLOSSARY = (
    "<div class='hcv-glossary' style='font-size:90%;color:#444;white-space:normal;line-height:1.4'>"
    "<span title='the input of stage i, kept by a forward without autograd (Fck) until its backward: a checkpoint'>"
    "<b style='color:#238b45'>x<sub>i</sub></b> a stage's input kept as a checkpoint</span> · "
    "<span title='what a forward recording autograd (Fall) leaves for the backward of stage i: its output and the "
    "tensors it saved'><b style='color:#3182bd'>x̄<sub>i+1</sub></b> everything stage i keeps for its backward</span> · "
    "<span title='the gradient a backward (B) hands to the stage before it; it has the size of x_i'>"
    "<b style='color:#e6550d'>δ<sub>i</sub></b> the gradient flowing back into stage i</span> · "
    "<span title='forwards of a stage that already ran: what a schedule pays for the memory it saves'>"
    "<b style='color:#d62728'>red bars</b> forwards run again</span></div>")
# The frontier and the memory figure share a row: half the width, so taller than a figure of its own, leaving the
# frontier's legend (two or three short rows at 420 px) room below a plot of readable height.
_PAIR_HEIGHT = 380
_CACHE_SIZE = 64  # (strategy, budget) -> view; a slider dragged back and forth hits it
# Play's time per op, and the most it slows to when the kernel takes longer than that to draw a step.
_PLAY_MS, _PLAY_MAX_MS = 80, 600
# The statistics table: numbers right-aligned under right-aligned heads, names left; one line kept for a note.
_STATS_STYLE = ("<style>.hcv-stats{border-collapse:collapse;font-variant-numeric:tabular-nums}"
                ".hcv-stats th,.hcv-stats td{text-align:right;padding:2px 8px;white-space:nowrap}"
                ".hcv-stats th:first-child,.hcv-stats td:first-child{text-align:left;padding-left:0}"
                ".hcv-stats .hcv-none td{color:#999;font-style:italic}"
                ".hcv-note{color:#c00;height:1.4em;overflow:hidden;white-space:nowrap;text-overflow:ellipsis}</style>")
# Explorers not yet closed, with the notebook cell that made each (None outside JupyterLab): a new explorer closes
# the ones it replaces, so re-running a cell does not leave widgets alive in the kernel (and in a reloaded page).
_OPEN: list[tuple[Explorer, str | None]] = []


def _cell() -> tuple[str | None, list[str]]:
    """The id of the notebook cell being run and of the cells deleted since the last run (JupyterLab and Notebook 7
    send them with every execute request); (None, []) elsewhere."""
    try:
        from IPython import get_ipython

        meta = get_ipython().kernel.get_parent()["metadata"]
    except Exception:  # no IPython, no kernel, no parent message: not in a notebook
        return None, []
    cell = meta.get("cellId")
    return (cell if isinstance(cell, str) else None), [c for c in meta.get("deletedCells") or [] if isinstance(c, str)]


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
    """The explorer widget over ``chain`` (and its ``model``, for :meth:`wrap`); docs/design.md §1.

    Args:
        chain: the profiled :class:`~hchain_viz.Chain`.
        model: the ``nn.Module`` the chain describes; only used by :meth:`wrap`.
        solution: a :class:`~hchain_viz.core.solver.Solution` of ``chain``; solved here when omitted.
        budget: the initial budget (bytes or ``"300MiB"``); default halfway between the least and store-all's peak.
        strategy: ``"optimal"`` or a baseline of ``hcv.strategies.STRATEGIES`` that applies to the chain.
        baselines: drawn on the frontier: None (all), False (none), or a list of names (:func:`figures.frontier`).
        throttle_ms: least time between two redraws while the budget slider is dragged.
        width: largest width in pixels; by default it fills its output area and follows it.
        device_memory, margin, axis: the device panel's device (bytes or ``"24GiB"``), allocator margin (a
            fraction) and memory axis (``"activations"`` or ``"device"``); only for chains with a fixed part.
        pipeline: ``(devices, microbatches)`` adds the pipeline view of the chain as given below (:attr:`pipeline`,
            a :class:`~hchain_viz.viz.pipeline.PipelineView`; docs/design.md §12); None: no pipeline view.

    Raises:
        HChainError: ``chain`` is not a Chain, ``solution`` was solved for another chain, or a pipeline view is
            asked of a chain without its fixed part (profile with ``optimizer=``).
    """

    def __init__(self, chain: Chain, model: Any = None, *, solution: Any = None, budget: int | str | None = None,
                 strategy: str = OPTIMAL, baselines: Any = None, throttle_ms: float = 60.0, width: int | None = None,
                 device_memory: int | str | None = None, margin: float = D.DEFAULT_MARGIN, axis: str = "activations",
                 pipeline: tuple[int, int] | None = None):
        if not isinstance(chain, Chain):
            raise HChainError(f"Explorer needs a Chain (from hcv.profile or hcv.Chain), got {type(chain).__name__}; "
                              "for a model use hcv.explore(model, sample_input)")
        if solution is not None and getattr(solution, "chain", None) != chain:
            raise HChainError("the solution was solved for another chain; pass solution=hcv.solve(chain) for this one")
        with status("building the explorer"):  # in a notebook, a line that counts the seconds until it shows
            self._init(chain, model, solution, budget, strategy, baselines, throttle_ms, width, device_memory,
                       margin, axis, pipeline)

    def _init(self, chain: Chain, model: Any, solution: Any, budget: int | str | None, strategy: str, baselines: Any,
              throttle_ms: float, width: int | None, device_memory: int | str | None, margin: float,
              axis: str, pipeline: tuple[int, int] | None) -> None:
        self.model = model
        self._strategies = [OPTIMAL, *applicable(chain)]  # the transformer baselines need groups / tags
        self._baselines = baselines
        self._base_chain = chain  # the chain as given: batch sizes are taken from its fit
        self._profiled = chain  # precisions are derived from its fixed part as profiled (docs/design.md §11)
        self._device: int | None = None  # bytes of the chosen device (None: no device chosen)
        self._margin = D.DEFAULT_MARGIN
        self._axis = "activations"
        self._device_note = ""
        self._device_fits = True
        self._throughput_fig: go.Figure | None = None
        if axis not in ("activations", "device"):
            raise HChainError(f"axis must be 'activations' or 'device', got {axis!r}")
        if (device_memory is not None or axis == "device") and chain.fixed is None:
            raise HChainError("the device panel needs the chain's fixed part: profile with the optimizer, "
                              "hcv.profile(model, x, loss_fn, optimizer=opt)")
        self.pipeline = None  # the pipeline view (PipelineView), when asked for
        if pipeline is not None:
            from .pipeline import PipelineView, check_pipeline

            self.pipeline = PipelineView(chain, *check_pipeline(chain, pipeline))
        self._set_chain(chain, solution)

        self._budget = self._check_budget(budget if budget is not None else (self.min_budget + self.max_budget) // 2)
        self._strategy = self._check_strategy(strategy)
        self._overlay: str | None = None
        self._view, self._note = self._view_for(self._strategy, self._budget)
        self._overlay_view: TraceView | None = None
        self._step = self._view.n
        self._syncing = False  # True while the explorer itself moves a control: its observer must not echo

        if width is not None and (not isinstance(width, int) or width < 300):
            raise HChainError(f"width is the explorer's largest width in pixels, 300 or more (or None to fill the "
                              f"output area), got {width!r}")
        self._build_widgets(throttle_ms / 1000.0, width)
        self._draw_budget()
        if self.chain.fixed is not None:
            self._margin = self._check_margin(margin)
            self._axis = axis
            if device_memory is not None:
                self._set_device(device_memory)
            self._redraw_all()
        self._replace_stale()

    def _set_chain(self, chain: Chain, solution: Any = None) -> None:
        """Solve ``chain`` (unless ``solution`` is given) and reset everything that depends on it."""
        if solution is None:
            from ..core.solver import solve

            solution = solve(chain)
        if solution.min_budget is None:
            raise HChainError(f"no schedule fits up to max_budget = {format_bytes(solution.max_budget)}; solve "
                              "again with a larger max_budget (the default, store-all's peak, always works)")
        self.chain = chain
        self.solution = solution
        self.min_budget = int(solution.min_budget)
        self.max_budget = int(max(getattr(solution, "store_all_peak", solution.max_budget), self.min_budget))
        self._unit = style.byte_unit(self.max_budget)  # one unit for every hover, so templates never change
        self._frontier = F.FrontierData.of(solution, self._baselines)
        self._cache: OrderedDict[tuple[str, int], tuple[TraceView, str]] = OrderedDict()
        self._refined: set[int] = set()  # budgets whose optimal answer in the cache is Solution.refined's
        self._refining: int | None = None  # the budget a background refinement works on

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
        self._draw_budget()  # the frontier's point moves to the strategy's, or back to the optimum

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

    # ---------------------------------------------------------------- will it fit (docs/design.md §7)
    @property
    def device_memory(self) -> int | None:
        """The device chosen in the device panel (bytes), or None. Setting it (bytes, text like ``"24GiB"``, or a
        :data:`~hchain_viz.core.device.DEVICE_PRESETS` label) moves the budget to the fastest schedule whose whole
        step fits; when nothing fits, the budget stays and the panel says so (see :attr:`device_note`)."""
        return self._device

    @device_memory.setter
    def device_memory(self, value: int | str | None) -> None:
        self._need_fixed()
        self._set_device(value)
        self._redraw_all()

    @property
    def device_note(self) -> str:
        """What the device panel says: the schedule chosen for the device, or why nothing fits ("" without device)."""
        return self._device_note

    @property
    def margin(self) -> float:
        """The allocator margin, a fraction of the device memory kept free."""
        return self._margin

    @margin.setter
    def margin(self, value: float) -> None:
        self._need_fixed()
        self._margin = self._check_margin(value)
        if self._device is not None:
            self._set_device(self._device)
        self._redraw_all()

    @property
    def axis(self) -> str:
        """``"activations"`` (the slider and the frontier in activation bytes, design.md §3) or ``"device"`` (in bytes
        of the whole step: the fixed part plus activations)."""
        return self._axis

    @axis.setter
    def axis(self, value: str) -> None:
        self._need_fixed()
        if value not in ("activations", "device"):
            raise HChainError(f"axis must be 'activations' or 'device', got {value!r}")
        self._axis = value
        self._redraw_all()

    @property
    def batch(self) -> int | None:
        """The batch size shown (for a chain with a batch-size fit). Setting it re-solves at that size."""
        return self.chain.batch

    @batch.setter
    def batch(self, value: int) -> None:
        if self._base_chain.batch_fit is None:
            raise HChainError("this chain has no batch-size fit; profile it with hcv.profile_batches(...)")
        self._set_chain(at_batch(self._base_chain, value))
        self._budget = min(max(self._budget, self.min_budget), self.max_budget)
        if self._device is not None:
            self._set_device(self._device)
        self._redraw_all()

    @property
    def precision(self) -> str | None:
        """The precision the fixed part is counted in (a name of :data:`~hchain_viz.core.fixed.PRECISIONS`; None
        without a fixed part). Setting it to one of ``chain.fixed.precisions()`` re-counts the fixed part
        (:func:`~hchain_viz.core.device.in_precision`) and answers the device again; activations stay as profiled."""
        return None if self.chain.fixed is None else self.chain.fixed.precision

    @precision.setter
    def precision(self, name: str) -> None:
        self._need_fixed()
        self._base_chain = D.in_precision(self._profiled, name)  # from the record as profiled: derivations don't chain
        self._set_chain(replace(self.chain, fixed=self._base_chain.fixed))
        self._budget = min(max(self._budget, self.min_budget), self.max_budget)
        if self._device is not None:
            self._set_device(self._device)
        self._redraw_all()

    def _need_fixed(self) -> None:
        if self.chain.fixed is None:
            raise HChainError("the device panel needs the chain's fixed part: profile with the optimizer, "
                              "hcv.profile(model, x, loss_fn, optimizer=opt)")

    def _check_margin(self, value: Any) -> float:
        D.usable_memory(1, value)  # validates
        return float(value)

    @property
    def _offset(self) -> int:
        """Bytes added to every budget on the slider and the frontier: the fixed part on the device axis."""
        return self.chain.fixed.total_per_rank if self._axis == "device" and self.chain.fixed is not None else 0

    def _set_device(self, value: int | str | None) -> None:
        """Choose a device: the budget becomes that of the fastest schedule whose whole step fits it."""
        if value is None:
            self._device, self._device_note, self._device_fits, self._throughput_fig = None, "", True, None
            return
        if isinstance(value, str) and value in D.DEVICE_PRESETS:
            value = D.DEVICE_PRESETS[value]
        dev = parse_bytes(value)
        usable = D.usable_memory(dev, self._margin)
        self._device = dev
        if self._base_chain.batch_fit is not None:  # throughput against the batch size on this device
            self._throughput_fig = F.throughput(self._base_chain, dev, margin=self._margin)
            b = self.chain.batch
            self._throughput_fig.add_vline(x=b, line=dict(color=style.BUDGET_COLOR, dash="dot"),
                                           annotation_text=f"batch {b}")
        head = (f"{format_bytes(dev)} device, {100 * self._margin:g}% margin: {format_bytes(usable)} usable; fixed "
                f"part {self.chain.fixed.describe()}")
        try:
            sched = D.device_schedule(self.solution, dev, self._margin)
        except DoesNotFit as e:
            self._device_fits = False
            self._device_note = f"{e}"[0].upper() + f"{e}"[1:]
            return
        self._device_fits = True
        budget = min(max(int(sched.meta.get("budget", self.max_budget)), self.min_budget), self.max_budget)
        self._budget = budget
        self._strategy = OPTIMAL
        peak = D.device_peak(simulate(self.chain, sched))
        self._device_note = (f"{head}. Fits: the optimal schedule at {format_bytes(budget)} of activations, "
                             f"whole-step peak {format_bytes(peak)} ({100 * peak / dev:.0f}% of the device)")

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
    def figures(self) -> dict[str, go.Figure]:
        """``{"frontier", "memory", "timeline", "tape"}`` → the figure on screen (a ``go.Figure`` kept in step with
        the page; change it through the explorer, not directly)."""
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
        from ..runtime.train.wrap import wrap

        return wrap(model, self.schedule, **kwargs)

    def close(self) -> None:
        """Release every widget of the explorer (controls and figures), in the kernel and in the page.

        Called for you on the explorers a new one replaces: one on the same chain object, or one made by the same
        notebook cell (a re-run) or by a deleted cell. The explorer's state (budget, schedule, figures) stays readable.
        """
        self._throttled_budget.cancel()
        for w in _tree(self._layout):
            w.close()
        _OPEN[:] = [(e, c) for e, c in _OPEN if e is not self]

    def _replace_stale(self) -> None:
        """Close the open explorers this one replaces (see :meth:`close`), then register this one."""
        cell, deleted = _cell()
        for other, other_cell in list(_OPEN):
            if other.chain is self.chain or (other_cell is not None and (other_cell == cell or other_cell in deleted)):
                other.close()
        _OPEN.append((self, cell))

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
    def clear_cache(self) -> None:
        """Forget the answers kept for recent budgets: the next move solves and simulates again."""
        self._cache.clear()
        self._refined.clear()

    def refine(self) -> None:
        """Show :meth:`Solution.refined`'s answer at the current budget (about a second of solving). On a long
        chain, whose tables are coarse in the middle of the range (``solution.coarse``), the slider does this by
        itself in the background once it stops (docs/design.md §4.4)."""
        self._take_refined(self._budget, self.solution.refined(self._budget))

    def _take_refined(self, budget: int, sched: Schedule) -> None:
        sched = Schedule(sched.ops, {**sched.meta, "strategy": OPTIMAL})
        self._cache[(OPTIMAL, budget)] = (TraceView.of(simulate(self.chain, sched)), "")
        self._refined.add(budget)
        if budget == self._budget:
            self._draw_budget()

    def _refine_soon(self) -> None:
        """In a notebook, refine the answer at the current budget on a thread (the solver's kernels run without the
        GIL) and show it when it comes, if the budget is still the same; one refinement at a time, the newest
        budget next."""
        if not getattr(self.solution, "coarse", False) or self._budget in self._refined or self._refining is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a script: refine() on demand
            return
        budget = self._refining = self._budget
        solution = self.solution

        def work() -> None:
            try:
                sched = self.solution.refined(budget)
            except Exception:  # noqa: BLE001 (the table's answer stays; nothing to show the user here)
                sched = None
            loop.call_soon_threadsafe(done, sched)

        def done(sched: Schedule | None) -> None:
            self._refining = None
            if sched is not None and self.solution is solution:  # not a chain replaced meanwhile
                self._take_refined(budget, sched)
            self._refine_soon()  # the slider may have moved on meanwhile

        threading.Thread(target=work, daemon=True, name="hchain_viz-refine").start()
        self._draw_stats()  # says it is refining

    def _view_for(self, name: str, budget: int) -> tuple[TraceView, str]:
        key = (name, budget)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        if name == OPTIMAL:
            self._refined.discard(budget)  # (evicted from the cache, if it was)
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
    def _build_widgets(self, throttle_s: float, width: int | None) -> None:
        lo, hi = self.min_budget, self.max_budget
        # Widths flex with the output area: rows wrap instead of scrolling sideways when it is narrow.
        grow = W.Layout(flex="1 1 240px", min_width="160px", max_width="560px")
        self._budget_slider = W.IntSlider(
            value=min(self._budget, hi), min=lo, max=max(hi, lo + 1), step=max(1, (hi - lo) // _KEY_STEPS),
            description="budget", readout=False, continuous_update=True, layout=grow)
        self._budget_slider.add_class("hcv-budget")
        self._budget_label = W.HTML(layout=W.Layout(flex="0 0 auto"))
        self._strategy_dd = W.Dropdown(options=self._strategies, value=self._strategy, description="strategy",
                                       layout=W.Layout(width="230px"))
        # "" stands for "no overlay": an ipywidgets Dropdown treats the value None as "nothing selected" and shows
        # a blank box instead of the "none" option.
        self._overlay_dd = W.Dropdown(options=[("none", "")] + [(s, s) for s in self._strategies], value="",
                                      description="compare", layout=W.Layout(width="230px"))
        self._play = W.Play(value=self._step, min=0, max=self._view.n, interval=_PLAY_MS, description="play")
        self._step_slider = W.IntSlider(value=self._step, min=0, max=self._view.n, description="step",
                                        continuous_update=True, layout=grow)
        self._step_slider.add_class("hcv-step")
        self._stats = W.HTML()
        self._path = W.Text(value="schedule.json", description="file", layout=W.Layout(width="300px"))
        self._save = W.Button(description="Save schedule", icon="download")
        self._save_label = W.HTML()
        device_row = self._build_device_widgets()

        self._throttled_budget = Throttle(self._on_budget_slider, throttle_s)
        self._budget_slider.observe(lambda ch: self._syncing or self._throttled_budget(ch["new"]), "value")
        self._strategy_dd.observe(lambda ch: self._syncing or setattr(self, "strategy", ch["new"]), "value")
        self._overlay_dd.observe(lambda ch: self._syncing or setattr(self, "overlay", ch["new"] or None), "value")
        self._step_slider.observe(lambda ch: self._syncing or self._on_step_slider(ch["new"]), "value")
        self._play.observe(lambda ch: self._syncing or self._on_step_slider(ch["new"]), "value")
        self._save.on_click(lambda _: self._on_save())

        self._figs = self._make_figures()
        self._board = FigureBoard(self._figs, rows=self._rows())
        self._board.on_click("frontier", self._on_frontier_click)

        L = self.chain.length
        # a chain profiled with compile=True says so: its times and sizes are those of the compiled stages
        compiled = " (compiled stages, torch.compile)" if self.chain.meta.get("compile") else ""
        head = W.HTML(layout=W.Layout(min_width="0"))
        head.value = (f"<b>hchain_viz explorer</b> — {L} stages{compiled}, store-all "
                      f"{format_time(self.chain.store_all_time)} at {format_bytes(self.max_budget)}; least "
                      f"feasible budget {format_bytes(self.min_budget)}")
        self._head = head
        self._timing = W.HTML(_timing_html(self.chain), layout=W.Layout(min_width="0"))
        row = dict(flex_flow="row wrap", align_items="center", width="100%")
        # The player sits right above the timeline, the figure it animates first (issue 43: at 800 px the timeline
        # was out of sight below the frontier while it played).
        self._layout = W.VBox([
            head,
            self._timing,
            W.HBox([self._budget_slider, self._budget_label], layout=W.Layout(**row)),
            W.HBox([self._strategy_dd, self._overlay_dd], layout=W.Layout(**row)),
            W.HTML(_GLOSSARY, layout=W.Layout(overflow="hidden", min_width="0")),
            *device_row,
            self._stats,
            W.HBox([self._play, self._step_slider], layout=W.Layout(**row)),
            self._board,  # its caption, right under the player, is the status line of the player's step
            W.HBox([self._path, self._save, self._save_label], layout=W.Layout(**row)),
            *([] if self.pipeline is None else [W.HTML("<b>pipeline</b>"), self.pipeline.widget]),
        ], layout=W.Layout(width="100%", min_width="0", max_width=None if width is None else f"{width}px"))
        self._layout.add_class("hcv-explorer")

    def _make_figures(self) -> dict[str, go.Figure]:
        """Every figure from scratch for the current chain, budget and axis."""
        fd = self._frontier
        # No widths: the board sizes every figure to its grid cell, and again whenever the output area changes.
        figs = {
            "frontier": go.Figure(data=self._frontier_traces(F.frontier_traces(fd, self._budget, self._unit)),
                                  layout=self._frontier_layout()),
            "memory": go.Figure(data=F.memory_traces(self._view, self._budget, None, None, self._unit),
                                layout=dict(F.memory_layout(self._view, self._budget), height=_PAIR_HEIGHT)),
            "timeline": go.Figure(data=F.timeline_traces(self._view, None, self._unit),
                                  layout=F.timeline_layout(self._view)),
            "tape": go.Figure(data=F.tape_traces(self._view, None, self._unit), layout=F.tape_layout(self._view)),
        }
        if self._throughput_fig is not None:
            figs["throughput"] = self._throughput_fig
        # optimal, baselines, the points beyond the axes; the budget marks come after them
        self._n_frontier_curves = 2 + len(fd.baselines)
        return figs

    def _rows(self) -> list[list[str]]:
        rows = [["timeline"], ["frontier", "memory"], ["tape"]]
        return rows + [["throughput"]] if self._throughput_fig is not None else rows

    def _frontier_traces(self, traces: list[dict]) -> list[dict]:
        """Frontier traces on the current axis: budgets moved by the fixed part on the device axis."""
        off = self._offset
        if not off:
            return traces
        return [{**t, "x": [v + off for v in t["x"]]} if "x" in t else t for t in traces]

    def _frontier_layout(self) -> dict:
        """The frontier's layout; on the device axis: in device bytes from 0, the fixed part a band, the device and
        its usable part lines."""
        lay = F.frontier_layout(self._frontier)
        lay["height"] = _PAIR_HEIGHT
        off = self._offset
        if self.chain.fixed is None or (not off and self._device is None):
            return lay
        x_lo, x_hi = self._frontier.x_range
        shapes = [dict(sh, x0=sh["x0"] + off, x1=sh["x1"] + off) for sh in lay.get("shapes", [])]
        notes = [dict(a, x=a["x"] + off) for a in lay.get("annotations", [])]
        lo = 0 if off else x_lo
        hi = x_hi + off
        if off:
            shapes.append(dict(type="rect", xref="x", yref="paper", x0=0, x1=off, y0=0, y1=1, layer="below",
                               fillcolor="rgba(148, 103, 189, 0.25)", line_width=0))
            notes.append(dict(x=off / 2, y=0.95, xref="x", yref="paper", showarrow=False,
                              text=f"fixed {format_bytes(off)}", font=dict(color="#5b3f8c")))
        if self._device is not None:  # on the activation axis the device lines sit at what is left for activations
            base = 0 if off else self.chain.fixed.total_per_rank
            for x, dash, text in ((D.usable_memory(self._device, self._margin) - base, "dash", "usable"),
                                  (self._device - base, "solid", "device")):
                shapes.append(dict(type="line", xref="x", yref="paper", x0=x, x1=x, y0=0, y1=1,
                                   line=dict(color="#d62728", dash=dash, width=1.5)))
                notes.append(dict(x=x, y=1.0, xref="x", yref="paper", showarrow=False, text=text, yanchor="bottom",
                                  font=dict(color="#d62728")))
                hi = max(hi, x)
        lay["xaxis"] = dict(style.byte_axis(lo, hi, "device memory" if off else ""), range=[lo, hi * 1.02])
        lay["shapes"], lay["annotations"] = shapes, notes
        if off:
            lay["title"] = dict(lay["title"], text=f"Makespan vs device memory (fixed part {format_bytes(off)} + "
                                                   f"activations)")
        return lay

    def _read_views(self) -> None:
        """The strategy's and the overlay's views at the current budget; the step cursor back at the end."""
        self._view, self._note = self._view_for(self._strategy, self._budget)
        self._overlay_view = None if self._overlay is None else self._view_for(self._overlay, self._budget)[0]
        self._step = self._view.n

    def _redraw_all(self) -> None:
        """After a change of chain, device or axis: every control and figure from the current state."""
        self._read_views()
        off = self._offset
        self._syncing = True
        try:
            lo, hi = self.min_budget + off, self.max_budget + off
            self._budget_slider.min = min(self._budget_slider.min, lo)  # keep min <= max while moving both
            self._budget_slider.max = max(hi, lo + 1)
            self._budget_slider.min = lo
            self._budget_slider.step = max(1, (hi - lo) // _KEY_STEPS)
            self._budget_slider.description = "device" if off else "budget"
            if self._device_widgets:
                self._axis_tb.value = self._axis
                self._margin_slider.value = self._margin
                if self._precision_dd is not None:
                    self._precision_dd.value = self.precision
                if self._batch_box is not None:
                    self._batch_box.value = self.chain.batch
        finally:
            self._syncing = False
        self._figs = self._make_figures()
        self._board.figures = dict(self._figs)
        self._board.rows = self._rows()
        self._draw_budget(frontier=False)
        self._device_label.value = self._device_html()

    def _device_html(self) -> str:
        if self.chain.fixed is None:
            return ""
        if not self._device_note:
            return ("<i>choose a device to see whether a training step fits (fixed part "
                    f"{html.escape(self.chain.fixed.describe())})</i>")
        bad = not self._device_fits
        return f"<div style='color:{'#c00' if bad else '#060'}'>{html.escape(self._device_note)}</div>"

    def _build_device_widgets(self) -> list[W.Widget]:
        """The device panel (presets, custom size, margin, axis) and the batch-size box; none without a fixed part."""
        self._device_widgets = self.chain.fixed is not None
        self._batch_box = None
        self._precision_dd = None
        self._device_label = W.HTML()
        if not self._device_widgets:
            return []
        options = [("none", 0)] + [(k, v) for k, v in D.DEVICE_PRESETS.items()] + [("custom", -1)]
        self._device_dd = W.Dropdown(options=options, value=0, description="device", layout=W.Layout(width="300px"))
        self._custom = W.Text(placeholder="custom, e.g. 20GiB", layout=W.Layout(width="160px"),
                              continuous_update=False)
        self._margin_slider = W.FloatSlider(value=self._margin, min=0.0, max=0.3, step=0.01, description="margin",
                                            readout_format=".0%", continuous_update=False)
        self._axis_tb = W.ToggleButtons(options=[("activations", "activations"), ("whole step", "device")],
                                        value=self._axis, description="axis")
        self._device_dd.observe(lambda ch: self._syncing or self._on_device(ch["new"]), "value")
        self._custom.observe(lambda ch: self._syncing or self._on_device(-1), "value")
        self._margin_slider.observe(lambda ch: self._syncing or setattr(self, "margin", ch["new"]), "value")
        self._axis_tb.observe(lambda ch: self._syncing or setattr(self, "axis", ch["new"]), "value")
        row = dict(flex_flow="row wrap", align_items="center", width="100%")
        items = [self._device_dd, self._custom, self._margin_slider, self._axis_tb]
        names = self.chain.fixed.precisions()
        if len(names) > 1:  # the fixed part in another precision of the profiled width (docs/design.md §11)
            self._precision_dd = W.Dropdown(options=names, value=self.precision, description="precision",
                                            layout=W.Layout(width="230px"))
            self._precision_dd.observe(lambda ch: self._syncing or setattr(self, "precision", ch["new"]), "value")
            items.append(self._precision_dd)
        if self.chain.batch_fit is not None:
            self._batch_box = W.BoundedIntText(value=self.chain.batch, min=1, max=2**24, description="batch",
                                               layout=W.Layout(width="180px"))
            self._batch_box.observe(lambda ch: self._syncing or setattr(self, "batch", ch["new"]), "value")
            items.append(self._batch_box)
        return [W.HBox(items, layout=W.Layout(**row)), self._device_label]

    def _on_device(self, choice: int) -> None:
        if choice == 0:
            self.device_memory = None
            return
        if choice == -1:
            text = self._custom.value.strip()
            if not text:
                return
            try:
                self.device_memory = text
            except HChainError as e:
                self._device_label.value = f"<div style='color:#c00'>{html.escape(str(e))}</div>"
            return
        self.device_memory = choice

    # ------------------------------------------------------------------------------------------ event handlers
    def _on_budget_slider(self, value: int) -> None:
        self._budget = self._check_budget(max(int(value) - self._offset, self.min_budget))
        self._draw_budget()
        self._refine_soon()

    def _on_step_slider(self, value: int) -> None:
        self._step = min(int(value), self._view.n)
        t0 = time.perf_counter()
        self._draw_step()
        # Play at the pace the kernel keeps: a tick that comes before the last one is drawn would queue up and the
        # figures would trail the player more and more on a busy machine
        busy_ms = 1000 * (time.perf_counter() - t0)
        interval = int(min(_PLAY_MAX_MS, max(_PLAY_MS, 1.5 * busy_ms)))
        if self._play.playing and abs(interval - self._play.interval) > 10:
            self._play.interval = interval

    def _on_frontier_click(self, click: dict) -> None:
        """A click on the frontier jumps to that budget (clamped to the feasible range). The frontier's hovermode is
        "x", so a click anywhere lands on the curves near the pointer; the budget is where it landed."""
        x = click.get("x")
        if isinstance(x, (int, float)) and np.isfinite(x):
            self.budget = int(min(max(x - self._offset, self.min_budget), self.max_budget))

    def _on_save(self) -> None:
        try:
            path = self.save_schedule(self._path.value)
            self._save_label.value = f"saved {html.escape(path)}"
        except OSError as e:
            self._save_label.value = f"<span style='color:#c00'>cannot write: {html.escape(str(e))}</span>"

    # ------------------------------------------------------------------------------------------ drawing
    def _draw_budget(self, frontier: bool = True) -> None:
        """Re-read the schedule(s) at the current budget and redraw everything (step reset to the end)."""
        self._read_views()
        v = self._view
        self._syncing = True
        try:
            self._budget_slider.value = min(max(self._budget + self._offset, self._budget_slider.min),
                                            self._budget_slider.max)
            self._strategy_dd.value = self._strategy
            self._overlay_dd.value = self._overlay or ""
            self._play.max = self._step_slider.max = v.n
            self._play.step = max(1, v.n // 250)  # a replay takes ~20 s at most, whatever the op count
            self._play.value = self._step_slider.value = v.n
        finally:
            self._syncing = False
        off = self._offset
        self._budget_label.value = (f"<b>{format_bytes(self._budget + off)}</b> = fixed {format_bytes(off)} + "
                                    f"activations {format_bytes(self._budget)}" if off else
                                    f"<b>{format_bytes(self._budget)}</b>")
        self._push_views(None)
        if frontier or self._strategy != OPTIMAL:
            tr = v.trace
            point = None if self._strategy == OPTIMAL else (tr.peak_memory, tr.makespan)
            if point is not None and self._offset:
                point = (point[0] + self._offset, point[1])
            marks = F.frontier_budget_traces(self._frontier, self._budget, point)
            if self._offset:  # the budget marks sit at the budget: move them with the axis
                marks = [{**t, "x": [v + self._offset if v is not None else v for v in t["x"]]} if "x" in t else t
                         for t in marks]
            _push(self._figs["frontier"], marks, first=self._n_frontier_curves)
        with self._board.hold_sync():  # the figures and their status lines in one message
            self._draw_step_label()
            self._board.sync()
        self._draw_stats()

    def _draw_step(self) -> None:
        """Move the player's cursor: faint future ops, memory revealed up to the step, the tape at that moment; the
        player, the step slider and the label move with them (one kernel turn: the page shows them together)."""
        self._push_views(self._step)
        # the figures and the status line in one message (the board's caption); the slider and player right after
        self._board.sync(("memory", "timeline", "tape"), step=self._step)
        self._syncing = True
        try:
            self._step_slider.value = self._play.value = self._step
        finally:
            self._syncing = False

    def _push_views(self, step: int | None) -> None:
        """Redraw the memory curve, timeline and tape of the current view after ``step`` ops (None: all, no cursor)."""
        v, u, b, o = self._view, self._unit, self._budget, self._overlay_view
        _push(self._figs["memory"], F.memory_traces(v, b, step, o, u), F.memory_layout(v, b, step, o))
        _push(self._figs["timeline"], F.timeline_traces(v, step, u), F.timeline_layout(v, step))
        _push(self._figs["tape"], F.tape_traces(v, step, u), F.tape_layout(v, step))

    def _draw_step_label(self) -> None:
        """Every step's status line, sent to the page once per schedule (the board's caption shows the one at the
        player's step, two lines high whatever it says, so the figures below never move)."""
        v = self._view
        texts = [_step_text(v, k) for k in range(v.n + 1)]
        with self._board.hold_sync():
            if self._board.texts != texts:
                self._board.texts = texts
            self._board.step = self._step

    def _draw_stats(self) -> None:
        rows = [(self._strategy, self._view)]
        if self._overlay_view is not None:
            rows.append((self._overlay, self._overlay_view))
        whole = self.chain.fixed is not None
        b = self._budget

        def peak(v: TraceView) -> str:  # a peak over the budget in red, marked: that schedule does not fit
            return (f"<td class='hcv-over' style='color:#c00' title='over the budget'>{format_bytes(v.peak)} ▲</td>"
                    if v.peak > b else f"<td>{format_bytes(v.peak)}</td>")

        cells = "".join(
            f"<tr><td><b>{html.escape(name)}</b></td><td>{format_time(v.makespan)}</td>"
            f"<td>{100 * v.trace.overhead:+.1f}%</td>{peak(v)}"
            + (f"<td>{format_bytes(D.device_peak(v.trace))}</td>" if whole else "")
            + f"<td>{v.trace.n_recomputed}</td><td>{v.n}</td></tr>" for name, v in rows)
        if len(rows) == 1:  # the compare row is always there, so that turning compare on moves nothing
            cells += "<tr class='hcv-none'><td>compare: none</td>" + "<td></td>" * (6 if whole else 5) + "</tr>"
        notes = [self._note or (f"peak exceeds the budget by {format_bytes(self._view.peak - b)}"
                                if self._view.peak > b else "")]
        if self._strategy == OPTIMAL and b in self._refined:
            notes.append("optimal: refined for this budget")
        elif self._strategy == OPTIMAL and self._refining == b:
            notes.append("optimal: the tables' answer, refining for this budget…")
        o = self._overlay_view
        if o is not None and o.peak > b:  # compare shows a schedule that does not fit: say so, not only draw it
            notes.append(f"{self._overlay} peaks at {format_bytes(o.peak)}, {format_bytes(o.peak - b)} over the "
                         f"{format_bytes(b)} budget: it does not fit")
        note = " · ".join(n for n in notes if n)
        self._stats.value = (
            _STATS_STYLE + "<table class='hcv-stats'><tr><th>strategy</th><th>makespan</th>"
            "<th>overhead vs store-all</th><th>peak</th>" + ("<th>whole-step peak</th>" if whole else "")
            + "<th>recomputed forwards</th><th>ops</th></tr>"
            f"{cells}</table><div class='hcv-note'>{html.escape(note) or '&nbsp;'}</div>")


# Repeats of a stage that varied more than this (step-time weighted) make the profiler warn and the explorer say so:
# the same threshold as runtime/profile.py's NOISY_SPREAD.
_NOISY = 0.10


def _timing_html(chain: Chain) -> str:
    """When the profiled times were unsteady: one note in plain words, with what to do; else nothing."""
    spread = chain.untied_spread
    if spread is None or spread <= _NOISY:
        return ""
    s = chain.meta["time_spread"]
    tied = {i for t in chain.tied for i in t}
    worst = max((i for i in range(chain.length) if i not in tied),
                key=lambda i: chain.fwd_time[i] * s["fwd"][i] + chain.bwd_time[i] * s["bwd"][i])
    name = chain.names[worst] if chain.names[worst] else f"stage {worst}"
    repeats = chain.meta.get("repeats", "several")
    return (f"<div class='hcv-timing' style='background:#fff8e1;border-left:3px solid #f0a000;padding:2px 8px;"
            f"white-space:normal;line-height:1.4'><b>Rough timings.</b> Each stage was timed {repeats} times; the "
            f"times differed by ±{100 * spread:.0f}% (most in {html.escape(str(name))}), as when other programs share "
            f"the processor. Memory is exact, times may be off: profile again when the machine is quieter, or with "
            f"<code>hcv.profile(..., repeats=10)</code>.</div>")


_OP_WORDS = {
    "Fck": "forward of {s} without autograd; its input x_{i} stays as a checkpoint",
    "Fn": "forward of {s} without autograd; its input x_{i} is dropped",
    "Fall": "forward of {s} recording autograd; x̄_{j} stays for its backward",
    "Loss": "the loss: the first gradient δ_{i} appears",
    "B": "backward of {s}: x̄_{j} is freed, the gradient δ_{i} is handed back",
    "Off": "the copy of {s}'s value to the host starts",
    "Pre": "the copy of {s}'s value back to the device starts",
}


def _step_text(v: TraceView, k: int) -> str:
    """The status line after ``k`` ops of ``v``, in plain words (HTML, user text escaped)."""
    tr = v.trace
    if k == v.n:  # the whole step on screen: what it does, and how to go through it
        redo = f" ({tr.n_recomputed} forwards run again: red)" if tr.n_recomputed else ""
        return (f"The whole step: <b>{v.n} ops</b> in {format_time(tr.makespan)}{redo}; peak "
                f"{format_bytes(tr.peak_memory)}. ▶ plays it from the first op.")
    if k == 0:
        return (f"Before the first op: only the input x_0 is in memory ({format_bytes(tr.initial_memory)}). "
                f"Op 1 is <b>{html.escape(str(v.labels[0]))}</b>.")
    e = tr.events[k - 1]
    op, names = e.op, tr.chain.names
    i = op.stage
    stage = f"stage {i}" + (f" ({names[i]})" if i < len(names) and names[i] else "")
    words = _OP_WORDS.get(op.kind, "{s}").format(s=html.escape(stage), i=i, j=i + 1)
    if e.recompute:
        words = "runs again: " + words
    # the figures first: in a narrow output area the words wrap to the second line, never the numbers
    return (f"Op {k} of {v.n}, done at {format_time(e.end)} · {format_bytes(e.mem_after)} in memory after it "
            f"(peak {format_bytes(e.mem_peak)} during it) · <b>{words}</b>")


def _push(fig: go.Figure, traces: list[dict], layout: dict | None = None, first: int = 0) -> None:
    """Store builder output in a figure as ONE plotly update: trace ``first + j`` gets ``traces[j]``.

    NOTE [fast updates]: ``fig.plotly_update`` (the same path the browser's own edits take) stores values without
    plotly.py's per-property validation, which costs milliseconds per property and dominated a budget change. This
    is safe because the values come from the very builders whose output was validated when the figure was built,
    and only values that differ from the stored ones are stored. It is the equivalent of assigning every property
    inside ``fig.batch_update()``; the board then sends the figures that changed to the page (``FigureBoard.sync``).
    """
    flat = [{k: v for k, v in _flatten(d).items() if k in _DYNAMIC_DATA} for d in traces]
    keys = dict.fromkeys(k for f in flat for k in f)
    restyle = {k: [f.get(k, _UNDEFINED) for f in flat] for k in keys}  # one entry per trace; missing: untouched
    relayout = {} if layout is None else {k: layout[k] for k in F.DYNAMIC_LAYOUT if k in layout}
    fig.plotly_update(restyle_data=restyle, relayout_data=relayout,
                      trace_indexes=list(range(first, first + len(traces))))


def _tree(w: W.Widget) -> list[W.Widget]:
    """``w`` and every widget inside it."""
    return [w, *(x for c in getattr(w, "children", ()) for x in _tree(c))]


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
    import warnings

    from ..errors import TimingWarning
    from ..runtime.profile import profile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chain = profile(model, sample_input, loss_fn, **profile_kwargs)
    for w in caught:  # every other warning as it came; unsteady timings are the explorer's note (_timing_html)
        if not issubclass(w.category, TimingWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return Explorer(chain, model)
