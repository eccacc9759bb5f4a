"""viz/board.py: the FigureBoard widget's state is the figures, encoded as plotly.io would encode them."""

from __future__ import annotations

import base64
import json

import numpy as np
import plotly.graph_objects as go
import pytest
from plotly.io import to_json

import hchain_viz as hcv
from hchain_viz.viz.board import FigureBoard, _json
from hchain_viz.viz.explorer import Explorer

_DTYPES = {"f8": "<f8", "i4": "<i4", "f4": "<f4", "i2": "<i2", "i1": "i1", "u1": "u1", "u2": "<u2", "u4": "<u4"}


def decoded(obj):
    """A figure's JSON with base64 typed arrays turned into lists of floats (either encoder's output)."""
    if isinstance(obj, dict):
        if "bdata" in obj:
            a = np.frombuffer(base64.b64decode(obj["bdata"]), _DTYPES[obj["dtype"]])
            if "shape" in obj:
                a = a.reshape([int(n) for n in obj["shape"].split(",")])
            return a.astype(float).tolist()
        return {k: decoded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decoded(v) for v in obj]
    return float(obj) if isinstance(obj, int) and not isinstance(obj, bool) else obj


def test_fast_encoding_equals_plotly_io_for_every_explorer_figure():
    ex = Explorer(hcv.Chain.random(12, seed=5))
    ex.overlay = "sqrt_n"
    ex.step = 9
    for name, fig in ex.figures.items():
        assert decoded(json.loads(_json(fig))) == decoded(json.loads(to_json(fig, validate=False))), name
    ex.close()


def test_values_json_cannot_hold_fall_back_to_plotly_io():
    fig = go.Figure(go.Scatter(x=[0.0, 1.0], y=[float("nan"), 1.0]))
    assert json.loads(_json(fig))["data"][0]["y"] == [None, 1.0]  # NaN: null, as plotly.io writes it


def test_sync_sends_only_changed_figures_and_clicks_reach_their_callbacks():
    a, b = go.Figure(go.Scatter(x=[1, 2])), go.Figure(go.Bar(x=[3]))
    board = FigureBoard({"a": a, "b": b}, rows=[["a", "b"]])
    sent = []
    board.observe(lambda ch: sent.append(ch["new"]), "_figure_json")
    board.sync()
    assert sent == []  # nothing changed
    a.update_layout(title_text="new")
    board.sync(["a"])
    assert len(sent) == 1 and json.loads(sent[0]["a"])["layout"]["title"]["text"] == "new"
    clicks = []
    board.on_click("b", clicks.append)
    board._on_msg(board, {"event": "click", "name": "b", "trace": 0, "x": 3, "y": 1}, None)
    board._on_msg(board, {"event": "click", "name": "a", "trace": 0, "x": 1, "y": 1}, None)
    assert [c["x"] for c in clicks] == [3]
    with pytest.raises(ValueError, match="does not have"):
        FigureBoard({"a": a}, rows=[["a", "c"]])
    board.close()


def test_the_caption_and_the_figures_travel_in_one_message():
    """The status line of the player's step is the board's caption: a step change and the figures it goes with are
    one message, so the page never shows one op's figures under another op's line (issue 43)."""
    import plotly.graph_objects as go

    from hchain_viz.viz.board import _ESM, FigureBoard

    b = FigureBoard({"a": go.Figure(go.Scatter(x=[0], y=[0]))}, texts=["before", "after op 1"], step=0)
    assert b.trait_metadata("texts", "sync") and b.trait_metadata("step", "sync")  # the page reads both
    assert "texts[k]" in _ESM and 'model.on("change:step"' in _ESM
    sent = []
    b.comm.send = lambda data=None, buffers=None, **kw: sent.append(data)
    b.figures["a"].data[0].x = [1]
    b.sync(step=1)
    (msg,) = sent
    assert set(msg["state"]) == {"_figure_json", "step"} and msg["state"]["step"] == 1
    # the page-wide keys: PageUp/PageDown doubled only for real presses on the budget handle; Home/End set the ends
    # of the range as it is now on either slider
    assert ".hcv-budget .noUi-handle" in _ESM and ".hcv-step .noUi-handle" in _ESM and "ev.isTrusted" in _ESM
    assert "slider.options.range" in _ESM
    b.close()
