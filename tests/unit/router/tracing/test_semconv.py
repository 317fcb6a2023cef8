"""Span names and attributes: GenAI conventions' names, bounded types, nothing made up from bad input."""

from __future__ import annotations

from router.tracing import semconv


def test_server_span_is_named_by_operation_and_model() -> None:
    assert semconv.server_span_name("chat", "qwen") == "chat qwen"
    assert semconv.server_span_name("completions", "qwen") == "text_completion qwen"
    assert semconv.server_span_name("completions", None) == "text_completion"


def test_request_attributes_keep_only_well_typed_values() -> None:
    attrs = semconv.request_attributes(
        endpoint="completions", model=None, stream=False, max_tokens=True, request_id="r", mode="pull"
    )
    assert attrs == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "vllm",
        "kvpush.request.id": "r",
        "kvpush.mode": "pull",
        "kvpush.stream": False,
    }
    with_all = semconv.request_attributes(
        endpoint="chat", model="m", stream=True, max_tokens=8, request_id="r", mode="push"
    )
    assert with_all["gen_ai.request.model"] == "m" and with_all["gen_ai.request.max_tokens"] == 8


def test_leg_attributes_name_worker_ids_and_address() -> None:
    attrs = semconv.leg_attributes(
        leg="prefill", attempt=2, worker="http://10.0.0.5:8100", pairing_id="p", transfer_id=None, route="pull"
    )
    assert attrs["kvpush.attempt"] == 2 and attrs["gen_ai.request.id"] == "p" and "kvpush.transfer_id" not in attrs
    assert (attrs["server.address"], attrs["server.port"]) == ("10.0.0.5", 8100)
    assert semconv.address_of("https://h") == {"server.address": "h", "server.port": 443}
    assert semconv.address_of("http://h:99999") == {}


def test_outcomes_map_to_error_type() -> None:
    assert semconv.outcome_attributes("ok") == {"kvpush.outcome": "ok"}
    assert semconv.outcome_attributes("client_gone") == {"kvpush.outcome": "client_gone"}
    assert semconv.outcome_attributes("timeout", status=504) == {
        "kvpush.outcome": "timeout",
        "error.type": "timeout",
        "http.response.status_code": 504,
    }


def test_usage_maps_to_token_counts() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 8}}
    assert semconv.usage_attributes(usage) == {
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 4,
        "gen_ai.usage.cache_read.input_tokens": 8,
    }
    assert semconv.usage_attributes({"prompt_tokens": "12", "completion_tokens": None}) == {}
    assert semconv.usage_attributes(None) == {}
