"""The notebooks are executed top to bottom, so they cannot rot: the course (``notebooks/course``, each lesson well
under a minute on CPU) and the guides (``notebooks/guides``).

The course's exercises ship with ``answer = ...``; each exercise cell carries its answer in its metadata
(``"answer"``), which the test fills in before running, and the check cell after it must then say "Right".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = [pytest.mark.torch, pytest.mark.slow]

ROOT = Path(__file__).parent.parent
COURSE = sorted((ROOT / "notebooks" / "course").glob("*.ipynb"))
GUIDES = sorted((ROOT / "notebooks" / "guides").glob("*.ipynb"))
NOTEBOOKS = COURSE + GUIDES


def test_the_course_has_six_lessons_in_order_and_the_guides_three():
    assert [p.name for p in COURSE] == [
        "01_why_activations_fill_memory.ipynb", "02_what_recomputation_costs.ipynb",
        "03_heterogeneous_chains.ipynb", "04_the_dynamic_program.ipynb", "05_beyond_the_chain_model.ipynb",
        "06_a_real_densenet.ipynb"]
    assert [p.name for p in GUIDES] == ["explore_tradeoffs.ipynb", "export_and_train.ipynb", "will_it_fit.ipynb"]
    assert not list((ROOT / "notebooks").glob("*.ipynb"))  # nothing left loose beside the two folders


def _exercises(nb) -> list[int]:
    return [k for k, c in enumerate(nb.cells) if "exercise" in c.metadata.get("tags", [])]


def test_at_least_three_lessons_have_checked_exercises():
    with_exercises = 0
    for path in COURSE:
        nb = nbformat.read(path, as_version=4)
        found = _exercises(nb)
        for k in found:
            cell = nb.cells[k]
            assert re.search(r"^answer = \.\.\.", cell.source, re.M), (path.name, "ships without the answer")
            assert "answer" in cell.metadata, path.name
            assert "course.check(answer" in nb.cells[k + 1].source, (path.name, "the next cell checks the answer")
        with_exercises += bool(found)
    assert with_exercises >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_are_stripped_in_git(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_reference_only_what_the_project_contains(path):
    text = path.read_text()
    assert "DESIGN" not in text and "§" not in text, "the design notes users can read are docs/design.md"
    for ref in re.findall(r"`((?:docs|notebooks|tests|hchain_viz)/[\w./-]+)`", text):
        assert (ROOT / ref.rstrip("/")).exists(), ref


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    # The kernel imports this checkout's hchain_viz, and runs torch on one thread: on a small shared machine,
    # torch's default of one thread per core makes the notebooks several times slower.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for attempt in (1, 2):
        nb = nbformat.read(path, as_version=4)
        exercises = _exercises(nb)
        for k in exercises:  # the reader's answer, filled in
            cell = nb.cells[k]
            cell.source = re.sub(r"^answer = \.\.\.", f"answer = {cell.metadata['answer']!r}", cell.source, flags=re.M)
        # Run in a scratch folder: the export guide writes schedule.json next to itself.
        client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})
        try:
            client.execute()
            break
        except Exception as exc:
            # jupyter_client can trip over its own kernel-start future on a loaded machine (InvalidStateError,
            # jupyter/jupyter_client#967) before any cell runs: start once more. A notebook that ran is never retried.
            started = any(c.get("execution_count") is not None for c in nb.cells if c.cell_type == "code")
            if attempt == 2 or started or not _kernel_start_race(exc):
                raise
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    for k in exercises:
        said = "".join(o.get("text", "") for o in nb.cells[k + 1].outputs if o.output_type == "stream")
        assert said.startswith("Right:") and "Why:" in said, said


def _kernel_start_race(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it came from) is asyncio's InvalidStateError."""
    import asyncio

    while exc is not None:
        if isinstance(exc, asyncio.InvalidStateError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
