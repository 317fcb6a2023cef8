"""The kv_transfer_params contract between the router (router.protocol) and our connector (connector.wire.metadata).

Both ends are real code: the router builds the legs' bodies and reads a prefill's answer; the connector parses
the legs and builds that answer. A change on either side that breaks the other fails here.
"""

from __future__ import annotations

from typing import Any

import pytest

from connector.wire.metadata import DecodeLeg, PrefillAnswer, PrefillLeg, pairing_key
from router.domain import Endpoint, NixlIdentity
from router.protocol import (
    KvTransferParams,
    PairingIds,
    identity_from,
    kv_params_of,
    prefill_body,
    pull_decode_body,
    push_decode_body,
)

CLIENT: dict[str, Any] = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "stream": True}
IDS = PairingIds(request_id="kvp-0123", transfer_id="xfer-4567")
IDENTITY = NixlIdentity(engine_id="p0", host="10.0.0.7", port=5601)
ANSWER = PrefillAnswer(
    remote_engine_id="p0",
    remote_host="10.0.0.7",
    remote_port=5601,
    remote_request_id="kvp-0123-abcdef01",
    remote_block_ids=(3, 4, 5),
    remote_num_tokens=40,
    transfer_id="xfer-4567",
)


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_the_routers_prefill_leg_parses_as_a_prefill_leg(endpoint: Endpoint) -> None:
    body = prefill_body(CLIENT, endpoint, IDS.transfer_id)
    leg = PrefillLeg.parse(body["kv_transfer_params"])
    assert leg == PrefillLeg(transfer_id="xfer-4567")
    assert DecodeLeg.parse(body["kv_transfer_params"]) is None, "a prefill leg is never a decode leg"
    limit = "max_output_tokens" if endpoint is Endpoint.RESPONSES else "max_tokens"  # each API's own output cap
    assert body[limit] == 1, "one-token legs get the WRITE in their completing step (G10)"


def test_the_routers_push_decode_leg_parses_as_a_decode_leg_and_pairs_with_its_prefill() -> None:
    body = push_decode_body(CLIENT, IDENTITY, IDS)
    leg = DecodeLeg.parse(body["kv_transfer_params"])
    assert leg is not None
    assert (leg.remote_engine_id, leg.remote_host, leg.remote_port) == ("p0", "10.0.0.7", 5601)
    assert (leg.tp_size, leg.pp_size, leg.transfer_id) == (1, 1, "xfer-4567")
    assert PrefillLeg.parse(body["kv_transfer_params"]) is None
    p_leg = PrefillLeg.parse(prefill_body(CLIENT, Endpoint.COMPLETIONS, IDS.transfer_id)["kv_transfer_params"])
    assert p_leg is not None
    # vLLM suffixes each engine's request id differently; the transfer id still pairs them
    assert pairing_key(leg.transfer_id, "kvp-0123-aaaaaaaa") == pairing_key(p_leg.transfer_id, "kvp-0123-bbbbbbbb")


def test_the_connectors_answer_gives_the_router_the_prefills_identity() -> None:
    params = kv_params_of({"kv_transfer_params": ANSWER.to_params()})
    assert params is not None
    assert identity_from(params) == IDENTITY


def test_the_connectors_answer_forwarded_verbatim_parses_as_a_decode_leg() -> None:
    params: KvTransferParams = ANSWER.to_params()  # type: ignore[assignment]
    leg = DecodeLeg.parse(pull_decode_body(CLIENT, params)["kv_transfer_params"])
    assert leg is not None and (leg.remote_engine_id, leg.remote_port, leg.transfer_id) == ("p0", 5601, "xfer-4567")
