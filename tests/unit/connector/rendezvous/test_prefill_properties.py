"""Random interleavings of both rendezvous machines over a reordering, duplicating network.

Each example runs a few transfers (every retry gets a fresh key, as the router does) through one
prefill and one decode machine. Hypothesis picks the order of: prefill finish / failure, decode
registration and abort, progressive push (a chunk's partial WRITE, a preemption; G14), delivery (possibly
duplicated) of any in-flight notice, landing or failure
of any posted WRITE (a failed one may have its release refused: it then stays "stuck" and may still
land until prefill's hold limit), and clock jumps (lease expiry). Checked invariants:

* guarantee G2: a WRITE (also a failed or abandoned one whose handle is not yet released) never lands
  in blocks that decode already gave back, and prefill never posts a
  WRITE for a (key, decode request) it has acknowledged or failed;
* guarantee G4: a WRITE only pairs a prefill and a registration of the same transfer;
* guarantee G14: at most one WRITE of a transfer is in flight (posted, not yet reported), and only the
  last one carries Done;
* guarantee G5: after quiescence both machines are empty, every prefill's blocks were released exactly
  once and every registered decode request was reported exactly once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

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
    Timeouts,
)
from connector.rendezvous.decode import DecodeRendezvous
from connector.rendezvous.prefill import P_TERMINAL, PrefillRendezvous
from connector.wire.metadata import CancelAck, Done, Failure, Notice, PeerAddress, Registration
from connector.wire.plan import PrefillProgress

T = Timeouts(lease_s=30, kv_timeout_s=60, write_grace_s=10, write_timeout_s=5, connect_timeout_s=10)
PEER = PeerAddress("P", "127.0.0.1", 5600)
N = 3  # transfers per example


@dataclass
class Write:
    key: str
    p_request: str
    d_request: str
    land_by: float
    final: bool = True


@dataclass
class World:
    p: PrefillRendezvous = field(default_factory=lambda: PrefillRendezvous(T))
    d: DecodeRendezvous = field(default_factory=lambda: DecodeRendezvous(T, "D"))
    now: float = 0.0
    to_p: list[Notice] = field(default_factory=list)
    to_d: list[Notice] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)
    stuck: list[Write] = field(default_factory=list)  # failed or abandoned, release refused so far
    write_results: list[tuple[str, bool]] = field(default_factory=list)
    d_gone: set[str] = field(default_factory=set)  # decode requests whose blocks were given back
    closed: set[tuple[str, str]] = field(default_factory=set)  # (key, d req) acked or failed by P
    released: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)
    p_done: set[int] = field(default_factory=set)
    p_pushed: set[int] = field(default_factory=set)  # legs that ordered a partial WRITE (their blocks held at a fail)
    d_started: set[int] = field(default_factory=set)
    d_aborted: set[int] = field(default_factory=set)
    finished_ok: set[str] = field(default_factory=set)
    limits: dict[str, float] = field(default_factory=dict)  # key -> P's hold limit for a stuck WRITE
    d_gone_at: dict[str, float] = field(default_factory=dict)

    # ---- performing actions -------------------------------------------------------------
    def perform(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, StartWrite):
                assert (a.key, a.registration.d_request_id) not in self.closed, "WRITE after ack/failure"
                assert a.key == a.registration.key == key_of(a.request_id), "paired across transfers"
                assert a.registration.d_request_id == f"d{a.key[2:]}"
                assert self.now < a.registration.write_deadline
                live = [w.key for w in self.writes + self.stuck] + [k for k, _ in self.write_results]
                assert a.key not in live, "two WRITEs of one transfer in flight"
                self.writes.append(
                    Write(a.key, a.request_id, a.registration.d_request_id, self.now + T.write_timeout_s, a.final)
                )
                self.limits[a.key] = a.registration.write_deadline + T.write_grace_s
            elif isinstance(a, AbandonWrite):
                # The transport may refuse to cancel it: it stays stuck and may land until P's hold limit.
                for w in [w for w in self.writes if w.key == a.key]:
                    self.writes.remove(w)
                    self.stuck.append(Write(w.key, w.p_request, w.d_request, self.limits[w.key], w.final))
                    self.perform(self.p.on_write_stuck(w.key, self.now))
            elif isinstance(a, Send) and a.engine_id == "P":
                self.to_p.append(a.notice)
            elif isinstance(a, Send):
                if isinstance(a.notice, CancelAck | Done) or (
                    isinstance(a.notice, Failure) and not a.notice.quarantine
                ):
                    assert not any(w.key == a.notice.key for w in self.writes + self.stuck), "freed with a WRITE live"
                    self.closed.add((a.notice.key, a.notice.d_request_id))
                self.to_d.append(a.notice)
            elif isinstance(a, Release):
                self.released[a.request_id] += 1
            elif isinstance(a, Received | Freed):
                self.received[a.request_id] += 1
                self.d_gone.add(a.request_id)
                self.d_gone_at.setdefault(a.request_id, self.now)
            elif isinstance(a, Failed):
                pass  # reported failed; the blocks stay held
            elif isinstance(a, Connect):
                self.perform(self.d.on_peer_ready("P", 0.0, self.now))

    # ---- operations hypothesis chooses ------------------------------------------------
    def op(self, kind: str, i: int, dup: bool, dt: float) -> None:
        n = i % N
        if kind == "p_finish" and n not in self.p_done:
            self.p_done.add(n)
            self.finished_ok.add(f"p{n}")
            self.perform(self.p.on_prefill_finished(f"t:{n}", f"p{n}", (n, n + 1), self.now))
        elif kind == "p_fail" and n not in self.p_done:
            self.p_done.add(n)
            held = f"p{n}" if n in self.p_pushed else None  # a partial WRITE may read them: vLLM keeps them
            if held is not None:
                self.finished_ok.add(held)
            self.perform(self.p.on_prefill_failed(f"t:{n}", "aborted", self.now, held))
        elif kind == "p_progress" and n not in self.p_done:
            self.p_pushed.add(n)
            self.perform(
                self.p.on_prefill_progress(PrefillProgress(f"p{n}", f"t:{n}", (n, n + 1)[: 1 + dup], 2, 0), self.now)
            )
        elif kind == "p_restart" and n not in self.p_done:
            self.perform(self.p.on_prefill_restarted(f"t:{n}", self.now))
        elif kind == "d_register" and n not in self.d_started:
            self.d_started.add(n)
            self.perform(self.d.on_register(f"d{n}", f"t:{n}", PEER, (10 + n, 20 + n), self.now))
        elif kind == "d_abort" and n in self.d_started and n not in self.d_aborted:
            self.d_aborted.add(n)
            if f"d{n}" in self.d.entries:
                self.perform(self.d.on_abort(f"d{n}", self.now))
        elif kind == "deliver_p" and self.to_p:
            self.deliver_p(i, dup)
        elif kind == "deliver_d" and self.to_d:
            self.deliver_d(i, dup)
        elif kind == "land" and self.writes:
            self.land(self.writes.pop(i % len(self.writes)), ok=True)
        elif kind == "write_fails" and self.writes:
            w = self.writes.pop(i % len(self.writes))
            if dup:  # the release is refused: stuck, may still land
                self.stuck.append(Write(w.key, w.p_request, w.d_request, self.limits[w.key], w.final))
                self.perform(self.p.on_write_stuck(w.key, self.now))
            else:
                self.land(w, ok=False)
        elif kind == "stuck_lands" and self.stuck:
            w = self.stuck[i % len(self.stuck)]
            assert w.d_request not in self.d_gone, "a stuck WRITE landed in freed decode blocks"
        elif kind == "stuck_released" and self.stuck:
            w = self.stuck.pop(i % len(self.stuck))
            self.perform(self.p.on_write_released(w.key, self.now))
        elif kind == "write_result" and self.write_results:
            key, ok = self.write_results.pop(i % len(self.write_results))
            self.result(key, ok)
        elif kind == "tick":
            self.tick(dt)

    def result(self, key: str, ok: bool) -> None:
        self.perform(self.p.on_write_done(key, self.now) if ok else self.p.on_write_released(key, self.now))

    def deliver_p(self, i: int, dup: bool) -> None:
        notice = self.to_p[i % len(self.to_p)] if dup else self.to_p.pop(i % len(self.to_p))
        if isinstance(notice, Registration):
            self.perform(self.p.on_registration(notice, self.now))
        else:
            self.perform(self.p.on_cancel(notice, self.now))  # type: ignore[arg-type]

    def deliver_d(self, i: int, dup: bool) -> None:
        notice = self.to_d[i % len(self.to_d)] if dup else self.to_d.pop(i % len(self.to_d))
        self.perform(self.d.on_notice(notice, self.now))

    def land(self, w: Write, ok: bool) -> None:
        if ok:
            assert self.now <= w.land_by
            assert w.d_request not in self.d_gone, "WRITE landed in freed decode blocks"
            if w.final:
                self.to_d.append(Done(w.key, w.d_request))  # NIXL delivers it after the data
        self.write_results.append((w.key, ok))

    def tick(self, dt: float) -> None:
        self.now += dt
        # Writes past their bound cannot land; prefill abandons them at its next expiry.
        self.perform(self.p.expire(self.now))
        self.writes = [w for w in self.writes if w.land_by >= self.now]
        for w in self.stuck:  # past P's hold limit nothing lands (the transport's retry bound)
            if w.land_by < self.now:
                assert w.d_request not in self.d_gone or self.d_gone_at[w.d_request] >= w.land_by
        self.stuck = [w for w in self.stuck if w.land_by >= self.now]
        self.perform(self.d.expire(self.now))

    def quiesce(self) -> None:
        for _ in range(50):
            if not (self.to_p or self.to_d or self.writes or self.write_results or self.stuck):
                break
            while self.stuck:
                self.perform(self.p.on_write_released(self.stuck.pop().key, self.now))
            if not (self.to_p or self.to_d or self.writes or self.write_results):
                break
            while self.writes:
                self.land(self.writes.pop(), ok=True)
            while self.write_results:
                self.result(*self.write_results.pop())
            while self.to_p:
                self.deliver_p(0, dup=False)
            while self.to_d:
                self.deliver_d(0, dup=False)
        for _ in range(3):
            self.tick(3 * T.kv_timeout_s)


def key_of(p_request: str) -> str:
    return f"t:{p_request[1:]}"


OPS = st.tuples(
    st.sampled_from(
        [
            "p_finish",
            "p_fail",
            "p_progress",
            "p_restart",
            "d_register",
            "d_abort",
            "deliver_p",
            "deliver_d",
            "land",
            "write_fails",
            "stuck_lands",
            "stuck_released",
            "write_result",
            "tick",
        ]
    ),
    st.integers(0, 20),
    st.booleans(),
    st.sampled_from([0.1, 1.0, 4.0, 6.0, 29.0, 31.0, 55.0]),
)


@settings(max_examples=1500, deadline=None)
@given(st.lists(OPS, max_size=60))
@example(  # a Cancel overtaking its Registration, the tombstone expiring at the lease, the prefill finishing after
    [
        ("d_register", 1, False, 0.1),
        ("d_abort", 1, False, 0.1),
        ("deliver_p", 1, False, 0.1),
        ("tick", 0, False, 31.0),
        ("p_finish", 1, False, 0.1),
    ]
)
def test_random_interleavings_keep_the_guarantees(ops: list[tuple[str, int, bool, float]]) -> None:
    w = World()
    for op in ops:
        w.op(*op)
        assert w.p.live == sum(e.state not in P_TERMINAL for e in w.p.entries.values()), "live counter drifted"
    w.quiesce()
    assert w.p.entries == {} and w.d.entries == {}, "state kept forever"
    assert w.p.live == 0 and w.p.next_deadline() is None and w.d.next_deadline() is None
    assert all(c == 1 for c in w.released.values()), w.released
    assert set(w.released) == w.finished_ok, "held prefill blocks never released"
    assert all(c == 1 for c in w.received.values()), w.received
    assert set(w.received) == {f"d{n}" for n in w.d_started}, "registered decode request never reported"


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=60))
def test_without_aborts_or_failures_every_transfer_that_meets_in_time_succeeds(
    ops: list[tuple[str, int, bool, float]],
) -> None:
    w = World()
    ok_ops = [op for op in ops if op[0] not in ("p_fail", "d_abort", "write_fails", "tick")]
    for op in ok_ops:
        w.op(*op)
    for n in range(N):
        w.op("p_finish", n, False, 0)
        w.op("d_register", n, False, 0)
    w.quiesce()
    oks = [r for r, c in w.received.items() if c]
    assert sorted(oks) == [f"d{n}" for n in range(N)]
    assert w.d.counters["received"] == N
