"""Benchmark: server-side time of one explorer budget change (``python -m hchain_viz bench widget``).

One change re-reads the DP table and rebuilds the op list (``solution.schedule``), simulates it, reads the trace into
arrays, updates the four figures and serialises the changed ones for the page (the explorer's
FigureBoard). Measured on ``Chain.random(L)`` with the explorer's
(strategy, budget) cache cleared before every change, over budgets spread from the least feasible one to store-all,
after one warm-up change. Goals: median <= 30 ms at L=50 and <= 100 ms at L=200. No browser is attached, so the
time is what the kernel spends; the frontend's redraw comes on top.

Then, where JupyterLab, Playwright and Chromium are installed, the same in the browser (:mod:`hchain_viz.bench.lab`):
a notebook whose one cell opens ``Explorer(Chain.random(L0))`` (L0: the first length) in JupyterLab at 1280x800,
timed from "Run All" (kernel already idle) to four drawn figures, each round with a fresh kernel; and from a key
press on the budget slider (End / Home in turn, after one warm-up) to the memory figure's redrawn title. Medians of
``--rounds`` each. Goals on 2 cores: first render <= 8 s, key press to redrawn figure <= 150 ms.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from . import positive_int, print_table

GOALS_MS = {50: 30.0, 200: 100.0}
FIRST_RENDER_GOAL_S = 8.0
KEY_GOAL_MS = 150.0


def run(args: list[str]) -> None:
    """Print one row per chain length: cold start, op count, and the budget-change times (median, p90, max)."""
    p = argparse.ArgumentParser(prog="python -m hchain_viz bench widget", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="50,200", help="comma-separated chain lengths (default 50,200)")
    p.add_argument("--changes", type=positive_int, default=30, help="budget changes measured per length (default 30)")
    p.add_argument("--slots", type=positive_int, default=500, help="DP memory resolution (default 500)")
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="browser rounds: first renders and key presses (default 5)")
    p.add_argument("--no-browser", action="store_true", help="skip the JupyterLab measurements")
    p.add_argument("--baselines", action="store_true",
                   help="draw the baselines' frontiers too (static, not redrawn on a budget change; slow to "
                        "compute at L=200)")
    opts = p.parse_args(args)

    from ..core.chain import Chain
    from ..core.simulate import simulate
    from ..core.solver import solve
    from ..viz.explorer import Explorer
    from ..viz.trace_view import TraceView

    head = ("L", "solve", "explorer", "ops", "schedule", "simulate+view", "change median", "p90", "max", "goal", "ok")
    rows = []
    for L in [int(s) for s in opts.lengths.split(",") if s.strip()]:
        chain = Chain.random(L, seed=0)
        t0 = time.perf_counter()
        sol = solve(chain, slots=opts.slots)
        t_solve = time.perf_counter() - t0
        t0 = time.perf_counter()
        ex = Explorer(chain, solution=sol, baselines=None if opts.baselines else False)
        t_build = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        budgets = rng.permutation(np.linspace(sol.min_budget, sol.store_all_peak, opts.changes).astype(np.int64))
        ex.budget = int(budgets[-1])  # warm-up: first kernel call loads the compiled rebuild
        totals, sched_t, sim_t, ops = [], [], [], []
        for b in budgets.tolist():
            ex.clear_cache()  # measure the full path, not a cache hit
            t0 = time.perf_counter()
            ex.budget = b
            totals.append(time.perf_counter() - t0)
            ops.append(len(ex.schedule))
            # the data half of the change, alone
            t0 = time.perf_counter()
            s = sol.schedule(b)
            t1 = time.perf_counter()
            TraceView.of(simulate(chain, s))
            t2 = time.perf_counter()
            sched_t.append(t1 - t0)
            sim_t.append(t2 - t1)
        ms = 1e3 * np.asarray(totals)
        med = float(np.median(ms))
        goal = GOALS_MS.get(L)
        rows.append((str(L), f"{t_solve:.2f} s", f"{t_build:.2f} s", f"{int(np.median(ops))}",
                     f"{1e3 * np.median(sched_t):.1f} ms", f"{1e3 * np.median(sim_t):.1f} ms", f"{med:.1f} ms",
                     f"{np.percentile(ms, 90):.1f} ms", f"{ms.max():.1f} ms",
                     "-" if goal is None else f"<= {goal:.0f} ms", "-" if goal is None else
                     ("yes" if med <= goal else "NO")))
    print(f"widget: server-side time of one explorer budget change ({opts.changes} changes per length, "
          f"{opts.slots} slots, baselines {'on' if opts.baselines else 'off'})")
    print_table(head, rows)
    if not opts.no_browser:
        lengths = [int(s) for s in opts.lengths.split(",") if s.strip()]
        print()
        browser(lengths[0] if lengths else 50, opts.rounds)


# The memory figure's title as drawn (SVG text), and a promise of the ms from the last keydown to its next change.
_MEMORY_TITLE_JS = """() => {
  const t = Array.from(document.querySelectorAll('.hcv-board .gtitle')).map(e => e.textContent)
                 .find(s => s.startsWith('Memory'));
  return t === undefined ? null : t;
}"""
_KEY_TO_TITLE_JS = """(prev) => new Promise(resolve => {
  const title = """ + _MEMORY_TITLE_JS + """;
  const poll = () => {
    const t = title(), ms = performance.now() - window.__hcvKeyT0;
    if (t !== null && t !== prev) resolve(ms);
    else if (ms > 30000) resolve(null);  // never redrawn (a frozen figure)
    else requestAnimationFrame(poll);
  };
  poll();
})"""


def browser(length: int, rounds: int) -> None:
    """Print the JupyterLab timings (see the module docstring), or why they cannot be taken here."""
    import statistics
    import tempfile
    from pathlib import Path

    from . import lab

    why = lab.missing()
    if why is not None:
        print(f"widget (browser): skipped, {why}")
        return
    import jupyterlab
    from playwright.sync_api import sync_playwright

    cell = f"import hchain_viz as hcv\nhcv.Explorer(hcv.Chain.random({length}, seed=0))"
    first, keys = [], []
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        root = Path(tmp) / "root"
        root.mkdir()
        package_root = Path(__file__).resolve().parents[2]  # the kernel imports this hchain_viz
        with lab.LabServer(root, package_root) as server:
            b = pw.chromium.launch(executable_path=lab.chromium(), args=lab.CHROMIUM_ARGS)
            for r in range(rounds):
                name = server.write_notebook(f"bench{r}.ipynb", lab.notebook(cell))
                context = b.new_context(viewport={"width": 1280, "height": 800})
                page = context.new_page()
                nb = lab.LabPage(page, server, name)
                nb.open()
                t0 = time.perf_counter()
                nb.run_all()
                page.wait_for_function("""() => document.querySelectorAll('.hcv-board .js-plotly-plot .main-svg')
                                                .length >= 4 * 2""", timeout=180_000)  # 4 figures, 2+ svgs each
                first.append(time.perf_counter() - t0)
                if r == rounds - 1:  # key presses on the last page, its kernel warm
                    page.evaluate("() => document.addEventListener('keydown', "
                                  "() => { window.__hcvKeyT0 = performance.now(); }, true)")
                    page.locator(".hcv-explorer .widget-hslider .noUi-handle").first.focus()
                    for k in range(rounds + 1):
                        prev = page.evaluate(_MEMORY_TITLE_JS)
                        page.keyboard.press("End" if k % 2 == 0 else "Home")
                        ms = page.evaluate(_KEY_TO_TITLE_JS, prev)
                        if k > 0:  # the first press is a warm-up
                            keys.append(float("inf") if ms is None else ms)
                page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
                context.close()
            b.close()

    def row(what, values, fmt, goal, goal_text):
        med = statistics.median(values)
        return (what, fmt(med), fmt(min(values)), fmt(max(values)), goal_text, "yes" if med <= goal else "NO")

    print(f"widget (browser): JupyterLab {jupyterlab.__version__}, headless Chromium at 1280x800 with the file browser "
          f"open, Explorer(Chain.random({length})), median of {rounds}")
    print_table(("", "median", "min", "max", "goal", "ok"), [
        row("Run All -> four drawn figures", first, lambda s: f"{s:.2f} s", FIRST_RENDER_GOAL_S,
            f"<= {FIRST_RENDER_GOAL_S:.0f} s"),
        row("budget key press -> memory title redrawn", keys, lambda ms: f"{ms:.0f} ms", KEY_GOAL_MS,
            f"<= {KEY_GOAL_MS:.0f} ms"),
    ], left=1)
