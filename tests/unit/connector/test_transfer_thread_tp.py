"""N prefill ranks and M decode ranks as transfer threads in one process (issue 20): the TP wiring.

Every rank is a ``TransferThread`` with its own ``MemoryBackend`` agent, its own side-channel port (rank-0 port
+ rank, ``connector.parallel.ranks.rank_port``) and its ``RankInfo``. The KV of a made-up model (4 KV heads of 16 bytes
per block, 2 layer regions) is split by head as vLLM does; a D rank's blocks must end up holding exactly its
heads of the prefill's blocks. ``Engine`` plays vLLM's part across ranks: a request is finished when every rank
reported it received, failed when any rank did, and (as the scheduler half does with the workers' failures) a
failure on one rank is turned into a cancel on every other rank. G-numbers are connector/README.md's.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from connector.options import Options
from connector.orders import CancelOrder
from connector.parallel.topology import heads_of, plan
from connector.rendezvous.actions import Timeouts
from connector.transfer.base import WriteTicket
from connector.transfer.memory import MemoryBackend, MemoryFabric
from connector.transfer_thread import Results, TransferThread
from connector.wire.metadata import KVLayout, PeerAddress, RankId, RankInfo, Region
from connector.wire.plan import PrefillFinished, RegisterOrder
from connector.wire.side_channel import Liveness
from tests.unit.connector.side_channel_fake import LoopbackSideChannel

HEADS, HEAD_BYTES, BLOCKS, REGIONS = 4, 16, 8, 2
FAST = Timeouts(lease_s=2, kv_timeout_s=3, write_grace_s=1, write_timeout_s=0.5, connect_timeout_s=2)
OPTIONS = Options(timeouts=FAST, liveness=Liveness(heartbeat_s=0.2, dead_after_s=0.8))
CHANNEL = LoopbackSideChannel()
_PORTS = itertools.count(52000, 10)
P_BLOCKS, D_BLOCKS = (1, 2), (5, 6)


@dataclass
class Rank:
    thread: TransferThread
    backend: MemoryBackend
    kv: list[np.ndarray]  # per region: [BLOCKS, heads of this rank, HEAD_BYTES]
    results: Results = field(default_factory=Results)
    reports: Counter[str] = field(default_factory=Counter)  # how often each id was reported released or received

    def collect(self) -> Results:
        new = self.thread.collect_results()
        self.reports.update([*new.released, *new.received])
        self.results.merge(new)
        return self.results


def make_engine(
    fabric: MemoryFabric, name: str, tp: int, model: np.ndarray | None, pp: int = 1, kv_heads: int = HEADS
) -> list[Rank]:
    """``model``: the whole KV [REGIONS, BLOCKS, kv_heads, HEAD_BYTES] (prefill) or None (decode: zeros). ``pp`` 2:
    stage s holds layer (region) s; ranks in (stage, tp) order, rank (s, t) on port0 + s x tp + t. With
    ``tp > kv_heads`` each rank holds one head, replicated over ``tp / kv_heads`` ranks (as vLLM does)."""
    port0 = next(_PORTS)
    ranks = []
    for s, r in itertools.product(range(pp), range(tp)):
        heads = heads_of(r, tp, kv_heads)
        layers = range(REGIONS) if pp == 1 else range(s, s + 1)
        kv = [
            np.ascontiguousarray(model[g][:, list(heads)])
            if model is not None
            else np.zeros((BLOCKS, len(heads), HEAD_BYTES), np.uint8)
            for g in layers
        ]
        layout = KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, len(heads) * HEAD_BYTES, BLOCKS) for a in kv))
        info = RankInfo(tp, pp, RankId(s, r), kv_heads, heads, HEAD_BYTES, (layers[0], layers[-1] + 1))
        backend = MemoryBackend(fabric, f"agent-{name}-{s}-{r}", layout)
        thread = TransferThread(
            backend,
            engine_id=name,
            layout=layout,
            compat_hash="c1",
            side_host="127.0.0.1",
            side_port=port0 + s * tp + r,
            options=OPTIONS,
            side_channel=CHANNEL,
            rank=info,
        )
        thread.start()
        ranks.append(Rank(thread, backend, kv))
    return ranks


@dataclass
class Engine:
    """vLLM across one engine's ranks (the output aggregator and the scheduler half's cross-rank cancel)."""

    ranks: list[Rank]
    cancelled: bool = False

    def step(self, request_id: str) -> None:
        for rank in self.ranks:
            rank.collect()
        if not self.cancelled and any(request_id in r.results.failed for r in self.ranks):
            self.cancelled = True  # the scheduler half's plan: a cancel reaches every rank
            for rank in self.ranks:
                rank.thread.submit(CancelOrder(request_id))

    def finished(self, request_id: str) -> bool:
        self.step(request_id)
        return all(request_id in r.results.received for r in self.ranks)

    def failed(self, request_id: str) -> bool:
        self.step(request_id)
        return any(request_id in r.results.failed for r in self.ranks)

    def released(self, request_id: str) -> bool:
        self.step(request_id)
        return all(request_id in r.results.released for r in self.ranks)


def wait_for(cond: Callable[[], bool], timeout: float = 8.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


@pytest.fixture
def model() -> np.ndarray:
    return np.random.default_rng(7).integers(1, 256, (REGIONS, BLOCKS, HEADS, HEAD_BYTES), dtype=np.uint8)


@pytest.fixture
def engines(request: pytest.FixtureRequest, model: np.ndarray) -> Iterator[tuple[Engine, Engine]]:
    p_tp, d_tp = request.param
    fabric = MemoryFabric()
    p, d = Engine(make_engine(fabric, "P", p_tp, model)), Engine(make_engine(fabric, "D", d_tp, None))
    yield p, d
    for rank in d.ranks + p.ranks:
        rank.thread.close()


def start(p: Engine, d: Engine, req: str = "d1", key: str = "t:1") -> None:
    peer = PeerAddress("P", "127.0.0.1", p.ranks[0].thread.side_port, tp_size=len(p.ranks))
    for rank in p.ranks:  # vLLM's step plan reaches every rank
        rank.thread.submit(PrefillFinished("p1", key, P_BLOCKS, 32))
    for rank in d.ranks:
        rank.thread.submit(RegisterOrder(req, key, peer, D_BLOCKS, 32))


def heads_landed(d: Engine, model: np.ndarray) -> bool:
    for r, rank in enumerate(d.ranks):
        heads = list(heads_of(r, len(d.ranks), model.shape[2]))
        for g in range(REGIONS):
            if not np.array_equal(rank.kv[g][list(D_BLOCKS)], model[g][list(P_BLOCKS)][:, heads]):
                return False
            untouched = [b for b in range(BLOCKS) if b not in D_BLOCKS]
            if rank.kv[g][untouched].any():
                return False
    return True


def nothing_in_flight_to(p: Engine, d: Engine) -> bool:
    return all(pr.backend.in_flight_to(dr.backend.agent_name) == 0 for pr in p.ranks for dr in d.ranks)


PAIRS = [(n, m) for n in (1, 2, 4) for m in (1, 2, 4)]


@pytest.mark.parametrize("engines", PAIRS, indirect=True, ids=[f"P{n}-D{m}" for n, m in PAIRS])
def test_every_tp_pair_moves_each_d_ranks_heads(engines: tuple[Engine, Engine], model: np.ndarray) -> None:
    p, d = engines
    start(p, d)
    wait_for(lambda: d.finished("d1") and p.released("p1"))
    assert not d.failed("d1")
    assert heads_landed(d, model)  # every byte of each D rank's heads, nothing else
    legs = len(plan(p_tp=len(p.ranks), d_tp=len(d.ranks), num_kv_heads=HEADS, head_bytes=HEAD_BYTES, num_layers=1).legs)
    assert sum(len(r.results.records) for r in p.ranks) == legs  # one WRITE per leg (P_tp < D_tp: fan-out)


@pytest.mark.parametrize("engines", [(2, 2), (2, 1), (4, 2), (4, 1), (1, 2), (1, 4), (2, 4)], indirect=True, ids=str)
def test_a_failing_write_on_one_p_rank_fails_the_request_on_every_d_rank(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    p.ranks[0].backend.fail_writes = True
    start(p, d)
    wait_for(lambda: d.finished("d1") and p.released("p1"))
    assert d.failed("d1")
    assert nothing_in_flight_to(p, d)  # freed on every D rank only once no leg can land (G2)
    assert all(r.thread._decode.live == 0 for r in d.ranks)  # quiescent


@pytest.mark.parametrize("engines", [(2, 2), (4, 2), (2, 1), (1, 2), (1, 4), (2, 4)], indirect=True, ids=str)
def test_a_d_rank_whose_handshake_fails_fails_the_request_on_every_rank(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    d.ranks[-1].thread._compat_hash = "other"  # its payload no longer matches: P refuses the handshake
    start(p, d)
    wait_for(lambda: d.finished("d1") and p.released("p1"))
    assert d.failed("d1") and "d1" in d.ranks[-1].results.failed
    assert nothing_in_flight_to(p, d)
    assert all(r.thread._decode.live == 0 for r in d.ranks)


@pytest.mark.parametrize("engines", [(2, 2), (2, 1), (4, 2), (1, 2), (2, 4)], indirect=True, ids=str)
def test_a_killed_p_rank_fails_the_request_and_blocks_are_freed_only_when_nothing_can_land(
    engines: tuple[Engine, Engine],
) -> None:
    p, d = engines
    peer = PeerAddress("P", "127.0.0.1", p.ranks[0].thread.side_port, tp_size=len(p.ranks))
    for rank in d.ranks:
        rank.thread.submit(RegisterOrder("d1", "t:1", peer, D_BLOCKS, 32))
    wait_for(lambda: all(r.thread._prefill.entries for r in p.ranks))  # every leg registered
    p.ranks[-1].thread.close()  # a P rank dies: its links drop like a process exit
    for rank in p.ranks[:-1]:
        rank.thread.submit(PrefillFinished("p1", "t:1", P_BLOCKS, 32))
    wait_for(lambda: d.failed("d1"), timeout=2.0)  # failed at once (link lost), not at the deadline
    wait_for(lambda: d.finished("d1"))  # freed at the hold deadline: the dead rank's WRITE could still land
    assert nothing_in_flight_to(p, d)
    assert all(r.thread._decode.live == 0 for r in d.ranks)


@pytest.mark.parametrize("engines", [(2, 2)], indirect=True, ids=str)
def test_request_counters_come_from_the_leader_rank_only(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    start(p, d)
    wait_for(lambda: d.finished("d1") and p.released("p1"))
    time.sleep(0.05)
    d.finished("d1")
    p.released("p1")
    assert [r.results.counters["received"] for r in d.ranks] == [1, 0]  # request-level: the leader rank only
    assert [r.results.counters["writes_posted"] for r in p.ranks] == [1, 1]  # per-WRITE series: every rank


@pytest.mark.parametrize("engines", [(2, 1)], indirect=True, ids=str)
def test_a_decode_leg_that_misstates_the_prefills_tp_is_refused_not_half_received(
    engines: tuple[Engine, Engine], model: np.ndarray
) -> None:
    """A router configured with tp 1 for a TP=2 prefill: D would take P rank 0's half of the heads for the whole
    KV. The handshake refuses it (the payload states tp_size 2), so the request fails and nothing is written."""
    p, d = engines
    wrong = PeerAddress("P", "127.0.0.1", p.ranks[0].thread.side_port, tp_size=1)
    for rank in p.ranks:
        rank.thread.submit(PrefillFinished("p1", "t:1", P_BLOCKS, 32))
    d.ranks[0].thread.submit(RegisterOrder("d1", "t:1", wrong, D_BLOCKS, 32))
    wait_for(lambda: d.finished("d1"))
    assert d.failed("d1")
    assert not any(r.results.records for r in p.ranks) and not d.ranks[0].kv[0].any()


@pytest.mark.parametrize("engines", [(1, 2), (2, 4)], indirect=True, ids=str)
def test_a_lost_d_rank_ends_its_leg_and_p_releases_once_the_other_legs_ended(
    engines: tuple[Engine, Engine], model: np.ndarray
) -> None:
    """P_tp < D_tp: a D rank dies after registering; the P rank serving it drops that leg (its link is gone),
    still writes its other D rank and releases its blocks once, after that leg, never writing the dead rank."""
    p, d = engines
    peer = PeerAddress("P", "127.0.0.1", p.ranks[0].thread.side_port, tp_size=len(p.ranks))
    for rank in d.ranks:
        rank.thread.submit(RegisterOrder("d1", "t:1", peer, D_BLOCKS, 32))
    wait_for(lambda: all(r.thread._prefill.live == len(d.ranks) // len(p.ranks) for r in p.ranks))
    dead = d.ranks[-1]
    dead.thread.close()  # its links drop like a process exit
    wait_for(lambda: p.ranks[-1].thread._prefill.live == len(d.ranks) // len(p.ranks) - 1)  # that leg is over
    for rank in p.ranks:
        rank.thread.submit(PrefillFinished("p1", "t:1", P_BLOCKS, 32))
    wait_for(lambda: p.released("p1"))
    assert all(r.results.released == {"p1"} for r in p.ranks)
    assert not dead.kv[0].any() and not dead.kv[1].any(), "nothing was written into the dead rank"
    alive = d.ranks[0]
    wait_for(lambda: "d1" in alive.collect().received)
    assert "d1" not in alive.results.failed


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 2), (2, 1), (1, 2)], ids=str)
def test_a_pp_prefill_writes_each_stage_s_layers_and_decode_waits_for_every_stage(
    model: np.ndarray, p_tp: int, d_tp: int
) -> None:
    """PP 2 prefill (stage s holds layer s) with any TP pair: each D rank has one leg per stage, is received only
    after both stages' Done, and ends holding exactly its heads of every layer."""
    fabric = MemoryFabric()
    p = Engine(make_engine(fabric, "P", p_tp, model, pp=2))
    d = Engine(make_engine(fabric, "D", d_tp, None))
    try:
        peer = PeerAddress("P", "127.0.0.1", p.ranks[0].thread.side_port, tp_size=p_tp, pp_size=2)
        for rank in p.ranks:
            rank.thread.submit(PrefillFinished("p1", "t:1", P_BLOCKS, 32))
        for rank in d.ranks:
            rank.thread.submit(RegisterOrder("d1", "t:1", peer, D_BLOCKS, 32))
        wait_for(lambda: d.finished("d1") and p.released("p1"))
        assert not d.failed("d1")
        assert heads_landed(d, model)
        legs = len(plan(p_tp=p_tp, d_tp=d_tp, num_kv_heads=HEADS, head_bytes=HEAD_BYTES, num_layers=2, p_pp=2).legs)
        assert sum(len(r.results.records) for r in p.ranks) == legs  # one WRITE per (stage, leg)
    finally:
        for rank in d.ranks + p.ranks:
            rank.thread.close()


def test_a_failing_stage_fails_the_request_and_frees_only_when_no_stage_can_land(model: np.ndarray) -> None:
    fabric = MemoryFabric()
    p = Engine(make_engine(fabric, "P", 1, model, pp=2))
    d = Engine(make_engine(fabric, "D", 1, None))
    try:
        p.ranks[1].backend.fail_writes = True  # stage 1's WRITE fails
        peer = PeerAddress("P", "127.0.0.1", p.ranks[0].thread.side_port, tp_size=1, pp_size=2)
        for rank in p.ranks:
            rank.thread.submit(PrefillFinished("p1", "t:1", P_BLOCKS, 32))
        d.ranks[0].thread.submit(RegisterOrder("d1", "t:1", peer, D_BLOCKS, 32))
        wait_for(lambda: d.finished("d1") and p.released("p1"))
        assert d.failed("d1")
        assert nothing_in_flight_to(p, d)
        assert d.ranks[0].thread._decode.live == 0
    finally:
        for rank in d.ranks + p.ranks:
            rank.thread.close()


# (KV heads, P tp, D tp) with tp > KV heads on at least one side: every path (equal TP, P_tp > D_tp with idle
# replicas, P_tp < D_tp fan-out to every D rank holding a copy)
REPLICATED = [(2, 4, 4), (2, 4, 2), (2, 4, 1), (2, 2, 4), (2, 1, 4), (1, 2, 2), (1, 2, 1), (1, 1, 2), (1, 4, 4)]


def spy_writes(p: Engine, d: Engine) -> list[tuple[int, int, int]]:
    """Every WRITE P's ranks post, as (P rank, D rank, bytes): the transfer threads' own backend seam, observed."""
    d_rank = {rank.backend.agent_name: i for i, rank in enumerate(d.ranks)}
    posted: list[tuple[int, int, int]] = []
    for i, rank in enumerate(p.ranks):
        real = rank.backend.write

        def write(agent: str, *args: object, _i: int = i, _real: Callable[..., WriteTicket] = real) -> WriteTicket:
            ticket = _real(agent, *args)
            posted.append((_i, d_rank[agent], ticket.num_bytes))
            return ticket

        rank.backend.write = write  # type: ignore[method-assign,assignment]
    return posted


@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"), REPLICATED, ids=[f"H{h}-P{p}-D{d}" for h, p, d in REPLICATED])
def test_a_replicated_kv_head_is_written_once_into_every_d_rank_that_holds_a_copy(
    kv_heads: int, p_tp: int, d_tp: int
) -> None:
    """tp > num_kv_heads: each D rank gets each of its heads exactly once, from the one P rank the topology picks
    among the head's holders (never a second copy from another holder), bytes equal to P's; every P rank
    reports its blocks released once, including a replica no D rank registered with (at its lease), and every
    D rank reports the request received once."""
    model = np.random.default_rng(11).integers(1, 256, (REGIONS, BLOCKS, kv_heads, HEAD_BYTES), dtype=np.uint8)
    fabric = MemoryFabric()
    p = Engine(make_engine(fabric, "P", p_tp, model, kv_heads=kv_heads))
    d = Engine(make_engine(fabric, "D", d_tp, None, kv_heads=kv_heads))
    posted = spy_writes(p, d)
    try:
        start(p, d)
        wait_for(lambda: d.finished("d1") and p.released("p1"))
        assert not d.failed("d1")
        assert heads_landed(d, model)  # every D rank holds its (replicated) heads of P's blocks, nothing else
        topology = plan(p_tp=p_tp, d_tp=d_tp, num_kv_heads=kv_heads, head_bytes=HEAD_BYTES, num_layers=1)
        assert sorted((src, dst) for src, dst, _ in posted) == sorted((leg.src.tp, leg.dst) for leg in topology.legs)
        for r in range(d_tp):  # one copy of each of its heads, in every block of every layer
            expected = len(heads_of(r, d_tp, kv_heads)) * HEAD_BYTES * len(D_BLOCKS) * REGIONS
            assert sum(n for _, dst, n in posted if dst == r) == expected
        wait_for(lambda: all(rank.thread._prefill.live == 0 for rank in p.ranks))
        for engine in (p, d):
            engine.step("d1")
        assert [rank.reports["p1"] for rank in p.ranks] == [1] * p_tp
        assert [rank.reports["d1"] for rank in d.ranks] == [1] * d_tp
        assert nothing_in_flight_to(p, d)
    finally:
        for rank in d.ranks + p.ranks:
            rank.thread.close()
