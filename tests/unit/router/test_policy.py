"""Selection policies: least-loaded decode, least-prefill-tokens prefill, load-aware scoring, fair tie-breaking,
the registry and the options its factories take from configuration."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from router.domain import Endpoint, RequestInfo, WorkerView
from router.errors import ConfigError
from router.policy import (
    REGISTRY,
    LeastInFlight,
    LeastLoaded,
    LeastPrefillTokens,
    LoadAware,
    RoundRobin,
    make_policy,
)

REQ = RequestInfo(endpoint=Endpoint.COMPLETIONS, stream=True, prompt_tokens=100)


def views(*loads: tuple[int, int]) -> list[WorkerView]:
    return [WorkerView(id=f"w{i}", in_flight=f, outstanding_tokens=t) for i, (f, t) in enumerate(loads)]


def test_least_loaded_prefers_fewest_in_flight_then_fewest_tokens() -> None:
    assert LeastLoaded().select(views((2, 0), (1, 900), (1, 100)), REQ).id == "w2"


def test_least_prefill_tokens_prefers_fewest_tokens_then_fewest_requests() -> None:
    assert LeastPrefillTokens().select(views((0, 500), (3, 100), (1, 100)), REQ).id == "w2"


def test_least_in_flight_ignores_tokens() -> None:
    assert LeastInFlight().select(views((1, 0), (0, 10_000)), REQ).id == "w1"


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_ties_are_shared_in_turn(name: str) -> None:
    policy = make_policy(name)
    picks = Counter(policy.select(views((0, 0), (0, 0), (0, 0)), REQ).id for _ in range(300))
    assert picks == {"w0": 100, "w1": 100, "w2": 100}


def test_round_robin_cycles() -> None:
    rr = RoundRobin()
    assert [rr.select(views((5, 5), (0, 0)), REQ).id for _ in range(4)] == ["w0", "w1", "w0", "w1"]


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="least-loaded"):
        make_policy("fastest")


def test_every_policy_is_made_from_the_registry_with_no_options() -> None:
    assert {type(make_policy(name)).__name__ for name in REGISTRY} == {
        "RoundRobin",
        "LeastInFlight",
        "LeastLoaded",
        "LeastPrefillTokens",
        "LoadAware",
    }


def test_load_aware_takes_its_weights_from_options() -> None:
    policy = make_policy("load-aware", {"waiting_weight": "3", "kv_weight": 10, "kv_high": 0.9})
    assert isinstance(policy, LoadAware)
    assert (policy.waiting_weight, policy.kv_weight, policy.kv_high, policy.kv_full_penalty) == (3.0, 10.0, 0.9, 1000.0)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("load-aware", {"running_weight": 1}, r"policy load-aware: unknown option\(s\) \['running_weight'\]; its opt"),
        ("load-aware", {"kv_high": 1.5}, r"policy load-aware: kv_high: must be a finite number in \[0, 1"),
        ("load-aware", {"kv_weight": -1}, "kv_weight"),
        ("load-aware", {"waiting_weight": True}, "expected a number"),
        ("round-robin", {"weight": 2}, "policy round-robin: unknown option.*it takes no options"),
    ],
)
def test_bad_policy_options_are_refused(name: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_policy(name, options)


# ------------------------------------------------------------------------------------------------- load-aware


def load(
    wid: str, in_flight: int = 0, running: int = 0, waiting: int = 0, kv: float = 0.0, known: bool = True
) -> WorkerView:
    return WorkerView(
        id=wid,
        in_flight=in_flight,
        outstanding_tokens=0,
        engine_running=running,
        engine_waiting=waiting,
        kv_usage=kv,
        load_known=known,
    )


def pick(*candidates: WorkerView) -> str:
    return LoadAware().select(candidates, REQ).id


def test_engine_waiting_outweighs_a_request_in_flight() -> None:
    assert pick(load("a", in_flight=1, running=1, waiting=3), load("b", in_flight=3, running=3)) == "b"


def test_engine_running_counts_other_routers_requests() -> None:
    assert pick(load("a", in_flight=0, running=12), load("b", in_flight=2, running=2)) == "b"


def test_our_own_burst_counts_before_the_next_scrape_shows_it() -> None:
    assert pick(load("a", in_flight=5, running=0), load("b", in_flight=1, running=1)) == "b"


def test_kv_usage_breaks_otherwise_equal_loads() -> None:
    assert pick(load("a", in_flight=1, kv=0.8), load("b", in_flight=1, kv=0.3)) == "b"


def test_a_nearly_full_kv_cache_is_avoided_while_any_other_worker_has_room() -> None:
    assert pick(load("full", kv=0.97), load("busy", in_flight=20, running=20, kv=0.6)) == "busy"


def test_unknown_load_scores_by_in_flight_only() -> None:
    assert LoadAware().score(load("u", in_flight=2, waiting=50, kv=0.99, known=False)) == 2.0
    assert pick(load("u", in_flight=2, known=False), load("k", in_flight=1, waiting=1)) == "u"


def test_scores_are_weighted_as_documented() -> None:
    policy = LoadAware(waiting_weight=3.0, kv_weight=10.0)
    assert policy.score(load("a", in_flight=1, running=4, waiting=2, kv=0.5)) == 4 + 6 + 5


def test_equal_scores_take_turns_despite_float_noise() -> None:
    policy = LoadAware()
    picks = Counter(policy.select([load("a", kv=0.1 + 0.2), load("b", kv=0.3)], REQ).id for _ in range(100))
    assert picks == {"a": 50, "b": 50}  # 0.1 + 0.2 and 0.3 differ only by float noise
