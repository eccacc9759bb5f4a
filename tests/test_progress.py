"""The profiling progress bar: a widget in a notebook that leaves only text in the saved output."""

from __future__ import annotations

import pytest

from hchain_viz.runtime import progress


class FakeHandle:
    def __init__(self, obj):
        self.shown = [obj]

    def update(self, obj, raw=False):
        self.shown.append((obj, raw))


@pytest.fixture
def notebook(monkeypatch):
    """Pretend to be in a kernel; record what is displayed."""
    import IPython.display

    handles = []

    def display(obj, display_id=False, raw=False):
        assert display_id is True or raw  # the bar must be replaceable; a note alone is plain text
        handles.append(FakeHandle(obj))
        return handles[-1]

    monkeypatch.setattr(progress, "in_kernel", lambda: True)
    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    return handles


def test_notebook_bar_turns_into_text_and_releases_its_widgets(notebook):
    with progress.progress_bar(3, "profiling", "stage") as bar:
        for name in "abc":
            bar.set_postfix_str(name)
            bar.update(1)
        (handle,) = notebook
        box = handle.shown[0]
        assert box.children[0].value == 3 and box.comm is not None
    data, raw = handle.shown[-1]
    assert raw and list(data) == ["text/plain"]  # no widget reference left in the output
    assert data["text/plain"].startswith("profiling: 3/3 stages in ")
    assert box.comm is None and all(w.comm is None for w in box.children)


def test_notebook_bar_says_where_it_stopped(notebook):
    with pytest.raises(KeyError), progress.progress_bar(3, "profiling", "stage") as bar:
        bar.set_postfix_str("conv2")
        bar.update(1)
        raise KeyError
    assert notebook[0].shown[-1][0]["text/plain"].endswith("(stopped at conv2)")


def test_quick_loops_show_nothing_and_scripts_get_tqdm(notebook, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 60.0)
    with progress.progress_bar(2, "profiling", "stage") as bar:
        bar.update(2)
    assert notebook == []
    monkeypatch.setattr(progress, "in_kernel", lambda: False)
    from tqdm import tqdm

    assert isinstance(progress.progress_bar(2, "profiling", "stage"), tqdm)


def test_a_note_goes_on_the_line_the_bar_left(notebook):
    with progress.progress_bar(2, "profiling", "stage") as bar:
        bar.update(2)
    bar.note("times rough")
    (handle,) = notebook
    text = handle.shown[-1][0]["text/plain"]
    assert text.startswith("profiling: 2/2 stages in ") and text.endswith(" · times rough")


def test_status_counts_the_seconds_of_a_long_step_and_leaves_text(notebook, monkeypatch):
    import time

    monkeypatch.setattr(progress, "DELAY_S", 0.05)
    with progress.status("building the explorer"):
        time.sleep(0.8)  # one long call: the line still counts (a timer thread updates it)
        (handle,) = notebook
        label = handle.shown[0]
        assert label.value.startswith("building the explorer… ") and label.value != "building the explorer… 0.0 s"
    data, raw = handle.shown[-1]
    assert raw and data["text/plain"].startswith("building the explorer: ") and label.comm is None


def test_status_of_a_quick_step_shows_nothing(notebook, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 60.0)
    with progress.status("solving"):
        pass
    assert notebook == []


def test_after_profiling_a_line_counts_until_the_cell_ends(notebook, monkeypatch):
    """Issue 43: 17.5 s passed with nothing shown between the profiling bar and the explorer (solve, wrap, ten
    steps, building it). The bar's line is followed by one that counts the seconds until the cell finishes."""
    import time

    import IPython
    from IPython.core.events import EventManager, available_events

    class Shell:
        events = EventManager(None, available_events)

    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell)
    monkeypatch.setattr(progress, "DELAY_S", 0.05)
    with progress.progress_bar(2, "profiling", "stage") as bar:
        time.sleep(0.1)
        bar.update(2)
    time.sleep(0.7)  # the cell goes on (solve, wrap, steps) ...
    profiling, rest = notebook
    assert profiling.shown[-1][0]["text/plain"].startswith("profiling: 2/2 stages in ")
    label = rest.shown[0]
    assert label.value.startswith("after profiling, the rest of the cell… ")
    Shell.events.trigger("post_run_cell", None)  # ... until it ends: then text, and the widget is released
    data, raw = rest.shown[-1]
    assert raw and data["text/plain"].startswith("after profiling, the rest of the cell: ") and label.comm is None
    assert Shell.events.callbacks["post_run_cell"] == []


def test_the_bar_counts_the_seconds_of_a_long_stage(notebook, monkeypatch):
    import time

    monkeypatch.setattr(progress, "DELAY_S", 0.05)
    with progress.progress_bar(3, "profiling", "stage") as bar:
        bar.set_postfix_str("layer2.0")
        time.sleep(1.2)  # one slow stage, no update from the loop: the timer shows the bar and counts
        (handle,) = notebook
        label = handle.shown[0].children[1]
        assert label.value.startswith("0/3 layer2.0 · ") and label.value.endswith(" s")
        assert label.value != "0/3 layer2.0 · 0 s"
