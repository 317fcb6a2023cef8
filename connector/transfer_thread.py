"""The one thread that owns the transfer backend (the NIXL agent) and both rendezvous machines.

Threading model (guarantee G6):

* **Owner thread** (``kvpush-transfer``, this module): the only caller of the ``TransferBackend`` and the only
  reader/writer of ``PrefillRendezvous`` / ``DecodeRendezvous``, ``_writes``, ``_agents`` and ``_links``. Each
  turn it drains the inbox, polls notices (which also progresses UCX, since NIXL runs without its progress
  thread), checks posted WRITEs, expires what is due and performs the actions the machines return.
* **When it runs** (guarantee G7): it sleeps on ``_wake`` until something needs it: a submission (``submit``), a
  step hook (``kick``, once per engine step from ``get_transfer_results``; a decode takes it only while
  something is in flight, a prefill always: a registration may come any time; issue 41), a side-channel event,
  the next deadline of either machine (a heap: O(1) to look at), or, only while a transfer is in flight on this
  side (P: a WRITE posted; D: a receive waiting for its ``Done``, so a notice never waits for the idle tick;
  either: an order waiting for its step's ``ReadyEvent``, G15 ``connector.transfer.ready``), a short backoff
  timer (``Polling.write_poll_min_s`` doubling up to ``write_poll_max_s``; a new receive restarts it only if
  none ran) that notices its completion. With nothing in flight it wakes at most every ``Polling.idle_wait_s``
  as a safety net (NIXL offers no wake-up on a notification). Who moves UCX's bytes is the progress model
  (``connector.options``: ``poll`` or ``thread``).
* **Worker thread** (vLLM's model runner, via ``connector.worker``): only calls ``submit``, ``kick`` and
  ``collect_results`` (empties the outbox). It never waits on the owner thread, so the forward loop never waits
  on NIXL.
* **Side-channel threads** (``connector.wire.side_channel`` through the ``SideChannel`` seam, TCP unless a test
  injects another; started by ``start``): put ``PeerReady`` / ``PeerLost`` / ``AddPeer`` in the inbox.
  ``AddPeer`` carries an ``Event`` the server thread waits on, so the handshake reply is sent only after the
  owner loaded the peer's agent. They read only ``_local_payload`` (cached bytes).

Peers (guarantee G8): agent names are unique per process incarnation (the worker adds a uuid); a handshake with
changed metadata reloads the agent, a new agent for a known engine id retires the old one, and a retired or lost
agent is removed once no WRITE to it is in flight.

Stopping: ``close()`` sets ``_stop`` and ``_wake``, joins the owner thread, then closes the side channel and the
backend from the calling thread (the owner is gone by then).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import assert_never

from connector.options import Options
from connector.orders import AddPeer, CancelOrder, Command, Gated, Order, PeerLost, PeerReady, Quiesce, Write
from connector.parallel.fanout import PrefillFanOut, split_leg_key
from connector.parallel.ranks import DecodeFanIn, FanInStep, Unpairable, decode_legs, prefill_peer, prefill_targets
from connector.rendezvous.actions import (
    AbandonWrite,
    Action,
    Connect,
    Failed,
    Freed,
    Received,
    Release,
    Send,
    StartWrite,
    Tally,
)
from connector.rendezvous.decode import DecodeRendezvous
from connector.results import Results as Results
from connector.results import TransferRecord
from connector.transfer.base import TransferBackend, TransferError
from connector.transfer.layered import LayeredBackend, StepLayers, StepsByKey
from connector.transfer.ready import READY, HostFence, ReadyEvent, StepFence
from connector.wire.metadata import (
    PROTOCOL_VERSION,
    Cancel,
    CancelAck,
    Done,
    Failure,
    HandshakePayload,
    KVLayout,
    PeerAddress,
    ProtocolError,
    RankId,
    RankInfo,
    Registration,
    decode_notice,
    encode_notice,
    is_notice,
)
from connector.wire.plan import (
    CancelUnallocated,
    PrefillFailed,
    PrefillFinished,
    PrefillProgress,
    PrefillRestarted,
    RegisterOrder,
)
from connector.wire.side_channel import PeerHandle, Server, SideChannel, TcpSideChannel

logger = logging.getLogger(__name__)


class TransferThread:
    def __init__(
        self,
        backend: TransferBackend,
        *,
        engine_id: str,
        layout: KVLayout,
        compat_hash: str,
        side_host: str,
        side_port: int,
        options: Options | None = None,
        clock: Callable[[], float] = time.monotonic,
        side_channel: SideChannel | None = None,
        fence: StepFence | None = None,
        rank: RankInfo | None = None,
    ) -> None:
        options = options or Options()
        self._rank = rank or RankInfo()  # this worker's rank in its engine (wire v3, ``connector.parallel.ranks``)
        self._leader = self._rank.rank == RankId(0, 0)  # request-level counters from the leader rank only
        self._fanin = DecodeFanIn()  # D: requests with several source ranks
        self._peer_ranks: dict[str, RankInfo] = {}  # D: each prefill rank's RankInfo from its handshake
        self._fence: StepFence = fence or HostFence()
        self._gated: deque[Gated] = deque()  # orders in submission order, the first maybe not ready yet
        self._layers = StepsByKey()  # P, layer-wise push: per pairing key, the step of its latest order
        self.engine_id = engine_id
        self._backend, self._layout, self._compat_hash = backend, layout, compat_hash
        self._metadata, self._clock = backend.agent_metadata(), clock
        self._polling, self._liveness, self._timeouts = options.polling, options.liveness, options.timeouts
        self._side_host, self._side_port = side_host, side_port
        self._prefill = PrefillFanOut(self._timeouts)  # P: legs per D rank (``connector.parallel.fanout``)
        self._d_ranks: dict[str, RankInfo] = {}  # P: each decode rank's RankInfo from its handshake
        self._decode = DecodeRendezvous(self._timeouts, engine_id, self._rank.rank.tp)
        self._writes: dict[str, Write] = {}
        self._quiescing: list[Quiesce] = []  # P: preemption fences waiting for their WRITEs to end
        self._write_backoff = self._polling.write_poll_min_s
        self._agents: dict[str, str] = {}  # peer key (engine, rank: ``metadata.peer_key``) -> agent name
        self._retired: set[str] = set()  # agent names to remove once no WRITE to them is in flight
        self._links: dict[str, PeerHandle] = {}
        self._side_channel: SideChannel = side_channel or TcpSideChannel()
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[Results] = queue.SimpleQueue()
        self._pending = Results()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._server: Server | None = None
        self._thread = threading.Thread(target=self._run, name="kvpush-transfer", daemon=True)
        self.side_port = side_port
        self.wakes = 0  # owner-thread turns so far (for tests and stats)
        self._dialled, self._kick_wakes = False, True  # a decode dialled us (P); kicks wake us (``_wants_kicks``)

    def start(self) -> None:
        """Open the side channel and start the owner thread."""
        self._server = self._side_channel.serve(
            self._side_host,
            self._side_port,
            self._local_payload,
            self._add_peer_and_wait,
            self._peer_lost,
            self._compat_hash,
            self._liveness,
            self._clock,
        )
        self.side_port = self._server.port
        self._thread.start()

    # ---- worker-thread API -------------------------------------------------------------

    def submit(self, order: Order, ready: ReadyEvent = READY, layers: StepLayers | None = None) -> None:
        """Queue an order; it reaches the machines (and may post a WRITE) only once ``ready`` completed
        and every order submitted before it did (``connector.transfer.ready``: the forward stream on a GPU).
        ``layers``: its WRITE is posted layer by layer as they are marked ready (``connector.transfer.layered``)."""
        self._inbox.put(Gated(order, ready, layers))
        self._wake.set()

    def quiesce(self, keys: frozenset[str]) -> bool:
        """P, worker thread (``handle_preemptions``): vLLM preempted these transfers' legs and freed their
        blocks, which the coming forward may overwrite. Stop their partial WRITEs and wait until none of
        their WRITEs is in flight, at most ``write_timeout_s`` (by then the owner abandoned it). False: a
        WRITE may still read the freed blocks (logged and counted by the owner thread)."""
        order = Quiesce(keys, self._clock() + self._timeouts.write_timeout_s)
        self._inbox_put(order)
        settled = order.done.wait(timeout=self._timeouts.write_timeout_s + 1.0)
        return settled and not order.timed_out

    def kick(self) -> None:
        """A step hook: let the owner poll notices and WRITEs now (one ``Event.set``), if it wants kicks (G7)."""
        if self._kick_wakes:
            self._wake.set()

    def collect_results(self) -> Results:
        merged = Results()
        while True:
            try:
                merged.merge(self._outbox.get_nowait())
            except queue.Empty:
                return merged

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        if self._server is not None:
            self._server.close()
        for link in self._links.values():
            link.close()
        self._backend.close()

    # ---- side-channel callbacks (their own threads) ------------------------------------

    def _local_payload(self) -> HandshakePayload:
        return HandshakePayload(
            PROTOCOL_VERSION,
            self._compat_hash,
            self.engine_id,
            self._backend.agent_name,
            self._metadata,
            self._layout,
            clock=self._clock(),
            rank=self._rank,
        )

    def _add_peer_and_wait(self, payload: HandshakePayload) -> None:
        cmd = AddPeer(payload)
        self._inbox_put(cmd)
        if not cmd.done.wait(timeout=self._timeouts.connect_timeout_s):
            raise TimeoutError("transfer thread did not load the peer in time")
        if cmd.error is not None:
            raise ConnectionError(cmd.error)

    def _peer_lost(self, engine_id: str) -> None:
        self._inbox_put(PeerLost(engine_id))

    def _inbox_put(self, cmd: Command) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    # ---- owner thread --------------------------------------------------------------------

    def _run(self) -> None:
        self._fence.bind_thread()  # before any backend call on this thread (CUDA: the KV cache's device)
        while not self._stop.is_set():
            self._wake.clear()
            self.wakes += 1
            now = self._clock()
            try:
                self._turn(now)
            except Exception:  # the loop must survive one bad turn
                logger.exception("kvpush transfer thread turn failed")
                self._pending.counters[Tally.THREAD_ERRORS] += 1
            self._publish()
            self._kick_wakes = self._wants_kicks()
            self._wake.wait(self._sleep_s(self._clock()))

    def _wants_kicks(self) -> bool:  # G7: a prefill always (a registration may come any time), else if in flight
        in_flight = self._writes or self._gated or self._decode.live or self._quiescing
        return self._dialled or bool(in_flight) or not self._inbox.empty()

    def _sleep_s(self, now: float) -> float:
        """Until the next deadline, the next WRITE check (only with WRITEs in flight) or the safety net."""
        timeout = self._polling.idle_wait_s
        if self._writes or self._gated or self._decode.live:  # nothing wakes us when a WRITE ends, a CUDA
            # event completes or a notice arrives: poll while a transfer is in flight on this side
            timeout = self._write_backoff
            self._write_backoff = min(2 * self._write_backoff, self._polling.write_poll_max_s)
        fences = [q.deadline for q in self._quiescing]
        for deadline in (self._prefill.next_deadline(), self._decode.next_deadline(), *fences):
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - now))
        return timeout

    def _turn(self, now: float) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, Gated):
                self._gated.append(cmd)
            else:
                self._handle(cmd, now)
        while self._gated and self._gated[0].ready.query():
            gated = self._gated.popleft()
            if gated.layers is not None and isinstance(gated.order, PrefillProgress | PrefillFinished):
                self._layers.note(gated.order.key, gated.layers)
            self._handle(gated.order, now)
        for sender, raw in self._backend.poll_notices():
            self._on_raw_notice(sender, raw, now)
        if self._writes:
            self._check_writes(now)
        if self._quiescing:
            self._settle_quiesces(now)
        if self._due(now):
            self._perform(self._prefill.expire(now), now)
            self._perform(self._decode.expire(now), now)
        if self._retired:
            self._reap_agents()
        self._layers.sweep(self._prefill.live_keys)

    def _due(self, now: float) -> bool:
        return any(d is not None and d <= now for d in (self._prefill.next_deadline(), self._decode.next_deadline()))

    def _publish(self) -> None:
        for counters in (self._prefill.counters, self._decode.counters):
            if counters and self._leader:  # request-level: counted once per engine, not per rank
                self._pending.counters.update(counters)
            counters.clear()
        if self._pending:
            self._outbox.put(self._pending)
            self._pending = Results()

    def _handle(self, cmd: Order | PeerReady | PeerLost | AddPeer | Quiesce, now: float) -> None:
        match cmd:
            case RegisterOrder():
                if not (self._decode.live or self._writes):  # poll from now (G7); a running poll keeps its pace
                    self._write_backoff = self._polling.write_poll_min_s
                self._register(cmd, now)
            case CancelOrder():
                if cmd.request_id in self._fanin.requests:
                    self._fan_in(self._fanin.on_abort(cmd.request_id), now)
                else:
                    self._perform(self._decode.on_abort(cmd.request_id, now), now)
            case CancelUnallocated():
                try:
                    legs = decode_legs(cmd.request_id, cmd.peer, self._rank)
                except Unpairable:
                    return  # nothing was registered with any prefill rank
                for leg, peer in legs:
                    self._perform(self._decode.on_abort_unallocated(leg, cmd.key, peer, now), now)
            case PrefillFinished():
                actions = self._prefill.on_prefill_finished(cmd.key, cmd.request_id, cmd.block_ids, now, cmd.num_tokens)
                self._perform(actions, now)
            case PrefillFailed():
                held = cmd.request_id if cmd.held else None
                self._perform(self._prefill.on_prefill_failed(cmd.key, cmd.reason, now, held), now)
            case PrefillProgress():
                self._perform(self._prefill.on_prefill_progress(cmd, now), now)
            case PrefillRestarted():
                self._perform(self._prefill.on_prefill_restarted(cmd.key, now), now)
            case Quiesce():
                for key in cmd.keys:  # no partial WRITE from now on, even from an order still gated
                    self._perform(self._prefill.on_prefill_restarted(key, now), now)
                if self._in_flight(cmd.keys):
                    self._pending.counters[Tally.FENCED] += 1
                self._quiescing.append(cmd)
                self._settle_quiesces(now)
            case AddPeer():
                self._dialled = True
                try:
                    self._load_peer(cmd.payload, writes_to=True)  # a decode dialled us: we WRITE to it
                except TransferError as exc:
                    cmd.error = str(exc)
                cmd.done.set()
            case PeerReady():
                self._on_peer_ready(cmd, now)
            case PeerLost():
                self._on_peer_lost(cmd.engine_id, now, cmd.link)
            case _:
                assert_never(cmd)

    def _register(self, cmd: RegisterOrder, now: float) -> None:
        """D: register with every P rank the topology makes a source of this rank (``connector.parallel.ranks``)."""
        try:
            legs = decode_legs(cmd.request_id, cmd.peer, self._rank)
        except Unpairable as exc:
            logger.warning("request %s refused: %s", cmd.request_id, exc)
            self._pending.counters[Tally.FAILED] += self._leader
            self._perform([Received(cmd.request_id, ok=False)], now)  # no prefill rank knows our blocks
            return
        known = [self._peer_ranks.get(peer.key) for _, peer in legs]
        if any(r is not None and (r.tp_size, r.pp_size) != (cmd.peer.tp_size, cmd.peer.pp_size) for r in known):
            logger.warning("request %s refused: the prefill's tp/pp is not what its decode leg says", cmd.request_id)
            self._perform([Received(cmd.request_id, ok=False)], now)  # would wait for too few parts: wrong KV
            return
        if len(legs) > 1:
            self._fanin.add(cmd.request_id, legs)
        for leg, peer in legs:
            self._perform(self._decode.on_register(leg, cmd.key, peer, cmd.block_ids, now, cmd.num_tokens), now)

    def _fan_in(self, step: FanInStep, now: float) -> None:
        """D: a leg of a fanned-in request ended: report the request as its ``SourceSet`` decides."""
        for leg in step.cancel_legs:
            self._perform(self._decode.on_abort(leg, now), now)
        if step.fail_now:
            self._pending.failed.add(step.request_id)  # failed now, blocks held: a quarantine upstream
        if step.finish:
            self._pending.received.add(step.request_id)
            if not step.ok:
                self._pending.failed.add(step.request_id)

    def _on_peer_ready(self, cmd: PeerReady, now: float) -> None:
        try:
            self._load_peer(cmd.payload, writes_to=False)  # the prefill we dialled: notices only
        except TransferError:
            logger.exception("could not load prefill agent %s", cmd.payload.peer_key)
            self._on_peer_lost(cmd.payload.peer_key, now)
            return
        self._peer_ranks[cmd.payload.peer_key] = cmd.payload.rank
        self._perform(self._decode.on_peer_ready(cmd.payload.peer_key, cmd.clock_offset, now), now)

    def _on_peer_lost(self, engine_id: str, now: float, ended: PeerHandle | None = None) -> None:
        if ended is not None and self._links.get(engine_id) is not ended:
            return  # an older link of that engine ended after a newer one was opened
        link = self._links.pop(engine_id, None)
        if link is not None:
            link.close()
        agent = self._agents.pop(engine_id, None)
        if agent is not None:
            self._retired.add(agent)
        self._perform(self._decode.on_peer_lost(engine_id, now), now)
        self._perform(self._prefill.on_peer_lost(engine_id, now), now)

    def _load_peer(self, payload: HandshakePayload, writes_to: bool) -> None:
        # Reloads when the metadata changed (a restarted peer). Decode loads prefill for notices only; prefill
        # writes a decode rank whole blocks or, under unequal TP, the slices the topology gives it.
        if writes_to:
            try:
                window, slices = prefill_peer(self._rank, payload.rank, self._layout, payload.layout)
                payload = replace(payload, layout=window)  # a PP stage writes only its layers' regions
            except Unpairable as exc:
                raise TransferError(f"decode {payload.peer_key} cannot be paired with this rank: {exc}") from exc
            self._backend.add_peer(payload, writes_to=True, slices=slices)
            self._d_ranks[payload.peer_key] = payload.rank
        else:
            self._backend.add_peer(payload, writes_to=False)
        key = payload.peer_key
        previous = self._agents.get(key)
        if previous is not None and previous != payload.agent_name:
            self._retired.add(previous)  # an older incarnation of that rank
        self._retired.discard(payload.agent_name)
        self._agents[key] = payload.agent_name

    def _reap_agents(self) -> None:
        busy = {w.agent for w in self._writes.values()}
        for agent in list(self._retired - busy):
            self._retired.discard(agent)
            self._backend.remove_peer(agent)
            self._pending.counters[Tally.AGENTS_REMOVED] += 1

    def _on_raw_notice(self, sender: str, raw: bytes, now: float) -> None:
        if not is_notice(raw):
            self._pending.counters[Tally.UNKNOWN_NOTICES] += 1
            return
        try:
            notice = decode_notice(raw)
        except ProtocolError as exc:
            logger.warning("dropped notice from %s: %s", sender, exc)
            self._pending.counters[Tally.BAD_NOTICES] += 1
            return
        match notice:
            case Registration():
                self._perform(self._prefill.on_registration(notice, now, self._targets(notice.sender)), now)
            case Cancel():
                self._perform(self._prefill.on_cancel(notice, now, self._targets(notice.sender)), now)
            case CancelAck() | Failure() | Done():
                self._perform(self._decode.on_notice(notice, now), now)
            case _:
                assert_never(notice)

    def _targets(self, d_peer: str) -> tuple[int, ...] | None:
        """P: the ranks of that D rank's engine this rank writes (None: unknown peer, that rank alone)."""
        theirs = self._d_ranks.get(d_peer)
        return None if theirs is None else prefill_targets(self._rank, theirs)

    def _check_writes(self, now: float) -> None:
        for key, w in list(self._writes.items()):
            if w.failed:  # retry the release of a failed or abandoned WRITE
                if self._backend.release(w.ticket.handle):
                    del self._writes[key]
                    self._perform(self._prefill.on_write_released(key, now), now)
                continue
            state = self._backend.write_state(w.ticket.handle)
            if state == "PROC":
                continue
            if state == "ERR":
                self._fail_write(key, w, now)
                continue
            del self._writes[key]
            if not self._backend.release(w.ticket.handle):
                self._pending.counters[Tally.RELEASE_REFUSED] += 1  # done: the data landed already
            self._pending.records.append(
                TransferRecord(w.ticket.num_bytes, now - w.started, w.ticket.num_descriptors, w.ticket.runs)
            )
            if w.final:  # one structured line per transfer: how many WRITEs it took (G14)
                logger.info("kvpush transfer written key=%s writes=%d", key, w.ordinal)
            self._perform(self._prefill.on_write_done(key, now), now)

    def _in_flight(self, keys: frozenset[str]) -> bool:
        return any(split_leg_key(k)[0] in keys for k in self._writes)

    def _settle_quiesces(self, now: float) -> None:
        """Release the preemption fences whose WRITEs are over (or whose deadline passed: counted, logged)."""
        waiting: list[Quiesce] = []
        for q in self._quiescing:
            if not self._in_flight(q.keys):
                q.done.set()
            elif now >= q.deadline:
                logger.error("kvpush: a WRITE of preempted %s still runs; the forward goes on", sorted(q.keys))
                self._pending.counters[Tally.FENCE_TIMEOUTS] += 1
                q.timed_out = True
                q.done.set()
            else:
                waiting.append(q)
        self._quiescing = waiting

    def _fail_write(self, key: str, w: Write, now: float) -> None:
        """ERR or abandoned: D may free its blocks only once the backend released the handle."""
        if self._backend.release(w.ticket.handle):
            del self._writes[key]
            self._perform(self._prefill.on_write_released(key, now), now)
            return
        w.failed = True
        self._pending.counters[Tally.RELEASE_REFUSED] += 1
        self._perform(self._prefill.on_write_stuck(key, now), now)

    # ---- performing actions --------------------------------------------------------------

    def _perform(self, actions: list[Action], now: float) -> None:
        for action in actions:
            match action:
                case StartWrite():
                    self._start_write(action, now)
                case AbandonWrite():
                    w = self._writes.get(action.key)
                    if w is None:
                        self._perform(self._prefill.on_write_released(action.key, now), now)
                    elif not w.failed:
                        self._fail_write(action.key, w, now)
                case Send():
                    self._send(action, now)
                case Release():
                    self._pending.released.add(action.request_id)
                case Received() | Failed() | Freed() if self._fanin.owns(action.request_id):
                    self._fan_in(self._fanin.on_leg(action.request_id, _leg_event(action)), now)
                case Received():
                    self._pending.received.add(action.request_id)
                    if not action.ok:
                        self._pending.failed.add(action.request_id)
                case Failed():
                    self._pending.failed.add(action.request_id)
                case Freed():
                    self._pending.received.add(action.request_id)
                case Connect():
                    self._connect(action.peer)
                case _:
                    assert_never(action)

    def _start_write(self, action: StartWrite, now: float) -> None:
        reg = action.registration
        try:
            agent = self._agents[reg.sender]
            done = encode_notice(Done(reg.key, reg.d_request_id)) if action.final else b""
            remote = reg.block_ids if action.remote_blocks is None else action.remote_blocks
            # The order behind this WRITE reached the machine only after its step's ReadyEvent completed,
            # or, layer-wise, its parts are posted only as their layers' ReadyEvents complete (layer_push).
            layers = self._layers.for_write(split_leg_key(action.key)[0])
            if layers is not None and isinstance(self._backend, LayeredBackend):
                ticket = self._backend.write_layered(agent, action.local_blocks, remote, done, layers)
            else:
                ticket = self._backend.write(agent, action.local_blocks, remote, done)
        except (KeyError, TransferError, ValueError) as exc:
            logger.warning("WRITE for %s not posted: %r", action.key, exc)
            self._perform(self._prefill.on_write_released(action.key, now), now)  # nothing can land
            return
        self._pending.counters[Tally.WRITES_POSTED] += 1
        if not action.final:
            self._pending.counters[Tally.PARTIAL_WRITES] += 1
        self._writes[action.key] = Write(ticket, agent, now, final=action.final, ordinal=action.ordinal)
        self._write_backoff = self._polling.write_poll_min_s

    def _send(self, action: Send, now: float) -> None:
        notice = action.notice
        try:
            self._backend.send_notice(self._agents[action.engine_id], encode_notice(notice))
        except (KeyError, TransferError) as exc:
            logger.warning("%s notice to %s not sent: %r", notice.kind, action.engine_id, exc)
            self._pending.counters[Tally.FAILED_NOTICES] += 1
            if isinstance(notice, Registration):  # P never saw it: fail just this request
                failure = Failure(notice.key, notice.d_request_id, "registration could not be sent")
                self._perform(self._decode.on_notice(failure, now), now)
            # A lost Cancel keeps the request held until its deadline; a lost Ack, Failure or
            # Done likewise ends at decode's deadline. Safe, only slower.

    def _connect(self, peer: PeerAddress) -> None:
        if peer.key in self._links:
            return
        link = self._side_channel.connect(
            peer,
            self._local_payload,
            lambda payload, offset: self._inbox_put(PeerReady(payload, offset)),
            lambda key: self._inbox_put(PeerLost(key, link)),
            self._compat_hash,
            self._timeouts.connect_timeout_s,
            self._liveness,
            self._clock,
        )
        self._links[peer.key] = link
        link.start()


def _leg_event(action: Received | Failed | Freed) -> str:
    if isinstance(action, Received):
        return "done" if action.ok else "ended"
    return "quarantined" if isinstance(action, Failed) else "freed"
