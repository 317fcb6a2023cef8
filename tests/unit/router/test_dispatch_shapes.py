"""The dispatcher on request shapes that are not a plain one-choice prompt: what goes to which worker."""

from __future__ import annotations

from typing import Any

import pytest

from router.domain import Endpoint
from tests.unit.router.fake_workers import FakeWorkers, decode_ok, prefill_ok
from tests.unit.router.test_dispatch import call_of, make, relay

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True}


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.COMPLETIONS, {**PROMPT, "use_beam_search": True}),
        (Endpoint.CHAT, {**CHAT, "use_beam_search": True}),
        (Endpoint.COMPLETIONS, {**PROMPT, "prompt_logprobs": 1}),
        (Endpoint.COMPLETIONS, {**PROMPT, "echo": True, "logprobs": 1}),
        (Endpoint.CHAT, {**CHAT, "echo": True, "top_logprobs": 1}),
    ],
)
async def test_a_request_vllm_computes_on_decode_anyway_goes_to_decode_alone(
    mode: str, endpoint: Endpoint, body: dict[str, Any]
) -> None:
    workers = FakeWorkers({"p0": prefill_ok(mode=mode), "d0": decode_ok()})
    dispatcher, _, timings = await make(workers, mode=mode)
    await relay(await dispatcher.handle(call_of(dispatcher, body, endpoint)))
    assert workers.legs("p0") == []
    (leg,) = workers.legs("d0")
    assert "kv_transfer_params" not in leg.body and leg.body == body
    (record,) = timings.query()
    assert record["mode"] == "bypass" and record["outcome"] == "ok"
