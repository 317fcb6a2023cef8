"""A 1P+1D pair in virtual time (pure, no I/O): the simulator's engines and handoff, stepped by an event heap.

The same EngineModel, cost model and WRITE timing (`writes.py`) as the simulator processes, without HTTP, asyncio
or the wall clock, so a whole 8 QPS run of 16k prompts takes well under a second. Used to calibrate a profile
and to predict the connectors' rows; the process simulator (seed-sim suite) stays the measured path.

Choreography, as kvpush's router drives it:
  pull   P: API time, prefill, answers at the end of its completing step; then D: API time, admission (descriptor
         setup stalls that step), READ over the link, KV counts from the end of the step it landed in.
  push   both legs at once: P and D each pay API time; D's admission step registers its blocks (the message
         reaches P after notify_s); P WRITEs per its connector's timing (writes.WriteAt); Done reaches D
         notify_s after the final WRITE landed.
The link (net.py) is one transfer at a time (the seed-scale profiles and calibration) or, with `shared`, a
fair-share link: transfers in flight at once share its rate (the link-scale predictions, sim/scaled.py).
Router time is not modelled (it is the same for every mode).
"""

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadtest.sim import costs
from loadtest.sim.engine import (
    ChunkDone,
    EngineModel,
    Event,
    LegKind,
    PrefillDone,
    Req,
    StartPull,
    StartPush,
    StepEnd,
    Token,
)
from loadtest.sim.link import Fifo
from loadtest.sim.net import FifoNet, Net, SharedNet
from loadtest.sim.profile import Profile
from loadtest.sim.writes import CONNECTOR_WRITE_AT, PlannedWrite, WritePlan, stage

MODES = ("pull", *CONNECTOR_WRITE_AT)


@dataclass
class RequestTimes:
    """One request's times (seconds from its arrival); None where it never got there."""

    arrival: float
    p_answer: float | None = None  # P's leg done (its one token)
    first_token: float | None = None
    done: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def handoff(self) -> float | None:
        """The router's handoff: P's leg done -> decode's first token (the router measures it so)."""
        if self.first_token is None or self.p_answer is None:
            return None
        return self.first_token - self.p_answer


class Clock:
    """An event heap: `at(t, fn)` runs fn at virtual time t; `run()` drains it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def run(self, limit_s: float = 3600.0) -> None:
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            if t > limit_s:
                return
            self.now = t
            fn()


@dataclass
class ClockLoop:
    """Steps one EngineModel on the Clock (loop.EngineLoop's virtual-time twin): plan, wait the step's duration,
    complete, hand the events on."""

    engine: EngineModel
    clock: Clock
    on_events: Callable[[Sequence[Event]], None]
    stepping: bool = False

    def kick(self) -> None:
        if self.stepping:
            return
        step = self.engine.plan()
        if step is None:
            return
        self.stepping = True

        def finish() -> None:
            self.stepping = False
            self.on_events(self.engine.complete(step))
            self.kick()

        self.clock.at(self.clock.now + step.duration, finish)


@dataclass
class PairModel:
    profile: Profile
    mode: str
    output_len: int
    clock: Clock = field(default_factory=Clock)
    writer: Fifo = field(default_factory=Fifo)
    outcomes: dict[str, RequestTimes] = field(default_factory=dict)
    _legs: dict[Req, Req] = field(default_factory=dict)  # P leg -> D leg, and D leg -> P leg
    _plans: dict[Req, WritePlan] = field(default_factory=dict)  # P leg -> its WRITE plan (push)
    _contact: bool = False
    pull_serial_s: float = 0.0  # what-if, not in any profile: a pull-only serial stage on D before each READ
    reader: Fifo = field(default_factory=Fifo)
    shared: bool = False  # the link as TCP flows share it (net.SharedNet); else one transfer at a time
    start_s: float = 0.0  # shared only: what each transfer pays before it runs (link.tcp_start_s)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")
        self.net: Net = SharedNet(self.clock, self.start_s) if self.shared else FifoNet(self.clock)
        self.p = ClockLoop(EngineModel(self.profile, chunk_events=True), self.clock, self._p_events)
        self.d = ClockLoop(EngineModel(self.profile), self.clock, self._d_events)

    # arrivals ----------------------------------------------------------------------------------------
    def arrive(self, rid: str, t: float, prompt: int) -> None:
        self.outcomes[rid] = RequestTimes(t)
        api = costs.api_time(self.profile, prompt)
        p_leg = Req(rid, LegKind.PREFILL, prompt, 1)
        self.clock.at(t + api, lambda: self._add(self.p, p_leg))
        if self.mode != "pull":
            d_leg = Req(rid, LegKind.PUSH, prompt, self.output_len)
            self._legs[p_leg], self._legs[d_leg] = d_leg, p_leg
            self._plans[p_leg] = WritePlan(CONNECTOR_WRITE_AT[self.mode], prompt)
            self.clock.at(t + api, lambda: self._add(self.d, d_leg))

    def _add(self, drv: ClockLoop, req: Req) -> None:
        drv.engine.add(req)
        drv.kick()

    # P side ------------------------------------------------------------------------------------------
    def _p_events(self, events: Sequence[Event]) -> None:
        e = self.p.engine
        for ev in events:
            if isinstance(ev, ChunkDone) and (plan := self._plans.get(ev.req)) is not None:
                self._post(ev.req, plan.on_step_end(e.steps_done, ev.computed))
            elif isinstance(ev, StepEnd):
                for p_leg, plan in list(self._plans.items()):
                    self._post(p_leg, plan.on_step_end(ev.index, plan.computed))
                    if plan.wants_step:
                        e.request_step()
            elif isinstance(ev, Token):
                self.outcomes[ev.req.rid].p_answer = self.clock.now
                if self.mode == "pull":
                    self._pull_d_leg(ev.req)
            elif isinstance(ev, PrefillDone):
                pass  # push: the WRITE plan saw the last chunk; pull: D reads after P's answer

    def _contact_s(self) -> float:
        if self._contact:
            return 0.0
        self._contact = True
        return self.profile.handshake_s

    def _post(self, p_leg: Req, writes: list[PlannedWrite]) -> None:
        if not writes:
            return
        p = self.profile
        staged = stage(
            writes,
            self.clock.now,
            self.writer,
            lambda n: costs.setup_time(p, n),
            lambda n: costs.transfer_time(p, n),
            self._contact_s(),
        )
        landed = None
        if any(final for *_, final in staged):
            self._plans.pop(p_leg, None)
            d_leg = self._legs.pop(p_leg)
            self._legs.pop(d_leg, None)
            landed = self._written(p_leg, d_leg)
        for ready, seconds, final in staged:
            self.net.send(ready, seconds, landed if final else None)

    def _written(self, p_leg: Req, d_leg: Req) -> Callable[[], None]:
        """The final WRITE landed: P frees the blocks; Done reaches D notify_s later."""

        def fn() -> None:
            self._release(p_leg)
            self.clock.at(self.clock.now + self.profile.notify_s, lambda: self._landed(d_leg))

        return fn

    def _release(self, p_leg: Req) -> None:
        self.p.engine.release(p_leg)
        self.p.kick()

    # D side ------------------------------------------------------------------------------------------
    def _pull_d_leg(self, p_leg: Req) -> None:
        d_leg = Req(p_leg.rid, LegKind.PULL, p_leg.prompt, self.output_len)
        self._legs[d_leg] = p_leg
        self.clock.at(self.clock.now + costs.api_time(self.profile, p_leg.prompt), lambda: self._add(self.d, d_leg))

    def _d_events(self, events: Sequence[Event]) -> None:
        now = self.clock.now
        for ev in events:
            if isinstance(ev, StartPush):
                p_leg = self._legs[ev.req]
                plan = self._plans[p_leg]
                self.clock.at(now + self.profile.notify_s, self._registration(p_leg, plan))
            elif isinstance(ev, StartPull):
                p_leg = self._legs.pop(ev.req)
                start = self.reader.reserve(now, self.pull_serial_s)
                seconds = self._contact_s() + costs.transfer_time(self.profile, p_leg.prompt)
                self.net.send(start, seconds, self._read_done(p_leg, ev.req))
            elif isinstance(ev, Token):
                out = self.outcomes[ev.req.rid]
                if out.first_token is None:
                    out.first_token = now
                if ev.final:
                    out.done = now

    def _registration(self, p_leg: Req, plan: WritePlan) -> Callable[[], None]:
        return lambda: self._post(p_leg, plan.on_register())

    def _read_done(self, p_leg: Req, d_leg: Req) -> Callable[[], None]:
        def fn() -> None:
            self._release(p_leg)
            self._landed(d_leg)

        return fn

    def _landed(self, d_leg: Req) -> None:
        self.d.engine.kv_landed(d_leg)
        self.d.kick()


@dataclass(frozen=True)
class Scores:
    """Means over the scored requests (after warm-up), in ms; n counts the scored requests that finished."""

    mode: str
    qps: float
    n: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    tpot_mean_ms: float
    handoff_p50_ms: float
    unfinished: int


def _p50(xs: list[float]) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def run(
    profile: Profile,
    mode: str,
    arrivals: Sequence[float],
    prompt: int,
    output_len: int,
    warmup: int = 2,
    pull_serial_s: float = 0.0,
    shared: bool = False,
    start_s: float = 0.0,
) -> Scores:
    """Send one request per arrival time (seconds) through a fresh pair in `mode`; score all but the first `warmup`.

    `pull_serial_s` adds a pull-only serial stage on D (a what-if mechanism, see calibrate.missing_mechanism);
    `shared`: transfers share the link (FairShare) and each pays `start_s` first; else FIFO."""
    pair = PairModel(profile, mode, output_len, pull_serial_s=pull_serial_s, shared=shared, start_s=start_s)
    for i, t in enumerate(arrivals):
        pair.arrive(f"r{i}", t, prompt)
    pair.clock.run()
    scored = [pair.outcomes[f"r{i}"] for i in range(warmup, len(arrivals))]
    done = [o for o in scored if o.done is not None and o.first_token is not None]
    ttft = [1000 * (o.first_token - o.arrival) for o in done if o.first_token is not None]
    tpot = [
        1000 * (o.done - o.first_token) / (output_len - 1)
        for o in done
        if o.done is not None and o.first_token is not None and output_len > 1
    ]
    hand = [1000 * h for o in done if (h := o.handoff) is not None]
    qps = (len(arrivals) - 1) / arrivals[-1] if len(arrivals) > 1 and arrivals[-1] > 0 else math.inf
    return Scores(
        mode=mode,
        qps=qps,
        n=len(done),
        ttft_mean_ms=sum(ttft) / len(ttft) if ttft else math.nan,
        ttft_p50_ms=_p50(ttft),
        tpot_mean_ms=sum(tpot) / len(tpot) if tpot else math.nan,
        handoff_p50_ms=_p50(hand),
        unfinished=len(scored) - len(done),
    )
