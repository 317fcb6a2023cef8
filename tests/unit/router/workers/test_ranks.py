"""router/workers/ranks.py: rank identities (`<engine_id>_dp<r>`, side port base + r), the rank chooser (even under
uniform load, least-loaded by legs and scraped load), learned identities per rank, and per-rank ejection."""

from __future__ import annotations

from collections import Counter

import pytest

from router.domain import ConnectorKind, EngineLoad, NixlIdentity
from router.workers.health import HealthPolicy
from router.workers.ranks import (
    RANK_HEADER,
    NoUsableRank,
    RankHealth,
    RankPick,
    RankSet,
    RankState,
    rank_headers,
    rank_identity,
    split_rank,
    stated_rank,
)

BASE = NixlIdentity(engine_id="prefill-0", host="10.0.0.5", port=5600)
POLICY = HealthPolicy(eject_after=3, base_backoff=1.0, max_backoff=8.0)


# --- identities ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1, 7])
def test_a_rank_s_identity_is_the_suffixed_engine_id_on_the_base_port_plus_the_rank(rank: int) -> None:
    got = rank_identity(BASE, rank, 8)
    assert got == NixlIdentity(engine_id=f"prefill-0_dp{rank}", host="10.0.0.5", port=5600 + rank)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_kvpush_dp_engines_start_tp_times_pp_ports_apart_and_upstream_ones_one_apart(tp: int, pp: int) -> None:
    """kvpush's connector runs a side channel per worker rank: DP engine r's rank (0, 0) is at base + r x TP x PP
    (connector.kvcache.side_channel_port); upstream's runs one per DP engine, at base + r."""
    ours = NixlIdentity("p0", "h", 5600, tp_size=tp, pp_size=pp, connector=ConnectorKind.KVPUSH)
    theirs = NixlIdentity("p0", "h", 5600, tp_size=tp, pp_size=pp)
    assert [rank_identity(ours, r, 3).port for r in range(3)] == [5600 + r * tp * pp for r in range(3)]
    assert [rank_identity(theirs, r, 3).port for r in range(3)] == [5600, 5601, 5602]
    assert rank_identity(ours, 2, 3).engine_id == "p0_dp2"


def test_a_server_without_data_parallelism_is_its_base_identity() -> None:
    assert rank_identity(BASE, 0, 1) is BASE


@pytest.mark.parametrize(("rank", "size"), [(-1, 2), (2, 2), (0, 0), (0, 1025)])
def test_a_rank_outside_the_server_is_refused(rank: int, size: int) -> None:
    with pytest.raises(ValueError):
        rank_identity(BASE, rank, size)


@pytest.mark.parametrize(
    ("engine_id", "split"),
    [
        ("p_dp0", ("p", 0)),
        ("p_dp12", ("p", 12)),
        ("a_dp1_dp3", ("a_dp1", 3)),
        ("p", ("p", None)),
        ("p_dp", ("p_dp", None)),
        ("p_dp01", ("p_dp01", None)),  # vLLM never writes a leading zero
        ("_dp1", ("_dp1", None)),  # no server id before the suffix
        ("p_dpx", ("p_dpx", None)),
        ("p_dp12345", ("p_dp12345", None)),
    ],
)
def test_split_rank(engine_id: str, split: tuple[str, int | None]) -> None:
    assert split_rank(engine_id) == split


def test_stated_rank_and_the_pinning_header() -> None:
    assert stated_rank(rank_identity(BASE, 3, 4)) == 3
    assert stated_rank(BASE) is None
    assert rank_headers(2) == {RANK_HEADER: "2"}
    assert rank_headers(None) == {}
    assert RANK_HEADER == "x-data-parallel-rank"


def test_configured_identities_are_derived_per_rank() -> None:
    ranks = RankSet(2, POLICY, configured=BASE)
    assert [ranks.identity(r) for r in (0, 1)] == [rank_identity(BASE, 0, 2), rank_identity(BASE, 1, 2)]
    with pytest.raises(ValueError):
        ranks.identity(2)


def test_a_configured_engine_id_that_already_names_a_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="already names a rank"):
        RankSet(2, POLICY, configured=rank_identity(BASE, 1, 2))
    RankSet(1, POLICY, configured=NixlIdentity("odd_dp1", "h", 1))  # without DP the id is the engine's own


def test_learned_identities_are_kept_per_rank() -> None:
    ranks = RankSet(2, POLICY)
    assert ranks.identity(0) is None and ranks.identity(1) is None
    assert ranks.learn(rank_identity(BASE, 1, 2), pinned=1) is None
    assert ranks.identity(0) is None
    assert ranks.identity(1) == rank_identity(BASE, 1, 2)
    assert ranks.learn(rank_identity(BASE, 0, 2), pinned=0) is None
    assert ranks.identity(0) == rank_identity(BASE, 0, 2)
    ranks.forget()
    assert ranks.identity(0) is None and ranks.identity(1) is None


@pytest.mark.parametrize("pinned", [0, None])
def test_an_answer_for_another_rank_than_the_pinned_one_is_not_learned(pinned: int | None) -> None:
    ranks = RankSet(2, POLICY)
    why = ranks.learn(rank_identity(BASE, 1, 2), pinned=pinned)
    assert why is not None and "X-data-parallel-rank" in why
    assert ranks.identity(0) is None and ranks.identity(1) is None


def test_an_unsuffixed_answer_from_a_dp_server_is_not_learned() -> None:
    ranks = RankSet(2, POLICY)
    assert ranks.learn(BASE, pinned=0) is not None
    assert ranks.identity(0) is None


def test_without_data_parallelism_the_stated_identity_is_learned_as_rank_0() -> None:
    ranks = RankSet(1, POLICY)
    assert ranks.learn(BASE, pinned=None) is None
    assert ranks.identity(0) == BASE


def test_a_rank_suffix_from_a_server_configured_without_dp_is_a_misconfiguration() -> None:
    ranks = RankSet(1, POLICY)
    why = ranks.learn(rank_identity(BASE, 1, 2), pinned=None)
    assert why is not None and "data-parallel size 1" in why
    assert ranks.identity(0) is None


# --- choice ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pick", list(RankPick))
@pytest.mark.parametrize("size", [2, 3, 4])
def test_uniform_load_spreads_evenly_over_the_ranks(pick: RankPick, size: int) -> None:
    """Each leg ends before the next starts (uniform load): every rank gets the same share."""
    ranks = RankSet(size, POLICY)
    counts: Counter[int] = Counter()
    for _ in range(size * 50):
        rank = ranks.choose(0.0, pick)
        with ranks.track(rank):
            counts[rank] += 1
    assert counts == {r: 50 for r in range(size)}


def test_concurrent_legs_spread_evenly_with_least_loaded() -> None:
    ranks = RankSet(2, POLICY)
    held = []
    for _ in range(10):
        rank = ranks.choose(0.0, RankPick.LEAST_LOADED)
        cm = ranks.track(rank)
        cm.__enter__()
        held.append((rank, cm))
    assert Counter(r for r, _ in held) == {0: 5, 1: 5}
    assert [v.in_flight for v in ranks.views(0.0)] == [5, 5]
    for _, cm in held:
        cm.__exit__(None, None, None)
    assert [v.in_flight for v in ranks.views(0.0)] == [0, 0]


def test_least_loaded_counts_the_scraped_load_of_each_rank() -> None:
    ranks = RankSet(3, POLICY)
    ranks.set_loads({0: EngineLoad(4, 2, 0.5), 1: EngineLoad(0, 0, 0.0), 2: EngineLoad(1, 0, 0.1)})
    assert ranks.choose(0.0, RankPick.LEAST_LOADED) == 1
    with ranks.track(1), ranks.track(1):
        assert ranks.choose(0.0, RankPick.LEAST_LOADED) == 2  # 1 + 0 < 0 + 2
    views = ranks.views(0.0)
    assert [v.load_known for v in views] == [True, True, True]
    assert views[0].load == 6


def test_loads_for_ranks_the_server_does_not_have_are_dropped_and_none_forgets() -> None:
    ranks = RankSet(2, POLICY)
    ranks.set_loads({0: EngineLoad(1, 0, 0.0), 5: EngineLoad(9, 9, 1.0)})
    assert [v.load_known for v in ranks.views(0.0)] == [True, False]
    ranks.set_loads(None)
    assert [v.load_known for v in ranks.views(0.0)] == [False, False]


def test_round_robin_ignores_load() -> None:
    ranks = RankSet(2, POLICY)
    ranks.set_loads({0: EngineLoad(100, 100, 1.0)})
    assert [ranks.choose(0.0, RankPick.ROUND_ROBIN) for _ in range(4)] == [0, 1, 0, 1]


# --- per-rank ejection -----------------------------------------------------------------------------------------


def test_a_hard_failure_ejects_that_rank_alone_and_choice_skips_it() -> None:
    ranks = RankSet(2, POLICY)
    assert ranks.report(1, 10.0, ok=False, hard=True) is True
    assert [v.usable for v in ranks.views(10.0)] == [True, False]
    assert {ranks.choose(10.0, pick) for pick in RankPick for _ in range(3)} == {0}
    assert ranks.has_usable(10.0)


def test_every_rank_held_out_leaves_no_usable_rank_until_the_backoff_ends() -> None:
    ranks = RankSet(2, POLICY)
    ranks.report(0, 0.0, ok=False, hard=True)
    ranks.report(1, 0.0, ok=False, hard=True)
    assert not ranks.has_usable(0.5)
    with pytest.raises(NoUsableRank):
        ranks.choose(0.5, RankPick.ROUND_ROBIN)
    assert ranks.has_usable(1.0)  # base_backoff 1 s


def test_soft_failures_eject_after_eject_after_in_a_row_and_a_success_resets() -> None:
    ranks = RankSet(2, POLICY)
    assert ranks.report(0, 0.0, ok=False) is False
    assert ranks.report(0, 0.0, ok=False) is False
    ranks.report(0, 0.0, ok=True)
    assert ranks.report(0, 0.0, ok=False) is False
    assert ranks.report(0, 0.0, ok=False) is False
    assert ranks.report(0, 0.0, ok=False) is True


class TestRankHealth:
    def test_the_hold_doubles_per_ejection_in_a_row_up_to_the_maximum(self) -> None:
        health = RankHealth(POLICY)
        now, holds = 0.0, []
        for _ in range(6):
            assert health.on_failed(now, hard=True) is True
            holds.append(health.held_until - now)
            assert not health.usable(now)
            now = health.held_until
            assert health.usable(now)  # back on trust once the hold ends
        assert holds == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]

    def test_a_success_resets_the_backoff(self) -> None:
        health = RankHealth(POLICY)
        health.on_failed(0.0, hard=True)
        health.on_failed(1.0, hard=True)
        assert health.held_until == 3.0
        health.on_ok()
        assert health.state is RankState.UP
        health.on_failed(5.0, hard=True)
        assert health.held_until == 6.0

    def test_failures_while_held_do_not_count(self) -> None:
        health = RankHealth(POLICY)
        health.on_failed(0.0, hard=True)
        assert health.on_failed(0.5, hard=True) is False
        assert health.held_until == 1.0 and health.failures == 0

    def test_every_state_and_event(self) -> None:
        """UP and HELD × ok, soft failure, hard failure, time passing."""
        for start_held in (False, True):
            for event in ("ok", "soft", "hard", "time"):
                health = RankHealth(POLICY)
                if start_held:
                    health.on_failed(0.0, hard=True)
                now = 0.5
                if event == "ok":
                    health.on_ok()
                    assert health.usable(now)
                elif event == "time":
                    assert health.usable(5.0) is True
                elif event == "soft":
                    assert health.on_failed(now, hard=False) is False
                    assert health.usable(now) is not start_held
                else:
                    assert health.on_failed(now, hard=True) is (not start_held)
                    assert not health.usable(now)


def test_track_releases_the_count_when_the_leg_raises() -> None:
    ranks = RankSet(2, POLICY)
    with pytest.raises(RuntimeError), ranks.track(1):
        raise RuntimeError("leg failed")
    assert [v.in_flight for v in ranks.views(0.0)] == [0, 0]
    with pytest.raises(ValueError):
        ranks.report(2, 0.0, ok=True)
