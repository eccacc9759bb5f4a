"""core/units.py: bytes and seconds formatted for people, and memory sizes parsed from their text."""

from __future__ import annotations

import math

import pytest

from hchain_viz.core.units import format_bytes, format_time, parse_bytes
from hchain_viz.errors import HChainError


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (10 * 2**20 + 2**19, "10.5 MiB"),
        (2**20 - 1, "1024 KiB"),  # just under a MiB stays in KiB, rounded
        (123_456_789, "118 MiB"),
        (5 * 2**30, "5 GiB"),
        (2000 * 2**30, "2000 GiB"),  # beyond GiB: no rounding to 3 figures
        (-2048, "-2 KiB"),
        (0.7, "0 B"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_format_bytes_missing_and_infinite():
    assert format_bytes(None) == "n/a"
    assert format_bytes(float("nan")) == "n/a"
    assert format_bytes(float("inf")) == "inf"


@pytest.mark.parametrize(
    "s, text",
    [
        (0, "0 s"),
        (0.0123, "12.3 ms"),
        (2.5, "2.5 s"),
        (5000.0, "5000 s"),
        (12e-6, "12 µs"),
        (1e-7, "100 ns"),
        (-0.5, "-500 ms"),
        (float("nan"), "n/a"),
        (float("inf"), "inf"),
        (None, "n/a"),
    ],
)
def test_format_time(s, text):
    assert format_time(s) == text


@pytest.mark.parametrize(
    "text, n",
    [
        ("300MiB", 300 * 2**20),
        ("300 MiB", 300 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2GB", 2_000_000_000),
        ("2gb", 2_000_000_000),
        ("4k", 4096),
        ("4kB", 4000),
        ("0.5 KiB", 512),
        ("100", 100),
        (" 7 b ", 7),
        ("1e3", 1000),
        (".5MiB", 2**19),
        (12345, 12345),
        (12.9, 12),
        (0, 0),
    ],
)
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n
    assert isinstance(parse_bytes(text), int)


@pytest.mark.parametrize("bad", ["", "abc", "12 parsecs", "-5MiB", "MiB", "1.2.3GB", -1, float("nan"), float("inf"),
                                 "1e400", True, None, [3]])
def test_parse_bytes_rejects_with_hint(bad):
    with pytest.raises(HChainError) as info:
        parse_bytes(bad)
    msg = str(info.value)
    assert "memory size" in msg or "bytes" in msg


def test_parse_bytes_error_says_how_to_write_it():
    with pytest.raises(HChainError, match="300MiB"):
        parse_bytes("lots")


@pytest.mark.parametrize("n", [1, 1000, 1536, 3 * 2**20, 7 * 2**30 + 12345])
def test_format_then_parse_is_close(n):
    # The printed form reads back within the 3-significant-figure rounding.
    back = parse_bytes(format_bytes(n).replace(" ", ""))
    assert math.isclose(back, n, rel_tol=5e-3)
