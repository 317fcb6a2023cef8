"""A real vLLM P/D pair on the emulated link: P and D each in its own namespace behind a shaped NIC, our connector
over UCX TCP, the router in the root namespace. One streamed and one plain completion through the router give the
single-instance answer, D receives every prompt token by transfer, and at least those KV bytes left P's NIC.

Starts two engines: run under the vLLM flock, e.g.
    flock /tmp/kvpush-vllm.lock python -m pytest tests/integration/stack/test_link_vllm.py
"""

from __future__ import annotations

import pytest

from stack.engines import Fleet
from stack.family import pd_family, start_family
from stack.link.access import LinkUnavailable, require_access
from stack.link.calibrate import calibrate
from stack.link.fabric import Link
from stack.link.plan import Shaping, preset
from stack.tiny_model import SIZES
from tests.integration.support import VLLM
from tests.integration.vllm_support import (
    LOGS,
    STARTUP_TIMEOUT,
    complete,
    kv_sources,
    request_body,
    require_vllm,
    router,
    tiny_model,
)

pytestmark = VLLM
KV_BYTES_PER_TOKEN = SIZES["tiny"].kv_bytes_per_token()


def test_a_pd_request_over_the_shaped_link_gives_the_single_instance_answer_and_its_kv_crosses_ps_nic() -> None:
    require_vllm()
    try:
        require_access()
    except LinkUnavailable as exc:
        pytest.skip(str(exc))
    family = pd_family("lk", tiny_model(), "KvpushConnector", module="connector.plugin")
    with Link(Shaping.for_rate(2e8)) as link, Fleet(LOGS) as fleet:
        engines = start_family(fleet, family, STARTUP_TIMEOUT, link=link)
        p, d = engines.prefills[0], engines.decode
        assert p.url.startswith("http://10.231.") and d.url.startswith("http://10.231.")
        measured = calibrate(
            link, preset("ethernet-100g-like"), p.url, prompt_tokens=512, kv_bytes_per_token=KV_BYTES_PER_TOKEN, runs=2
        )
        assert link.shaping == measured.plan.shaping and measured.plan.shaping is not None
        with router("push", engines.prefill_args(), [d.url]) as url:
            for stream in (True, False):
                body = request_body("completions", stream)
                meter, before = link.meter(p.name), kv_sources(d.url)
                via_link = complete(url, "completions", body)
                after = kv_sources(d.url)
                check = meter.check(
                    int(after["external_kv_transfer"] - before["external_kv_transfer"]) * KV_BYTES_PER_TOKEN
                )
                plain = {k: v for k, v in body.items() if k != "stream_options"}
                alone = complete(p.url, "completions", dict(plain, stream=False))  # P alone, no transfer
                assert via_link.status == alone.status == 200, (via_link, alone)
                assert via_link.text == alone.text and via_link.text
                assert after["external_kv_transfer"] - before["external_kv_transfer"] >= via_link.prompt_tokens - 1
                assert after["external_kv_transfer"] > before["external_kv_transfer"]
                assert check.ok, check.verdict
                assert check.drops == 0
                print(f"link {measured.record()}; stream={stream}: {check.record()}")
