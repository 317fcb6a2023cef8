"""The router in front of a data-parallel prefill on real vLLM CPU engines (issue 22, item 1): a prefill started
with --data-parallel-size 2 (two engine ranks, `<engine_id>_dp<r>` on side ports base + r) and a DP=1 decode, over
upstream's NixlPushConnector and ours. Requests spread over both ranks, none fails, every prompt token reaches
decode by transfer, and greedy output equals one instance's. The prefill is declared `dp=2` with its configured
identity; a second router learns each rank's identity from its first answer."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pytest

from stack.family import PdFamily, pd_family
from stack.procs import free_port
from tests.integration.connector.kvpush_support import CONNECTOR, CONNECTOR_EXTRA, MODULE
from tests.integration.support import VLLM, metric, require_vllm, tiny_model, wait_for
from tests.integration.vllm_support import Engines, complete, kv_sources, prompt_text, router, started, timing

pytestmark = VLLM
DP = ("--data-parallel-size", "2")
REQUESTS = 8  # per router: 4 per rank when even


@dataclass(frozen=True)
class Connector:
    id: str
    name: str
    module: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


CONNECTORS = (
    Connector("upstream", "NixlPushConnector", extra={"kv_lease_duration": 150}),
    Connector("kvpush", CONNECTOR, MODULE, CONNECTOR_EXTRA),
)


@dataclass
class DpStack:
    engines: Engines
    configured: str  # router URL: the prefill's identity configured, dp=2
    learned: str  # router URL: dp=2, each rank's identity learned


@pytest.fixture(scope="module", params=CONNECTORS, ids=[c.id for c in CONNECTORS])
def dp_stack(request: pytest.FixtureRequest) -> Iterator[DpStack]:
    require_vllm()
    c: Connector = request.param
    family = pd_family(
        f"dp-{c.id}",
        tiny_model(),
        c.name,
        module=c.module,
        engine_suffix=f"-{uuid.uuid4().hex[:6]}",
        prefill_args=(DP,),
        connector_extra=c.extra,
    )
    side_port = free_port()
    family = PdFamily((replace(family.prefills[0], side_port=side_port),), family.decodes)
    with contextlib.ExitStack() as running:
        engines = running.enter_context(started(family))
        prefill, decode = engines.prefills[0], engines.decode.url
        configured = running.enter_context(router("push", [f"{prefill.engine_spec.prefill_arg()},dp=2"], [decode]))
        learned = running.enter_context(router("push", [f"{prefill.url},dp=2"], [decode]))
        yield DpStack(engines, configured, learned)


def transferred(decode: str, before: Mapping[str, float], tokens: int) -> bool:
    return kv_sources(decode)["external_kv_transfer"] - before["external_kv_transfer"] >= tokens


def per_rank(url: str) -> list[float]:
    """Requests each of the server's engine ranks finished (its /metrics, `engine` label)."""
    return [metric(url, "vllm:request_success_total", engine=str(rank)) for rank in (0, 1)]


@pytest.mark.parametrize("which", ["configured", "learned"])
def test_requests_spread_over_both_ranks_by_transfer_with_one_instance_s_output(dp_stack: DpStack, which: str) -> None:
    url = dp_stack.configured if which == "configured" else dp_stack.learned
    prefill, decode = dp_stack.engines.prefills[0].url, dp_stack.engines.decode.url
    ranks_before = per_rank(prefill)
    for i in range(REQUESTS):
        stream = i % 2 == 0
        body = {"model": "tiny", "prompt": prompt_text(), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        body["stream"] = stream
        if stream:
            body["stream_options"] = {"include_usage": True}
        before = kv_sources(decode)
        got = complete(url, "completions", body)
        assert got.status == 200, got.text
        wait_for(partial(transferred, decode, before, got.prompt_tokens), "decode counted the prompt")
        after = kv_sources(decode)
        assert after["external_kv_transfer"] - before["external_kv_transfer"] == got.prompt_tokens
        assert after["local_compute"] == before["local_compute"]
        alone = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        assert got.text == complete(decode, "completions", alone).text  # the same request on one instance
        record = timing(url, got.headers["x-kvpush-pairing-id"])
        assert record["outcome"] == "ok" and record["attempts"] == 1
        if which == "configured" or i >= 2:  # the learning router's first request per rank runs sequentially
            assert record["decode_sent"] < record["prefill_done"], "push legs must overlap"
    wait_for(lambda: sum(per_rank(prefill)) - sum(ranks_before) >= REQUESTS, "prefill counted the requests")
    spread = [now - then for now, then in zip(per_rank(prefill), ranks_before, strict=True)]
    even = REQUESTS / 2
    assert all(abs(n - even) <= 0.2 * even for n in spread), f"requests per rank {spread}"
