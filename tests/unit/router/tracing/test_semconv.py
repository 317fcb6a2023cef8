"""Span names and attributes: GenAI conventions' names, bounded types, nothing made up from bad input."""

from __future__ import annotations

from router.tracing import semconv


def test_server_span_is_named_by_operation_and_model() -> None:
    assert semconv.server_span_name("chat", "qwen") == "chat qwen"
    assert semconv.server_span_name("completions", "qwen") == "text_completion qwen"
    assert semconv.server_span_name("completions", None) == "text_completion"


def test_request_attributes_keep_only_well_typed_values() -> None:
    attrs = semconv.request_attributes(endpoint="completions", model=None, max_tokens=True, request_id="r")
    assert attrs == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "vllm",
        "kvpush.request.id": "r",
    }
    with_all = semconv.request_attributes(endpoint="chat", model="m", max_tokens=8, request_id="r")
    assert with_all["gen_ai.request.model"] == "m" and with_all["gen_ai.request.max_tokens"] == 8


def test_leg_attributes_name_the_attempt_the_id_the_worker_saw_and_its_address() -> None:
    attrs = semconv.leg_attributes(attempt=2, pairing_id="p", address=semconv.address_of("http://10.0.0.5:8100"))
    assert attrs == {
        "kvpush.attempt": 2,
        "gen_ai.request.id": "p",
        "server.address": "10.0.0.5",
        "server.port": 8100,
    }
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


def test_a_leg_adds_only_what_went_wrong() -> None:
    assert semconv.leg_failure_attributes("ok", status=200) == {}
    assert semconv.leg_failure_attributes("client_gone") == {"kvpush.outcome": "client_gone"}
    assert semconv.leg_failure_attributes("status", status=500) == {
        "error.type": "status",
        "http.response.status_code": 500,
    }


def test_end_attributes_name_route_attempts_ids_and_usage() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    assert semconv.end_attributes(route="push", attempts=2, pairing_id="p", transfer_id="t", usage=usage) == {
        "kvpush.route": "push",
        "kvpush.attempts": 2,
        "kvpush.pairing_id": "p",
        "kvpush.transfer_id": "t",
        "gen_ai.usage.input_tokens": 3,
        "gen_ai.usage.output_tokens": 2,
    }
    assert semconv.end_attributes(route="bypass", attempts=1, pairing_id=None, transfer_id=None, usage=None) == {
        "kvpush.route": "bypass",
        "kvpush.attempts": 1,
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


def test_the_client_s_model_name_is_bounded() -> None:
    long = "m" * 10_000
    assert semconv.server_span_name("chat", long) == "chat " + "m" * semconv.MAX_MODEL_CHARS
    attrs = semconv.request_attributes(endpoint="chat", model=long, max_tokens=None, request_id="r")
    assert attrs["gen_ai.request.model"] == "m" * semconv.MAX_MODEL_CHARS
    assert semconv.server_span_name("chat", {"not": "a string"}) == "chat"
    assert "gen_ai.request.model" not in semconv.request_attributes(
        endpoint="chat", model=7, max_tokens=None, request_id="r"
    )
