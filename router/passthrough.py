"""vLLM's helper endpoints (`POST /tokenize`, `POST /detokenize`, `GET /version`, Anthropic's
`POST /v1/messages/count_tokens`), passed to one healthy worker.

Every worker serves the same model, so any of them answers the same: the healthy decode workers first, then the
healthy prefill workers, each call under `timeouts.helper`. A worker's own answer (2xx, or a 4xx: the client's
request) is relayed as it came; a worker that fails (no connection, 5xx, the deadline) is passed over for the
next; none left: 503.

`to_owner` is the one-worker form, for what only one worker holds (a stored Responses API response, on the decode
that answered it: router/responses.py): its answer below 500 is relayed with its content type, else 502.
"""

from __future__ import annotations

import logging

import httpx

from router.domain import Role
from router.errors import NoHealthyWorker, UpstreamStatus
from router.upstream import translate
from router.workers.pool import Pool

logger = logging.getLogger("kvpush.passthrough")
PATHS = ("/tokenize", "/detokenize", "/version", "/v1/messages/count_tokens")


async def forward(
    pool: Pool, client: httpx.AsyncClient, method: str, path: str, body: bytes, deadline: float
) -> tuple[int, bytes]:
    """The first usable worker's (status, body) for `method path`."""
    for role in (Role.DECODE, Role.PREFILL):
        for view in pool.candidates(role):
            url = f"{pool.get(view.id).spec.url}{path}"
            try:
                answer = await client.request(
                    method, url, content=body or None, headers={"content-type": "application/json"}, timeout=deadline
                )
            except httpx.HTTPError as exc:
                logger.warning("%s %s: %s", method, url, translate(exc, leg=role, worker=view.id))
                continue
            if answer.status_code < 500:
                return answer.status_code, answer.content
            logger.warning("%s %s: answered %d", method, url, answer.status_code)
    raise NoHealthyWorker(f"no healthy worker answered {method} {path}")


async def to_owner(
    client: httpx.AsyncClient, url: str, method: str, path: str, deadline: float
) -> tuple[int, bytes, str]:
    """The (status, body, content type) of `method path` (no body) on the worker at `url`, a pool member."""
    try:
        answer = await client.request(method, f"{url}{path}", timeout=deadline)
    except httpx.HTTPError as exc:
        raise translate(exc, leg=Role.DECODE, worker=url) from exc
    if answer.status_code >= 500:
        raise UpstreamStatus(answer.status_code, answer.content, leg=Role.DECODE, worker=url)
    return answer.status_code, answer.content, answer.headers.get("content-type", "application/json")
