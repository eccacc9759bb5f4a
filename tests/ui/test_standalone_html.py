"""The offline HTML export (``hcv.to_html``) in a real browser, opened from a file:// URL with no server.

Its budget slider (a plain range input) is moved with the keyboard; each move must redraw the timeline as the optimal
schedule at the budget of that frame, bar for bar (conftest's TimelineCheck), and the statistics line must follow. Play
sweeps the budgets down on its own. No request may leave the page: only file:, data: and blob: URLs are allowed.
A screenshot goes to assets/standalone_html.png with ``HCV_UPDATE_ASSETS=1``, else to a temporary folder.
"""

from __future__ import annotations

import pytest

import hchain_viz as hcv

pytestmark = pytest.mark.ui

WAIT_MS = 20_000
N_BUDGETS = 8
LOCAL = ("file:", "data:", "blob:")


@pytest.fixture(scope="module")
def html_page(browser, app_solution, tmp_path_factory):
    """The exported page loaded in Chromium, with every request and page error it makes recorded."""
    path = tmp_path_factory.mktemp("standalone") / "explorer.html"
    assert hcv.to_html(app_solution, path, n_budgets=N_BUDGETS) == str(path)
    context = browser.new_context(viewport={"width": 1200, "height": 800})  # screenshots take the full page
    page = context.new_page()
    page.requests, page.errors = [], []
    page.on("request", lambda r: page.requests.append(r.url))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    try:
        page.goto(path.as_uri())
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 4 && "
                               "document.getElementById('budget-label').textContent !== ''", timeout=WAIT_MS)
        yield page
    finally:
        context.close()


def _budgets(page) -> list[int]:
    return page.evaluate("JSON.parse(document.getElementById('hcv-data').textContent).frames.map(f => f.budget)")


def _at(page) -> int:
    return int(page.input_value("#budget"))


def test_slider_redraws_every_figure_offline(html_page, app_solution, app_timeline, assets_dir):
    page = html_page
    budgets = _budgets(page)
    assert len(budgets) == N_BUDGETS and budgets[0] == app_solution.min_budget
    mid = (N_BUDGETS - 1) // 2
    assert _at(page) == mid  # it opens halfway between the least feasible budget and store-all
    app_timeline.wait(page, budgets[mid], WAIT_MS)
    assert page.evaluate("document.getElementById('tape').layout.title.text").startswith("Storage tape")
    first = {k: page.inner_text(k) for k in ("#stats", "#budget-label")}
    memory_title = page.evaluate("document.getElementById('memory').layout.title.text")

    page.focus("#budget")
    page.keyboard.press("Home")  # the least feasible budget
    assert _at(page) == 0
    assert page.inner_text("#budget-label") == hcv.format_bytes(app_solution.min_budget)
    app_timeline.wait(page, budgets[0], WAIT_MS)
    stats = page.inner_text("#stats")
    assert stats != first["#stats"] and f"{app_timeline.n_recomputed(budgets[0])} recomputed" in stats
    assert page.evaluate("document.getElementById('memory').layout.title.text") != memory_title
    # the frontier's budget line moved to the new budget
    line = page.evaluate("(i) => document.getElementById('frontier').data[i].x",
                         page.evaluate("JSON.parse(document.getElementById('hcv-data').textContent)"
                                       ".frontier_budget_index"))
    assert line == [budgets[0], budgets[0]]

    for i in (1, 2):  # one frame per arrow press
        page.keyboard.press("ArrowRight")
        assert _at(page) == i
        app_timeline.wait(page, budgets[i], WAIT_MS)
        assert page.inner_text("#budget-label") == hcv.format_bytes(budgets[i])
    page.screenshot(path=str(assets_dir / "standalone_html.png"), full_page=True, animations="disabled")
    assert page.errors == []


def test_play_sweeps_the_budgets_down(html_page, app_timeline):
    page = html_page
    budgets = _budgets(page)
    page.focus("#budget")
    page.keyboard.press("End")
    page.click("#play")
    # every 0.15 s the page steps one frame down; each frame must show its own schedule
    for i in (N_BUDGETS - 2, N_BUDGETS - 3):
        page.wait_for_function("(i) => +document.getElementById('budget').value <= i", arg=i, timeout=WAIT_MS)
        # the slider and the bars read in one go: the player may step again at any moment
        at, bars = page.evaluate("() => [+document.getElementById('budget').value, (" + app_timeline.READ_JS + ")()]")
        app_timeline.check(bars, app_timeline.expected(budgets[at]), f"playing, frame {at}")
    assert "Pause" in page.inner_text("#play")
    page.click("#play")  # pause
    page.wait_for_function("document.getElementById('play').textContent.includes('Play')", timeout=WAIT_MS)
    stopped = _at(page)
    page.wait_for_timeout(1500)  # ten play ticks: a paused player must not move (a wait for nothing to happen)
    assert _at(page) == stopped
    assert page.errors == []


def test_no_request_leaves_the_page(html_page):
    # runs last in this module: the page has loaded, been moved and played by now
    assert html_page.requests, "no request recorded at all: the listener is not attached"
    remote = [u for u in html_page.requests if not u.startswith(LOCAL)]
    assert remote == []
