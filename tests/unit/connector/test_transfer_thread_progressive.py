"""Progressive push (guarantee G14) through two transfer threads over the in-memory backend (no sockets).

P posts a WRITE of each step's full blocks (``PrefillProgress``) without a notice and the final WRITE
(``PrefillFinished``) with Done; one WRITE in flight per transfer; faults while a partial WRITE is in flight
(ERR, refused release, abort, cancel) free nothing until nothing of the transfer can land any more.
"""

from __future__ import annotations

import time

from connector.orders import CancelOrder
from connector.wire.plan import PrefillFailed, PrefillFinished, PrefillProgress
from tests.unit.connector.test_transfer_thread import BLOCK_LEN, FAST, Side, register, sha, wait_for

KEY = "t:1"
D_BLOCKS = (4, 5, 6)


def progress(p: Side, full: int) -> None:
    p.thread.submit(PrefillProgress("p1", KEY, (1, 2, 3)[:full], 3, 0))


def registered(p: Side, d: Side) -> None:
    register(p, d, blocks=D_BLOCKS)
    wait_for(lambda: KEY in p.thread._prefill.entries)


def test_each_chunk_lands_at_once_and_decode_is_done_only_after_the_final_write(pair: tuple[Side, Side]) -> None:
    p, d = pair
    registered(p, d)
    progress(p, 1)
    wait_for(lambda: d.block(4) == p.block(1))
    progress(p, 2)
    wait_for(lambda: d.block(5) == p.block(2))
    time.sleep(0.05)
    assert "d1" not in d.collect().received, "Done before the final WRITE"
    assert d.block(6) == bytes(2 * BLOCK_LEN)
    p.thread.submit(PrefillFinished("p1", KEY, (1, 2, 3)))
    wait_for(lambda: "d1" in d.collect().received and "p1" in p.collect().released)
    assert d.results.failed == set()
    assert sha(d.block(4) + d.block(5) + d.block(6)) == sha(p.block(1) + p.block(2) + p.block(3))
    counters = p.collect().counters
    assert (p.results.counters["writes_posted"], p.results.counters["partial_writes"]) == (3, 2), counters
    assert [r.num_bytes for r in p.results.records] == [2 * BLOCK_LEN] * 3, "one block per WRITE"


def test_at_most_one_write_is_in_flight_and_later_chunks_join_the_next(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.backend.polls_before_done = 30
    registered(p, d)
    progress(p, 1)
    wait_for(lambda: len(p.backend.writes) == 1)
    progress(p, 2)
    p.thread.submit(PrefillFinished("p1", KEY, (1, 2, 3)))
    seen = 0
    while "d1" not in d.collect().received:
        seen = max(seen, sum(1 for w in p.backend.writes.values() if w.in_flight))
        assert seen <= 1, "two WRITEs of one transfer in flight"
        time.sleep(0.001)
    assert p.backend.in_flight_to("agent-D") == 0, "Done arrived while a WRITE could still land"
    wait_for(lambda: "p1" in p.collect().released)
    assert p.results.counters["writes_posted"] <= 3
    assert sha(d.block(4) + d.block(5) + d.block(6)) == sha(p.block(1) + p.block(2) + p.block(3))


def test_a_registration_that_arrives_late_is_pushed_what_is_computed_in_one_write(pair: tuple[Side, Side]) -> None:
    p, d = pair
    progress(p, 1)
    progress(p, 2)
    time.sleep(0.05)
    assert p.collect().counters["writes_posted"] == 0, "nothing to write to before a registration"
    registered(p, d)
    progress(p, 2)  # the next step's hook: still two full blocks
    wait_for(lambda: d.block(4) + d.block(5) == p.block(1) + p.block(2))
    p.thread.submit(PrefillFinished("p1", KEY, (1, 2, 3)))
    wait_for(lambda: "d1" in d.collect().received)
    assert [r.num_bytes for r in p.collect().records] == [2 * 2 * BLOCK_LEN, 2 * BLOCK_LEN]


def test_an_err_of_a_partial_write_fails_decode_and_frees_the_prefill_only_at_its_end(
    pair: tuple[Side, Side],
) -> None:
    p, d = pair
    p.backend.fail_writes = True
    registered(p, d)
    progress(p, 1)
    wait_for(lambda: "d1" in d.collect().failed and "d1" in d.results.received)
    assert "p1" not in p.collect().released, "vLLM still runs the prefill: its blocks are not ours to free"
    p.backend.fail_writes = False
    p.thread.submit(PrefillFinished("p1", KEY, (1, 2, 3)))
    wait_for(lambda: "p1" in p.collect().released)
    assert p.results.counters["writes_posted"] == 1, "no WRITE after the failure"


def test_an_err_with_a_sibling_part_in_flight_frees_nothing_on_decode_until_it_ended(
    pair: tuple[Side, Side],
) -> None:
    p, d = pair
    p.backend.subrequests, p.backend.fail_first_part, p.backend.sibling_polls = 2, True, 40
    registered(p, d)
    p.thread.submit(PrefillProgress("p1", KEY, (1, 2), 3, 0))
    wait_for(lambda: "d1" in d.collect().received)
    assert p.backend.in_flight_to("agent-D") == 0, "decode freed its blocks while a part could still land"
    assert d.results.failed == {"d1"}


def test_an_abort_with_a_partial_write_in_flight_frees_the_blocks_only_after_it(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.backend.polls_before_done = 40
    registered(p, d)
    progress(p, 1)
    wait_for(lambda: len(p.backend.writes) == 1)
    p.thread.submit(PrefillFailed("p1", KEY, "ABORTED", held=True))
    wait_for(lambda: "p1" in p.collect().released)
    assert p.backend.in_flight_to("agent-D") == 0, "blocks released while the partial WRITE could read them"
    wait_for(lambda: "d1" in d.collect().failed and "d1" in d.results.received)


def test_a_stuck_partial_write_quarantines_and_holds_the_prefill_blocks(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.backend.fail_writes, p.backend.refuse_releases = True, -1
    registered(p, d)
    progress(p, 1)
    wait_for(lambda: "d1" in d.collect().failed, timeout=2.0)
    assert "d1" not in d.results.received, "quarantined blocks freed at once"
    p.thread.submit(PrefillFinished("p1", KEY, (1, 2, 3)))
    time.sleep(0.1)
    assert "p1" not in p.collect().released, "a stuck WRITE may still read the prefill's blocks"
    wait_for(lambda: "p1" in p.collect().released, timeout=FAST.kv_timeout_s + 2)


def test_a_cancel_with_a_partial_write_in_flight_is_acked_only_after_it(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.backend.polls_before_done = 40
    registered(p, d)
    progress(p, 1)
    wait_for(lambda: len(p.backend.writes) == 1)
    d.thread.submit(CancelOrder("d1"))
    wait_for(lambda: "d1" in d.collect().received)
    assert p.backend.in_flight_to("agent-D") == 0, "decode freed its blocks while the partial WRITE could land"
    progress(p, 2)
    p.thread.submit(PrefillFinished("p1", KEY, (1, 2, 3)))
    wait_for(lambda: "p1" in p.collect().released)
    assert p.results.counters["writes_posted"] == 1, "no WRITE after the cancel"


# ---- issue 38: a preempted leg's blocks are free before its partial WRITE is over (handle_preemptions) --------


def test_a_preemption_fence_returns_only_once_the_legs_partial_write_is_over(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.backend.polls_before_done = 40
    registered(p, d)
    progress(p, 1)
    wait_for(lambda: p.backend.in_flight_to("agent-D") == 1)
    assert p.thread.quiesce(frozenset({KEY})) is True
    assert p.backend.in_flight_to("agent-D") == 0, "the forward may overwrite blocks a WRITE still reads"
    assert p.collect().counters["fenced"] == 1


def test_after_a_preemption_fence_no_partial_write_is_posted_and_the_final_write_writes_every_block(
    pair: tuple[Side, Side],
) -> None:
    p, d = pair
    registered(p, d)
    progress(p, 1)
    wait_for(lambda: d.block(4) == p.block(1))
    assert p.thread.quiesce(frozenset({KEY})) is True
    progress(p, 2)  # an order of the step before the preemption, still queued (a GPU's forward stream)
    time.sleep(0.05)
    assert p.collect().counters["partial_writes"] == 1, "a partial WRITE after the preemption"
    p.thread.submit(PrefillFinished("p1", KEY, (1, 2, 3)))
    wait_for(lambda: "d1" in d.collect().received)
    assert d.results.failed == set()
    assert p.collect().records[-1].num_bytes == 3 * 2 * BLOCK_LEN, "the final WRITE rewrites every block"


def test_a_preemption_fence_with_a_write_that_cannot_be_released_gives_up_at_the_write_timeout(
    pair: tuple[Side, Side],
) -> None:
    p, d = pair
    p.backend.polls_before_done, p.backend.refuse_releases = 10**9, -1
    registered(p, d)
    progress(p, 1)
    wait_for(lambda: p.backend.in_flight_to("agent-D") == 1)
    assert p.thread.quiesce(frozenset({KEY})) is False, "bounded: the forward cannot wait forever"
    counters = p.collect().counters
    assert counters["fence_timeouts"] == 1 and counters["fenced"] == 1


def test_a_fence_for_a_transfer_with_nothing_in_flight_returns_at_once(pair: tuple[Side, Side]) -> None:
    p, _ = pair
    assert p.thread.quiesce(frozenset({"t:unknown"})) is True
    assert p.collect().counters["fenced"] == 0
