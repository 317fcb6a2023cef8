"""Typed, versioned wire formats of the kvpush connector and the request protocol it reads.

Three kinds of data cross a boundary here:

* **Notices** travel between the prefill (P) and decode (D) agents as NIXL notifications:
  ``Registration`` (D -> P), ``Cancel`` (D -> P), ``CancelAck`` (P -> D), ``Failure`` (P -> D) and
  ``Done`` (P -> D, attached to the WRITE itself so it is delivered after the data landed).
* **The handshake payload** travels over the TCP side channel before the first notice
  (agent metadata, KV layout, clock sample, compatibility hash).
* **Request parameters** arrive in vLLM's ``kv_transfer_params``; they follow upstream
  ``NixlPushConnector`` exactly so a router works with either connector.

Every encoded message carries ``PROTOCOL_VERSION``; a peer with another version is rejected
with a ``ProtocolError`` before the rest of the message is interpreted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

# History:
#   1  first version: Registration / Cancel / CancelAck / Failure / Done notices, JSON bodies,
#      handshake with regions + clock sample, pairing key "t:<transfer_id>" or "r:<base request id>".
#   2  Registration carries D's prompt length (``num_tokens``) so P refuses a registration its blocks
#      cannot fill; Failure carries ``quarantine`` (D fails the request now but holds its blocks until
#      its hold deadline: a WRITE P could not release may still land); agent names are unique per
#      incarnation; the side channel carries heartbeats after the handshake.
#   3  tensor/pipeline parallelism: the handshake payload carries the sender's ``RankInfo`` (TP and PP sizes,
#      its rank, the model's total KV heads, the heads it holds, bytes per head per block, its layer window);
#      ``Registration`` carries the D rank (``d_rank``); each rank listens on its own side-channel port
#      (``connector.kvcache.side_channel_port``) and a peer is known per (engine, rank).
PROTOCOL_VERSION = 3

NOTICE_PREFIX = b"kvpush:"

_RANDOM_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$")


def version_mismatch(what: str, theirs: object) -> str:
    """The refusal of a peer of another wire version: names both versions (G9)."""
    return (
        f"{what}: the peer speaks kvpush wire protocol version {theirs!r}, this connector speaks version "
        f"{PROTOCOL_VERSION} (run the same kvpush connector version on prefill and decode)"
    )


class ProtocolError(ValueError):
    """A notice or payload that this version cannot accept (bad version, kind or shape)."""


# --------------------------------------------------------------------------------------------
# Pairing: which P request and which D request belong to the same transfer.
# --------------------------------------------------------------------------------------------


def base_request_id(request_id: str) -> str:
    """Strip vLLM's per-engine ``-<8 hex>`` suffix, so P's and D's ids of one router id agree."""
    return _RANDOM_SUFFIX_RE.sub("", request_id)


def pairing_key(transfer_id: str | None, request_id: str) -> str:
    """The rendezvous key: the router's ``transfer_id`` or, without one, the base request id."""
    if transfer_id:
        return f"t:{transfer_id}"
    return f"r:{base_request_id(request_id)}"


def _opt_str(params: dict[str, Any], name: str) -> str | None:
    value = params.get(name)
    return None if value is None else str(value)


@dataclass(frozen=True, order=True)
class RankId:
    pp: int
    tp: int


@dataclass(frozen=True)
class PrefillLeg:
    """``kv_transfer_params`` of a prefill leg (``do_remote_decode``)."""

    transfer_id: str | None

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> PrefillLeg | None:
        if not params or not params.get("do_remote_decode"):
            return None
        return cls(transfer_id=_opt_str(params, "transfer_id"))


@dataclass(frozen=True)
class DecodeLeg:
    """``kv_transfer_params`` of a decode leg (``do_remote_prefill``): where the prefill lives."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    pp_size: int
    remote_request_id: str | None
    transfer_id: str | None

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> DecodeLeg | None:
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return cls(
                remote_engine_id=str(params["remote_engine_id"]),
                remote_host=str(params["remote_host"]),
                remote_port=int(params["remote_port"]),
                tp_size=int(params.get("tp_size") or 1),
                pp_size=int(params.get("pp_size") or 1),
                remote_request_id=_opt_str(params, "remote_request_id"),
                transfer_id=_opt_str(params, "transfer_id"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"decode leg kv_transfer_params incomplete: {exc!r}") from exc


@dataclass(frozen=True)
class PrefillAnswer:
    """What a finished prefill leg answers in its ``kv_transfer_params`` (upstream's push protocol):
    who holds the KV and how to reach it. ``to_params()`` is the wire form; the router reads it with
    ``router.protocol.identity_from`` (tests/unit/test_wire_contract.py holds both ends to it)."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    remote_num_tokens: int
    transfer_id: str | None
    tp_size: int = 1  # the prefill engine's: decode derives its source ranks from it (``connector.parallel.ranks``)
    pp_size: int = 1

    def to_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(self.remote_block_ids),
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "remote_num_tokens": self.remote_num_tokens,
            "transfer_mode": "push",
            "transfer_id": self.transfer_id,
        }


# --------------------------------------------------------------------------------------------
# Notices (NIXL notifications)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Registration:
    """D -> P: "my blocks for transfer ``key`` are allocated; WRITE them before ``write_deadline``".

    ``write_deadline`` is expressed in P's monotonic clock (D converts with the offset it measured
    at handshake, rounded against itself); P never posts a WRITE after it, which is what lets D
    free cancelled blocks after its own hold deadline without P's acknowledgement.
    """

    kind: ClassVar[str] = "reg"
    key: str
    d_request_id: str
    d_engine_id: str
    block_ids: tuple[int, ...]
    write_deadline: float
    num_tokens: int  # D's prompt length: P refuses blocks that cannot hold exactly this prompt
    d_rank: int = 0  # the D rank whose blocks these are

    @property
    def sender(self) -> str:
        """The D rank's peer key (its agent on P)."""
        return peer_key(self.d_engine_id, RankId(0, self.d_rank))


@dataclass(frozen=True)
class Cancel:
    """D -> P: the decode request is gone; acknowledge once no WRITE for it can still land."""

    kind: ClassVar[str] = "cancel"
    key: str
    d_request_id: str
    d_engine_id: str
    d_rank: int = 0

    @property
    def sender(self) -> str:
        return peer_key(self.d_engine_id, RankId(0, self.d_rank))


@dataclass(frozen=True)
class CancelAck:
    """P -> D: no WRITE for (``key``, ``d_request_id``) is in flight or will be posted."""

    kind: ClassVar[str] = "ack"
    key: str
    d_request_id: str


@dataclass(frozen=True)
class Failure:
    """P -> D: the transfer will not happen (prefill failed, aborted, expired or WRITE failed).

    ``quarantine``: a WRITE into D's blocks may still land (P could not release its handle); D
    reports the request failed now and frees its blocks only at its own hold deadline.
    """

    kind: ClassVar[str] = "fail"
    key: str
    d_request_id: str
    reason: str
    quarantine: bool = False


@dataclass(frozen=True)
class Done:
    """P -> D: the KV is in D's blocks (sent as the WRITE's own notification)."""

    kind: ClassVar[str] = "done"
    key: str
    d_request_id: str


Notice = Registration | Cancel | CancelAck | Failure | Done
_NOTICE_TYPES: dict[str, type[Notice]] = {t.kind: t for t in (Registration, Cancel, CancelAck, Failure, Done)}


def encode_notice(notice: Notice) -> bytes:
    body = {"v": PROTOCOL_VERSION, "k": notice.kind, **asdict(notice)}
    return NOTICE_PREFIX + json.dumps(body, separators=(",", ":")).encode()


def is_notice(raw: bytes) -> bool:
    return raw.startswith(NOTICE_PREFIX)


def decode_notice(raw: bytes) -> Notice:
    """Parse one notice; raise ``ProtocolError`` on anything this version does not accept."""
    if not is_notice(raw):
        raise ProtocolError("not a kvpush notice")
    try:
        body = json.loads(raw[len(NOTICE_PREFIX) :])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"undecodable notice: {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError("notice body is not an object")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(version_mismatch("notice refused", version))
    cls = _NOTICE_TYPES.get(body.pop("k", None))
    if cls is None:
        raise ProtocolError("unknown notice kind")
    if cls is Registration and isinstance(body.get("block_ids"), list):
        body["block_ids"] = tuple(int(b) for b in body["block_ids"])
    try:
        return cls(**body)
    except TypeError as exc:
        raise ProtocolError(f"malformed {cls.kind} notice: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Handshake payload (side channel)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """One registered memory region of the paged KV cache: ``num_blocks`` blocks of ``block_len``
    bytes each, block ``i`` at ``base + i * block_len``."""

    base: int
    block_len: int
    num_blocks: int


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on for a block-for-block WRITE."""

    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    block_size: int  # tokens per block
    regions: tuple[Region, ...]

    def shape_signature(self) -> str:
        """The parts of the layout that must be equal on every P and D rank (addresses may differ; block lengths
        differ between ranks of unequal TP, region counts between a PP stage and decode: both are checked per pair
        by ``connector.parallel.ranks.stage_window`` / ``prefill_slices``)."""
        return f"{self.block_size}"


def compatibility_hash(model_signature: str, layout: KVLayout) -> str:
    """Hash of everything that must match between P and D before any block id is trusted."""
    text = f"kvpush/{PROTOCOL_VERSION}|{model_signature}|{layout.shape_signature()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RankInfo:
    """Where the sender sits in its engine and which part of the model's KV its blocks hold (wire v3).

    A block of one region of this rank holds ``len(heads)`` KV heads of ``head_bytes`` bytes each, in the
    order of ``heads`` (LBHNC); the rank holds the layers ``[layers[0], layers[1])`` (its PP stage).
    ``num_kv_heads``/``head_bytes`` 0 and ``heads`` empty: not described (whole blocks only)."""

    tp_size: int = 1
    pp_size: int = 1
    rank: RankId = field(default_factory=lambda: RankId(0, 0))
    num_kv_heads: int = 0  # the model's total KV heads
    heads: tuple[int, ...] = ()
    head_bytes: int = 0
    layers: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ProtocolError(f"tp_size and pp_size must be >= 1, got {self.tp_size} and {self.pp_size}")
        if not (0 <= self.rank.tp < self.tp_size and 0 <= self.rank.pp < self.pp_size):
            raise ProtocolError(f"rank {self.rank} outside tp_size {self.tp_size} x pp_size {self.pp_size}")

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    @classmethod
    def from_json(cls, body: Any) -> RankInfo:
        if not isinstance(body, dict):
            raise ProtocolError("handshake payload: rank is not an object")
        rank = body.get("rank") or {}
        return cls(
            tp_size=int(body["tp_size"]),
            pp_size=int(body["pp_size"]),
            rank=RankId(int(rank["pp"]), int(rank["tp"])),
            num_kv_heads=int(body.get("num_kv_heads", 0)),
            heads=tuple(int(h) for h in body.get("heads", ())),
            head_bytes=int(body.get("head_bytes", 0)),
            layers=(int(body["layers"][0]), int(body["layers"][1])),
        )


@dataclass(frozen=True)
class HandshakePayload:
    """One agent's identity as exchanged on the side channel (both directions)."""

    protocol_version: int
    compat_hash: str
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: KVLayout
    clock: float = field(default=0.0)  # sender's time.monotonic() when it built the payload
    rank: RankInfo = field(default_factory=RankInfo)  # wire v3: the sender's rank and head layout

    @property
    def peer_key(self) -> str:
        """How the receiver knows this sender: ``peer_key(engine_id, rank)``."""
        return peer_key(self.engine_id, self.rank.rank)

    def encode(self) -> bytes:
        body = asdict(self)
        body["agent_metadata"] = base64.b64encode(self.agent_metadata).decode()
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, *, expect_hash: str | None = None) -> HandshakePayload:
        """Parse a payload; check version and (if given) the compatibility hash first."""
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"undecodable handshake payload: {exc}") from exc
        if not isinstance(body, dict):
            raise ProtocolError("handshake payload is not an object")
        if body.get("protocol_version") != PROTOCOL_VERSION:
            raise ProtocolError(version_mismatch("handshake refused", body.get("protocol_version")))
        if expect_hash is not None and body.get("compat_hash") != expect_hash:
            raise ProtocolError(
                f"incompatible peer: compatibility hash {body.get('compat_hash')!r} != {expect_hash!r} "
                "(P and D must run the same model, dtype, block size and connector version)"
            )
        try:
            layout = body["layout"]
            return cls(
                protocol_version=int(body["protocol_version"]),
                compat_hash=str(body["compat_hash"]),
                engine_id=str(body["engine_id"]),
                agent_name=str(body["agent_name"]),
                agent_metadata=base64.b64decode(body["agent_metadata"]),
                layout=KVLayout(
                    mem_type=str(layout["mem_type"]),
                    device_id=int(layout["device_id"]),
                    block_size=int(layout["block_size"]),
                    regions=tuple(Region(**r) for r in layout["regions"]),
                ),
                clock=float(body.get("clock", 0.0)),
                rank=RankInfo.from_json(body["rank"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ProtocolError(f"malformed handshake payload: {exc!r}") from exc


# --------------------------------------------------------------------------------------------
# Scheduler -> worker step plan (travels inside vLLM's KVConnectorMetadata)
# --------------------------------------------------------------------------------------------


def peer_key(engine_id: str, rank: RankId) -> str:
    """How one rank of a peer engine is known (agents, links, notices): the engine id for rank (0, 0), so a
    TP = PP = 1 peer is named as before, else ``<engine>#pp<p>tp<t>``."""
    return engine_id if rank == RankId(0, 0) else f"{engine_id}#pp{rank.pp}tp{rank.tp}"


@dataclass(frozen=True)
class PeerAddress:
    """Where a prefill engine's side channel listens (its rank (0, 0): the router's ``remote_port``), who it
    claims to be, its parallelism as the decode leg states it (``tp_size``/``pp_size``), and which of its
    ranks this address reaches (``rank``; ``port`` is then that rank's own port)."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1
    rank: RankId = field(default_factory=lambda: RankId(0, 0))

    @property
    def key(self) -> str:
        return peer_key(self.engine_id, self.rank)
