import pytest

from loadtest.client import StreamTracker
from loadtest.promtext import by_label, parse
from loadtest.records import ClientRecord
from loadtest.sim import wire
from loadtest.sim.engine import LegKind


def test_kind_follows_kv_transfer_params() -> None:
    assert wire.kind_of({}) is LegKind.LOCAL
    assert wire.kind_of({"do_remote_decode": True}) is LegKind.PREFILL
    assert wire.kind_of({"do_remote_prefill": True, "remote_block_ids": [1, 2]}) is LegKind.PULL
    assert wire.kind_of({"do_remote_prefill": True, "transfer_id": "t"}) is LegKind.PUSH


def test_parse_counts_words_and_forces_one_token_on_prefill_legs() -> None:
    inc = wire.parse({"prompt": "1 2 3", "max_tokens": 9, "kv_transfer_params": {"do_remote_decode": True}}, False)
    assert (inc.prompt_tokens, inc.max_tokens, inc.kind, inc.stream) == (3, 1, LegKind.PREFILL, False)
    chat = wire.parse(
        {
            "messages": [{"role": "user", "content": "a b"}],
            "max_completion_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        True,
    )
    assert (chat.prompt_tokens, chat.max_tokens, chat.include_usage) == (2, 4, True)
    assert wire.parse({"prompt": [5, 6, 7, 8]}, False).prompt_tokens == 4
    with pytest.raises(ValueError):
        wire.parse({"prompt": "x", "kv_transfer_params": "nope"}, False)


def test_handoff_key_prefers_the_transfer_id() -> None:
    assert wire.handoff_key({"transfer_id": "t", "remote_request_id": "r"}, "h") == "t"
    assert wire.handoff_key({"remote_request_id": "r"}, "h") == "r"
    assert wire.handoff_key({}, "h") == "h"


@pytest.mark.parametrize("mode", ["pull", "push", "both"])
def test_prefill_params_state_the_connector_mode(mode: str) -> None:
    kv = wire.prefill_kv_params("P", "127.0.0.1", 9, "t", 40, 3, mode)
    assert kv["remote_engine_id"] == "P" and kv["remote_port"] == 9 and kv["remote_request_id"] == "t"
    assert kv.get("transfer_mode") == (None if mode == "both" else mode)
    assert ("remote_block_ids" in kv) == (mode != "push")


@pytest.mark.parametrize("chat", [False, True])
def test_stream_is_what_our_client_reads(chat: bool) -> None:
    body = b"".join(wire.chunk("r", "m", chat, first=i == 0, final=i == 2) for i in range(3))
    body += wire.usage_chunk("r", "m", chat, 7, 3) + wire.DONE
    t = StreamTracker(ClientRecord(0, "r"), 0.0)
    for i, line in enumerate(body.decode().split("\n")):
        t.feed(line, float(i))
    rec = t.finish(expect_output=3)
    assert rec.ok and rec.chunks == 3 and rec.prompt_tokens == 7 and t.done


def test_metrics_text_parses() -> None:
    text = wire.metrics_text("m", 2, 1, 0.5, {"external_kv_transfer": 30}, 4)
    s = parse(text)
    assert s[("vllm:num_requests_running", (("engine", "0"), ("model_name", "m")))] == 2.0
    assert by_label(s, "vllm:prompt_tokens_by_source_total", "source")["external_kv_transfer"] == 30.0
