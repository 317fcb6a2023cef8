"""The conversation key: session ids, and digest chains that a later turn shares exactly up to its first edit."""

from __future__ import annotations

from typing import Any

import pytest

from router.deciders.conversation import (
    DEFAULT_CHUNK_CHARS,
    MESSAGE_OVERHEAD_CHARS,
    PROMPT_SHAPING,
    Chain,
    chain_of,
    conversation_key,
    session_of,
)
from router.domain import Endpoint

SYSTEM = {"role": "system", "content": "You are terse."}
USER1 = {"role": "user", "content": "What is a KV cache?"}
ANSWER1 = "Saved attention keys and values."
USER2 = {"role": "user", "content": "And prefix caching?"}


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **fields}


def digests(chain: Chain) -> list[bytes]:
    return [link.digest for link in chain.links]


def shared(a: Chain, b: Chain) -> int:
    """How many leading links two chains share."""
    n = 0
    for x, y in zip(a.links, b.links, strict=False):
        if x.digest != y.digest:
            break
        n += 1
    return n


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({"x-session-id": "s1"}, {}, "s1"),
        ({"x-session-id": " s1 "}, {}, "s1"),
        ({}, {"prompt_cache_key": "k9"}, "k9"),
        ({"x-session-id": "h"}, {"prompt_cache_key": "b"}, "h"),  # the header wins
        ({"x-session-id": ""}, {"prompt_cache_key": "b"}, "b"),
        ({"x-session-id": "x" * 257}, {}, None),  # too long: ignored
        ({}, {"prompt_cache_key": 7}, None),
        ({}, {}, None),
    ],
)
def test_session_id_from_header_then_body(headers: dict[str, str], body: dict[str, Any], expected: str | None) -> None:
    assert session_of(body, headers) == expected


def test_chat_chain_has_a_head_link_and_one_link_per_message() -> None:
    chain = chain_of(Endpoint.CHAT, chat(SYSTEM, USER1))
    assert len(chain.links) == 3
    assert chain.links[0].chars == 0
    assert chain.links[1].chars == MESSAGE_OVERHEAD_CHARS + len(SYSTEM["content"])
    assert chain.chars == chain.links[2].chars == 2 * MESSAGE_OVERHEAD_CHARS + 14 + len(USER1["content"])


def test_a_turn_that_extends_the_history_shares_every_earlier_link() -> None:
    turn1 = chain_of(Endpoint.CHAT, chat(SYSTEM, USER1))
    turn2 = chain_of(Endpoint.CHAT, chat(SYSTEM, USER1, {"role": "assistant", "content": ANSWER1}, USER2))
    assert shared(turn1, turn2) == len(turn1.links)
    held = turn1.extend(ANSWER1)  # what the decode worker holds after generating ANSWER1
    assert shared(held, turn2) == len(held.links) == 4


@pytest.mark.parametrize(
    "sent_back",
    [
        "Saved attention keys and values. ",  # whitespace added
        "saved attention keys and values.",  # edited
        "Saved attention keys",  # truncated
    ],
)
def test_an_answer_sent_back_altered_matches_only_up_to_the_previous_message(sent_back: str) -> None:
    """The strict-prefix rule (vLLM #43094): credit only text that is exactly what the worker holds."""
    held = chain_of(Endpoint.CHAT, chat(SYSTEM, USER1)).extend(ANSWER1)
    turn2 = chain_of(Endpoint.CHAT, chat(SYSTEM, USER1, {"role": "assistant", "content": sent_back}, USER2))
    assert shared(held, turn2) == 3


def test_reasoning_stripped_from_the_answer_is_not_credited() -> None:
    generated = "<think>keys, values</think>Saved attention keys and values."
    held = chain_of(Endpoint.CHAT, chat(USER1)).extend(generated)
    turn2 = chain_of(Endpoint.CHAT, chat(USER1, {"role": "assistant", "content": ANSWER1}, USER2))
    assert shared(held, turn2) == 2


def test_editing_the_middle_of_the_history_breaks_the_chain_there() -> None:
    original = chat(SYSTEM, USER1, {"role": "assistant", "content": ANSWER1}, USER2)
    edited = chat(SYSTEM, {"role": "user", "content": "What is a KV-cache?"}, original["messages"][2], USER2)
    assert shared(chain_of(Endpoint.CHAT, original), chain_of(Endpoint.CHAT, edited)) == 2


def test_sdk_style_null_fields_do_not_break_the_match_but_other_fields_do() -> None:
    held = chain_of(Endpoint.CHAT, chat(USER1)).extend(ANSWER1)
    nulls = {"role": "assistant", "content": ANSWER1, "tool_calls": None, "refusal": None}
    named = {"role": "assistant", "content": ANSWER1, "name": "bot"}
    assert shared(held, chain_of(Endpoint.CHAT, chat(USER1, nulls, USER2))) == 3
    assert shared(held, chain_of(Endpoint.CHAT, chat(USER1, named, USER2))) == 2


def test_key_order_inside_a_message_does_not_matter() -> None:
    a = chain_of(Endpoint.CHAT, chat({"role": "user", "content": "hi"}))
    b = chain_of(Endpoint.CHAT, chat({"content": "hi", "role": "user"}))
    assert digests(a) == digests(b)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("model", "other"),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "none"),
        ("chat_template_kwargs", {"enable_thinking": False}),
        ("add_generation_prompt", False),
        ("cache_salt", "tenant-2"),
        ("reasoning_effort", "high"),
    ],
)
def test_every_prompt_shaping_field_changes_the_whole_chain(name: str, value: Any) -> None:
    assert name in PROMPT_SHAPING
    base = chat(SYSTEM, USER1)
    changed = dict(base, **{name: value})
    assert shared(chain_of(Endpoint.CHAT, base), chain_of(Endpoint.CHAT, changed)) == 0


@pytest.mark.parametrize(("name", "value"), [("temperature", 0.7), ("max_tokens", 9), ("stream", True), ("seed", 3)])
def test_sampling_fields_do_not_change_the_chain(name: str, value: Any) -> None:
    base = chat(SYSTEM, USER1)
    assert digests(chain_of(Endpoint.CHAT, base)) == digests(chain_of(Endpoint.CHAT, dict(base, **{name: value})))


def test_the_chat_and_completions_chains_never_share_a_link() -> None:
    text = "x" * 600
    a = chain_of(Endpoint.COMPLETIONS, {"model": "m", "prompt": text})
    b = chain_of(Endpoint.CHAT, chat({"role": "user", "content": text}))
    assert not set(digests(a)) & set(digests(b))


def test_tools_count_towards_the_head_characters() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert chain_of(Endpoint.CHAT, chat(USER1, tools=tools)).links[0].chars > 40


def test_completions_chain_has_one_link_per_whole_chunk_and_keeps_the_tail() -> None:
    chain = chain_of(Endpoint.COMPLETIONS, {"model": "m", "prompt": "a" * 25}, chunk_chars=10)
    assert [link.chars for link in chain.links] == [0, 10, 20]
    assert chain.tail == "aaaaa" and chain.chars == 25


def test_completions_turn_two_shares_the_chunks_of_prompt_plus_answer() -> None:
    prompt, answer, more = "p" * 23, "ANSWER-ONE", "\nUser: next?\n"
    held = chain_of(Endpoint.COMPLETIONS, {"model": "m", "prompt": prompt}, 10).extend(answer)
    assert [link.chars for link in held.links] == [0, 10, 20, 30] and held.tail == "ONE"
    turn2 = chain_of(Endpoint.COMPLETIONS, {"model": "m", "prompt": prompt + answer + more}, 10)
    assert shared(held, turn2) == 4
    other = chain_of(Endpoint.COMPLETIONS, {"model": "m", "prompt": prompt + "answer-one" + more}, 10)
    assert shared(held, other) == 3  # the chunk holding the altered answer breaks the chain


def test_a_batch_of_one_prompt_keys_like_the_prompt_and_token_ids_give_no_chain() -> None:
    one = chain_of(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["q" * 300]})
    assert digests(one) == digests(chain_of(Endpoint.COMPLETIONS, {"model": "m", "prompt": "q" * 300}))
    ids = chain_of(Endpoint.COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]})
    assert ids.links == () and ids.chars == 0 and ids.extend("x") == ids


def test_chunk_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunk_chars"):
        chain_of(Endpoint.COMPLETIONS, {"model": "m", "prompt": "x"}, chunk_chars=0)


def test_conversation_key_combines_session_and_chain() -> None:
    body = chat(USER1, prompt_cache_key="conv-7")
    key = conversation_key(Endpoint.CHAT, body, {})
    assert key.session == "conv-7"
    assert digests(key.chain) == digests(chain_of(Endpoint.CHAT, body, DEFAULT_CHUNK_CHARS))
