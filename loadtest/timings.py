"""The router's own per-request timings (GET /debug/timings), joined onto the client's records."""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from loadtest.records import ClientRecord

PER_ID_LIMIT = 2000  # at most this many single-id look-ups when the ring buffer has lost older ones


async def fetch(
    client: httpx.AsyncClient, base_url: str, request_ids: Sequence[str], timeout_s: float = 10.0
) -> dict[str, dict[str, Any]]:
    """{request_id: record}: one bulk read, then bounded per-id queries for what the ring buffer dropped."""
    url = base_url.rstrip("/") + "/debug/timings"
    found: dict[str, dict[str, Any]] = {}
    resp = await client.get(url, timeout=timeout_s)
    resp.raise_for_status()
    wanted = set(request_ids)
    _collect(found, resp.json().get("requests", []), wanted)
    missing = [r for r in request_ids if r not in found][:PER_ID_LIMIT]
    for rid in missing:
        resp = await client.get(url, params={"request_id": rid}, timeout=timeout_s)
        if resp.status_code == 200:
            _collect(found, resp.json().get("requests", []), wanted)
    return found


def _collect(found: dict[str, dict[str, Any]], rows: Iterable[Any], wanted: set[str]) -> None:
    for row in rows:
        if isinstance(row, dict) and row.get("request_id") in wanted:
            found[str(row["request_id"])] = row  # newest wins: the buffer is oldest first


def join(records: Iterable[ClientRecord], timings: Mapping[str, Mapping[str, Any]]) -> int:
    """Copy handoff/ttft/decode-wait onto each record from the router's row; returns how many matched."""
    matched = 0
    for rec in records:
        row = timings.get(rec.request_id)
        if row is None:
            continue
        matched += 1
        rec.handoff_ms = _num(row.get("handoff_ms"))
        rec.router_ttft_ms = _num(row.get("ttft_ms"))
        rec.decode_wait_ms = _num(row.get("decode_wait_ms"))
        rec.pairing_id = rec.pairing_id or row.get("pairing_id")
    return matched


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) else None
