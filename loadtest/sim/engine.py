"""The simulated engine core: a pure step scheduler (waiting -> prefill chunks -> KV handoff -> decode).

No clock, no I/O. A driver calls `plan()` to get the next step and its duration, waits that long, then calls
`complete(step)` which returns the events of that step boundary. Request states:

  QUEUED      admitted by the API server, not yet scheduled (waiting queue, FIFO)
  PREFILL     prompt being computed in chunks (local, or the P leg of a P/D pair)
  WAIT_KV     decode leg holding blocks until remote KV lands (push: registered with P; pull: read in flight)
  KV_READY    KV landed; the next step computes its first token
  DECODE      producing one token per step
  HELD        P leg finished: its KV blocks stay allocated until the handoff releases them
  DONE        blocks freed

KV that lands during a step becomes KV_READY only at the end of that step (vLLM reports finished transfers
at step boundaries); pull's descriptor setup runs inside the step that admits the request, so it lengthens
that step for every sequence in the batch. Push's setup runs on P's writer thread, outside this class.
"""

import enum
from collections import deque
from dataclasses import dataclass, field

from loadtest.sim import costs
from loadtest.sim.profile import Profile


class LegKind(enum.Enum):
    LOCAL = "local"  # prefill and decode here
    PREFILL = "prefill"  # P leg: prefill, one token, then hold the KV for the handoff
    PULL = "pull"  # D leg that READs the KV from P
    PUSH = "push"  # D leg whose KV P WRITEs


class State(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    WAIT_KV = "wait_kv"
    KV_READY = "kv_ready"
    DECODE = "decode"
    HELD = "held"
    DONE = "done"


@dataclass(eq=False)
class Req:
    rid: str
    kind: LegKind
    prompt: int
    max_tokens: int
    state: State = State.QUEUED
    computed: int = 0  # prompt tokens whose KV exists here
    generated: int = 0


@dataclass(frozen=True)
class Token:
    req: Req
    final: bool


@dataclass(frozen=True)
class PrefillDone:
    """A P leg's prefill finished; its KV is HELD until `release`."""

    req: Req


@dataclass(frozen=True)
class StartPull:
    """A pull D leg was admitted this step (setup paid); the driver now reads the KV from P."""

    req: Req


@dataclass(frozen=True)
class StartPush:
    """A push D leg was admitted this step; the driver now registers its blocks with P."""

    req: Req


@dataclass(frozen=True)
class ChunkDone:
    """A P leg's prompt chunk was computed in this step (only with `chunk_events`): `computed` tokens now exist."""

    req: Req
    computed: int


@dataclass(frozen=True)
class StepEnd:
    """The end of step `index` (only with `chunk_events`): where a connector's end-of-step hook runs."""

    index: int


Event = Token | PrefillDone | StartPull | StartPush | ChunkDone | StepEnd


@dataclass(frozen=True)
class ScheduledStep:
    chunks: tuple[tuple[Req, int], ...]  # (request, new prompt tokens)
    decodes: tuple[Req, ...]  # one token each (KV_READY ones produce their first token)
    admitted_remote: tuple[Req, ...]  # PULL/PUSH legs admitted (blocks allocated)
    duration: float


@dataclass
class EngineModel:
    profile: Profile
    waiting: deque[Req] = field(default_factory=deque)
    running: list[Req] = field(default_factory=list)  # PREFILL, WAIT_KV, KV_READY, DECODE in admission order
    used_tokens: int = 0
    busy: bool = False
    chunk_events: bool = False  # emit ChunkDone per P-leg chunk and StepEnd per step (push WRITE timing)
    steps_done: int = 0
    _landed_in_step: list[Req] = field(default_factory=list)
    _wanted: bool = False

    # events from outside ---------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def kv_landed(self, req: Req) -> None:
        """Remote KV for a WAIT_KV leg arrived; it counts from the end of the current step (if any)."""
        if req.state is not State.WAIT_KV:
            return
        if self.busy:
            self._landed_in_step.append(req)
        else:
            req.state = State.KV_READY
            req.computed = req.prompt

    def abort(self, req: Req) -> None:
        """Drop a request wherever it is and free its blocks (client left, handoff failed or expired)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.state not in (State.QUEUED, State.DONE):
            self.used_tokens -= self._footprint(req)
        req.state = State.DONE

    def release(self, req: Req) -> None:
        """The handoff of a HELD P leg is over: free its KV."""
        if req.state is State.HELD:
            self.used_tokens -= self._footprint(req)
            req.state = State.DONE

    # stepping --------------------------------------------------------------------------------------------
    def request_step(self) -> None:
        """Run one more step even with nothing to compute (vLLM keeps stepping while a connector has work)."""
        self._wanted = True

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _footprint(self, req: Req) -> int:
        return req.prompt + (1 if req.kind is LegKind.PREFILL else req.max_tokens)

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        while self.waiting and len(self.running) < self.profile.max_seqs:
            req = self.waiting[0]
            if self.used_tokens + self._footprint(req) > self.profile.kv_capacity_tokens:
                break  # FIFO: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            self.used_tokens += self._footprint(req)
            req.state = State.WAIT_KV if req.kind in (LegKind.PULL, LegKind.PUSH) else State.PREFILL
            self.running.append(req)
            admitted.append(req)
        return admitted

    def plan(self) -> ScheduledStep | None:
        """The next step, or None when there is nothing to compute and nobody to admit."""
        admitted = self._admit()
        decodes = tuple(r for r in self.running if r.state in (State.DECODE, State.KV_READY))
        budget = self.profile.max_batched_tokens - len(decodes)
        chunks: list[tuple[Req, int]] = []
        for r in self.running:
            if r.state is State.PREFILL and budget > 0:
                n = min(budget, r.prompt - r.computed)
                chunks.append((r, n))
                budget -= n
        remote = tuple(r for r in admitted if r.kind in (LegKind.PULL, LegKind.PUSH))
        idle = not decodes and not chunks and not remote
        if idle and not self._wanted:
            return None
        self._wanted = False
        p = self.profile
        duration = costs.step_time(p, [(n, r.computed) for r, n in chunks], [r.prompt + r.generated for r in decodes])
        duration += sum(costs.setup_time(p, r.prompt) for r in remote if r.kind is LegKind.PULL)
        if idle:
            duration = p.step_overhead_s  # a no-forward step: scheduling and the connector's hooks only
        self.busy = True
        return ScheduledStep(tuple(chunks), decodes, remote, duration)

    def complete(self, step: ScheduledStep) -> list[Event]:
        """Apply a finished step; returns its events in a stable order."""
        events: list[Event] = []
        for r, n in step.chunks:
            if r.state is not State.PREFILL:
                continue  # aborted while the step ran
            r.computed += n
            if self.chunk_events and r.kind is LegKind.PREFILL:
                events.append(ChunkDone(r, r.computed))
            if r.computed >= r.prompt:
                events.extend(self._first_token(r))
        for r in step.decodes:
            if r.state not in (State.DECODE, State.KV_READY):
                continue
            r.state = State.DECODE
            events.extend(self._token(r))
        for r in step.admitted_remote:
            if r.state is not State.DONE:
                events.append(StartPull(r) if r.kind is LegKind.PULL else StartPush(r))
        for r in self._landed_in_step:
            if r.state is State.WAIT_KV:
                r.state = State.KV_READY
                r.computed = r.prompt
        self._landed_in_step.clear()
        self.busy = False
        self.steps_done += 1
        if self.chunk_events:
            events.append(StepEnd(self.steps_done))
        return events

    def _first_token(self, r: Req) -> list[Event]:
        if r.kind is LegKind.PREFILL:
            r.generated = 1
            r.state = State.HELD
            self.running.remove(r)
            return [Token(r, final=True), PrefillDone(r)]
        r.state = State.DECODE
        return self._token(r)

    def _token(self, r: Req) -> list[Event]:
        r.generated += 1
        final = r.generated >= r.max_tokens
        if final:
            self.running.remove(r)
            self.used_tokens -= self._footprint(r)
            r.state = State.DONE
        return [Token(r, final=final)]
