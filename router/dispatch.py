"""Executes one client request over the pools: push (both legs at once), pull (prefill, then decode) or bypass.

The dispatcher only sequences awaits: bodies come from `protocol`, the route from the decider, workers from the
policies, I/O from `upstream`, what the decider is told from `feedback`, a request's end from `finish`. One
attempt = one pair of fresh ids. An attempt that fails before anything reached the client is retried (once, by
default) with fresh ids on another worker of the failing leg's role, unless the failure was the client's own
request (a worker's 4xx). Every leg runs under its own deadline and is raced against its worker being lost
(ejected, drained, removed: router/workers/pool.py `unless_lost`): a hung worker costs the client seconds, not the
deadline. A stream's end goes forward from its answer (router/feedback.py `StreamClose`), never back here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from router import legtasks, protocol, responses, usage
from router.answer import JsonAnswer, known, true_cached
from router.apis import api_of
from router.config import Settings
from router.decider import Decider, Decision, NoDecider, Route, Turn
from router.domain import Endpoint, Fallback, NixlIdentity, RequestInfo, Role, WorkerView
from router.errors import (
    NoHealthyWorker,
    RouterError,
    Unpairable,
    UpstreamError,
    UpstreamProtocolError,
)
from router.feedback import Feedback, StreamClose
from router.finish import Finisher
from router.legcalls import Answer, LegCalls
from router.legcalls import ClientRequest as ClientRequest
from router.legs.base import LegTransport
from router.metrics import Metrics
from router.policy import Policy, make_policy
from router.timings import RequestRecord, TimingLog
from router.tracing import semconv
from router.workers.pairing import BlockSizes, block_size_mismatch, parallelism_mismatch
from router.workers.pool import Pool, WorkerState
from router.workers.ranks import RankPick

logger = logging.getLogger("kvpush.dispatch")
LOAD_AWARE = frozenset({"least-loaded", "load-aware"})  # decode policies that read engine load: decode's rank too


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        legs: LegTransport,
        metrics: Metrics,
        timings: TimingLog,
        clock: Callable[[], float] = time.monotonic,
        decider: Decider | None = None,
    ) -> None:
        self._settings = settings
        self._route = Route.of(settings.mode)  # both legs, as the mode says
        self._pool = pool
        self._legs = legs
        self._metrics = metrics
        self._clock = clock
        self.feedback = Feedback(decider or NoDecider(), pool, self._legs, clock)
        self.finisher = Finisher(metrics, timings, clock)
        self._policies: dict[Role, Policy] = {
            Role.PREFILL: make_policy(settings.prefill_policy, settings.prefill_policy_options),
            Role.DECODE: make_policy(settings.decode_policy, settings.decode_policy_options),
        }
        self._calls = LegCalls(settings, pool, legs, metrics, self.feedback, clock)
        self._pin_decode = settings.decode_policy in LOAD_AWARE  # else a DP decode server picks its own rank

    def new_record(self, request_id: str, info: RequestInfo) -> RequestRecord:
        return RequestRecord(
            request_id=request_id,
            endpoint=str(info.endpoint),
            mode=self._route.label,
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
                decision = self._decide(turn, decodes, prefills, request.owner)
                try:
                    answer = await self._attempt(request, turn, decision, decodes, prefills)
                except UpstreamError as error:
                    self.feedback.tell(turn, decision, request.record, ok=False)
                    if request.owner is not None:
                        raise  # no other decode holds its conversation
                    exclude[error.leg].add(error.worker)
                    self._retry_or_raise(error, attempt, exclude[error.leg], request.record)
                    continue
                return self._answered(request, turn, decision, answer)
            raise AssertionError("unreachable: the attempt loop returns or raises")
        except RouterError as error:
            self._metrics.child(self._metrics.errors, error.kind).inc()
            self.finisher.finish(request.record, error.kind, request.trace, status=error.http_status)
            raise
        except asyncio.CancelledError:
            self.finisher.finish(request.record, semconv.CLIENT_GONE, request.trace)
            raise

    def _retry_or_raise(self, error: UpstreamError, attempt: int, excluded: set[str], rec: RequestRecord) -> None:
        """Raises `error` unless another attempt may go to another worker of the failing leg's role."""
        others = self._pool.candidates(error.leg, frozenset(excluded))
        if attempt == self._settings.retries or not error.may_retry or not others:
            raise error
        logger.warning("request %s: retrying with fresh ids after: %s", rec.request_id, error)
        self._metrics.child(self._metrics.retries, str(error.leg)).inc()

    def _answered(self, request: ClientRequest, turn: Turn, decision: Decision, answer: Answer) -> Answer:
        """A JSON answer is whole: the decider is told and the request finished now (a stream: at its close)."""
        if isinstance(answer, JsonAnswer):
            self.feedback.tell_json(turn, decision, request.record, answer.content)
            trace = request.trace
            usage = _usage(answer.content, request.info.endpoint) if trace is not None and trace.recording else None
            self.finisher.finish(request.record, "ok", trace, status=answer.status, usage=usage)
            if self.feedback.asks_ids_for_us(request.body):
                answer = JsonAnswer(answer.status, protocol.scrub_token_ids(answer.content))
        return answer

    def _decide(
        self, turn: Turn, decodes: Sequence[WorkerView], prefills: Sequence[WorkerView], owner: str | None = None
    ) -> Decision:
        if owner is not None:  # only that decode holds the conversation (previous_response_id)
            if not any(view.id == owner for view in decodes):
                raise NoHealthyWorker("the decode worker that holds 'previous_response_id' is not available")
            return Decision(Route.BYPASS, decode=owner, reason="the decode that holds previous_response_id")
        if (why := protocol.decode_only(turn.info.endpoint, turn.body)) is not None:
            return Decision(Route.BYPASS, reason=why)  # decode computes the prompt whatever it is sent
        if not prefills and self._settings.fallback is Fallback.DECODE_ONLY:
            return Decision(Route.FALLBACK, reason="no healthy prefill worker")
        decider = self.feedback.decider
        decision = decider.decide(turn, decodes, prefills, self._clock())
        if decision.route not in (Route.BYPASS, self._route):
            logger.warning("decider %s chose %s; routing by the mode instead", decider.name, decision.route)
            decision = Decision(self._route, decision.decode, decision.prefill)
        return decision

    async def _attempt(
        self,
        request: ClientRequest,
        turn: Turn,
        decision: Decision,
        decodes: Sequence[WorkerView],
        prefills: Sequence[WorkerView],
    ) -> Answer:
        rec, info, route = request.record, request.info, decision.route
        decode = self._select(Role.DECODE, info, decodes, decision.decode)
        self._metrics.child(self._metrics.decisions, str(route)).inc()
        if info.endpoint is Endpoint.RESPONSES:  # the response id names the decode that will hold it
            request = replace(request, body=responses.owned(request.body, decode.spec.url))
        ids = protocol.mint_ids()
        close = StreamClose(self.feedback, self.finisher, turn, decision, rec, request.trace)
        if route in (Route.BYPASS, Route.FALLBACK):
            _served_by(rec, route, ids, decode, None)
            if route is Route.FALLBACK:
                logger.warning("request %s: no healthy prefill worker; decode-only fallback", rec.request_id)
            return await self._calls.decode(request, close, decode, request.body, ids, self._decode_rank(decode))
        prefill = self._select(Role.PREFILL, info, prefills, request.prefill or decision.prefill)
        _served_by(rec, route, ids, decode, prefill)
        self._check_pair(prefill, decode)
        n = protocol.choices(request.body, info.endpoint)
        decode_rank = self._decode_rank(decode, pinned=n > 1)
        legs = _Ranks(self._pool.pin_rank(prefill.spec.id, RankPick.LEAST_LOADED), decode_rank)
        if n == 1:
            return await self._pair(request, close, route, prefill, decode, ids, legs)
        return await self._choices(request, close, route, prefill, decode, ids, legs)

    async def _pair(
        self,
        request: ClientRequest,
        close: StreamClose,
        route: Route,
        prefill: WorkerState,
        decode: WorkerState,
        ids: protocol.PairingIds,
        legs: _Ranks,
    ) -> Answer:
        """The prompt computed on `prefill`, decoded on `decode`, as the route says (pull or push)."""
        if route is Route.PULL:
            prefilled = await self._calls.prefill(request, prefill, ids, legs.prefill)
            body = protocol.pull_decode_body(request.body, prefilled.params)
            answer = await self._calls.decode(request, close, decode, body, ids, legs.decode)
            api = api_of(request.info.endpoint)
            if usage.relays_cached(prefilled.params) and not api.restates_relayed:  # decode reports P's count
                return answer
            return await true_cached(answer, request.body, known(prefilled.cached), api)
        identity = prefill.ranks.identity(legs.prefill or 0)
        if identity is None:  # auto: learn the identity (this rank's) from a first, sequential prefill
            return await self._push_learning(request, close, prefill, decode, ids, legs)
        _check_parallelism(identity, prefill, decode)
        return await self._push(request, close, prefill, decode, identity, ids, legs)

    async def _choices(
        self,
        request: ClientRequest,
        close: StreamClose,
        route: Route,
        prefill: WorkerState,
        decode: WorkerState,
        ids: protocol.PairingIds,
        legs: _Ranks,
    ) -> Answer:
        """n > 1: a one-token pair (n = 1) moves the prompt's KV once into decode's prefix cache; then the client's
        request goes to that decode (and rank) alone, and vLLM starts its n choices from that cache (each computes
        only the prompt's last, partial block). The client's usage gets P's cached count, as for one choice."""
        body = protocol.first_token_body(request.body, request.info.endpoint)
        first = replace(request, body=body, info=replace(request.info, stream=False))
        moved = await self._pair(first, close, route, prefill, decode, ids, legs)
        assert isinstance(moved, JsonAnswer)
        answer = await self._calls.decode(request, close, decode, request.body, ids, legs.decode)
        return await true_cached(answer, request.body, known(usage.answered_cached(moved.content)))

    def _decode_rank(self, decode: WorkerState, *, pinned: bool = False) -> int | None:
        """Decode's rank: pinned (to the least loaded) when the policy reads load or the request needs its legs on
        one rank (`pinned`); else the server picks."""
        return self._pool.pin_rank(decode.spec.id, RankPick.LEAST_LOADED) if self._pin_decode or pinned else None

    def _check_pair(self, prefill: WorkerState, decode: WorkerState) -> None:
        """Refuses a pair the engines would refuse at the NIXL handshake, when the router knows it (block sizes)."""
        why = block_size_mismatch(BlockSizes(prefill.block_size, decode.block_size))
        if why is not None:
            raise UpstreamProtocolError(
                why, leg=Role.PREFILL, worker=prefill.spec.id, detail=f"decode {decode.spec.id}"
            )

    def _select(
        self, role: Role, info: RequestInfo, candidates: Sequence[WorkerView], prefer: str | None
    ) -> WorkerState:
        if not candidates:
            raise NoHealthyWorker(f"no healthy {role} worker is available")
        if prefer is not None and any(v.id == prefer for v in candidates):
            return self._pool.get(prefer)
        return self._pool.get(self._policies[role].select(list(candidates), info).id)

    async def _push_learning(
        self,
        request: ClientRequest,
        close: StreamClose,
        prefill: WorkerState,
        decode: WorkerState,
        ids: protocol.PairingIds,
        legs: _Ranks,
    ) -> Answer:
        """A push to a prefill worker whose NIXL identity is not known yet: prefill first, then decode."""
        prefilled = await self._calls.prefill(request, prefill, ids, legs.prefill)
        identity = prefill.ranks.identity(legs.prefill or 0)
        if identity is None:
            raise UpstreamProtocolError("did not state its NIXL identity", leg=Role.PREFILL, worker=prefill.spec.id)
        _check_parallelism(identity, prefill, decode)
        body = protocol.push_decode_body(request.body, identity, ids)
        answer = await self._calls.decode(request, close, decode, body, ids, legs.decode)
        return await true_cached(answer, request.body, known(prefilled.cached), api_of(request.info.endpoint))

    async def _push(
        self,
        request: ClientRequest,
        close: StreamClose,
        prefill: WorkerState,
        decode: WorkerState,
        identity: NixlIdentity,
        ids: protocol.PairingIds,
        legs: _Ranks,
    ) -> Answer:
        """Both legs at once; the answer is decode's, as soon as its first byte is in. A decode that fails while
        the prefill leg runs is blamed only once the prefill leg answered: when P dies, D's error (its KV never
        came) can reach us before P's own reset, and P's failure is then the root cause to retry around."""
        decode_body = protocol.push_decode_body(request.body, identity, ids)
        prefill_leg = asyncio.create_task(self._calls.prefill(request, prefill, ids, legs.prefill))
        decode_call = self._calls.decode(request, close, decode, decode_body, ids, legs.decode, report=False)
        decode_leg = asyncio.create_task(decode_call)
        try:
            await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
            if legtasks.failed(prefill_leg) and not decode_leg.done():
                decode_leg.cancel()  # decode would wait for KV that never comes
                await asyncio.wait({decode_leg})
                prefill_leg.result()  # raises the prefill error
            if legtasks.may_be_the_prefills_fault(decode_leg):
                await asyncio.wait({prefill_leg})  # within the prefill deadline; raised below if it failed
            answer = await decode_leg
        except BaseException as error:
            await legtasks.give_up(prefill_leg, decode_leg)  # raises the prefill leg's error when it failed
            if isinstance(error, UpstreamError) and error.leg is Role.DECODE:
                self._calls.passive_check(error, legs.decode)  # the prefill leg answered: decode's own failure
            raise
        self.finisher.detach(ids.request_id, prefill_leg)
        cached = functools.partial(legtasks.cached_of, prefill_leg)
        return await true_cached(answer, request.body, cached, api_of(request.info.endpoint))

    def forget(self, worker_id: str) -> None:
        """A worker went down or left the pool (the pool's on_gone): the decider drops what it knew of it."""
        self.feedback.forget(worker_id)

    async def aclose(self) -> None:
        await self.feedback.aclose()
        await self.finisher.aclose()
        await self._legs.aclose()


def _check_parallelism(identity: NixlIdentity, prefill: WorkerState, decode: WorkerState) -> None:
    """Refuses (503) a pair whose parallelism the connectors cannot serve, before the decode leg leaves."""
    why = parallelism_mismatch(identity, decode.spec.tp_size)
    if why is not None:
        logger.warning("prefill %s and decode %s cannot be paired: %s", prefill.spec.id, decode.spec.id, why)
        raise Unpairable(why)


def _served_by(
    rec: RequestRecord, route: Route, ids: protocol.PairingIds, decode: WorkerState, prefill: WorkerState | None
) -> None:
    """The attempt's route and workers on the record (a route without a prefill leg has no transfer id)."""
    rec.mode, rec.decode_worker, rec.pairing_id = route.label, decode.spec.id, ids.request_id
    rec.prefill_worker = None if prefill is None else prefill.spec.id
    rec.transfer_id = None if prefill is None else ids.transfer_id


@dataclass(frozen=True)
class _Ranks:
    """The data-parallel rank each leg of an attempt is pinned to (None: not pinned)."""

    prefill: int | None
    decode: int | None


def _usage(content: bytes, endpoint: Endpoint) -> dict[str, Any] | None:
    """The usage of a JSON answer as OpenAI's (for a traced request's span), None when it has none or is not
    JSON."""
    try:
        return api_of(endpoint).usage_of(protocol.decode_json(content))
    except ValueError:
        return None
