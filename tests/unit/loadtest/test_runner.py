import asyncio
import json

import httpx

from loadtest.arrivals import ArrivalSpec
from loadtest.prompts import Prompt
from loadtest.runner import LoadConfig, run_load


def stream_of(tokens: int) -> bytes:
    lines = [json.dumps({"choices": [{"index": 0, "text": "t"}]}) for _ in range(tokens)]
    lines.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}}))
    return "".join(f"data: {x}\n\n" for x in [*lines, "[DONE]"]).encode()


def test_run_sends_warmup_apart_and_keeps_failures() -> None:
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        rid = req.headers["x-request-id"]
        seen.append(rid)
        if rid.endswith("-2"):
            return httpx.Response(500, text="boom")
        return httpx.Response(200, content=stream_of(4))

    cfg = LoadConfig(
        base_url="http://x",
        model="m",
        input_len=3,
        output_len=4,
        num_requests=5,
        arrivals=ArrivalSpec(),
        concurrency=2,
        warmup=2,
    )
    prompts = [Prompt(f"p{i}", 3) for i in range(7)]

    async def go() -> object:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await run_load(cfg, c, prompts)

    res = asyncio.run(go())
    assert len(res.warmup) == 2 and all(r.ok for r in res.warmup)  # type: ignore[attr-defined]
    recs = res.records  # type: ignore[attr-defined]
    assert [r.index for r in recs] == [0, 1, 2, 3, 4]
    assert [r.ok for r in recs] == [True, True, False, True, True]
    assert seen[:2] == ["lt-warm-0", "lt-warm-1"]
    assert all(r.output_tokens == 4 for r in recs if r.ok)
