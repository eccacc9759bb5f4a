"""The notebooks are executed top to bottom, so they cannot rot: the course (``notebooks/course``, each lesson well
under a minute on CPU) and the guides (``notebooks/guides``).

The course's exercises ship with ``answer = ...``; each exercise cell carries its answer and a wrong one in its
metadata (``"answer"``, ``"wrong"``, and optionally ``"tells"``: patterns that would give the answer away where its
bare number cannot be told from others). The test tries the wrong answer, then the right one, and scans what the cells
above each exercise show for its answer.
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


LESSONS = [
    "01_why_activations_fill_memory.ipynb", "02_what_recomputation_costs.ipynb", "03_heterogeneous_chains.ipynb",
    "04_the_dynamic_program.ipynb", "05_schedules_outside_the_model.ipynb", "06_offloading_and_bandwidth.ipynb",
    "07_transformers_inside_the_layer.ipynb", "08_a_real_densenet.ipynb", "09_measure_it.ipynb"]


def test_the_course_has_nine_lessons_in_order_and_the_guides_four():
    assert [p.name for p in COURSE] == LESSONS
    assert [p.name for p in GUIDES] == ["explore_tradeoffs.ipynb", "export_and_train.ipynb", "pipeline.ipynb",
                                        "will_it_fit.ipynb"]
    assert not list((ROOT / "notebooks").glob("*.ipynb"))  # nothing left loose beside the two folders


def _tagged(nb, tag: str) -> list[int]:
    return [k for k, c in enumerate(nb.cells) if tag in c.metadata.get("tags", [])]


# An exercise cell ships with `answer = ...` (or, for a question answered on the explorer's slider, `drag_to = ...`:
# a headless run has no one to drag it, so it sets the explorer's budget there, as a drag would).
_BLANK = re.compile(r"^(answer|drag_to) = \.\.\.", re.M)


def _filled(source: str, value) -> str:
    return _BLANK.sub(lambda m: f"{m.group(1)} = {value!r}", source)


def test_lessons_ask_before_they_tell():
    """Every exercise cell ships blank, carries its answer and a wrong one in its metadata, and the next cell checks
    it; every "write it" cell is checked by the next cell, and a solution further down is checked the same way."""
    with_exercises = 0
    for path in COURSE:
        nb = nbformat.read(path, as_version=4)
        for k in _tagged(nb, "exercise"):
            cell = nb.cells[k]
            assert _BLANK.search(cell.source), (path.name, "ships without the answer")
            assert "answer" in cell.metadata and "wrong" in cell.metadata, path.name
            assert "course.check(answer" in nb.cells[k + 1].source, (path.name, "the next cell checks the answer")
        for k in _tagged(nb, "write-it"):
            assert "course.check_" in nb.cells[k + 1].source, (path.name, "the next cell checks what was written")
            assert [s for s in _tagged(nb, "solution") if s > k + 1], (path.name, "a solution follows the check")
        with_exercises += bool(_tagged(nb, "exercise") or _tagged(nb, "write-it"))
    assert len(COURSE) >= 8 and with_exercises >= 7


def _tokens(value) -> list[str]:
    """How an answer would read in an output: 60 as "60" (not in "600" or "6.0"), 3.5 as "3.5"."""
    v = float(value)
    text = f"{int(v)}" if v == int(v) else f"{v:g}"
    return [rf"(?<![\w.]){re.escape(text)}(?![\w]|\.\d)"]


def _shown(cell) -> str:
    """What a cell's outputs show a reader: printed text, and of a plotly figure its titles, annotations, trace
    names and hover text (not the data arrays: a number on an axis is not a label)."""
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", "") if out.output_type == "stream" else "")
        data = out.get("data", {})
        fig = data.get("application/vnd.plotly.v1+json")
        if fig is not None:
            lay = fig.get("layout", {})
            parts.append(json.dumps(lay.get("title", "")))
            parts += [json.dumps(a.get("text", "")) for a in lay.get("annotations", [])]
            for axis in (v for key, v in lay.items() if key.startswith(("xaxis", "yaxis"))):
                parts.append(json.dumps(axis.get("title", "")))
            for tr in fig.get("data", []):
                parts += [json.dumps(tr.get(key, "")) for key in ("name", "hovertemplate", "hovertext", "text")]
        elif "text/plain" in data:
            parts.append(data["text/plain"])
    return "\n".join(parts)


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
    """Each exercise is tried as a reader would: a wrong answer first (it must get a hint, not the answer), then the
    right one in a copy of the two cells inserted below (it must be told "Right" and why). Nothing any cell above
    an exercise shows may give its answer away."""
    # The kernel imports this checkout's hchain_viz, and runs torch on one thread: on a small shared machine,
    # torch's default of one thread per core makes the notebooks several times slower.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for attempt in (1, 2):
        nb = nbformat.read(path, as_version=4)
        exercises = _tagged(nb, "exercise")
        for k in reversed(exercises):
            cell, check_cell = nb.cells[k], nb.cells[k + 1]
            right = nbformat.v4.new_code_cell(_filled(cell.source, cell.metadata["answer"]))
            again = nbformat.v4.new_code_cell(check_cell.source)
            cell.source = _filled(cell.source, cell.metadata["wrong"])
            nb.cells[k + 2:k + 2] = [right, again]
        exercises = [k + 2 * n for n, k in enumerate(exercises)]  # where they are now
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

    def said(k: int) -> str:
        return "".join(o.get("text", "") for o in nb.cells[k].outputs if o.output_type == "stream")

    for k in exercises:
        answer, tells = nb.cells[k].metadata["answer"], nb.cells[k].metadata.get("tells")
        tells = tells or _tokens(answer)
        wrong, right = said(k + 1), said(k + 3)
        assert wrong.startswith("Not quite:") and "Hint:" in wrong and "Why:" not in wrong, wrong
        assert right.startswith("Right:") and "Why:" in right, right
        above = "\n".join(_shown(c) for c in nb.cells[:k] if c.cell_type == "code") + "\n" + wrong
        for tell in tells:
            found = re.search(tell, above)
            near = above[max(0, found.start() - 80):found.end() + 80] if found else ""
            assert not found, (path.name, f"the answer {answer!r} shows above its check: ...{near}...")
    for k in _tagged(nb, "write-it"):
        assert said(k + 1).startswith("Write "), said(k + 1)  # the blank is not judged
    for k in _tagged(nb, "solution"):
        assert said(k).startswith("Right:"), said(k)


def _kernel_start_race(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it came from) is asyncio's InvalidStateError."""
    import asyncio

    while exc is not None:
        if isinstance(exc, asyncio.InvalidStateError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
