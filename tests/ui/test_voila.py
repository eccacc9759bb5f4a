"""The notebook explorer in a real browser: tests/ui/explorer_app.ipynb served by Voila, driven in headless Chromium.

The budget slider is moved with the keyboard (Home/End on the focused handle) and by dragging it; after each move the
timeline the browser draws must be the optimal schedule at the budget the slider shows, bar for bar (conftest's
TimelineCheck). Play must move the step cursor forward over time. Screenshots and an animated GIF of the session go to
``assets/`` with ``HCV_UPDATE_ASSETS=1`` (see conftest.py), else to a temporary folder.
"""

from __future__ import annotations

import io
import json
import re

import pytest

import hchain_viz as hcv

pytestmark = pytest.mark.ui

WAIT_MS = 30_000  # for the kernel to answer one control change: generous, other jobs share the CPUs
GIF_WIDTH = 900  # px, about the size the README shows it at

# The explorer's controls and cursors as the browser shows them. The budget slider is the layout's first slider and
# the step slider its second; the budget label follows its slider, the step label is the one-line label below;
# the cursor is the first layout shape of a figure.
_STATE_JS = """() => {
  const title = p => {
    const t = p.layout && p.layout.title;
    return String(t && t.text !== undefined ? t.text : t || '');
  };
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
  const fig = prefix => plots.find(p => title(p).startsWith(prefix));
  const tl = fig('Timeline'), mem = fig('Memory');
  const sliders = Array.from(document.querySelectorAll('.widget-hslider'));
  if (!tl || !mem || sliders.length < 2) return null;
  const cursor = p => {
    const s = (p.layout.shapes || [])[0] || {};
    return [s.x0 === undefined ? null : s.x0, s.visible !== false];
  };
  const label = s => { const h = s.parentElement.querySelector('.widget-html'); return h ? h.innerText.trim() : ''; };
  const value = s => +s.querySelector('.noUi-handle').getAttribute('aria-valuenow');
  return {timeline_title: title(tl), memory_title: title(mem), cursor: cursor(tl), memory_cursor: cursor(mem),
          budget: value(sliders[0]), budget_label: label(sliders[0]),
          step: value(sliders[1]),
          step_label: (document.querySelector('.hcv-steptext') || {innerText: ''}).innerText.trim()};
}"""


def _when(args: str, condition: str) -> str:
    """A wait_for_function predicate over the state ``s`` (null while the explorer is not on the page)."""
    return "(" + args + ") => { const s = (" + _STATE_JS + ")(); return s !== null && (" + condition + "); }"


class App:
    """The Voila page of the explorer, its controls, and what the tests collect on it (page errors, GIF frames)."""

    def __init__(self, page, timeline):
        self.page, self.timeline = page, timeline
        self.errors: list[str] = []
        self.frames: list[bytes] = []
        self.bars: dict = {}  # the timeline's bars as last checked by settle()
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def state(self) -> dict:
        return self.page.evaluate(_STATE_JS)

    def settle(self, budget: int | None = None) -> dict:
        """Wait until the figures show ``budget`` (default: where the slider's handle is); return the state."""
        budget = int(self.state()["budget"]) if budget is None else budget
        self.page.wait_for_function(_when("label", "s.budget_label === label"), arg=hcv.format_bytes(budget),
                                    timeout=WAIT_MS)
        self.bars = self.timeline.wait(self.page, budget, WAIT_MS)
        return self.state()

    def _budget_slider(self):
        return self.page.locator(".widget-hslider").first

    def press(self, key: str) -> dict:
        """Press ``key`` on the focused budget handle (noUiSlider: arrows step, Home/End jump to the ends)."""
        self._budget_slider().locator(".noUi-handle").focus()
        self.page.keyboard.press(key)
        return self.settle()

    def drag(self, fraction: float) -> dict:
        """Drag the budget handle to ``fraction`` of its track in several mouse moves, as a hand would."""
        track = self._budget_slider().locator(".noUi-base").bounding_box()
        handle = self._budget_slider().locator(".noUi-handle").bounding_box()
        y = handle["y"] + handle["height"] / 2
        self.page.mouse.move(handle["x"] + handle["width"] / 2, y)
        self.page.mouse.down()
        self.page.mouse.move(track["x"] + fraction * track["width"], y, steps=8)
        self.page.mouse.up()
        return self.settle()

    def shot(self, path=None) -> bytes:
        """A screenshot from the explorer's header to the bottom of the frontier and memory row under the timeline
        (the tape below is left out)."""
        clip = self.page.evaluate("""() => {
          const root = Array.from(document.querySelectorAll('.widget-vbox')).find(
              v => v.innerText.trim().startsWith('hchain_viz explorer'));
          const mem = Array.from(document.querySelectorAll('.js-plotly-plot')).find(
              p => String((p.layout.title || {}).text || '').startsWith('Memory'));
          const a = root.getBoundingClientRect(), b = mem.getBoundingClientRect();
          // +40 px: the step label above the figures wraps to one or two lines while playing, which can move the
          // timeline by a line between this measure and the capture
          return {x: a.x + scrollX, y: a.y + scrollY, width: a.width, height: b.bottom - a.y + 40};
        }""")
        png = self.page.screenshot(clip=clip, full_page=True, animations="disabled")
        if path is not None:
            path.write_bytes(png)
        return png

    def recomputed(self) -> int:
        return len(self.bars["recomputed forward"][1])


def save_gif(frames: list[bytes], path) -> int:
    """An animated GIF of ``frames`` (PNG bytes) at GIF_WIDTH px with one shared palette; returns its size in bytes."""
    from PIL import Image

    imgs = []
    for png in frames:
        im = Image.open(io.BytesIO(png)).convert("RGB")
        imgs.append(im.resize((GIF_WIDTH, round(im.height * GIF_WIDTH / im.width)), Image.LANCZOS))
    # frames differ in height by a few pixels at most (titles wrap alike); pad to the tallest so none is cut
    height = max(im.height for im in imgs)
    imgs = [im if im.height == height else _pad(im, height) for im in imgs]
    # one palette for every frame keeps colours steady; built from all frames at once (octree keeps rare but vivid
    # colours, like the few red recomputed bars, that a median cut weighted by pixel counts would merge into brown)
    montage = Image.new("RGB", (GIF_WIDTH, height * len(imgs)))
    for i, im in enumerate(imgs):
        montage.paste(im, (0, i * height))
    palette = montage.quantize(colors=255, method=Image.Quantize.FASTOCTREE)
    frames_p = [im.quantize(palette=palette, dither=Image.Dither.NONE) for im in imgs]
    frames_p[0].save(path, save_all=True, append_images=frames_p[1:], duration=800, loop=0, optimize=True)
    return path.stat().st_size


def _pad(im, height):
    from PIL import Image

    out = Image.new("RGB", (im.width, height), "white")
    out.paste(im, (0, 0))
    return out


@pytest.fixture(scope="module")
def app(browser, voila_url, app_spec, app_timeline):
    context = browser.new_context(viewport={"width": app_spec["width"] + 100, "height": 2400})
    page = context.new_page()
    a = App(page, app_timeline)
    try:
        page.goto(voila_url, wait_until="domcontentloaded", timeout=app_spec["render_ms"])
        # the kernel has run the notebook: figures drawn, the controls' labels filled in
        page.wait_for_function(_when("", "s.budget_label !== '' && s.step_label !== '' && "
                                         "document.querySelectorAll('.js-plotly-plot .main-svg').length >= 4"),
                               timeout=app_spec["render_ms"])
        yield a
    finally:
        context.close()


def test_app_notebook_builds_the_chain_the_tests_expect(app_spec):
    cells = json.loads(app_spec["path"].read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert f"Chain.random({app_spec['stages']}, seed={app_spec['seed']})" in code
    assert f"width={app_spec['width']}" in code


def test_opens_at_the_middle_budget_with_its_schedule(app, app_solution, app_spec):
    lo, hi = app_solution.min_budget, app_solution.store_all_peak
    s = app.settle((lo + hi) // 2)  # the explorer opens halfway; its slider shows that to the nearest step
    assert abs(s["budget"] - (lo + hi) // 2) <= (hi - lo) // 100  # keyboard steps: 1% of the range
    assert s["timeline_title"].startswith("Timeline (optimal)")
    assert s["cursor"][1] is False  # no replay yet: the cursor is hidden
    # the explorer is as wide as it may be (its width= caps it), the timeline and tape fill it, the frontier and the
    # memory curve share a row; each figure is drawn at the width of its box (never plotly's default 700 px)
    sizes = app.page.evaluate("""() => ({
      explorer: document.querySelector('.hcv-explorer').getBoundingClientRect().width,
      board: document.querySelector('.hcv-board').getBoundingClientRect().width,
      figs: Array.from(document.querySelectorAll('.js-plotly-plot')).map(
          p => [p._fullLayout.width, p.getBoundingClientRect().width])})""")
    assert sizes["explorer"] == pytest.approx(app_spec["width"], abs=1)
    drawn = sorted(w for w, _ in sizes["figs"])
    assert all(abs(w - box) <= 1 for w, box in sizes["figs"])
    assert drawn[2] == drawn[3] == pytest.approx(sizes["board"], abs=1)
    assert drawn[0] == drawn[1] == pytest.approx((sizes["board"] - 8) / 2, abs=1)  # 8 px: the grid's column gap
    assert app.errors == []
    app.frames.append(app.shot())


def test_keyboard_moves_the_budget_and_the_figures_follow(app, app_solution, app_timeline):
    high = app.press("End")  # store-all's peak: nothing recomputed
    assert high["budget"] == app_solution.store_all_peak
    assert app.recomputed() == 0

    low = app.press("Home")  # the least feasible budget: the most recomputation
    assert low["budget"] == app_solution.min_budget
    assert app.recomputed() == app_timeline.n_recomputed(low["budget"]) > 0
    assert low["timeline_title"] != high["timeline_title"] and low["memory_title"] != high["memory_title"]
    app.frames.append(app.shot())
    # an arrow key moves the budget 1% of the range, PageUp 10%
    step = max(1, (app_solution.store_all_peak - app_solution.min_budget) // 100)
    right = app.press("ArrowRight")
    assert right["budget"] == low["budget"] + step
    page_up = app.press("PageUp")
    assert page_up["budget"] == right["budget"] + 10 * step
    assert app.press("PageDown")["budget"] == right["budget"]
    assert app.errors == []


def test_dragging_the_slider_redraws_at_the_dragged_budget(app, app_timeline, assets_dir):
    app.press("Home")
    seen = []
    for fraction in (0.12, 0.25, 0.45, 0.7):
        s = app.drag(fraction)  # settle() has checked the bars against the schedule at the slider's budget
        seen.append((s["budget"], app.recomputed()))
        app.frames.append(app.shot(assets_dir / "explorer.png" if fraction == 0.25 else None))
    budgets, recomputed = zip(*seen)
    assert list(budgets) == sorted(set(budgets))  # every drag moved the budget up
    assert recomputed[0] > recomputed[-1]  # more memory, fewer recomputed forwards
    assert app.errors == []


def test_play_moves_the_cursor(app, app_solution, assets_dir):
    s = app.drag(0.25)
    n_ops = len(app_solution.schedule(s["budget"]).ops)
    makespan = hcv.simulate(app_solution.chain, app_solution.schedule(s["budget"])).makespan
    assert s["step"] == n_ops  # the player rests at the end of the schedule

    buttons = app.page.locator(".widget-play button")
    buttons.nth(0).click()  # Play; from the end it restarts at step 0
    # Sample the cursor up to five times, spread over the replay: each sample waits until the browser has advanced
    # the step and the kernel has redrawn both cursors past the last sample. A kernel lagging behind may jump
    # straight to the end; then the replay is over ("The whole step" in the step label) and sampling stops.
    # The first sample waits for the cursor past 0: at 0 the figures may still show the step before Play's first redraw.
    ended = "s.step_label.startsWith('The whole step')"
    positions = []
    for k in range(1, 6):
        app.page.wait_for_function(
            _when("[prev, min_step]", "s.cursor[1] && s.memory_cursor[0] === s.cursor[0] && "
                                      f"((s.cursor[0] > prev && s.step >= min_step) || {ended})"),
            arg=[positions[-1] if positions else 0.0, k * n_ops // 7], timeout=WAIT_MS)
        st = app.state()
        assert st["cursor"][1] and re.match(rf"(Op \d+ of {n_ops}, |The whole step)", st["step_label"]), st
        if positions and st["cursor"][0] <= positions[-1]:
            break  # the replay ended before this sample
        positions.append(st["cursor"][0])
        app.frames.append(app.shot(assets_dir / "explorer_playing.png" if k == 3 else None))
    buttons.nth(1).click()  # Stop
    assert len(positions) >= 3, f"the cursor moved only through {positions}"
    assert positions == sorted(positions) and 0 <= positions[0] < positions[-1] <= makespan * (1 + 1e-12)
    assert app.errors == []


def test_gif_of_the_session(app, assets_dir):
    if len(app.frames) < 6:
        pytest.fail(f"only {len(app.frames)} frames: the tests above that take them failed or were deselected")
    size = save_gif(app.frames, assets_dir / "explorer.gif")
    assert 0 < size < 2_000_000

    from PIL import Image

    with Image.open(assets_dir / "explorer.gif") as gif:
        assert gif.n_frames == len(app.frames) and gif.width == GIF_WIDTH
