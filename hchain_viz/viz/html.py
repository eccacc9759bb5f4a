"""Offline export: one self-contained HTML file with a budget slider, a play button and the explorer's figures.

``to_html(chain_or_solution, path)`` solves (if given a Chain), precomputes the optimal schedule's timeline, memory
curve and storage tape at ``n_budgets`` budgets (120 by default) from the least feasible one to store-all's peak, and
writes a page that embeds plotly.js and that data. It opens at the budget halfway up that range, where the schedule
already recomputes something. A little inline JavaScript swaps frames with ``Plotly.react`` when the slider moves, the
play button sweeps the budgets, and a click on the frontier jumps to the nearest budget. Nothing is fetched from the
network: no CDN, no MathJax, no fonts — the file works from a USB stick.

The figures are the very builders of :mod:`hchain_viz.viz.figures`, so the page shows what the notebook explorer shows.
``pipeline=(P, M)`` adds the pipeline view of :mod:`hchain_viz.viz.pipeline` (its own device-memory slider, the
memory bars and the timeline, one frame per limit) below them.
"""

from __future__ import annotations

import html
import os
from typing import Any

import numpy as np

from ..core.chain import Chain
from ..core.simulate import simulate
from ..core.units import format_bytes, format_time
from ..errors import HChainError
from ..runtime.progress import progress_bar
from . import figures as F
from . import style
from .page import PLOTLY_CONFIG, plotly_js, script_json
from .pipeline import check_pipeline, html_frames, html_section
from .trace_view import TraceView

__all__ = ["to_html"]


def to_html(chain_or_solution: Any, path: str | os.PathLike, *, n_budgets: int = 120, strategies: Any = None,
            title: str | None = None, pipeline: tuple[int, int] | None = None, refine: bool = False) -> str:
    """Write the offline explorer page for ``chain_or_solution`` (a Chain, or a Solution from ``hcv.solve``) to
    ``path`` and return the path.

    ``n_budgets``: how many budgets the slider offers, evenly spaced from the least feasible budget to store-all's
    peak (one precomputed frame each). ``strategies``: the baselines drawn on the frontier (see
    :func:`figures.frontier`: None for all, False for none, a list of names, or a mapping name → points).
    ``pipeline``: ``(devices, microbatches)`` adds the pipeline view (docs/design.md §12); the chain needs its fixed
    part (profiled with ``optimizer=``), else HChainError. ``refine``: each budget's answer from
    ``Solution.refined`` (about a second each), worth it where ``solution.coarse`` (docs/design.md §4.4).
    """
    pipe_section = ""
    chain = getattr(chain_or_solution, "chain", chain_or_solution)
    if pipeline is not None and isinstance(chain, Chain):  # before the solve: a chain without a fixed part fails fast
        P, M = check_pipeline(chain, pipeline)
        pipe, limits, pipe_frames = html_frames(chain, P, M)
        pipe_section = (f"<h3>{html.escape(pipe.kind)} pipeline on {P} devices, {M} microbatches, "
                        f"{html.escape(format_bytes(limits[0]))} to {html.escape(format_bytes(limits[-1]))} per "
                        f"device</h3>\n" + html_section(pipe_frames, prefix="pipe-"))
    solution = _solution_of(chain_or_solution)
    if isinstance(n_budgets, bool) or not isinstance(n_budgets, (int, np.integer)) or n_budgets < 1:
        raise HChainError(f"n_budgets must be a positive integer (frames on the budget slider), got {n_budgets!r}")
    chain = solution.chain
    if solution.min_budget is None:
        raise HChainError("the solution has no feasible budget; solve with a larger max_budget")
    lo = int(solution.min_budget)
    hi = int(max(min(solution.store_all_peak, solution.max_budget), lo))
    budgets = np.unique(np.linspace(lo, hi, int(n_budgets)).round().astype(np.int64)).tolist()

    fd = F.FrontierData.of(solution, strategies)
    unit = style.byte_unit(hi)
    frames, first = [], None
    start = (len(budgets) - 1) // 2  # the page opens halfway between the least feasible budget and store-all
    refine = refine and hasattr(solution, "refined")  # (an offload solution has no finer table)
    answer = solution.refined if refine else solution.schedule
    bar = progress_bar(len(budgets), "refining", "budget", enabled=refine)
    for n, b in enumerate(budgets):
        view = TraceView.of(simulate(chain, answer(b)))
        bar.update(1)
        tl_data, tl_lay = F.timeline_traces(view, None, unit), F.timeline_layout(view)
        mem_data, mem_lay = F.memory_traces(view, b, None, None, unit), F.memory_layout(view, b)
        tape_data, tape_lay = F.tape_traces(view, None, unit), F.tape_layout(view)
        if n == start:
            first = dict(timeline=dict(data=tl_data, layout=tl_lay), memory=dict(data=mem_data, layout=mem_lay),
                         tape=dict(data=tape_data, layout=tape_lay))
        tr = view.trace
        frames.append(dict(
            budget=b,
            label=format_bytes(b),
            stats=(f"makespan <b>{format_time(tr.makespan)}</b> ({100 * tr.overhead:+.1f}% over store-all), "
                   f"peak <b>{format_bytes(tr.peak_memory)}</b>, {tr.n_recomputed} recomputed forwards, "
                   f"{len(tr.events)} ops"),
            timeline=dict(data=tl_data, layout={k: tl_lay[k] for k in F.DYNAMIC_LAYOUT if k in tl_lay}),
            memory=dict(data=mem_data, layout={k: mem_lay[k] for k in F.DYNAMIC_LAYOUT if k in mem_lay}),
            tape=dict(data=tape_data, layout={k: tape_lay[k] for k in F.DYNAMIC_LAYOUT if k in tape_lay}),
            frontier=F.frontier_budget_traces(fd, b),
        ))
    bar.close()
    frontier_data = F.frontier_traces(fd, budgets[start], unit)
    payload = dict(
        frames=frames,
        start=start,
        base=dict(timeline=first["timeline"], memory=first["memory"], tape=first["tape"],
                  frontier=dict(data=frontier_data, layout=F.frontier_layout(fd))),
        frontier_budget_index=len(frontier_data) - 3,  # the budget line and point come just before the axis trace
        config=PLOTLY_CONFIG,
    )
    title = title or f"hchain_viz: {chain.length}-stage chain, optimal schedules from " \
                      f"{format_bytes(lo)} to {format_bytes(hi)}"
    page = _PAGE.format(
        title=html.escape(title),
        head=html.escape(f"store-all {format_time(chain.store_all_time)} at {format_bytes(solution.store_all_peak)}; "
                         f"least feasible budget {format_bytes(lo)}; {len(frames)} budgets"
                         + ("; each answer refined for its budget" if refine else
                            "; answers from coarse tables (a long chain): to_html(..., refine=True) refines them"
                            if getattr(solution, "coarse", False) else "")),
        plotlyjs=plotly_js(),
        data=script_json(payload),
        n_last=len(frames) - 1,
        start=start,
        script=_SCRIPT,
        pipeline=pipe_section,
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return str(path)


def _solution_of(obj: Any) -> Any:
    if isinstance(obj, Chain):
        from ..core.solver import solve

        return solve(obj)
    if all(hasattr(obj, a) for a in ("chain", "schedule", "frontier", "min_budget")):
        return obj
    raise HChainError(f"to_html needs a Chain or a Solution (hcv.solve(chain)), got {type(obj).__name__}")


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
  body {{ font-family: Helvetica, Arial, sans-serif; margin: 16px; color: #222; }}
  .controls {{ display: flex; align-items: center; gap: 12px; margin: 8px 0; }}
  .controls input[type=range] {{ width: 420px; }}
  .row {{ display: flex; gap: 8px; }}
  .row > div {{ flex: 1 1 50%; min-width: 0; }}
  #stats {{ margin: 4px 0 8px; }}
  .muted {{ color: #666; font-size: 90%; }}
</style>
<script type="text/javascript">{plotlyjs}</script>
</head>
<body>
<h3>{title}</h3>
<div class="muted">{head}</div>
<div class="controls">
  <button id="play" type="button">&#9654; Play</button>
  <label for="budget">budget</label>
  <input id="budget" type="range" min="0" max="{n_last}" step="1" value="{start}"
         title="arrow keys: the next budget; Home / End: the least budget / store-all">
  <b id="budget-label"></b>
</div>
<div id="stats"></div>
<div class="row"><div id="frontier"></div><div id="memory"></div></div>
<div id="timeline"></div>
<div id="tape"></div>
<div class="muted">x: a stage's input kept as a checkpoint · x̄: everything a stage keeps for its backward (its output
and saved tensors) · δ: the gradient flowing back into a stage · red bars: forwards run again</div>
<script type="application/json" id="hcv-data">{data}</script>
<script type="text/javascript">{script}</script>
{pipeline}</body>
</html>
"""

_SCRIPT = """
(function () {
  var D = JSON.parse(document.getElementById('hcv-data').textContent);
  var slider = document.getElementById('budget'), label = document.getElementById('budget-label');
  var stats = document.getElementById('stats'), play = document.getElementById('play');
  var base = D.base, cfg = D.config, timer = null;
  function merged(a, b) { var o = {}, k; for (k in a) o[k] = a[k]; for (k in b) o[k] = b[k]; return o; }
  function frontierData(f) {
    var data = base.frontier.data.slice();
    for (var j = 0; j < f.frontier.length; j++) {
      data[D.frontier_budget_index + j] = merged(data[D.frontier_budget_index + j], f.frontier[j]);
    }
    return data;
  }
  function show(i) {
    var f = D.frames[i];
    label.textContent = f.label;
    stats.innerHTML = f.stats;
    Plotly.react('timeline', f.timeline.data, merged(base.timeline.layout, f.timeline.layout), cfg);
    Plotly.react('memory', f.memory.data, merged(base.memory.layout, f.memory.layout), cfg);
    Plotly.react('tape', f.tape.data, merged(base.tape.layout, f.tape.layout), cfg);
    Plotly.react('frontier', frontierData(f), base.frontier.layout, cfg);
  }
  function stop() { if (timer) { clearInterval(timer); timer = null; play.innerHTML = '&#9654; Play'; } }
  slider.addEventListener('input', function () { show(+slider.value); });
  play.addEventListener('click', function () {
    if (timer) { stop(); return; }
    if (+slider.value === 0) slider.value = D.frames.length - 1;  // sweep from store-all down to the least budget
    play.innerHTML = '&#10073;&#10073; Pause';
    timer = setInterval(function () {
      var i = +slider.value - 1;
      if (i < 0) { stop(); return; }
      slider.value = i; show(i);
    }, 150);
  });
  show(+slider.value);
  document.getElementById('frontier').on('plotly_click', function (ev) {
    if (!ev.points.length) return;
    var x = ev.points[0].x, best = 0;
    for (var i = 1; i < D.frames.length; i++) {
      if (Math.abs(D.frames[i].budget - x) < Math.abs(D.frames[best].budget - x)) best = i;
    }
    stop(); slider.value = best; show(best);
  });
})();
"""
