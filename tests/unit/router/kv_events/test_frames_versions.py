"""Frames of each vLLM version's event shapes, built from msgspec structs declared here field by field as each
version declares them (vllm/distributed/kv_events.py: 0.32.0; 0.33.0 and 0.34.0, identical, add
`BlockStored.lookahead_token_ids`; vllm#48933, open, proposes `BlockRemoved.remaining_copy_counts`) and encoded as
vLLM's publisher encodes them: an array batch of map events tagged by "type", default fields omitted."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.kv_events.frames import BatchDecoder, Layout, Removed, Stored, parse_published

TOPIC = b"kv"
HASH_A = bytes(range(32))
HASH_B = bytes(range(1, 33))


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored032(_Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _Stored033(_Stored032, tag="BlockStored"):  # 0.34.0's is the same
    lookahead_token_ids: list[list[int]] | None = None


class _Removed032(_Event, tag="BlockRemoved"):  # 0.33.0 and 0.34.0 alike
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _Removed48933(_Removed032, tag="BlockRemoved"):
    remaining_copy_counts: list[int] | None = None


def decode(*events: Any) -> tuple[Any, ...]:
    payload = msgspec.msgpack.encode(_Batch(2.0, list(events), 0))
    message = parse_published([TOPIC, (4).to_bytes(8, "big"), payload], BatchDecoder(), TOPIC, 1 << 20)
    assert message.batch is not None, message.fault
    assert message.batch.layout is Layout.ARRAY_MAP
    return message.batch.events


def stored_032(**extra: Any) -> _Stored032:
    return _Stored032([HASH_A, HASH_B], None, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0, **extra)


def stored_033(lookahead: Any, **extra: Any) -> _Stored033:
    return _Stored033(
        [HASH_A, HASH_B], None, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0, lookahead_token_ids=lookahead, **extra
    )


TOKEN_ONLY = Stored((HASH_A, HASH_B), None, (1, 2, 3, 4), 2, "GPU", 0, False, None)


def test_0_32_blocks_have_no_lookahead() -> None:
    assert decode(stored_032(session_id="s")) == (
        Stored((HASH_A, HASH_B), None, (1, 2, 3, 4), 2, "GPU", 0, False, "s", None),
    )


def test_0_33_blocks_without_lookahead_hashing_read_as_0_32_s() -> None:
    assert decode(stored_033(None)) == (TOKEN_ONLY,)


def test_0_33_blocks_hashed_with_lookahead_carry_it_per_block() -> None:
    (event,) = decode(stored_033([[3, 4], [5, 6]]))
    assert isinstance(event, Stored)
    assert (event.lookahead, event.keyed) == (((3, 4), (5, 6)), False)
    (event,) = decode(stored_033([[], [5]]))  # the engine's last block: fewer tokens known after it
    assert isinstance(event, Stored) and event.lookahead == ((), (5,))


@pytest.mark.parametrize("lookahead", [[[3, 4]], [[3, 4], None], [[3, "x"], [5, 6]], [3, 4]])
def test_a_lookahead_of_another_shape_makes_the_blocks_keyed(lookahead: Any) -> None:
    """The hash covered something besides the block's tokens that we cannot read: never matched."""
    wire = _Stored033([HASH_A, HASH_B], None, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0)
    raw = msgspec.to_builtins(wire, builtin_types=(bytes,)) | {"lookahead_token_ids": lookahead}
    payload = msgspec.msgpack.encode([2.0, [raw], 0])
    message = parse_published([TOPIC, (4).to_bytes(8, "big"), payload], BatchDecoder(), TOPIC, 1 << 20)
    assert message.batch is not None
    (event,) = message.batch.events
    assert isinstance(event, Stored) and (event.keyed, event.lookahead) == (True, None)


def test_lookahead_in_array_events_at_its_declaration_position() -> None:
    fields = [[11], None, [1, 2], 2, None, "GPU", None, None, 0, None, None, None, None, "s", [[3]]]
    message = parse_published(
        [TOPIC, (1).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [["BlockStored", *fields]]])],
        BatchDecoder(),
        TOPIC,
        1 << 20,
    )
    assert message.batch is not None and message.batch.layout is Layout.ARRAY_ARRAY
    (event,) = message.batch.events
    assert isinstance(event, Stored) and (event.lookahead, event.keyed) == (((3,),), False)


def test_removals_of_each_shape() -> None:
    assert decode(_Removed032([HASH_A], "GPU", group_idx=0)) == (Removed((HASH_A,), "GPU", 0),)
    assert decode(_Removed48933([HASH_A, HASH_B], "GPU", remaining_copy_counts=[1, 0])) == (
        Removed((HASH_A, HASH_B), "GPU", None, (1, 0)),
    )
    for counts in ([1], [1, -1], ["1", 0]):  # not one count per hash: not believed
        raw = msgspec.to_builtins(_Removed032([HASH_A, HASH_B], "GPU"), builtin_types=(bytes,)) | {
            "remaining_copy_counts": counts
        }
        payload = msgspec.msgpack.encode([2.0, [raw]])
        message = parse_published([TOPIC, (4).to_bytes(8, "big"), payload], BatchDecoder(), TOPIC, 1 << 20)
        assert message.batch is not None and message.batch.events == (Removed((HASH_A, HASH_B), "GPU", None),)
