"""Every (state, event) pair of both rendezvous machines, as transition tables."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from connector.metadata import Cancel, CancelAck, Done, Failure, PeerAddress, Registration
from connector.rendezvous import (
    AbandonWrite,
    Connect,
    DecodeRendezvous,
    DState,
    PrefillRendezvous,
    PState,
    Received,
    Release,
    Send,
    StartWrite,
    Timeouts,
)

T = Timeouts(lease_s=30, kv_timeout_s=100, write_grace_s=10, write_timeout_s=5, connect_timeout_s=10)
KEY = "t:x"
REG = Registration(KEY, "d1", "D", (7, 8), write_deadline=90.0)
REG2 = Registration(KEY, "d2", "D2", (9,), write_deadline=90.0)

# ---------------------------------------------------------------------------------- prefill


def p_setup(name: str) -> PrefillRendezvous:
    p = PrefillRendezvous(T)
    steps: dict[str, list[Callable[[], object]]] = {
        "none": [],
        "await_registration": [lambda: p.on_prefill_finished(KEY, "p1", (1, 2), 0)],
        "await_prefill": [lambda: p.on_registration(REG, 0)],
        "writing": [lambda: p.on_prefill_finished(KEY, "p1", (1, 2), 0), lambda: p.on_registration(REG, 0)],
        "writing_cancel": [
            lambda: p.on_prefill_finished(KEY, "p1", (1, 2), 0),
            lambda: p.on_registration(REG, 0),
            lambda: p.on_cancel(Cancel(KEY, "d1", "D"), 0),
        ],
        "done": [
            lambda: p.on_prefill_finished(KEY, "p1", (1, 2), 0),
            lambda: p.on_registration(REG, 0),
            lambda: p.on_write_result(KEY, True, 0),
        ],
        "failed": [lambda: p.on_prefill_failed(KEY, "abort", 0)],
        "cancelled": [lambda: p.on_cancel(Cancel(KEY, "d1", "D"), 0)],
    }
    for step in steps[name]:
        step()
    return p


def kinds(actions):
    return [type(a).__name__ + (f":{type(a.notice).__name__}" if isinstance(a, Send) else "") for a in actions]


P_EVENTS: dict[str, Callable[[PrefillRendezvous], list]] = {
    "finished": lambda p: p.on_prefill_finished(KEY, "p2", (3,), 1),
    "failed": lambda p: p.on_prefill_failed(KEY, "abort", 1),
    "reg_same": lambda p: p.on_registration(REG, 1),
    "reg_other": lambda p: p.on_registration(REG2, 1),
    "cancel_same": lambda p: p.on_cancel(Cancel(KEY, "d1", "D"), 1),
    "cancel_other": lambda p: p.on_cancel(Cancel(KEY, "d2", "D2"), 1),
    "write_ok": lambda p: p.on_write_result(KEY, True, 1),
    "write_err": lambda p: p.on_write_result(KEY, False, 1),
    "peer_lost": lambda p: p.on_peer_lost("D", 1),
    "expire_early": lambda p: p.expire(1),
    "expire_late": lambda p: p.expire(1000),
}

# fmt: off
W, R, FAIL, ACK = "StartWrite", "Release", "Send:Failure", "Send:CancelAck"
# state -> event -> (state after, action kinds); None = no entry
P_TABLE: dict[str, dict[str, tuple[str | None, list[str]]]] = {
    "none": {
        "finished": ("await_registration", []), "failed": ("failed", []), "reg_same": ("await_prefill", []),
        "reg_other": ("await_prefill", []), "cancel_same": ("cancelled", [ACK]),
        "cancel_other": ("cancelled", [ACK]), "write_ok": (None, []), "write_err": (None, []),
        "peer_lost": (None, []), "expire_early": (None, []), "expire_late": (None, []),
    },
    "await_registration": {
        "finished": ("await_registration", [R]), "failed": ("await_registration", []),
        "reg_same": ("writing", [W]), "reg_other": ("writing", [W]), "cancel_same": ("cancelled", [R, ACK]),
        "cancel_other": ("cancelled", [R, ACK]), "write_ok": ("await_registration", []),
        "write_err": ("await_registration", []), "peer_lost": ("await_registration", []),
        "expire_early": ("await_registration", []), "expire_late": ("done", [R]),
    },
    "await_prefill": {
        "finished": ("writing", [W]), "failed": ("done", [FAIL]), "reg_same": ("await_prefill", []),
        "reg_other": ("await_prefill", [FAIL]), "cancel_same": ("cancelled", [ACK]),
        "cancel_other": ("await_prefill", [ACK]), "write_ok": ("await_prefill", []),
        "write_err": ("await_prefill", []), "peer_lost": ("done", []),
        "expire_early": ("await_prefill", []), "expire_late": ("done", [FAIL]),
    },
    "writing": {
        "finished": ("writing", [R]), "failed": ("writing", []), "reg_same": ("writing", []),
        "reg_other": ("writing", [FAIL]), "cancel_same": ("writing", []), "cancel_other": ("writing", [ACK]),
        "write_ok": ("done", [R]), "write_err": ("done", [R, FAIL]), "peer_lost": ("writing", []),
        "expire_early": ("writing", []), "expire_late": ("done", ["AbandonWrite", R, FAIL]),
    },
    "writing_cancel": {
        "finished": ("writing", [R]), "failed": ("writing", []), "reg_same": ("writing", []),
        "reg_other": ("writing", [FAIL]), "cancel_same": ("writing", []), "cancel_other": ("writing", [ACK]),
        "write_ok": ("done", [R, ACK]), "write_err": ("done", [R, FAIL]), "peer_lost": ("writing", []),
        "expire_early": ("writing", []), "expire_late": ("done", ["AbandonWrite", R, FAIL]),
    },
    "done": {
        "finished": ("done", [R]), "failed": ("done", []), "reg_same": ("done", []), "reg_other": ("done", [FAIL]),
        "cancel_same": ("done", [ACK]), "cancel_other": ("done", [ACK]), "write_ok": ("done", []),
        "write_err": ("done", []), "peer_lost": ("done", []), "expire_early": ("done", []),
        "expire_late": (None, []),
    },
    "failed": {
        "finished": ("failed", [R]), "failed": ("failed", []), "reg_same": ("done", [FAIL]),
        "reg_other": ("done", [FAIL]), "cancel_same": ("failed", [ACK]), "cancel_other": ("failed", [ACK]),
        "write_ok": ("failed", []), "write_err": ("failed", []), "peer_lost": ("failed", []),
        "expire_early": ("failed", []), "expire_late": (None, []),
    },
    "cancelled": {
        "finished": ("cancelled", [R]), "failed": ("cancelled", []), "reg_same": ("cancelled", []),
        "reg_other": ("cancelled", [FAIL]), "cancel_same": ("cancelled", [ACK]),
        "cancel_other": ("cancelled", [ACK]), "write_ok": ("cancelled", []), "write_err": ("cancelled", []),
        "peer_lost": ("cancelled", []), "expire_early": ("cancelled", []), "expire_late": (None, []),
    },
}
# fmt: on


def test_prefill_table_is_exhaustive():
    assert set(P_TABLE) == {"none", "writing_cancel", *(s.value for s in PState)}
    assert all(set(row) == set(P_EVENTS) for row in P_TABLE.values())


@pytest.mark.parametrize(("state", "event"), [(s, e) for s in P_TABLE for e in P_EVENTS], ids=lambda v: v)
def test_prefill_transition(state, event):
    p = p_setup(state)
    actions = P_EVENTS[event](p)
    want_state, want_kinds = P_TABLE[state][event]
    entry = p.entries.get(KEY)
    assert (entry.state.value if entry else None) == want_state
    assert kinds(actions) == want_kinds


def test_prefill_finished_then_registration_writes_tail_blocks_to_that_registration():
    p = PrefillRendezvous(T)
    assert p.on_prefill_finished(KEY, "p1", (1, 2), 0) == []
    assert p.on_registration(REG, 1) == [StartWrite(KEY, "p1", (1, 2), REG)]
    assert p.entries[KEY].deadline == 1 + T.write_timeout_s


def test_prefill_registration_then_finished_writes():
    p = PrefillRendezvous(T)
    assert p.on_registration(REG, 0) == []
    assert p.entries[KEY].deadline == REG.write_deadline  # D's lease bounds the wait
    assert p.on_prefill_finished(KEY, "p1", (1, 2), 3) == [StartWrite(KEY, "p1", (1, 2), REG)]


def test_prefill_never_writes_after_the_write_deadline():
    p = PrefillRendezvous(T)
    p.on_registration(REG, 0)
    actions = p.on_prefill_finished(KEY, "p1", (1,), REG.write_deadline)
    assert actions == [Release("p1"), Send("D", Failure(KEY, "d1", "write deadline passed"))]
    assert p.counters["expired"] == 1


def test_prefill_late_registration_is_refused_and_remembered():
    p = PrefillRendezvous(T)
    assert kinds(p.on_registration(REG, 95)) == [FAIL]
    assert p.entries[KEY].state is PState.DONE
    assert p.on_prefill_finished(KEY, "p1", (1,), 96) == [Release("p1")]


def test_prefill_failure_reaches_a_waiting_decode_at_once():
    p = PrefillRendezvous(T)
    p.on_registration(REG, 0)
    [send] = p.on_prefill_failed(KEY, "aborted", 1)
    assert send == Send("D", Failure(KEY, "d1", "prefill failed: aborted"))


def test_prefill_cancel_during_write_acks_only_after_the_write():
    p = p_setup("writing")
    assert p.on_cancel(Cancel(KEY, "d1", "D"), 1) == []
    assert p.on_write_result(KEY, True, 2) == [Release("p1"), Send("D", CancelAck(KEY, "d1"))]


def test_prefill_expired_blocks_are_released_and_counted():
    p = p_setup("await_registration")
    assert p.expire(T.lease_s - 0.01) == []
    assert p.expire(T.lease_s) == [Release("p1")]
    assert p.counters["expired"] == 1
    p.expire(2 * T.lease_s)
    assert p.entries == {}


def test_prefill_abandoned_write():
    p = p_setup("writing")
    actions = p.expire(T.write_timeout_s)
    assert actions[:2] == [AbandonWrite(KEY), Release("p1")]


# ----------------------------------------------------------------------------------- decode

PEER = PeerAddress("P", "127.0.0.1", 5600)


def d_setup(name: str) -> DecodeRendezvous:
    d = DecodeRendezvous(T, "D")
    if name == "none":
        return d
    d.on_register("d1", KEY, PEER, (7, 8), 0)
    if name in ("awaiting_kv", "cancelling"):
        d.on_peer_ready("P", 0.0, 0)
    if name == "cancelling":
        d.on_abort("d1", 0)
    return d


D_EVENTS: dict[str, Callable[[DecodeRendezvous], list]] = {
    "register": lambda d: d.on_register("d1", KEY, PEER, (7, 8), 1),
    "peer_ready": lambda d: d.on_peer_ready("P", 0.0, 1),
    "peer_lost": lambda d: d.on_peer_lost("P", 1),
    "done": lambda d: d.on_notice(Done(KEY, "d1"), 1),
    "failure": lambda d: d.on_notice(Failure(KEY, "d1", "x"), 1),
    "ack": lambda d: d.on_notice(CancelAck(KEY, "d1"), 1),
    "done_other_key": lambda d: d.on_notice(Done("t:old", "d1"), 1),
    "abort": lambda d: d.on_abort("d1", 1),
    "expire_early": lambda d: d.expire(1),
    "expire_late": lambda d: d.expire(1000),
}

# fmt: off
D_TABLE: dict[str, dict[str, tuple[str | None, list[str]]]] = {
    "none": {
        "register": ("pending_send", ["Connect"]), "peer_ready": (None, []), "peer_lost": (None, []),
        "done": (None, []), "failure": (None, []), "ack": (None, []), "done_other_key": (None, []),
        "abort": (None, []), "expire_early": (None, []), "expire_late": (None, []),
    },
    "pending_send": {
        "register": ("pending_send", []), "peer_ready": ("awaiting_kv", ["Send:Registration"]),
        "peer_lost": (None, ["Received"]), "done": ("pending_send", []), "failure": ("pending_send", []),
        "ack": ("pending_send", []), "done_other_key": ("pending_send", []), "abort": (None, ["Received"]),
        "expire_early": ("pending_send", []), "expire_late": (None, ["Received"]),
    },
    "awaiting_kv": {
        "register": ("awaiting_kv", []), "peer_ready": ("awaiting_kv", []), "peer_lost": (None, ["Received"]),
        "done": (None, ["Received"]), "failure": (None, ["Received"]), "ack": ("awaiting_kv", []),
        "done_other_key": ("awaiting_kv", []), "abort": ("cancelling", ["Send:Cancel"]),
        "expire_early": ("awaiting_kv", []), "expire_late": (None, ["Received"]),
    },
    "cancelling": {
        "register": ("cancelling", []), "peer_ready": ("cancelling", []), "peer_lost": (None, ["Received"]),
        "done": (None, ["Received"]), "failure": (None, ["Received"]), "ack": (None, ["Received"]),
        "done_other_key": ("cancelling", []), "abort": ("cancelling", []),
        "expire_early": ("cancelling", []), "expire_late": (None, ["Received"]),
    },
}
# fmt: on


def test_decode_table_is_exhaustive():
    assert set(D_TABLE) == {"none", *(s.value for s in DState)}
    assert all(set(row) == set(D_EVENTS) for row in D_TABLE.values())


@pytest.mark.parametrize(("state", "event"), [(s, e) for s in D_TABLE for e in D_EVENTS], ids=lambda v: v)
def test_decode_transition(state, event):
    d = d_setup(state)
    actions = D_EVENTS[event](d)
    want_state, want_kinds = D_TABLE[state][event]
    entry = d.entries.get("d1")
    assert (entry.state.value if entry else None) == want_state
    assert kinds(actions) == want_kinds


def test_decode_registration_carries_deadline_in_prefill_clock():
    d = DecodeRendezvous(T, "D")
    assert d.on_register("d1", KEY, PEER, (7, 8), 0) == [Connect(PEER)]
    [send] = d.on_peer_ready("P", clock_offset=1000.0, now=2)
    assert send == Send("P", Registration(KEY, "d1", "D", (7, 8), 2 + 100 - 10 + 1000.0))


def test_decode_received_ok_only_when_kv_arrived_while_waiting():
    d = d_setup("awaiting_kv")
    assert d.on_notice(Done(KEY, "d1"), 1) == [Received("d1", ok=True)]
    d = d_setup("cancelling")
    assert d.on_notice(Done(KEY, "d1"), 1) == [Received("d1", ok=False)]


def test_decode_cancelling_keeps_the_hold_deadline_of_the_send():
    d = d_setup("awaiting_kv")
    d.on_abort("d1", 50)
    assert d.expire(T.kv_timeout_s - 0.01) == []
    assert d.expire(T.kv_timeout_s) == [Received("d1", ok=False)]
    assert d.counters["expired"] == 1


def test_timeouts_must_nest():
    with pytest.raises(ValueError):
        Timeouts(write_timeout_s=10, write_grace_s=5)
