"""Random interleavings of one transfer over N prefill x M decode ranks (1-4 each) with faults per leg.

The legs come from ``connector.parallel.topology`` (12 KV heads: every N, M in 1-4 splits them). Each leg follows
the per-leg contract that ``test_rendezvous_properties.py`` proves for the pairwise machines: D's
registration reaches P; P posts the WRITE once its prefill finished and the registration arrived; the
WRITE lands (then ``Done``), fails cleanly (``Failure``, nothing lands), or gets stuck (quarantine
``Failure``: it may still land until the hold deadline); a ``Cancel`` is answered with ``CancelAck`` once
no WRITE of that leg can land. Hypothesis interleaves those with notice delivery in any order, link loss
on one leg, a killed P rank, a decode abort, P's lease and the hold deadline. The aggregation under test is
``connector.parallel.fanin`` (``SourceSet`` per D rank, ``RankFanIn`` across D ranks, ``FanOut`` per P rank).

Invariants: no WRITE lands in a D rank's blocks after that rank freed them (G2 per rank); a D rank
receives only when every leg into it landed, and the request is finished OK only when every rank
received (Done after every part); a failure on any leg fails the request on every rank; after
quiescence every D rank freed, the request finished, and every live P rank released its blocks (G5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.parallel.fanin import FanOut, RankFanIn, SourceOutcome, SourceSet
from connector.parallel.topology import plan
from connector.wire.metadata import RankId

DEADLINE = 100.0


@dataclass
class LegSim:
    p: int
    d: int
    state: str = "unregistered"  # registered | writing | stuck | over
    cancelled: bool = False
    landed: bool = False
    link: bool = True


@dataclass
class World:
    n: int
    m: int
    legs: dict[tuple[int, int], LegSim]
    sources: list[SourceSet]
    ranks: RankFanIn
    fanouts: dict[int, FanOut]
    finished_p: set[int] = field(default_factory=set)
    killed: set[int] = field(default_factory=set)
    notices: list[tuple[str, int, int, bool]] = field(default_factory=list)  # (kind, p, d, quarantine)
    received: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    freed: set[int] = field(default_factory=set)
    finished_ok: bool | None = None
    past_deadline: bool = False

    @classmethod
    def make(cls, n: int, m: int) -> World:
        topo = plan(p_tp=n, d_tp=m, num_kv_heads=12, head_bytes=4, num_layers=2)
        legs = {(leg.src.tp, leg.dst): LegSim(leg.src.tp, leg.dst) for leg in topo.legs}
        sources = [SourceSet(tuple(r.tp for r in topo.sources(d)), DEADLINE) for d in range(m)]
        fanouts = {p: FanOut(topo.targets(RankId(0, p))) for p in {leg.src.tp for leg in topo.legs}}
        world = cls(n, m, legs, sources, RankFanIn(m), fanouts)
        world.notices = [("reg", p, d, False) for (p, d) in legs]
        return world

    # ---- D side ------------------------------------------------------------------------------

    def apply(self, d: int, out: SourceOutcome) -> None:
        if out.received:
            assert all(leg.landed for leg in self.legs.values() if leg.d == d), "received before every part landed"
            self.received.add(d)
        if out.failed:
            self.failed.add(d)
            if self.ranks.on_rank_failed(d).cancel_everywhere:
                for other in range(self.m):
                    self.apply(other, self.sources[other].on_abort())
        for p in out.cancel:
            assert isinstance(p, int)
            self.notices.append(("cancel", p, d, False))
        if out.freed:
            self.freed.add(d)
            done = self.ranks.on_rank_freed(d)
            if done.finished:
                self.finished_ok = done.ok

    def to_d(self, kind: str, p: int, d: int, quarantine: bool = False) -> None:
        if self.legs[(p, d)].link:
            self.notices.append((kind, p, d, quarantine))

    def deliver(self, i: int) -> None:
        kind, p, d, quarantine = self.notices.pop(i)
        leg, src = self.legs[(p, d)], self.sources[d]
        if not leg.link:
            return
        if kind == "reg":
            self.p_registration(leg)
        elif kind == "cancel":
            self.p_cancel(leg)
        elif kind == "done":
            self.apply(d, src.on_done(p))
        elif kind == "failure":
            self.apply(d, src.on_failure(p, quarantine))
        elif kind == "ack":
            self.apply(d, src.on_cancel_ack(p))

    # ---- P side ------------------------------------------------------------------------------

    def p_registration(self, leg: LegSim) -> None:
        if leg.p in self.killed or leg.state == "over":
            return
        if leg.state != "unregistered" or not self.fanouts[leg.p].on_registration(leg.d):
            if leg.state == "unregistered":
                leg.state = "over"
                self.to_d("failure", leg.p, leg.d)
            return
        leg.state = "registered"
        if leg.p in self.finished_p:
            leg.state = "writing"

    def p_finish(self, p: int) -> None:
        self.finished_p.add(p)
        for leg in self.legs.values():
            if leg.p == p and leg.state == "registered" and not leg.cancelled:
                leg.state = "writing"

    def p_cancel(self, leg: LegSim) -> None:
        if leg.p in self.killed:
            return
        leg.cancelled = True
        if leg.state in ("unregistered", "registered"):
            self.leg_over(leg, "ack")

    def leg_over(self, leg: LegSim, notice: str, quarantine: bool = False) -> None:
        leg.state = "over"
        self.to_d(notice, leg.p, leg.d, quarantine)
        if leg.p not in self.killed:
            self.fanouts[leg.p].on_leg_over(leg.d)

    def land(self, leg: LegSim) -> None:
        assert leg.d not in self.freed, f"G2: a WRITE of leg {leg.p}->{leg.d} landed in freed blocks"
        leg.landed = True

    def write_end(self, leg: LegSim, how: str) -> None:
        if how == "land":
            self.land(leg)
            self.leg_over(leg, "ack" if leg.cancelled else "done")
        elif how == "err":
            self.leg_over(leg, "ack" if leg.cancelled else "failure")
        else:  # stuck: a quarantine Failure now; it may land until P's hold limit (before D's deadline)
            leg.state = "stuck"
            self.to_d("failure", leg.p, leg.d, True)

    # ---- faults ------------------------------------------------------------------------------

    def lose_link(self, p: int, d: int) -> None:
        leg = self.legs[(p, d)]
        if not leg.link:
            return
        leg.link = False
        self.notices = [n for n in self.notices if (n[1], n[2]) != (p, d)]
        self.apply(d, self.sources[d].on_link_lost(p))
        if leg.state in ("unregistered", "registered"):
            self.leg_over(leg, "ack")

    def kill(self, p: int) -> None:
        self.killed.add(p)
        for (lp, d), leg in self.legs.items():
            if lp == p:
                if leg.state == "writing":
                    leg.state = "stuck"  # the dead process's posted WRITE may still land until the deadline
                self.lose_link(p, d)

    def deadline(self) -> None:
        self.past_deadline = True
        for leg in self.legs.values():
            if leg.state in ("unregistered", "registered") and leg.p not in self.killed:
                self.leg_over(leg, "failure")  # past D's write deadline P posts no WRITE for it any more
            if leg.state == "stuck":
                leg.state = "over"  # P's hold limit passed: nothing of it can land any more
                if leg.p not in self.killed:
                    self.fanouts[leg.p].on_leg_over(leg.d)
        for d in range(self.m):
            self.apply(d, self.sources[d].on_deadline(DEADLINE))
        for p, fan in self.fanouts.items():
            if p not in self.killed:
                fan.on_lease_expired()


def events(w: World) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = [("deliver", i, 0) for i in range(len(w.notices))]
    out += [("finish", p, 0) for p in range(w.n) if p not in w.finished_p and p not in w.killed]
    for (p, d), leg in w.legs.items():
        if leg.state == "writing":
            out += [("land", p, d), ("err", p, d), ("stuck", p, d)]
        if leg.state == "stuck" and not w.past_deadline:
            out.append(("late_land", p, d))
        if leg.link:
            out.append(("lose", p, d))
    out += [("kill", p, 0) for p in range(w.n) if p not in w.killed]
    out += [("lease", p, 0) for p in w.fanouts if p in w.finished_p and p not in w.killed]
    out.append(("abort", 0, 0))
    if not any(leg.state == "writing" for leg in w.legs.values()) and not w.past_deadline:
        out.append(("deadline", 0, 0))
    return out


def step(w: World, ev: tuple[str, int, int]) -> None:
    kind, a, b = ev
    if kind == "deliver":
        w.deliver(a)
    elif kind == "finish":
        w.p_finish(a)
    elif kind in ("land", "err", "stuck"):
        w.write_end(w.legs[(a, b)], kind)
    elif kind == "late_land":
        w.land(w.legs[(a, b)])
    elif kind == "lose":
        w.lose_link(a, b)
    elif kind == "kill":
        w.kill(a)
    elif kind == "abort":
        for d in range(w.m):
            w.apply(d, w.sources[d].on_abort())
    elif kind == "deadline":
        w.deadline()
    elif kind == "lease":  # P's lease (shorter than D's hold): targets that never registered are over
        w.fanouts[a].on_lease_expired()


def check(w: World) -> None:
    """Invariants after every step."""
    if w.failed:  # at once, not at the deadline: the other ranks were told in the same step
        assert all(s.failed or s.received for s in w.sources), "a failure on one rank left another waiting"
    for p, fan in w.fanouts.items():
        if fan.released:  # P's blocks are free for reuse: no leg of that rank may still read them
            busy = [leg for leg in w.legs.values() if leg.p == p and leg.state in ("registered", "writing", "stuck")]
            assert not busy, f"P rank {p} released its blocks while {busy} may still read them"


def quiesce(w: World) -> None:
    for _ in range(10_000):
        if w.notices:
            w.deliver(0)
        elif any(p not in w.finished_p and p not in w.killed for p in range(w.n)):
            w.p_finish(next(p for p in range(w.n) if p not in w.finished_p and p not in w.killed))
        elif any(leg.state == "writing" for leg in w.legs.values()):
            w.write_end(next(leg for leg in w.legs.values() if leg.state == "writing"), "land")
        elif not w.past_deadline:
            w.deadline()
        else:
            return
    raise AssertionError("did not quiesce")


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 4), m=st.integers(1, 4), data=st.data())
def test_random_interleavings_over_n_by_m_ranks_keep_every_guarantee_per_rank(
    n: int, m: int, data: st.DataObject
) -> None:
    w = World.make(n, m)
    faulty = data.draw(st.booleans(), label="faults")
    for _ in range(data.draw(st.integers(0, 40), label="steps")):
        options = events(w)
        if not faulty:
            options = [e for e in options if e[0] in ("deliver", "finish", "land")] or options
        step(w, data.draw(st.sampled_from(options)))
        check(w)
    quiesce(w)
    check(w)
    assert w.freed == set(range(m)), "every D rank freed its blocks"
    assert w.finished_ok is not None, "the request finished across ranks"
    assert w.finished_ok == (w.received == set(range(m)) and not w.failed)
    if w.failed:
        assert all(s.failed or s.received for s in w.sources), "a failure on one leg fails every rank"
        assert w.finished_ok is False
    if w.finished_ok:
        assert all(leg.landed for leg in w.legs.values()), "Done only after every part"
    for p, fan in w.fanouts.items():
        assert fan.released or p in w.killed, f"P rank {p} still holds its blocks"


def test_a_clean_run_over_every_rank_count_finishes_ok() -> None:
    for n in range(1, 5):
        for m in range(1, 5):
            w = World.make(n, m)
            quiesce(w)
            assert w.finished_ok is True and w.received == set(range(m)), (n, m)
