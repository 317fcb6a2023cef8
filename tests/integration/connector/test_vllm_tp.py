"""Our connector on real vLLM CPU under tensor parallelism (issue 20): a TP=2 prefill pushing to a TP=1 decode
through the router.

One family of two engines: the prefill at `--tensor-parallel-size 2` (two worker processes, each with its own side
channel and NIXL agent, both pinned to core 0: stack.engines binds OpenMP once per rank on the engine's core) and
a TP=1 decode on core 1. The router is told the prefill's TP (`--prefill ...,tp=2`): the decode leg leaves before
the prefill answers. Each P rank holds one of the model's two KV heads and writes it into its slice of decode's
blocks; decode fans in both legs (connector/README.md "Tensor parallelism").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.integration.connector.kvpush_support import CONNECTOR, CONNECTOR_EXTRA, MODULE
from tests.integration.families import FamilyPool, FamilySpec, pairs
from tests.integration.support import VLLM, metric, wait_for
from tests.integration.vllm_support import Engines, complete, kv_sources, request_body, router

PREFILL_TP = 2
KVPUSH_TP = FamilySpec(
    "tp",
    CONNECTOR,
    MODULE,
    n_prefill=1,
    prefill_args=(("--tensor-parallel-size", str(PREFILL_TP)),),
    connector_extra=pairs(CONNECTOR_EXTRA),
)
WRITES = "vllm:kvpush_xfer_time_seconds_count"  # one sample per completed WRITE, from every rank

pytestmark = [*VLLM, pytest.mark.family(KVPUSH_TP)]


@dataclass
class Stack:
    engines: Engines
    router_url: str

    @property
    def prefill_url(self) -> str:
        return self.engines.prefills[0].url

    @property
    def decode_url(self) -> str:
        return self.engines.decode.url


@pytest.fixture(scope="module")
def stack(family_pool: FamilyPool) -> Iterator[Stack]:
    engines = family_pool.get(KVPUSH_TP).engines
    assert engines.prefills[0].engine_spec.tp_size == PREFILL_TP
    with router("push", [engines.prefills[0].engine_spec.prefill_arg()], [engines.decode.url]) as url:
        yield Stack(engines, url)


def transferred(stack: Stack, before: dict[str, float]) -> float:
    return kv_sources(stack.decode_url)["external_kv_transfer"] - before["external_kv_transfer"]


def test_a_tp2_engine_with_our_connector_loaded_serves_a_request_on_its_own(stack: Stack) -> None:
    got = complete(stack.prefill_url, "completions", request_body("completions", stream=False))
    assert got.status == 200, got.text
    assert got.text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_tp2_prefill_pushes_each_rank_s_heads_to_a_tp1_decode_and_the_output_equals_a_single_instance(
    stack: Stack, stream: bool
) -> None:
    body = request_body("completions", stream)
    before, writes = kv_sources(stack.decode_url), metric(stack.prefill_url, WRITES)
    got = complete(stack.router_url, "completions", body)
    assert got.status == 200, got.text
    assert got.prompt_tokens > 100
    wait_for(lambda: transferred(stack, before) >= got.prompt_tokens, "decode counted the prompt")
    after = kv_sources(stack.decode_url)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == got.prompt_tokens
    assert after["local_compute"] == before["local_compute"]
    # both P ranks wrote (a one-step prefill: one WRITE per rank, each its own KV head into decode's blocks)
    wait_for(lambda: metric(stack.prefill_url, WRITES) - writes >= PREFILL_TP, "every prefill rank wrote")
    reference = complete(stack.decode_url, "completions", body)  # the same request on one plain TP=1 instance
    assert reference.status == 200, reference.text
    assert got.text == reference.text and got.text
