"""The router's one error tree and its mapping to OpenAI-style JSON error bodies.

    RouterError                      500 internal_error
    ├── BadRequest                   400 invalid_request_error   (the client's body or headers)
    │   ├── NotFound                 404                         (no such route)
    │   ├── MethodNotAllowed         405
    │   ├── RequestTimeout           408                         (the body did not arrive within client_body)
    │   ├── PayloadTooLarge          413                         (body over limits.max_body_bytes)
    │   └── HeadersTooLarge          431                         (headers over limits.max_header_bytes/max_headers)
    ├── Unauthorized                 401 authentication_error
    ├── Overloaded                   429 rate_limit_error        (admission bound reached)
    ├── NoHealthyWorker              503 service_unavailable     (a pool has no healthy worker)
    └── UpstreamError                502 upstream_error          (one leg to one worker failed)
        ├── UpstreamConnectError     502                         (connect refused/reset before a response)
        ├── UpstreamTimeout          504 upstream_timeout        (a deadline ran out)
        ├── UpstreamStatus           the worker's 4xx, else 502  (the worker answered non-2xx)
        └── UpstreamProtocolError    502                         (the worker answered something unusable)

ConfigError is separate: it is raised at startup, never inside a request.

What a client reads (`message`, the body) names the failing role, never a worker's URL; `str(error)` (logs) adds
the worker and the low-level detail.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from router.domain import Role


class ConfigError(ValueError):
    """Invalid router configuration; the message names the offending setting."""


class RouterError(Exception):
    """Base of every error a request can end with."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    kind: ClassVar[str] = "internal"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, when one is (OpenAI's `param`)

    @property
    def http_status(self) -> int:
        return self.status

    def to_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.http_status}}

    def to_json(self) -> bytes:
        return json.dumps(self.to_body(), ensure_ascii=True).encode()


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"
    kind = "bad_request"


class NotFound(BadRequest):
    status = 404
    kind = "not_found"


class MethodNotAllowed(BadRequest):
    status = 405
    kind = "method_not_allowed"


class RequestTimeout(BadRequest):
    status = 408
    kind = "body_timeout"


class PayloadTooLarge(BadRequest):
    status = 413
    kind = "body_too_large"


class HeadersTooLarge(BadRequest):
    status = 431
    kind = "headers_too_large"


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"
    kind = "unauthorized"


class Overloaded(RouterError):
    status = 429
    type = "rate_limit_error"
    kind = "overloaded"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NoHealthyWorker(RouterError):
    status = 503
    type = "service_unavailable"
    kind = "no_worker"


class Unpairable(RouterError):
    """The chosen prefill and decode cannot be paired as configured (parallelism): an operator's fix, not the
    client's; answered before the decode leg leaves, never a hang."""

    status = 503
    type = "service_unavailable"
    kind = "unpairable"


class UpstreamError(RouterError):
    """One leg to one worker failed. `leg` is the role; `worker` the worker's URL (logs only, never to clients);
    `detail` the low-level cause (logs only: it may name hosts and ports)."""

    status = 502
    type = "upstream_error"
    kind = "upstream"
    retryable: ClassVar[bool] = True

    def __init__(self, message: str, *, leg: Role | str, worker: str, detail: str = "") -> None:
        self.leg = Role(leg)
        super().__init__(f"{self.leg} worker: {message}")
        self.worker = worker
        self.detail = detail

    @property
    def may_retry(self) -> bool:
        """Another worker may succeed: the failure was the worker's, not the client's request."""
        return self.retryable

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.message} [{self.worker}]{detail}"


class UpstreamConnectError(UpstreamError):
    kind = "connect"


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "upstream_timeout"
    kind = "timeout"


class UpstreamProtocolError(UpstreamError):
    kind = "protocol"
    retryable = False


class UpstreamStatus(UpstreamError):
    """The worker answered with a non-2xx status. A 4xx is the client's fault and is passed through as is."""

    kind = "status"

    def __init__(self, upstream_status: int, body: bytes, *, leg: Role | str, worker: str) -> None:
        detail = _error_message(body) or f"HTTP {upstream_status}"
        super().__init__(f"answered {upstream_status}: {detail}", leg=leg, worker=worker)
        self.upstream_status = upstream_status
        self.body = body

    @property
    def client_fault(self) -> bool:
        return 400 <= self.upstream_status < 500 and self.upstream_status not in (408, 429)

    @property
    def may_retry(self) -> bool:
        return not self.client_fault  # the same request would fail the same way on another worker

    @property
    def http_status(self) -> int:
        return self.upstream_status if self.client_fault else 502

    def to_body(self) -> dict[str, Any]:
        body = super().to_body()
        if self.client_fault:
            body["error"]["type"] = "invalid_request_error"
            body["error"]["message"] = _error_message(self.body) or self.message
        return body


def _error_message(body: bytes) -> str | None:
    """The message inside a vLLM/OpenAI error body, if there is one."""
    try:
        data = json.loads(body)
    except ValueError:
        text = body.decode(errors="replace").strip()
        return text[:300] or None
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
        if isinstance(data.get("detail"), str):
            return str(data["detail"])
    return None
