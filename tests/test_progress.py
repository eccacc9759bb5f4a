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

    def display(obj, display_id=False):
        assert display_id is True  # the bar must be replaceable
        handles.append(FakeHandle(obj))
        return handles[-1]

    monkeypatch.setattr(progress, "_in_kernel", lambda: True)
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
    monkeypatch.setattr(progress, "_in_kernel", lambda: False)
    from tqdm import tqdm

    assert isinstance(progress.progress_bar(2, "profiling", "stage"), tqdm)
