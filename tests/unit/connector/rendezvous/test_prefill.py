"""Every (state, event) pair of both rendezvous machines, as transition tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from connector.rendezvous.actions import (
    AbandonWrite,
    Connect,
    Failed,
    Freed,
    Received,
    Release,
    Send,
    StartWrite,
    Timeouts,
)
from connector.rendezvous.decode import DecodeRendezvous, DState
from connector.rendezvous.prefill import PrefillRendezvous, PState
from connector.wire.metadata import Cancel, CancelAck, Done, Failure, PeerAddress, Registration
from connector.wire.plan import PrefillProgress

T = Timeouts(lease_s=30, kv_timeout_s=100, write_grace_s=10, write_timeout_s=5, connect_timeout_s=10)
KEY = "t:x"
REG = Registration(KEY, "d1", "D", (7, 8), write_deadline=90.0, num_tokens=0)
REG2 = Registration(KEY, "d2", "D2", (9,), write_deadline=90.0, num_tokens=0)

# ---------------------------------------------------------------------------------- prefill


def p_setup(name: str) -> PrefillRendezvous:
    p = PrefillRendezvous(T)
    finished = lambda: p.on_prefill_finished(KEY, "p1", (1, 2), 0)  # noqa: E731
    registered = lambda: p.on_registration(REG, 0)  # noqa: E731
    progress = lambda: p.on_prefill_progress(PrefillProgress("p1", KEY, (1,), 2, 0), 0)  # noqa: E731
    steps: dict[str, list[Callable[[], object]]] = {
        "none": [],
        "await_registration": [finished],
        "await_prefill": [registered],
        "pushing": [registered, progress],
        "flushing": [registered, progress, finished],
        "writing": [finished, registered],
        "writing_cancel": [finished, registered, lambda: p.on_cancel(Cancel(KEY, "d1", "D"), 0)],
        "releasing": [finished, registered, lambda: p.on_write_stuck(KEY, 0)],
        "done": [finished, registered, lambda: p.on_write_done(KEY, 0)],
        "failed": [lambda: p.on_prefill_failed(KEY, "abort", 0)],
        "cancelled": [lambda: p.on_cancel(Cancel(KEY, "d1", "D"), 0)],
    }
    for step in steps[name]:
        step()
    return p


def kinds(actions: list[Any]) -> list[str]:
    out = []
    for a in actions:
        name = type(a).__name__
        if isinstance(a, Send):
            name += f":{type(a.notice).__name__}" + ("(q)" if getattr(a.notice, "quarantine", False) else "")
        out.append(name)
    return out


P_EVENTS: dict[str, Callable[[PrefillRendezvous], list[Any]]] = {
    "finished": lambda p: p.on_prefill_finished(KEY, "p2", (3, 4), 1),
    "failed": lambda p: p.on_prefill_failed(KEY, "abort", 1),
    "failed_held": lambda p: p.on_prefill_failed(KEY, "abort", 1, held="p2"),
    "progress": lambda p: p.on_prefill_progress(PrefillProgress("p2", KEY, (3,), 2, 0), 1),
    "restarted": lambda p: p.on_prefill_restarted(KEY, 1),
    "reg_same": lambda p: p.on_registration(REG, 1),
    "reg_other": lambda p: p.on_registration(REG2, 1),
    "cancel_same": lambda p: p.on_cancel(Cancel(KEY, "d1", "D"), 1),
    "cancel_other": lambda p: p.on_cancel(Cancel(KEY, "d2", "D2"), 1),
    "write_done": lambda p: p.on_write_done(KEY, 1),
    "write_released": lambda p: p.on_write_released(KEY, 1),
    "write_stuck": lambda p: p.on_write_stuck(KEY, 1),
    "peer_lost": lambda p: p.on_peer_lost("D", 1),
    "expire_early": lambda p: p.expire(1),
    "expire_late": lambda p: p.expire(1000),
}

# fmt: off
W, R, FAIL, FAILQ, ACK = "StartWrite", "Release", "Send:Failure", "Send:Failure(q)", "Send:CancelAck"
_NO_WRITE: dict[str, list[str]] = {"write_done": [], "write_released": [], "write_stuck": []}


def _same(state: str, **rows: list[str]) -> dict[str, tuple[str | None, list[str]]]:
    return {event: (state, kinds_) for event, kinds_ in rows.items()}


# state -> event -> (state after, action kinds); None = no entry
P_TABLE: dict[str, dict[str, tuple[str | None, list[str]]]] = {
    "none": {
        "failed_held": ("failed", [R]), "progress": (None, []), "restarted": (None, []),
        "finished": ("await_registration", []), "failed": ("failed", []), "reg_same": ("await_prefill", []),
        "reg_other": ("await_prefill", []), "cancel_same": ("cancelled", [ACK]),
        "cancel_other": ("cancelled", [ACK]), **_same(None, **_NO_WRITE),  # type: ignore[arg-type]
        "peer_lost": (None, []), "expire_early": (None, []), "expire_late": (None, []),
    },
    "await_registration": {
        "failed_held": ("await_registration", [R]), "progress": ("await_registration", []),
        "restarted": ("await_registration", []),
        "finished": ("await_registration", [R]), "failed": ("await_registration", []),
        "reg_same": ("writing", [W]), "reg_other": ("writing", [W]), "cancel_same": ("cancelled", [R, ACK]),
        "cancel_other": ("cancelled", [R, ACK]), **_same("await_registration", **_NO_WRITE),
        "peer_lost": ("await_registration", []),
        "expire_early": ("await_registration", []), "expire_late": ("done", [R]),
    },
    "await_prefill": {
        "failed_held": ("done", [R, FAIL]), "progress": ("pushing", [W]), "restarted": ("await_prefill", []),
        "finished": ("writing", [W]), "failed": ("done", [FAIL]), "reg_same": ("await_prefill", []),
        "reg_other": ("await_prefill", [FAIL]), "cancel_same": ("cancelled", [ACK]),
        "cancel_other": ("await_prefill", [ACK]), **_same("await_prefill", **_NO_WRITE),
        "peer_lost": ("done", []),
        "expire_early": ("await_prefill", []), "expire_late": ("done", [FAIL]),
    },
    "pushing": {
        "finished": ("flushing", []), "failed": ("flushing", []), "failed_held": ("flushing", []),
        "progress": ("pushing", []), "restarted": ("pushing", []), "reg_same": ("pushing", []),
        "reg_other": ("pushing", [FAIL]), "cancel_same": ("pushing", []), "cancel_other": ("pushing", [ACK]),
        "write_done": ("await_prefill", []), "write_released": ("done", [FAIL]), "write_stuck": ("releasing", [FAILQ]),
        "peer_lost": ("pushing", []), "expire_early": ("pushing", []), "expire_late": ("releasing", ["AbandonWrite"]),
    },
    "flushing": {
        "finished": ("flushing", [R]), "failed": ("flushing", []), "failed_held": ("flushing", [R]),
        "progress": ("flushing", []), "restarted": ("flushing", []), "reg_same": ("flushing", []),
        "reg_other": ("flushing", [FAIL]), "cancel_same": ("flushing", []), "cancel_other": ("flushing", [ACK]),
        "write_done": ("writing", [W]), "write_released": ("done", [R, FAIL]), "write_stuck": ("releasing", [FAILQ]),
        "peer_lost": ("flushing", []), "expire_early": ("flushing", []), "expire_late": ("releasing", ["AbandonWrite"]),
    },
    "writing": {
        "failed_held": ("writing", [R]), "progress": ("writing", []), "restarted": ("writing", []),
        "finished": ("writing", [R]), "failed": ("writing", []), "reg_same": ("writing", []),
        "reg_other": ("writing", [FAIL]), "cancel_same": ("writing", []), "cancel_other": ("writing", [ACK]),
        "write_done": ("done", [R]), "write_released": ("done", [R, FAIL]), "write_stuck": ("releasing", [FAILQ]),
        "peer_lost": ("writing", []), "expire_early": ("writing", []), "expire_late": ("releasing", ["AbandonWrite"]),
    },
    "writing_cancel": {
        "failed_held": ("writing", [R]), "progress": ("writing", []), "restarted": ("writing", []),
        "finished": ("writing", [R]), "failed": ("writing", []), "reg_same": ("writing", []),
        "reg_other": ("writing", [FAIL]), "cancel_same": ("writing", []), "cancel_other": ("writing", [ACK]),
        "write_done": ("done", [R, ACK]), "write_released": ("done", [R, FAIL]),
        "write_stuck": ("releasing", [FAILQ]),
        "peer_lost": ("writing", []), "expire_early": ("writing", []), "expire_late": ("releasing", ["AbandonWrite"]),
    },
    "releasing": {
        "failed_held": ("releasing", [R]), "progress": ("releasing", []), "restarted": ("releasing", []),
        "finished": ("releasing", [R]), "failed": ("releasing", []), "reg_same": ("releasing", []),
        "reg_other": ("releasing", [FAIL]), "cancel_same": ("releasing", []), "cancel_other": ("releasing", [ACK]),
        "write_done": ("releasing", []), "write_released": ("done", [R, FAIL]), "write_stuck": ("releasing", []),
        "peer_lost": ("releasing", []), "expire_early": ("releasing", []), "expire_late": ("done", [R]),
    },
    "done": {
        "failed_held": ("done", [R]), "progress": ("done", []), "restarted": ("done", []),
        "finished": ("done", [R]), "failed": ("done", []), "reg_same": ("done", []), "reg_other": ("done", [FAIL]),
        "cancel_same": ("done", [ACK]), "cancel_other": ("done", [ACK]), **_same("done", **_NO_WRITE),
        "peer_lost": ("done", []), "expire_early": ("done", []), "expire_late": (None, []),
    },
    "failed": {
        "failed_held": ("failed", [R]), "progress": ("failed", []), "restarted": ("failed", []),
        "finished": ("failed", [R]), "failed": ("failed", []), "reg_same": ("done", [FAIL]),
        "reg_other": ("done", [FAIL]), "cancel_same": ("failed", [ACK]), "cancel_other": ("failed", [ACK]),
        **_same("failed", **_NO_WRITE), "peer_lost": ("failed", []),
        "expire_early": ("failed", []), "expire_late": (None, []),
    },
    "cancelled": {
        "failed_held": ("cancelled", [R]), "progress": ("cancelled", []), "restarted": ("cancelled", []),
        "finished": ("cancelled", [R]), "failed": ("cancelled", []), "reg_same": ("cancelled", []),
        "reg_other": ("cancelled", [FAIL]), "cancel_same": ("cancelled", [ACK]),
        "cancel_other": ("cancelled", [ACK]), **_same("cancelled", **_NO_WRITE),
        "peer_lost": ("cancelled", []), "expire_early": ("cancelled", []), "expire_late": (None, []),
    },
}
# fmt: on


def test_prefill_table_is_exhaustive() -> None:
    assert set(P_TABLE) == {"none", "writing_cancel", *(s.value for s in PState)}
    assert all(set(row) == set(P_EVENTS) for row in P_TABLE.values())


@pytest.mark.parametrize(("state", "event"), [(s, e) for s in P_TABLE for e in P_EVENTS], ids=lambda v: v)
def test_prefill_transition(state: str, event: str) -> None:
    p = p_setup(state)
    actions = P_EVENTS[event](p)
    want_state, want_kinds = P_TABLE[state][event]
    entry = p.entries.get(KEY)
    assert (entry.state.value if entry else None) == want_state
    assert kinds(actions) == want_kinds


def test_prefill_finished_then_registration_writes_tail_blocks_to_that_registration() -> None:
    p = PrefillRendezvous(T)
    assert p.on_prefill_finished(KEY, "p1", (1, 2), 0) == []
    assert p.on_registration(REG, 1) == [StartWrite(KEY, "p1", (1, 2), REG)]
    assert p.entries[KEY].deadline == 1 + T.write_timeout_s


def test_prefill_registration_then_finished_writes() -> None:
    p = PrefillRendezvous(T)
    assert p.on_registration(REG, 0) == []
    assert p.entries[KEY].deadline == REG.write_deadline  # D's lease bounds the wait
    assert p.on_prefill_finished(KEY, "p1", (1, 2), 3) == [StartWrite(KEY, "p1", (1, 2), REG)]


def test_prefill_never_writes_after_the_write_deadline() -> None:
    p = PrefillRendezvous(T)
    p.on_registration(REG, 0)
    actions = p.on_prefill_finished(KEY, "p1", (1, 2), REG.write_deadline)
    assert actions == [Release("p1"), Send("D", Failure(KEY, "d1", "write deadline passed"))]
    assert p.counters["expired"] == 1


def test_prefill_late_registration_is_refused_and_remembered() -> None:
    p = PrefillRendezvous(T)
    assert kinds(p.on_registration(REG, 95)) == [FAIL]
    assert p.entries[KEY].state is PState.DONE
    assert p.on_prefill_finished(KEY, "p1", (1,), 96) == [Release("p1")]


def test_prefill_failure_reaches_a_waiting_decode_at_once() -> None:
    p = PrefillRendezvous(T)
    p.on_registration(REG, 0)
    [send] = p.on_prefill_failed(KEY, "aborted", 1)
    assert send == Send("D", Failure(KEY, "d1", "prefill failed: aborted"))


def test_prefill_cancel_during_write_acks_only_after_the_write() -> None:
    p = p_setup("writing")
    assert p.on_cancel(Cancel(KEY, "d1", "D"), 1) == []
    assert p.on_write_done(KEY, 2) == [Release("p1"), Send("D", CancelAck(KEY, "d1"))]


def test_prefill_expired_blocks_are_released_and_counted() -> None:
    p = p_setup("await_registration")
    assert p.expire(T.lease_s - 0.01) == []
    assert p.expire(T.lease_s) == [Release("p1")]
    assert p.counters["expired"] == 1
    p.expire(2 * T.lease_s)
    assert p.entries == {}


def test_prefill_abandoned_write_keeps_the_blocks_until_the_handle_is_released() -> None:
    """G2: an abandoned WRITE frees nothing by itself; the release decides (issue 8 item 1)."""
    p = p_setup("writing")
    assert p.expire(T.write_timeout_s) == [AbandonWrite(KEY)]
    assert p.entries[KEY].state is PState.RELEASING
    assert p.on_write_released(KEY, 6) == [Release("p1"), Send("D", Failure(KEY, "d1", "WRITE failed"))]


def test_prefill_stuck_write_quarantines_decode_and_holds_its_blocks_until_the_hold_limit() -> None:
    """G2: a WRITE whose handle the backend will not release: D fails now and holds its blocks; P holds
    its blocks until D's hold deadline (in P's clock) has passed."""
    p = p_setup("writing")
    assert p.expire(T.write_timeout_s) == [AbandonWrite(KEY)]
    [send] = p.on_write_stuck(KEY, 6)
    assert isinstance(send, Send) and isinstance(send.notice, Failure) and send.notice.quarantine
    hold_limit = REG.write_deadline + T.write_grace_s
    assert p.expire(hold_limit - 0.01) == []
    assert p.expire(hold_limit) == [Release("p1")]
    assert p.counters["quarantine_expired"] == 1


def test_prefill_refuses_a_registration_with_more_blocks_than_it_holds() -> None:
    """G9: decode registering more blocks than prefill holds gets a clear failure, nothing written."""
    p = PrefillRendezvous(T)
    p.on_prefill_finished(KEY, "p1", (1,), 0, num_tokens=16)
    reg = Registration(KEY, "d1", "D", (7, 8), write_deadline=90.0, num_tokens=32)
    [release, send] = p.on_registration(reg, 1)
    assert release == Release("p1") and isinstance(send, Send)
    assert isinstance(send.notice, Failure) and "registered 2 blocks" in send.notice.reason
    assert p.counters["mismatch"] == 1


def test_prefill_refuses_a_registration_for_another_prompt_length() -> None:
    p = PrefillRendezvous(T)
    p.on_registration(Registration(KEY, "d1", "D", (7,), write_deadline=90.0, num_tokens=20), 0)
    [release, send] = p.on_prefill_finished(KEY, "p1", (1, 2), 1, num_tokens=30)
    assert release == Release("p1") and isinstance(send, Send) and isinstance(send.notice, Failure)
    assert "20 tokens" in send.notice.reason


def test_deadlines_are_a_heap_not_a_scan() -> None:
    """G5 at O(log n): expiring one due entry does not visit the thousands that are not due."""
    p = PrefillRendezvous(T)
    for i in range(2000):
        p.on_prefill_finished(f"t:{i}", f"p{i}", (1,), float(i))
    assert p.live == 2000 and p.next_deadline() == T.lease_s
    assert p.expire(T.lease_s) == [Release("p0")]
    assert p.live == 1999 and p.next_deadline() == 1 + T.lease_s


# ----------------------------------------------------------------------------------- decode

PEER = PeerAddress("P", "127.0.0.1", 5600)


def d_setup(name: str) -> DecodeRendezvous:
    d = DecodeRendezvous(T, "D")
    if name == "none":
        return d
    if name == "pending_cancel":
        d.on_abort_unallocated("d1", KEY, PEER, 0)
        return d
    d.on_register("d1", KEY, PEER, (7, 8), 0)
    if name in ("awaiting_kv", "cancelling", "quarantined"):
        d.on_peer_ready("P", 0.0, 0)
    if name == "cancelling":
        d.on_abort("d1", 0)
    if name == "quarantined":
        d.on_notice(Failure(KEY, "d1", "stuck", quarantine=True), 0)
    return d


D_EVENTS: dict[str, Callable[[DecodeRendezvous], list[Any]]] = {
    "register": lambda d: d.on_register("d1", KEY, PEER, (7, 8), 1),
    "peer_ready": lambda d: d.on_peer_ready("P", 0.0, 1),
    "peer_lost": lambda d: d.on_peer_lost("P", 1),
    "done": lambda d: d.on_notice(Done(KEY, "d1"), 1),
    "failure": lambda d: d.on_notice(Failure(KEY, "d1", "x"), 1),
    "failure_q": lambda d: d.on_notice(Failure(KEY, "d1", "x", quarantine=True), 1),
    "ack": lambda d: d.on_notice(CancelAck(KEY, "d1"), 1),
    "done_other_key": lambda d: d.on_notice(Done("t:old", "d1"), 1),
    "abort": lambda d: d.on_abort("d1", 1),
    "abort_unallocated": lambda d: d.on_abort_unallocated("d1", KEY, PEER, 1),
    "expire_early": lambda d: d.expire(1),
    "expire_late": lambda d: d.expire(1000),
}

# fmt: off
_QUIET = ("done", "failure", "failure_q", "ack", "done_other_key")
D_TABLE: dict[str, dict[str, tuple[str | None, list[str]]]] = {
    "none": {
        "register": ("pending_send", ["Connect"]), "peer_ready": (None, []), "peer_lost": (None, []),
        **{e: (None, []) for e in _QUIET}, "abort": (None, []),
        "abort_unallocated": ("pending_cancel", ["Connect"]), "expire_early": (None, []), "expire_late": (None, []),
    },
    "pending_send": {
        "register": ("pending_send", []), "peer_ready": ("awaiting_kv", ["Send:Registration"]),
        "peer_lost": (None, ["Received"]), **{e: ("pending_send", []) for e in _QUIET},
        "abort": (None, ["Received"]), "abort_unallocated": ("pending_send", []),
        "expire_early": ("pending_send", []), "expire_late": (None, ["Received"]),
    },
    "awaiting_kv": {
        "register": ("awaiting_kv", []), "peer_ready": ("awaiting_kv", []), "peer_lost": ("quarantined", ["Failed"]),
        "done": (None, ["Received"]), "failure": (None, ["Received"]), "failure_q": ("quarantined", ["Failed"]),
        "ack": ("awaiting_kv", []), "done_other_key": ("awaiting_kv", []),
        "abort": ("cancelling", ["Send:Cancel"]), "abort_unallocated": ("awaiting_kv", []),
        "expire_early": ("awaiting_kv", []), "expire_late": (None, ["Received"]),
    },
    "cancelling": {
        "register": ("cancelling", []), "peer_ready": ("cancelling", []), "peer_lost": ("cancelling", []),
        "done": (None, ["Received"]), "failure": (None, ["Received"]), "failure_q": ("cancelling", []),
        "ack": (None, ["Received"]), "done_other_key": ("cancelling", []), "abort": ("cancelling", []),
        "abort_unallocated": ("cancelling", []),
        "expire_early": ("cancelling", []), "expire_late": (None, ["Received"]),
    },
    "quarantined": {
        "register": ("quarantined", []), "peer_ready": ("quarantined", []), "peer_lost": ("quarantined", []),
        "done": ("quarantined", []), "failure": (None, ["Freed"]), "failure_q": ("quarantined", []),
        "ack": ("quarantined", []), "done_other_key": ("quarantined", []), "abort": ("quarantined", []),
        "abort_unallocated": ("quarantined", []),
        "expire_early": ("quarantined", []), "expire_late": (None, ["Freed"]),
    },
    "pending_cancel": {
        "register": ("pending_cancel", []), "peer_ready": (None, ["Send:Cancel"]), "peer_lost": (None, []),
        **{e: ("pending_cancel", []) for e in _QUIET}, "abort": ("pending_cancel", []),
        "abort_unallocated": ("pending_cancel", []),
        "expire_early": ("pending_cancel", []), "expire_late": (None, []),
    },
}
# fmt: on


def test_decode_table_is_exhaustive() -> None:
    assert set(D_TABLE) == {"none", *(s.value for s in DState)}
    assert all(set(row) == set(D_EVENTS) for row in D_TABLE.values())


@pytest.mark.parametrize(("state", "event"), [(s, e) for s in D_TABLE for e in D_EVENTS], ids=lambda v: v)
def test_decode_transition(state: str, event: str) -> None:
    d = d_setup(state)
    actions = D_EVENTS[event](d)
    want_state, want_kinds = D_TABLE[state][event]
    entry = d.entries.get("d1")
    assert (entry.state.value if entry else None) == want_state
    assert kinds(actions) == want_kinds


def test_decode_registration_carries_deadline_in_prefill_clock() -> None:
    d = DecodeRendezvous(T, "D")
    assert d.on_register("d1", KEY, PEER, (7, 8), 0) == [Connect(PEER)]
    [send] = d.on_peer_ready("P", clock_offset=1000.0, now=2)
    assert send == Send("P", Registration(KEY, "d1", "D", (7, 8), 2 + 100 - 10 + 1000.0, 0))


def test_decode_received_ok_only_when_kv_arrived_while_waiting() -> None:
    d = d_setup("awaiting_kv")
    assert d.on_notice(Done(KEY, "d1"), 1) == [Received("d1", ok=True)]
    d = d_setup("cancelling")
    assert d.on_notice(Done(KEY, "d1"), 1) == [Received("d1", ok=False)]


def test_decode_link_loss_fails_at_once_but_frees_only_at_the_hold_deadline() -> None:
    """G2/G3: a closed or silent link is not proof P's process is gone: fail now, free at the deadline."""
    d = d_setup("awaiting_kv")
    assert d.on_peer_lost("P", 5) == [Failed("d1")]
    assert d.expire(T.kv_timeout_s - 0.01) == []
    assert d.expire(T.kv_timeout_s) == [Freed("d1")]


def test_decode_quarantine_ends_early_when_prefill_released_the_write() -> None:
    d = d_setup("quarantined")
    assert d.on_notice(Failure(KEY, "d1", "WRITE failed"), 3) == [Freed("d1")]
    assert d.entries == {}


def test_decode_aborted_before_allocation_cancels_at_once_when_connected() -> None:
    """G5: P releases the blocks it holds for a decode request that never allocated."""
    d = DecodeRendezvous(T, "D")
    d.on_register("d0", "t:other", PEER, (1,), 0)
    d.on_peer_ready("P", 0.0, 0)
    assert d.on_abort_unallocated("d1", KEY, PEER, 1) == [Send("P", Cancel(KEY, "d1", "D"))]
    assert "d1" not in d.entries


def test_decode_cancelling_keeps_the_hold_deadline_of_the_send() -> None:
    d = d_setup("awaiting_kv")
    d.on_abort("d1", 50)
    assert d.expire(T.kv_timeout_s - 0.01) == []
    assert d.expire(T.kv_timeout_s) == [Received("d1", ok=False)]
    assert d.counters["expired"] == 1


def test_timeouts_must_nest() -> None:
    with pytest.raises(ValueError):
        Timeouts(write_timeout_s=10, write_grace_s=5)
