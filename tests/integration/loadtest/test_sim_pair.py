"""Two simulator processes doing the pull and the push handoff by hand (no router), on loopback."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from loadtest import promtext
from loadtest.bench.procs import sim_proc, url
from loadtest.sim.profile import PROFILE_DIR
from stack.engines import Fleet
from stack.procs import free_port

pytestmark = pytest.mark.integration
PROMPT = " ".join(str(i % 997) for i in range(300))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    logs: Path = tmp_path_factory.mktemp("simlogs")
    doc = yaml.safe_load((PROFILE_DIR / "zero.yaml").read_text())
    doc["network"]["rendezvous"] = True  # free, but D still waits for P over the side channel
    profile = logs / "zero-rendezvous.yaml"
    profile.write_text(yaml.safe_dump(doc))
    p_port, d_port = free_port(), free_port()
    with Fleet(logs) as fleet:
        fleet.start(sim_proc("sim-p", "prefill", p_port, str(profile), "both", logs))
        fleet.start(sim_proc("sim-d", "decode", d_port, str(profile), "both", logs))
        fleet.wait_all_healthy(timeout=60.0)
        yield url(p_port), url(d_port)


def prefill_body(transfer_id: str) -> dict[str, object]:
    kv = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": transfer_id,
    }
    return {"model": "sim", "prompt": PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": kv}


def decode_body(kv: dict[str, object]) -> dict[str, object]:
    return {
        "model": "sim",
        "prompt": PROMPT,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": kv,
    }


async def stream_lines(c: httpx.AsyncClient, base: str, body: dict[str, object], rid: str) -> list[str]:
    async with c.stream("POST", f"{base}/v1/completions", json=body, headers={"x-request-id": rid}) as resp:
        assert resp.status_code == 200
        return [line async for line in resp.aiter_lines() if line.startswith("data:")]


def external_tokens(c: httpx.Client, base: str) -> float:
    samples = promtext.parse(c.get(f"{base}/metrics").text)
    return promtext.total(samples, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def test_pull_then_push_handoffs_move_the_kv(pair: tuple[str, str]) -> None:
    p, d = pair
    port = int(p.rsplit(":", 1)[1])

    async def go() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(timeout=30.0) as c:
            answer = await c.post(f"{p}/v1/completions", json=prefill_body("t-pull"), headers={"x-request-id": "r1"})
            kv = answer.json()["kv_transfer_params"]
            assert kv["remote_block_ids"] and kv["remote_port"] == port and kv["remote_num_tokens"] == 300
            pulled = await stream_lines(c, d, decode_body(kv), "r1")
            push_kv = {
                "do_remote_prefill": True,
                "remote_engine_id": "sim-p",
                "remote_host": "127.0.0.1",
                "remote_port": port,
                "tp_size": 1,
                "pp_size": 1,
                "remote_request_id": "r2",
                "transfer_id": "t-push",
            }
            legs = await asyncio.gather(
                c.post(f"{p}/v1/completions", json=prefill_body("t-push"), headers={"x-request-id": "r2"}),
                stream_lines(c, d, decode_body(push_kv), "r2"),
            )
            assert legs[0].status_code == 200
            return pulled, legs[1]

    with httpx.Client(timeout=10.0) as sync:
        before = external_tokens(sync, d)
        pulled, pushed = asyncio.run(go())
        assert external_tokens(sync, d) - before == 600
    for lines in (pulled, pushed):
        assert lines[-1] == "data: [DONE]"
        assert '"completion_tokens":5' in lines[-2]
        assert sum('"text"' in x for x in lines) == 5


def test_decode_fails_cleanly_when_prefill_never_comes(pair: tuple[str, str]) -> None:
    p, d = pair
    kv = {
        "do_remote_prefill": True,
        "remote_engine_id": "sim-p",
        "remote_host": "127.0.0.1",
        "remote_port": int(p.rsplit(":", 1)[1]),
        "remote_block_ids": [0],
        "remote_request_id": "nobody",
    }

    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=30.0) as c:
            return await stream_lines(c, d, decode_body(kv), "r3")

    lines = asyncio.run(go())
    assert any('"error"' in x for x in lines)
