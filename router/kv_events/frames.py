"""vLLM's KV-event frames, decoded into typed events. Pure.

A vLLM engine started with `--kv-events-config` publishes what its prefix cache holds on a ZMQ PUB socket, one
multipart message per scheduler step: `(topic, seq, payload)`, `seq` an 8-byte big-endian counter from 0 per
publisher process, `payload` one msgpack event batch. Its replay socket (ZMQ ROUTER) answers a start sequence
number with the buffered messages from there on, then an end marker whose seq is -1 (eight 0xff bytes) and whose
payload is empty.

Layouts seen from vLLM 0.32 to 0.34 (all decoded here; which one a frame used is reported as `Layout`):
- the batch is an array `[ts, events, data_parallel_rank?]` (0.32's wheel and the 0.33/0.34 file) or a map
  `{"ts", "events", "data_parallel_rank"?}` (builds whose batch struct is not array-like);
- each event is a map tagged by `"type"` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`; default fields
  omitted) or, in builds whose event structs are array-like, an array whose first element is that tag and whose
  fields follow in declaration order (`block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, ...`);
- a block hash is 32 bytes (sha256 block hashing, the default) or an int (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`);
- later builds add fields (`locality`, `ownership`, `session_id`, ...): unknown map keys and extra trailing array
  elements are ignored;
- 0.33 added `BlockStored.lookahead_token_ids` (0.34 kept it): per block, the tokens after it that its hash also
  covers (speculative decoding's lookahead hashing), None when lookahead hashing is off. Read when present, as
  `Stored.lookahead`; a value of another shape makes the event's blocks `keyed` (matchable never);
- `BlockRemoved.remaining_copy_counts` (proposed upstream, vllm#48933: per hash, the physical copies the engine
  still holds after this removal) is read when present, as `Removed.remaining`;
- replay answers carry the topic frame (`topic, seq, payload`) or not (`seq, payload`, older builds).

An event type this module does not know is counted and skipped (`Batch.unknown`); a frame that cannot be read is a
`FrameError` (what to do with it is the subscriber's: count it, skip it, never stop).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec

BlockHash = int | bytes
END_SEQ = 2**64 - 1  # the replay end marker's seq, (-1).to_bytes(8, "big", signed=True) read unsigned
_SEQ_BYTES = 8


class FrameError(ValueError):
    """A frame that cannot be read. `kind` is a counter name: "malformed" or "oversized"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind} KV-event frame: {detail}")
        self.kind = kind


class Layout(enum.StrEnum):
    """How a batch was laid out on the wire: the batch's shape, then its events'."""

    ARRAY_MAP = "array-batch/map-events"  # vLLM 0.32 wheel, 0.33, 0.34
    MAP_MAP = "map-batch/map-events"
    ARRAY_ARRAY = "array-batch/array-events"
    MAP_ARRAY = "map-batch/array-events"


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks an engine cached: `hashes[i]` holds `token_ids[i*block_size:(i+1)*block_size]`, each block's parent
    is the one before it, the first one's is `parent` (None: the prompt's first block)."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None  # "GPU", "CPU", "STORAGE"; None: unspecified (the GPU pool)
    group: int | None  # the KV cache group (hybrid models have several); None: unspecified
    keyed: bool  # the engine hashed more than the tokens (LoRA, multimodal, cache salt, prompt embeddings)
    session_id: str | None
    # Per block, the token ids after it that the engine's hash of it also covers (vLLM 0.33+ lookahead hashing):
    # the block is a hit only for a prompt that continues with them. None: hashed over its own tokens only.
    lookahead: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """One physical copy of each block left the engine's cache (vLLM 0.32-0.34 send one per copy)."""

    hashes: tuple[BlockHash, ...]
    medium: str | None
    group: int | None
    # Per hash, the copies the engine still holds after this removal, where the engine says (vllm#48933's
    # `remaining_copy_counts`); None: not said.
    remaining: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine dropped its whole prefix cache (reset_prefix_cache)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    rank: int | None  # the publisher's data-parallel rank, as it says
    events: tuple[Event, ...]
    layout: Layout
    unknown: int = 0  # events of a type this module does not know, skipped


@dataclass(frozen=True, slots=True)
class Message:
    """One published (or replayed) message: its seq and its batch, or the reason the batch could not be read
    (`fault`: "malformed" or "oversized"; the seq is still known, so the gap is)."""

    seq: int
    batch: Batch | None
    fault: str | None = None


@dataclass(frozen=True, slots=True)
class ReplayEnd:
    """The replay socket's end marker."""


# --- the wire ---------------------------------------------------------------------------------------------------


class _StoredMap(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    session_id: str | None = None
    lookahead_token_ids: Any = None  # 0.33+; checked below


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    remaining_copy_counts: Any = None  # vllm#48933 (not in a release yet); checked below


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _StoredArray(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: Any = None
    medium: Any = None
    lora_name: Any = None  # positions past block_size changed across builds: read loosely, checked below
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: Any = None  # 0.33+'s declaration order; checked below


class _RemovedArray(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[BlockHash]
    medium: Any = None
    group_idx: Any = None


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


_MapEvent = _StoredMap | _RemovedMap | _ClearedMap
_ArrayEvent = _StoredArray | _RemovedArray | _ClearedArray


class _BatchArrayMapEvents(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _BatchMapMapEvents(msgspec.Struct, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _BatchArrayArrayEvents(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _BatchMapArrayEvents(msgspec.Struct, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _BatchArrayRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _BatchMapRaw(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_WireBatch = _BatchArrayMapEvents | _BatchMapMapEvents | _BatchArrayArrayEvents | _BatchMapArrayEvents
_DECODERS: dict[Layout, msgspec.msgpack.Decoder[Any]] = {
    Layout.ARRAY_MAP: msgspec.msgpack.Decoder(_BatchArrayMapEvents),
    Layout.MAP_MAP: msgspec.msgpack.Decoder(_BatchMapMapEvents),
    Layout.ARRAY_ARRAY: msgspec.msgpack.Decoder(_BatchArrayArrayEvents),
    Layout.MAP_ARRAY: msgspec.msgpack.Decoder(_BatchMapArrayEvents),
}
_RAW: dict[bool, msgspec.msgpack.Decoder[Any]] = {
    True: msgspec.msgpack.Decoder(_BatchArrayRaw),
    False: msgspec.msgpack.Decoder(_BatchMapRaw),
}


class _MapTag(msgspec.Struct, gc=False):
    type: str


class _ArrayTag(msgspec.Struct, array_like=True, gc=False):
    type: str


_KNOWN = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_MAP_TAG = msgspec.msgpack.Decoder(_MapTag)
_ARRAY_TAG = msgspec.msgpack.Decoder(_ArrayTag)
_ONE_MAP_EVENT = msgspec.msgpack.Decoder(_MapEvent)
_ONE_ARRAY_EVENT = msgspec.msgpack.Decoder(_ArrayEvent)


def _is_array(first: int) -> bool | None:
    """Whether a msgpack value starting with this byte is an array (True), a map (False) or neither (None)."""
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return True
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return False
    return None


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _keyed(lora_name: Any, extra_keys: Any) -> bool:
    if lora_name is not None:
        return True
    return isinstance(extra_keys, list) and any(entry is not None for entry in extra_keys)


def _int_list(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return tuple(value)


def _per_block(value: Any, blocks: int) -> tuple[tuple[int, ...], ...] | None:
    """Lookahead token ids: one list of ints per block hash, or None (absent, or of another shape)."""
    if not isinstance(value, list) or len(value) != blocks:
        return None
    found = [_int_list(entry) for entry in value]
    return None if any(entry is None for entry in found) else tuple(e for e in found if e is not None)


def _remaining(value: Any, blocks: int) -> tuple[int, ...] | None:
    counts = _int_list(value)
    return counts if counts is not None and len(counts) == blocks and min(counts, default=0) >= 0 else None


def _stored(wire: _StoredMap | _StoredArray) -> Stored:
    if wire.block_size < 1 or len(wire.token_ids) != len(wire.block_hashes) * wire.block_size:
        raise FrameError("malformed", "BlockStored: token_ids is not block_size per block hash")
    lookahead = _per_block(wire.lookahead_token_ids, len(wire.block_hashes))
    unreadable = wire.lookahead_token_ids is not None and lookahead is None  # hashed over something: not tokens
    return Stored(
        tuple(wire.block_hashes),
        wire.parent_block_hash,
        tuple(wire.token_ids),
        wire.block_size,
        _optional_str(wire.medium),
        _optional_int(wire.group_idx),
        unreadable or _keyed(wire.lora_name, wire.extra_keys),
        wire.session_id if isinstance(wire, _StoredMap) else None,
        lookahead,
    )


def _event(wire: _MapEvent | _ArrayEvent) -> Event:
    if isinstance(wire, _StoredMap | _StoredArray):
        return _stored(wire)
    if isinstance(wire, _RemovedMap | _RemovedArray):
        remaining = (
            _remaining(wire.remaining_copy_counts, len(wire.block_hashes)) if isinstance(wire, _RemovedMap) else None
        )
        return Removed(tuple(wire.block_hashes), _optional_str(wire.medium), _optional_int(wire.group_idx), remaining)
    return Cleared()


class BatchDecoder:
    """Decodes payloads, trying the layout that last worked first (one stream keeps one layout)."""

    def __init__(self) -> None:
        self._order = list(Layout)

    def decode(self, payload: bytes) -> Batch:
        if not payload:
            raise FrameError("malformed", "empty payload")
        array = _is_array(payload[0])
        if array is None:
            raise FrameError("malformed", "the batch is neither a msgpack array nor a map")
        for layout in self._order:
            if (layout in (Layout.ARRAY_MAP, Layout.ARRAY_ARRAY)) != array:
                continue
            try:
                wire: _WireBatch = _DECODERS[layout].decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if self._order[0] is not layout:
                self._order.remove(layout)
                self._order.insert(0, layout)
            return Batch(wire.ts, wire.data_parallel_rank, tuple(_event(e) for e in wire.events), layout)
        return self._event_by_event(payload, array)

    def _event_by_event(self, payload: bytes, array: bool) -> Batch:
        """The slow path: a batch with an event type we do not know (skipped and counted), or mixed shapes."""
        try:
            raw = _RAW[array].decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise FrameError("malformed", f"batch: {error}") from None
        events: list[Event] = []
        unknown = 0
        shapes = set()
        for item in raw.events:
            body = bytes(item)
            shape = _is_array(body[0]) if body else None
            if shape is None:
                raise FrameError("malformed", "an event is neither a msgpack array nor a map")
            shapes.add(shape)
            try:
                tag = (_ARRAY_TAG if shape else _MAP_TAG).decode(body).type
                if tag not in _KNOWN:
                    unknown += 1
                    continue
                wire = (_ONE_ARRAY_EVENT if shape else _ONE_MAP_EVENT).decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                raise FrameError("malformed", f"event: {error}") from None
            events.append(_event(wire))
        events_array = shapes == {True}
        layout = {
            (True, False): Layout.ARRAY_MAP,
            (False, False): Layout.MAP_MAP,
            (True, True): Layout.ARRAY_ARRAY,
            (False, True): Layout.MAP_ARRAY,
        }[(array, events_array)]
        return Batch(raw.ts, raw.data_parallel_rank, tuple(events), layout, unknown)


def _seq(frame: bytes) -> int:
    if len(frame) != _SEQ_BYTES:
        raise FrameError("malformed", f"seq frame of {len(frame)} bytes, not {_SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def parse_published(parts: list[bytes], decoder: BatchDecoder, topic: bytes, max_bytes: int) -> Message:
    """A message from the PUB socket: `(topic, seq, payload)` (also `(seq, payload)`). A frame whose seq cannot be
    read raises `FrameError`; one whose payload cannot be read (or is over `max_bytes`) comes back with its seq
    and `fault` set."""
    if len(parts) == 3:
        if parts[0] != topic:
            raise FrameError("malformed", "another topic")
        seq_frame, payload = parts[1], parts[2]
    elif len(parts) == 2:
        seq_frame, payload = parts
    else:
        raise FrameError("malformed", f"{len(parts)} parts")
    return _message(_seq(seq_frame), payload, decoder, max_bytes)


def parse_replayed(parts: list[bytes], decoder: BatchDecoder, topic: bytes, max_bytes: int) -> Message | ReplayEnd:
    """A message from the replay socket, read on a DEALER: `("", topic, seq, payload)` or `("", seq, payload)`;
    the end marker has seq -1 and an empty payload."""
    if not parts or parts[0] != b"":
        raise FrameError("malformed", "replay answer without its empty delimiter frame")
    body = parts[1:]
    if len(body) == 3:
        if body[0] not in (topic, b""):
            raise FrameError("malformed", "another topic")
        seq_frame, payload = body[1], body[2]
    elif len(body) == 2:
        seq_frame, payload = body
    else:
        raise FrameError("malformed", f"replay answer of {len(parts)} parts")
    seq = _seq(seq_frame)
    if seq == END_SEQ:
        return ReplayEnd()
    return _message(seq, payload, decoder, max_bytes)


def _message(seq: int, payload: bytes, decoder: BatchDecoder, max_bytes: int) -> Message:
    if len(payload) > max_bytes:
        return Message(seq, None, "oversized")
    try:
        return Message(seq, decoder.decode(payload))
    except FrameError as error:
        return Message(seq, None, error.kind)


def replay_request(start: int) -> list[bytes]:
    """What a DEALER sends to ask for everything from `start` on (the empty frame stands for REQ's delimiter)."""
    return [b"", start.to_bytes(_SEQ_BYTES, "big")]
