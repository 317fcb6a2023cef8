"""Selection policies: least-loaded decode, least-prefill-tokens prefill, fair tie-breaking, registry."""

from __future__ import annotations

from collections import Counter

import pytest

from router.domain import Endpoint, RequestInfo, WorkerView
from router.errors import ConfigError
from router.policy import REGISTRY, LeastInFlight, LeastLoaded, LeastPrefillTokens, RoundRobin, make_policy

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
