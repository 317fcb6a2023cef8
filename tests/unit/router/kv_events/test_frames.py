"""Frames of the other layouts (hand-built: map batches, array events, replay answers without a topic), unknown
event types, malformed and oversized frames."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.kv_events.frames import (
    END_SEQ,
    BatchDecoder,
    Cleared,
    FrameError,
    Layout,
    Message,
    Removed,
    ReplayEnd,
    Stored,
    parse_published,
    parse_replayed,
    replay_request,
)

TOPIC = b"kv"
LIMIT = 4096


def pack(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def read(payload: bytes, decoder: BatchDecoder | None = None) -> Message:
    return parse_published([TOPIC, seq(1), payload], decoder or BatchDecoder(), TOPIC, LIMIT)


STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": None,
    "lora_name": None,
}
STORED = Stored((11, 12), None, (1, 2, 3, 4), 2, None, None, False, None)


def test_a_map_batch_of_map_events() -> None:
    payload = pack({"ts": 3.0, "events": [STORED_MAP, {"type": "AllBlocksCleared"}], "data_parallel_rank": 2})
    message = read(payload)
    assert message.batch is not None
    assert message.batch.layout is Layout.MAP_MAP
    assert (message.batch.rank, message.batch.events) == (2, (STORED, Cleared()))


def test_array_events_in_declaration_order_with_extra_trailing_fields() -> None:
    events = [
        ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, None, None, None, 0, "full", None, "LOCAL"],
        ["BlockRemoved", [11], "GPU"],
        ["AllBlocksCleared"],
    ]
    for batch, layout in ((pack([1.0, events]), Layout.ARRAY_ARRAY), (pack({"ts": 1.0, "events": events}), None)):
        message = read(batch)
        assert message.batch is not None, message.fault
        assert message.batch.layout is (layout or Layout.MAP_ARRAY)
        assert message.batch.events == (
            Stored((11, 12), None, (1, 2, 3, 4), 2, None, 0, False, None),
            Removed((11,), "GPU", None),
            Cleared(),
        )


def test_array_events_of_the_oldest_shape_without_medium() -> None:
    message = read(pack([1.0, [["BlockStored", [5], 4, [7, 8], 2, None]]]))
    assert message.batch is not None
    assert message.batch.events == (Stored((5,), 4, (7, 8), 2, None, None, False, None),)


def test_an_unknown_event_type_is_skipped_and_counted() -> None:
    payload = pack([1.0, [{"type": "BlockPinned", "block_hashes": [1]}, STORED_MAP, ["Future", 1]]])
    message = read(payload)
    assert message.batch is not None
    assert (message.batch.events, message.batch.unknown) == ((STORED,), 2)


def test_the_decoder_keeps_the_layout_that_worked_first() -> None:
    decoder = BatchDecoder()
    read(pack({"ts": 1.0, "events": [STORED_MAP]}), decoder)
    message = read(pack({"ts": 2.0, "events": [STORED_MAP]}), decoder)
    assert message.batch is not None and message.batch.layout is Layout.MAP_MAP
    message = read(pack([3.0, [STORED_MAP]]), decoder)
    assert message.batch is not None and message.batch.layout is Layout.ARRAY_MAP


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack",
        pack(5),
        pack([1.0]),
        pack(["ts", []]),
        pack([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),  # fields missing
        pack([1.0, [{**STORED_MAP, "token_ids": [1, 2, 3]}]]),  # not block_size per hash
        pack([1.0, [{**STORED_MAP, "block_size": 0, "token_ids": []}]]),
        pack([1.0, [{**STORED_MAP, "block_hashes": [1.5, 2]}]]),
        pack([1.0, [7]]),
        pack([1.0, [{"no": "type"}]]),
        pack([1.0, [[3, 4]]]),
        pack([1.0, [STORED_MAP], "rank"]),
        pack([1.0, [STORED_MAP]])[:-3],  # truncated
    ],
)
def test_a_malformed_payload_keeps_its_seq_and_says_so(payload: bytes) -> None:
    message = read(payload)
    assert (message.seq, message.batch, message.fault) == (1, None, "malformed")


def test_an_oversized_payload_is_not_decoded() -> None:
    payload = pack([1.0, [{**STORED_MAP, "token_ids": list(range(2000)), "block_hashes": list(range(1000))}]])
    assert len(payload) > LIMIT
    message = read(payload)
    assert (message.seq, message.batch, message.fault) == (1, None, "oversized")


@pytest.mark.parametrize(
    "parts",
    [
        [],
        [TOPIC],
        [TOPIC, seq(1), b"x", b"y"],
        [b"other", seq(1), pack([1.0, []])],
        [TOPIC, b"\x01\x02", pack([1.0, []])],
    ],
)
def test_a_frame_without_a_readable_seq_raises(parts: list[bytes]) -> None:
    with pytest.raises(FrameError) as raised:
        parse_published(parts, BatchDecoder(), TOPIC, LIMIT)
    assert raised.value.kind == "malformed"


def test_two_part_messages_have_no_topic() -> None:
    message = parse_published([seq(9), pack([1.0, []])], BatchDecoder(), TOPIC, LIMIT)
    assert message.seq == 9 and message.batch is not None and message.batch.events == ()


def test_replay_answers_with_and_without_the_topic_frame() -> None:
    for parts in ([b"", TOPIC, seq(2), pack([1.0, []])], [b"", seq(2), pack([1.0, []])]):
        answer = parse_replayed(parts, BatchDecoder(), TOPIC, LIMIT)
        assert isinstance(answer, Message) and answer.seq == 2
    for parts in ([b"", b"", seq(END_SEQ), b""], [b"", seq(END_SEQ), b""]):
        assert isinstance(parse_replayed(parts, BatchDecoder(), TOPIC, LIMIT), ReplayEnd)


@pytest.mark.parametrize(
    "parts",
    [[], [b"x", seq(1), b""], [b""], [b"", b"a", b"b", b"c", b"d"], [b"", b"other", seq(1), b""]],
)
def test_a_replay_answer_that_cannot_be_read_raises(parts: list[bytes]) -> None:
    with pytest.raises(FrameError):
        parse_replayed(parts, BatchDecoder(), TOPIC, LIMIT)


def test_the_replay_request_is_a_delimiter_and_the_start_seq() -> None:
    assert replay_request(258) == [b"", b"\x00\x00\x00\x00\x00\x00\x01\x02"]
