"""The sequence tracker, exhaustively: every event in every state, then the paths through a replay."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from router.kv_events.sequence import (
    Apply,
    EndReplay,
    Op,
    RequestReplay,
    Reset,
    SeqState,
    SequenceTracker,
)

TIMEOUT = 2.0


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def tracker(clock: Clock, can_replay: bool = True, max_held: int = 8) -> SequenceTracker[str]:
    return SequenceTracker(clock, can_replay, TIMEOUT, max_held)


def in_state(state: SeqState, clock: Clock) -> SequenceTracker[str]:
    """FRESH: new. IN_SYNC: seq 0 applied. REPLAY_REQUESTED: then seq 3 (gap: replay from 1, 3 held).
    REPLAYING: then seq 1 replayed. REMOVED: removed when fresh."""
    t = tracker(clock)
    if state is SeqState.REMOVED:
        t.removed()
        return t
    if state is SeqState.FRESH:
        return t
    assert t.published(0, "s0") == [Apply(0, "s0")]
    if state is SeqState.IN_SYNC:
        return t
    assert t.published(3, "s3") == [RequestReplay(1)]
    if state is SeqState.REPLAY_REQUESTED:
        return t
    assert t.replayed(1, "r1") == [Apply(1, "r1")]
    assert t.state is SeqState.REPLAYING
    return t


def following(t: SequenceTracker[str]) -> int:
    return max(t.next_seq, t.last_live + 1)


def late_tick(t: SequenceTracker[str], clock: Clock) -> list[Op[str]]:
    clock.now += TIMEOUT
    return t.tick()


Event = Callable[[SequenceTracker[str], Clock], list[Op[str]] | None]

EVENTS: dict[str, Event] = {
    "live_following": lambda t, c: t.published(following(t), "x"),
    "live_gap": lambda t, c: t.published(following(t) + 2, "x"),
    "live_back_to_0": lambda t, c: t.published(0, "x"),
    "live_lost": lambda t, c: t.published(following(t), None),
    "replayed_next": lambda t, c: t.replayed(t.next_seq, "r"),
    "replayed_duplicate": lambda t, c: t.replayed(t.next_seq - 1, "r"),
    "replayed_ahead": lambda t, c: t.replayed(t.next_seq + 2, "r"),
    "replayed_lost": lambda t, c: t.replayed(t.next_seq, None),
    "replay_ended": lambda t, c: t.replay_ended(),
    "tick_early": lambda t, c: t.tick(),
    "tick_late": lambda t, c: late_tick(t, c),
    "cache_cleared": lambda t, c: t.cache_cleared(),
    "restarted": lambda t, c: t.restarted(),
    "removed": lambda t, c: t.removed(),
}

F, S, RQ, RP, RM = (
    SeqState.FRESH,
    SeqState.IN_SYNC,
    SeqState.REPLAY_REQUESTED,
    SeqState.REPLAYING,
    SeqState.REMOVED,
)
END: list[Op[str]] = [
    EndReplay(),
    Reset(),
    Apply(3, "s3"),
]  # a replay given up in REPLAY_*: seq 3 held, a hole before it

# (state, event) -> (ops, state after, complete after, next_seq after); None ops: the event returns nothing
TABLE: dict[tuple[SeqState, str], tuple[list[Op[str]] | None, SeqState, bool, int]] = {
    (F, "live_following"): ([Apply(0, "x")], S, True, 1),
    (S, "live_following"): ([Apply(1, "x")], S, True, 2),
    (RQ, "live_following"): ([], RQ, True, 1),
    (RP, "live_following"): ([], RP, True, 2),
    (RM, "live_following"): ([], RM, False, 0),
    (F, "live_gap"): ([RequestReplay(0)], RQ, True, 0),
    (S, "live_gap"): ([RequestReplay(1)], RQ, True, 1),
    (RQ, "live_gap"): ([], RQ, True, 1),
    (RP, "live_gap"): ([], RP, True, 2),
    (RM, "live_gap"): ([], RM, False, 0),
    (F, "live_back_to_0"): ([Apply(0, "x")], S, True, 1),
    (S, "live_back_to_0"): ([Reset(), Apply(0, "x")], S, True, 1),
    (RQ, "live_back_to_0"): ([EndReplay(), Reset(), Apply(0, "x")], S, True, 1),
    (RP, "live_back_to_0"): ([EndReplay(), Reset(), Apply(0, "x")], S, True, 1),
    (RM, "live_back_to_0"): ([], RM, False, 0),
    (F, "live_lost"): ([Reset()], S, False, 1),
    (S, "live_lost"): ([Reset()], S, False, 2),
    (RQ, "live_lost"): ([], RQ, True, 1),
    (RP, "live_lost"): ([], RP, True, 2),
    (RM, "live_lost"): ([], RM, False, 0),
    (F, "replayed_next"): ([], F, False, 0),
    (S, "replayed_next"): ([], S, True, 1),
    (RQ, "replayed_next"): ([Apply(1, "r")], RP, True, 2),
    (RP, "replayed_next"): ([Apply(2, "r")], RP, True, 3),
    (RM, "replayed_next"): ([], RM, False, 0),
    (F, "replayed_duplicate"): ([], F, False, 0),
    (S, "replayed_duplicate"): ([], S, True, 1),
    (RQ, "replayed_duplicate"): ([], RP, True, 1),
    (RP, "replayed_duplicate"): ([], RP, True, 2),
    (RM, "replayed_duplicate"): ([], RM, False, 0),
    (F, "replayed_ahead"): ([], F, False, 0),
    (S, "replayed_ahead"): ([], S, True, 1),
    (RQ, "replayed_ahead"): ([Reset(), Apply(3, "r")], RP, False, 4),
    (RP, "replayed_ahead"): ([Reset(), Apply(4, "r")], RP, False, 5),
    (RM, "replayed_ahead"): ([], RM, False, 0),
    (F, "replayed_lost"): ([], F, False, 0),
    (S, "replayed_lost"): ([], S, True, 1),
    (RQ, "replayed_lost"): ([Reset()], RP, False, 2),
    (RP, "replayed_lost"): ([Reset()], RP, False, 3),
    (RM, "replayed_lost"): ([], RM, False, 0),
    (F, "replay_ended"): ([], F, False, 0),
    (S, "replay_ended"): ([], S, True, 1),
    (RQ, "replay_ended"): (END, S, False, 4),
    (RP, "replay_ended"): (END, S, False, 4),
    (RM, "replay_ended"): ([], RM, False, 0),
    (F, "tick_early"): ([], F, False, 0),
    (S, "tick_early"): ([], S, True, 1),
    (RQ, "tick_early"): ([], RQ, True, 1),
    (RP, "tick_early"): ([], RP, True, 2),
    (RM, "tick_early"): ([], RM, False, 0),
    (F, "tick_late"): ([], F, False, 0),
    (S, "tick_late"): ([], S, True, 1),
    (RQ, "tick_late"): (END, S, False, 4),
    (RP, "tick_late"): (END, S, False, 4),
    (RM, "tick_late"): ([], RM, False, 0),
    (F, "cache_cleared"): (None, F, True, 0),
    (S, "cache_cleared"): (None, S, True, 1),
    (RQ, "cache_cleared"): (None, RQ, True, 1),
    (RP, "cache_cleared"): (None, RP, True, 2),
    (RM, "cache_cleared"): (None, RM, False, 0),
    (F, "restarted"): ([Reset()], F, False, 0),
    (S, "restarted"): ([Reset()], F, False, 0),
    (RQ, "restarted"): ([EndReplay(), Reset()], F, False, 0),
    (RP, "restarted"): ([EndReplay(), Reset()], F, False, 0),
    (RM, "restarted"): ([], RM, False, 0),
    (F, "removed"): ([Reset()], RM, False, 0),
    (S, "removed"): ([Reset()], RM, False, 0),
    (RQ, "removed"): ([EndReplay(), Reset()], RM, False, 0),
    (RP, "removed"): ([EndReplay(), Reset()], RM, False, 0),
    (RM, "removed"): ([], RM, False, 0),
}


def test_the_table_covers_every_state_and_event() -> None:
    assert set(TABLE) == {(state, event) for state in SeqState for event in EVENTS}


@pytest.mark.parametrize(("state", "event"), sorted(TABLE))
def test_every_event_in_every_state(state: SeqState, event: str) -> None:
    clock = Clock()
    t = in_state(state, clock)
    ops, after, complete, next_seq = TABLE[(state, event)]
    assert EVENTS[event](t, clock) == ops
    assert (t.state, t.complete, t.next_seq) == (after, complete, next_seq)
    assert t.caught_up is (after is SeqState.IN_SYNC and complete)


def test_a_gap_replayed_whole_is_no_hole() -> None:
    clock = Clock()
    t = in_state(SeqState.IN_SYNC, clock)
    assert t.published(3, "s3") == [RequestReplay(1)]
    assert t.published(4, "s4") == []
    assert t.replayed(1, "r1") == [Apply(1, "r1")]
    assert t.replayed(2, "r2") == [Apply(2, "r2")]
    assert t.replayed(3, "r3") == [Apply(3, "r3")]
    assert t.replay_ended() == [EndReplay(), Apply(4, "s4")]  # 3 was replayed: its held copy is a duplicate
    assert t.caught_up and t.next_seq == 5
    assert (t.counters.gaps, t.counters.replays, t.counters.holes, t.counters.duplicates) == (2, 1, 0, 1)


def test_live_messages_the_replay_already_brought_are_skipped() -> None:
    """The replay may answer seqs the SUB socket has not been read for yet: they are not a restart."""
    clock = Clock()
    t = in_state(SeqState.IN_SYNC, clock)
    assert t.published(2, "s2") == [RequestReplay(1)]
    assert [t.replayed(s, f"r{s}") for s in (1, 2, 3, 4)] == [[Apply(s, f"r{s}")] for s in (1, 2)] + [
        [Apply(3, "r3")],
        [Apply(4, "r4")],
    ]
    assert t.published(3, "s3") == []  # held during the replay: a duplicate
    assert t.replay_ended() == [EndReplay()]
    assert t.published(4, "s4") == []
    assert t.published(5, "s5") == [Apply(5, "s5")]
    assert t.caught_up and t.counters.restarts == 0 and t.counters.duplicates == 3


def test_joining_late_replays_from_0() -> None:
    clock = Clock()
    t = tracker(clock)
    assert t.published(2, "s2") == [RequestReplay(0)]
    assert t.replayed(0, "r0") == [Apply(0, "r0")]
    assert t.replayed(1, "r1") == [Apply(1, "r1")]
    assert t.replay_ended() == [EndReplay(), Apply(2, "s2")]
    assert t.caught_up


def test_joining_after_the_replay_buffer_rolled_over_is_incomplete() -> None:
    clock = Clock()
    t = tracker(clock)
    assert t.published(20, "s20") == [RequestReplay(0)]
    assert t.replayed(12, "r12") == [Reset(), Apply(12, "r12")]
    assert t.replay_ended() == [EndReplay(), Reset(), Apply(20, "s20")]
    assert t.state is SeqState.IN_SYNC and not t.complete and not t.caught_up
    t.cache_cleared()
    assert t.caught_up


def test_without_a_replay_socket_a_gap_is_a_hole_at_once() -> None:
    clock = Clock()
    t = tracker(clock, can_replay=False)
    assert t.published(0, "s0") == [Apply(0, "s0")]
    assert t.published(2, "s2") == [Reset(), Apply(2, "s2")]
    assert t.state is SeqState.IN_SYNC and not t.complete
    assert (t.counters.gaps, t.counters.replays, t.counters.holes) == (1, 0, 1)
    late = tracker(clock, can_replay=False)
    assert late.published(5, "s5") == [Reset(), Apply(5, "s5")]
    assert not late.complete


def test_too_many_messages_held_during_a_replay_end_it() -> None:
    clock = Clock()
    t = tracker(clock, max_held=2)
    t.published(0, "s0")
    assert t.published(2, "s2") == [RequestReplay(1)]
    assert t.published(3, "s3") == []
    assert t.published(4, "s4") == [EndReplay(), Reset(), Apply(2, "s2"), Apply(3, "s3"), Apply(4, "s4")]
    assert t.counters.replay_cut == 1 and not t.complete


def test_the_replay_deadline_runs_from_the_request() -> None:
    clock = Clock()
    t = in_state(SeqState.REPLAY_REQUESTED, clock)
    clock.now += TIMEOUT - 0.01
    assert t.tick() == []
    clock.now += 0.01
    assert t.tick() == END
    assert t.counters.replay_timeouts == 1


def test_a_removed_tracker_ignores_everything_and_counts_stale_answers() -> None:
    t = in_state(SeqState.REMOVED, Clock())
    assert t.published(0, "x") == [] and t.replayed(0, "x") == [] and t.replay_ended() == []
    assert t.counters.stale == 2


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        SequenceTracker(Clock(), True, 0.0, 1)
    with pytest.raises(ValueError):
        SequenceTracker(Clock(), True, 1.0, 0)
