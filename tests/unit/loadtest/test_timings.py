import asyncio

import httpx

from loadtest.records import ClientRecord
from loadtest.timings import fetch, join


def row(rid: str, handoff: float | None) -> dict[str, object]:
    return {"request_id": rid, "pairing_id": "p-" + rid, "handoff_ms": handoff, "ttft_ms": 50.0, "decode_wait_ms": 1.5}


def test_fetch_reads_bulk_then_asks_for_what_the_ring_dropped() -> None:
    asked: list[str | None] = []

    def handler(req: httpx.Request) -> httpx.Response:
        rid = req.url.params.get("request_id")
        asked.append(rid)
        if rid is None:
            return httpx.Response(200, json={"requests": [row("a", 3.0), row("zz", 1.0)]})
        return httpx.Response(200, json={"requests": [row(rid, 4.0)] if rid == "b" else []})

    async def go() -> dict[str, dict[str, object]]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await fetch(c, "http://r", ["a", "b", "c"])

    found = asyncio.run(go())
    assert set(found) == {"a", "b"} and asked == [None, "b", "c"]


def test_join_copies_router_fields() -> None:
    recs = [ClientRecord(0, "a"), ClientRecord(1, "b")]
    assert join(recs, {"a": row("a", 3.0)}) == 1
    assert recs[0].handoff_ms == 3.0 and recs[0].pairing_id == "p-a" and recs[0].decode_wait_ms == 1.5
    assert recs[1].handoff_ms is None
