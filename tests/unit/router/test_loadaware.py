"""The load-aware policy: scoring from in-flight and engine load, unknown load, KV pressure, fair ties."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import pytest

from router.domain import Endpoint, RequestInfo, WorkerView
from router.loadaware import LoadAware

REQ = RequestInfo(endpoint=Endpoint.CHAT, stream=True, prompt_tokens=1000)


@dataclass(frozen=True)
class View:
    id: str
    in_flight: int = 0
    engine_running: int = 0
    engine_waiting: int = 0
    kv_usage: float = 0.0
    load_known: bool = True


def pick(*views: View) -> str:
    return LoadAware().select(views, REQ).id


def test_engine_waiting_outweighs_a_request_in_flight() -> None:
    assert (
        pick(View("a", in_flight=1, engine_running=1, engine_waiting=3), View("b", in_flight=3, engine_running=3))
        == "b"
    )


def test_engine_running_counts_other_routers_requests() -> None:
    assert pick(View("a", in_flight=0, engine_running=12), View("b", in_flight=2, engine_running=2)) == "b"


def test_our_own_burst_counts_before_the_next_scrape_shows_it() -> None:
    assert pick(View("a", in_flight=5, engine_running=0), View("b", in_flight=1, engine_running=1)) == "b"


def test_kv_usage_breaks_otherwise_equal_loads() -> None:
    assert pick(View("a", in_flight=1, kv_usage=0.8), View("b", in_flight=1, kv_usage=0.3)) == "b"


def test_a_nearly_full_kv_cache_is_avoided_while_any_other_worker_has_room() -> None:
    assert pick(View("full", kv_usage=0.97), View("busy", in_flight=20, engine_running=20, kv_usage=0.6)) == "busy"


def test_unknown_load_scores_by_in_flight_only() -> None:
    policy = LoadAware()
    assert policy.score(View("u", in_flight=2, engine_waiting=50, kv_usage=0.99, load_known=False)) == 2.0
    assert pick(View("u", in_flight=2, load_known=False), View("k", in_flight=1, engine_waiting=1)) == "u"


def test_scores_are_weighted_as_documented() -> None:
    policy = LoadAware(waiting_weight=3.0, kv_weight=10.0)
    assert policy.score(View("a", in_flight=1, engine_running=4, engine_waiting=2, kv_usage=0.5)) == 4 + 6 + 5


def test_equal_scores_take_turns() -> None:
    policy = LoadAware()
    views = [
        View("a", kv_usage=0.1 + 0.2),
        View("b", kv_usage=0.3),
        View("c", in_flight=0, load_known=False, kv_usage=0.3),
    ]
    picks = Counter(policy.select(views[:2], REQ).id for _ in range(100))
    assert picks == {"a": 50, "b": 50}  # 0.1 + 0.2 and 0.3 differ only by float noise


def test_the_policy_reads_the_routers_worker_view() -> None:
    names = {f.name for f in dataclasses.fields(WorkerView)}
    if not {"engine_running", "engine_waiting", "kv_usage", "load_known"} <= names:
        pytest.skip("router.domain.WorkerView has no engine-load fields yet")
    quiet = WorkerView(id="q", in_flight=1, outstanding_tokens=0, engine_running=1, load_known=True)  # type: ignore[call-arg,unused-ignore]
    queued = WorkerView(id="w", in_flight=1, outstanding_tokens=0, engine_running=1, engine_waiting=4, load_known=True)  # type: ignore[call-arg,unused-ignore]
    assert LoadAware().select([queued, quiet], REQ).id == "q"
