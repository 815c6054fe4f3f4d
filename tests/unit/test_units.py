"""Human sizes and durations: every spelling the config accepts, and clear refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd_server.units import format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("64MiB", 64 << 20),
        ("64mib", 64 << 20),
        ("64 MiB", 64 << 20),
        ("1GiB", 1 << 30),
        ("1.5GiB", 3 << 29),
        ("2TiB", 2 << 40),
        ("0.5KiB", 512),
        ("12B", 12),
        ("0", 0),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("spelling", ["8g", "8G", "8Gi", "8gi", "8GiB", "8gib", "8GB", "8gb",
                                      "8 G", "8192M", "8192Mi", "8388608K", "8388608KB"])
def test_every_spelling_of_a_size_is_binary(spelling):
    """One rule: K, M, G, T are powers of 1024 however they are written (`--pool-size 8g` is
    8 GiB, Kubernetes' `64Gi` is accepted)."""
    assert parse_size(spelling) == 8 << 30


@pytest.mark.parametrize(("letter", "power"), [("k", 1), ("m", 2), ("g", 3), ("t", 4)])
def test_each_unit_letter(letter, power):
    for tail in ("", "b", "i", "ib"):
        for text in (f"3{letter}{tail}", f"3{letter.upper()}{tail.upper()}"):
            assert parse_size(text) == 3 * 1024**power, text


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "not a number"),
        ("abc", "not a number"),
        ("12XB", "unknown unit 'XB'"),
        ("1PB", "use B, K, M, G or T"),
        ("1Gibibyte", "unknown unit"),
        ("-1GiB", "not a number"),
        ("1.3B", "whole number of bytes"),
        ("1..2MiB", "not a number"),
        (-5, "negative"),
        (True, "not a number of bytes"),
        (1.5, "not a string or an integer"),
    ],
)
def test_parse_size_refuses(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500ms", 0.5),
        ("2s", 2.0),
        ("1m", 60.0),
        ("1min", 60.0),
        ("1h", 3600.0),
        ("1.5s", 1.5),
        ("10", 10.0),
        (3, 3.0),
        (0.25, 0.25),
        ("2S", 2.0),
    ],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("soon", "not a number"), ("5d", "unknown unit 'd'"), (-1, ">= 0"), (float("inf"), "finite"),
     (False, "not a number of seconds")],
)
def test_parse_duration_refuses(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_duration(text)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(64 << 20, "64MiB"), (1 << 30, "1GiB"), (3 << 29, "1.5GiB"), (4095, "4.0KiB"), (1023, "1023B"), (0, "0B")],
)
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.5, "500ms"), (2.0, "2s"), (60.0, "1m"), (3600.0, "1h"), (1.5, "1.5s"),
                          (0, "0s")]
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@given(st.integers(min_value=0, max_value=1 << 50))
def test_exact_sizes_round_trip(n):
    text = format_size(n)
    if "." not in text:
        assert parse_size(text) == n


@given(st.integers(min_value=0, max_value=10**7))
def test_millisecond_durations_round_trip(ms):
    assert parse_duration(format_duration(ms / 1000)) == ms / 1000
