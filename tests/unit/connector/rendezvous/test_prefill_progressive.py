"""Progressive push (guarantee G14) on the prefill rendezvous: event sequences beyond the one-event table of
test_rendezvous.py. Each chunk's full blocks are written at the end of its step, one WRITE in flight per key,
Done only with the final WRITE; cancel, abort, preemption and expiry wait for the WRITE in flight."""

from __future__ import annotations

from connector.rendezvous.actions import AbandonWrite, Action, Release, Send, StartWrite, Timeouts
from connector.rendezvous.prefill import PrefillRendezvous, PState
from connector.wire.metadata import Cancel, CancelAck, Done, Failure, Registration
from connector.wire.plan import PrefillProgress

T = Timeouts(lease_s=30, kv_timeout_s=100, write_grace_s=10, write_timeout_s=5, connect_timeout_s=10)
KEY = "t:x"
REG = Registration(KEY, "d1", "D", (20, 21, 22, 23), write_deadline=90.0, num_tokens=60)
PROMPT = (1, 2, 3, 4)  # P's four prompt blocks (16 tokens each; the last one partial: 60 tokens)


def progress(p: PrefillRendezvous, full: int, now: float = 1.0) -> list[Action]:
    return p.on_prefill_progress(PrefillProgress("p1", KEY, PROMPT[:full], len(PROMPT), 60), now)


def finished(p: PrefillRendezvous, now: float = 1.0) -> list[Action]:
    return p.on_prefill_finished(KEY, "p1", PROMPT, now, 60)


def writes(actions: list[Action]) -> list[StartWrite]:
    return [a for a in actions if isinstance(a, StartWrite)]


def only_write(actions: list[Action]) -> StartWrite:
    (write,) = writes(actions)
    return write


def state(p: PrefillRendezvous) -> PState:
    return p.entries[KEY].state


def registered() -> PrefillRendezvous:
    p = PrefillRendezvous(T)
    assert p.on_registration(REG, 0) == []
    return p


def test_each_step_writes_its_new_full_blocks_one_write_in_flight_and_done_only_with_the_last() -> None:
    p = registered()
    first = only_write(progress(p, 1))
    assert (first.local_blocks, first.remote_blocks, first.final, first.ordinal) == ((1,), (20,), False, 1)
    assert progress(p, 2) == [] and state(p) is PState.PUSHING, "one WRITE in flight: block 2 waits"
    assert progress(p, 3) == []
    second = only_write(p.on_write_done(KEY, 2))  # blocks 2 and 3 join the next WRITE
    assert (second.local_blocks, second.remote_blocks, second.final) == ((2, 3), (21, 22), False)
    assert finished(p) == [] and state(p) is PState.FLUSHING, "the final WRITE waits for the partial one"
    last = only_write(p.on_write_done(KEY, 3))
    assert (last.local_blocks, last.remote_blocks, last.final, last.ordinal) == ((4,), (23,), True, 3)
    assert p.on_write_done(KEY, 4) == [Release("p1")]
    assert state(p) is PState.DONE and p.live == 0


def test_a_partial_write_done_with_nothing_new_waits_for_the_next_step() -> None:
    p = registered()
    only_write(progress(p, 1))
    assert p.on_write_done(KEY, 2) == [] and state(p) is PState.AWAIT_PREFILL
    assert p.next_deadline() == REG.write_deadline, "waiting again under the registration's deadline"
    assert only_write(progress(p, 2)).local_blocks == (2,)


def test_a_registration_that_arrives_late_gets_everything_computed_so_far_in_one_write() -> None:
    p = PrefillRendezvous(T)
    assert progress(p, 1) == [] and progress(p, 2) == [], "nothing registered: nothing to write"
    assert KEY not in p.entries, "P holds nothing for an unregistered chunk (vLLM still owns the blocks)"
    p.on_registration(REG, 1)
    catch_up = only_write(progress(p, 3))
    assert (catch_up.local_blocks, catch_up.remote_blocks) == ((1, 2, 3), (20, 21, 22))
    p.on_write_done(KEY, 2)
    assert only_write(finished(p)).local_blocks == (4,)


def test_a_registration_after_the_last_chunk_is_a_whole_request_push() -> None:
    p = PrefillRendezvous(T)
    progress(p, 3)
    finished(p)
    whole = only_write(p.on_registration(REG, 2))
    assert (whole.local_blocks, whole.remote_blocks, whole.final) == (PROMPT, None, True)


def test_blocks_decode_already_holds_are_skipped_and_tails_stay_aligned() -> None:
    p = PrefillRendezvous(T)
    p.on_registration(Registration(KEY, "d1", "D", (30, 31), write_deadline=90.0, num_tokens=60), 0)
    assert progress(p, 2) == [] and state(p) is PState.AWAIT_PREFILL, "blocks 1-2 are D's own prefix hit"
    third = only_write(progress(p, 3))
    assert (third.local_blocks, third.remote_blocks) == ((3,), (30,))
    p.on_write_done(KEY, 2)
    last = only_write(finished(p))
    assert (last.local_blocks, last.remote_blocks) == ((4,), (31,))


def test_a_registration_that_cannot_fit_gets_no_partial_write_and_is_refused_at_the_end() -> None:
    p = PrefillRendezvous(T)
    p.on_registration(Registration(KEY, "d1", "D", (20, 21, 22, 23, 24), write_deadline=90.0, num_tokens=60), 0)
    assert progress(p, 2) == []
    actions = finished(p)
    assert actions[0] == Release("p1") and isinstance(actions[1], Send) and isinstance(actions[1].notice, Failure)


def test_no_partial_write_after_the_write_deadline() -> None:
    p = registered()
    assert progress(p, 1, now=REG.write_deadline) == []


def test_cancel_with_a_partial_write_in_flight_is_acked_only_after_it() -> None:
    p = registered()
    progress(p, 1)
    assert p.on_cancel(Cancel(KEY, "d1", "D"), 2) == []
    assert progress(p, 2) == [], "no new WRITE for a cancelled transfer"
    assert p.on_write_done(KEY, 3) == [Send("D", CancelAck(KEY, "d1"))]
    assert state(p) is PState.CANCELLED
    assert finished(p) == [Release("p1")], "the prefill's blocks go back at once: nothing is in flight"


def test_an_abort_with_a_partial_write_in_flight_frees_the_blocks_only_after_it() -> None:
    p = registered()
    progress(p, 1)
    assert p.on_prefill_failed(KEY, "ABORTED", 2, held="p1") == [], "a partial WRITE may still read them"
    assert state(p) is PState.FLUSHING
    actions = p.on_write_done(KEY, 3)
    assert actions[0] == Release("p1") and isinstance(actions[1], Send) and isinstance(actions[1].notice, Failure)
    assert state(p) is PState.DONE


def test_an_abort_with_nothing_in_flight_after_partial_writes_frees_at_once() -> None:
    p = registered()
    progress(p, 1)
    p.on_write_done(KEY, 2)
    actions = p.on_prefill_failed(KEY, "ABORTED", 3, held="p1")
    assert actions[0] == Release("p1") and isinstance(actions[1], Send) and isinstance(actions[1].notice, Failure)


def test_an_err_of_a_partial_write_fails_decode_and_the_later_final_is_released_at_once() -> None:
    p = registered()
    progress(p, 1)
    actions = p.on_write_released(KEY, 2)  # ERR, handle released: nothing can land any more
    assert len(actions) == 1 and isinstance(actions[0], Send) and isinstance(actions[0].notice, Failure)
    assert not actions[0].notice.quarantine
    assert progress(p, 2) == []
    assert finished(p) == [Release("p1")]


def test_a_stuck_partial_write_keeps_the_prefill_blocks_to_the_hold_limit() -> None:
    p = registered()
    progress(p, 1)
    (told,) = p.on_write_stuck(KEY, 2)
    assert isinstance(told, Send) and isinstance(told.notice, Failure) and told.notice.quarantine
    assert finished(p) == [], "the stuck WRITE may still read the prefill's blocks"
    assert p.expire(REG.write_deadline + T.write_grace_s - 1) == []
    assert p.expire(REG.write_deadline + T.write_grace_s) == [Release("p1")]


def test_a_stuck_partial_write_released_later_frees_the_blocks_then() -> None:
    p = registered()
    progress(p, 1)
    p.on_write_stuck(KEY, 2)
    p.on_prefill_failed(KEY, "ABORTED", 3, held="p1")
    actions = p.on_write_released(KEY, 4)
    assert actions[0] == Release("p1") and isinstance(actions[1], Send)


def test_an_expired_partial_write_is_abandoned_and_the_blocks_wait_for_its_release() -> None:
    p = registered()
    progress(p, 1)
    assert p.expire(1 + T.write_timeout_s) == [AbandonWrite(KEY)]
    assert state(p) is PState.RELEASING
    assert finished(p) == []
    actions = p.on_write_released(KEY, 7)
    assert actions[0] == Release("p1") and isinstance(actions[1], Send) and isinstance(actions[1].notice, Failure)


def test_a_preempted_prefill_rewrites_every_block_in_its_final_write() -> None:
    p = registered()
    progress(p, 1)
    assert p.on_prefill_restarted(KEY, 2) == []
    assert p.on_write_done(KEY, 3) == [] and state(p) is PState.AWAIT_PREFILL
    assert progress(p, 2) == [], "no partial WRITE of recomputed blocks"
    final = only_write(finished(p))
    assert (final.local_blocks, final.remote_blocks, final.final) == (PROMPT, None, True)


def test_a_final_with_every_block_already_written_sends_done_alone() -> None:
    p = registered()
    progress(p, 4)
    p.on_write_done(KEY, 2)
    assert finished(p) == [Release("p1"), Send("D", Done(KEY, "d1"))]
    assert state(p) is PState.DONE


def test_done_never_travels_before_every_partial_write_ended() -> None:
    """Every interleaving of one more chunk, the finish and the completions: at most one WRITE in flight,
    only the last one final, and it covers exactly the blocks no earlier WRITE wrote."""
    for order in (["p2", "fin", "done"], ["p2", "done", "fin"], ["done", "p2", "fin"], ["fin", "done", "p2"]):
        p = registered()
        posted = writes(progress(p, 1))
        in_flight = 1
        for event in [*order, "done", "done", "done"]:
            new = (
                progress(p, 2)
                if event == "p2"
                else finished(p)
                if event == "fin"
                else (p.on_write_done(KEY, 5) if in_flight else [])
            )
            in_flight -= event == "done" and in_flight > 0
            in_flight += len(writes(new))
            assert in_flight <= 1, order
            posted += writes(new)
        assert [w.final for w in posted] == [False] * (len(posted) - 1) + [True], order
        assert sum((w.local_blocks for w in posted), ()) == PROMPT, order
        assert state(p) is PState.DONE, order
