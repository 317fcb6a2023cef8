"""Which publishers the subscriber follows: the pool's publishing members, planned against what it follows now."""

from __future__ import annotations

from router.domain import Role, WorkerSpec
from router.kv_events.membership import Plan, plan
from router.kv_events.settings import parse_kv_events

SETTINGS = parse_kv_events({"port_offset": 1000, "replay_offset": 2000, "roles": ["prefill", "decode"]})
P = WorkerSpec("http://h:8100", Role.PREFILL)
D = WorkerSpec("http://h:8200", Role.DECODE)
D2 = WorkerSpec("http://h:8300", Role.DECODE, dp_size=2)


def test_new_members_are_followed_every_rank() -> None:
    found = plan(SETTINGS, [P, D2], {})
    assert found.remove == () and found.refused == ()
    assert [(e.worker, e.rank, e.publisher) for e in found.add] == [
        ("http://h:8100", 0, "tcp://h:9100"),
        ("http://h:8300", 0, "tcp://h:9300"),
        ("http://h:8300", 1, "tcp://h:9301"),
    ]


def test_followed_members_are_left_alone_and_those_gone_dropped() -> None:
    following = {P.id: SETTINGS.endpoints(P.id, P.url), D.id: SETTINGS.endpoints(D.id, D.url)}
    assert plan(SETTINGS, [P, D], following) == Plan((), ())
    assert plan(SETTINGS, [P], following) == Plan((), (D.id,))


def test_a_worker_whose_ranks_changed_starts_over() -> None:
    following = {D2.id: SETTINGS.endpoints(D2.id, D2.url, 2)}
    fewer = WorkerSpec(D2.url, Role.DECODE, dp_size=1)
    found = plan(SETTINGS, [fewer], following)
    assert found.remove == (D2.id,) and [e.rank for e in found.add] == [0]


def test_only_the_configured_roles_publish_and_a_bad_url_is_refused() -> None:
    decode_only = parse_kv_events({"roles": ["decode"], "port_offset": 1000})
    assert [e.worker for e in plan(decode_only, [P, D], {}).add] == [D.id]
    high = WorkerSpec("http://h:65000", Role.DECODE)
    found = plan(SETTINGS, [high, D], {})
    assert [e.worker for e in found.add] == [D.id] and found.refused[0].startswith("http://h:65000: ")
