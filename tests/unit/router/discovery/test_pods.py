"""Pod membership decisions: readiness, deletion, annotations, lists, and watch events applied in order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.discovery.base import specs_from_addresses
from router.discovery.pods import (
    BadPod,
    Members,
    WatchEvent,
    WatchFailed,
    WatchGone,
    apply_event,
    members_from_list,
    parse_event,
    pod_member,
)
from router.domain import NixlIdentity, Role, WorkerSpec


def pod(
    name: str,
    ip: str | None = "10.1.0.1",
    *,
    ready: bool = True,
    deleting: bool = False,
    annotations: dict[str, str] | None = None,
    rv: str = "7",
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "llm", "resourceVersion": rv, "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T16:00:00Z"
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"kind": "Pod", "metadata": meta, "status": status}


def d(ip: str, port: int = 8000) -> WorkerSpec:
    return WorkerSpec(f"http://{ip}:{port}", Role.DECODE)


def test_a_ready_pod_with_an_ip_is_a_member_on_the_default_port() -> None:
    assert pod_member(pod("a"), Role.DECODE, 8000) == d("10.1.0.1")


@pytest.mark.parametrize(
    "p",
    [
        pod("a", ready=False),
        pod("a", ip=None),
        pod("a", deleting=True),
        {"metadata": {"name": "a"}, "status": {"podIP": "10.1.0.1"}},  # no conditions yet
        {"metadata": {"name": "a"}},
    ],
)
def test_pods_that_are_not_ready_have_no_ip_or_are_leaving_are_not_members(p: dict[str, Any]) -> None:
    assert pod_member(p, Role.DECODE, 8000) is None


def test_the_port_annotation_wins_and_ipv6_is_bracketed() -> None:
    assert pod_member(pod("a", "fd00::5", annotations={"kvpush.io/port": "9000"}), Role.DECODE, 8000) == WorkerSpec(
        "http://[fd00::5]:9000", Role.DECODE
    )


def test_prefill_identity_comes_from_annotations_with_the_pod_ip_as_side_host() -> None:
    ann = {"kvpush.io/engine-id": "p-7", "kvpush.io/side-port": "5600", "kvpush.io/tp": "2"}
    spec = pod_member(pod("p", "10.2.0.9", annotations=ann), Role.PREFILL, 8100)
    assert spec == WorkerSpec("http://10.2.0.9:8100", Role.PREFILL, NixlIdentity("p-7", "10.2.0.9", 5600, 2, 1))


def test_the_dp_size_annotation_declares_a_server_s_ranks() -> None:
    ann = {"kvpush.io/engine-id": "p-7", "kvpush.io/side-port": "5600", "kvpush.io/dp-size": "4"}
    spec = pod_member(pod("p", "10.2.0.9", annotations=ann), Role.PREFILL, 8100)
    assert spec is not None and spec.dp_size == 4 and spec.identity == NixlIdentity("p-7", "10.2.0.9", 5600)
    decode = pod_member(pod("d", annotations={"kvpush.io/dp-size": "2"}), Role.DECODE, 8000)
    assert decode is not None and decode.dp_size == 2


def test_prefill_without_identity_annotations_is_learned_and_decode_ignores_them() -> None:
    assert pod_member(pod("p"), Role.PREFILL, 8100) == WorkerSpec("http://10.1.0.1:8100", Role.PREFILL)
    ann = {"kvpush.io/engine-id": "x", "kvpush.io/side-port": "5600"}
    assert pod_member(pod("d", annotations=ann), Role.DECODE, 8000) == d("10.1.0.1")


@pytest.mark.parametrize(
    ("ann", "message"),
    [
        ({"kvpush.io/port": "http"}, "not an integer"),
        ({"kvpush.io/port": "70000"}, "out of range"),
        ({"kvpush.io/engine-id": "p0"}, "go together"),
        ({"kvpush.io/side-port": "5600"}, "go together"),
        ({"kvpush.io/engine-id": "p0", "kvpush.io/side-port": "5600", "kvpush.io/tp": "0"}, "out of range"),
        ({"kvpush.io/dp-size": "0"}, "out of range"),
        ({"kvpush.io/dp-size": "two"}, "not an integer"),
    ],
)
def test_bad_annotations_are_reported(ann: dict[str, str], message: str) -> None:
    with pytest.raises(BadPod, match=message):
        pod_member(pod("p", annotations=ann), Role.PREFILL, 8100)


def test_a_list_gives_the_ready_members_their_problems_and_the_resource_version() -> None:
    pods = {
        "kind": "PodList",
        "metadata": {"resourceVersion": "100"},
        "items": [
            pod("b", "10.1.0.2"),
            pod("a", "10.1.0.1"),
            pod("c", "10.1.0.3", ready=False),
            pod("e", "10.1.0.5", annotations={"kvpush.io/port": "x"}),
        ],
    }
    members, rv = members_from_list(pods, Role.DECODE, 8000)
    assert rv == "100"
    assert members.specs() == [d("10.1.0.1"), d("10.1.0.2")]
    assert len(members.problems) == 1 and "pod e" in members.problems[0]


@pytest.mark.parametrize(
    "bad",
    [{"items": []}, {"metadata": {"resourceVersion": "1"}}, {"metadata": {"resourceVersion": "1"}, "items": ["a-pod"]}],
)
def test_something_that_is_not_a_pod_list_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(WatchFailed):
        members_from_list(bad, Role.DECODE, 8000)


def ev(kind: str, obj: dict[str, Any]) -> WatchEvent:
    return WatchEvent(kind, obj)


def test_events_move_membership_through_readiness_flips_ip_changes_and_deletions() -> None:
    m = Members()
    steps: list[tuple[WatchEvent, list[WorkerSpec]]] = [
        (ev("ADDED", pod("a", "10.1.0.1", ready=False, rv="11")), []),
        (ev("MODIFIED", pod("a", "10.1.0.1", rv="12")), [d("10.1.0.1")]),
        (ev("ADDED", pod("b", "10.1.0.2", rv="13")), [d("10.1.0.1"), d("10.1.0.2")]),
        (ev("MODIFIED", pod("a", "10.1.0.1", ready=False, rv="14")), [d("10.1.0.2")]),
        (ev("MODIFIED", pod("a", "10.1.0.1", rv="15")), [d("10.1.0.1"), d("10.1.0.2")]),
        (ev("MODIFIED", pod("b", "10.1.0.9", rv="16")), [d("10.1.0.1"), d("10.1.0.9")]),
        (ev("MODIFIED", pod("b", "10.1.0.9", deleting=True, rv="17")), [d("10.1.0.1")]),
        (ev("DELETED", pod("b", "10.1.0.9", rv="18")), [d("10.1.0.1")]),
        (ev("DELETED", pod("a", "10.1.0.1", rv="19")), []),
    ]
    for event, expected in steps:
        m, rv = apply_event(m, event, Role.DECODE, 8000)
        assert m.specs() == expected, event
        assert rv == event.object["metadata"]["resourceVersion"]


def test_a_bookmark_only_moves_the_resource_version() -> None:
    m, _ = apply_event(Members(), ev("ADDED", pod("a")), Role.DECODE, 8000)
    after, rv = apply_event(
        m, ev("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "99"}}), Role.DECODE, 8000
    )
    assert (after, rv) == (m, "99")


def test_a_member_whose_annotations_turn_bad_leaves_with_a_problem() -> None:
    m, _ = apply_event(Members(), ev("ADDED", pod("a")), Role.DECODE, 8000)
    m, _ = apply_event(m, ev("MODIFIED", pod("a", annotations={"kvpush.io/port": "0"})), Role.DECODE, 8000)
    assert m.specs() == [] and "pod a" in m.problems[0]


def test_error_events_410_means_list_again_and_others_fail_the_watch() -> None:
    gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version: 1 (5)"}
    with pytest.raises(WatchGone, match="too old"):
        apply_event(Members(), ev("ERROR", gone), Role.DECODE, 8000)
    with pytest.raises(WatchFailed, match="500"):
        apply_event(Members(), ev("ERROR", {"kind": "Status", "code": 500}), Role.DECODE, 8000)


def test_watch_lines_are_parsed_and_garbage_is_refused() -> None:
    line = json.dumps({"type": "ADDED", "object": pod("a")}).encode()
    assert parse_event(line) == WatchEvent("ADDED", pod("a"))
    for bad in (b"{not json", b'{"type": "ADDED"}', b'{"type": "RENAMED", "object": {}}', b"[]"):
        with pytest.raises(WatchFailed):
            parse_event(bad)
    with pytest.raises(WatchFailed, match=r"metadata\.name"):
        apply_event(Members(), ev("ADDED", {"status": {}}), Role.DECODE, 8000)


def test_addresses_become_sorted_distinct_workers_with_ipv6_in_brackets() -> None:
    specs = specs_from_addresses(["10.0.0.10", "fd00::1", "10.0.0.9", "10.0.0.10"], Role.PREFILL, 8100)
    assert [s.url for s in specs] == ["http://10.0.0.9:8100", "http://10.0.0.10:8100", "http://[fd00::1]:8100"]
    assert all(s.role is Role.PREFILL and s.identity is None for s in specs)
    assert specs_from_addresses([], Role.DECODE, 1) == []
