"""Batched prompts merged as vLLM merges them: indices i·n + k, usage summed, one usage event, one [DONE]."""

from __future__ import annotations

import json
from typing import Any

from router import batch


def answer(prompt: int, n: int, cached: int | None) -> bytes:
    choices = [{"index": k, "text": f"p{prompt}c{k}"} for k in range(n)]
    details = None if cached is None else {"cached_tokens": cached}
    usage = {"prompt_tokens": 10, "completion_tokens": 2 * n, "total_tokens": 10 + 2 * n}
    body = {"id": f"cmpl-{prompt}", "choices": choices, "usage": {**usage, "prompt_tokens_details": details}}
    return json.dumps({**body, "kv_transfer_params": None}).encode()


def test_json_answers_merge_in_prompt_order_with_vllms_indices_and_summed_usage() -> None:
    merged = json.loads(batch.merge_json([answer(0, 2, 3), answer(1, 2, 0)], 2))
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "p0c0"), (1, "p0c1"), (2, "p1c0"), (3, "p1c1")]
    assert merged["id"] == "cmpl-0" and "kv_transfer_params" not in merged
    assert merged["usage"] == {
        "prompt_tokens": 20,
        "completion_tokens": 8,
        "total_tokens": 28,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_a_prompt_without_a_cached_count_makes_the_sum_unknown() -> None:
    merged = json.loads(batch.merge_json([answer(0, 1, 3), answer(1, 1, None)], 1))
    assert merged["usage"]["prompt_tokens_details"] is None


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_stream_events_are_reindexed_under_one_id_and_the_usage_sent_once_last() -> None:
    merge = batch.StreamMerge(2, 1)
    out = [
        merge.event(1, event({"id": "b", "choices": [{"index": 0, "text": "x"}]})),
        merge.event(0, event({"id": "a", "choices": [{"index": 0, "text": "y"}]})),
        merge.event(0, event({"id": "a", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}})),
        merge.event(0, batch.DONE),
        merge.event(1, event({"id": "b", "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 1}})),
        merge.event(1, b": keep-alive\n\n"),
    ]
    assert out[2:4] == [b"", b""] and out[4] == b"" and out[5] == b": keep-alive\n\n"
    first, second = (json.loads(o[6:]) for o in out[:2])
    assert (first["id"], first["choices"][0]["index"]) == ("b", 1)
    assert (second["id"], second["choices"][0]["index"]) == ("b", 0)
    *usage, done = merge.end().split(b"\n\n")[:-1]
    assert done == b"data: [DONE]"
    assert json.loads(usage[0][6:])["usage"] == {"prompt_tokens": 10, "completion_tokens": 2}


def test_error_events_pass_and_a_stream_without_usage_ends_with_done_alone() -> None:
    merge = batch.StreamMerge(2, 1)
    error = event({"error": {"message": "boom"}})
    assert merge.event(1, error) == error
    assert merge.end() == batch.DONE
