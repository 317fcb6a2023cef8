"""Frames built with vLLM's own event classes and encoded the way its ZMQ publisher encodes them (0.32's layout:
an array batch of events tagged by "type")."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.kv_events.frames import (
    BatchDecoder,
    Cleared,
    Layout,
    Message,
    Removed,
    ReplayEnd,
    Stored,
    parse_published,
    parse_replayed,
)

kv = pytest.importorskip("vllm.distributed.kv_events", reason="frames built by vLLM itself")

TOPIC = b"kv"
HASH_A = bytes(range(32))
HASH_B = bytes(range(1, 33))


def published(batch: Any, seq: int, topic: bytes = TOPIC) -> list[bytes]:
    """What ZmqEventPublisher sends on its PUB socket for one batch."""
    return [topic, seq.to_bytes(8, "big"), msgspec.msgpack.Encoder().encode(batch)]


def stored(hashes: list[Any], parent: Any, tokens: list[int], size: int, **extra: Any) -> Any:
    return kv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        lora_id=extra.pop("lora_id", None),
        medium=extra.pop("medium", "GPU"),
        lora_name=extra.pop("lora_name", None),
        **extra,
    )


def decode(parts: list[bytes]) -> Message:
    message = parse_published(parts, BatchDecoder(), TOPIC, 1 << 20)
    assert isinstance(message, Message)
    return message


def test_a_batch_of_each_event_type_round_trips() -> None:
    batch = kv.KVEventBatch(
        ts=12.5,
        events=[
            stored([HASH_A, HASH_B], None, [1, 2, 3, 4], 2, group_idx=0, session_id="s-1"),
            kv.BlockRemoved(block_hashes=[HASH_A], medium="GPU", group_idx=0),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    message = decode(published(batch, 7))
    assert message.seq == 7 and message.fault is None
    assert message.batch is not None
    assert message.batch.layout is Layout.ARRAY_MAP
    assert (message.batch.ts, message.batch.rank, message.batch.unknown) == (12.5, 1, 0)
    assert message.batch.events == (
        Stored((HASH_A, HASH_B), None, (1, 2, 3, 4), 2, "GPU", 0, False, "s-1"),
        Removed((HASH_A,), "GPU", 0),
        Cleared(),
    )


def test_int_block_hashes_and_a_parent() -> None:
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: 64-bit ints instead of 32 bytes."""
    batch = kv.KVEventBatch(ts=1.0, events=[stored([2**64 - 1], 5, [9, 9], 2)])
    message = decode(published(batch, 0))
    assert message.batch is not None
    assert message.batch.events == (Stored((2**64 - 1,), 5, (9, 9), 2, "GPU", None, False, None),)


def test_the_publishers_rank_is_filled_in_by_publish() -> None:
    """publish() sets data_parallel_rank when the batch has none; an unset rank is omitted (omit_defaults)."""
    batch = kv.KVEventBatch(ts=1.0, events=[kv.AllBlocksCleared()])
    message = decode(published(batch, 3))
    assert message.batch is not None and message.batch.rank is None


@pytest.mark.parametrize(
    ("extra", "keyed"),
    [
        ({}, False),
        ({"extra_keys": [None]}, False),
        ({"extra_keys": [("salt",)]}, True),
        ({"extra_keys": [(("mm-hash", 0),)]}, True),
        ({"lora_name": "adapter", "lora_id": 3}, True),
    ],
)
def test_blocks_hashed_with_more_than_tokens_are_keyed(extra: dict[str, Any], keyed: bool) -> None:
    batch = kv.KVEventBatch(ts=1.0, events=[stored([HASH_A], None, [1, 2], 2, **extra)])
    message = decode(published(batch, 0))
    assert message.batch is not None
    event = message.batch.events[0]
    assert isinstance(event, Stored) and event.keyed is keyed


def test_fields_the_decoder_does_not_know_are_ignored() -> None:
    batch = kv.KVEventBatch(
        ts=1.0,
        events=[
            stored(
                [HASH_A],
                None,
                [1, 2],
                2,
                kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=4,
                locality="LOCAL",
                ownership="tier-2",
                medium="CPU",
            )
        ],
    )
    message = decode(published(batch, 0))
    assert message.batch is not None
    event = message.batch.events[0]
    assert isinstance(event, Stored) and event.medium == "CPU"


def test_replay_answers_and_the_end_marker() -> None:
    """What a DEALER reads from the replay ROUTER: ("", topic, seq, payload), then ("", "", -1, "")."""
    batch = kv.KVEventBatch(ts=1.0, events=[kv.AllBlocksCleared()])
    payload = msgspec.msgpack.Encoder().encode(batch)
    answer = parse_replayed([b"", TOPIC, (4).to_bytes(8, "big"), payload], BatchDecoder(), TOPIC, 1 << 20)
    assert isinstance(answer, Message) and answer.seq == 4
    assert answer.batch is not None and answer.batch.events == (Cleared(),)
    end = parse_replayed([b"", b"", kv.ZmqEventPublisher.END_SEQ, b""], BatchDecoder(), TOPIC, 1 << 20)
    assert isinstance(end, ReplayEnd)
