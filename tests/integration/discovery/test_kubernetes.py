"""Kubernetes discovery against a stand-in API server on loopback whose pods change while the source watches."""

from __future__ import annotations

import asyncio

import pytest

from router.discovery.build import build_source
from router.discovery.kubernetes import KubernetesSource
from router.discovery.settings import parse_discovery
from router.domain import NixlIdentity, Role
from tests.integration.discovery.kube_standin import TOKEN, KubeStandin, make_pod
from tests.integration.discovery.recording import RecordingSink, until

pytestmark = pytest.mark.integration

PREFILL = {"app": "vllm", "kvpush.io/role": "prefill"}
DECODE = {"app": "vllm", "kvpush.io/role": "decode"}


def source_for(kube: KubeStandin, errors: list[str], watch_timeout: int = 30) -> KubernetesSource:
    (cfg,) = parse_discovery(
        {
            "prefill": {
                "kubernetes": {
                    "namespace": "llm",
                    "selector": "app=vllm,kvpush.io/role=prefill",
                    "port": 8100,
                    "api_url": kube.url,
                    "token": TOKEN,
                    "watch_timeout": watch_timeout,
                    "request_timeout": 5,
                    "backoff_max": 0.5,
                }
            }
        }
    )
    source = build_source(cfg, on_error=lambda role, reason: errors.append(reason))
    assert isinstance(source, KubernetesSource)
    return source


async def test_membership_follows_readiness_deletion_recreation_and_a_relist_after_410(kube: KubeStandin) -> None:
    identity = {"kvpush.io/engine-id": "prefill-a", "kvpush.io/side-port": "5600", "kvpush.io/tp": "2"}
    await kube.apply(make_pod("a", "127.0.1.1", ready=True, labels=PREFILL, annotations=identity))
    await kube.apply(make_pod("b", "127.0.1.2", ready=False, labels=PREFILL))
    await kube.apply(make_pod("c", None, ready=False, labels=PREFILL))  # not scheduled yet
    await kube.apply(make_pod("x", "127.0.2.1", ready=True, labels=DECODE))  # another role: never selected
    errors: list[str] = []
    sink = RecordingSink()
    task = asyncio.create_task(source_for(kube, errors).run(sink))
    try:
        await until(lambda: sink.urls == ["http://127.0.1.1:8100"], "the one ready pod")
        assert sink.history[-1][1][0].identity == NixlIdentity("prefill-a", "127.0.1.1", 5600, 2, 1)

        await kube.apply(make_pod("b", "127.0.1.2", ready=True, labels=PREFILL))  # b becomes Ready
        await until(lambda: sink.urls == ["http://127.0.1.1:8100", "http://127.0.1.2:8100"], "b ready")

        await kube.delete("a")
        await until(lambda: sink.urls == ["http://127.0.1.2:8100"], "a deleted")

        await kube.delete("b")  # b comes back under the same name with a new IP (a StatefulSet pod)
        await kube.apply(make_pod("b", "127.0.1.9", ready=False, labels=PREFILL))
        await until(lambda: sink.urls == [], "b gone while its successor starts")
        await kube.apply(make_pod("b", "127.0.1.9", ready=True, labels=PREFILL))
        await until(lambda: sink.urls == ["http://127.0.1.9:8100"], "b back on its new IP")

        lists_before = sum(kind == "list" for kind, _ in kube.requests)
        await kube.apply(make_pod("c", "127.0.1.3", ready=True, labels=PREFILL))
        await kube.expire_watches()  # the watch ends before c's event went out; resuming gets 410
        await until(lambda: sink.urls == ["http://127.0.1.3:8100", "http://127.0.1.9:8100"], "c, seen by a re-list")
        assert sum(kind == "list" for kind, _ in kube.requests) == lists_before + 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert errors == []  # a 410 is routine, not a failure
    assert all(role is Role.PREFILL for role, _ in sink.history)
    watches = [q for kind, q in kube.requests if kind == "watch"]
    assert all(q["labelSelector"] == "app=vllm,kvpush.io/role=prefill" and q["timeoutSeconds"] == "30" for q in watches)
    assert all(a != b for a, b in zip(sink.seen(), sink.seen()[1:], strict=False))  # published on change only


async def test_watches_that_time_out_resume_and_an_unreachable_api_keeps_the_members(kube: KubeStandin) -> None:
    await kube.apply(make_pod("a", "127.0.1.1", ready=True, labels=PREFILL))
    errors: list[str] = []
    sink = RecordingSink()
    task = asyncio.create_task(source_for(kube, errors, watch_timeout=1).run(sink))
    try:
        await until(lambda: sink.urls == ["http://127.0.1.1:8100"], "the first member")
        await until(lambda: sum(kind == "watch" for kind, _ in kube.requests) >= 2, "a second watch after timeout")
        assert sum(kind == "list" for kind, _ in kube.requests) == 1  # resumed from the bookmark, no re-list
        await kube.apply(make_pod("b", "127.0.1.2", ready=True, labels=PREFILL))
        await until(lambda: len(sink.urls or []) == 2, "b through the resumed watch")

        await kube.stop()  # the API goes away: the watch breaks, LISTs are refused
        await until(lambda: len(errors) >= 2, "failures to be counted")
        assert sink.urls == ["http://127.0.1.1:8100", "http://127.0.1.2:8100"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [] not in sink.seen()
