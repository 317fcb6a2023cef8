"""The end of a client request: its record finished, counted, kept and logged once; its detached prefill leg.

A push request's prefill leg may still run after decode answered (`detach`): it finishes on its own deadline,
unless the request ends otherwise than "ok" first (the client left), which cancels it. `finish` is called once
per request by whoever ends it: the dispatcher for a JSON answer or an error, the StreamAnswer's close for a
stream (router/feedback.py StreamClose); a second call is ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from router.metrics import Metrics
from router.timings import RequestRecord, TimingLog
from router.tracing import semconv
from router.tracing.trace import RequestTrace

logger = logging.getLogger("kvpush.dispatch")  # the dispatcher's logger: the request log line is API
_LOG_FIELDS = (
    "request_id",
    "pairing_id",
    "mode",
    "endpoint",
    "stream",
    "prefill_worker",
    "decode_worker",
    "outcome",
    "attempts",
    "ttft_ms",
    "handoff_ms",
)


class Finisher:
    def __init__(self, metrics: Metrics, timings: TimingLog, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._timings = timings
        self._clock = clock
        self._background: dict[str, asyncio.Task[Any]] = {}  # pairing id → prefill leg still running

    def detach(self, pairing_id: str, prefill_leg: asyncio.Task[Any]) -> None:
        """Lets a prefill leg still running after decode answered finish on its deadline (checked when done)."""
        if prefill_leg.done():
            _log_late_failure(prefill_leg)
            return
        self._background[pairing_id] = prefill_leg
        prefill_leg.add_done_callback(lambda _: self._background.pop(pairing_id, None))
        prefill_leg.add_done_callback(_log_late_failure)

    def finish(
        self,
        rec: RequestRecord,
        outcome: str,
        trace: RequestTrace | None = None,
        *,
        status: int | None = None,
        usage: dict[str, Any] | None = None,
    ) -> None:
        """Finishes the record (once) and ends the request's trace with its outcome, HTTP status and usage."""
        if rec.t_end is not None:
            return  # finished already (a stream that opened as the request was given up closed first)
        if trace is not None:
            trace.end(outcome, status=status, attributes=_end_attributes(rec, usage) if trace.recording else None)
        t_end = self._clock()
        rec.outcome, rec.t_end = outcome, t_end
        leftover = self._background.get(rec.pairing_id or "")
        if leftover is not None and outcome != "ok":
            leftover.cancel()
        mode = rec.mode
        self._metrics.child(self._metrics.requests, rec.endpoint, mode, outcome).inc()
        self._metrics.child(self._metrics.e2e, rec.endpoint, mode).observe(t_end - rec.t_start)
        if rec.decode_first_byte is not None and rec.decode_sent is not None:
            self._metrics.child(self._metrics.leg, "decode", mode).observe(t_end - rec.decode_sent)
        self._timings.add(rec)
        if logger.isEnabledFor(logging.INFO):
            self._log(rec, outcome, t_end)

    def _log(self, rec: RequestRecord, outcome: str, t_end: float) -> None:
        data = rec.to_json()
        fields = {k: data[k] for k in _LOG_FIELDS}
        fields["e2e_ms"] = round((t_end - rec.t_start) * 1000.0, 3)
        logger.info(
            "request %s %s (%s, %s attempt(s))",
            rec.request_id,
            outcome,
            rec.mode,
            rec.attempts,
            extra={"fields": fields},
        )

    async def aclose(self) -> None:
        """Cancels the prefill legs still running and waits for them."""
        tasks = list(self._background.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def _end_attributes(rec: RequestRecord, usage: dict[str, Any] | None) -> semconv.Attributes:
    return semconv.end_attributes(
        route=rec.mode, attempts=rec.attempts, pairing_id=rec.pairing_id, transfer_id=rec.transfer_id, usage=usage
    )


def _log_late_failure(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        logger.warning("prefill leg failed after decode had answered: %s", error)
