"""Bearer-key checks for clients and for the admin API. Pure; keys are compared in constant time, never logged."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from router.errors import Unauthorized


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _matches(token: str, keys: Iterable[str]) -> bool:
    found = False
    for key in keys:  # no early exit: the time taken does not tell which key was close
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


def check_client(authorization: str | None, keys: tuple[str, ...]) -> None:
    """Raises Unauthorized unless client auth is off (no keys) or the Bearer token is one of the keys."""
    if not keys:
        return
    token = bearer_token(authorization)
    if token is None:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if not _matches(token, keys):
        raise Unauthorized("invalid API key")


def check_admin(authorization: str | None, admin_key: str | None) -> None:
    """Raises Unauthorized unless the Bearer token is the admin key. No admin key configured: always refused."""
    if admin_key is None:
        raise Unauthorized("the admin API is disabled: configure admin_key (KVPUSH_ADMIN_KEY)")
    token = bearer_token(authorization)
    if token is None or not _matches(token, (admin_key,)):
        raise Unauthorized("the admin API needs the admin key")
