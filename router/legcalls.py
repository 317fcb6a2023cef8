"""One leg to one worker, start to first byte: the body sent, the deadline, the worker's health told, the span.

The dispatcher (router/dispatch.py) sequences legs; `LegCalls` runs each one. `prefill` answers with what P
returned (its params, its cache hit); `decode` with decode's whole JSON answer or its primed stream
(router/answer.py), which then owns what the leg still holds. Each leg runs under its own deadline, raced against
its worker being lost (router/workers/pool.py `unless_lost`). Tracing is one hook, `leg_span`: the leg's span is opened
around the leg and ended with the error's kind however the leg fails; the dispatcher never sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from router import legtasks, protocol, upstream, usage
from router.answer import JsonAnswer, StreamAnswer, read_first_events
from router.apis import api_of
from router.config import Settings
from router.deciders.conversation import SESSION_HEADER, session_of
from router.domain import RequestInfo, Role
from router.errors import RouterError, UpstreamError, UpstreamProtocolError, UpstreamStatus, UpstreamTimeout
from router.feedback import Feedback, StreamClose
from router.legs.base import LegResponse, LegTransport
from router.metrics import Metrics
from router.sse import EventFramer, RelayCheck, error_of
from router.timings import RequestRecord
from router.tracing import semconv
from router.tracing.trace import LegSpan, RequestTrace
from router.workers.pool import Pool, Tracked, WorkerLost, WorkerState, unless_lost
from router.workers.ranks import rank_headers, stated_rank

Answer = JsonAnswer | StreamAnswer


@dataclass
class ClientRequest:
    """One validated client request and its timing record."""

    body: dict[str, Any]
    info: RequestInfo
    record: RequestRecord
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names, for the decider
    prefill: str | None = None  # the prefill worker a gateway's EPP named (router/gateway.py), a pool member
    owner: str | None = None  # the decode worker that alone can serve it (router/responses.py), a pool member
    trace: RequestTrace | None = None  # its trace (router/tracing), None with tracing off


class LegCalls:
    """Runs the legs of the dispatcher's attempts (one instance per dispatcher)."""

    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        legs: LegTransport,
        metrics: Metrics,
        feedback: Feedback,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._legs = legs
        self._metrics = metrics
        self._feedback = feedback
        self._clock = clock
        self._json_headers = {"content-type": "application/json"}

    async def prefill(
        self, request: ClientRequest, worker: WorkerState, ids: protocol.PairingIds, rank: int | None
    ) -> legtasks.Prefilled:
        """The prefill leg, pinned to `rank` (a server with data-parallel ranks)."""
        with leg_span(request, semconv.PREFILL_SPAN, ids, worker) as span:
            headers = {**self._headers(ids, request), **rank_headers(rank), **(span.headers if span else {})}
            prefilled = await self._prefill_leg(request, worker, ids, headers, rank)
            if span is not None:
                span.end()
        return prefilled

    async def _prefill_leg(
        self,
        request: ClientRequest,
        worker: WorkerState,
        ids: protocol.PairingIds,
        headers: dict[str, str],
        rank: int | None,
    ) -> legtasks.Prefilled:
        """The prefill leg under its deadline; returns the kv_transfer_params it answered with and its cache hit."""
        rec, wid, deadline = request.record, worker.spec.id, self._settings.timeouts.prefill
        body = protocol.encode(protocol.prefill_body(request.body, request.info.endpoint, ids.transfer_id))
        url = f"{worker.spec.url}{request.info.endpoint.path}"
        rec.prefill_sent = self._clock()
        with self._pool.track(wid, request.info.prompt_tokens, rank) as tracked:
            try:
                async with unless_lost(tracked, Role.PREFILL), asyncio.timeout(deadline):
                    _, answer = await upstream.post_json(self._legs, url, body, headers, leg=Role.PREFILL, worker=wid)
            except TimeoutError:
                reason = f"no answer within the prefill deadline ({deadline:g} s)"
                if rank is not None:  # a rank that does not answer is held out; the server's health is its probes'
                    self._pool.report_rank(wid, rank, ok=False, reason=reason)
                raise UpstreamTimeout(reason, leg=Role.PREFILL, worker=wid) from None
            except UpstreamError as error:
                self.passive_check(error, rank)
                raise
        rec.prefill_done = self._clock()
        self._pool.report(wid, ok=True)
        if rank is not None:
            self._pool.report_rank(wid, rank, ok=True)
        self._metrics.child(self._metrics.leg, "prefill", rec.mode).observe(rec.prefill_done - rec.prefill_sent)
        return legtasks.Prefilled(self._check_prefill_answer(worker, answer, rank), usage.prefill_cached(answer))

    def _check_prefill_answer(
        self, worker: WorkerState, answer: dict[str, Any], rank: int | None
    ) -> protocol.KvTransferParams:
        wid, mode = worker.spec.id, self._settings.mode
        params = protocol.kv_params_of(answer)
        if params is None:
            raise UpstreamProtocolError(
                "answered without kv_transfer_params: is it started with a KV connector (kv_producer)?",
                leg=Role.PREFILL,
                worker=wid,
            )
        stated = params.get("transfer_mode")
        if stated is not None and stated != str(mode):
            raise UpstreamProtocolError(
                f"runs a {stated}-mode connector but the router is in {mode} mode", leg=Role.PREFILL, worker=wid
            )
        identity = protocol.identity_from(params)
        if identity is None:
            return params
        if worker.spec.dp_size > 1 and stated_rank(identity) != rank:
            raise UpstreamProtocolError(
                f"answered from data-parallel rank {stated_rank(identity)} a leg pinned to rank {rank}: does it honour "
                "the X-data-parallel-rank header, and is its dp size configured right?",
                leg=Role.PREFILL,
                worker=wid,
            )
        if worker.spec.identity is None and (why := self._pool.learn_identity(wid, identity, rank)) is not None:
            raise UpstreamProtocolError(why, leg=Role.PREFILL, worker=wid)
        return params

    async def decode(
        self,
        request: ClientRequest,
        close: StreamClose,
        worker: WorkerState,
        body: dict[str, Any],
        ids: protocol.PairingIds,
        rank: int | None,
        *,
        report: bool = True,
    ) -> Answer:
        """Opens the decode leg (pinned to `rank` when given) and waits for its first event (stream) or its whole
        answer (non-stream). Traced, the leg's span ends here on failure or with a JSON answer, else when the stream
        closes (its StreamClose). With `report` false a failure is not fed to decode's health: the caller does,
        once it knows the prefill leg did not cause it (a push's concurrent legs)."""
        rec, wid, info = request.record, worker.spec.id, request.info
        api = api_of(info.endpoint)
        scrub = info.endpoint.openai_choices and self._feedback.asks_ids_for_us(request.body)
        raw = protocol.encode(protocol.asking_token_ids(body) if scrub else body)
        framer = EventFramer(self._settings.limits.max_event_bytes)
        with leg_span(request, semconv.DECODE_SPAN, ids, worker) as span:
            headers = {**self._headers(ids, request), **rank_headers(rank), **(span.headers if span else {})}
            leg = _DecodeLeg(wid, f"{worker.spec.url}{info.endpoint.path}", headers)
            cleanup = contextlib.AsyncExitStack()
            tracked = cleanup.enter_context(self._pool.track(wid, info.prompt_tokens, rank))
            rec.decode_sent = self._clock()
            try:
                if not info.stream:
                    content = await self._decode_json(tracked, leg, raw)
                    await cleanup.aclose()
                else:
                    response, first, rest = await self._open_decode_stream(tracked, leg, raw, framer, cleanup, api.held)
            except BaseException as error:
                if report and isinstance(error, UpstreamError):
                    self.passive_check(error, rank)
                await cleanup.aclose()
                raise
        rec.decode_first_byte = self._clock()
        self._observe_first_byte(rec, request.trace)
        if span is not None:
            span.first_byte(rec.handoff)
            if not info.stream:
                span.end()
            else:
                close = replace(close, decode_leg=span)
        if not info.stream:
            return JsonAnswer(200, content)
        check = RelayCheck(self._settings.limits.max_event_bytes, api.usage_of)
        collect = self._feedback.collect(scrub)
        return StreamAnswer(
            response, first, rest, framer, check, worker=wid, cleanup=cleanup, on_close=close, collect=collect, api=api
        )

    async def _decode_json(self, tracked: Tracked, leg: _DecodeLeg, raw: bytes) -> bytes:
        """A non-stream decode leg: its whole answer, within the decode deadline."""
        deadline = self._settings.timeouts.decode_total
        try:
            async with unless_lost(tracked, Role.DECODE), asyncio.timeout(deadline):
                content, _ = await upstream.post_json(
                    self._legs, leg.url, raw, leg.headers, leg=Role.DECODE, worker=leg.worker
                )
        except TimeoutError:
            raise UpstreamTimeout(
                f"no answer within the decode deadline ({deadline:g} s)", leg=Role.DECODE, worker=leg.worker
            ) from None
        return content

    async def _open_decode_stream(
        self,
        tracked: Tracked,
        leg: _DecodeLeg,
        raw: bytes,
        framer: EventFramer,
        cleanup: contextlib.AsyncExitStack,
        held: Callable[[bytes], bool] | None = None,
    ) -> tuple[LegResponse, list[bytes], AsyncGenerator[bytes, None]]:
        """A stream decode leg, opened: the response and its first events (past the ones `held` holds back),
        within the first-byte deadline. An error event before the first token is retryable: nothing reached the
        client yet."""
        deadline, wid = self._settings.timeouts.decode_first_byte, leg.worker
        try:
            async with unless_lost(tracked, Role.DECODE), asyncio.timeout(deadline):
                response = await upstream.open_stream(
                    self._legs, leg.url, raw, leg.headers, leg=Role.DECODE, worker=wid
                )
                cleanup.push_async_callback(response.aclose)
                first, rest = await read_first_events(response, framer, worker=wid, held=held)
                if (message := _first_error(first)) is not None:
                    raise UpstreamError(f"failed before its first token: {message}", leg=Role.DECODE, worker=wid)
        except TimeoutError:
            raise UpstreamTimeout(
                f"no first byte within {deadline:g} s (did the KV arrive?)", leg=Role.DECODE, worker=wid
            ) from None
        return response, first, rest

    def _headers(self, ids: protocol.PairingIds, request: ClientRequest) -> dict[str, str]:
        headers = {**self._json_headers, protocol.REQUEST_ID_HEADER: ids.request_id}
        if self._settings.kv_events.enabled:  # the engines tag the blocks they store with it (KV events)
            session = session_of(request.body, request.headers)
            if session is not None and session.isascii() and session.isprintable():
                headers[SESSION_HEADER] = session
        return headers

    def _observe_first_byte(self, rec: RequestRecord, trace: RequestTrace | None) -> None:
        """TTFT and handoff observed; a sampled trace's id goes with them as the exemplar (OpenMetrics)."""
        mode = rec.mode
        exemplar = None if trace is None else trace.exemplar()
        if rec.decode_worker is not None:
            self._pool.report(rec.decode_worker, ok=True)
        m = self._metrics
        if rec.ttft is not None:
            m.observe(m.child(m.ttft, rec.endpoint, mode), rec.ttft, exemplar)
            m.observe(m.child(m.decode_ttft, mode, rec.decode_worker or ""), rec.ttft, exemplar)
        if rec.handoff is not None:
            m.observe(m.child(m.handoff, mode), max(0.0, rec.handoff), exemplar)

    def passive_check(self, error: UpstreamError, rank: int | None = None) -> None:
        """Feeds a leg's failure to the worker's health, unless the client's request was at fault. A leg pinned to
        a data-parallel rank that the server answered (or timed out on) counts against that rank alone; a refused
        connection is the whole server's."""
        if isinstance(error, UpstreamStatus) and error.client_fault:
            return
        if isinstance(error, WorkerLost):  # health already knows about a lost worker
            return
        if rank is not None and error.kind != "connect":
            self._pool.report_rank(error.worker, rank, ok=False, reason=str(error))
        else:
            self._pool.report(error.worker, ok=False, hard=error.kind == "connect", reason=str(error))
        # an ejection this causes reaches the decider through the pool's on_gone (router/service.py)


@contextlib.contextmanager
def leg_span(
    request: ClientRequest, name: str, ids: protocol.PairingIds, worker: WorkerState
) -> Iterator[LegSpan | None]:
    """The tracing hook of a leg: its span (None when the request is not traced), ended with the error's kind
    when the leg raises; a leg that succeeds ends (or hands on) its span itself."""
    trace = request.trace
    if trace is None:
        yield None
        return
    span = trace.leg(name, attempt=request.record.attempts, pairing_id=ids.request_id, worker=worker.spec.url)
    try:
        yield span
    except BaseException as error:
        _end_failed(span, error)
        raise


@dataclass(frozen=True)
class _DecodeLeg:
    worker: str
    url: str
    headers: dict[str, str]


def _end_failed(span: LegSpan, error: BaseException) -> None:
    """Ends the span of a leg that raised: with the error kind (and the worker's status), or cancelled (the
    client left, or the other leg failed first)."""
    if isinstance(error, UpstreamStatus):
        span.end(error.kind, status=error.upstream_status)
    elif isinstance(error, RouterError):
        span.end(error.kind)
    else:
        span.end(semconv.CANCELLED if isinstance(error, asyncio.CancelledError) else RouterError.kind)


def _first_error(events: list[bytes]) -> str | None:
    return next((message for event in events if (message := error_of(event)) is not None), None)
