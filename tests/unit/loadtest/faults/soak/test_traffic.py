"""What each soak request kind may end with."""

from __future__ import annotations

import pytest

from loadtest.faults.soak.traffic import MIX, expected


@pytest.mark.parametrize(
    ("kind", "label", "ok"),
    [
        ("chat-stream", "200", True),
        ("chat-stream", "200 cut", False),
        ("completion-json", "502", False),
        ("session", "200", True),
        ("session", "no answer", False),
        ("leaver", "left", True),
        ("leaver", "200 cut", False),  # the stream ended before the client could leave
        ("bad", "400", True),
        ("bad", "422", True),
        ("bad", "400 unclear", False),  # a 4xx without an OpenAI-style error body
        ("bad", "429", False),
        ("bad", "500", False),
    ],
)
def test_each_kind_has_its_expected_outcomes(kind: str, label: str, ok: bool) -> None:
    assert kind in MIX
    assert expected(kind, label) is ok
