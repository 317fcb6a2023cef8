"""Two transfer threads (prefill and decode) over the in-memory backend, with injected faults.

No sockets: the side channel is ``LoopbackSideChannel`` (in process, same exchange and checks), the data
path is ``MemoryBackend``. The TCP side channel has its own tests on real processes
(tests/integration/connector/test_side_channel.py). Guarantee numbers (G2, G3, ...) are those of
connector/README.md.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from connector.options import Options, Polling
from connector.orders import CancelOrder
from connector.rendezvous.actions import Timeouts
from connector.transfer.base import TransferError
from connector.transfer.memory import MemoryBackend, MemoryFabric
from connector.transfer.ready import StepFence
from connector.transfer_thread import Results, TransferThread
from connector.wire.metadata import KVLayout, PeerAddress, Region
from connector.wire.plan import CancelUnallocated, PrefillFailed, PrefillFinished, RegisterOrder
from connector.wire.side_channel import Liveness
from tests.unit.connector.side_channel_fake import LoopbackSideChannel

BLOCKS, BLOCK_LEN = 8, 64
FAST = Timeouts(lease_s=2, kv_timeout_s=3, write_grace_s=1, write_timeout_s=0.5, connect_timeout_s=2)


@dataclass
class Side:
    thread: TransferThread
    backend: MemoryBackend
    kv: list[np.ndarray]
    results: Results

    def block(self, b: int) -> bytes:
        return b"".join(r[b * BLOCK_LEN : (b + 1) * BLOCK_LEN].tobytes() for r in self.kv)

    def collect(self) -> Results:
        self.results.merge(self.thread.collect_results())
        return self.results


OPTIONS = Options(timeouts=FAST, liveness=Liveness(heartbeat_s=0.2, dead_after_s=0.8))


CHANNEL = LoopbackSideChannel()


def make_side(
    fabric: MemoryFabric,
    engine: str,
    seed: int | None,
    compat: str = "c1",
    options: Options = OPTIONS,
    fence: StepFence | None = None,
    backend_cls: type[MemoryBackend] = MemoryBackend,
) -> Side:
    rng = np.random.default_rng(seed)
    kv = [
        rng.integers(0, 256, BLOCKS * BLOCK_LEN, dtype=np.uint8)
        if seed is not None
        else np.zeros(BLOCKS * BLOCK_LEN, np.uint8)
        for _ in range(2)
    ]
    layout = KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, BLOCK_LEN, BLOCKS) for a in kv))
    backend = backend_cls(fabric, f"agent-{engine}", layout)
    thread = TransferThread(
        backend,
        engine_id=engine,
        layout=layout,
        compat_hash=compat,
        side_host="127.0.0.1",
        side_port=0,
        options=options,
        side_channel=CHANNEL,
        fence=fence,
    )
    thread.start()
    return Side(thread, backend, kv, Results())


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


def register(p: Side, d: Side, req: str = "d1", key: str = "t:1", blocks: tuple[int, ...] = (5, 6)) -> None:
    peer = PeerAddress("P", "127.0.0.1", p.thread.side_port)
    d.thread.submit(RegisterOrder(req, key, peer, blocks))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("prefill_first", [True, False])
def test_either_order_moves_the_blocks(pair: tuple[Side, Side], prefill_first: bool) -> None:
    p, d = pair
    if prefill_first:
        p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
        time.sleep(0.05)
        register(p, d)
    else:
        register(p, d)
        time.sleep(0.2)
        p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    wait_for(lambda: "d1" in d.collect().received and "p1" in p.collect().released)
    assert d.results.failed == set()
    assert sha(d.block(5) + d.block(6)) == sha(p.block(1) + p.block(2))
    assert d.block(4) == bytes(2 * BLOCK_LEN)  # nothing else touched
    [record] = p.results.records
    assert record.num_bytes == 2 * 2 * BLOCK_LEN
    assert record.num_descriptors == 2  # one run consecutive on both sides: one descriptor per region, as NIXL posts
    assert record.runs.both == ((2, 1),) and record.runs.prefill == record.runs.decode == ((2, 1),)


def test_tail_blocks_are_aligned_when_decode_registers_fewer(pair: tuple[Side, Side]) -> None:
    p, d = pair
    register(p, d, blocks=(7,))
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2, 3)))
    wait_for(lambda: "d1" in d.collect().received)
    assert d.block(7) == p.block(3)


def test_cancel_before_prefill_finishes_releases_decode_and_never_writes(pair: tuple[Side, Side]) -> None:
    p, d = pair
    register(p, d)
    wait_for(lambda: bool(p.thread._prefill.entries))  # registration reached P
    d.thread.submit(CancelOrder("d1"))
    wait_for(lambda: "d1" in d.collect().received)
    assert d.results.failed == {"d1"}
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    wait_for(lambda: "p1" in p.collect().released)
    time.sleep(0.05)
    assert d.block(5) == bytes(2 * BLOCK_LEN)
    assert p.results.records == []


def test_prefill_failure_reaches_decode_at_once(pair: tuple[Side, Side]) -> None:
    p, d = pair
    register(p, d)
    wait_for(lambda: bool(p.thread._prefill.entries))
    t0 = time.monotonic()
    p.thread.submit(PrefillFailed("p1", "t:1", "aborted"))
    wait_for(lambda: "d1" in d.collect().failed, timeout=1.0)
    assert time.monotonic() - t0 < 0.5


def test_prefill_failure_before_registration_is_remembered(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.thread.submit(PrefillFailed("p1", "t:1", "aborted"))
    time.sleep(0.05)
    register(p, d)
    wait_for(lambda: "d1" in d.collect().failed, timeout=1.0)


def test_write_failure_is_told_to_decode(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.backend.fail_writes = True
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    register(p, d)
    wait_for(lambda: "d1" in d.collect().failed and "p1" in p.collect().released)
    assert p.results.counters["write_failed"] == 1


def test_prefill_gone_fails_waiting_decode_requests(pair: tuple[Side, Side]) -> None:
    p, d = pair
    register(p, d)
    wait_for(lambda: bool(p.thread._prefill.entries))
    p.thread.close()  # drops its side-channel links like a process exit
    wait_for(lambda: "d1" in d.collect().failed, timeout=2.0)
    assert d.results.counters["peer_lost"] == 1


def test_unmatched_state_expires(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    register(p, d, req="d9", key="t:other")
    wait_for(lambda: "p1" in p.collect().released, timeout=FAST.lease_s + 1)
    wait_for(lambda: "d9" in d.collect().failed, timeout=FAST.kv_timeout_s + 1)
    assert p.results.counters["expired"] >= 1
    wait_for(lambda: not p.thread._prefill.entries and not d.thread._decode.entries, timeout=FAST.lease_s + 1)


def test_incompatible_peer_is_refused() -> None:
    fabric = MemoryFabric()
    p, d = make_side(fabric, "P", seed=1, compat="c1"), make_side(fabric, "D", seed=None, compat="c2")
    try:
        register(p, d)
        wait_for(lambda: "d1" in d.collect().failed, timeout=2.0)
        assert p.thread._agents == {}
    finally:
        d.thread.close()
        p.thread.close()


def test_many_transfers_concurrently(pair: tuple[Side, Side]) -> None:
    p, d = pair
    for i in range(4):
        register(p, d, req=f"d{i}", key=f"t:{i}", blocks=(4 + i,))
        p.thread.submit(PrefillFinished(f"p{i}", f"t:{i}", (i,)))
    wait_for(lambda: len(d.collect().received) == 4 and len(p.collect().released) == 4)
    assert d.results.failed == set()
    assert [d.block(4 + i) for i in range(4)] == [p.block(i) for i in range(4)]


# ---- issue 8 item 1: faults ------------------------------------------------------------------


def test_an_err_with_sibling_parts_in_flight_frees_nothing_until_every_part_ended(pair: tuple[Side, Side]) -> None:
    """G2: NIXL reports ERR at the first failed part while its siblings still write; D must not
    free (report finished) its blocks before the last of them ended and the handle was released."""
    p, d = pair
    p.backend.subrequests, p.backend.fail_first_part, p.backend.sibling_polls = 2, True, 40
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    register(p, d)
    wait_for(lambda: "d1" in d.collect().received)
    assert p.backend.in_flight_to("agent-D") == 0, "decode freed its blocks while a part could still land"
    assert p.backend.landed, "the siblings of the failed part did land"
    assert d.results.failed == {"d1"}
    wait_for(lambda: "p1" in p.collect().released)


def test_a_release_that_keeps_failing_quarantines_both_sides(pair: tuple[Side, Side]) -> None:
    """G2: ERR and the backend refuses to release the handle: D reports the request failed at once
    but frees its blocks only at its hold deadline; P keeps its blocks until then as well."""
    p, d = pair
    p.backend.fail_writes, p.backend.refuse_releases = True, -1
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    t0 = time.monotonic()
    register(p, d)
    wait_for(lambda: "d1" in d.collect().failed, timeout=2.0)
    assert "d1" not in d.results.received, "quarantined blocks freed at once"
    assert "p1" not in p.collect().released
    wait_for(lambda: "d1" in d.collect().received, timeout=FAST.kv_timeout_s + 2)
    assert time.monotonic() - t0 >= FAST.kv_timeout_s - 0.5, "freed before the hold deadline"
    wait_for(lambda: "p1" in p.collect().released, timeout=FAST.kv_timeout_s + 2)
    assert p.results.counters["quarantined"] == 1


def test_a_release_that_succeeds_later_ends_the_quarantine_early(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.backend.fail_writes, p.backend.refuse_releases = True, 3
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    register(p, d)
    wait_for(lambda: "d1" in d.collect().received and "p1" in p.collect().released, timeout=2.0)
    assert d.results.failed == {"d1"}


def test_an_abandoned_write_that_cannot_be_released_is_quarantined(pair: tuple[Side, Side]) -> None:
    """G2: a WRITE past write_timeout_s whose cancel is refused frees nothing before the hold deadline."""
    p, d = pair
    p.backend.polls_before_done, p.backend.refuse_releases = 10**9, -1
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    register(p, d)
    wait_for(lambda: "d1" in d.collect().failed, timeout=FAST.write_timeout_s + 2)
    assert "d1" not in d.results.received
    counters = p.collect().counters
    assert counters["expired"] >= 1 and counters["quarantined"] == 1


def test_a_link_reset_while_both_live_fails_decode_at_once_but_keeps_its_blocks(pair: tuple[Side, Side]) -> None:
    """G2/G3: a closed side channel is not proof that prefill died: fail now, free at the hold deadline."""
    p, d = pair
    register(p, d)
    wait_for(lambda: bool(p.thread._prefill.entries))
    CHANNEL.reset(p.thread.side_port)  # both processes live; only the links go
    t0 = time.monotonic()
    wait_for(lambda: "d1" in d.collect().failed, timeout=2.0)
    assert time.monotonic() - t0 < 1.5
    assert "d1" not in d.results.received, "blocks freed on link loss"
    wait_for(lambda: "d1" in d.collect().received, timeout=FAST.kv_timeout_s + 2)


def test_decode_registering_more_blocks_than_prefill_holds_is_refused(pair: tuple[Side, Side]) -> None:
    """G9: no silent tail write; decode fails the request, prefill writes nothing."""
    p, d = pair
    p.thread.submit(PrefillFinished("p1", "t:1", (1,)))
    register(p, d, blocks=(5, 6))
    wait_for(lambda: "d1" in d.collect().failed and "p1" in p.collect().released)
    assert p.results.records == [] and p.results.counters["mismatch"] == 1
    assert d.block(6) == bytes(2 * BLOCK_LEN)


def test_decode_aborted_before_allocation_cancels_and_prefill_frees_at_once(pair: tuple[Side, Side]) -> None:
    """G5: P holds the finished blocks only until decode's Cancel, not for its whole lease."""
    p, d = pair
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    wait_for(lambda: bool(p.thread._prefill.entries))
    peer = PeerAddress("P", "127.0.0.1", p.thread.side_port)
    d.thread.submit(CancelUnallocated("d1", "t:1", peer))
    wait_for(lambda: "p1" in p.collect().released, timeout=FAST.lease_s / 2)
    assert d.collect().received == set(), "vLLM holds nothing for it: nothing to report"


def test_a_lost_peer_agent_is_removed_once_no_write_to_it_is_in_flight(pair: tuple[Side, Side]) -> None:
    """G8: the agent of a decode whose link went is removed, but only after its WRITE ended."""
    p, d = pair
    p.backend.polls_before_done = 60
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    register(p, d)
    wait_for(lambda: bool(p.thread._writes))
    d.thread.close()
    wait_for(lambda: "agent-D" in p.backend.removed, timeout=3.0)
    assert p.backend.in_flight_to("agent-D") == 0


def test_a_restarted_prefill_under_the_same_engine_id_is_reloaded(pair: tuple[Side, Side]) -> None:
    """G8: the new incarnation's metadata replaces the old; the old agent is removed."""
    p, d = pair
    register(p, d)
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    wait_for(lambda: "d1" in d.collect().received)
    p.thread.close()
    wait_for(lambda: "agent-P" in d.backend.removed, timeout=3.0)
    p2 = make_side(d.backend.fabric, "P", seed=2)  # same engine id and agent name, new incarnation
    try:
        register(p2, d, req="d2", key="t:2")
        p2.thread.submit(PrefillFinished("p2", "t:2", (3, 4)))
        wait_for(lambda: "d2" in d.collect().received)
        assert "d2" not in d.results.failed
        assert d.block(5) == p2.block(3)
    finally:
        p2.thread.close()


# ---- issue 8 item 2: the owner thread sleeps until there is work -----------------------------


def test_the_owner_thread_does_not_spin_while_blocks_wait_for_a_registration(pair: tuple[Side, Side]) -> None:
    """G7: held blocks awaiting a registration are no reason to wake (the old loop woke every 1 ms)."""
    p, _ = pair
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    wait_for(lambda: p.thread._prefill.live == 1)
    before = p.thread.wakes
    time.sleep(0.5)
    idle_wakes = p.thread.wakes - before
    assert idle_wakes <= 0.5 / OPTIONS.polling.idle_wait_s + 3, idle_wakes


def test_a_kick_wakes_a_prefill_once_a_decode_dialled_it(pair: tuple[Side, Side]) -> None:
    """G7: a registration may reach a prefill in any notice, so every step hook wakes it, in flight or not."""
    p, d = pair
    register(p, d)
    wait_for(lambda: p.thread._prefill.live == 1)  # D dialled P, its registration arrived
    time.sleep(0.05)
    before = p.thread.wakes
    for _ in range(5):
        p.thread.kick()
        time.sleep(0.01)
    assert p.thread.wakes - before >= 3


def test_an_idle_decode_ignores_the_step_hooks_kicks(pair: tuple[Side, Side]) -> None:
    """G7, issue 41: with nothing in flight a decode expects no notice, so the engine's kicks (one per step) do
    not wake its owner thread (each wake-up a context switch and a GIL hand-off taken from the step); a receive
    in flight makes it poll again."""
    p, d = pair
    register(p, d)
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    wait_for(lambda: "d1" in d.collect().received and d.thread._decode.live == 0)
    time.sleep(0.05)  # a turn after the last one that had something in flight
    before = d.thread.wakes
    for _ in range(20):
        d.thread.kick()
        time.sleep(0.002)
    assert d.thread.wakes - before <= 2, "at most the idle tick (0.1 s) and a deadline, not one wake per kick"
    register(p, d, req="d2", key="t:2", blocks=(3, 4))  # in flight again: its Done is still taken at once
    p.thread.submit(PrefillFinished("p2", "t:2", (3, 4)))
    wait_for(lambda: "d2" in d.collect().received)


def test_a_new_receive_keeps_the_pace_of_a_poll_already_running() -> None:
    """G7, issue 41: a receive in flight starts decode's poll at write_poll_min_s; another one registered while
    it runs does not restart it (its Done comes after its prefill, so the restart's burst of wake-ups, each taken
    from the engine's step, found nothing)."""
    slow = Options(
        timeouts=FAST,
        polling=Polling(write_poll_min_s=0.02, write_poll_max_s=0.2, idle_wait_s=1.0),
        liveness=OPTIONS.liveness,
    )
    fabric = MemoryFabric()
    p, d = make_side(fabric, "P", seed=1, options=slow), make_side(fabric, "D", seed=None, options=slow)
    try:
        register(p, d)
        wait_for(lambda: d.thread._decode.live == 1)
        time.sleep(0.5)  # the poll reached its slowest pace (0.2 s)
        before = d.thread.wakes
        register(p, d, req="d2", key="t:2", blocks=(3, 4))
        time.sleep(0.15)
        assert d.thread._decode.live == 2
        # a restart wakes at +0, 0.02, 0.06 and 0.14 s; the running pace at +0 and at most one timer
        assert d.thread.wakes - before <= 2
    finally:
        d.thread.close()
        p.thread.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"poll_s": 0.001}, "unknown kv_connector_extra_config key(s) ['poll_s']"),
        ({"write_timeout_s": 50}, "write_timeout_s < write_grace_s"),
        ({"write_poll_min_s": "fast"}, "bad kv_connector_extra_config"),
        ({"progressive": "yes"}, "progressive must be true or false"),
        ({"progressive": True, "early_write": False}, "progressive push needs early_write"),
    ],
)
def test_extra_config_refuses_unknown_keys_and_bad_values(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Options.from_extra(extra)


def test_extra_config_sets_every_group() -> None:
    o = Options.from_extra({"lease_s": 7, "write_poll_max_s": 0.002, "dead_after_s": 2, "backends": ["UCX"]})
    assert (o.timeouts.lease_s, o.polling.write_poll_max_s, o.liveness.dead_after_s) == (7, 0.002, 2)
    assert o.polling == Polling(write_poll_max_s=0.002)
    assert Options.from_extra({"progressive": True}).progressive is True
    assert Options.from_extra({}).progressive is True, "on by default (G14)"
    assert Options.from_extra({"early_write": False}).progressive is False, "off with early_write unless asked for"


# ---- issue 21 item 3: decode's notice handling never waits for the idle tick -----------------


def test_decode_takes_its_done_without_waiting_for_the_idle_tick() -> None:
    """With a receive in flight D's owner thread polls (0.2 -> 5 ms), so the Done is seen at once even
    though its idle safety net is 30 s and nothing kicks it (before: one idle tick per transfer)."""
    slow_idle = Options(
        timeouts=Timeouts(lease_s=60, kv_timeout_s=120, write_grace_s=10, write_timeout_s=5, connect_timeout_s=5),
        polling=Polling(idle_wait_s=30.0),
        liveness=OPTIONS.liveness,
    )
    fabric = MemoryFabric()
    p, d = make_side(fabric, "P", seed=1, options=slow_idle), make_side(fabric, "D", seed=None, options=slow_idle)
    try:
        register(p, d)
        wait_for(lambda: bool(p.backend.inbox) or p.thread._prefill.live == 1)  # the registration reached P
        p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))  # P wakes for it and finds the registration
        wait_for(lambda: "d1" in d.collect().received, timeout=10.0)
        assert not d.results.failed and sha(d.block(5) + d.block(6)) == sha(p.block(1) + p.block(2))
    finally:
        d.thread.close()
        p.thread.close()


@pytest.mark.parametrize(
    ("extra", "host", "model", "delay"),
    [
        ({}, "127.0.0.1", "poll", None),
        ({}, "::1", "poll", None),
        ({}, "localhost", "poll", None),
        ({}, "10.231.0.2", "thread", 1000),
        ({}, "decode-0.pool.svc", "thread", 1000),
        ({"progress": "poll"}, "10.231.0.2", "poll", None),
        ({"progress": "thread"}, "127.0.0.1", "thread", 1000),
        ({"progress": "thread", "progress_delay_us": 200}, "10.0.0.1", "thread", 200),
    ],
)
def test_the_progress_model_is_an_option_and_auto_follows_the_side_channels_address(
    extra: dict[str, object], host: str, model: str, delay: int | None
) -> None:
    o = Options.from_extra(extra)
    assert (o.progress_model(host), o.progress_thread_delay_us(host)) == (model, delay)


@pytest.mark.parametrize(
    ("extra", "message"),
    [({"progress": "busy"}, "progress must be one of ['auto', 'poll', 'thread']"), ({"progress_delay_us": 0}, "spin")],
)
def test_a_bad_progress_model_is_refused(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Options.from_extra(extra)


def test_the_default_write_timeout_outlasts_the_slowest_presets_transfer() -> None:
    """issue 21: the stack's slowest preset (25g-like, prefill-scaled) moves a 16 MiB prompt in 4.7 s
    (research turn3-netem, about four prefills); the defaults leave that WRITE a 6x margin, and D's hold
    deadline leaves P time to start it after a long queue."""
    t = Options.from_extra({}).timeouts
    assert t.write_timeout_s >= 6 * 4.7
    assert t.kv_timeout_s - t.write_grace_s >= 60


def test_a_shorter_kv_timeout_scales_the_write_windows_it_did_not_set() -> None:
    """A bed or deployment that sets only kv_timeout_s (the fault matrix: 30 s) is not refused for the longer
    WRITE defaults it never set: the windows keep their proportions; what is given is kept and checked."""
    t = Options.from_extra({"kv_timeout_s": 30}).timeouts
    assert (t.kv_timeout_s, t.write_grace_s, t.write_timeout_s) == (30, 10, 7.5)
    assert Options.from_extra({}).timeouts == Timeouts()
    given = Options.from_extra({"kv_timeout_s": 30, "write_timeout_s": 2}).timeouts
    assert (given.write_grace_s, given.write_timeout_s) == (10, 2)
    with pytest.raises(ValueError, match=re.escape("write_grace_s < kv_timeout_s")):
        Options.from_extra({"kv_timeout_s": 30, "write_grace_s": 40})


def test_decode_loads_prefill_for_notices_only_and_prefill_loads_decode_to_write(pair: tuple[Side, Side]) -> None:
    """Descriptors at scale: decode never WRITEs, so it prepares no list for prefill's blocks."""
    p, d = pair
    register(p, d)
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    wait_for(lambda: "d1" in d.collect().received)
    assert not d.backend.peers["agent-P"].writable and p.backend.peers["agent-D"].writable
    with pytest.raises(TransferError, match="notices-only"):
        d.backend.write("agent-P", (1,), (1,), b"")
