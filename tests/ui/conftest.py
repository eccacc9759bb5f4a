"""Browser tests: a headless Chromium (Playwright driving the system's Chromium), a Voila server for the explorer app,
where screenshots go, and the expected figure data computed in-process to compare with what the browser shows.

Every test here is marked ``ui`` (``pytestmark`` in each file). They are skipped, with the reason, only when
Playwright or a Chromium binary is missing; with both present they run (CI installs Chromium). Screenshots and the GIF
go to ``tmp_path`` unless ``HCV_UPDATE_ASSETS=1``, which writes them into the repository's ``assets/`` (the README's
pictures)."""

from __future__ import annotations

import http.client
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import hchain_viz as hcv
from hchain_viz.bench.lab import chromium, free_port, stop_server

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).with_name("explorer_app.ipynb")
# What the app notebook builds: Explorer(hcv.Chain.random(24, seed=7), width=1000). test_voila.py checks the notebook.
APP_STAGES, APP_SEED, APP_WIDTH = 24, 7, 1000

# Flags for a quiet, offline, reproducible headless Chromium (no sandbox: CI runs as root in a container).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
VOILA_START_S = 120  # a cold CI machine imports jupyter_server and voila here: generous, but bounded
APP_RENDER_MS = 180_000  # kernel start + the notebook's import, solve (numba compile on a cold cache) and explorer


def _playwright_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "needs the playwright Python package (pip install playwright; the system's Chromium is used)"
    if chromium() is None:
        return "needs a Chromium binary on PATH (Debian: apt-get install chromium)"
    return None


def pytest_collection_modifyitems(config, items):
    # Skip the browser tests (only those under tests/ui), with the reason, when Playwright or Chromium is missing.
    reason = _playwright_missing()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the whole ui session."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def assets_dir(tmp_path_factory) -> Path:
    """Where screenshots are written: the repo's assets/ with HCV_UPDATE_ASSETS=1, else a temporary folder."""
    if os.environ.get("HCV_UPDATE_ASSETS") == "1":
        out = ROOT / "assets"
        out.mkdir(exist_ok=True)
        return out
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def app_spec() -> dict:
    """The app notebook, what it builds, and how long its first render may take."""
    return dict(path=APP, stages=APP_STAGES, seed=APP_SEED, width=APP_WIDTH, render_ms=APP_RENDER_MS)


@pytest.fixture(scope="session")
def app_chain() -> hcv.Chain:
    return hcv.Chain.random(APP_STAGES, seed=APP_SEED)


@pytest.fixture(scope="session")
def app_solution(app_chain):
    return hcv.solve(app_chain)


class TimelineCheck:
    """Compare the timeline a page draws with the optimal schedule's at a budget, built here by the explorer's and the
    HTML export's own figure builders: a browser showing other bars shows another schedule."""

    # The bars of the figure titled "Timeline ...": {trace name: [starts, durations]}
    READ_JS = """() => {
      const title = p => {
        const t = p.layout && p.layout.title;
        return String(t && t.text !== undefined ? t.text : t || '');
      };
      const tl = Array.from(document.querySelectorAll('.js-plotly-plot')).find(p => title(p).startsWith('Timeline'));
      if (!tl || !tl._fullData) return null;
      const bars = {};  // _fullData: arrays decoded (a figure's JSON may carry numpy arrays base64-encoded)
      for (const t of tl._fullData) {
        if (t.type === 'bar') bars[t.name] = [Array.from(t.base || []), Array.from(t.x || [])];
      }
      return bars;
    }"""
    # True when the page's bars equal `want` (same traces and lengths, values to 1e-9 relative)
    SAME_JS = """(want) => {
      const got = (""" + READ_JS + """)();
      if (!got) return false;
      const names = Object.keys(want);
      if (Object.keys(got).length !== names.length) return false;
      const near = (v, w) => Math.abs(v - w) <= 1e-15 + 1e-9 * Math.abs(w);
      const close = (a, b) => a.length === b.length && a.every((v, i) => near(v, b[i]));
      return names.every(n => got[n] && close(got[n][0], want[n][0]) && close(got[n][1], want[n][1]));
    }"""

    def __init__(self, solution):
        self.solution = solution

    def expected(self, budget: int) -> dict[str, tuple[list[float], list[float]]]:
        from hchain_viz.viz import figures as F
        from hchain_viz.viz.trace_view import TraceView

        view = TraceView.of(hcv.simulate(self.solution.chain, self.solution.schedule(int(budget))))
        return {t["name"]: (np.asarray(t["base"], float).tolist(), np.asarray(t["x"], float).tolist())
                for t in F.timeline_traces(view) if t["type"] == "bar"}

    def n_recomputed(self, budget: int) -> int:
        return hcv.simulate(self.solution.chain, self.solution.schedule(int(budget))).n_recomputed

    def read(self, page) -> dict | None:
        return page.evaluate(self.READ_JS)

    def wait(self, page, budget: int, timeout_ms: float) -> dict:
        """Wait until ``page`` draws the schedule at ``budget``; fail with the difference if it never does."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        want = self.expected(budget)
        try:
            page.wait_for_function(self.SAME_JS, arg=want, timeout=timeout_ms)
        except PlaywrightTimeout:
            pass  # the check below says what differs
        got = self.read(page)
        self.check(got, want, f"after {timeout_ms / 1000:.0f} s at budget {budget} ({hcv.format_bytes(budget)})")
        return got

    @staticmethod
    def check(got: dict | None, want: dict, where: str) -> None:
        assert got is not None, f"{where}: no timeline figure on the page"
        assert set(got) == set(want), f"{where}: bar traces {sorted(got)} instead of {sorted(want)}"
        for name, (base, x) in want.items():
            g_base, g_x = got[name]
            assert len(g_x) == len(x), f"{where}: {len(g_x)} {name!r} bars shown, {len(x)} expected"
            np.testing.assert_allclose(g_base, base, rtol=1e-9, atol=1e-15, err_msg=f"{where}: {name} starts")
            np.testing.assert_allclose(g_x, x, rtol=1e-9, atol=1e-15, err_msg=f"{where}: {name} durations")


@pytest.fixture(scope="session")
def app_timeline(app_solution) -> TimelineCheck:
    """Checks the browser's timeline against the app chain's optimal schedules."""
    return TimelineCheck(app_solution)


# ---------------------------------------------------------------------------------------------- Voila
def _answers(port: int) -> bool:
    """True once the server answers HTTP (a static path: asking for the notebook page would start a kernel)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/voila/static/favicon.ico")
        status = conn.getresponse().status
        conn.close()
        return status < 500
    except OSError:
        return False


@pytest.fixture(scope="session")
def voila_url(tmp_path_factory):
    """Serve tests/ui/explorer_app.ipynb with Voila on 127.0.0.1 and a free port; yield its URL; always stop it."""
    if importlib.util.find_spec("voila") is None:
        pytest.fail("the explorer's browser test serves its notebook with Voila: pip install voila")
    tmp = tmp_path_factory.mktemp("voila")
    log_path = tmp / "voila.log"
    port = free_port()
    env = dict(os.environ)
    env.update(
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),  # the kernelspec runs "python"
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_DATA_DIR=str(tmp / "data"),  # nothing written to ~
        JUPYTER_CONFIG_DIR=str(tmp / "config"),  # no user configuration leaks in
        JUPYTER_PLATFORM_DIRS="1", PYDEVD_DISABLE_FILE_VALIDATION="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),  # the kernel imports this checkout's package
    )
    cmd = [sys.executable, "-m", "voila", "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1",
           "--show_tracebacks=True", APP.name]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=APP.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + VOILA_START_S
        while not _answers(port):
            if proc.poll() is not None:
                raise RuntimeError(f"voila exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"voila did not answer within {VOILA_START_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        yield f"http://127.0.0.1:{port}/"
    finally:
        stop_server(proc)
