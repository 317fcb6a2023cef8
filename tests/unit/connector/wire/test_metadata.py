"""Wire formats: round trips, version and compatibility checks, request-protocol parsing."""

from __future__ import annotations

import json

import pytest

from connector.wire.metadata import (
    NOTICE_PREFIX,
    PROTOCOL_VERSION,
    Cancel,
    CancelAck,
    DecodeLeg,
    Done,
    Failure,
    HandshakePayload,
    KVLayout,
    Notice,
    PrefillLeg,
    ProtocolError,
    RankId,
    RankInfo,
    Region,
    Registration,
    base_request_id,
    compatibility_hash,
    decode_notice,
    encode_notice,
    pairing_key,
)

NOTICES = [
    Registration("t:x", "d-1", "D", (3, 4, 5), 12.5, 40),
    Cancel("t:x", "d-1", "D"),
    CancelAck("t:x", "d-1"),
    Failure("t:x", "d-1", "prefill failed"),
    Failure("t:x", "d-1", "WRITE failed and could not be released", quarantine=True),
    Done("t:x", "d-1"),
]

LAYOUT = KVLayout("DRAM", 0, 16, (Region(4096, 1024, 8), Region(65536, 1024, 8)))


@pytest.mark.parametrize("notice", NOTICES, ids=lambda n: f"{n.kind}-{NOTICES.index(n)}")
def test_notice_round_trip(notice: Notice) -> None:
    assert decode_notice(encode_notice(notice)) == notice


def _raw(body: object) -> bytes:
    return NOTICE_PREFIX + json.dumps(body).encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"other:1",
        NOTICE_PREFIX + b"{not json",
        _raw([1, 2]),
        _raw({"v": PROTOCOL_VERSION + 1, "k": "ack", "key": "k", "d_request_id": "d"}),
        _raw({"v": PROTOCOL_VERSION, "k": "nope", "key": "k", "d_request_id": "d"}),
        _raw({"v": PROTOCOL_VERSION, "k": "ack", "key": "k"}),
    ],
    ids=["prefix", "json", "not-object", "version", "kind", "fields"],
)
def test_bad_notices_are_rejected(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_notice(raw)


def test_base_request_id_strips_only_the_vllm_suffix() -> None:
    assert base_request_id("cmpl-abc-0-1234abcd") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert base_request_id("chatcmpl-x-DEADBEEF") == "chatcmpl-x-DEADBEEF"  # upper case is not vLLM's


def test_pairing_key_prefers_transfer_id() -> None:
    assert pairing_key("T1", "cmpl-r-0-0badf00d") == "t:T1"
    assert pairing_key(None, "cmpl-r-0-0badf00d") == pairing_key("", "cmpl-r-0-12345678") == "r:cmpl-r-0"


def test_prefill_leg_parse() -> None:
    assert PrefillLeg.parse(None) is None
    assert PrefillLeg.parse({"do_remote_prefill": True}) is None
    assert PrefillLeg.parse({"do_remote_decode": True, "transfer_id": "T"}) == PrefillLeg("T")
    assert PrefillLeg.parse({"do_remote_decode": True}) == PrefillLeg(None)


def test_decode_leg_parse_upstream_shape() -> None:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p0",
        "remote_host": "127.0.0.1",
        "remote_port": "5600",
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": "R",
        "transfer_id": "T",
    }
    leg = DecodeLeg.parse(params)
    assert leg == DecodeLeg("p0", "127.0.0.1", 5600, 1, 1, "R", "T")
    assert DecodeLeg.parse({"do_remote_decode": True}) is None


def test_decode_leg_missing_field_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="remote_host"):
        DecodeLeg.parse({"do_remote_prefill": True, "remote_engine_id": "p0", "remote_port": 1})


def _payload(compat: str = "h1") -> HandshakePayload:
    return HandshakePayload(PROTOCOL_VERSION, compat, "p0", "agent-p0", b"\x00\xffmeta", LAYOUT, 3.5)


def test_handshake_round_trip() -> None:
    p = _payload()
    assert HandshakePayload.decode(p.encode(), expect_hash="h1") == p


def test_handshake_rejects_incompatible_peer_before_decoding_the_rest() -> None:
    raw = json.dumps({"protocol_version": PROTOCOL_VERSION, "compat_hash": "other"}).encode()
    with pytest.raises(ProtocolError, match="incompatible peer"):
        HandshakePayload.decode(raw, expect_hash="h1")


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff",
        json.dumps({"protocol_version": 0}).encode(),
        json.dumps({"protocol_version": PROTOCOL_VERSION, "compat_hash": "h1"}).encode(),
    ],
    ids=["bytes", "version", "fields"],
)
def test_handshake_rejects_bad_payloads(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        HandshakePayload.decode(raw)


def test_compatibility_hash_covers_layout_not_addresses() -> None:
    moved = KVLayout("DRAM", 0, 16, (Region(1, 1024, 99), Region(2, 1024, 99)))
    other = KVLayout("DRAM", 0, 32, LAYOUT.regions)
    assert compatibility_hash("m", LAYOUT) == compatibility_hash("m", moved)
    assert compatibility_hash("m", LAYOUT) != compatibility_hash("m", other)
    assert compatibility_hash("m", LAYOUT) != compatibility_hash("m2", LAYOUT)


def test_a_peer_of_the_old_wire_version_is_refused_naming_both_versions() -> None:
    old = json.dumps({**json.loads(_payload().encode()), "protocol_version": PROTOCOL_VERSION - 1}).encode()
    with pytest.raises(ProtocolError) as refused:
        HandshakePayload.decode(old, expect_hash="h1")
    assert f"version {PROTOCOL_VERSION - 1}" in str(refused.value)
    assert f"this connector speaks version {PROTOCOL_VERSION}" in str(refused.value)
    notice = encode_notice(Done("t:1", "d1")).replace(f'"v":{PROTOCOL_VERSION}'.encode(), b'"v":1')
    with pytest.raises(ProtocolError, match=f"version 1, this connector speaks version {PROTOCOL_VERSION}"):
        decode_notice(notice)


def test_a_v3_payload_carries_the_senders_rank_and_head_layout() -> None:
    info = RankInfo(
        tp_size=4, pp_size=2, rank=RankId(1, 3), num_kv_heads=8, heads=(6, 7), head_bytes=512, layers=(2, 4)
    )
    p = HandshakePayload(PROTOCOL_VERSION, "h1", "p0", "agent-p0", b"m", LAYOUT, 1.0, info)
    back = HandshakePayload.decode(p.encode(), expect_hash="h1")
    assert back == p and back.rank.world == 8
    assert back.peer_key == "p0#pp1tp3" and _payload().peer_key == "p0"  # rank (0, 0) keeps the engine id
    reg = Registration("t:1", "d1", "d0", (1, 2), 9.0, 32, d_rank=3)
    assert decode_notice(encode_notice(reg)) == reg


def test_a_v3_payload_without_its_rank_or_with_a_rank_outside_its_sizes_is_refused() -> None:
    body = json.loads(_payload().encode())
    del body["rank"]
    with pytest.raises(ProtocolError, match="malformed"):
        HandshakePayload.decode(json.dumps(body).encode())
    body = json.loads(_payload().encode())
    body["rank"]["rank"] = {"pp": 0, "tp": 2}  # tp_size 1
    with pytest.raises(ProtocolError, match="outside tp_size 1"):
        HandshakePayload.decode(json.dumps(body).encode())


def test_a_v2_peer_is_refused_at_the_handshake_naming_versions_2_and_3() -> None:
    v2 = {k: v for k, v in json.loads(_payload().encode()).items() if k != "rank"}  # what a v2 peer sent
    v2["protocol_version"] = 2
    with pytest.raises(
        ProtocolError, match="peer speaks kvpush wire protocol version 2, this connector speaks version 3"
    ):
        HandshakePayload.decode(json.dumps(v2).encode(), expect_hash="h1")
