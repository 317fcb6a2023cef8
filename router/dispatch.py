"""Executes one client request over the pools: push (both legs at once), pull (prefill, then decode) or bypass.

The dispatcher only sequences awaits: bodies come from `protocol`, the route from the decider, workers from the
policies, I/O from `upstream`. One attempt = one pair of fresh ids. An attempt that fails before anything reached
the client is retried (once, by default) with fresh ids on another worker of the failing leg's role, unless the
failure was the client's own request (a worker's 4xx). Every leg runs under its own deadline and is raced against
its worker being lost (ejected, drained, removed): a hung worker costs the client seconds, not the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from router import protocol, upstream
from router.answer import Collect, JsonAnswer, StreamAnswer, StreamEnd, read_first_events
from router.config import Settings
from router.decider import AnswerCheck, Decider, Decision, NoDecider, Outcome, Route, Turn
from router.domain import Mode, NixlIdentity, RequestInfo, Role, WorkerView
from router.errors import (
    NoHealthyWorker,
    RouterError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatus,
    UpstreamTimeout,
)
from router.legs.base import LegTransport
from router.legs.httpx import HttpxLegs
from router.metrics import Metrics
from router.policy import LeastInFlight, Policy, make_policy
from router.pool import Pool, Tracked, WorkerState
from router.retokenize import Retokenizer
from router.sse import EventFramer, RelayCheck, error_of
from router.timings import RequestRecord, TimingLog

logger = logging.getLogger("kvpush.dispatch")

Answer = JsonAnswer | StreamAnswer
DECODE_ONLY = "decode-only"  # the record's mode when the fallback served a request
BYPASS = "bypass"  # the record's mode when the decider skipped prefill
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


@dataclass
class ClientRequest:
    """One validated client request and its timing record."""

    body: dict[str, Any]
    info: RequestInfo
    record: RequestRecord
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names, for the decider


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        legs: LegTransport | httpx.AsyncClient,
        metrics: Metrics,
        timings: TimingLog,
        clock: Callable[[], float] = time.monotonic,
        decider: Decider | None = None,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._legs: LegTransport = HttpxLegs(legs) if isinstance(legs, httpx.AsyncClient) else legs
        self._metrics = metrics
        self._timings = timings
        self._clock = clock
        self._decider: Decider = decider or NoDecider()
        self._learns = not isinstance(self._decider, NoDecider)  # NoDecider.record does nothing: skip the parse
        self._policies: dict[Role, Policy] = {
            Role.PREFILL: make_policy(settings.prefill_policy, settings.prefill_policy_options),
            Role.DECODE: make_policy(settings.decode_policy, settings.decode_policy_options),
        }
        self._background: dict[str, asyncio.Task[Any]] = {}  # pairing id → prefill leg still running
        self._checks = Retokenizer(self._legs, clock)  # the decider's answer checks (router/retokenize.py)
        self._tokenizers = LeastInFlight()  # where a check goes when no prefill served its request
        self._wants_ids = self._decider.wants_answer and self._decider.wants_token_ids
        self._json_headers = {"content-type": "application/json"}

    @property
    def decider(self) -> Decider:
        return self._decider

    def new_record(self, request_id: str, info: RequestInfo) -> RequestRecord:
        return RequestRecord(
            request_id=request_id,
            endpoint=str(info.endpoint),
            mode=str(self._settings.mode),
            stream=info.stream,
            t_start=self._clock(),
        )

    async def handle(self, request: ClientRequest) -> Answer:
        """The answer to relay, or a RouterError. The record is finished here, or by the StreamAnswer's aclose."""
        exclude: dict[Role, set[str]] = {Role.PREFILL: set(), Role.DECODE: set()}
        turn = Turn(request.info, request.body, request.headers, self._settings.mode)
        try:
            for attempt in range(1 + self._settings.retries):
                request.record.new_attempt()
                decodes = self._pool.candidates(Role.DECODE, frozenset(exclude[Role.DECODE]))
                prefills = self._pool.candidates(Role.PREFILL, frozenset(exclude[Role.PREFILL]))
                decision = self._decide(turn, decodes, prefills)
                try:
                    answer = await self._attempt(request, turn, decision, decodes, prefills)
                except UpstreamError as error:
                    self._tell(turn, decision, request.record, ok=False)
                    exclude[error.leg].add(error.worker)
                    last = attempt == self._settings.retries
                    others = self._pool.candidates(error.leg, frozenset(exclude[error.leg]))
                    if last or not error.may_retry or not others:
                        raise
                    logger.warning("request %s: retrying with fresh ids after: %s", request.record.request_id, error)
                    self._metrics.child(self._metrics.retries, str(error.leg)).inc()
                    continue
                if isinstance(answer, JsonAnswer):
                    self._tell(turn, decision, request.record, ok=True, answer=answer.content)
                    self._finish(request.record, "ok")
                    if self._asks_ids_for_us(request.body):
                        answer = JsonAnswer(answer.status, protocol.scrub_token_ids(answer.content))
                return answer
            raise AssertionError("unreachable: the attempt loop returns or raises")
        except RouterError as error:
            self._metrics.child(self._metrics.errors, error.kind).inc()
            self._finish(request.record, error.kind)
            raise
        except asyncio.CancelledError:
            self._finish(request.record, "client_gone")
            raise

    def _decide(self, turn: Turn, decodes: Sequence[WorkerView], prefills: Sequence[WorkerView]) -> Decision:
        if not prefills and self._settings.fallback == DECODE_ONLY:
            return Decision(Route.FALLBACK, reason="no healthy prefill worker")
        decision = self._decider.decide(turn, decodes, prefills, self._clock())
        if decision.route not in (Route.BYPASS, Route(str(self._settings.mode))):
            logger.warning("decider %s chose %s; routing by the mode instead", self._decider.name, decision.route)
            decision = Decision(Route(str(self._settings.mode)), decision.decode, decision.prefill)
        return decision

    async def _attempt(
        self,
        request: ClientRequest,
        turn: Turn,
        decision: Decision,
        decodes: Sequence[WorkerView],
        prefills: Sequence[WorkerView],
    ) -> Answer:
        rec, info = request.record, request.info
        decode = self._select(Role.DECODE, info, decodes, decision.decode)
        self._metrics.child(self._metrics.decisions, str(decision.route)).inc()
        ids = protocol.mint_ids()
        if decision.route in (Route.BYPASS, Route.FALLBACK):
            rec.mode = DECODE_ONLY if decision.route is Route.FALLBACK else BYPASS
            rec.prefill_worker, rec.decode_worker = None, decode.spec.id
            rec.pairing_id, rec.transfer_id = ids.request_id, None
            if decision.route is Route.FALLBACK:
                logger.warning("request %s: no healthy prefill worker; decode-only fallback", rec.request_id)
            return await self._decode(request, turn, decision, decode, request.body, ids)
        prefill = self._select(Role.PREFILL, info, prefills, decision.prefill)
        rec.mode = str(self._settings.mode)
        rec.prefill_worker, rec.decode_worker = prefill.spec.id, decode.spec.id
        rec.pairing_id, rec.transfer_id = ids.request_id, ids.transfer_id
        if self._settings.mode is Mode.PULL:
            params = await self._prefill(request, prefill, ids)
            body = protocol.pull_decode_body(request.body, params)
            return await self._decode(request, turn, decision, decode, body, ids)
        identity = prefill.identity
        if identity is None:  # auto: learn the identity from a first, sequential prefill
            await self._prefill(request, prefill, ids)
            identity = prefill.identity
            if identity is None:
                raise UpstreamProtocolError("did not state its NIXL identity", leg=Role.PREFILL, worker=prefill.spec.id)
            body = protocol.push_decode_body(request.body, identity, ids)
            return await self._decode(request, turn, decision, decode, body, ids)
        return await self._push(request, turn, decision, prefill, decode, identity, ids)

    def _select(
        self, role: Role, info: RequestInfo, candidates: Sequence[WorkerView], prefer: str | None
    ) -> WorkerState:
        if not candidates:
            raise NoHealthyWorker(f"no healthy {role} worker is available")
        if prefer is not None and any(v.id == prefer for v in candidates):
            return self._pool.get(prefer)
        return self._pool.get(self._policies[role].select(list(candidates), info).id)

    async def _push(
        self,
        request: ClientRequest,
        turn: Turn,
        decision: Decision,
        prefill: WorkerState,
        decode: WorkerState,
        identity: NixlIdentity,
        ids: protocol.PairingIds,
    ) -> Answer:
        """Both legs at once; the answer is decode's, as soon as its first byte is in."""
        decode_body = protocol.push_decode_body(request.body, identity, ids)
        prefill_leg = asyncio.create_task(self._prefill(request, prefill, ids))
        decode_leg = asyncio.create_task(self._decode(request, turn, decision, decode, decode_body, ids))
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
        self._detach_prefill_leg(ids.request_id, prefill_leg)
        return answer

    async def _prefill(
        self, request: ClientRequest, worker: WorkerState, ids: protocol.PairingIds
    ) -> protocol.KvTransferParams:
        """The prefill leg under its deadline; returns the kv_transfer_params it answered with."""
        rec, wid, deadline = request.record, worker.spec.id, self._settings.timeouts.prefill
        body = protocol.encode(protocol.prefill_body(request.body, request.info.endpoint, ids.transfer_id))
        url = f"{worker.spec.url}{request.info.endpoint.path}"
        rec.prefill_sent = self._clock()
        with self._pool.track(wid, request.info.prompt_tokens) as tracked:
            try:
                async with _unless_lost(tracked, Role.PREFILL), asyncio.timeout(deadline):
                    _, answer = await upstream.post_json(
                        self._legs, url, body, self._headers(ids), leg=Role.PREFILL, worker=wid
                    )
            except TimeoutError:
                raise UpstreamTimeout(
                    f"no answer within the prefill deadline ({deadline:g} s)", leg=Role.PREFILL, worker=wid
                ) from None
            except UpstreamError as error:
                self._passive_check(error)
                raise
        rec.prefill_done = self._clock()
        self._pool.report(wid, ok=True)
        self._metrics.child(self._metrics.leg, "prefill", rec.mode).observe(rec.prefill_done - rec.prefill_sent)
        return self._check_prefill_answer(worker, answer)

    def _check_prefill_answer(self, worker: WorkerState, answer: dict[str, Any]) -> protocol.KvTransferParams:
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
        if worker.spec.identity is None and (identity := protocol.identity_from(params)) is not None:
            self._pool.learn_identity(wid, identity)
        return params

    async def _decode(
        self,
        request: ClientRequest,
        turn: Turn,
        decision: Decision,
        worker: WorkerState,
        body: dict[str, Any],
        ids: protocol.PairingIds,
    ) -> Answer:
        """Opens the decode leg and waits for its first event (stream) or its whole answer (non-stream)."""
        rec, wid, t = request.record, worker.spec.id, self._settings.timeouts
        url = f"{worker.spec.url}{request.info.endpoint.path}"
        scrub = self._asks_ids_for_us(request.body)
        raw = protocol.encode(protocol.asking_token_ids(body) if scrub else body)
        cleanup = contextlib.AsyncExitStack()
        tracked = cleanup.enter_context(self._pool.track(wid, request.info.prompt_tokens))
        rec.decode_sent = self._clock()
        try:
            if not request.info.stream:
                try:
                    async with _unless_lost(tracked, Role.DECODE), asyncio.timeout(t.decode_total):
                        content, _ = await upstream.post_json(
                            self._legs, url, raw, self._headers(ids), leg=Role.DECODE, worker=wid
                        )
                except TimeoutError:
                    raise UpstreamTimeout(
                        f"no answer within the decode deadline ({t.decode_total:g} s)", leg=Role.DECODE, worker=wid
                    ) from None
                rec.decode_first_byte = self._clock()
                self._observe_first_byte(rec)
                await cleanup.aclose()
                return JsonAnswer(200, content)
            framer = EventFramer(self._settings.limits.max_event_bytes)
            try:
                async with _unless_lost(tracked, Role.DECODE), asyncio.timeout(t.decode_first_byte):
                    response = await upstream.open_stream(
                        self._legs, url, raw, self._headers(ids), leg=Role.DECODE, worker=wid
                    )
                    cleanup.push_async_callback(response.aclose)
                    first, rest = await read_first_events(response, framer, worker=wid)
                    if (message := error_of(first[0])) is not None:  # nothing reached the client yet: retryable
                        raise UpstreamError(f"failed before its first token: {message}", leg=Role.DECODE, worker=wid)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"no first byte within {t.decode_first_byte:g} s (did the KV arrive?)",
                    leg=Role.DECODE,
                    worker=wid,
                ) from None
        except BaseException as error:
            if isinstance(error, UpstreamError):
                self._passive_check(error)
            await cleanup.aclose()
            raise
        rec.decode_first_byte = self._clock()
        self._observe_first_byte(rec)

        def on_close(end: StreamEnd) -> None:
            self._tell(turn, decision, rec, ok=end.outcome == "ok", usage=end.usage, text=end.text, ids=end.token_ids)
            self._finish(rec, end.outcome)

        return StreamAnswer(
            response,
            first,
            rest,
            framer,
            RelayCheck(self._settings.limits.max_event_bytes),
            worker=wid,
            cleanup=cleanup,
            on_close=on_close,
            collect=self._collect(scrub),
        )

    def _asks_ids_for_us(self, client_body: Mapping[str, Any]) -> bool:
        """The decider wants the answer's token ids and the client did not ask for them: decode is asked, and
        what the client gets is scrubbed of them."""
        return self._wants_ids and not protocol.asks_token_ids(client_body)

    def _collect(self, scrub: bool) -> Collect | None:
        if not self._decider.wants_answer:
            return None
        ids_of = protocol.token_ids_of if self._wants_ids else None
        return Collect(protocol.text_of, ids_of, protocol.scrub_token_ids if scrub else None)

    def _headers(self, ids: protocol.PairingIds) -> dict[str, str]:
        return {**self._json_headers, protocol.REQUEST_ID_HEADER: ids.request_id}

    def _observe_first_byte(self, rec: RequestRecord) -> None:
        mode = rec.mode
        if rec.decode_worker is not None:
            self._pool.report(rec.decode_worker, ok=True)
        if rec.ttft is not None:
            self._metrics.child(self._metrics.ttft, rec.endpoint, mode).observe(rec.ttft)
            self._metrics.child(self._metrics.decode_ttft, mode, rec.decode_worker or "").observe(rec.ttft)
        if rec.handoff is not None:
            self._metrics.child(self._metrics.handoff, mode).observe(max(0.0, rec.handoff))

    def _passive_check(self, error: UpstreamError) -> None:
        """Feeds a leg's failure to the worker's health, unless the client's request was at fault."""
        if isinstance(error, UpstreamStatus) and error.client_fault:
            return
        if not isinstance(error, _WorkerLost):  # health already knows about a lost worker
            self._pool.report(error.worker, ok=False, hard=error.kind == "connect", reason=str(error))
        # an ejection this causes reaches the decider through the pool's on_gone (router/service.py)

    def _tell(
        self,
        turn: Turn,
        decision: Decision,
        rec: RequestRecord,
        *,
        ok: bool,
        answer: bytes | None = None,
        usage: dict[str, Any] | None = None,
        text: str | None = None,
        ids: tuple[int, ...] | None = None,
    ) -> None:
        """The attempt's Outcome for the decider (skipped for NoDecider, which learns nothing)."""
        if not self._learns or rec.decode_worker is None:
            return
        if answer is not None:
            parsed = _json_or_none(answer)
            usage = protocol.usage_of(parsed)
            text = protocol.text_of(parsed) if self._decider.wants_answer else None
            found = protocol.token_ids_of(parsed) if self._wants_ids else None
            ids = None if found is None else tuple(found)
        details = usage.get("prompt_tokens_details") if usage else None
        outcome = Outcome(
            ok=ok,
            decode=rec.decode_worker,
            prefill=rec.prefill_worker,
            prompt_tokens=_int_or_none(usage, "prompt_tokens"),
            cached_tokens=_int_or_none(details if isinstance(details, dict) else None, "cached_tokens"),
            completion_tokens=_int_or_none(usage, "completion_tokens"),
            answer=text,
            answer_token_ids=ids,
        )
        try:
            check = self._decider.record(turn, decision, outcome, self._clock())
        except Exception:  # a decider's bug must not fail a request that is already answered
            logger.exception("decider %s failed to record an outcome", self._decider.name)
            return
        if check is not None:
            self._submit_check(check, rec.prefill_worker, turn.info)

    def _submit_check(self, check: AnswerCheck, prefill: str | None, info: RequestInfo) -> None:
        """To the prefill worker that served the request while it is healthy (the prefill policy chose it), else
        to the healthy prefill worker with the fewest requests in flight, in turn on ties (a turn decode served
        alone), else to the decode worker itself. A prefill worker serves the same model, so it tokenizes the
        same, and the /tokenize call stays off the decode worker streaming others' tokens."""
        healthy = self._pool.candidates(Role.PREFILL)
        served = [w for w in healthy if w.id == prefill]
        target = (served[0] if served else self._tokenizers.select(healthy, info)).id if healthy else check.worker
        if target in self._pool:
            self._checks.submit(self._pool.get(target).spec.url, check)

    def _detach_prefill_leg(self, pairing_id: str, prefill_leg: asyncio.Task[Any]) -> None:
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
        if rec.t_end is not None:
            return  # finished already (a stream that opened as the request was given up closed first)
        rec.outcome, rec.t_end = outcome, self._clock()
        leftover = self._background.get(rec.pairing_id or "")
        if leftover is not None and outcome != "ok":
            leftover.cancel()
        mode = rec.mode
        self._metrics.child(self._metrics.requests, rec.endpoint, mode, outcome).inc()
        self._metrics.child(self._metrics.e2e, rec.endpoint, mode).observe(rec.t_end - rec.t_start)
        if rec.decode_first_byte is not None and rec.decode_sent is not None:
            self._metrics.child(self._metrics.leg, "decode", mode).observe(rec.t_end - rec.decode_sent)
        self._timings.add(rec)
        if logger.isEnabledFor(logging.INFO):
            data = rec.to_json()
            fields = {k: data[k] for k in _LOG_FIELDS}
            fields["e2e_ms"] = round((rec.t_end - rec.t_start) * 1000.0, 3)
            logger.info(
                "request %s %s (%s, %s attempt(s))",
                rec.request_id,
                outcome,
                rec.mode,
                rec.attempts,
                extra={"fields": fields},
            )

    def forget(self, worker_id: str) -> None:
        """A worker went down or left the pool (the pool's on_gone): the decider drops what it knew of it."""
        self._decider.forget(worker_id)

    async def aclose(self) -> None:
        await self._checks.aclose()
        tasks = list(self._background.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        await self._legs.aclose()


class _WorkerLost(UpstreamError):
    """The leg's worker was ejected, drained or removed before the leg answered (retryable elsewhere). With no
    other worker to retry on, the client gets a 503: the service is unavailable, the request itself was fine."""

    status = 503
    type = "service_unavailable"
    kind = "worker_lost"


@contextlib.asynccontextmanager
async def _unless_lost(tracked: Tracked, leg: Role) -> AsyncIterator[None]:
    """Runs the block unless the leg's worker is lost first; then the block is cancelled and _WorkerLost raised.

    The loss cancels the task only while it is suspended inside the block (the listener is called synchronously
    and removed on the way out), so a cancellation can never land on whatever the task does next."""
    task = asyncio.current_task()
    assert task is not None
    if tracked.is_lost:
        raise _WorkerLost(f"was out of rotation ({tracked.reason})", leg=leg, worker=tracked.worker_id)
    fired = False

    def fire() -> None:
        nonlocal fired
        if asyncio.current_task() is not task:  # the task itself marking its own worker: it is not waiting
            fired = True
            task.cancel()

    tracked.listen(fire)
    try:
        yield
    except asyncio.CancelledError:
        if fired and task.uncancel() == 0:
            raise _WorkerLost(
                f"was taken out of rotation before it answered ({tracked.loss})", leg=leg, worker=tracked.worker_id
            ) from None
        raise
    else:
        if fired:  # the block swallowed the cancellation and finished: the request goes on, uncancelled
            task.uncancel()
    finally:
        tracked.listen(None)


def _json_or_none(raw: bytes) -> Any:
    try:
        return protocol.decode_json(raw)
    except ValueError:
        return None


def _int_or_none(mapping: dict[str, Any] | None, key: str) -> int | None:
    value = mapping.get(key) if mapping else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _failed(task: asyncio.Task[Any]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


def _log_late_failure(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        logger.warning("prefill leg failed after decode had answered: %s", error)
