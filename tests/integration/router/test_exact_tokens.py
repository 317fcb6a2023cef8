"""The router's exact prompt ids (router/deciders/prompt_tokens.py) against the engine's own `/tokenize`, over a
table of chat and completions shapes, with the tiny model's tokenizer folder (issue 40, item 1).

One engine of the shared push family answers `/tokenize`: what vLLM renders and encodes for the same body.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router.deciders.prompt_tokens import PromptTokens
from router.domain import Endpoint
from tests.integration.families import UPSTREAM_PUSH, FamilyPool
from tests.integration.support import VLLM, tiny_model
from tests.integration.vllm_support import prompt_text

pytestmark = [*VLLM, pytest.mark.family(UPSTREAM_PUSH)]
SYSTEM = {"role": "system", "content": "You are a careful assistant. " + prompt_text(40)}
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "Find a word.", "parameters": {"type": "object", "properties": {}}},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "tiny"}'}}
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there"}]},
    {"messages": [SYSTEM, {"role": "user", "content": "Hi  \n\n  again <|im_end|> é ü 中文"}]},
    {"messages": [SYSTEM, {"role": "user", "content": "x"}], "add_generation_prompt": False},
    {
        "messages": [
            SYSTEM,
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": " two "}]},
        ]
    },
    {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Look it up."},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "found"}]},
            {"role": "user", "content": "Thanks."},
        ],
        "tools": [TOOL],
    },
    {
        "messages": [
            SYSTEM,
            {"role": "user", "content": prompt_text(120)},
            {"role": "assistant", "content": prompt_text(30)},
            {"role": "user", "content": "And then?"},
        ],
        "chat_template_kwargs": {"unused": True},
    },
    {"messages": [{"role": "user", "content": "special"}], "add_special_tokens": True},
    {"messages": [{"role": "user", "content": "named"}, {"role": "assistant", "content": "ok", "name": "bot"}]},
]
COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "def f(x):\n    return x  # ok"},
    {"prompt": prompt_text(200)},
    {"prompt": "no bos", "add_special_tokens": False},
    {"prompt": ["in a batch of one"]},
]


@pytest.fixture(scope="module")
def engine(family_pool: FamilyPool) -> str:
    return family_pool.get(UPSTREAM_PUSH).engines.decode.url


@pytest.fixture(scope="module")
def router_ids() -> PromptTokens:
    return PromptTokens.load(str(tiny_model()))


def _tokenize(engine: str, body: dict[str, Any]) -> list[int]:
    answer = httpx.post(f"{engine}/tokenize", json={"model": "tiny", **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    tokens = answer.json()["tokens"]
    assert isinstance(tokens, list)
    return tokens


@pytest.mark.parametrize("body", CHATS, ids=[f"chat{i}" for i in range(len(CHATS))])
def test_chat_ids_equal_the_engines(engine: str, router_ids: PromptTokens, body: dict[str, Any]) -> None:
    assert router_ids.of(Endpoint.CHAT, body) == _tokenize(engine, body)


@pytest.mark.parametrize("body", COMPLETIONS, ids=[f"completion{i}" for i in range(len(COMPLETIONS))])
def test_completion_ids_equal_the_engines(engine: str, router_ids: PromptTokens, body: dict[str, Any]) -> None:
    tokenize = dict(body)
    if isinstance(tokenize["prompt"], list):
        tokenize["prompt"] = tokenize["prompt"][0]  # /tokenize takes one prompt
    assert router_ids.of(Endpoint.COMPLETIONS, body) == _tokenize(engine, tokenize)


def test_a_conversation_grown_turn_by_turn_equals_the_engines_every_turn(engine: str, router_ids: PromptTokens) -> None:
    messages: list[dict[str, Any]] = [SYSTEM]
    for turn in range(4):
        messages = [*messages, {"role": "user", "content": f"Question {turn}: " + prompt_text(20 + turn)}]
        body = {"messages": messages}
        assert router_ids.of(Endpoint.CHAT, body) == _tokenize(engine, body)
        messages = [*messages, {"role": "assistant", "content": prompt_text(10 + turn)}]
    assert router_ids.memo_on


def test_a_completions_conversation_grown_turn_by_turn_equals_the_engines_every_turn(engine: str) -> None:
    """Each prompt extends the one before, cut mid-word, in spaces, after newlines, in digits and non-ASCII text:
    the router resumes from the previous prompt's ids (issue 40 item 1) and still gives the engine's ids."""
    router_ids = PromptTokens.load(str(tiny_model()))
    text = "Transcript.\n\n" + prompt_text(80)
    endings = ["User: hel", "lo there  ", "\n\nAssistant: 12", "345 é", "中文 ok", "\t\n  x", "'s fine", "!?\n"]
    for turn, ending in enumerate(endings):
        text += ending + prompt_text(5 + turn)[: 7 * turn]
        assert router_ids.of(Endpoint.COMPLETIONS, {"prompt": text}) == _tokenize(engine, {"prompt": text})
    assert router_ids.extended == len(endings) - 1
    assert router_ids.memo_on and router_ids.extends_on
