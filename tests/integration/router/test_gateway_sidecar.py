"""The sidecar behind an InferencePool, on the wire (real router process, stand-in workers): the header contract of
deploy/k8s/overlays/inference-pool (`--gateway-prefill-header=required`). The prefill the EPP names in
`x-prefiller-host-port` serves, both legs leave at once; a prefill named outside the pool is a 400 and nothing
connects to it (a listening socket that must see no connection)."""

from __future__ import annotations

import socket

import httpx
import pytest

from router.gateway import PREFILLER_HEADER
from tests.integration.router.test_operations import BODY, fake, router, running

pytestmark = pytest.mark.integration


def test_the_named_prefill_serves_both_legs_at_once_and_an_outsider_is_never_dialled() -> None:
    p0, p1, d = fake("p0"), fake("p1"), fake("d", tokens=4)
    r = router([p0, p1], [d], "--gateway-prefill-header", "required")
    outsider = socket.socket()
    outsider.bind(("127.0.0.1", 0))
    outsider.listen(8)
    outsider.setblocking(False)
    with running(r, p0, p1, d), outsider:
        for _ in range(3):
            body = {**BODY, "stream": False}
            response = httpx.post(
                f"{r.url}/v1/completions", json=body, headers={PREFILLER_HEADER: f"127.0.0.1:{p1.port}"}, timeout=30
            )
            assert response.status_code == 200, response.text
            pairing = response.headers["x-kvpush-pairing-id"]
            (record,) = httpx.get(f"{r.url}/debug/timings", params={"pairing_id": pairing}, timeout=5).json()[
                "requests"
            ]
            assert record["prefill_worker"] == p1.url and record["outcome"] == "ok"
            assert record["decode_sent"] < record["prefill_done"], "push legs must overlap"
        port = outsider.getsockname()[1]
        for named in (f"127.0.0.1:{port}", f"localhost:{p1.port}", ""):
            refused = httpx.post(f"{r.url}/v1/completions", json=BODY, headers={PREFILLER_HEADER: named}, timeout=30)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["type"] == "invalid_request_error"
        missing = httpx.post(f"{r.url}/v1/completions", json=BODY, timeout=30)
        assert missing.status_code == 400 and "missing" in missing.json()["error"]["message"]
        with pytest.raises(BlockingIOError):
            outsider.accept()  # nobody connected to the host the header named
