"""Body shaping for both legs and both endpoints, id minting and request validation."""

from __future__ import annotations

from typing import Any, cast

import pytest

from router import protocol
from router.domain import Endpoint, NixlIdentity
from router.errors import BadRequest

IDENTITY = NixlIdentity(engine_id="p0", host="10.1.2.3", port=5600, tp_size=2, pp_size=1)
COMPLETION = {
    "model": "tiny",
    "prompt": "hello world",
    "max_tokens": 16,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 4,
    "temperature": 0,
}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8, "stream": False}


def test_minted_ids_are_fresh_and_safe_for_vllm_base_id_pairing() -> None:
    seen = {protocol.mint_ids() for _ in range(200)}
    assert len({i.request_id for i in seen}) == 200
    assert len({i.transfer_id for i in seen}) == 200
    assert all(protocol.is_safe_request_id(i.request_id) for i in seen)


@pytest.mark.parametrize(
    ("request_id", "safe"),
    [("abc-0123abcd", False), ("abc-0123abcg", True), ("kvp-0123456789abcdef", True), ("x-deadbeef", False)],
)
def test_unsafe_request_ids_are_the_ones_vllm_would_strip(request_id: str, safe: bool) -> None:
    assert protocol.is_safe_request_id(request_id) is safe


@pytest.mark.parametrize(("endpoint", "body"), [(Endpoint.COMPLETIONS, COMPLETION), (Endpoint.CHAT, CHAT)])
def test_prefill_leg_is_one_unstreamed_token_asking_for_remote_decode(endpoint: Endpoint, body: dict[str, Any]) -> None:
    out = protocol.prefill_body(body, endpoint, "xfer-1")
    assert out["max_tokens"] == 1
    assert out["stream"] is False
    assert "stream_options" not in out and "min_tokens" not in out
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": "xfer-1",
    }
    assert out.get("max_completion_tokens", 1) == 1
    assert {k: v for k, v in out.items() if k not in _SHAPED} == {k: v for k, v in body.items() if k not in _SHAPED}


_SHAPED = {"max_tokens", "max_completion_tokens", "stream", "stream_options", "min_tokens", "kv_transfer_params"}


def test_chat_prefill_also_caps_max_completion_tokens() -> None:
    assert protocol.prefill_body(CHAT, Endpoint.CHAT, "t")["max_completion_tokens"] == 1


def test_shaping_never_mutates_the_client_body() -> None:
    before = repr(COMPLETION)
    protocol.prefill_body(COMPLETION, Endpoint.COMPLETIONS, "t")
    protocol.push_decode_body(COMPLETION, IDENTITY, protocol.PairingIds("r", "t"))
    protocol.pull_decode_body(COMPLETION, {"remote_block_ids": [[1]]})
    assert repr(COMPLETION) == before


def test_push_decode_leg_is_the_client_request_plus_the_prefill_identity() -> None:
    ids = protocol.PairingIds(request_id="kvp-1", transfer_id="xfer-1")
    out = protocol.push_decode_body(COMPLETION, IDENTITY, ids)
    assert {k: v for k, v in out.items() if k != "kv_transfer_params"} == COMPLETION
    assert out["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p0",
        "remote_host": "10.1.2.3",
        "remote_port": 5600,
        "tp_size": 2,
        "pp_size": 1,
        "remote_request_id": "kvp-1",
        "transfer_id": "xfer-1",
    }


def test_pull_decode_leg_carries_prefill_params_verbatim() -> None:
    params: protocol.KvTransferParams = {
        "do_remote_prefill": True,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "e",
    }
    out = protocol.pull_decode_body(CHAT, params)
    assert out["kv_transfer_params"] == params
    assert out["kv_transfer_params"] is not params


def test_identity_is_read_from_a_prefill_answer() -> None:
    stated = {"remote_engine_id": "e1", "remote_host": "h", "remote_port": 5601, "tp_size": 4, "pp_size": None}
    params = cast(protocol.KvTransferParams, stated)  # as a worker may send it: pp_size null
    assert protocol.identity_from(params) == NixlIdentity("e1", "h", 5601, 4, 1)
    assert protocol.identity_from({"remote_engine_id": "e1"}) is None
    assert protocol.kv_params_of({"kv_transfer_params": params}) == params
    assert protocol.kv_params_of({"kv_transfer_params": None}) is None


@pytest.mark.parametrize(
    ("endpoint", "body", "message"),
    [
        (Endpoint.COMPLETIONS, [], "JSON object"),
        (Endpoint.COMPLETIONS, {"prompt": "x"}, "'model'"),
        (Endpoint.COMPLETIONS, {"model": "", "prompt": "x"}, "'model'"),
        (Endpoint.COMPLETIONS, {"model": "m"}, "'prompt'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": ""}, "'prompt'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": 5}, "'prompt'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": ["a", ""]}, "prompt[1]"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": [[1], [True]]}, "prompt[1]"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": ["a", 5]}, "prompt[1]"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": ["a"] * 65}, "limit of 64"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "stream": "yes"}, "'stream'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 0}, "'max_tokens'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": "5"}, "'max_tokens'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "n": 17}, "'n'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "n": 2, "temperature": 0}, "greedy"),
        (Endpoint.CHAT, {"model": "m", "messages": [{"role": "u"}], "n": 2, "temperature": 0.0}, "greedy"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "n": 0}, "'n'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "n": True}, "'n'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "n": 1.0}, "'n'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "best_of": 2}, "'best_of'"),
        (Endpoint.CHAT, {"model": "m", "messages": [{"role": "u", "content": "x"}], "best_of": 3}, "'best_of'"),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
        (Endpoint.CHAT, {"model": "m"}, "'messages'"),
        (Endpoint.CHAT, {"model": "m", "messages": []}, "'messages'"),
        (Endpoint.CHAT, {"model": "m", "messages": ["hi"]}, "messages[0]"),
        (Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": 3}]}, "content"),
        (Endpoint.CHAT, {"model": "m", "messages": [{"content": "x"}]}, "role"),
        (
            Endpoint.CHAT,
            {"model": "m", "messages": [{"role": "u", "content": "x"}], "stream_options": 1},
            "stream_options",
        ),
    ],
)
def test_invalid_requests_are_rejected_with_a_clear_message(endpoint: Endpoint, body: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        protocol.parse_request(endpoint, body)


@pytest.mark.parametrize(
    ("body", "param"),
    [({"n": 99}, "n"), ({"n": -1}, "n"), ({"n": "1"}, "n"), ({"best_of": 2}, "best_of"), ({"best_of": 0}, "best_of")],
)
def test_a_refused_sampling_field_is_named_as_the_errors_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        protocol.parse_request(Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", **body})
    assert refused.value.to_body()["error"]["param"] == param
    assert refused.value.http_status == 400


@pytest.mark.parametrize(
    "choices", [{"n": None}, {"n": 1}, {"best_of": None}, {"best_of": 1}, {"n": None, "best_of": 1}]
)
def test_n_null_is_one_choice_and_best_of_null_or_one_is_none(choices: dict[str, Any]) -> None:
    assert protocol.parse_request(Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", **choices}).prompt_tokens == 1


@pytest.mark.parametrize(
    ("endpoint", "fields", "why"),
    [
        (Endpoint.COMPLETIONS, {"use_beam_search": True}, "beam search"),
        (Endpoint.CHAT, {"use_beam_search": True}, "beam search"),
        (Endpoint.COMPLETIONS, {"prompt_logprobs": 0}, "prompt logprobs"),
        (Endpoint.CHAT, {"prompt_logprobs": 1}, "prompt logprobs"),
        (Endpoint.COMPLETIONS, {"echo": True, "logprobs": 0}, "echo"),
        (Endpoint.CHAT, {"echo": True, "top_logprobs": 2}, "echo"),
        (Endpoint.COMPLETIONS, {"use_beam_search": False}, None),
        (Endpoint.COMPLETIONS, {"echo": True}, None),
        (Endpoint.COMPLETIONS, {"logprobs": 3}, None),
        (Endpoint.CHAT, {"echo": True, "logprobs": True}, None),
        (Endpoint.COMPLETIONS, {"prompt_logprobs": None}, None),
    ],
)
def test_requests_vllm_computes_the_prompt_for_on_decode_are_decode_only(
    endpoint: Endpoint, fields: dict[str, Any], why: str | None
) -> None:
    reason = protocol.decode_only(endpoint, {"model": "m", **fields})
    assert reason == why if why is None else (reason is not None and why in reason)


def test_n_is_bounded_by_the_routers_limit() -> None:
    body = {"model": "m", "prompt": "x", "n": 4}
    assert protocol.choices(body) == 4 and protocol.choices({"n": None}) == 1 and protocol.choices({}) == 1
    protocol.parse_request(Endpoint.COMPLETIONS, body, max_n=4)
    with pytest.raises(BadRequest, match="limit of 3"):
        protocol.parse_request(Endpoint.COMPLETIONS, body, max_n=3)


@pytest.mark.parametrize("endpoint", [Endpoint.COMPLETIONS, Endpoint.CHAT])
def test_the_first_token_pair_of_n_choices_asks_one_unstreamed_token(endpoint: Endpoint) -> None:
    body = {"model": "m", "n": 3, "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    out = protocol.first_token_body({**body, "min_tokens": 2, "seed": 7}, endpoint)
    assert out["n"] == 1 and out["max_tokens"] == 1 and out["stream"] is False and out["seed"] == 7
    assert "stream_options" not in out and "min_tokens" not in out and "kv_transfer_params" not in out
    assert ("max_completion_tokens" in out) is (endpoint is Endpoint.CHAT)
    assert body["n"] == 3  # the client's body is not touched


def test_a_batch_is_each_prompt_validated_and_its_tokens_summed() -> None:
    body = {"model": "m", "prompt": ["x" * 40, [1, 2, 3]]}
    assert protocol.parse_request(Endpoint.COMPLETIONS, body).prompt_tokens == 13
    assert protocol.batch_of(body) == ["x" * 40, [1, 2, 3]]
    assert protocol.batch_of({"prompt": [1, 2]}) is None and protocol.batch_of({"prompt": "x"}) is None
    with pytest.raises(BadRequest, match="limit of 1") as refused:
        protocol.parse_request(Endpoint.COMPLETIONS, body, max_batch=1)
    assert refused.value.param == "prompt"


def test_valid_requests_give_selection_facts() -> None:
    info = protocol.parse_request(Endpoint.COMPLETIONS, {"model": "m", "prompt": [1, 2, 3], "stream": True})
    assert (info.prompt_tokens, info.stream) == (3, True)
    info = protocol.parse_request(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["x" * 400]})
    assert info.prompt_tokens == 100
    parts = [{"type": "text", "text": "y" * 40}]
    info = protocol.parse_request(Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": parts}]})
    assert info.prompt_tokens == 10


@pytest.mark.parametrize(
    "raw",
    [
        b'{"t": NaN}',
        b'{"t": Infinity}',
        b'{"t": -Infinity}',
        b'{"p": "\\ud800"}',
        b'{"p": "\\udfff x"}',
        b'{"n": 1e999}',
        b'{"x": ' + b"[" * 65 + b"]" * 65 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_hostile_json_is_a_bad_request(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        protocol.decode_body(raw, max_depth=64)


def test_json_nested_up_to_the_limit_and_brackets_in_strings_are_fine() -> None:
    deep = protocol.decode_body(b'{"x": ' + b"[" * 63 + b"]" * 63 + b"}", max_depth=64)["x"]
    for _ in range(62):
        (deep,) = deep
    assert deep == []
    assert protocol.decode_body(b'{"p": "' + b"[" * 500 + b'"}', max_depth=64) == {"p": "[" * 500}


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("client-7", True),
        ("A-z0.9_:" * 16, True),
        ("r" * 129, False),
        ("has space", False),
        ("é", False),
        (None, False),
    ],
)
def test_a_client_request_id_is_kept_only_when_short_and_plain(given: str | None, kept: bool) -> None:
    out = protocol.client_request_id(given, 128)
    assert (out == given) is kept
    assert protocol.client_request_id(given, 128) != out or kept  # a replacement is fresh each time


def test_token_ids_are_asked_for_read_and_scrubbed_back_to_null() -> None:
    body = {"model": "m", "prompt": "x"}
    assert protocol.asking_token_ids(body) == {**body, "return_token_ids": True} and "return_token_ids" not in body
    assert protocol.asks_token_ids({"return_token_ids": True}) and not protocol.asks_token_ids(body)
    assert protocol.token_ids_of({"choices": [{"text": "a", "token_ids": [3, 4]}]}) == [3, 4]
    carries_none: list[dict[str, Any]] = [
        {"choices": []},
        {"choices": [{"token_ids": None}]},
        {"choices": [{"token_ids": [True]}]},
    ]
    for answer in carries_none:
        assert protocol.token_ids_of(answer) is None
    event = b'data: {"choices":[{"delta":{"content":"\\"token_ids\\":[1]"},"token_ids":[5,6]}],'
    event += b'"prompt_token_ids":[1]}\n\n'
    assert protocol.scrub_token_ids(event) == (
        b'data: {"choices":[{"delta":{"content":"\\"token_ids\\":[1]"},"token_ids":null}],"prompt_token_ids":null}\n\n'
    )  # what the model wrote inside a string is left alone
    assert protocol.scrub_token_ids(b'{"token_ids": [1, 2]}') == b'{"token_ids": null}'
    assert protocol.scrub_token_ids(b'{"text":"no ids"}') == b'{"text":"no ids"}'
