"""The value checks every setting goes through: one rule per kind of value, and what each refuses."""

from __future__ import annotations

from typing import Any

import pytest

from router import values
from router.errors import ConfigError


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
        ("https://vllm.example/", "https://vllm.example"),
        (" http://[fd00::1]:8000/ ", "http://[fd00::1]:8000"),
    ],
)
def test_urls_are_http_or_https_base_urls(given: str, expected: str) -> None:
    assert values.url(given, "w") == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (None, "url is missing"),
        ("", "url is missing"),
        (8000, "url is missing"),
        ("10.0.0.1:8000", "not a base URL"),
        ("ftp://h:1", "not a base URL"),
        ("http://:8000", "not a base URL"),
        ("http://h:1/v1", "without a path"),
        ("http://h:1?x=1", "without a path"),
        ("http://h:1#frag", "without a path"),
        ("http://h:99999", "not a valid URL"),
        ("http://h:port", "not a valid URL"),
        ("http://h:0", "port 0"),
        ("http://user:pw@h:1", "must not carry credentials"),
        ("http://token@h:1", "must not carry credentials"),
        ("http://user:p@ss@h:1", "must not carry credentials"),
    ],
)
def test_bad_urls_are_refused(given: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        values.url(given, "w")
    assert str(refused.value).startswith("w: ")
    assert "pw" not in str(refused.value) and "ss@" not in str(refused.value), "credentials are never shown"


def test_only_the_given_schemes_pass() -> None:
    with pytest.raises(ConfigError, match="http://host:port"):
        values.url("https://h:1", "w", schemes=("http",))


@pytest.mark.parametrize(("given", "expected"), [(3, 3), ("3", 3), (" 7 ", 7), (4.0, 4)])
def test_integers(given: Any, expected: int) -> None:
    assert values.integer(given, "n", low=0) == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [(True, "expected an integer"), (2.5, "expected an integer"), ("x", "expected an integer"), (None, "integer")],
)
def test_booleans_fractions_and_words_are_not_integers(given: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        values.integer(given, "n", low=0)


def test_integer_ranges_name_both_ends() -> None:
    with pytest.raises(ConfigError, match=r"n: 6 is out of range \[0, 5\]"):
        values.integer(6, "n", low=0, high=5)
    with pytest.raises(ConfigError, match=r"n: 0 is out of range \[1, inf\]"):
        values.integer(0, "n", low=1)


def test_numbers_are_finite_and_in_range() -> None:
    assert values.number("0.5", "x", high=1.0) == 0.5
    for bad in (True, "nan", "inf", -1, 2, "x"):
        with pytest.raises(ConfigError, match="x: "):
            values.number(bad, "x", high=1.0)


@pytest.mark.parametrize(("given", "expected"), [(2, 2.0), ("0.25", 0.25), (1e-3, 0.001)])
def test_seconds(given: Any, expected: float) -> None:
    assert values.seconds(given, "t") == expected


@pytest.mark.parametrize("given", [0, "0", -1, True, False, "inf", "nan", "soon", None])
def test_seconds_are_positive_finite_numbers(given: Any) -> None:
    with pytest.raises(ConfigError, match="t: "):
        values.seconds(given, "t")


def test_zero_seconds_switch_a_feature_off_only_where_allowed() -> None:
    assert values.seconds(0, "t", zero_off=True) == 0.0
    assert values.seconds("0.0", "t", zero_off=True) == 0.0
    with pytest.raises(ConfigError, match=r"must be 0 \(off\) or positive"):
        values.seconds(-1, "t", zero_off=True)
    with pytest.raises(ConfigError, match="number of seconds"):
        values.seconds(False, "t", zero_off=True)  # false is not "off": it is not a number


def test_ports() -> None:
    assert values.port("8000", "p") == 8000
    assert values.port(0, "p", zero_ok=True) == 0
    for bad, message in [(0, "out of range"), (65536, "out of range"), (True, "port number"), (None, "missing")]:
        with pytest.raises(ConfigError, match=message):
            values.port(bad, "p")


def test_text_and_secrets() -> None:
    assert values.text("  llm ", "t") == "llm" and values.text(None, "t") is None
    with pytest.raises(ConfigError, match="got ''"):
        values.text("", "t")
    with pytest.raises(ConfigError, match=r"got int$"):
        values.text(12345, "t", secret=True)


def test_booleans() -> None:
    assert values.boolean(True, "b") is True and values.boolean("False", "b") is False
    for bad in (1, 0, "yes", None):
        with pytest.raises(ConfigError, match="true or false"):
            values.boolean(bad, "b")
