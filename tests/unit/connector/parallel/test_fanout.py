"""connector.parallel.fanout: one P rank's transfer fanned out over the D ranks it writes (P_tp < D_tp), pure.

Tables of single scenarios, then random interleavings (hypothesis) of registrations, WRITE outcomes, cancels,
lost links and deadlines over 1-4 target D ranks. Invariants: a D rank is written only after its own
registration; P's blocks are released exactly once and only when no leg has a WRITE in flight or stuck (G2 on
the P side); every notice leaves under the pairing key; everything ends quiescent (G5).
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from connector.parallel.fanout import PrefillFanOut, leg_key, split_leg_key
from connector.rendezvous.actions import AbandonWrite, Action, Release, Send, StartWrite, Timeouts
from connector.wire.metadata import Cancel, CancelAck, Done, Failure, Registration
from connector.wire.plan import PrefillProgress

T = Timeouts(lease_s=10, kv_timeout_s=60, write_grace_s=20, write_timeout_s=5, connect_timeout_s=5)
KEY, BLOCKS = "t:1", (1, 2)


def reg(d: int, engine: str = "D", deadline: float = 50.0, d_request: str = "d1") -> Registration:
    return Registration(KEY, d_request, engine, (5, 6), deadline, 32, d)


def cancel(d: int) -> Cancel:
    return Cancel(KEY, "d1", "D", d)


def writes(actions: list[Action]) -> list[StartWrite]:
    return [a for a in actions if isinstance(a, StartWrite)]


def releases(actions: list[Action]) -> list[str]:
    return [a.request_id for a in actions if isinstance(a, Release)]


def failures(actions: list[Action]) -> list[tuple[str, Failure]]:
    return [(a.engine_id, a.notice) for a in actions if isinstance(a, Send) and isinstance(a.notice, Failure)]


def test_leg_keys_are_injective_for_any_pairing_key() -> None:
    assert split_leg_key(leg_key("a:1:b", 3)) == ("a:1:b", 3)
    assert leg_key("x", 1) != leg_key("1:x", 0)


def test_each_d_rank_is_written_after_its_own_registration_and_p_releases_after_the_last_leg() -> None:
    f = PrefillFanOut(T)
    out = f.on_registration(reg(0), 1.0, (0, 1))
    assert out == []
    out = f.on_prefill_finished(KEY, "p1", BLOCKS, 2.0, 32)
    [w0] = writes(out)
    assert w0.key == leg_key(KEY, 0) and w0.registration.key == KEY  # Done travels under the pairing key
    assert w0.registration.d_rank == 0 and releases(out) == []
    [w1] = writes(f.on_registration(reg(1), 3.0, (0, 1)))  # D rank 1 registers later: written then, not before
    assert w1.registration.sender == "D#pp0tp1"
    assert releases(f.on_write_done(w0.key, 4.0)) == []  # leg 1 still writes P's blocks
    assert releases(f.on_write_done(w1.key, 5.0)) == ["p1"]
    assert f.live == 0


def test_a_failed_write_on_one_leg_tells_that_d_rank_and_keeps_the_blocks_while_another_leg_writes() -> None:
    f = PrefillFanOut(T)
    f.on_registration(reg(0), 1.0, (0, 1))
    f.on_registration(reg(1), 1.0, (0, 1))
    w0, w1 = writes(f.on_prefill_finished(KEY, "p1", BLOCKS, 2.0, 32))
    out = f.on_write_released(w0.key, 3.0)  # ERR, handle released: nothing of it can land
    assert [(e, n.key, n.quarantine) for e, n in failures(out)] == [("D", KEY, False)] and releases(out) == []
    assert releases(f.on_write_done(w1.key, 4.0)) == ["p1"]


def test_a_stuck_write_keeps_the_blocks_until_its_quarantine_ends() -> None:
    f = PrefillFanOut(T)
    f.on_registration(reg(0), 1.0, (0, 1))
    f.on_registration(reg(1), 1.0, (0, 1))
    w0, w1 = writes(f.on_prefill_finished(KEY, "p1", BLOCKS, 2.0, 32))
    out = f.on_write_stuck(w0.key, 3.0)
    assert [n.quarantine for _, n in failures(out)] == [True]
    assert releases(f.on_write_done(w1.key, 4.0)) == []  # leg 0 may still land: P's blocks stay
    assert releases(f.expire(49.0)) == []
    assert releases(f.expire(50.0 + T.write_grace_s)) == ["p1"]  # D's hold deadline has passed by then


def test_a_d_rank_that_never_registers_holds_the_blocks_until_the_lease_and_is_refused_later() -> None:
    f = PrefillFanOut(T)
    f.on_registration(reg(0), 1.0, (0, 1))
    [w0] = writes(f.on_prefill_finished(KEY, "p1", BLOCKS, 2.0, 32))
    assert releases(f.on_write_done(w0.key, 3.0)) == []
    assert releases(f.expire(2.0 + T.lease_s)) == ["p1"]
    out = f.on_registration(reg(1), 13.0, (0, 1))
    assert writes(out) == [] and [n.reason for _, n in failures(out)] == [
        "the transfer ended before this decode rank registered"
    ]


def test_a_siblings_cancel_ends_the_legs_that_never_registered() -> None:
    """D rank 1's handshake failed: D's scheduler cancels every rank; rank 0's Cancel frees P at once."""
    f = PrefillFanOut(T)
    f.on_registration(reg(0), 1.0, (0, 1))
    out = f.on_cancel(cancel(0), 2.0, (0, 1))
    assert [a.notice for a in out if isinstance(a, Send)] == [CancelAck(KEY, "d1")]
    assert releases(f.on_prefill_finished(KEY, "p1", BLOCKS, 3.0, 32)) == ["p1"]  # nothing written, nothing held
    assert writes(f.on_registration(reg(1), 4.0, (0, 1))) == []  # a late registration of rank 1: refused


def test_a_cancel_while_a_leg_writes_is_acked_after_it_and_releases_then() -> None:
    f = PrefillFanOut(T)
    f.on_registration(reg(0), 1.0, (0, 1))
    [w0] = writes(f.on_prefill_finished(KEY, "p1", BLOCKS, 2.0, 32))
    out = f.on_cancel(cancel(0), 3.0, (0, 1))
    assert out == []  # answered once the WRITE is over
    out = f.on_write_done(w0.key, 4.0)
    assert releases(out) == ["p1"] and CancelAck(KEY, "d1") in [a.notice for a in out if isinstance(a, Send)]


def test_what_cannot_pair_is_refused_at_once() -> None:
    f = PrefillFanOut(T)
    f.on_registration(reg(0), 1.0, (0, 1))
    [(_, other)] = failures(f.on_registration(reg(1, engine="E"), 1.0, (0, 1)))
    assert "another decode engine" in other.reason
    [(_, stranger)] = failures(f.on_registration(reg(2), 1.0, (0, 1)))
    assert "not written by this prefill rank" in stranger.reason
    [(_, conflict)] = failures(f.on_registration(reg(0, d_request="d2"), 1.0, (0, 1)))
    assert "pairing key already used" in conflict.reason


def test_a_prefill_failure_releases_at_once_and_fails_every_registered_leg() -> None:
    f = PrefillFanOut(T)
    f.on_registration(reg(0), 1.0, (0, 1))
    out = f.on_prefill_failed(KEY, "oom", 2.0, held="p1")
    assert releases(out) == ["p1"] and [e for e, _ in failures(out)] == ["D"]
    assert "prefill failed" in failures(f.on_registration(reg(1), 3.0, (0, 1)))[0][1].reason


def test_progress_reaches_every_registered_leg() -> None:
    f = PrefillFanOut(T)
    f.on_registration(reg(0), 1.0, (0, 1))
    f.on_registration(reg(1), 1.0, (0, 1))
    out = f.on_prefill_progress(PrefillProgress("p1", KEY, (1,), 2, 32), 2.0)
    assert sorted(w.registration.d_rank for w in writes(out)) == [0, 1]
    assert all(not w.final and w.registration.key == KEY for w in writes(out))


def test_one_target_behaves_as_the_plain_machine() -> None:
    f = PrefillFanOut(T)
    assert f.on_prefill_finished(KEY, "p1", BLOCKS, 1.0, 32) == []
    [w] = writes(f.on_registration(reg(0), 2.0))
    out = f.on_write_done(w.key, 3.0)
    assert releases(out) == ["p1"]
    assert releases(f.on_prefill_finished(KEY, "p1", BLOCKS, 4.0, 32)) == ["p1"]  # never pair a second prefill
    f.expire(1000.0)
    f.expire(2000.0)
    assert not f.entries and f.live == 0


def _over(f: PrefillFanOut, leg: str) -> bool:
    entry = f.legs.entries.get(leg)
    return entry is None or entry.state.value == "done"


# ---- random interleavings ---------------------------------------------------------------------------------


def blocks_of(request_id: str) -> tuple[int, ...]:
    """Each prefill's own blocks: p1 holds BLOCKS, p<n> holds (10n + 1, 10n + 2)."""
    n = int(request_id[1:])
    return BLOCKS if n == 1 else (10 * n + 1, 10 * n + 2)


def owner(blocks: tuple[int, ...]) -> str:
    return f"p{max(1, blocks[0] // 10)}"


EVENT = st.tuples(
    st.sampled_from(["reg", "finish", "fail", "done", "err", "stuck", "cancel", "lost", "tick", "progress"]),
    st.integers(0, 3),
)


@settings(max_examples=300, deadline=None)
@given(targets=st.integers(1, 4), events=st.lists(EVENT, max_size=30))
@example(  # found in a clean-clone run: p1 failed and was released, its tombstone expired, a later p2 paired
    targets=1, events=[("fail", 1), ("reg", 0), ("reg", 0), ("tick", 0), ("reg", 0), ("finish", 0)]
)
@example(
    targets=1, events=[("reg", 0), ("finish", 0), ("done", 0), ("tick", 0), ("tick", 0), ("reg", 0), ("progress", 0)]
)
def test_random_interleavings_keep_the_fan_out_safe_and_quiescent(targets: int, events: list[tuple[str, int]]) -> None:
    f, now = PrefillFanOut(T), 0.0
    ranks = tuple(range(targets))
    in_flight: dict[str, int] = {}  # leg key -> D rank, WRITEs posted and not over (stuck ones included)
    registered: set[int] = set()
    stuck: set[str] = set()
    released: list[str] = []  # Releases of the first prefill's blocks ("p1")
    freed: set[str] = set()  # every prefill whose blocks P released (a later prefill may pair with the key once
    # its tombstone is gone: its blocks differ, ``blocks_of``)
    prefills = iter(f"p{n}" for n in range(1, 100))

    def run(actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, StartWrite):
                d = split_leg_key(a.key)[1]
                assert d in registered, "a D rank is written only after its own registration"
                assert owner(a.local_blocks) not in freed, "no WRITE from released blocks"
                assert a.registration.key == KEY
                in_flight[a.key] = d
            elif isinstance(a, Release) and a.request_id != "p1":
                freed.add(a.request_id)
            elif isinstance(a, Release) and a.request_id == "p1":
                # only a stuck WRITE past its quarantine (D's hold deadline has passed: D freed first) may remain
                assert all(leg in stuck and _over(f, leg) for leg in in_flight), "no leg can still write P's blocks"
                released.append(a.request_id)
                freed.add(a.request_id)
            elif isinstance(a, AbandonWrite):
                in_flight.pop(a.key, None)
                run(f.on_write_released(a.key, now))  # the backend releases it
            elif isinstance(a, Send):
                assert a.notice.key == KEY, "notices leave under the pairing key"

    def end_write(leg: str, how: str) -> None:
        if how == "done":
            in_flight.pop(leg)
            run(f.on_write_done(leg, now))
        elif how == "err":
            in_flight.pop(leg)
            run(f.on_write_released(leg, now))
        else:
            stuck.add(leg)
            run(f.on_write_stuck(leg, now))  # stays in flight until released or its hold deadline

    ended = False  # the first prefill finished or failed
    for kind, i in events:
        d = i % targets
        now += 0.5
        if kind == "reg":
            registered.add(d)
            run(f.on_registration(reg(d, deadline=now + 40), now, ranks))
        elif kind == "finish":
            ended = True
            rid = next(prefills)
            run(f.on_prefill_finished(KEY, rid, blocks_of(rid), now, 32))
        elif kind == "fail":
            ended = True
            rid = next(prefills)
            run(f.on_prefill_failed(KEY, "x", now, held=rid if i % 2 else None))
        elif kind == "progress" and not ended:
            # P's scheduler reports progress only while the prefill runs: never after it finished or failed
            run(f.on_prefill_progress(PrefillProgress("p1", KEY, BLOCKS[: 1 + i % 2], 2, 32), now))
        elif kind in ("done", "err", "stuck") and in_flight:
            end_write(sorted(in_flight)[i % len(in_flight)], kind)
        elif kind == "cancel":
            run(f.on_cancel(cancel(d), now, ranks))
        elif kind == "lost":
            run(f.on_peer_lost(reg(d).sender, now))
        elif kind == "tick":
            now += 7.0
            run(f.expire(now))
    for _ in range(8):  # the rest runs out: WRITEs end (stuck ones when their quarantine ends), deadlines pass
        for leg in sorted(in_flight):
            entry = f.legs.entries.get(leg)
            if entry is not None and entry.state.value != "releasing":
                end_write(leg, "done")
        now += 100.0
        run(f.expire(now))
        for leg in [k for k in in_flight if k not in f.legs.entries or f.legs.entries[k].state.value == "done"]:
            in_flight.pop(leg)
    first = next(((k, i) for k, i in events if k in ("finish", "fail")), None)
    holds = first is not None and (first[0] == "finish" or first[1] % 2 == 1)
    assert released == (["p1"] if holds else []), "the first prefill's blocks are released exactly once"
    assert not f.entries and f.live == 0 and f.next_deadline() is None, "quiescent"


def test_done_notices_of_the_plain_machine_keep_the_pairing_key() -> None:
    f = PrefillFanOut(T)
    f.on_registration(reg(1), 1.0, (0, 1))
    f.on_registration(reg(0), 1.0, (0, 1))
    w0, _ = writes(f.on_prefill_finished(KEY, "p1", BLOCKS, 2.0, 32))
    assert Done(w0.registration.key, w0.registration.d_request_id) == Done(KEY, "d1")
