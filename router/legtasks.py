"""A push attempt's two leg tasks: what the prefill leg answered, waiting for it without cancelling it, and giving
both legs up. Used by the dispatcher (router/dispatch.py), which sequences them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from router import protocol
from router.answer import StreamAnswer
from router.errors import UpstreamConnectError, UpstreamError, UpstreamStatus, UpstreamTimeout


@dataclass(frozen=True)
class Prefilled:
    """A prefill leg's answer: the params it returned, and the prompt tokens it found in its prefix cache."""

    params: protocol.KvTransferParams
    cached: int | None


async def give_up(prefill_leg: asyncio.Task[Any], decode_leg: asyncio.Task[Any]) -> None:
    """Cancels both legs of a push given up; a stream that opened just then is closed; the prefill leg's error
    is raised as the root cause."""
    for leg in (prefill_leg, decode_leg):
        leg.cancel()
    await asyncio.wait({prefill_leg, decode_leg})
    opened = None if failed(decode_leg) else decode_leg.result()
    if isinstance(opened, StreamAnswer):
        await asyncio.shield(opened.aclose())  # it opened just as we gave up
    if failed(prefill_leg) and not prefill_leg.cancelled():
        raise prefill_leg.exception() from None  # type: ignore[misc]  # the root cause


async def cached_of(prefill_leg: asyncio.Task[Prefilled]) -> int | None:
    """P's count once its leg has answered (it may still be answering after decode's first byte); None when the
    leg failed or was cancelled after decode had answered. Waiting never cancels the leg."""
    await asyncio.wait({prefill_leg})
    if prefill_leg.cancelled() or prefill_leg.exception() is not None:
        return None
    return prefill_leg.result().cached


def may_be_the_prefills_fault(decode_leg: asyncio.Task[Any]) -> bool:
    """Whether a failed decode leg may have failed because its prefill did: an error answer (a 5xx, an error
    event: its KV never came) may; a refused connection, a deadline or a client error is decode's own."""
    if not failed(decode_leg) or decode_leg.cancelled():
        return False
    error = decode_leg.exception()
    if isinstance(error, (UpstreamConnectError, UpstreamTimeout)):
        return False
    return isinstance(error, UpstreamError) and not (isinstance(error, UpstreamStatus) and error.client_fault)


def failed(task: asyncio.Task[Any]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)
