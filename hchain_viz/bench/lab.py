"""Drive a real JupyterLab in headless Chromium: the browser tests (``tests/ui/test_lab.py``) and ``bench widget``.

:class:`LabServer` starts ``jupyter lab`` on 127.0.0.1 with a throw-away root, config and runtime folders (nothing
read from or written to ``~``), no token and ``window.jupyterapp`` exposed; :class:`LabPage` opens a notebook in it and
runs JupyterLab's own commands (Run All, save, reload). Needs ``jupyterlab`` and ``playwright`` (the dev extra) and a
Chromium binary (Debian: ``apt-get install chromium``); nothing is downloaded.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Flags for a quiet, offline, reproducible headless Chromium (no sandbox: CI runs as root in a container).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
START_S = 120  # a cold machine imports jupyter_server and every lab extension's server part here

# The explorer's figures as the page draws them: {title prefix: [drawn, title]} for each plotly graph on the page.
FIGURES_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(p => {
  const t = p.layout && p.layout.title;
  return {title: String(t && t.text !== undefined ? t.text : t || ''), drawn: !!p.querySelector('.main-svg'),
          width: p.getBoundingClientRect().width};
})"""


def chromium() -> str | None:
    """The system's Chromium (or Chrome) binary, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def missing() -> str | None:
    """Why JupyterLab cannot be driven here (a missing package or browser), or None."""
    import importlib.util

    for mod, pkg in (("playwright", "playwright"), ("jupyterlab", "jupyterlab")):
        if importlib.util.find_spec(mod) is None:
            return f"needs the {pkg} Python package (pip install {pkg}; the dev extra has it)"
    if chromium() is None:
        return "needs a Chromium binary on PATH (Debian: apt-get install chromium)"
    return None


def notebook(*cells: str) -> dict:
    """An nbformat-4 notebook of code cells with the python3 kernel."""
    return {"cells": [{"cell_type": "code", "execution_count": None, "id": f"cell{i}", "metadata": {},
                       "outputs": [], "source": src} for i, src in enumerate(cells)],
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a server's process group (the server and the kernels it started), then SIGKILL what is left."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # kernels that outlived their server
    except ProcessLookupError:
        pass
    proc.wait(timeout=15)


class LabServer:
    """``jupyter lab`` serving ``root`` on a free port; a context manager that always stops it and its kernels."""

    def __init__(self, root: Path, cwd_pythonpath: Path | None = None):
        self.root = Path(root)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pythonpath = cwd_pythonpath
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root.parent / f"lab-{self.port}.log"

    def __enter__(self) -> LabServer:
        tmp = self.root.parent
        env = dict(os.environ)
        env.update(
            PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),  # the kernel runs this python
            JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_DATA_DIR=str(tmp / "data"),
            JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), JUPYTER_PLATFORM_DIRS="1",
            PYDEVD_DISABLE_FILE_VALIDATION="1",
        )
        # no "get notified about Jupyter news?" toast over the notebook
        settings = tmp / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "notification.jupyterlab-settings").write_text(
            '{"fetchNews": "false", "checkForUpdates": false}')
        if self.pythonpath is not None:  # the kernel imports this checkout's hchain_viz
            env["PYTHONPATH"] = str(self.pythonpath) + os.pathsep + env.get("PYTHONPATH", "")
        # No news or update checks (offline), no token (127.0.0.1 only), the app on window for the tests' commands.
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={self.port}", "--ServerApp.ip=127.0.0.1",
               "--allow-root",  # CI containers run as root
               "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
               f"--ServerApp.root_dir={self.root}", "--LabApp.expose_app_in_browser=True",
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_S
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"jupyter lab did not answer within {START_S} s:\n{self.log()}")
            time.sleep(0.25)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def _answers(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/api/status")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            stop_server(self.proc)

    def write_notebook(self, name: str, nb: dict) -> str:
        (self.root / name).write_text(json.dumps(nb, indent=1))
        return name


class LabPage:
    """A notebook open in JupyterLab in ``page``; console errors and page errors are collected in ``errors``."""

    def __init__(self, page: Any, server: LabServer, name: str):
        self.page, self.server, self.name = page, server, name
        self.errors: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def open(self, timeout_ms: float = 120_000) -> None:
        """Open the notebook (fresh workspace: file browser open on the left) and wait for an idle kernel."""
        self.page.goto(f"{self.server.url}/lab/tree/{self.name}?reset", wait_until="domcontentloaded",
                       timeout=timeout_ms)
        self.wait_kernel_idle(timeout_ms)

    def wait_kernel_idle(self, timeout_ms: float = 120_000) -> None:
        self.page.wait_for_function("""() => {
          const app = window.jupyterapp, w = app && app.shell.currentWidget;
          const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
          return !!k && k.status === 'idle' && w.content.widgets.length > 0;
        }""", timeout=timeout_ms)

    def command(self, name: str) -> Any:
        return self.page.evaluate("name => window.jupyterapp.commands.execute(name)", name)

    def run_all(self) -> None:
        self.command("notebook:run-all-cells")

    def save(self) -> None:
        self.command("docmanager:save")
        self.page.wait_for_function("""() => { const w = window.jupyterapp.shell.currentWidget;
                                          return w && !w.context.model.dirty; }""", timeout=30_000)

    def figures(self) -> list[dict]:
        return self.page.evaluate(FIGURES_JS)

    def wait_figures(self, n: int, timeout_ms: float) -> None:
        """Wait until at least ``n`` plotly figures are drawn on the page."""
        self.page.wait_for_function(
            "n => Array.from(document.querySelectorAll('.js-plotly-plot')).filter("
            "p => p.querySelector('.main-svg')).length >= n", arg=n, timeout=timeout_ms)

    def overflow(self) -> list[str]:
        """Elements inside notebook outputs wider than their output area, or scrolling sideways (empty: none)."""
        return self.page.evaluate("""() => {
          const out = [];
          for (const area of document.querySelectorAll('.jp-OutputArea-output')) {
            const box = area.getBoundingClientRect();
            if (area.scrollWidth > area.clientWidth + 1) out.push('output area scrolls: ' + area.scrollWidth +
                                                                    ' > ' + area.clientWidth);
            for (const el of area.querySelectorAll('*')) {
              const r = el.getBoundingClientRect();
              if (r.width === 0) continue;
              if (r.right > box.right + 1 || r.left < box.left - 1) {
                out.push((el.className && el.className.baseVal !== undefined ? el.className.baseVal : el.className)
                         + ' ' + Math.round(r.left) + '..' + Math.round(r.right) + ' outside ' +
                         Math.round(box.left) + '..' + Math.round(box.right));
                if (out.length > 8) return out;
              }
              if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX !== 'visible' &&
                  getComputedStyle(el).overflowX !== 'hidden') out.push('scrolls sideways: ' + el.className);
            }
          }
          return out;
        }""")
