"""The explorer in JupyterLab itself, as a user meets it: Run All with the file browser open at 1280x800, then at
1920x1080.

One JupyterLab server and one notebook for the module (about a minute in all). The notebook profiles a small torch
model (its progress bar must leave text, not a dead widget, in the saved notebook) and opens the app chain's explorer
(conftest). Checked: nothing is clipped or scrolls sideways at either size, each figure is drawn at the width of its
box and follows the output area when the file browser closes, a budget key press redraws the four figures with the
right schedule, a re-run closes the replaced explorer, and neither the first run nor a reload of the saved notebook
logs a console error. Screenshots of both sizes go to ``assets/`` with ``HCV_UPDATE_ASSETS=1`` (see conftest.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hchain_viz.bench.lab import LabPage, LabServer, notebook

pytestmark = pytest.mark.ui

WAIT_MS = 60_000
RUN_MS = 180_000  # kernel start, torch import, profile, solve (numba cache may be cold), explorer
NOTEBOOK = "explorer.ipynb"
PROFILE_CELL = """import torch, hchain_viz as hcv
import hchain_viz.runtime.progress as progress
progress.DELAY_S = 0.0  # show the bar even for this small model
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
chain = hcv.profile(model, torch.randn(64, 256), warmup=0, repeats=1)"""
EXPLORER_CELL = "hcv.Explorer(hcv.Chain.random({stages}, seed={seed}))"

# Budget, memory title and the widths of the board and its figures (drawn width, box width), as the page shows them.
STATE_JS = """() => {
  const title = p => String((p.layout.title || {}).text || '');
  const plots = Array.from(document.querySelectorAll('.hcv-board .js-plotly-plot'));
  const mem = plots.find(p => title(p).startsWith('Memory'));
  const board = document.querySelector('.hcv-board');
  const handle = document.querySelector('.hcv-explorer .widget-hslider .noUi-handle');
  if (!mem || !board || !handle || plots.length < 4) return null;
  return {budget: +handle.getAttribute('aria-valuenow'), memory_title: title(mem), n_boards:
          document.querySelectorAll('.hcv-board').length, board: board.getBoundingClientRect().width,
          figs: plots.map(p => [title(p).split(' ')[0], p._fullLayout.width, p.getBoundingClientRect().width])};
}"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab") / "root"
    root.mkdir()
    with LabServer(root, Path(__file__).resolve().parents[2]) as server:  # the kernel imports this checkout
        yield server


@pytest.fixture(scope="module")
def nb(lab, browser, app_spec):
    lab.write_notebook(NOTEBOOK, notebook(PROFILE_CELL, EXPLORER_CELL.format(**app_spec)))
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    p = LabPage(page, lab, NOTEBOOK)
    try:
        p.open(RUN_MS)
        yield p
    finally:
        context.close()


def state(p: LabPage) -> dict:
    return p.page.evaluate(STATE_JS)


def wait_state(p: LabPage, condition: str, arg=None, timeout_ms: float = WAIT_MS) -> dict:
    p.page.wait_for_function("(arg) => { const s = (" + STATE_JS + ")(); return s !== null && (" + condition + "); }",
                             arg=arg, timeout=timeout_ms)
    return state(p)


def check_fit(p: LabPage, where: str) -> dict:
    """Nothing clipped or scrolling sideways; every figure drawn at its box's width, the pair splitting the row."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:  # a resize redraws on the next animation frame
        wait_state(p, "s.figs.every(f => Math.abs(f[1] - f[2]) <= 1)", timeout_ms=10_000)
    except PlaywrightTimeout:
        pass  # the asserts below say what differs
    over = p.overflow()
    assert over == [], (where, over)
    s = state(p)
    for name, drawn, box in s["figs"]:
        assert abs(drawn - box) <= 1, f"{where}: {name} drawn {drawn} px wide in a {box:.0f} px box"
    wide = sorted(box for _, _, box in s["figs"])
    assert wide[-1] == pytest.approx(s["board"], abs=1), where
    assert wide[0] == pytest.approx((s["board"] - 8) / 2, abs=1), where  # 8 px: the grid's column gap
    return s


def test_run_all_at_1280_with_the_file_browser_open(nb, app_timeline, assets_dir):
    assert nb.page.locator(".jp-FileBrowser").is_visible()  # the default workspace: file browser open
    nb.run_all()
    nb.wait_figures(4, RUN_MS)
    s = wait_state(nb, "true")
    check_fit(nb, "1280x800")
    assert s["board"] < 900  # the output area next to the file browser is ~850 px: the explorer took its width
    lo, hi = app_timeline.solution.min_budget, app_timeline.solution.store_all_peak
    app_timeline.wait(nb.page, (lo + hi) // 2, WAIT_MS)  # the middle budget's schedule, bar for bar
    # the step label is two lines high whatever it says, and what it says fits
    fits = nb.page.evaluate("""() => { const el = document.querySelector('.hcv-steptext');
                                       const line = parseFloat(getComputedStyle(el).lineHeight);
                                       return Math.abs(el.clientHeight - 2 * line) <= 1 &&
                                              el.scrollHeight <= el.clientHeight + 1 &&
                                              el.innerText.length > 20; }""")
    assert fits
    # the profile cell's bar became text: the output holds no widget
    outputs = nb.page.evaluate("""() => window.jupyterapp.shell.currentWidget.content.model.cells.get(0)
                                  .toJSON().outputs""")
    assert any("profiling: 6/6 stages" in "".join(o.get("data", {}).get("text/plain", "")) for o in outputs), outputs
    assert not any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs), outputs
    nb.page.screenshot(path=str(assets_dir / "explorer_lab_1280.png"))
    assert nb.errors == []


def test_a_budget_key_press_redraws_the_four_figures(nb, app_timeline):
    before = wait_state(nb, "true")
    nb.page.locator(".hcv-explorer .widget-hslider .noUi-handle").first.focus()
    nb.page.keyboard.press("Home")
    low = wait_state(nb, "s.memory_title !== arg", before["memory_title"])
    assert low["budget"] == app_timeline.solution.min_budget
    bars = app_timeline.wait(nb.page, low["budget"], WAIT_MS)
    assert len(bars["recomputed forward"][1]) == app_timeline.n_recomputed(low["budget"]) > 0
    # the frontier marks the new budget and the tape follows (their data come from the same update)
    marks = nb.page.evaluate("""() => {
      const plots = Array.from(document.querySelectorAll('.hcv-board .js-plotly-plot'));
      const fr = plots.find(p => String(p.layout.title.text).startsWith('Makespan'));
      return Array.from(fr._fullData.find(t => t.name === 'budget').x);
    }""")
    assert marks == [low["budget"]] * 2
    assert nb.errors == []


def test_the_explorer_follows_the_output_area(nb):
    before = check_fit(nb, "file browser open")
    nb.command("application:toggle-left-area")
    try:
        wider = wait_state(nb, "s.board > arg + 100", before["board"])
        check_fit(nb, "file browser closed")
        assert wider["board"] > before["board"]
    finally:
        nb.command("application:toggle-left-area")
    wait_state(nb, "Math.abs(s.board - arg) < 2", before["board"])
    check_fit(nb, "file browser open again")


def test_rerun_replaces_the_explorer_and_a_reload_is_clean(nb, app_timeline):
    old = nb.page.evaluate("() => document.querySelector('.hcv-board').closest('.jp-OutputArea-output') !== null")
    assert old
    count = "() => window.jupyterapp.shell.currentWidget.content.model.cells.get(1).executionCount"
    before = nb.page.evaluate(count)
    nb.run_all()  # a re-run: the new explorer closes the old one's widgets in the kernel
    nb.page.wait_for_function(f"(n) => ({count})() > n", arg=before, timeout=RUN_MS)  # the explorer cell ran again
    nb.wait_kernel_idle(RUN_MS)
    nb.wait_figures(4, RUN_MS)
    wait_state(nb, "s.n_boards === 1")
    nb.save()
    saved = json.loads((nb.server.root / NOTEBOOK).read_text())
    views = [o for c in saved["cells"] for o in c.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1  # only the explorer; the progress bar left text
    nb.errors.clear()
    nb.page.reload(wait_until="domcontentloaded")
    nb.wait_kernel_idle(RUN_MS)
    nb.wait_figures(4, RUN_MS)  # restored from the live kernel
    s = wait_state(nb, "true")
    assert s["n_boards"] == 1
    time.sleep(2.5)  # past anywidget's 2 s initialisation timeout: any failed model would have logged by now
    text = nb.page.locator(".jp-Notebook").inner_text()
    assert "Error displaying widget" not in text and "model not found" not in text
    assert nb.errors == []


def test_at_1920x1080(nb, assets_dir):
    nb.page.set_viewport_size({"width": 1920, "height": 1080})
    s = wait_state(nb, "s.board > 1300")
    check_fit(nb, "1920x1080")
    assert s["board"] > 1300  # wide screens: the figures use the width they are given
    nb.page.evaluate("() => document.querySelector('.hcv-explorer').scrollIntoView()")
    nb.page.screenshot(path=str(assets_dir / "explorer_lab_1920.png"))
    assert nb.errors == []
