"""Executes one client request over the pools: push (both legs at once) or pull (prefill, then decode).

The dispatcher only sequences awaits: bodies come from `protocol`, choices from the policies, I/O from
`upstream`. One attempt = one pair of fresh ids. An attempt that fails before anything reached the client is
retried once (by default) with fresh ids on another worker of the failing leg's role, when there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from router import protocol, upstream
from router.answer import JsonAnswer, StreamAnswer, read_first_events
from router.config import Settings
from router.domain import Mode, NixlIdentity, RequestInfo, Role
from router.errors import (
    NoHealthyWorker,
    RouterError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatus,
    UpstreamTimeout,
)
from router.metrics import Metrics
from router.policy import Policy, make_policy
from router.pool import Pool, WorkerState
from router.sse import EventFramer, error_of
from router.timings import RequestRecord, TimingLog

logger = logging.getLogger("kvpush.dispatch")

Answer = JsonAnswer | StreamAnswer
DECODE_ONLY = "decode-only"  # the record's mode when the fallback served a request


@dataclass
class Call:
    """One validated client request and its timing record."""

    body: dict[str, Any]
    info: RequestInfo
    record: RequestRecord


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        client: httpx.AsyncClient,
        metrics: Metrics,
        timings: TimingLog,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self._timings = timings
        self._clock = clock
        self._policies: dict[Role, Policy] = {
            Role.PREFILL: make_policy(settings.prefill_policy),
            Role.DECODE: make_policy(settings.decode_policy),
        }
        self._background: dict[str, asyncio.Task[Any]] = {}  # pairing id → prefill leg still running

    def new_record(self, request_id: str, info: RequestInfo) -> RequestRecord:
        return RequestRecord(
            request_id=request_id,
            endpoint=str(info.endpoint),
            mode=str(self._settings.mode),
            stream=info.stream,
            t_start=self._clock(),
        )

    async def handle(self, call: Call) -> Answer:
        """The answer to relay, or a RouterError. Records and metrics are finished here or when a stream closes."""
        exclude: dict[Role, set[str]] = {Role.PREFILL: set(), Role.DECODE: set()}
        try:
            for attempt in range(1 + self._settings.retries):
                call.record.new_attempt()
                decode = self._select(Role.DECODE, call.info, exclude[Role.DECODE])
                try:
                    if self._decode_only(exclude[Role.PREFILL]):
                        answer = await self._attempt_decode_only(call, decode)
                    else:
                        prefill = self._select(Role.PREFILL, call.info, exclude[Role.PREFILL])
                        answer = await self._attempt(call, prefill, decode)
                except UpstreamError as error:
                    role = Role(error.leg)
                    exclude[role].add(error.worker)
                    last = attempt == self._settings.retries
                    if last or not error.retryable or not self._pool.candidates(role, frozenset(exclude[role])):
                        raise
                    logger.warning("request %s: retrying with fresh ids after: %s", call.record.request_id, error)
                    self._metrics.retries.labels(error.leg).inc()
                    continue
                if isinstance(answer, JsonAnswer):
                    self._finish(call.record, "ok")
                return answer
            raise AssertionError("unreachable: the attempt loop returns or raises")
        except RouterError as error:
            self._metrics.errors.labels(error.kind).inc()
            self._finish(call.record, error.kind)
            raise
        except asyncio.CancelledError:
            self._finish(call.record, "client_gone")
            raise

    def _select(self, role: Role, info: RequestInfo, exclude: set[str]) -> WorkerState:
        candidates = self._pool.candidates(role, frozenset(exclude))
        if not candidates:
            raise NoHealthyWorker(f"no healthy {role} worker is available")
        return self._pool.get(self._policies[role].select(candidates, info).id)

    def _decode_only(self, excluded_prefills: set[str]) -> bool:
        """With fallback "decode-only" and no healthy prefill left, decode computes the prompt itself."""
        return self._settings.fallback == "decode-only" and not self._pool.candidates(
            Role.PREFILL, frozenset(excluded_prefills)
        )

    async def _attempt_decode_only(self, call: Call, decode: WorkerState) -> Answer:
        rec = call.record
        rec.mode, rec.prefill_worker, rec.decode_worker = DECODE_ONLY, None, decode.spec.id
        ids = protocol.mint_ids()
        rec.pairing_id, rec.transfer_id = ids.request_id, None
        logger.warning("request %s: no healthy prefill worker; decode-only fallback", rec.request_id)
        return await self._decode(call, decode, call.body, ids)

    async def _attempt(self, call: Call, prefill: WorkerState, decode: WorkerState) -> Answer:
        rec = call.record
        rec.prefill_worker, rec.decode_worker = prefill.spec.id, decode.spec.id
        ids = protocol.mint_ids()
        rec.pairing_id, rec.transfer_id = ids.request_id, ids.transfer_id
        if self._settings.mode is Mode.PULL:
            params = await self._prefill(call, prefill, ids)
            return await self._decode(call, decode, protocol.pull_decode_body(call.body, params), ids)
        if prefill.identity is None:  # auto: learn the identity from a first, sequential prefill
            await self._prefill(call, prefill, ids)
        identity = prefill.identity
        if identity is None:
            raise UpstreamProtocolError("did not state its NIXL identity", leg="prefill", worker=prefill.spec.id)
        if rec.prefill_done is not None:
            return await self._decode(call, decode, protocol.push_decode_body(call.body, identity, ids), ids)
        return await self._push(call, prefill, decode, identity, ids)

    async def _push(
        self,
        call: Call,
        prefill: WorkerState,
        decode: WorkerState,
        identity: NixlIdentity,
        ids: protocol.PairingIds,
    ) -> Answer:
        """Both legs at once; the answer is decode's, as soon as its first byte is in."""
        decode_body = protocol.push_decode_body(call.body, identity, ids)
        prefill_leg = asyncio.create_task(self._prefill(call, prefill, ids))
        decode_leg = asyncio.create_task(self._decode(call, decode, decode_body, ids))
        try:
            await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
            if _failed(prefill_leg) and not decode_leg.done():
                decode_leg.cancel()  # decode would wait for KV that never comes
                await asyncio.wait({decode_leg})
                prefill_leg.result()  # raises the prefill error
            answer = await decode_leg
        except BaseException:
            for leg in (prefill_leg, decode_leg):
                leg.cancel()
            await asyncio.wait({prefill_leg, decode_leg})
            opened = None if _failed(decode_leg) else decode_leg.result()
            if isinstance(opened, StreamAnswer):
                await asyncio.shield(opened.aclose())  # it opened just as we gave up
            if _failed(prefill_leg) and not prefill_leg.cancelled():
                raise prefill_leg.exception() from None  # type: ignore[misc]  # the root cause
            raise
        self._drain(ids.request_id, prefill_leg)
        return answer

    async def _prefill(self, call: Call, worker: WorkerState, ids: protocol.PairingIds) -> dict[str, Any]:
        """The prefill leg; returns the kv_transfer_params it answered with."""
        rec, wid = call.record, worker.spec.id
        body = protocol.prefill_body(call.body, call.info.endpoint, ids.transfer_id)
        url = f"{worker.spec.url}{call.info.endpoint.path}"
        rec.prefill_sent = self._clock()
        with self._pool.track(wid, call.info.prompt_tokens):
            try:
                async with asyncio.timeout(self._settings.timeouts.prefill):
                    _, answer = await upstream.post_json(
                        self._client, url, body, _headers(ids), leg="prefill", worker=wid
                    )
            except TimeoutError:
                raise UpstreamTimeout("no answer within the prefill deadline", leg="prefill", worker=wid) from None
            except UpstreamError as error:
                self._passive_check(error)
                raise
        rec.prefill_done = self._clock()
        self._pool.report(wid, ok=True)
        self._metrics.leg.labels("prefill", rec.mode).observe(rec.prefill_done - rec.prefill_sent)
        return self._check_prefill_answer(worker, answer)

    def _check_prefill_answer(self, worker: WorkerState, answer: dict[str, Any]) -> dict[str, Any]:
        wid, mode = worker.spec.id, self._settings.mode
        params = protocol.kv_params_of(answer)
        if params is None:
            raise UpstreamProtocolError(
                "answered without kv_transfer_params: is it started with a KV connector (kv_producer)?",
                leg="prefill",
                worker=wid,
            )
        stated = params.get("transfer_mode")
        if stated is not None and stated != str(mode):
            raise UpstreamProtocolError(
                f"runs a {stated}-mode connector but the router is in {mode} mode", leg="prefill", worker=wid
            )
        if worker.spec.identity is None and (identity := protocol.identity_from(params)) is not None:
            self._pool.learn_identity(wid, identity)
        return params

    async def _decode(self, call: Call, worker: WorkerState, body: dict[str, Any], ids: protocol.PairingIds) -> Answer:
        """Opens the decode leg and waits for its first byte (stream) or its whole answer (non-stream)."""
        rec, wid, t = call.record, worker.spec.id, self._settings.timeouts
        url = f"{worker.spec.url}{call.info.endpoint.path}"
        cleanup = contextlib.AsyncExitStack()
        cleanup.enter_context(self._pool.track(wid, call.info.prompt_tokens))
        rec.decode_sent = self._clock()
        try:
            if not call.info.stream:
                try:
                    async with asyncio.timeout(t.decode_total):
                        content, _ = await upstream.post_json(
                            self._client, url, body, _headers(ids), leg="decode", worker=wid
                        )
                except TimeoutError:
                    raise UpstreamTimeout("no answer within the decode deadline", leg="decode", worker=wid) from None
                rec.decode_first_byte = self._clock()
                self._observe_first_byte(rec)
                await cleanup.aclose()
                return JsonAnswer(200, content)
            framer = EventFramer()
            try:
                async with asyncio.timeout(t.decode_first_byte):
                    response = await upstream.open_stream(
                        self._client, url, body, _headers(ids), leg="decode", worker=wid
                    )
                    cleanup.push_async_callback(response.aclose)
                    first, rest = await read_first_events(response, framer, worker=wid)
                    if (message := error_of(first[0])) is not None:  # nothing reached the client yet: retryable
                        raise UpstreamError(f"failed before its first token: {message}", leg="decode", worker=wid)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"no first byte within {t.decode_first_byte:g} s (did the KV arrive?)",
                    leg="decode",
                    worker=wid,
                ) from None
        except BaseException as error:
            if isinstance(error, UpstreamError):
                self._passive_check(error)
            await cleanup.aclose()
            raise
        rec.decode_first_byte = self._clock()
        self._observe_first_byte(rec)
        return StreamAnswer(
            response,
            first,
            rest,
            framer,
            worker=wid,
            cleanup=cleanup,
            on_close=lambda outcome: self._finish(rec, outcome),
        )

    def _observe_first_byte(self, rec: RequestRecord) -> None:
        mode = rec.mode
        if rec.decode_worker is not None:
            self._pool.report(rec.decode_worker, ok=True)
        if rec.ttft is not None:
            self._metrics.ttft.labels(rec.endpoint, mode).observe(rec.ttft)
            self._metrics.decode_ttft.labels(mode, rec.decode_worker or "").observe(rec.ttft)
        if rec.handoff is not None:
            self._metrics.handoff.labels(mode).observe(max(0.0, rec.handoff))

    def _passive_check(self, error: UpstreamError) -> None:
        """Feeds a leg's failure to the worker's health, unless the client's request was at fault."""
        if isinstance(error, UpstreamStatus) and error.client_fault:
            return
        self._pool.report(error.worker, ok=False, hard=error.kind == "connect", reason=error.message)

    def _drain(self, pairing_id: str, prefill_leg: asyncio.Task[dict[str, Any]]) -> None:
        """Lets a prefill leg still running after decode answered finish on its deadline (checked when done).

        If the request ends otherwise than "ok" first (the client left), `_finish` cancels it.
        """
        if prefill_leg.done():
            _log_late_failure(prefill_leg)
            return
        self._background[pairing_id] = prefill_leg
        prefill_leg.add_done_callback(lambda _: self._background.pop(pairing_id, None))
        prefill_leg.add_done_callback(_log_late_failure)

    def _finish(self, rec: RequestRecord, outcome: str) -> None:
        rec.outcome, rec.t_end = outcome, self._clock()
        leftover = self._background.get(rec.pairing_id or "")
        if leftover is not None and outcome != "ok":
            leftover.cancel()
        mode = rec.mode
        self._metrics.requests.labels(rec.endpoint, mode, outcome).inc()
        self._metrics.e2e.labels(rec.endpoint, mode).observe(rec.t_end - rec.t_start)
        if rec.decode_first_byte is not None and rec.decode_sent is not None:
            self._metrics.leg.labels("decode", mode).observe(rec.t_end - rec.decode_sent)
        self._timings.add(rec)
        data = rec.to_json()
        fields = {
            k: data[k]
            for k in (
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
        }
        fields["e2e_ms"] = round((rec.t_end - rec.t_start) * 1000.0, 3)
        logger.info(
            "request %s %s (%s, %s attempt(s))",
            rec.request_id,
            outcome,
            rec.mode,
            rec.attempts,
            extra={"fields": fields},
        )

    async def aclose(self) -> None:
        tasks = list(self._background.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def _headers(ids: protocol.PairingIds) -> dict[str, str]:
    return {"X-Request-Id": ids.request_id}


def _failed(task: asyncio.Task[Any]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


def _log_late_failure(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        logger.warning("prefill leg failed after decode had answered: %s", error)
