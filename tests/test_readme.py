"""The README's and the docs pages' examples are executed, so they cannot rot; their CLI commands are checked to
exist, and their links to files of the project point at files that exist.

A ```python block runs unless the line just before it says why not, as ``<!-- not run: <reason> -->`` (it still has
to parse). The blocks of one page run in order in one namespace, as a reader would paste them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"(?:(<!--\s*not run:\s*(.*?)\s*-->)\n)?```(\w+)\n(.*?)```", re.S)


def blocks(text: str, lang: str = "python") -> list[tuple[str, str | None]]:
    """``(code, reason it is not run or None)`` of every ```lang block of ``text``, in order."""
    return [(code, reason if marker else None) for marker, reason, kind, code in _BLOCK.findall(text) if kind == lang]


def test_block_parser_sees_the_not_run_marker():
    text = "x\n<!-- not run: needs your model -->\n```python\nmodel()\n```\n\n```python\n1 + 1\n```\n"
    assert blocks(text) == [("model()\n", "needs your model"), ("1 + 1\n", None)]


@pytest.mark.torch
def test_quick_start_runs():
    quick = next(b for b, _ in blocks(README) if "hcv.profile" in b and "hcv.wrap" in b)
    assert len(quick.strip().splitlines()) <= 14  # "a ten-line quick start" (plus imports and the loop body)
    # pasted as one notebook cell it shows the explorer: the explorer is the cell's last expression
    tree = ast.parse(quick)
    last = tree.body.pop()
    assert isinstance(last, ast.Expr), "the quick start must end with the explorer as an expression"
    scope: dict = {}
    exec(compile(tree, "README quick start", "exec"), scope)
    shown = eval(compile(ast.Expression(last.value), "README quick start", "eval"), scope)
    assert type(shown).__name__ == "Explorer" and shown.chain is scope["chain"]
    assert scope["wrapped"].schedule.ops == scope["schedule"].ops
    shown.close()


def test_readme_is_short_and_gives_the_two_setup_commands_and_the_benchmarks():
    assert len(README.splitlines()) <= 250
    bash = [b.strip() for b, _ in blocks(README, "bash")]
    demo = "python -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && python -m hchain_viz demo"
    tests = ('python -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[dev]" && '
             "python -m pytest")
    assert demo in bash and tests in bash
    # CI runs the test command verbatim (quietly: pip's -q)
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests.replace("pip install", "pip install -q") in ci
    for name in ("solver", "train", "profile", "widget", "models", "fit", "gpu", "compile", "transformers", "offload"):
        assert f"python -m hchain_viz bench {name}" in README
    assert "jupyter lab" in README and '".[lab]"' in README
    assert "commit " not in README and "previous README" not in README  # history lives in CHANGELOG.md


def test_lab_extra_installs_jupyterlab():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("jupyterlab") for d in extras["lab"])


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS], ids=lambda p: p.name)
def test_links_to_project_files_exist(page):
    text = re.sub(r"```.*?```|`[^`]*`", "", page.read_text(), flags=re.S)  # code is not a link
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [u for u in links if not re.match(r"[a-z]+:", u)]
    missing = [u for u in local if not (page.parent / u).exists()]
    assert missing == [], page.name


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_python_blocks_parse_and_runnable_ones_run(page):
    found = blocks(page.read_text())
    for code, reason in found:
        ast.parse(code)
        assert reason is None or len(reason) > 8, f"{page.name}: say why a block is not run"
    runnable = [code for code, reason in found if reason is None]
    if page.name == "README.md":  # the quick start and the will-it-fit block have tests of their own below/above
        runnable = [c for c in runnable if "hcv.wrap(" not in c and "profile_batches" not in c]
    if page.name == "train.md":  # tests/test_docs_train.py runs each section after the shared setup, with checks
        runnable = []
    if any("import torch" in c or "hcv.profile" in c for c in runnable):
        pytest.importorskip("torch")
    scope: dict = {"print": lambda *a, **k: None}
    for n, code in enumerate(runnable):
        exec(compile(code, f"{page.name} block {n + 1}", "exec"), scope)


@pytest.mark.torch
def test_will_it_fit_example_runs():
    block = next(b for b, _ in blocks(README) if "device_schedule(" in b and "profile_batches" in b)
    scope: dict = {"print": lambda *a: None}
    exec(compile(block, "README will it fit", "exec"), scope)
    import hchain_viz as hcv

    trace = hcv.simulate(scope["c64"], scope["schedule"])
    assert trace.n_recomputed > 0 and hcv.device_peak(trace) <= 0.95 * 256 * 2**20
    assert "python -m hchain_viz fit " in README
