"""core/schedule.py: ops, the text form and its parser, the JSON format, and rejection of malformed ops."""

from __future__ import annotations

import json

import pytest

from hchain_viz.core import strategies
from hchain_viz.core.chain import Chain
from hchain_viz.core.schedule import SCHEDULE_FORMAT, Op, Schedule, make_schedule
from hchain_viz.errors import HChainError, InvalidSchedule

TEXT = "Fck0 Fn1 Fall2 Loss B2 Fall0 Fall1 B1 B0"


def test_op_basics():
    assert str(Op("Fck", 3)) == "Fck3" and str(Op("Loss", 5)) == "Loss"
    assert Op("Fn", 1).is_forward and Op("Fall", 0).is_forward and Op("Fck", 0).is_forward
    assert not Op("B", 1).is_forward and not Op("Loss", 2).is_forward
    assert Op("B", 1) == ("B", 1)  # a NamedTuple: plain pairs compare equal


def test_parse_and_str_round_trip():
    s = Schedule.parse(TEXT, strategy="hand")
    assert str(s) == TEXT
    assert s.ops[3] == Op("Loss", 3)  # the loss stage is one past the last forward
    assert s.ops[:3] == (Op("Fck", 0), Op("Fn", 1), Op("Fall", 2))
    assert s.meta == {"strategy": "hand"}
    assert Schedule.parse(str(s)) == s
    assert len(s) == 9 and list(s) == list(s.ops)


def test_parse_loss_with_explicit_stage_and_whitespace():
    s = Schedule.parse("  Fall0\n Loss4\tB0 ")
    assert s.ops == (Op("Fall", 0), Op("Loss", 4), Op("B", 0))


@pytest.mark.parametrize("length", [1, 2, 5, 9, "transformer"])
def test_every_strategy_round_trips_through_text_and_json(length):
    chain = Chain.transformer(1) if length == "transformer" else Chain.random(length, seed=length)
    for name in strategies.applicable(chain):
        s = strategies.STRATEGIES[name](chain)
        assert Schedule.parse(str(s)) == s, name
        back = Schedule.from_json(s.to_json())
        assert back == s and back.meta == s.meta, name


@pytest.mark.parametrize("token", ["F0", "Fck", "B", "Bx", "Fall-1", "Loss!", "B²", "fck0", "X3", "Fn1.5"])
def test_parse_rejects_unknown_tokens(token):
    with pytest.raises(InvalidSchedule, match=repr(token).replace("[", r"\[")):
        Schedule.parse(f"Fck0 {token} Loss")


def test_json_format_is_exact():
    s = Schedule.parse("Fck0 Fall1 Loss B1 Fall0 B0", strategy="x", budget=123)
    d = json.loads(s.to_json())
    assert d == {
        "format": "hchain-schedule/1",
        "ops": [["Fck", 0], ["Fall", 1], ["Loss", 2], ["B", 1], ["Fall", 0], ["B", 0]],
        "strategy": "x",
        "budget": 123,
    }
    assert SCHEDULE_FORMAT == "hchain-schedule/1"
    assert list(d)[:2] == ["format", "ops"]


def test_json_file_round_trip(tmp_path):
    s = Schedule.parse(TEXT, strategy="hand")
    path = tmp_path / "s.json"
    text = s.to_json(str(path), indent=2)
    assert path.read_text() == text and "\n" in text
    back = Schedule.from_json(str(path))
    assert back == s and back.meta == {"strategy": "hand"}


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"format": "hchain-schedule/1", "ops": [', "malformed"),
        ('{"format": "hchain-chain/1", "ops": []}', "not a schedule"),
        ('{"format": "hchain-schedule/1"}', "not a schedule"),
        ('{"format": "hchain-schedule/1", "ops": 5}', "must be a list"),
        ('{"format": "hchain-schedule/1", "ops": [["Fck", 0], 7]}', "op #1"),
        ('{"format": "hchain-schedule/1", "ops": [["Jump", 0]]}', "kind 'Jump'"),
    ],
)
def test_from_json_errors(text, words):
    with pytest.raises(InvalidSchedule, match=words):
        Schedule.from_json(text)


def test_from_json_missing_file():
    with pytest.raises(InvalidSchedule, match="cannot read schedule file"):
        Schedule.from_json("/nonexistent/schedule.json")


@pytest.mark.parametrize(
    "bad, words",
    [
        (("Jump", 0), "kind 'Jump'"),
        (("fck", 0), "kind 'fck'"),
        (("Fck", -1), "stage -1"),
        (("Fck", 1.5), "stage 1.5"),
        (("Fck", "1"), "stage '1'"),
        (("Fck", True), "stage True"),
        (("Fck", None), "stage None"),
        (("Fck", float("inf")), "stage inf"),
        (("Fck",), "pair"),
        (("Fck", 0, 1), "pair"),
        (5, "pair"),
    ],
)
def test_bad_ops_name_their_index(bad, words):
    with pytest.raises(InvalidSchedule, match=words) as info:
        Schedule((Op("Fck", 0), Op("Fall", 1), bad))
    assert info.value.index == 2
    assert "op #2" in str(info.value)
    assert isinstance(info.value, HChainError)


def test_integral_stages_are_normalised():
    import numpy as np

    s = Schedule((("Fck", np.int64(0)), ["Fall", 1.0], ("Loss", 2)))
    assert s.ops == (Op("Fck", 0), Op("Fall", 1), Op("Loss", 2))
    assert all(type(op.stage) is int and isinstance(op, Op) for op in s.ops)


def test_make_schedule_and_meta_not_part_of_equality():
    a = make_schedule([("Fall", 0), ("Loss", 1), ("B", 0)], strategy="a")
    b = make_schedule([("Fall", 0), ("Loss", 1), ("B", 0)], strategy="b")
    assert a == b and hash(a) == hash(b) and a.meta["strategy"] == "a"
    with pytest.raises(AttributeError):
        a.ops = ()  # type: ignore[misc]


def test_n_recomputed_counts_repeat_forwards():
    assert Schedule.parse(TEXT).n_recomputed == 2  # Fall0 and Fall1 again after the loss
    assert Schedule.parse("Fall0 Fall1 Loss B1 B0").n_recomputed == 0
    assert Schedule.parse("Fck0 Fn1 Loss Fck0 Fall1 B1 Fall0 B0").n_recomputed == 3


def test_repr_names_strategy_and_truncates():
    s = strategies.recompute_all(Chain.homogeneous(30))
    r = repr(s)
    assert r.startswith(f"Schedule(recompute_all, {len(s)} ops: Fck0 Fn1")
    assert r.endswith(" ...)") and len(r) < 300
    assert repr(Schedule.parse("Fall0 Loss B0")) == "Schedule(schedule, 3 ops: Fall0 Loss B0)"
