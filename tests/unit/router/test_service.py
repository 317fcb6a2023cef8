"""The service's wiring between its parts (no sockets: the workers are an httpx mock transport)."""

from __future__ import annotations

import httpx

from router.config import build_settings
from router.service import Service

SETTINGS = {"prefill": ["http://p0:8100,engine_id=p0,side_port=5600"], "decode": ["http://d0:8200", "http://d1:8200"]}


async def test_a_worker_that_goes_down_or_leaves_is_forgotten_by_the_decider() -> None:
    """Issue 11: the prefix index drops a worker ejected by passive health or removed (admin, discovery)."""
    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    service = Service(build_settings(SETTINGS, {"decider": "session-affinity"}), transport=transport)
    forgotten: list[str] = []
    service.dispatcher.forget = forgotten.append  # type: ignore[method-assign,assignment]
    try:
        for spec in service.pool.all_members():
            service.pool.get(spec.id).health.on_probe_ok(0.0)
        service.pool.report("http://d0:8200", ok=False, hard=True, reason="connection refused")
        assert forgotten == ["http://d0:8200"]
        assert service.remove_worker("http://d1:8200")
        assert forgotten == ["http://d0:8200", "http://d1:8200"]
    finally:
        await service.client.aclose()
