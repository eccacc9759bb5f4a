"""core/chain.py: validation of a Chain's fields, JSON round trip, the teaching/test constructors and the table repr."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest

from hchain_viz.core.chain import CHAIN_FORMAT, Chain
from hchain_viz.errors import HChainError, InvalidChain


def small(**over) -> dict:
    """Fields of a valid 2-stage chain, with some replaced."""
    d = dict(fwd_time=[1.0, 2.0], bwd_time=[3.0, 4.0], x=[1, 2, 4], xbar=[8, 16], fwd_tmp=[32, 64], bwd_tmp=[128, 256])
    d.update(over)
    return d


# ------------------------------------------------------------------ validation
def test_valid_chain_normalises_types():
    c = Chain(**small(fwd_time=np.array([1, 2]), x=(1.0, 2, 4)))
    assert c.length == len(c) == 2
    assert c.fwd_time == (1.0, 2.0) and all(isinstance(v, float) for v in c.fwd_time)
    assert c.x == (1, 2, 4) and all(isinstance(v, int) for v in c.x)
    assert c.names == ("stage0", "stage1")


def test_defaults_for_transients_and_names():
    c = Chain(fwd_time=[1], bwd_time=[1], x=[5, 6], xbar=[6])
    assert c.fwd_tmp == (0,) and c.bwd_tmp == (0,)
    assert c.names == ("stage0",)


def test_fractional_sizes_round_up():
    # Never under-count memory.
    c = Chain(**small(x=[0.2, 2.0, 3.5], xbar=[8, 16]))
    assert c.x == (1, 2, 4)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("fwd_time", [], "at least one stage"),
        ("bwd_time", [1.0], "bwd_time has 1 entries but needs 2"),
        ("x", [1, 2], "x has 2 entries but needs 3"),
        ("xbar", [8, 16, 3], "xbar has 3 entries but needs 2"),
        ("fwd_tmp", [1], "fwd_tmp has 1 entries"),
        ("bwd_tmp", [1, 2, 3], "bwd_tmp has 3 entries"),
        ("names", ["a"], "names has 1 entries"),
        ("names", 5, "names must be a list"),
        ("fwd_time", 3.0, "fwd_time must be a sequence"),
    ],
)
def test_lengths_are_checked(field, value, words):
    with pytest.raises(InvalidChain, match=words):
        Chain(**small(**{field: value}))


def test_x_length_message_explains_the_extra_entry():
    with pytest.raises(InvalidChain, match="L\\+1"):
        Chain(**small(x=[1, 2]))


@pytest.mark.parametrize("field", ["fwd_time", "bwd_time", "x", "xbar", "fwd_tmp", "bwd_tmp"])
@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "abc", None])
def test_negative_nan_and_non_numbers_rejected(field, bad):
    d = small()
    vals = list(d[field])
    vals[1] = bad
    with pytest.raises(InvalidChain, match=rf"{field}\[1\]"):
        Chain(**small(**{field: vals}))


def test_xbar_smaller_than_output_rejected_with_index():
    with pytest.raises(InvalidChain, match=r"xbar\[1\] = 3 is smaller than x\[2\] = 4"):
        Chain(**small(xbar=[8, 3]))


def test_xbar_equal_to_output_is_fine():
    c = Chain(**small(xbar=[2, 4]))
    assert c.xbar == (2, 4)


def test_errors_are_hchain_errors_and_value_errors():
    with pytest.raises(HChainError):
        Chain(**small(x=[1]))
    with pytest.raises(ValueError):
        Chain(**small(x=[1]))


def test_frozen_equal_and_hashable_ignoring_meta():
    a = Chain(**small(), meta={"model": "a"})
    b = Chain(**small(), meta={"model": "b"})
    assert a == b and hash(a) == hash(b)
    assert a != Chain(**small(fwd_time=[1.0, 2.5]))
    with pytest.raises(AttributeError):
        a.x = (1, 1, 1)  # type: ignore[misc]


def test_arrays_and_store_all_time():
    c = Chain(**small())
    arr = c.arrays()
    assert arr["fwd_time"].dtype == np.float64 and arr["x"].dtype == np.int64
    assert arr["x"].tolist() == [1, 2, 4] and arr["bwd_tmp"].tolist() == [128, 256]
    assert c.store_all_time == 10.0


# ------------------------------------------------------------------ JSON
def test_json_round_trip_text_and_file(tmp_path):
    c = Chain.random(7, seed=3)
    c = Chain(**{k: getattr(c, k) for k in ("fwd_time", "bwd_time", "x", "xbar", "fwd_tmp", "bwd_tmp", "names")},
              meta={"device": "cpu", "batch": 8})
    back = Chain.from_json(c.to_json())
    assert back == c and back.names == c.names and back.meta == c.meta
    assert back.fwd_time == c.fwd_time  # floats survive exactly
    path = tmp_path / "chain.json"
    c.to_json(str(path))
    assert Chain.from_json(str(path)) == c
    d = json.loads(path.read_text())
    assert d["format"] == CHAIN_FORMAT and d["x"] == list(c.x)


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"format": "hchain-chain/1", "fwd_time": [1], "bwd_time": [1], "x": [1, 1]', "malformed"),
        ('{"format": "something-else", "fwd_time": [1]}', "not a chain"),
        ('{"format": "hchain-chain/1", "fwd_time": [1], "bwd_time": [1]}', "lacks the field"),
        ('{"format": "hchain-chain/1", "fwd_time": [1], "bwd_time": [1], "x": [1, 1], "xbar": [0]}', "xbar\\[0\\]"),
    ],
)
def test_from_json_errors(text, words):
    with pytest.raises(InvalidChain, match=words):
        Chain.from_json(text)


def test_from_json_missing_file():
    with pytest.raises(InvalidChain, match="cannot read chain file"):
        Chain.from_json("/nonexistent/chain.json")


# ------------------------------------------------------------------ constructors
def test_homogeneous():
    c = Chain.homogeneous(4, fwd_time=0.5, bwd_time=1.5, x=3)
    assert c.length == 4
    assert set(c.fwd_time) == {0.5} and set(c.bwd_time) == {1.5}
    assert c.x == (3,) * 5 and c.xbar == (6,) * 4  # xbar defaults to 2x
    assert Chain.homogeneous(2, x=3, xbar=3, fwd_tmp=1, bwd_tmp=2).xbar == (3, 3)
    assert Chain.homogeneous(1).store_all_time == 3.0


@pytest.mark.parametrize("bad", [0, -3, 2.5, "3"])
def test_homogeneous_and_random_reject_bad_length(bad):
    with pytest.raises(InvalidChain, match="positive integer"):
        Chain.homogeneous(bad)
    with pytest.raises(InvalidChain, match="positive integer"):
        Chain.random(bad)


def test_homogeneous_rejects_xbar_below_x():
    with pytest.raises(InvalidChain):
        Chain.homogeneous(3, x=4, xbar=2)


def test_random_is_heterogeneous():
    c = Chain.random(30, seed=1, scale=2**20)
    ratio = lambda v: max(v) / min(v)
    # Several-fold variation in every dimension (log-uniform over ~10x).
    assert ratio(c.fwd_time) > 3
    assert ratio(c.x) > 3
    assert ratio(c.xbar) > 2
    assert ratio(c.fwd_tmp) > 3 and ratio(c.bwd_tmp) > 3
    # Backward is 1-3x its forward, sizes are around the scale.
    assert all(f <= b <= 3 * f for f, b in zip(c.fwd_time, c.bwd_time))
    assert 2**20 / 10 < np.median(c.x) < 2**20 * 3
    assert all(xb >= c.x[i + 1] for i, xb in enumerate(c.xbar))
    assert c.names[0] == "layer0"


def test_random_is_reproducible_by_seed():
    assert Chain.random(10, seed=5) == Chain.random(10, seed=5)
    assert Chain.random(10, seed=5) != Chain.random(10, seed=6)


def test_random_zero_fraction_and_no_transients():
    c = Chain.random(40, seed=2, zero_fraction=0.3, transients=False)
    assert 0 in c.fwd_time and 0 in c.x
    assert set(c.fwd_tmp) == {0} and set(c.bwd_tmp) == {0}
    assert all(xb >= c.x[i + 1] for i, xb in enumerate(c.xbar))


# ------------------------------------------------------------------ display
def test_repr_is_a_table():
    c = Chain(**small(), names=["conv", "fc"])
    text = repr(c)
    lines = text.splitlines()
    assert lines[0].startswith("Chain: 2 stages, store-all 10 s")
    assert "fwd" in lines[1] and "xbar" in lines[1]
    assert len(lines) == 2 + 3  # header, column names, 2 stages + the output row
    assert "conv" in lines[2] and "(output)" in lines[-1]
    assert "128 B" in lines[2]  # bwd_tmp of stage 0
    # Columns align: every row has the same width.
    assert len({len(line) for line in lines[1:]}) == 1


def test_repr_truncates_long_chains_and_html():
    c = Chain.random(60, seed=0)
    lines = repr(c).splitlines()
    assert len(lines) == 2 + 21 and any(line.lstrip().startswith("...") for line in lines)
    html = c._repr_html_()
    assert html.count("<tr>") == 1 + 61 and "<table>" in html


def test_activation_total_in_header():
    c = Chain(**small())
    assert f"activations {24 + 1} B" in repr(c)
    assert math.isclose(c.store_all_time, sum(c.fwd_time) + sum(c.bwd_time))


def test_bandwidth_presets_validation_and_json():
    from hchain_viz.core.chain import BANDWIDTH_PRESETS

    c = Chain.random(3)
    assert c.bandwidth is None and "bandwidth" not in c.to_dict()  # old chain files load unchanged
    for name, label in (("pcie4", "PCIe 4.0 x16"), ("pcie5", "pcie 5.0 X16"), ("nvlink-c2c", "NVLink-C2C")):
        assert c.with_bandwidth(name).bandwidth == c.with_bandwidth(label).bandwidth == BANDWIDTH_PRESETS[name]
    d = c.with_bandwidth(3e9)
    assert d.bandwidth == 3e9 and Chain.from_json(d.to_json()).bandwidth == 3e9
    assert d.with_bandwidth(None).bandwidth is None
    for bad in (0, -1.0, float("inf"), float("nan"), "usb", True, [1]):
        with pytest.raises(InvalidChain, match="bandwidth"):
            c.with_bandwidth(bad)


def test_structure_fields_round_trip_and_default():
    c = Chain(fwd_time=[1, 1, 1], bwd_time=[2, 2, 2], x=[4, 6, 6, 4], xbar=[8, 8, 4],
              groups=[("h.0", 0, 1)], tags=["", "attn_core", ""], shared=[(1, 2, 3)])
    assert c.groups == (("h.0", 0, 1),) and c.tags == ("", "attn_core", "") and c.shared == ((1, 2, 3),)
    back = Chain.from_json(c.to_json())
    assert (back.groups, back.tags, back.shared) == (c.groups, c.tags, c.shared)
    plain = Chain(fwd_time=[1], bwd_time=[1], x=[1, 1], xbar=[1])
    assert plain.groups == () and plain.tags == ("",) and plain.shared == ()
    assert "groups" not in plain.to_dict() and "tags" not in plain.to_dict() and "shared" not in plain.to_dict()


def test_transit_gradient_sizes_and_nograd_transients_round_trip_default_and_validate():
    base = dict(fwd_time=[1, 1, 1], bwd_time=[2, 2, 2], x=[4, 6, 6, 4], xbar=[8, 8, 4], shared=[(1, 2, 3)])
    plain = Chain(**base)
    assert plain.transit == (0, 0, 0, 0) and plain.delta is None and plain.delta_bytes == plain.x
    assert replace(plain, x=[4, 8, 8, 4]).delta_bytes == (4, 8, 8, 4)  # follows x
    assert plain.nograd_tmp is None and plain.nograd_tmp_bytes == plain.fwd_tmp
    assert "nograd_tmp" not in plain.to_dict()
    assert Chain.from_json(Chain(**base, nograd_tmp=[5, 0, 1]).to_json()).nograd_tmp_bytes == (5, 0, 1)
    with pytest.raises(InvalidChain, match="nograd_tmp"):
        Chain(**base, nograd_tmp=[1, 2])
    assert "transit" not in plain.to_dict() and "delta" not in plain.to_dict()  # old chain files load unchanged
    c = Chain(**base, transit=[0, 3, 2, 0], delta=[0, 12, 6, 4])
    back = Chain.from_json(c.to_json())
    assert back.transit == (0, 3, 2, 0) and back.delta == back.delta_bytes == (0, 12, 6, 4)
    with pytest.raises(InvalidChain, match="transit\\[0\\] and transit\\[L\\] must be 0"):
        Chain(**base, transit=[1, 0, 0, 0])
    with pytest.raises(InvalidChain, match="transit\\[1\\] = 4 is more than the 3 bytes of x\\[1\\] that no shared"):
        Chain(**base, transit=[0, 4, 0, 0])  # 3 of x[1]'s 6 bytes are the shared tensor
    c = Chain(**base, transit=[0, 1, 2, 0], consumed=[0, 2, 1, 0])
    assert Chain.from_json(c.to_json()).consumed == (0, 2, 1, 0) and "consumed" not in plain.to_dict()
    assert plain.consumed == (0, 0, 0, 0)
    with pytest.raises(InvalidChain, match="consumed\\[0\\] and consumed\\[L\\] must be 0"):
        Chain(**base, consumed=[0, 0, 0, 1])
    with pytest.raises(InvalidChain, match="consumed\\[1\\] = 3 beside transit\\[1\\] = 1 is more than the 3 bytes"):
        Chain(**base, transit=[0, 1, 0, 0], consumed=[0, 3, 0, 0])  # together more than x[1]'s unshared bytes
    with pytest.raises(InvalidChain, match="delta"):
        Chain(**base, delta=[1, 2, 3])
    with pytest.raises(InvalidChain, match="delta"):
        Chain(**base, delta=[0, -1, 0, 0])


@pytest.mark.parametrize("kw, words", [
    (dict(groups=[("a", 0, 3)]), "outside"),
    (dict(groups=[("a", 0, 1), ("b", 1, 2)]), "overlap"),
    (dict(groups=[("a", 1, 0)]), "reversed"),
    (dict(tags=["x"]), "one per stage"),
    (dict(shared=[(2, 1, 1)]), "first < last"),
    (dict(shared=[(0, 1, 5)]), "more than x[0]"),
    (dict(shared=[(0, 1, -1)]), "negative"),
    (dict(shared=[(0, 1)]), "(first_boundary, last_boundary, bytes)"),
])
def test_structure_fields_are_validated(kw, words):
    with pytest.raises(InvalidChain, match=re.escape(words)):
        Chain(fwd_time=[1, 1, 1], bwd_time=[2, 2, 2], x=[4, 6, 6, 4], xbar=[8, 8, 4], **kw)


def test_time_spread_is_read_from_meta_weighted_by_time():
    c = Chain(fwd_time=[1.0, 3.0], bwd_time=[2.0, 2.0], x=[1, 1, 1], xbar=[1, 1],
              meta={"time_spread": {"fwd": [0.4, 0.0], "bwd": [0.1, 0.1]}})
    assert c.time_spread == pytest.approx((0.4 * 1 + 0.1 * 4) / 8)
    assert Chain.from_json(c.to_json()).time_spread == c.time_spread
    assert Chain.random(3, seed=0).time_spread is None  # not profiled: unknown
    for bad in ({"fwd": [0.1]}, {"fwd": [0.1], "bwd": [0.1]}, "noise", {"fwd": ["a", "b"], "bwd": [0, 0]}):
        assert Chain(fwd_time=[1.0, 3.0], bwd_time=[2.0, 2.0], x=[1, 1, 1], xbar=[1, 1],
                     meta={"time_spread": bad}).time_spread is None


# ------------------------------------------------------------------ tied stages (docs/design.md §10)
def test_tied_and_copy_spread_round_trip_and_validate():
    base = dict(fwd_time=[1.0] * 4, bwd_time=[2.0] * 4, x=[1] * 5, xbar=[1] * 4)
    c = Chain(**base, tied=[[3, 1], (0, 2)], copy_spread=[(0.1, 0.2), [0.0, 0.5]],
              meta={"repeats": 3, "time_spread": {"fwd": [0.0] * 4, "bwd": [0.0] * 4}})
    assert c.tied == ((1, 3), (0, 2)) and c.copy_spread == ((0.1, 0.2), (0.0, 0.5))
    again = Chain.from_json(c.to_json())
    assert again == c and again.tied == c.tied and again.copy_spread == c.copy_spread
    assert c.timing_note() == "4 identical stages in 2 kinds share their median time (copies differed by up to ±50%)"
    assert Chain(**base).timing_note() is None and Chain(**base).tied == ()
    for bad, match in (({"tied": [[1]]}, "two or more"), ({"tied": [[0, 4]]}, "from 0 to 3"),
                       ({"tied": [[0, 1], [1, 2]], "copy_spread": [(0, 0), (0, 0)]}, "overlap"),
                       ({"tied": [[0, 1]]}, "one \\[fwd, bwd\\] per set"),
                       ({"tied": [[0, 1]], "copy_spread": [(-1, 0)]}, "non-negative"),
                       ({"tied": ["ab"]}, "stage indices")):
        with pytest.raises(InvalidChain, match=match):
            Chain(**base, **bad)


def test_backward_call_round_trips_counts_in_store_all_and_validates():
    base = dict(fwd_time=[1.0] * 3, bwd_time=[2.0] * 3, x=[1] * 4, xbar=[1] * 3)
    c = Chain(**base, backward_call=0.25)
    assert c.store_all_time == 9.25 and Chain(**base).backward_call == 0.0
    again = Chain.from_json(c.to_json())
    assert again == c and again.backward_call == 0.25
    assert "backward_call" not in Chain(**base).to_dict()  # older readers see the chains they know
    for bad in (-1.0, float("nan"), "fast"):
        with pytest.raises(InvalidChain, match="backward_call"):
            Chain(**base, backward_call=bad)


def test_timing_note_counts_only_untied_stages_as_noise():
    meta = {"repeats": 5, "time_spread": {"fwd": [0.5, 0.5, 0.0], "bwd": [0.5, 0.5, 0.0]}}
    c = Chain(fwd_time=[1.0] * 3, bwd_time=[1.0] * 3, x=[1] * 4, xbar=[1] * 3, meta=meta)
    assert c.untied_spread == pytest.approx(1 / 3) and c.timing_note() == "stage times varied ±33% across 5 repeats"
    t = replace(c, tied=((0, 1),), copy_spread=((0.2, 0.1),))
    assert t.untied_spread == 0.0
    assert t.timing_note() == ("2 identical stages in 1 kind share their median time (copies differed by up to "
                               "±20%); other stage times varied ±0% across 5 repeats")


def test_handed_gradients_and_consumed_shared_tensors_round_trip_default_and_validate():
    base = dict(fwd_time=[1, 1, 1], bwd_time=[2, 2, 2], x=[4, 6, 6, 4], xbar=[8, 8, 4], shared=[(1, 2, 3)])
    plain = Chain(**base)
    assert plain.delta_through == (0, 0, 0) and plain.consumed_shared == ()
    assert "delta_through" not in plain.to_dict() and "consumed_shared" not in plain.to_dict()
    c = Chain(**base, delta_through=[0, 6, 4], consumed_shared=[0])
    back = Chain.from_json(c.to_json())
    assert back.delta_through == (0, 6, 4) and back.consumed_shared == (0,)
    assert Chain(**base, consumed_shared=iter([0])).consumed_shared == (0,)  # any iterable, read once
    with pytest.raises(InvalidChain, match="delta_through\\[2\\] = 5 is more than δ_2 \\(6 B\\) or δ_3 \\(4 B\\)"):
        Chain(**base, delta_through=[0, 0, 5])
    with pytest.raises(InvalidChain, match="consumed_shared index 1 is not one of shared's 1"):
        Chain(**base, consumed_shared=[1])
    with pytest.raises(InvalidChain, match="last == first \\+ 1 < L"):
        Chain(**{**base, "shared": [(0, 2, 3)]}, consumed_shared=[0])  # crosses three cuts, from the input
