"""The prompt-ids cost probe (idcost.py) follows a conversation past each size and times what a router does."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.bench.suites.multiturn import idcost
from router.deciders.prompt_tokens import PromptTokens
from tests.unit.router.deciders.test_prompt_tokens import folder


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_each_size_is_taken_once_at_the_first_turn_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    monkeypatch.setattr(idcost, "SIZES", (300, 900))
    model = folder(tmp_path)
    tokens = PromptTokens.load(str(model))
    found = idcost.conversation(tokens, api, 1, model)
    assert sorted(found) == [300, 900]
    assert all(found[size]["tokens"] >= size for size in found)
    assert all(v["next_turn_ms"] >= 0 and v["nothing_remembered_ms"] >= 0 for v in found.values())
    assert (tokens.extended > 0) == (api == "completions")  # a transcript extends the one before
