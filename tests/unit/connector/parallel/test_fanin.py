"""Fan-out / fan-in of a transfer's legs under TP (``connector.parallel.fanin``): tables per event."""

from __future__ import annotations

from connector.parallel.fanin import FanOut, LegEnd, RankFanIn, SourceOutcome, SourceSet


def test_a_request_is_received_only_when_every_source_sent_done() -> None:
    s = SourceSet(("p0", "p1"), deadline=10)
    assert s.on_done("p0") == SourceOutcome()
    assert s.on_done("p0") == SourceOutcome(), "a repeated Done changes nothing"
    assert s.on_done("p1") == SourceOutcome(received=True, freed=True)


def test_the_first_failure_fails_now_cancels_the_pending_sources_and_frees_when_all_ended() -> None:
    s = SourceSet(("p0", "p1", "p2"), deadline=10)
    assert s.on_done("p0") == SourceOutcome()
    assert s.on_failure("p1", quarantine=False) == SourceOutcome(failed=True, cancel=("p2",))
    assert s.on_cancel_ack("p2") == SourceOutcome(freed=True)
    assert not s.received


def test_a_quarantined_leg_keeps_the_blocks_until_the_deadline_even_when_the_others_end() -> None:
    s = SourceSet(("p0", "p1"), deadline=10)
    assert s.on_failure("p0", quarantine=True) == SourceOutcome(failed=True, cancel=("p1",))
    assert s.on_done("p1") == SourceOutcome(), "p0's WRITE may still land: not freed"
    assert s.on_deadline(9.9) == SourceOutcome()
    assert s.on_deadline(10) == SourceOutcome(freed=True)
    assert s.ends == {"p0": LegEnd.UNSAFE, "p1": LegEnd.DONE}


def test_a_quarantine_that_ends_cleanly_later_frees_early() -> None:
    s = SourceSet(("p0",), deadline=10)
    s.on_link_lost("p0")
    assert s.on_failure("p0", quarantine=False) == SourceOutcome(freed=True)


def test_abort_fails_and_cancels_every_pending_source_and_a_late_done_still_counts_as_ended() -> None:
    s = SourceSet(("p0", "p1"), deadline=10)
    assert s.on_abort() == SourceOutcome(failed=True, cancel=("p0", "p1"))
    assert s.on_done("p0") == SourceOutcome()
    assert s.on_cancel_ack("p1") == SourceOutcome(freed=True)
    assert not s.received


def test_a_deadline_with_sources_pending_fails_and_frees() -> None:
    s = SourceSet(("p0", "p1"), deadline=5)
    s.on_done("p0")
    assert s.on_deadline(5) == SourceOutcome(failed=True, freed=True)
    assert s.on_done("p1") == SourceOutcome(), "nothing after the free"


def test_notices_of_other_sources_are_ignored() -> None:
    s = SourceSet(("p0",), deadline=5)
    assert s.on_done("p9") == SourceOutcome() and s.ends == {"p0": LegEnd.PENDING}


def test_a_failure_on_any_rank_cancels_everywhere_once_and_finishes_when_every_rank_freed() -> None:
    r = RankFanIn(ranks=3)
    assert r.on_rank_freed(0).finished is False
    assert r.on_rank_failed(1).cancel_everywhere
    assert not r.on_rank_failed(2).cancel_everywhere, "once"
    assert r.on_rank_freed(1) == r.on_rank_freed(1)
    last = r.on_rank_freed(2)
    assert last.finished and not last.ok


def test_ranks_that_all_received_finish_ok() -> None:
    r = RankFanIn(ranks=2)
    r.on_rank_freed(0)
    assert r.on_rank_freed(1).ok


def test_prefill_blocks_are_released_only_when_every_targets_leg_is_over() -> None:
    f = FanOut(targets=(0, 1))
    assert f.on_registration(0) and not f.on_registration(5)
    assert not f.on_leg_over(0)
    assert f.on_lease_expired(), "rank 1 never registered: its leg is over at the lease"
    assert not f.on_registration(1), "a late registration is refused"


def test_a_running_leg_holds_the_release_past_the_lease() -> None:
    f = FanOut(targets=(0, 1))
    f.on_registration(0)
    f.on_registration(1)
    f.on_leg_over(1)
    assert not f.on_lease_expired()
    assert f.on_leg_over(0)
