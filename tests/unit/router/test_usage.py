"""True usage through P/D: P's cached count read from its answer, and decode's answer rewritten with it."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router import usage

USAGE = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 10}}


@pytest.mark.parametrize(
    ("answer", "cached"),
    [
        ({"kv_transfer_params": {"remote_prefill_cached_tokens": 4}, "usage": USAGE}, 4),
        ({"kv_transfer_params": {"remote_prefill_cached_tokens": 0}}, 0),
        ({"kv_transfer_params": {}, "usage": {"prompt_tokens_details": {"cached_tokens": 7}}}, 7),
        ({"kv_transfer_params": {"remote_prefill_cached_tokens": True}, "usage": {}}, None),
        ({"kv_transfer_params": None, "usage": {"prompt_tokens_details": None}}, None),
        ({"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}, None),
        ([], None),
    ],
)
def test_ps_count_comes_from_its_params_else_its_usage(answer: Any, cached: int | None) -> None:
    assert usage.prefill_cached(answer) == cached


def test_pull_relays_the_count_when_ps_params_carry_it() -> None:
    assert usage.relays_cached({"remote_prefill_cached_tokens": 3})
    assert not usage.relays_cached({"remote_block_ids": [1]})


@pytest.mark.parametrize(
    ("body", "wants"),
    [
        ({}, True),
        ({"stream": False}, True),
        ({"stream": True}, False),
        ({"stream": True, "stream_options": {"include_usage": False}}, False),
        ({"stream": True, "stream_options": {"include_usage": True}}, True),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, True),
        ({"stream": True, "stream_options": None}, False),
    ],
)
def test_only_answers_that_carry_usage_are_looked_at(body: dict[str, Any], wants: bool) -> None:
    assert usage.wants_usage(body) is wants


def test_a_whole_answer_gets_ps_count_and_nothing_else_changes() -> None:
    text = 'the model wrote \\"cached_tokens\\":99 here'
    raw = json.dumps({"choices": [{"text": text}], "usage": USAGE}, separators=(",", ":")).encode()
    out = json.loads(usage.with_cached(raw, 2))
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert out["choices"][0]["text"] == text and out["usage"]["prompt_tokens"] == 10
    spaced = json.dumps({"usage": USAGE}).encode()  # ": " separators
    assert json.loads(usage.with_cached(spaced, 0))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_when_p_did_not_say_the_details_are_null_not_decodes_count() -> None:
    raw = json.dumps({"usage": USAGE}).encode()
    out = json.loads(usage.with_cached(raw, None))
    assert out["usage"]["prompt_tokens_details"] is None and out["usage"]["prompt_tokens"] == 10
    assert (
        usage.with_cached(b'{"usage":{"prompt_tokens_details":null}}', 3) == b'{"usage":{"prompt_tokens_details":null}}'
    )


def test_the_parsed_usage_follows_the_same_rule() -> None:
    assert usage.fixed_usage(USAGE, 1) == {**USAGE, "prompt_tokens_details": {"cached_tokens": 1}}
    assert usage.fixed_usage(USAGE, None) == {**USAGE, "prompt_tokens_details": None}
    assert usage.fixed_usage({"prompt_tokens": 1}, 5) == {"prompt_tokens": 1}
    assert usage.fixed_usage(None, 5) is None


def stream_of(*usages: dict[str, Any]) -> bytes:
    events = [b'data: {"choices":[{"text":"a"}]}\n\n']
    events += [b"data: " + json.dumps({"choices": [], "usage": u}).encode() + b"\n\n" for u in usages]
    return b"".join([*events, b"data: [DONE]\n\n"])


async def relay(fix: usage.CachedFix, chunks: list[bytes]) -> bytes:
    out = []
    for chunk in chunks:
        got = fix.feed(chunk)
        if got is None:
            await fix.resolve()
            got = fix.feed(b"")
        out.append(got or b"")
    return b"".join([*out, await fix.flush()])


@given(st.lists(st.integers(min_value=1, max_value=400), max_size=8))
def test_a_stream_cut_anywhere_comes_out_whole_with_ps_count(cuts: list[int]) -> None:
    stream = stream_of(USAGE, USAGE)
    points = sorted({c % len(stream) for c in cuts} | {0, len(stream)})
    chunks = [stream[a:b] for a, b in itertools.pairwise(points)]
    asked = []

    async def source() -> int | None:
        asked.append(1)
        return 4

    got = asyncio.run(relay(usage.CachedFix(source), chunks))
    assert got == stream.replace(b'"cached_tokens": 10', b'"cached_tokens": 4')
    assert asked == [1]


async def test_chunks_without_a_count_pass_as_they_came_without_asking_p() -> None:
    async def source() -> int | None:
        raise AssertionError("P's count is not needed")

    fix = usage.CachedFix(source)
    chunk = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert fix.feed(chunk) is chunk
    assert fix.feed(b'data: {"choi') == b"" and fix.feed(b'ces":[]}\n\n') == b'data: {"choices":[]}\n\n'
    assert fix.feed(b"data: [DONE]") == b"" and await fix.flush() == b"data: [DONE]"
