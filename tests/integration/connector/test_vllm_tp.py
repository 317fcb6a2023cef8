"""Our connector on real vLLM CPU under tensor parallelism (issue 20): a TP=2 engine pushing to or fed by a TP=1
engine through the router.

Each pair is one family of two engines: the TP=2 engine has two worker processes, each with its own side channel
and NIXL agent, both pinned to its one core (stack.engines binds OpenMP once per rank on the engine's core; with
the ranks on both cores, a prefill that steps while it holds blocks starves the decode: connector/README.md
"Tensor parallelism"). The router is told a TP prefill's size (`--prefill ...,tp=2`): the decode leg leaves before
the prefill answers. The tiny model has 2 KV heads: at P2-D1 each P rank writes its head into its slice of
decode's blocks and decode fans in both legs; at P1-D2 the prefill writes each D rank its head (P's fan-out).

`make test` runs P2-D1 (one family start, about a minute); P1-D2 runs with KVPUSH_TEST_TP_FANOUT=1 (another).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from connector.parallel.topology import plan
from tests.integration.connector.kvpush_support import CONNECTOR, CONNECTOR_EXTRA, MODULE
from tests.integration.families import FamilyPool, FamilySpec, pairs
from tests.integration.support import VLLM, metric, wait_for
from tests.integration.vllm_support import Engines, complete, kv_sources, request_body, router

WRITES = "vllm:kvpush_xfer_time_seconds_count"  # one sample per completed WRITE, from every rank
KV_HEADS = 2  # the tiny model's (stack.tiny_model)


def tp_family(p_tp: int, d_tp: int) -> FamilySpec:
    def tp(n: int) -> tuple[str, ...]:
        return ("--tensor-parallel-size", str(n)) if n > 1 else ()

    return FamilySpec(
        f"tp{p_tp}{d_tp}",
        CONNECTOR,
        MODULE,
        n_prefill=1,
        prefill_args=(tp(p_tp),),
        decode_args=tp(d_tp),
        connector_extra=pairs(CONNECTOR_EXTRA),
    )


FANOUT = os.environ.get("KVPUSH_TEST_TP_FANOUT") == "1"
PAIRS = [
    pytest.param((2, 1), id="P2-D1", marks=pytest.mark.family(tp_family(2, 1))),
    pytest.param(
        (1, 2),
        id="P1-D2",
        marks=[
            pytest.mark.family(tp_family(1, 2)),
            pytest.mark.skipif(not FANOUT, reason="a second family start: KVPUSH_TEST_TP_FANOUT=1 runs it"),
        ],
    ),
]

pytestmark = VLLM


@dataclass
class Stack:
    engines: Engines
    router_url: str
    legs: int  # WRITEs of a one-step prefill: one per (P rank, D rank) pair that shares a head

    @property
    def prefill_url(self) -> str:
        return self.engines.prefills[0].url

    @property
    def decode_url(self) -> str:
        return self.engines.decode.url


@pytest.fixture(scope="module", params=PAIRS)
def stack(request: pytest.FixtureRequest, family_pool: FamilyPool) -> Iterator[Stack]:
    p_tp, d_tp = request.param
    engines = family_pool.get(tp_family(p_tp, d_tp)).engines
    assert (engines.prefills[0].engine_spec.tp_size, engines.decode.engine_spec.tp_size) == (p_tp, d_tp)
    legs = plan(p_tp=p_tp, d_tp=d_tp, num_kv_heads=KV_HEADS, head_bytes=1, num_layers=1).legs
    with router("push", [engines.prefills[0].engine_spec.prefill_arg()], [engines.decode.url]) as url:
        yield Stack(engines, url, len(legs))


def transferred(stack: Stack, before: dict[str, float]) -> float:
    return kv_sources(stack.decode_url)["external_kv_transfer"] - before["external_kv_transfer"]


def test_the_tp2_engine_with_our_connector_loaded_serves_a_request_on_its_own(stack: Stack) -> None:
    engine = max(stack.engines.members(), key=lambda e: e.engine_spec.tp_size)
    got = complete(engine.url, "completions", request_body("completions", stream=False))
    assert got.status == 200, got.text
    assert got.text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_tp_pair_pushes_each_rank_s_heads_and_the_output_equals_a_single_instance(stack: Stack, stream: bool) -> None:
    body = request_body("completions", stream)
    before, writes = kv_sources(stack.decode_url), metric(stack.prefill_url, WRITES)
    got = complete(stack.router_url, "completions", body)
    assert got.status == 200, got.text
    assert got.prompt_tokens > 100
    wait_for(lambda: transferred(stack, before) >= got.prompt_tokens, "decode counted the prompt")
    after = kv_sources(stack.decode_url)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == got.prompt_tokens
    assert after["local_compute"] == before["local_compute"]
    # every leg wrote: a one-step prefill is one WRITE per (P rank, D rank) pair, each one KV head
    wait_for(lambda: metric(stack.prefill_url, WRITES) - writes >= stack.legs, "every leg wrote")
    reference = complete(stack.decode_url, "completions", body)  # the same request on one plain instance
    assert reference.status == 200, reference.text
    assert got.text == reference.text and got.text
