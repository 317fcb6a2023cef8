"""Answer checks, off the request's path: a worker of the pools tokenizes an answer's text, and the decider learns
how many of the generated tokens a next turn sending that text back will find in decode's prefix cache.

A decider's `record` hands back an `AnswerCheck` (router/decider.py); `Retokenizer.submit` runs it as a task of
its own: one `POST /tokenize` (the text alone, no special tokens) to the URL it is given (the dispatcher picks a
healthy prefill worker: the same model, and off the decode core; else the decode worker) under `deadline`, then
`check.settle(matched_tokens(generated, tokens), len(tokens), now)`. The client's answer is relayed already, and
the next turn comes after the user's or the tool's think time, so nobody waits for it. At most `max_pending`
checks run at once; beyond that one is dropped and the decider's first estimate stands, as when a check fails.
`aclose` cancels what is still running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from router import protocol, upstream
from router.decider import AnswerCheck, matched_tokens
from router.domain import Role
from router.errors import UpstreamError
from router.legs.base import LegTransport

logger = logging.getLogger("kvpush.retokenize")

_HEADERS = {"content-type": "application/json"}


class Retokenizer:
    def __init__(
        self, legs: LegTransport, clock: Callable[[], float], *, deadline: float = 10.0, max_pending: int = 64
    ) -> None:
        if deadline <= 0 or max_pending < 1:
            raise ValueError("an answer check needs a positive deadline and room for one")
        self._legs = legs
        self._clock = clock
        self._deadline = deadline
        self._max = max_pending
        self._tasks: set[asyncio.Task[None]] = set()
        self.settled = self.failed = self.dropped = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def submit(self, url: str, check: AnswerCheck) -> bool:
        """Starts the check against the worker at `url`; False when `max_pending` are running already."""
        if len(self._tasks) >= self._max:
            self.dropped += 1
            return False
        task = asyncio.get_running_loop().create_task(self._run(url, check))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _run(self, url: str, check: AnswerCheck) -> None:
        body = protocol.encode({"prompt": check.text, "add_special_tokens": False})
        try:
            async with asyncio.timeout(self._deadline):
                _, answer = await upstream.post_json(
                    self._legs, f"{url}/tokenize", body, _HEADERS, leg=Role.DECODE, worker=check.worker
                )
        except (UpstreamError, TimeoutError) as error:
            self.failed += 1
            logger.debug("answer check on %s failed: %s", check.worker, error or "no answer in time")
            return
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            self.failed += 1
            logger.debug("answer check on %s: /tokenize answered without a token list", check.worker)
            return
        self.settled += 1
        try:
            check.settle(matched_tokens(check.generated, tokens), len(tokens), self._clock())
        except Exception:  # a decider's bug must not end the router's loop; it is logged whole
            logger.exception("the decider failed to settle an answer check")

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
